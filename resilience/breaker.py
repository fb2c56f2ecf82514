"""One circuit breaker per model: pybreaker's state machine, with what it lacks added around it.

pybreaker holds the state and notifies listeners; this wrapper decides when it moves:
- it trips on a failure RATE over a sliding time window with a minimum volume, not on a
  consecutive count (pybreaker's `fail_max` is set out of reach);
- open -> half-open follows the injected clock (pybreaker's own timer reads wall time and only
  moves when a call arrives), and each failed probe lengthens the next open period
  (exponential, capped, jittered);
- half-open lets ONE probe in at a time; every other caller gets `BreakerOpenError` at once;
- client-caused outcomes (cancellation, disconnect, 4xx request errors) count as nothing:
  pybreaker would count them as successes that close a half-open breaker, so it never closes on
  its own (`success_threshold` out of reach) and the close is decided here.

    async with breaker.calling_async() as call:   # BreakerOpenError when refused
        async for out in progress_deadline(engine.generate(...), 10.0):
            ...                                    # DeadlineExceeded inside counts as a failure
"""

import asyncio
import contextlib
import logging
import random
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pybreaker

from resilience.clock import Clock
from resilience.errors import BreakerOpenError

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_STATE_NAMES = {pybreaker.STATE_CLOSED: CLOSED, pybreaker.STATE_OPEN: OPEN, pybreaker.STATE_HALF_OPEN: HALF_OPEN}
# what the client caused: a cancelled or dropped request, a request the engine rejects (ValueError
# family, e.g. engine.errors.RequestRejectedError). GeneratorExit: the consumer closed the stream.
IGNORED_EXCEPTIONS: tuple[type[BaseException], ...] = (
    asyncio.CancelledError, GeneratorExit, ConnectionResetError, BrokenPipeError, ValueError)
PROBE_RETRY_AFTER_S = 1.0  # hint for callers refused while a half-open probe is in flight

StateListener = Callable[[str, str, str], None]  # (model, old_state, new_state)


@dataclass(frozen=True)
class BreakerConfig:
    failure_rate_threshold: float = 0.5  # open when failed / finished calls >= this ...
    min_calls: int = 10  # ... and at least this many calls finished ...
    window_s: float = 30.0  # ... within the last window_s seconds
    open_s: float = 30.0  # first open period
    max_open_s: float = 300.0  # cap of the exponential backoff of the open period
    backoff_factor: float = 2.0  # each failed probe multiplies the open period by this
    jitter: float = 0.2  # the open period is drawn from [1 - jitter, 1] x its nominal value
    success_threshold: int = 1  # probe successes in a row that close a half-open breaker
    ignored: tuple[type[BaseException], ...] = IGNORED_EXCEPTIONS

    def __post_init__(self) -> None:
        if not 0 < self.failure_rate_threshold <= 1:
            raise ValueError(f"failure_rate_threshold must be in (0, 1], got {self.failure_rate_threshold}")
        for name in ("min_calls", "success_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("window_s", "open_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_open_s < self.open_s:
            raise ValueError(f"max_open_s must be >= open_s ({self.open_s}), got {self.max_open_s}")
        if self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be >= 1, got {self.backoff_factor}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")


@dataclass
class BreakerCall:
    """Handle on one admitted call. `mark_failed()` counts it as a failure even when no exception
    leaves the block (e.g. a first token later than the slow-call threshold)."""

    is_probe: bool
    is_marked_failed: bool = False

    def mark_failed(self) -> None:
        self.is_marked_failed = True


class _Relay(pybreaker.CircuitBreakerListener):
    """pybreaker listener that hands state changes to the ModelBreaker that owns it."""

    def __init__(self, on_change: Callable[[str, str], None]) -> None:
        self._on_change = on_change

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state: pybreaker.CircuitBreakerState | None,
                     new_state: pybreaker.CircuitBreakerState) -> None:
        old = _STATE_NAMES[old_state.name] if old_state is not None else CLOSED
        self._on_change(old, _STATE_NAMES[new_state.name])


class ModelBreaker:
    def __init__(self, model: str, config: BreakerConfig | None = None, *, clock: Clock,
                 rng: random.Random | None = None, listeners: Sequence[StateListener] = ()) -> None:
        self.model = model
        self.config = config or BreakerConfig()
        self._clock = clock
        self._rng = rng or random.Random()
        self._listeners = list(listeners)
        self._state = CLOSED  # mirror of pybreaker's, updated in its notification
        self._outcomes: deque[tuple[float, bool]] = deque()  # (finished at, failed), closed state only
        self._num_failures = 0  # failed entries in _outcomes
        self._opened_until = 0.0
        self._num_failed_probes = 0  # since the last close: the exponent of the open period
        self._num_probe_successes = 0
        self._is_probe_in_flight = False
        self._epoch = 0  # bumped on each state change; outcomes of calls from older epochs are dropped
        self._cb = pybreaker.CircuitBreaker(
            fail_max=sys.maxsize, reset_timeout=self.config.max_open_s, success_threshold=sys.maxsize,
            exclude=[self.is_ignored], listeners=[_Relay(self._on_state_change)], name=model,
            throw_new_error_on_trip=False)  # callers see the real error, never CircuitBreakerError

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def is_ignored(self, exc: BaseException) -> bool:
        return isinstance(exc, self.config.ignored)

    @property
    def state(self) -> str:
        """"closed" | "open" | "half_open", with the open period measured on the injected clock."""
        if self._state == OPEN and self._clock() >= self._opened_until:
            self._cb.half_open()
        return self._state

    def is_call_permitted(self) -> bool:
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._is_probe_in_flight)

    def retry_after_s(self) -> float:
        """Seconds until a call may be let in again (0 when one would be now)."""
        if self.is_call_permitted():
            return 0.0
        if self._state == OPEN:
            return self._opened_until - self._clock()
        return PROBE_RETRY_AFTER_S

    @contextlib.asynccontextmanager
    async def calling_async(self) -> AsyncIterator[BreakerCall]:
        """Admit one call (or raise BreakerOpenError at once) and count how it ends."""
        call = BreakerCall(is_probe=self._admit())
        epoch = self._epoch
        try:
            with self._cb.calling():  # pybreaker holds its lock only on entry: awaits inside are fine
                yield call
        except BaseException as exc:
            if not self.is_ignored(exc):
                self._on_outcome(epoch, call, failed=True)
            raise
        else:
            self._on_outcome(epoch, call, failed=call.is_marked_failed)
        finally:
            if call.is_probe:
                self._is_probe_in_flight = False

    def _admit(self) -> bool:
        """True when the admitted call is the half-open probe."""
        state = self.state
        if state == CLOSED:
            return False
        if state == HALF_OPEN and not self._is_probe_in_flight:
            self._is_probe_in_flight = True
            return True
        raise BreakerOpenError(self.model, state, self.retry_after_s())

    def _on_outcome(self, epoch: int, call: BreakerCall, failed: bool) -> None:
        if epoch != self._epoch:
            return  # began before a state change (e.g. admitted while closed, ended after the trip)
        if call.is_probe:
            self._on_probe_outcome(failed)
        else:
            self._record(failed)

    def _on_probe_outcome(self, failed: bool) -> None:
        if failed:  # a marked failure; a raised one has already reopened pybreaker
            self._cb.open()
            return
        self._num_probe_successes += 1
        if self._num_probe_successes >= self.config.success_threshold:
            self._cb.close()

    def _record(self, failed: bool) -> None:
        now = self._clock()
        self._outcomes.append((now, failed))
        self._num_failures += failed
        while self._outcomes[0][0] <= now - self.config.window_s:
            self._num_failures -= self._outcomes.popleft()[1]
        num_calls = len(self._outcomes)
        if num_calls >= self.config.min_calls and \
                self._num_failures >= self.config.failure_rate_threshold * num_calls:
            self._cb.open()

    def _open_period_s(self) -> float:
        exponent = min(self._num_failed_probes, 64)
        nominal = min(self.config.max_open_s, self.config.open_s * self.config.backoff_factor ** exponent)
        return nominal * self._rng.uniform(1 - self.config.jitter, 1)

    def _on_state_change(self, old: str, new: str) -> None:
        if old == new:
            return
        self._state = new
        self._epoch += 1
        why = self._enter(old, new)
        logger.warning("breaker %s: %s -> %s (%s)", self.model, old, new, why)
        for listener in self._listeners:
            try:
                listener(self.model, old, new)
            except Exception:
                logger.exception("breaker %s: state listener failed", self.model)

    def _enter(self, old: str, new: str) -> str:
        """Reset the bookkeeping of the state being entered; says why, for the log line."""
        if new == OPEN:
            why = "probe failed" if old == HALF_OPEN else \
                f"{self._num_failures} of {len(self._outcomes)} calls failed in {self.config.window_s:g} s"
            self._num_failed_probes = self._num_failed_probes + 1 if old == HALF_OPEN else 0
            period = self._open_period_s()
            self._opened_until = self._clock() + period
            return f"{why}; open for {period:.1f} s"
        self._outcomes.clear()
        self._num_failures = 0
        if new == HALF_OPEN:
            self._num_probe_successes = 0
            return "open period over; letting one probe through"
        self._num_failed_probes = 0
        return "probe succeeded"
