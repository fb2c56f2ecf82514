"""One circuit breaker per model: pybreaker's state machine drives it, and what pybreaker lacks is fed
to it instead of being kept beside it.

pybreaker holds the state (its state objects), trips on `fail_max` bad calls in a row, reopens on a
failed half-open probe, closes after `success_threshold` good probes, and tells its listeners.
Fed to it:
- a failure RATE and a slow-call RATE over a sliding time window with a minimum volume (resilience4j's
  failureRateThreshold and slowCallRateThreshold): when either is reached, `open()`;
- the injected clock: `_ClockStorage` keeps `opened_at` on it, so pybreaker's own open-period check
  (and `state`, which half-opens on time without waiting for a call) follows the clock tests advance;
- exponential open periods (capped, jittered): a state listener sets `reset_timeout` at each opening;
- one probe at a time in half-open (pybreaker lets every caller in): a gate here;
- outcomes pybreaker cannot classify. A call is reported to pybreaker when it ends, in a `calling()`
  block of its own: a slow call (first token past the deadline) as a failure (`SlowCallError`); a
  client-caused end (cancellation, disconnect, 4xx request error) not at all, since pybreaker would
  count an excluded error as a success and close a half-open breaker on a cancelled probe.

    async with breaker.calling_async() as call:   # BreakerOpenError when refused
        ...                                        # call.mark_slow() when the first token came late
"""

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pybreaker

from resilience.clock import Clock
from resilience.errors import BreakerOpenError

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_STATE_NAMES = {
    pybreaker.STATE_CLOSED: CLOSED,
    pybreaker.STATE_OPEN: OPEN,
    pybreaker.STATE_HALF_OPEN: HALF_OPEN,
}
# what the client caused: a cancelled or dropped request, a request the engine rejects (ValueError
# family, e.g. engine.errors.RequestRejectedError). GeneratorExit: the consumer closed the stream.
IGNORED_EXCEPTIONS: tuple[type[BaseException], ...] = (
    asyncio.CancelledError,
    GeneratorExit,
    ConnectionResetError,
    BrokenPipeError,
    ValueError,
)
PROBE_RETRY_AFTER_S = 1.0  # hint for callers refused while a half-open probe is in flight

StateListener = Callable[[str, str, str], None]  # (model, old_state, new_state)


class SlowCallError(Exception):
    """What pybreaker is told about a call that was slow and raised nothing the model is blamed for."""


@dataclass(frozen=True)
class BreakerConfig:
    failure_rate_threshold: float = 0.5  # open when failed / finished calls >= this ...
    slow_call_rate_threshold: float = 0.5  # ... or slow / finished calls >= this ...
    min_calls: int = 10  # ... with at least this many calls finished (also pybreaker's fail_max) ...
    window_s: float = 30.0  # ... within the last window_s seconds
    open_s: float = 30.0  # first open period
    max_open_s: float = 300.0  # cap of the exponential backoff of the open period
    backoff_factor: float = 2.0  # each failed probe multiplies the open period by this
    jitter: float = 0.2  # the open period is drawn from [1 - jitter, 1] x its nominal value
    success_threshold: int = 1  # probe successes in a row that close a half-open breaker
    ignored: tuple[type[BaseException], ...] = IGNORED_EXCEPTIONS

    def __post_init__(self) -> None:
        for name in ("failure_rate_threshold", "slow_call_rate_threshold"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
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


@dataclass(eq=False)
class BreakerCall:
    """Handle on one admitted call, and pybreaker's state object it was admitted in."""

    is_probe: bool
    admitted_in: pybreaker.CircuitBreakerState
    is_slow: bool = False
    is_excused: bool = False

    def mark_slow(self) -> None:
        """Its first token came after the slow-call threshold (or never did)."""
        self.is_slow = True

    def excuse(self) -> None:
        """The error that ends it is not the model's doing (e.g. the request's own deadline ran out,
        or it was moved on at the first-token deadline): only its slowness counts."""
        self.is_excused = True


class _ClockStorage(pybreaker.CircuitMemoryStorage):
    """pybreaker's memory storage with `opened_at` kept on the injected clock. pybreaker stamps it with
    `datetime.now(UTC)` and compares it with the same; this hands back the wall time lying as far in
    the past as the injected clock has moved since the stamp."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(pybreaker.STATE_CLOSED)
        self._clock = clock
        self.opened_at_s: float | None = None  # on the injected clock

    @property
    def opened_at(self) -> datetime | None:
        if self.opened_at_s is None:
            return None
        return datetime.now(UTC) - timedelta(seconds=self.seconds_open())

    @opened_at.setter
    def opened_at(self, _wall_time: datetime) -> None:
        self.opened_at_s = self._clock()

    def seconds_open(self) -> float:
        return 0.0 if self.opened_at_s is None else self._clock() - self.opened_at_s


class _Window:
    """Outcomes of the calls finished within the last `window_s` seconds (closed state only)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._outcomes: deque[tuple[float, bool, bool]] = deque()  # (finished at, failed, slow)
        self.num_failed = self.num_slow = 0

    def add(self, now: float, failed: bool, slow: bool) -> None:
        self._outcomes.append((now, failed, slow))
        self.num_failed += failed
        self.num_slow += slow
        while self._outcomes[0][0] <= now - self.window_s:
            _, old_failed, old_slow = self._outcomes.popleft()
            self.num_failed -= old_failed
            self.num_slow -= old_slow

    def is_tripped(self, config: BreakerConfig) -> bool:
        num_calls = len(self._outcomes)
        return num_calls >= config.min_calls and (
            self.num_failed >= config.failure_rate_threshold * num_calls
            or self.num_slow >= config.slow_call_rate_threshold * num_calls
        )

    def clear(self) -> None:
        self._outcomes.clear()
        self.num_failed = self.num_slow = 0

    def __str__(self) -> str:
        return f"{self.num_failed} failed and {self.num_slow} slow of {len(self._outcomes)} calls in {self.window_s:g} s"


class _Relay(pybreaker.CircuitBreakerListener):
    """pybreaker listener that hands state changes to the ModelBreaker that owns it."""

    def __init__(self, on_change: Callable[[str, str], None]) -> None:
        self._on_change = on_change

    def state_change(
        self,
        cb: pybreaker.CircuitBreaker,
        old_state: pybreaker.CircuitBreakerState | None,
        new_state: pybreaker.CircuitBreakerState,
    ) -> None:
        old = _STATE_NAMES[old_state.name] if old_state is not None else CLOSED
        self._on_change(old, _STATE_NAMES[new_state.name])


class ModelBreaker:
    def __init__(
        self,
        model: str,
        config: BreakerConfig | None = None,
        *,
        clock: Clock,
        rng: random.Random | None = None,
        listeners: Sequence[StateListener] = (),
    ) -> None:
        self.model = model
        self.config = config or BreakerConfig()
        self._clock = clock
        self._rng = rng or random.Random()
        self._listeners = list(listeners)
        self._window = _Window(self.config.window_s)
        self._probe: BreakerCall | None = None  # the half-open probe in flight
        self._num_failed_probes = 0  # since the last close: the exponent of the open period
        self.num_failed_calls = 0  # outcomes counted, for metrics
        self.num_slow_calls = 0
        self._storage = _ClockStorage(clock)
        # every error reported to it is a failure (the ignored ones are never reported), so no exclude;
        # throw_new_error_on_trip=False: the caller sees the engine's error, never CircuitBreakerError
        self._cb = pybreaker.CircuitBreaker(
            fail_max=self.config.min_calls,
            reset_timeout=self.config.open_s,
            success_threshold=self.config.success_threshold,
            listeners=[_Relay(self._on_state_change)],
            state_storage=self._storage,
            name=model,
            throw_new_error_on_trip=False,
        )

    @property
    def circuit(self) -> pybreaker.CircuitBreaker:
        """The pybreaker breaker that holds the state (add pybreaker listeners to it)."""
        return self._cb

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def is_ignored(self, exc: BaseException) -> bool:
        return isinstance(exc, self.config.ignored)

    @property
    def state(self) -> str:
        """ "closed" | "open" | "half_open". An open breaker whose period is over half-opens now, as
        pybreaker would at the next call, so health and metrics see it without waiting for one."""
        if self._cb.current_state == pybreaker.STATE_OPEN and self._open_left_s() <= 0:
            self._cb.half_open()
        return _STATE_NAMES[self._cb.current_state]

    def is_call_permitted(self) -> bool:
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and self._probe is None)

    def retry_after_s(self) -> float:
        """Seconds until a call may be let in again (0 when one would be now)."""
        if self.is_call_permitted():
            return 0.0
        if self._cb.current_state == pybreaker.STATE_OPEN:
            return self._open_left_s()
        return PROBE_RETRY_AFTER_S

    @contextlib.asynccontextmanager
    async def calling_async(self) -> AsyncIterator[BreakerCall]:
        """Admit one call (or raise BreakerOpenError at once) and count how it ends."""
        call = self._admit()
        try:
            yield call
        except BaseException as exc:
            self._finish(call, exc)
            raise
        else:
            self._finish(call, None)

    def _admit(self) -> BreakerCall:
        state = self.state
        if state == OPEN or (state == HALF_OPEN and self._probe is not None):
            raise BreakerOpenError(self.model, state, self.retry_after_s())
        call = BreakerCall(is_probe=state == HALF_OPEN, admitted_in=self._cb.state)
        if call.is_probe:
            self._probe = call
        return call

    def _open_left_s(self) -> float:
        return self._cb.reset_timeout - self._storage.seconds_open()

    def _finish(self, call: BreakerCall, exc: BaseException | None) -> None:
        if call is self._probe:
            self._probe = None
        outcome = self._outcome(call, exc)
        if outcome is None:
            return
        failed, slow = outcome
        self.num_failed_calls += failed
        self.num_slow_calls += slow
        if self._cb.state is not call.admitted_in:
            return  # began before a state change (e.g. admitted while closed, ended after the trip)
        if self._cb.current_state == pybreaker.STATE_CLOSED:
            self._window.add(self._clock(), failed, slow)
        self._report(exc if failed else SlowCallError(f"{self.model}: slow call") if slow else None)
        if self._cb.current_state == pybreaker.STATE_CLOSED and self._window.is_tripped(self.config):
            self._cb.open()

    def _outcome(self, call: BreakerCall, exc: BaseException | None) -> tuple[bool, bool] | None:
        """(failed, slow), or None when the call counts as nothing."""
        if exc is not None and self.is_ignored(exc):
            return None
        failed = exc is not None and not call.is_excused
        if exc is not None and not failed and not call.is_slow:
            return None  # an excused end of a call that was not slow: neither a success nor a failure
        return failed, call.is_slow

    def _report(self, error: BaseException | None) -> None:
        """Tell pybreaker how a call ended: it counts it, trips on fail_max in a row, reopens on a
        failed probe, closes after success_threshold good ones, and notifies its listeners."""
        traceback = error.__traceback__ if error is not None else None
        try:
            with self._cb.calling():
                if error is not None:
                    raise error
        except BaseException as exc:
            if exc is not error:
                raise
        finally:
            if error is not None:
                error.__traceback__ = traceback  # the report's frames are no part of the engine's error

    def _open_period_s(self) -> float:
        exponent = min(self._num_failed_probes, 64)
        nominal = min(self.config.max_open_s, self.config.open_s * self.config.backoff_factor**exponent)
        return nominal * self._rng.uniform(1 - self.config.jitter, 1)

    def _on_state_change(self, old: str, new: str) -> None:
        if old == new:
            return  # open() on an open breaker: pybreaker restarted the period, the length stays
        why = self._enter(old, new)
        logger.warning("breaker %s: %s -> %s (%s)", self.model, old, new, why)
        for listener in self._listeners:
            try:
                listener(self.model, old, new)
            except Exception:
                logger.exception("breaker %s: state listener failed", self.model)

    def _enter(self, old: str, new: str) -> str:
        """Set up the state being entered; says why, for the log line."""
        why = "probe succeeded" if new == CLOSED else "open period over; letting one probe through"
        if new == OPEN:
            is_tripped = self._window.is_tripped(self.config) or self._cb.fail_counter >= self._cb.fail_max
            why = (
                "probe failed" if old == HALF_OPEN else str(self._window) if is_tripped else "opened by hand"
            )
            self._num_failed_probes = self._num_failed_probes + 1 if old == HALF_OPEN else 0
            self._cb.reset_timeout = period = self._open_period_s()  # read by pybreaker's open state
            why = f"{why}; open for {period:.1f} s"
        elif new == CLOSED:
            self._num_failed_probes = 0
        self._window.clear()
        self._probe = None
        return why
