"""Retries that cannot become a storm: a budget over all traffic, and tenacity policies that stop
on an open breaker, a refused admission, a passed deadline or a spent budget.

Retry only where it is safe (model loading, a resubmit before the first byte), never a stream after
bytes went out, and at one layer only (nginx, this and the client would multiply each other).

    async for attempt in retry_policy(budget=budget, deadline=deadline, clock=clock):
        with attempt:
            await load_model(path)
"""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pybreaker
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    stop_any,
    wait_random_exponential,
)

from engine.errors import EngineOverloadedError
from resilience.clock import Clock
from resilience.errors import RetryLater

logger = logging.getLogger(__name__)

# never worth a retry: refused fast on purpose (open breaker, full bulkhead) or cancelled by the client
NEVER_RETRY: tuple[type[BaseException], ...] = (
    RetryLater,
    pybreaker.CircuitBreakerError,
    asyncio.CancelledError,
)
DEFAULT_RETRY_ON: tuple[type[BaseException], ...] = (EngineOverloadedError, ConnectionError)


@dataclass(frozen=True)
class RetryBudgetConfig:
    ratio: float = 0.1  # retries may be at most this fraction of the requests ...
    window_s: float = 10.0  # ... that arrived within this many seconds ...
    min_retries: int = 3  # ... but this many per window are always allowed, so low traffic can retry

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_retries < 0:
            raise ValueError(f"min_retries must be >= 0, got {self.min_retries}")


class RetryBudget:
    """Token bucket in the style of Finagle's: each request deposits `ratio` of a token that expires
    after `window_s`, a retry withdraws one, and `min_retries` tokens are always there."""

    def __init__(self, config: RetryBudgetConfig | None = None, *, clock: Clock) -> None:
        self.config = config or RetryBudgetConfig()
        self._clock = clock
        self._request_times: deque[float] = deque()
        self._retry_times: deque[float] = deque()

    def record_request(self) -> None:
        self._expire()  # else a healthy replica, which never asks can_retry, grows this without bound
        self._request_times.append(self._clock())

    def can_retry(self) -> bool:
        self._expire()
        allowed = max(self.config.min_retries, self.config.ratio * len(self._request_times))
        return len(self._retry_times) + 1 <= allowed

    def try_spend(self) -> bool:
        """Withdraw one retry; False (and nothing withdrawn) when the budget is spent."""
        if not self.can_retry():
            return False
        self._retry_times.append(self._clock())
        return True

    @property
    def num_requests(self) -> int:
        self._expire()
        return len(self._request_times)

    @property
    def num_retries(self) -> int:
        self._expire()
        return len(self._retry_times)

    def _expire(self) -> None:
        oldest = self._clock() - self.config.window_s
        for times in (self._request_times, self._retry_times):
            while times and times[0] <= oldest:
                times.popleft()


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 3  # the first try included
    initial_wait_s: float = 0.1  # full-jitter window of the first retry: uniform(0, initial_wait_s)
    max_wait_s: float = 2.0  # the window doubles per retry up to this
    retry_on: tuple[type[BaseException], ...] = DEFAULT_RETRY_ON

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.initial_wait_s <= self.max_wait_s:
            raise ValueError(
                f"need 0 < initial_wait_s <= max_wait_s, got {self.initial_wait_s}, {self.max_wait_s}"
            )


def retry_policy(
    config: RetryConfig | None = None,
    *,
    budget: RetryBudget | None = None,
    deadline: float | None = None,
    clock: Clock = time.monotonic,
    is_call_permitted: Callable[[], bool] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncRetrying:
    """A fresh tenacity policy for one operation. `deadline` is a time on `clock`;
    `is_call_permitted` is e.g. `breaker.is_call_permitted`. The first attempt records a request on
    `budget`; each retry withdraws one from it, checked last so a retry stopped otherwise costs none."""
    config = config or RetryConfig()
    stops = [stop_after_attempt(config.max_attempts)]
    if deadline is not None:
        stops.append(_stop_past_deadline(deadline, clock))
    if is_call_permitted is not None:
        stops.append(lambda state: not is_call_permitted())
    if budget is not None:
        stops.append(lambda state: not budget.try_spend())
    return AsyncRetrying(
        sleep=sleep,
        stop=stop_any(*stops),
        reraise=True,
        wait=wait_random_exponential(multiplier=config.initial_wait_s, max=config.max_wait_s),
        retry=retry_if_exception(lambda exc: _is_retryable(exc, config.retry_on)),
        before=_record_first_attempt(budget),
        before_sleep=before_sleep_log(logger, logging.WARNING),
    )


def _is_retryable(exc: BaseException, retry_on: tuple[type[BaseException], ...]) -> bool:
    return isinstance(exc, retry_on) and not isinstance(exc, NEVER_RETRY)


def _stop_past_deadline(deadline: float, clock: Clock) -> Callable[[RetryCallState], bool]:
    # tenacity draws the wait before it asks stop: give up when the wait would end past the deadline
    return lambda state: clock() + state.upcoming_sleep >= deadline


def _record_first_attempt(budget: RetryBudget | None) -> Callable[[RetryCallState], None]:
    def before(state: RetryCallState) -> None:
        if budget is not None and state.attempt_number == 1:
            budget.record_request()

    return before
