"""A snapshot of the engine's state for metrics and health; cheap to take every scrape."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of KV blocks held by live sequences, 0..1
    kv_waste: float  # fraction of allocated KV slots not holding a token, 0..1
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
