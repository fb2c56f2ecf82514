"""A bulkhead per model: bounded requests (in flight + queued) AND tokens (prompt + max_tokens).

A full bulkhead refuses at once with `AdmissionRejected(retry_after_s)` (429/503 + Retry-After):
zero wait, as resilience4j recommends on event loops, so overload turns into fast refusals instead
of a queue whose every entry misses its deadline. The fallback model has its own bulkhead, so
failing over cannot swamp it.

    async with bulkhead.try_acquire(len(prompt_ids) + params.max_tokens):
        ...  # released exactly once: on return, error or cancellation
"""

import logging
from dataclasses import dataclass
from types import TracebackType

from engine.errors import RequestRejectedError
from resilience.clock import Clock
from resilience.errors import AdmissionRejected

logger = logging.getLogger(__name__)

_HOLD_EWMA_WEIGHT = 0.2  # weight of the newest hold time in the running average


@dataclass(frozen=True)
class BulkheadConfig:
    max_num_requests: int = 64  # admitted and not yet released: in flight + queued in the engine
    max_num_tokens: int = 65536  # sum of prompt + max_tokens over those requests
    min_retry_after_s: float = 1.0  # bounds of the Retry-After hint
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_num_requests", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s, "
                             f"got {self.min_retry_after_s}, {self.max_retry_after_s}")


class Permit:
    """One admitted request's share of the bulkhead; `release()` is idempotent."""

    def __init__(self, bulkhead: "Bulkhead", num_tokens: int, acquired_at: float) -> None:
        self._bulkhead = bulkhead
        self.num_tokens = num_tokens
        self.acquired_at = acquired_at
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._bulkhead._release(self)

    def __enter__(self) -> "Permit":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    async def __aenter__(self) -> "Permit":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.release()


class Bulkhead:
    def __init__(self, model: str, config: BulkheadConfig | None = None, *, clock: Clock) -> None:
        self.model = model
        self.config = config or BulkheadConfig()
        self._clock = clock
        self.num_requests = 0
        self.num_tokens = 0
        self.num_rejected = 0
        self._mean_hold_s: float | None = None  # EWMA of how long permits are held

    def can_acquire(self, num_tokens: int) -> bool:
        return self._refusal(num_tokens) is None

    def try_acquire(self, num_tokens: int) -> Permit:
        """Admit a request of `num_tokens` (prompt + max_tokens) or raise AdmissionRejected at once.
        A request larger than the whole bulkhead can never fit: RequestRejectedError (a 4xx)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens > self.config.max_num_tokens:
            raise RequestRejectedError(f"request needs {num_tokens} tokens, model {self.model!r} admits "
                                       f"at most {self.config.max_num_tokens} at a time")
        refusal = self._refusal(num_tokens)
        if refusal is not None:
            self.num_rejected += 1
            raise AdmissionRejected(self.model, refusal, self.retry_after_s())
        self.num_requests += 1
        self.num_tokens += num_tokens
        return Permit(self, num_tokens, self._clock())

    def retry_after_s(self) -> float:
        """About one mean hold time: by then most of the requests holding the bulkhead are done."""
        hold_s = self._mean_hold_s if self._mean_hold_s is not None else self.config.min_retry_after_s
        return min(max(hold_s, self.config.min_retry_after_s), self.config.max_retry_after_s)

    def _refusal(self, num_tokens: int) -> str | None:
        if self.num_requests + 1 > self.config.max_num_requests:
            return f"{self.num_requests} of {self.config.max_num_requests} requests admitted"
        if self.num_tokens + num_tokens > self.config.max_num_tokens:
            return f"{self.num_tokens} + {num_tokens} tokens exceed {self.config.max_num_tokens}"
        return None

    def _release(self, permit: Permit) -> None:
        self.num_requests -= 1
        self.num_tokens -= permit.num_tokens
        hold_s = self._clock() - permit.acquired_at
        self._mean_hold_s = hold_s if self._mean_hold_s is None else \
            (1 - _HOLD_EWMA_WEIGHT) * self._mean_hold_s + _HOLD_EWMA_WEIGHT * hold_s
