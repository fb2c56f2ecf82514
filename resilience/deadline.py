"""Deadlines over an async stream (an engine request's output deltas). Three timers, the earliest wins:

- stall: the next item has not come for `stall_timeout_s` AND the producer (`alive_at`: the engine
  loop's last step) made no progress for as long: the loop is stalled -> `StallDetected`, a failure.
  An item late while the producer is busy with other work is queued, not stalled: the wait goes on.
- first item: none by `first_item_deadline` (a time on the clock; queue time included when the
  caller counts it from the request's arrival) -> `DeadlineExceeded("first_token")`: too slow, not
  broken; the caller moves the request to another model. (`StallDetected` instead when the producer
  has made no progress for the stall timeout by then.)
- total: nothing after `total_deadline` (the request's own budget) -> `DeadlineExceeded("total")`.

On a timeout the inner iterator is closed (`aclose`), so an engine stream sees GeneratorExit or
CancelledError and aborts its request, freeing its KV blocks.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from resilience.clock import Clock
from resilience.errors import DeadlineExceeded

T = TypeVar("T")

DEFAULT_STALL_TIMEOUT_S = 10.0


class StallDetected(DeadlineExceeded):
    """The producer made no progress at all for the stall timeout: the model failed, it is not slow."""


@dataclass
class _Timers:
    stall_timeout_s: float
    first_item_deadline: float | None
    total_deadline: float | None
    clock: Clock
    alive_at: Callable[[], float] | None

    def check_now(self, is_first: bool) -> None:
        """Raise before waiting at all when a deadline has already passed."""
        now = self.clock()
        if self.total_deadline is not None and now >= self.total_deadline:
            raise DeadlineExceeded("total", 0.0)
        if is_first and self.first_item_deadline is not None and now >= self.first_item_deadline:
            raise DeadlineExceeded("first_token", 0.0)

    def next(self, is_first: bool, stall_check_at: float) -> tuple[float, str, float]:
        """(seconds to wait, the timer that fires then, its time on the clock); ties go to the request's
        own budget first, then to the first-token deadline."""
        timers = [(stall_check_at, 2, "stall")]
        if self.total_deadline is not None:
            timers.append((self.total_deadline, 0, "total"))
        if is_first and self.first_item_deadline is not None:
            timers.append((self.first_item_deadline, 1, "first_token"))
        at, _, which = min(timers)
        return max(at - self.clock(), 0.0), which, at

    def producer_idle_s(self) -> float:
        return self.clock() - self.alive_at() if self.alive_at is not None else float("inf")


async def progress_deadline(source: AsyncIterable[T], stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                            total_deadline: float | None = None, *, first_item_deadline: float | None = None,
                            clock: Clock = time.monotonic,
                            alive_at: Callable[[], float] | None = None) -> AsyncIterator[T]:
    """Yield what `source` yields. `total_deadline` and `first_item_deadline` are times on `clock`
    (absolute, not durations); `alive_at` returns when the producer last made progress of any kind."""
    if not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
    timers = _Timers(stall_timeout_s, first_item_deadline, total_deadline, clock, alive_at)
    iterator = aiter(source)
    is_first = True
    try:
        while True:
            try:
                item = await _next_item(iterator, timers, is_first)
            except StopAsyncIteration:
                return
            yield item
            is_first = False
    finally:
        await _aclose(iterator)


async def _next_item(iterator: AsyncIterator[T], timers: _Timers, is_first: bool) -> T:
    timers.check_now(is_first)
    started = timers.clock()
    stall_check_at = started + timers.stall_timeout_s
    stage = "first_token" if is_first else "between_tokens"
    pending = asyncio.ensure_future(anext(iterator))
    try:
        while True:
            wait_s, which, at = timers.next(is_first, stall_check_at)
            done, _ = await asyncio.wait({pending}, timeout=wait_s)
            if done:
                return pending.result()
            if which == "total":
                raise DeadlineExceeded("total", at - started)
            idle_s = timers.producer_idle_s()
            if which == "first_token":  # a producer silent all along is stalled, not slow
                is_stalled = timers.alive_at is not None and idle_s >= timers.stall_timeout_s
                raise (StallDetected if is_stalled else DeadlineExceeded)("first_token", at - started)
            if idle_s >= timers.stall_timeout_s:
                raise StallDetected(stage, timers.stall_timeout_s)
            stall_check_at = timers.clock() + timers.stall_timeout_s - idle_s  # its last step + the timeout
    finally:
        if not pending.done():
            pending.cancel()  # the source sees CancelledError at its await: an engine aborts the request
            with contextlib.suppress(BaseException):
                await pending


async def _aclose(iterator: AsyncIterator[object]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
