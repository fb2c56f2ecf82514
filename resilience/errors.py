"""Errors raised by the resilience layer.

Two families, as in the engine (docs/style.md, item 9): `RetryLater` (overload or a tripped breaker:
recoverable, the service answers 429/503 with a Retry-After header) and `ProbeError` with `is_fatal`
(a lost device: the replica must be replaced, liveness fails).
"""

import math


class ResilienceError(Exception):
    """Base of every error the resilience layer raises on purpose."""


class RetryLater(ResilienceError):
    """Refused now, may succeed later; `retry_after_s` feeds the Retry-After header."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        if not retry_after_s >= 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up, at least 1 (RFC 9110 delay-seconds)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class BreakerOpenError(RetryLater):
    """The model's breaker refused the call fast (open, or half-open with its probe in flight)."""

    def __init__(self, model: str, state: str, retry_after_s: float) -> None:
        super().__init__(f"breaker of model {model!r} is {state}", retry_after_s)
        self.model = model
        self.state = state


class AdmissionRejected(RetryLater):
    """The bulkhead is full (requests or tokens); rejected at once instead of queueing."""

    def __init__(self, model: str, reason: str, retry_after_s: float) -> None:
        super().__init__(f"model {model!r} is at capacity: {reason}", retry_after_s)
        self.model = model
        self.reason = reason


class QueueDelayExceeded(AdmissionRejected):
    """The model's queue has held its head longer than the admission target: a request admitted now
    would likely miss its first-token deadline. The router degrades it to the next model."""

    def __init__(self, model: str, delay_s: float, max_delay_s: float, retry_after_s: float) -> None:
        super().__init__(
            model, f"its queue has held a request {delay_s:.1f} s (target {max_delay_s:g} s)", retry_after_s
        )
        self.delay_s = delay_s


class NoModelAvailable(RetryLater):
    """Every model in the fallback chain refused the request."""


class DeadlineExceeded(ResilienceError, TimeoutError):
    """No progress in time. `stage` is "first_token", "between_tokens" or "total"."""

    STAGES = ("first_token", "between_tokens", "total")

    def __init__(self, stage: str, timeout_s: float) -> None:
        if stage not in self.STAGES:
            raise ValueError(f"stage must be one of {self.STAGES}, got {stage!r}")
        super().__init__(f"deadline exceeded at {stage} after {timeout_s:.3f} s")
        self.stage = stage
        self.timeout_s = timeout_s


class ProbeError(ResilienceError):
    """A memory probe failed. `is_fatal`: the device is gone (e.g. NVML GpuIsLost), mark not live."""

    def __init__(self, message: str, is_fatal: bool = False) -> None:
        super().__init__(message)
        self.is_fatal = is_fatal
