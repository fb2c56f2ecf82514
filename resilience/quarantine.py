"""Poison quarantine: a request the engine isolated as the cause of a failed step is remembered by its
fingerprint (its prompts' token ids, its sampling and grammar parameters) for a while; sent again
within that time it is refused before it reaches an engine, so a client's retry loop cannot make the
engine fail again and again. Bounded: past `max_entries` the oldest is forgotten first."""

from collections import OrderedDict

from resilience.clock import Clock

MAX_ENTRIES = 10_000


class Quarantine:
    def __init__(self, ttl_s: float, clock: Clock, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl_s = ttl_s  # 0: off
        self.clock = clock
        self.max_entries = max_entries
        self._until: OrderedDict[str, float] = OrderedDict()  # fingerprint -> refused until, oldest first
        self.num_refused = 0

    def add(self, fingerprint: str) -> None:
        if self.ttl_s <= 0:
            return
        self._until.pop(fingerprint, None)
        self._until[fingerprint] = self.clock() + self.ttl_s
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def seconds_left(self, fingerprint: str) -> float:
        """How much longer `fingerprint` is refused (0: it is not); a refusal is counted."""
        until = self._until.get(fingerprint)
        if until is None:
            return 0.0
        left = until - self.clock()
        if left <= 0:
            del self._until[fingerprint]
            return 0.0
        self.num_refused += 1
        return left

    def __len__(self) -> int:
        return len(self._until)
