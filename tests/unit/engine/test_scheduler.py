"""Scheduler driven by hand over a tiny pool (block_size=4, num_blocks=8): schedule, sample chosen
token ids, postprocess. Exact chunks, block tables and preemptions; every block free at the end."""

import dataclasses
from collections.abc import Callable

import pytest

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import SampledToken, Sequence, SequenceStatus
from engine.errors import EngineOverloadedError
from engine.fair_share import FairShare
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from tests.fakes import FakeClock

BLOCK_SIZE = 4
NUM_BLOCKS = 8


def make_scheduler(
    num_swap_blocks: int = 0, clock: Callable[[], float] | None = None, **overrides
) -> Scheduler:
    settings = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": 64, "max_num_seqs": 8} | overrides
    config = EngineConfig(model="x", **settings)
    bm = BlockManager(
        NUM_BLOCKS,
        BLOCK_SIZE,
        enable_prefix_caching=config.enable_prefix_caching,
        num_swap_blocks=num_swap_blocks,
    )
    return Scheduler(config, bm, clock=clock or FakeClock(0.0))


def add(
    sched: Scheduler,
    prompt: list[int],
    arrival: float = 0.0,
    priority: int = 0,
    eos: int | None = None,
    share: FairShare | None = None,
    **params,
) -> Sequence:
    seq = Sequence(
        request_id=f"req-{len(prompt)}-{arrival}",
        prompt_token_ids=list(prompt),
        params=SamplingParams(**params),
        priority=priority,
        arrival_time=arrival,
        share=share,
        eos_token_ids=frozenset() if eos is None else frozenset({eos}),
    )
    sched.add_seq(seq)
    return seq


def step(sched: Scheduler, token: int | Callable[[Sequence], int] = 7) -> SchedulerOutput:
    """One engine step: every item that samples gets `token` (or token(seq)) num_samples times."""
    out = sched.schedule()
    pick = token if callable(token) else (lambda seq: token)
    sampled = {
        item.seq.seq_id: [SampledToken(pick(item.seq))] * item.num_samples
        for item in out.scheduled
        if item.num_samples
    }
    sched.postprocess(out, sampled)
    return out


def drain(
    sched: Scheduler, token: int | Callable[[Sequence], int] = 7, max_steps: int = 50
) -> list[SchedulerOutput]:
    """Step until nothing is left; a livelock fails instead of hanging."""
    outs = []
    while sched.has_unfinished:
        assert len(outs) < max_steps, "the scheduler made no progress"
        outs.append(step(sched, token))
    return outs


def chunks(out: SchedulerOutput) -> list[tuple[Sequence, int, int, int]]:
    return [(item.seq, item.start, item.num_new_tokens, item.num_samples) for item in out.scheduled]


def free_ids(sched: Scheduler) -> list[int]:
    return sched.block_manager.free_queue.block_ids()


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished
    assert bm.num_free_blocks == bm.num_blocks
    assert [block.ref_count for block in bm.blocks] == [0] * bm.num_blocks
    assert sorted(bm.free_swap_blocks) == list(range(bm.num_swap_blocks))
    assert bm.swapped == {}


# --- continuous batching, budget, chunked prefill ------------------------------------------------
def test_fcfs_new_request_joins_while_others_decode():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3, 4, 5], arrival=0, max_tokens=3)
    out = step(sched, 10)
    assert chunks(out) == [(a, 0, 5, 1)]
    assert a.block_table == [0, 1] and a.output_token_ids == [10]

    b = add(sched, [20, 21, 22], arrival=1, max_tokens=3)
    out = step(sched, 11)
    assert chunks(out) == [(a, 5, 1, 1), (b, 0, 3, 1)]
    assert out.num_batched_tokens == 4
    assert b.block_table == [2]

    out = step(sched, 12)
    assert chunks(out) == [(a, 6, 1, 1), (b, 3, 1, 1)]
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert a.output_token_ids == [10, 11, 12]
    assert sched.running == [b]
    # a's block 1 (3 tokens) goes to the head, its full block 0 to the tail
    assert free_ids(sched) == [1, 3, 4, 5, 6, 7, 0]

    out = step(sched, 13)
    assert chunks(out) == [(b, 4, 1, 1)]
    assert b.block_table == []  # finished and freed: it had taken block 1 for its 5th token
    assert b.output_token_ids == [11, 12, 13]
    assert free_ids(sched) == [1, 3, 4, 5, 6, 7, 0, 2]
    assert sched.schedule().is_empty
    assert_all_free(sched)


def test_token_budget_chunks_a_long_prompt_between_decodes():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = add(sched, [1, 2], arrival=0, max_tokens=4)
    assert chunks(step(sched)) == [(a, 0, 2, 1)]
    b = add(sched, list(range(100, 109)), arrival=1, max_tokens=2)
    out = step(sched)
    assert chunks(out) == [(a, 2, 1, 1), (b, 0, 3, 0)]
    assert (a.block_table, b.block_table) == ([0], [1])
    out = step(sched)
    assert chunks(out) == [(a, 3, 1, 1), (b, 3, 3, 0)]
    assert b.block_table == [1, 2]
    assert b.output_token_ids == [] and b.num_computed_tokens == 6
    out = step(sched)
    assert chunks(out) == [(a, 4, 1, 1), (b, 6, 3, 1)]  # b's last chunk samples its first token
    assert a.is_finished and a.output_token_ids == [7, 7, 7, 7]
    assert b.block_table == [1, 2, 4]  # a still held block 3 while b allocated
    out = step(sched)
    assert chunks(out) == [(b, 9, 1, 1)]
    assert b.status == SequenceStatus.FINISHED_LENGTH
    assert_all_free(sched)


def test_budget_stops_admission_of_later_requests():
    sched = make_scheduler(max_num_batched_tokens=6)
    a = add(sched, [1, 2, 3, 4], arrival=0, max_tokens=1)
    b = add(sched, [5, 6, 7, 8], arrival=1, max_tokens=1)
    c = add(sched, [9, 10], arrival=2, max_tokens=1)
    out = step(sched)
    assert chunks(out) == [(a, 0, 4, 1), (b, 0, 2, 0)]  # c waits behind b (first come, first served)
    assert sched.waiting == [c]
    out = step(sched)
    assert chunks(out) == [(b, 2, 2, 1), (c, 0, 2, 1)]
    assert_all_free(sched)


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    a = add(sched, [1, 2], arrival=0, max_tokens=1)
    b = add(sched, [3, 4], arrival=1, max_tokens=2)
    c = add(sched, [5, 6], arrival=2, max_tokens=1)
    out = step(sched)
    assert chunks(out) == [(a, 0, 2, 1), (b, 0, 2, 1)]
    assert sched.waiting == [c] and c.status == SequenceStatus.WAITING
    out = step(sched)  # a finished at step 1: c takes its place
    assert chunks(out) == [(b, 2, 1, 1), (c, 0, 2, 1)]
    assert_all_free(sched)


# --- preemption ------------------------------------------------------------------------------------
def fill_pool(sched: Scheduler, **params) -> tuple[Sequence, Sequence, Sequence]:
    """a and b: 8-token prompts (2 blocks each); c: 16 tokens (4 blocks). The pool is then full and
    a's first decode needs a 3rd block."""
    a = add(sched, list(range(10, 18)), arrival=0, max_tokens=3)
    b = add(sched, list(range(20, 28)), arrival=1, max_tokens=3)
    c = add(sched, list(range(30, 46)), arrival=2, max_tokens=2, **params)
    out = step(sched, 101)
    assert chunks(out) == [(a, 0, 8, 1), (b, 0, 8, 1), (c, 0, 16, 1)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5, 6, 7])
    assert sched.block_manager.num_free_blocks == 0
    return a, b, c


def test_recompute_preemption_of_the_latest_arrival():
    sched = make_scheduler()
    a, b, c = fill_pool(sched)
    out = step(sched, 102)
    assert out.preempted == [c]
    assert chunks(out) == [(a, 8, 1, 1), (b, 8, 1, 1)]
    assert c.status == SequenceStatus.PREEMPTED
    assert (c.num_computed_tokens, c.block_table, c.num_preemptions) == (0, [], 1)
    assert sched.waiting == [c] and sched.num_preemptions == 1
    # c's hashed blocks went to the tail in reverse: its last block is taken first
    assert (a.block_table, b.block_table) == ([0, 1, 7], [2, 3, 6])
    assert free_ids(sched) == [5, 4]

    out = step(sched, 103)  # c's 2 cached blocks + 3 more do not fit in 2 free blocks
    assert chunks(out) == [(a, 9, 1, 1), (b, 9, 1, 1)]
    assert a.is_finished and b.is_finished
    assert free_ids(sched) == [6, 7, 5, 4, 1, 0, 3, 2]

    out = step(sched, 104)  # c recomputes the rest of its prompt (its first 2 blocks hit), nothing sampled
    assert chunks(out) == [(c, 8, 8, 0)]
    out = step(sched, 105)  # then its first token, replayed as the decode it was (Sequence.replay_until)
    assert chunks(out) == [(c, 16, 1, 1)]
    assert c.output_token_ids == [101, 105]
    assert c.status == SequenceStatus.FINISHED_LENGTH
    assert c.num_cached_tokens == 0  # counted at first admission only
    assert sched.block_manager.num_prefix_hits == 8
    assert_all_free(sched)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_queue_heads_say_since_when_each_priority_has_waited(mode):
    """From arrival for a new request, from its preemption for a preempted one (waiting or swapped)."""
    clock = FakeClock(5.0)
    sched = make_scheduler(num_swap_blocks=4, preemption_mode=mode, clock=clock, scheduler_policy="priority")
    assert sched.queue_heads() == ()
    a, b, c = fill_pool(sched)
    assert sched.queue_heads() == ()  # all three run
    late = add(sched, list(range(50, 54)), arrival=3.0, priority=2)
    later = add(sched, list(range(60, 64)), arrival=4.0, priority=2)
    clock.now = 9.0
    step(sched, 102)  # c preempted at 9.0 (by the pool); late and later still wait for room
    assert c.num_preemptions == 1 and {late.status, later.status} == {SequenceStatus.WAITING}
    assert sched.queue_heads() == ((0, None, 9.0), (2, None, 3.0))
    required = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING}
    stats = EngineStats(
        **{**required, "last_step_time": None, "is_busy": True, "queue_heads": sched.queue_heads()}
    )
    assert (stats.queue_delay_s(10.0), stats.queue_delay_s(10.0, max_priority=0)) == (7.0, 1.0)
    assert stats.queue_delay_s(10.0, max_priority=-1) == 0.0
    drain(sched)
    assert sched.queue_heads() == ()


def test_is_full_when_a_queued_sequence_finds_no_seat_or_no_blocks_not_when_the_budget_runs_out():
    sched = make_scheduler(max_num_seqs=1)
    add(sched, list(range(10, 14)), arrival=0, max_tokens=3)
    step(sched)
    assert not sched.is_full  # nothing waited
    add(sched, list(range(20, 24)), arrival=1, max_tokens=3)
    step(sched)
    assert sched.is_full  # no seat
    drain(sched)
    assert not sched.is_full

    sched = make_scheduler()
    fill_pool(sched)  # every block taken
    add(sched, list(range(50, 54)), arrival=3)
    step(sched, 102)  # a's decode preempts c for a block; the newcomer waits
    assert sched.is_full
    drain(sched)

    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, list(range(10, 18)), arrival=0, max_tokens=2)
    add(sched, list(range(20, 28)), arrival=1, max_tokens=2)
    step(sched)  # the token budget went to the first: the second gets it next step
    assert len(sched.waiting) == 1 and not sched.is_full
    drain(sched)


def test_swap_preemption_keeps_computed_tokens_and_records_copies():
    sched = make_scheduler(num_swap_blocks=4, preemption_mode="swap")
    a, b, c = fill_pool(sched)
    out = step(sched, 102)
    assert out.preempted == [c]
    assert out.copies.swap_out == [(4, 0), (5, 1), (6, 2), (7, 3)]
    assert c.status == SequenceStatus.SWAPPED
    assert (c.num_computed_tokens, c.block_table) == (16, [])
    assert sched.swapped == [c] and sched.waiting == []
    assert (a.block_table, b.block_table) == ([0, 1, 7], [2, 3, 6])

    out = step(sched, 103)  # 4 host blocks do not fit in 2 free device blocks yet
    assert chunks(out) == [(a, 9, 1, 1), (b, 9, 1, 1)]
    assert out.copies.swap_in == [] and sched.swapped == [c]

    out = step(sched, 104)
    assert out.copies.swap_in == [(0, 6), (1, 7), (2, 5), (3, 4)]
    assert out.copies.swap_out == []
    assert chunks(out) == [(c, 16, 1, 1)]  # only its last sampled token is missing
    assert c.output_token_ids == [101, 104]
    assert c.status == SequenceStatus.FINISHED_LENGTH
    assert_all_free(sched)


def test_swap_falls_back_to_recompute_without_host_blocks():
    sched = make_scheduler(num_swap_blocks=2, preemption_mode="swap")
    a, b, c = fill_pool(sched)
    out = step(sched)
    assert out.preempted == [c] and out.copies.swap_out == []
    assert c.status == SequenceStatus.PREEMPTED and sched.waiting == [c]
    drain(sched)
    assert c.output_token_ids == [101, 7]
    assert_all_free(sched)


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_last():
    sched = make_scheduler()
    a = add(sched, list(range(16)), arrival=0, max_tokens=2)
    b = add(sched, list(range(100, 116)), arrival=1, max_tokens=2)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)  # a needs a block and preempts b; b is gone before its turn
    assert out.preempted == [b] and chunks(out) == [(a, 16, 1, 1)]
    drain(sched)
    assert b.output_token_ids == [7, 7] and b.num_preemptions == 1
    assert_all_free(sched)


# --- priority -------------------------------------------------------------------------------------
def test_priority_orders_admission_by_priority_value():
    sched = make_scheduler(scheduler_policy="priority", max_num_seqs=1)
    low = add(sched, [1, 2], arrival=0, priority=2, max_tokens=1)
    high = add(sched, [3, 4], arrival=1, priority=0, max_tokens=1)
    mid = add(sched, [5, 6], arrival=2, priority=1, max_tokens=1)
    order = [chunks(step(sched))[0][0] for _ in range(3)]
    assert order == [high, mid, low]
    assert_all_free(sched)


def test_priority_preempts_the_least_important_running_sequence():
    sched = make_scheduler(scheduler_policy="priority")
    low = add(sched, list(range(10, 26)), arrival=0, priority=5, max_tokens=2)
    mid = add(sched, list(range(30, 46)), arrival=1, priority=1, max_tokens=3)
    out = step(sched)
    assert chunks(out) == [(mid, 0, 16, 1), (low, 0, 16, 1)]
    assert (mid.block_table, low.block_table) == ([0, 1, 2, 3], [4, 5, 6, 7])

    high = add(sched, [50, 51, 52], arrival=2, priority=0, max_tokens=2)
    out = step(sched)
    assert out.preempted == [low]
    assert low.status == SequenceStatus.PREEMPTED and low.num_computed_tokens == 0
    assert chunks(out) == [(mid, 16, 1, 1)]  # high waits one step: nothing is admitted after a preemption
    assert mid.block_table == [0, 1, 2, 3, 7]

    out = step(sched)
    assert out.preempted == []
    assert chunks(out) == [(mid, 17, 1, 1), (high, 0, 3, 1)]
    assert high.block_table == [6]
    assert mid.is_finished
    assert sched.waiting == [low]  # low's 2 cached blocks + 3 more do not fit yet

    out = step(sched)
    assert chunks(out) == [
        (high, 3, 1, 1),
        (low, 8, 8, 0),
    ]  # the rest of low's prompt, then its token replayed
    out = step(sched)
    assert chunks(out) == [(low, 16, 1, 1)]
    assert low.output_token_ids == [7, 7]
    assert_all_free(sched)


def test_priority_swap_preemption_admits_the_more_important_request():
    # regression: the swapped-out low-priority sequence was swapped back in ahead of the waiting
    # high-priority one it had been preempted for, then preempted again, every other step
    sched = make_scheduler(num_swap_blocks=8, scheduler_policy="priority", preemption_mode="swap")
    mid = add(sched, list(range(30, 46)), arrival=0, priority=1, max_tokens=8)
    low = add(sched, list(range(10, 18)), arrival=1, priority=5, max_tokens=4)
    step(sched)
    assert (mid.block_table, low.block_table) == ([0, 1, 2, 3], [4, 5])
    high = add(sched, list(range(50, 62)), arrival=2, priority=0, max_tokens=2)
    out = step(sched)
    assert out.preempted == [low] and out.copies.swap_out == [(4, 0), (5, 1)]
    assert chunks(out) == [(mid, 16, 1, 1)]
    out = step(sched)
    assert out.copies.swap_in == []
    assert chunks(out) == [(mid, 17, 1, 1), (high, 0, 12, 1)]
    assert low.status == SequenceStatus.SWAPPED
    drain(sched)
    assert (mid.num_output_tokens, low.num_output_tokens, high.num_output_tokens) == (8, 4, 2)
    assert_all_free(sched)


def test_waiting_request_does_not_overtake_a_swapped_one():
    # regression: a newcomer was admitted while an earlier swapped sequence waited for room
    sched = make_scheduler(num_swap_blocks=4, preemption_mode="swap")
    a, b, c = fill_pool(sched)
    step(sched)
    assert sched.swapped == [c]
    d = add(sched, [90, 91], arrival=3, max_tokens=1)
    out = step(sched)  # 2 free blocks: enough for d, not for c
    assert chunks(out) == [(a, 9, 1, 1), (b, 9, 1, 1)]
    assert d.status == SequenceStatus.WAITING
    out = step(sched)
    assert out.copies.swap_in == [(0, 6), (1, 7), (2, 5), (3, 4)]
    assert chunks(out) == [(c, 16, 1, 1), (d, 0, 2, 1)]
    assert d.is_finished and c.is_finished
    assert_all_free(sched)


# --- hybrid -----------------------------------------------------------------------------------------
def test_hybrid_schedules_decodes_before_prefills_and_caps_prefill_tokens():
    sched = make_scheduler(scheduler_policy="hybrid", max_num_batched_tokens=8, max_prefill_tokens=3)
    a = add(sched, list(range(10, 17)), arrival=0, max_tokens=1)  # 7 tokens: 3 + 3 + 1
    out = step(sched)
    assert chunks(out) == [(a, 0, 3, 0)]
    b = add(sched, [20, 21], arrival=1, max_tokens=3)
    out = step(sched)
    assert chunks(out) == [(a, 3, 3, 0)]  # the prefill budget is spent: b waits
    out = step(sched)
    assert chunks(out) == [(a, 6, 1, 1), (b, 0, 2, 1)]
    assert a.is_finished
    c = add(sched, list(range(30, 40)), arrival=2, max_tokens=1)
    out = step(sched)
    # 8 tokens of budget, but c's prefill gets only 3 of them
    assert chunks(out) == [(b, 2, 1, 1), (c, 0, 3, 0)]
    d = add(sched, [50], arrival=3, max_tokens=1)
    out = step(sched)
    assert chunks(out) == [(b, 3, 1, 1), (c, 3, 3, 0)]  # d waits: prefill budget spent
    assert d.status == SequenceStatus.WAITING
    drain(sched)
    assert_all_free(sched)


def test_hybrid_decode_goes_before_a_more_important_running_prefill():
    sched = make_scheduler(scheduler_policy="hybrid", max_num_batched_tokens=8, max_prefill_tokens=4)
    a = add(sched, [1, 2], arrival=0, max_tokens=3)
    assert chunks(step(sched)) == [(a, 0, 2, 1)]
    b = add(sched, list(range(10, 22)), arrival=0.5, priority=-1, max_tokens=1)
    assert chunks(step(sched)) == [(a, 2, 1, 1), (b, 0, 4, 0)]
    # b sorts first (priority -1), but a decodes: a goes first
    assert chunks(step(sched)) == [(a, 3, 1, 1), (b, 4, 4, 0)]
    assert chunks(step(sched)) == [(b, 8, 4, 1)]
    assert_all_free(sched)


def test_hybrid_aging_lets_an_old_low_priority_request_overtake():
    clock = FakeClock(10.0)
    sched = make_scheduler(scheduler_policy="hybrid", max_num_seqs=1, aging_seconds=5.0, clock=clock)
    old = add(sched, [1, 2], arrival=0.0, priority=1, max_tokens=1)  # 10 s old: 1 - 2 = -1
    new = add(sched, [3, 4], arrival=10.0, priority=0, max_tokens=1)
    assert chunks(step(sched))[0][0] is old
    assert chunks(step(sched))[0][0] is new
    assert_all_free(sched)


def test_hybrid_without_enough_aging_keeps_priority_order():
    clock = FakeClock(4.0)
    sched = make_scheduler(scheduler_policy="hybrid", max_num_seqs=1, aging_seconds=5.0, clock=clock)
    old = add(sched, [1, 2], arrival=0.0, priority=1, max_tokens=1)  # 4 s old: not a level yet
    new = add(sched, [3, 4], arrival=4.0, priority=0, max_tokens=1)
    assert chunks(step(sched))[0][0] is new
    assert chunks(step(sched))[0][0] is old
    assert_all_free(sched)


def test_hybrid_aging_does_not_ping_pong_preemptions():
    # regression: running sequences were not aged but preempted ones were (from arrival), so two
    # sequences preempted each other every step and a chunked prefill never finished
    clock = FakeClock(0.0)
    sched = make_scheduler(
        scheduler_policy="hybrid",
        max_num_seqs=1,
        max_num_batched_tokens=8,
        max_prefill_tokens=4,
        aging_seconds=5.0,
        clock=clock,
    )
    a = add(sched, list(range(10, 22)), arrival=0.0, priority=0, max_tokens=2)
    b = add(sched, [30, 31], arrival=0.0, priority=1, max_tokens=1)
    assert chunks(step(sched)) == [(a, 0, 4, 0)]
    clock.now = 10.0
    for _ in range(10):
        if not sched.has_unfinished:
            break
        step(sched)
    assert a.is_finished and b.is_finished
    assert a.num_preemptions == 0 and sched.num_preemptions == 0
    assert_all_free(sched)


# --- n > 1 -------------------------------------------------------------------------------------------
def test_n_2_fans_out_at_the_first_sample_and_shares_the_prompt_blocks():
    sched = make_scheduler()
    parent = add(sched, [1, 2, 3, 4, 5, 6], n=2, max_tokens=2)
    out = sched.schedule()
    assert chunks(out) == [(parent, 0, 6, 2)]
    updated = sched.postprocess(out, {parent.seq_id: [SampledToken(40), SampledToken(41)]})
    assert len(updated) == 2 and updated[0] is parent
    child = updated[1]
    assert (child.request_id, child.index, child.is_forked) == (parent.request_id, 1, True)
    assert (parent.output_token_ids, child.output_token_ids) == ([40], [41])
    assert child.block_table == parent.block_table == [0, 1]
    assert [block.ref_count for block in sched.block_manager.blocks[:2]] == [2, 2]
    assert sched.running == [parent, child]

    out = step(sched, lambda seq: 50 + seq.index)
    assert chunks(out) == [(parent, 6, 1, 1), (child, 6, 1, 1)]
    assert out.copies.copy == [(1, 2)]  # the shared, partly filled block 1 is copied for the parent
    assert (parent.output_token_ids, child.output_token_ids) == ([40, 50], [41, 51])
    assert parent.is_finished and child.is_finished
    assert_all_free(sched)


def test_n_2_child_preempted_by_recompute_samples_one_token():
    sched = make_scheduler()
    other = add(sched, list(range(100, 116)), arrival=0, max_tokens=4)
    parent = add(sched, list(range(10)), arrival=1, n=2, max_tokens=3)
    out = step(sched)
    assert chunks(out) == [(other, 0, 16, 1), (parent, 0, 10, 2)]
    child = sched.running[2]
    assert (other.block_table, parent.block_table, child.block_table) == ([0, 1, 2, 3], [4, 5, 6], [4, 5, 6])

    # the parent's copy-on-write needs the last free block: the child, later, is preempted instead
    out = step(sched)
    assert out.preempted == [child]
    assert chunks(out) == [(other, 16, 1, 1), (parent, 10, 1, 1)]
    assert out.copies.copy == []  # block 6 is the parent's alone again: written in place
    assert (other.block_table, parent.block_table) == ([0, 1, 2, 3, 7], [4, 5, 6])
    assert child.status == SequenceStatus.PREEMPTED and child.output_token_ids == [7]

    out = step(sched)
    assert chunks(out) == [(other, 17, 1, 1), (parent, 11, 1, 1)]
    assert parent.is_finished and sched.waiting == [child]

    out = step(sched)  # the child recomputes the rest of its prompt from the parent's cached prompt blocks
    assert chunks(out) == [(other, 18, 1, 1), (child, 8, 2, 0)]
    assert child.block_table == [4, 5, 6]
    out = step(sched)  # then replays its token as the decode it was, and samples once
    assert chunks(out) == [(child, 10, 1, 1)]
    out = step(sched)
    assert chunks(out) == [(child, 11, 1, 1)]
    assert (parent.num_output_tokens, child.num_output_tokens, other.num_output_tokens) == (3, 3, 4)
    assert_all_free(sched)


# --- abort -------------------------------------------------------------------------------------------
def test_abort_mid_prefill_frees_everything_and_twice_is_a_no_op():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = add(sched, list(range(10)), max_tokens=4)
    step(sched)
    assert (a.num_computed_tokens, a.block_table) == (4, [0])
    sched.abort_seq(a)
    assert a.status == SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_table == []
    sched.abort_seq(a)
    assert a.status == SequenceStatus.FINISHED_ABORTED
    assert_all_free(sched)


def test_abort_mid_decode_and_between_schedule_and_postprocess():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3, 4, 5], max_tokens=10)
    b = add(sched, [6, 7, 8], arrival=1, max_tokens=10)
    step(sched)
    step(sched)
    sched.abort_seq(a)
    assert a.output_token_ids == [7, 7] and sched.running == [b]
    out = sched.schedule()
    assert chunks(out) == [(b, 4, 1, 1)]
    sched.abort_seq(b)  # the step is already running
    assert sched.postprocess(out, {b.seq_id: [SampledToken(9)]}) == []
    assert b.output_token_ids == [7, 7]
    sched.abort_seq(b)
    assert_all_free(sched)


def test_abort_while_waiting_preempted_and_swapped():
    sched = make_scheduler(num_swap_blocks=4, preemption_mode="swap")
    a, b, c = fill_pool(sched)
    d = add(sched, [90, 91], arrival=3)
    step(sched)
    assert c.status == SequenceStatus.SWAPPED and d.status == SequenceStatus.WAITING
    sched.abort_seq(c)
    sched.abort_seq(d)
    sched.abort_seq(c)
    assert sched.swapped == [] and sched.waiting == []
    assert sorted(sched.block_manager.free_swap_blocks) == [0, 1, 2, 3]
    for seq in (a, b):
        sched.abort_seq(seq)
    assert_all_free(sched)

    sched = make_scheduler()
    a, b, c = fill_pool(sched)
    step(sched)
    assert c.status == SequenceStatus.PREEMPTED
    sched.abort_seq(c)
    assert c.status == SequenceStatus.FINISHED_ABORTED and sched.waiting == []
    drain(sched)
    assert_all_free(sched)


def test_abort_a_fanned_out_family():
    sched = make_scheduler()
    parent = add(sched, [1, 2, 3, 4, 5, 6], n=3, max_tokens=5)
    step(sched)
    family = list(sched.running)
    assert len(family) == 3 and sched.block_manager.blocks[1].ref_count == 3
    out = step(sched)
    assert out.copies.copy == [(1, 2), (1, 3)]
    for seq in family:
        sched.abort_seq(seq)
    assert parent.is_finished
    assert_all_free(sched)


# --- admission and finishing ------------------------------------------------------------------------
def test_full_waiting_queue_raises_overloaded():
    sched = make_scheduler(max_num_waiting=2)
    add(sched, [1])
    add(sched, [2])
    with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
        add(sched, [3])
    assert len(sched.waiting) == 2
    sched.schedule()
    add(sched, [3])  # admitted ones no longer count
    for seq in list(sched.running) + list(sched.waiting):
        sched.abort_seq(seq)
    assert_all_free(sched)


def test_finish_by_max_tokens():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3], max_tokens=2)
    step(sched, 5)
    assert a.status == SequenceStatus.RUNNING
    step(sched, 6)
    assert (a.status, a.finish_reason, a.stop_reason) == (SequenceStatus.FINISHED_LENGTH, "length", None)
    assert a.output_token_ids == [5, 6]
    assert_all_free(sched)


def test_finish_by_eos_and_ignore_eos():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3], eos=2, max_tokens=10)
    b = add(sched, [1, 2, 3], arrival=1, eos=2, ignore_eos=True, max_tokens=2)
    step(sched, 9)
    step(sched, 2)
    assert (a.status, a.finish_reason, a.stop_reason) == (SequenceStatus.FINISHED_STOPPED, "stop", None)
    assert a.output_token_ids == [9, 2]
    assert b.status == SequenceStatus.FINISHED_LENGTH and b.output_token_ids == [9, 2]
    assert_all_free(sched)


def test_finish_by_stop_token_id():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3], stop_token_ids=[5, 6], max_tokens=10)
    step(sched, 4)
    step(sched, 6)
    assert (a.status, a.stop_reason) == (SequenceStatus.FINISHED_STOPPED, 6)
    assert a.output_token_ids == [4, 6]
    assert_all_free(sched)


def test_min_tokens_suppresses_an_early_stop():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3], eos=2, stop_token_ids=[5], min_tokens=2, max_tokens=10)
    step(sched, 2)
    assert a.status == SequenceStatus.RUNNING
    step(sched, 5)
    assert (a.status, a.stop_reason) == (SequenceStatus.FINISHED_STOPPED, 5)
    assert a.output_token_ids == [2, 5]
    assert_all_free(sched)


def test_max_model_len_caps_max_tokens():
    sched = make_scheduler()
    a = Sequence(
        request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=None), max_model_len=5
    )
    sched.add_seq(a)
    step(sched)
    step(sched)
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.num_tokens == 5
    assert_all_free(sched)
