"""A bulkhead per model: bounded sequences (in flight + queued; a request counts its n) AND,
optionally, tokens (prompt + n x max_tokens). By default the sequence bound is what the engine
itself can hold (max_num_seqs running + max_num_waiting queued), so the bulkhead refuses only what
the engine would refuse a moment later, without queueing it first.

A full bulkhead refuses at once with `AdmissionRejected(retry_after_s)` (429/503 + Retry-After):
zero wait, as resilience4j recommends on event loops, so overload turns into fast refusals instead
of a queue whose every entry misses its deadline. The fallback model has its own bulkhead, so
failing over cannot swamp it.

A bound on counts alone lets a queue grow as long as the engine's 1024 waiting places: under a
steady overload every request admitted waits longer than the one before. So the bulkhead also
refuses while the engine's queue delay (how long its head has waited, as CoDel measures a queue)
is above `max_queue_delay_s`, with `QueueDelayExceeded`: the router then degrades the request to
the next model of its ladder, and answers 429 when none is left. It refuses only while the queue
stands that long, so it sheds what the engine cannot absorb and no more; a burst that the engine
drains within the target is let in whole.

With `max_owner_share`, one owner (an API key) holds at most that share of the engine's seats
(max_num_seqs), queued ones included: a key sending n=128 with long outputs cannot take every seat.

    async with bulkhead.try_acquire(len(prompt_ids) + params.n * params.max_tokens, params.n, queue_delay_s):
        ...  # released exactly once: on return, error or cancellation
"""

import logging
from collections import Counter
from dataclasses import dataclass
from types import TracebackType

from engine.errors import RequestRejectedError
from resilience.clock import Clock
from resilience.errors import AdmissionRejected, QueueDelayExceeded

logger = logging.getLogger(__name__)

REJECTION_REASONS = (
    "max_num_seqs",
    "max_num_tokens",
    "queue_delay",
    "owner_share",
)  # the keys of Bulkhead.num_rejected
_HOLD_EWMA_WEIGHT = 0.2  # weight of the newest hold time in the running average


@dataclass(frozen=True)
class BulkheadConfig:
    max_num_seqs: int | None = None  # admitted, not yet released; None: the engine's own capacity
    max_num_tokens: int | None = None  # sum of prompt + n x max_tokens over them; None: unbounded
    # refuse while the engine's queue has held its head longer than this (None: never). A quarter of the
    # router's 10 s first-token deadline: a new request queues behind more than the head did when the
    # queue grows, about twice the head's wait at twice the rate it drains, and must still be prefilled
    max_queue_delay_s: float | None = 2.5
    # share of the engine's seats (max_num_seqs) one owner may hold, queued included (None: no bound)
    max_owner_share: float | None = None
    min_retry_after_s: float = 1.0  # bounds of the Retry-After hint
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_owner_share is not None and not 0 < self.max_owner_share <= 1:
            raise ValueError(f"max_owner_share must be in (0, 1] (None: off), got {self.max_owner_share}")
        if self.max_queue_delay_s is not None and not self.max_queue_delay_s > 0:
            raise ValueError(f"max_queue_delay_s must be > 0 (None: off), got {self.max_queue_delay_s}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError(
                "need 0 < min_retry_after_s <= max_retry_after_s, "
                f"got {self.min_retry_after_s}, {self.max_retry_after_s}"
            )


class Permit:
    """One admitted request's share of the bulkhead; `release()` is idempotent."""

    def __init__(
        self,
        bulkhead: "Bulkhead",
        num_tokens: int,
        num_seqs: int,
        acquired_at: float,
        owner: str | None = None,
    ) -> None:
        self._bulkhead = bulkhead
        self.num_tokens = num_tokens
        self.num_seqs = num_seqs
        self.owner = owner
        self.acquired_at = acquired_at
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._bulkhead._release(self)

    def __enter__(self) -> "Permit":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    async def __aenter__(self) -> "Permit":
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Bulkhead:
    def __init__(
        self,
        model: str,
        config: BulkheadConfig | None = None,
        *,
        clock: Clock,
        engine_capacity: int | None = None,
        engine_seats: int | None = None,
    ) -> None:
        """`engine_capacity`: sequences the engine holds (running + waiting), the default bound;
        `engine_seats`: those it runs at once (max_num_seqs), which an owner's share is of."""
        self.model = model
        self.config = config or BulkheadConfig()
        self.max_num_seqs = self.config.max_num_seqs or engine_capacity  # None: unbounded
        share = self.config.max_owner_share
        # None: unbounded; at least one seat, so every owner can be served
        self.max_owner_seqs = (
            None if share is None or engine_seats is None else max(1, int(share * engine_seats))
        )
        self.num_seqs_by_owner: Counter[str] = Counter()
        self._clock = clock
        self.num_seqs = 0
        self.num_tokens = 0
        self.num_rejected: Counter[str] = Counter()  # by one of REJECTION_REASONS
        self._mean_hold_s: float | None = None  # EWMA of how long permits are held

    def can_acquire(self, num_tokens: int, num_seqs: int = 1) -> bool:
        return self._refusal(num_tokens, num_seqs) == (None, None)

    def check_fits(self, num_tokens: int, num_seqs: int = 1, owner: str | None = None) -> None:
        """RequestRejectedError (a 4xx) for what can never be admitted, even into an empty bulkhead."""
        if self.max_num_seqs is not None and num_seqs > self.max_num_seqs:
            raise RequestRejectedError(
                f"the request needs {num_seqs} sequences (prompts x n); model "
                f"{self.model!r} admits at most {self.max_num_seqs} at a time"
            )
        if owner is not None and self.max_owner_seqs is not None and num_seqs > self.max_owner_seqs:
            raise RequestRejectedError(
                f"the request needs {num_seqs} sequences (prompts x n); one API key may "
                f"hold at most {self.max_owner_seqs} of the seats of model {self.model!r}"
            )
        limit = self.config.max_num_tokens
        if limit is not None and num_tokens > limit:
            raise RequestRejectedError(
                f"the request needs {num_tokens} tokens (prompt + n x max_tokens); "
                f"model {self.model!r} admits at most {limit} at a time"
            )

    def try_acquire(
        self, num_tokens: int, num_seqs: int = 1, queue_delay_s: float = 0.0, owner: str | None = None
    ) -> Permit:
        """Admit a request of `num_seqs` sequences and `num_tokens` (prompt + n x max_tokens) or
        raise AdmissionRejected at once (RequestRejectedError when it could never fit);
        `queue_delay_s`: the engine's (`EngineClient.queue_delay_s`), QueueDelayExceeded above the target;
        `owner`: who sent it (an API key's fingerprint), for the owner share."""
        if num_tokens < 0 or num_seqs < 1:
            raise ValueError(f"need num_tokens >= 0 and num_seqs >= 1, got {num_tokens}, {num_seqs}")
        self.check_fits(num_tokens, num_seqs, owner)
        max_delay_s = self.config.max_queue_delay_s
        if max_delay_s is not None and queue_delay_s > max_delay_s:
            self.num_rejected["queue_delay"] += 1
            # by then the queue's head has waited as long again: about what is queued now has been served
            retry_after_s = min(
                max(queue_delay_s, self.config.min_retry_after_s), self.config.max_retry_after_s
            )
            raise QueueDelayExceeded(self.model, queue_delay_s, max_delay_s, retry_after_s)
        reason, refusal = self._refusal(num_tokens, num_seqs, owner)
        if reason is not None:
            self.num_rejected[reason] += 1
            raise AdmissionRejected(self.model, refusal, self.retry_after_s())
        self.num_seqs += num_seqs
        self.num_tokens += num_tokens
        if owner is not None:
            self.num_seqs_by_owner[owner] += num_seqs
        return Permit(self, num_tokens, num_seqs, self._clock(), owner)

    def retry_after_s(self) -> float:
        """About one mean hold time: by then most of the requests holding the bulkhead are done."""
        hold_s = self._mean_hold_s if self._mean_hold_s is not None else self.config.min_retry_after_s
        return min(max(hold_s, self.config.min_retry_after_s), self.config.max_retry_after_s)

    def _refusal(
        self, num_tokens: int, num_seqs: int, owner: str | None = None
    ) -> tuple[str, str] | tuple[None, None]:
        """(the bound that refuses, why) or (None, None)."""
        held = self.num_seqs_by_owner[owner] if owner is not None else 0
        if owner is not None and self.max_owner_seqs is not None and held + num_seqs > self.max_owner_seqs:
            return "owner_share", (
                f"this API key holds {held} sequences; {held} + {num_seqs} exceed its share, "
                f"{self.max_owner_seqs}"
            )
        if self.max_num_seqs is not None and self.num_seqs + num_seqs > self.max_num_seqs:
            return "max_num_seqs", f"{self.num_seqs} + {num_seqs} sequences exceed {self.max_num_seqs}"
        limit = self.config.max_num_tokens
        if limit is not None and self.num_tokens + num_tokens > limit:
            return "max_num_tokens", f"{self.num_tokens} + {num_tokens} tokens exceed {limit}"
        return None, None

    def _release(self, permit: Permit) -> None:
        self.num_seqs -= permit.num_seqs
        self.num_tokens -= permit.num_tokens
        if permit.owner is not None:
            self.num_seqs_by_owner[permit.owner] -= permit.num_seqs
            if not self.num_seqs_by_owner[permit.owner]:
                del self.num_seqs_by_owner[permit.owner]
        hold_s = self._clock() - permit.acquired_at
        self._mean_hold_s = (
            hold_s
            if self._mean_hold_s is None
            else (1 - _HOLD_EWMA_WEIGHT) * self._mean_hold_s + _HOLD_EWMA_WEIGHT * hold_s
        )
