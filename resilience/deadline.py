"""Deadlines over an async stream (an engine request's output deltas). Three timers, the earliest wins:

- stall: the next item has not come for `stall_timeout_s` AND the producer (`alive_at`: the engine
  loop's last step) made no progress for as long: the loop is stalled -> `StallDetected`, a failure.
  An item late while the producer is busy with other work is queued, not stalled: the wait goes on.
- first item: none by `first_item_deadline` (a time on the clock; queue time included when the
  caller counts it from the request's arrival) -> `DeadlineExceeded("first_token")`: too slow, not
  broken; the caller moves the request to another model. (`StallDetected` instead when the producer
  has made no progress for the stall timeout by then.)
- total: nothing after `total_deadline` (the request's own budget) -> `DeadlineExceeded("total")`.

`Deadlines.next(iterator)` awaits the iterator's next item in the caller's own task: no task per item
and no wrapping generator. The timers are one loop callback per stream; when one is due it cancels
that wait (as `asyncio.timeout` does), so an engine stream sees CancelledError at its await and aborts
its request, freeing its KV blocks. The stream's owner closes it on every other way out, and `close`s
the Deadlines.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from resilience.clock import Clock
from resilience.errors import DeadlineExceeded

T = TypeVar("T")

DEFAULT_STALL_TIMEOUT_S = 10.0


class StallDetected(DeadlineExceeded):
    """The producer made no progress at all for the stall timeout: the model failed, it is not slow."""


class Deadlines:
    """The timers of one stream. `total_deadline` and `first_item_deadline` are times on `clock`
    (absolute, not durations); `alive_at` returns when the producer last made progress of any kind."""

    def __init__(
        self,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        total_deadline: float | None = None,
        *,
        first_item_deadline: float | None = None,
        clock: Clock = time.monotonic,
        alive_at: Callable[[], float] | None = None,
    ) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self.total_deadline = total_deadline
        self.first_item_deadline = first_item_deadline
        self.clock = clock
        self.alive_at = alive_at
        self.is_first = True  # no item yet
        # one timer for the whole stream, not one per item (a timer per streamed token cost the event
        # loop ~10 us each): armed by a wait, it lapses between waits and is re-armed when early
        self._handle: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task | None = None  # the task waiting for an item now
        self._wait_started = 0.0
        self._fired: DeadlineExceeded | None = None

    async def next(self, iterator: AsyncIterator[T]) -> T:
        """The iterator's next item (StopAsyncIteration at its end), or the deadline error of the timer
        that fired first. The iterator must let a cancellation through (as under asyncio.timeout)."""
        self._check_now()
        self._waiter, self._wait_started = asyncio.current_task(), self.clock()
        if self._handle is None:
            self._arm(self._wait_started + self.stall_timeout_s)
        try:
            item = await anext(iterator)
        except asyncio.CancelledError:
            fired, self._fired = self._fired, None
            if fired is not None and self._waiter.uncancel() == 0:  # our timer's cancel, nobody else's
                raise fired from None
            raise
        finally:
            self._waiter = None
        self.is_first = False
        return item

    def close(self) -> None:
        """Disarm the timer (the stream is done with); idempotent."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, stall_check_at: float) -> None:
        wait_s, _, at = self._next_timer(stall_check_at)
        self._handle = asyncio.get_running_loop().call_later(wait_s, self._on_timer, at)

    def _on_timer(self, armed_at: float) -> None:
        """The one timer came due. It may have been armed in an earlier wait, whose timers come due
        no sooner than this one's: between waits it lapses, and early it is armed again."""
        self._handle = None
        if self._waiter is None:  # between items: the next wait arms it
            return
        stall_check_at = self._wait_started + self.stall_timeout_s
        _, which, at = self._next_timer(stall_check_at)
        if armed_at < at:  # armed for an earlier wait
            self._arm(stall_check_at)
            return
        idle_s = self._producer_idle_s()
        error = self._expired(which, at - self._wait_started, idle_s)
        if error is None:  # the producer is busy: check again a stall timeout after its last step
            self._arm(self.clock() + self.stall_timeout_s - idle_s)
            return
        self._fired = error
        self._waiter.cancel()

    def _check_now(self) -> None:
        """Raise before waiting at all when a deadline has already passed."""
        now = self.clock()
        if self.total_deadline is not None and now >= self.total_deadline:
            raise DeadlineExceeded("total", 0.0)
        if self.is_first and self.first_item_deadline is not None and now >= self.first_item_deadline:
            raise DeadlineExceeded("first_token", 0.0)

    def _next_timer(self, stall_check_at: float) -> tuple[float, str, float]:
        """(seconds to wait, the timer that fires then, its time on the clock); ties go to the request's
        own budget first, then to the first-token deadline."""
        timers = [(stall_check_at, 2, "stall")]
        if self.total_deadline is not None:
            timers.append((self.total_deadline, 0, "total"))
        if self.is_first and self.first_item_deadline is not None:
            timers.append((self.first_item_deadline, 1, "first_token"))
        at, _, which = min(timers)
        return max(at - self.clock(), 0.0), which, at

    def _expired(self, which: str, waited_s: float, idle_s: float) -> DeadlineExceeded | None:
        """The error for the timer that came due, or None when the wait goes on (a busy producer, idle
        for `idle_s`)."""
        if which == "total":
            return DeadlineExceeded("total", waited_s)
        if which == "first_token":  # a producer silent all along is stalled, not slow
            is_stalled = self.alive_at is not None and idle_s >= self.stall_timeout_s
            return (StallDetected if is_stalled else DeadlineExceeded)("first_token", waited_s)
        if idle_s >= self.stall_timeout_s:
            return StallDetected("first_token" if self.is_first else "between_tokens", self.stall_timeout_s)
        return None

    def _producer_idle_s(self) -> float:
        return self.clock() - self.alive_at() if self.alive_at is not None else float("inf")
