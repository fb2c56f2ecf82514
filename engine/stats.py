"""A snapshot of the engine's state for metrics and health; cheap to take every scrape."""

import bisect
from dataclasses import dataclass

# tokens per step: vLLM's iteration_tokens_total buckets
ITERATION_TOKEN_BUCKETS = (
    1.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    256.0,
    512.0,
    1024.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
)
# seconds per request: vLLM's request latency buckets, with finer ones below 0.3 s (tiny models on a
# CPU finish there) and trimmed past 480 s
SECONDS_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


@dataclass(frozen=True)
class Distribution:
    """Observed values by bucket: counts[i] holds those in (bounds[i-1], bounds[i]], the last count
    those past every bound. Immutable: the engine swaps in a new one per observation, so a snapshot
    shares it with a scraping thread safely and for free."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...] = ()
    total: float = 0.0  # sum of the observed values

    def __post_init__(self) -> None:
        if not self.counts:
            object.__setattr__(self, "counts", (0,) * (len(self.bounds) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> "Distribution":
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value: Prometheus' `le`
        counts = self.counts[:i] + (self.counts[i] + 1,) + self.counts[i + 1 :]
        return Distribution(self.bounds, counts, self.total + value)


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds each finished request (not aborted, not failed) spent per phase, as vLLM splits
    them: prefill from its first schedule to its first token, decode from there to its last token,
    inference the two together. The service observes queue time from each output's timestamps."""

    prefill: Distribution = Distribution(SECONDS_BUCKETS)
    decode: Distribution = Distribution(SECONDS_BUCKETS)
    inference: Distribution = Distribution(SECONDS_BUCKETS)

    def observe(self, scheduled: float, first_token: float, last_token: float) -> "PhaseTimes":
        return PhaseTimes(
            self.prefill.observe(first_token - scheduled),
            self.decode.observe(last_token - first_token),
            self.inference.observe(last_token - scheduled),
        )


@dataclass(frozen=True)
class CacheInfo:
    """The KV cache as configured and as laid out at load, for vLLM's cache_config_info (its names)."""

    block_size: int  # tokens
    num_gpu_blocks: int  # the pool the model reads K/V from, on whichever device it runs
    num_cpu_blocks: int  # the host pool for swapped-out blocks (0 unless preemption swaps)
    cache_dtype: str
    enable_prefix_caching: bool
    swap_space: float  # GiB
    gpu_memory_utilization: float


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of KV blocks held by live sequences, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    last_step_time: float | None  # time.monotonic() at the end of the last step
    is_busy: bool  # work is waiting or running
    num_isolated_steps: int = 0  # steps that raised and were re-run in parts (poison isolation)
    num_failed_requests: int = 0  # requests the engine finished with an error after isolating them
    iteration_tokens: Distribution = Distribution(ITERATION_TOKEN_BUCKETS)  # tokens run per step
    phase_times: PhaseTimes = PhaseTimes()
    cache: CacheInfo | None = None
    # (priority, tenant, time.monotonic() its longest-queued waiting or swapped sequence joined the queue), by
    # priority and tenant (None: requests of no tenant)
    queue_heads: tuple[tuple[int, str | None, float], ...] = ()
    is_full: bool = False  # the last step left a queued sequence out for lack of seats or KV blocks
    # speculative decoding: drafts run, their tokens, and those the sampler kept
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # kept draft tokens by their place in the draft

    def queue_delay_s(self, now: float, max_priority: int | None = None, tenant: str | None = None) -> float:
        """How long the longest-queued sequence (of priority <= `max_priority`, or any; of `tenant`, or
        any) has waited at `now` (time.monotonic()); 0 when none waits."""
        queued = [
            since
            for priority, owner, since in self.queue_heads
            if (max_priority is None or priority <= max_priority) and (tenant is None or owner == tenant)
        ]
        return max(0.0, now - min(queued)) if queued else 0.0
