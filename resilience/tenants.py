"""Tenants: several teams on one replica, each with its own quota, counted in tokens.

A tenant has a weight and a priority band (the engine's token-fair scheduler reads them: engine/core/
fairness.py), and may have a token rate with a burst (a token bucket: prompt + generated tokens per
minute) and a cap on its requests in flight. `TenantLimiter.admit` takes a request's prompt tokens from
its tenant's bucket or refuses it at once with `TenantLimitExceeded` (429 and a Retry-After computed
from the bucket: after that long, the same request is admitted if the tenant sent nothing else). Tokens
generated are taken as they are served; the bucket may go below zero (an answer is never cut short for
its quota), and the debt delays the tenant's next request. Prompt tokens of a request that ends before
its prompt was served are given back: what a tenant is counted is what it was served.
"""

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from resilience.errors import ResilienceError, RetryLater

REJECTION_REASONS = (
    "token_rate",
    "concurrency",
    "too_large",
)  # TenantLimitExceeded's, TenantRequestTooLarge's
TOKEN_KINDS = ("prompt", "generation")


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0  # share of the replica's tokens against other tenants of its priority band
    priority: int = 0  # its band: lower is more important (a request may ask for a less important one)
    tokens_per_minute: float | None = None  # prompt + generated tokens (None: no rate)
    burst: int | None = None  # the bucket's size in tokens (None: one minute of tokens_per_minute)
    max_concurrency: int | None = None  # requests in flight at once (None: no cap)

    def __post_init__(self) -> None:
        if not self.name or self.name.strip() != self.name or not self.name.isprintable():
            raise ValueError(
                f"a tenant name must be printable, non-empty, without surrounding spaces: {self.name!r}"
            )
        if not (_is_number(self.weight) and 0 < self.weight < math.inf):
            raise ValueError(f"tenant {self.name!r}: weight must be a positive number, got {self.weight!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"tenant {self.name!r}: priority must be an integer, got {self.priority!r}")
        if self.tokens_per_minute is not None and not (
            _is_number(self.tokens_per_minute) and 0 < self.tokens_per_minute < math.inf
        ):
            raise ValueError(
                f"tenant {self.name!r}: tokens_per_minute must be a positive number, got {self.tokens_per_minute!r}"
            )
        for name in ("burst", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"tenant {self.name!r}: {name} must be an integer >= 1, got {value!r}")
        if self.burst is not None and self.tokens_per_minute is None:
            raise ValueError(f"tenant {self.name!r}: a burst needs tokens_per_minute")

    @property
    def bucket_size(self) -> float | None:
        if self.tokens_per_minute is None:
            return None
        return float(self.burst) if self.burst is not None else self.tokens_per_minute


class TenantLimitExceeded(RetryLater):
    """A tenant's token rate or concurrency cap refused a request (429: the client's to slow down)."""

    def __init__(self, tenant: str, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(f"tenant {tenant!r}: {message}", retry_after_s)
        self.tenant = tenant
        self.reason = reason


class TenantRequestTooLarge(ResilienceError):
    """A request bigger than its tenant's whole bucket: no wait would let it in (400)."""

    http_status = 400
    code = "tenant_quota_too_small"
    reason = "too_large"


class TokenBucket:
    """`rate_per_s` tokens a second up to `capacity`; full at the start. `take` may overdraw it."""

    def __init__(self, rate_per_s: float, capacity: float, clock: Callable[[], float]) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._at = clock()

    @property
    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate_per_s)
        self._at = now
        return self._level

    def take(self, num_tokens: float) -> None:
        self._level = self.level - num_tokens

    def seconds_until(self, num_tokens: float) -> float:
        """How long until `num_tokens` can be taken (0: now)."""
        return max(0.0, (num_tokens - self.level) / self.rate_per_s)


class TenantPermit:
    """One admitted request's hold on its tenant: `serve_prompt` / `serve_generated` count what was served,
    `release` (idempotent) ends the hold and gives back prompt tokens never served."""

    def __init__(self, limiter: "TenantLimiter", tenant: Tenant, num_prompt_tokens: int) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self.num_reserved = num_prompt_tokens  # taken from the bucket at admission, not yet served
        self.num_served = 0
        self._released = False

    def serve_prompt(self, num_tokens: int) -> None:
        """A prompt's tokens were served (its first output came): taken at admission already."""
        num_tokens = min(num_tokens, self.num_reserved)
        self.num_reserved -= num_tokens
        self._count(num_tokens, "prompt")

    def serve_generated(self, num_tokens: int) -> None:
        bucket = self._limiter.buckets.get(self.tenant.name)
        if bucket is not None and num_tokens:
            bucket.take(num_tokens)
        self._count(num_tokens, "generation")

    def _count(self, num_tokens: int, kind: str) -> None:
        if num_tokens:
            self.num_served += num_tokens
            self._limiter.num_served[self.tenant.name, kind] += num_tokens

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        bucket = self._limiter.buckets.get(self.tenant.name)
        if bucket is not None and self.num_reserved:
            bucket.take(-self.num_reserved)
        self.num_reserved = 0
        self._limiter.num_in_flight[self.tenant.name] -= 1


class TenantLimiter:
    """The run-time quota state of every tenant: its bucket, its requests in flight, what it was served."""

    def __init__(self, tenants: Iterable[Tenant], clock: Callable[[], float] = time.monotonic) -> None:
        self.tenants = {tenant.name: tenant for tenant in tenants}
        self.buckets: dict[str, TokenBucket] = {}
        for tenant in self.tenants.values():
            size = tenant.bucket_size
            if size is not None and tenant.tokens_per_minute is not None:
                self.buckets[tenant.name] = TokenBucket(tenant.tokens_per_minute / 60, size, clock)
        self.num_in_flight: Counter[str] = Counter()
        self.num_served: Counter[tuple[str, str]] = Counter()  # tokens by (tenant, one of TOKEN_KINDS)
        self.num_rejected: Counter[tuple[str, str]] = Counter()  # by (tenant, one of REJECTION_REASONS)

    def admit(self, tenant: Tenant, num_prompt_tokens: int) -> TenantPermit:
        """Admit a request of `num_prompt_tokens` (its prompts together) or raise at once:
        `TenantRequestTooLarge` when the bucket could never hold it, `TenantLimitExceeded` when the cap
        is reached or the bucket holds too little now."""
        try:
            return self._admit(tenant, num_prompt_tokens)
        except (TenantLimitExceeded, TenantRequestTooLarge) as exc:
            self.num_rejected[tenant.name, exc.reason] += 1
            raise

    def _admit(self, tenant: Tenant, num_prompt_tokens: int) -> TenantPermit:
        bucket = self.buckets.get(tenant.name)
        if bucket is not None and num_prompt_tokens > bucket.capacity:
            raise TenantRequestTooLarge(
                f"tenant {tenant.name!r}: this request's {num_prompt_tokens} prompt tokens exceed the tenant's "
                f"burst of {bucket.capacity:.0f} tokens; send a shorter prompt"
            )
        if tenant.max_concurrency is not None and self.num_in_flight[tenant.name] >= tenant.max_concurrency:
            raise TenantLimitExceeded(
                tenant.name,
                "concurrency",
                f"{tenant.max_concurrency} requests in flight, the tenant's cap",
                1.0,  # a slot frees when one of them ends: no bucket says when
            )
        if bucket is not None:
            wait_s = bucket.seconds_until(num_prompt_tokens)
            if wait_s > 0:
                raise TenantLimitExceeded(
                    tenant.name,
                    "token_rate",
                    f"{num_prompt_tokens} prompt tokens asked, {max(bucket.level, 0):.0f} of the tenant's "
                    f"{tenant.tokens_per_minute:g} tokens a minute left",
                    wait_s,
                )
            bucket.take(num_prompt_tokens)
        self.num_in_flight[tenant.name] += 1
        return TenantPermit(self, tenant, num_prompt_tokens)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
