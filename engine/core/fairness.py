"""Token-fair scheduling between tenants: a virtual token counter per tenant (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024). Pure Python, no torch.

Every token the scheduler gives a tenant's sequence adds `cost / weight` to the tenant's counter (a
prefill token costs `prefill_cost`, a decode token `decode_cost`); within a priority band the next
prefill goes to the tenant with the smallest counter. A tenant sending more, or longer, requests only
raises its own counter. A tenant that had nothing queued or running is lifted, when it comes back, to the
smallest counter among the active ones less one contended step of its own prompt tokens
(`contended_prefill_tokens`): idle time buys no more head start than that, however long, and a light
tenant's next turns (a chat's, often queued while its last one still decodes) go before the next chunk of a
flood instead of each waiting one (benchmarks/fairness.py, 30 s runs: the light tenant's p99 time to first
token under a flood 99 ms lifted level, 66-70 ms in three runs lifted a step behind). The scheduler breaks
a tie for the tenant with fewer sequences in flight.

While more than one tenant has had sequences in flight within the last CONTENTION_WINDOW_S, a step's
prompt tokens are all of one tenant (the first the scheduler gives prompt tokens to, the least served),
its chunks of a prompt (a started one, or one too long to run whole) at most `contended_prefill_tokens`
(the least among those tenants' shares) and its prompt tokens at most twice that: a tenant's next prompt
then waits for a short step, never for a whole budget of another tenant's long prompt, a short prompt is
not split (its second part would wait for the other tenant's chunk), and a tenant's own step carries no
other tenant's prompt tokens beside it, only decodes. (A tenant between two requests counts: its next one
is what the cap is for.)"""

import time
from collections import Counter
from collections.abc import Callable

from engine.fair_share import FairShare

CONTENTION_WINDOW_S = 5.0  # a tenant idle for less than this still contends


class VirtualTokenCounter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.counters: dict[str, float] = {}
        self.active: Counter[str] = Counter()  # sequences of each tenant queued or running
        # each tenant's contended_prefill_tokens (its latest share's) while it contends, and when the idle
        # ones left
        self.chunks: dict[str, int] = {}
        self.idle_since: dict[str, float] = {}

    def join(self, share: FairShare | None) -> None:
        """One more sequence of `share`'s tenant is queued or running."""
        if share is None:
            return
        tenant = share.tenant
        if not self.active[tenant]:
            floor = min((self.counters[t] for t in self.active if self.active[t]), default=None)
            own = self.counters.get(tenant, 0.0)
            head_start = share.contended_prefill_tokens * share.prefill_cost / share.weight
            self.counters[tenant] = own if floor is None else max(own, floor - head_start)
        self.active[tenant] += 1
        self.chunks[tenant] = share.contended_prefill_tokens
        self.idle_since.pop(tenant, None)

    def leave(self, share: FairShare | None) -> None:
        if share is None:
            return
        self.active[share.tenant] -= 1
        if not self.active[share.tenant]:
            del self.active[share.tenant]
            self.idle_since[share.tenant] = self.clock()

    def prefill_cap(self) -> int | None:
        """Prompt tokens a step may compute while tenants contend (None: one tenant, or none, contends)."""
        if self.idle_since:
            stale = self.clock() - CONTENTION_WINDOW_S
            for tenant in [t for t, since in self.idle_since.items() if since < stale]:
                del self.idle_since[tenant], self.chunks[tenant]
        return min(self.chunks.values()) if len(self.chunks) > 1 else None

    def charge(self, share: FairShare | None, num_tokens: int, is_prefill: bool) -> None:
        if share is None or not num_tokens:
            return
        cost = share.prefill_cost if is_prefill else share.decode_cost
        self.counters[share.tenant] = self.counters.get(share.tenant, 0.0) + num_tokens * cost / share.weight

    def value(self, share: FairShare | None) -> float:
        """The tenant's counter (0 for a request of no tenant: served as before tenants existed)."""
        return 0.0 if share is None else self.counters.get(share.tenant, 0.0)
