"""Token-fair scheduling between tenants (engine/core/fairness.py, engine/core/scheduler.py): the
virtual token counter, and the scheduler's order over a tiny pool driven by hand."""

import pytest

from engine.core.fairness import CONTENTION_WINDOW_S, VirtualTokenCounter
from engine.core.sequence import Sequence
from engine.fair_share import FairShare
from tests.fakes import FakeClock
from tests.unit.engine.test_scheduler import add, assert_all_free, chunks, drain, make_scheduler, step

A, B = FairShare("a"), FairShare("b")


def test_counter_charges_cost_over_weight_and_lifts_a_returning_tenant_to_a_steps_head_start():
    vtc = VirtualTokenCounter()
    heavy = FairShare("heavy", weight=2.0, prefill_cost=1.0, decode_cost=4.0, contended_prefill_tokens=8)
    light = FairShare("a", contended_prefill_tokens=4)
    vtc.join(heavy)
    vtc.charge(heavy, 10, is_prefill=True)  # 10 x 1 / 2
    vtc.charge(heavy, 3, is_prefill=False)  # 3 x 4 / 2
    assert vtc.value(heavy) == 11.0
    # new while heavy is active: one step (4 tokens) behind heavy's 11, not at 0 with 11 to spend at once
    vtc.join(light)
    assert vtc.value(light) == 7.0
    vtc.charge(light, 5, is_prefill=True)
    vtc.leave(heavy)
    vtc.charge(light, 100, is_prefill=True)  # a's counter runs on while heavy is idle
    vtc.join(heavy)
    assert vtc.value(heavy) == 108.0  # lifted to the least served (112) less a step of its own (8 x 1 / 2)
    vtc.join(heavy)  # a second sequence of an active tenant: no lift
    vtc.leave(light)
    vtc.leave(heavy)
    vtc.join(light)  # back while heavy is active, its own counter past heavy's: kept
    assert vtc.value(light) == 112.0
    assert vtc.value(None) == 0.0
    vtc.leave(heavy)
    vtc.leave(light)
    assert not vtc.active


@pytest.mark.parametrize("field", ["weight", "prefill_cost", "decode_cost"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_a_share_needs_positive_finite_weights(field, value):
    with pytest.raises(ValueError, match=field):
        FairShare("t", **{field: value})


def test_contention_caps_a_steps_prefill_while_two_tenants_have_had_work_lately():
    clock = FakeClock()
    vtc = VirtualTokenCounter(clock)
    small, big = FairShare("a", contended_prefill_tokens=64), FairShare("b", contended_prefill_tokens=512)
    vtc.join(small)
    vtc.join(small)
    assert vtc.prefill_cap() is None  # one tenant: nobody to wait for its chunks
    vtc.join(big)
    assert vtc.prefill_cap() == 64  # the least of the contending tenants'
    vtc.leave(small)
    vtc.leave(small)
    clock.advance(CONTENTION_WINDOW_S - 0.1)
    assert vtc.prefill_cap() == 64  # a between its requests still contends: its next prompt is coming
    clock.advance(0.2)
    assert vtc.prefill_cap() is None
    vtc.join(small)
    assert vtc.prefill_cap() == 64


def test_while_tenants_contend_a_prompt_within_twice_the_cap_runs_whole_a_longer_one_in_chunks():
    """A light tenant's chat is not split (its second part would wait for the other tenant's chunk between
    them); a long prompt's chunks, and every chunk of a started one, keep to the cap: the step that a newly
    arrived prompt waits for stays short."""
    sched = make_fair_scheduler(max_num_batched_tokens=32, max_num_seqs=8)
    long = shared(sched, 12, FairShare("a", contended_prefill_tokens=4), arrival=0)
    chat = shared(sched, 7, FairShare("b", contended_prefill_tokens=4), arrival=1)
    assert chunks(step(sched)) == [(long, 0, 4, 0)]  # a tie, to the earlier: 12 > 2 x 4, a chunk of 4
    assert chunks(step(sched)) == [(chat, 0, 7, 1)]  # b, whole (7 <= 2 x 4)
    assert chunks(step(sched)) == [(long, 4, 4, 0)]  # started: chunks of 4, though the rest (8) would fit
    assert chunks(step(sched)) == [(long, 8, 4, 1)]
    assert_all_free(sched)


def test_a_prompt_that_fits_whole_past_its_cached_prefix_is_not_taken_for_a_chunk():
    """b's step: a first prompt past the cap spends the chunk room; a second prompt whose first block is
    cached fits whole in what is left, and runs (its cached tokens are not a chunk computed before)."""
    clock = FakeClock(0.0)
    sched = make_fair_scheduler(
        clock=clock, enable_prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=32
    )
    share_a, share_b = FairShare("a", contended_prefill_tokens=6), FairShare("b", contended_prefill_tokens=6)
    flood = shared(sched, 12, share_a, arrival=0, max_tokens=2)
    assert chunks(step(sched)) == [(flood, 0, 12, 1)]  # one tenant: whole
    earlier = add(sched, list(range(50, 58)), arrival=1, share=share_b, max_tokens=1)
    assert [c for c in chunks(step(sched)) if c[0] is earlier] == [
        (earlier, 0, 8, 1)
    ]  # its blocks stay cached
    assert flood.is_finished and earlier.is_finished
    first = add(sched, list(range(60, 67)), arrival=2, share=share_b, max_tokens=1)
    second = add(sched, [50, 51, 52, 53, 99], arrival=3, share=share_b, max_tokens=1)  # 4 tokens cached
    assert chunks(step(sched)) == [(first, 0, 7, 1), (second, 4, 1, 1)]  # 7 > 6 spends the chunk room
    assert_all_free(sched)


@pytest.mark.parametrize("other_share", [None, FairShare("d")])
def test_within_a_band_a_waiting_tenant_does_not_preempt_what_the_queue_would_take_back_first(other_share):
    """priority policy, seats for 4: c's request (2 seats) is older by id than the other's (3 seats), so by
    the policy's own order it preempted the other, which the queue (by counters) then admitted again ahead
    of it: 1,000 preemptions and c never ran (found by the property test). Within a band only the queue's
    order counts: c waits for the seats."""
    sched = make_fair_scheduler(scheduler_policy="priority", max_num_seqs=4, max_num_batched_tokens=4)
    share_c = FairShare("c", 0.5, 2.0, 1.0, contended_prefill_tokens=2)
    light = add(sched, [1], priority=2, share=share_c, n=2, max_tokens=1)
    other = add(sched, [2, 3, 4, 5], priority=2, share=other_share, n=3, max_tokens=1)
    urgent = add(sched, [6], arrival=0.5, priority=0, share=FairShare("a"), max_tokens=1)
    drain(sched, max_steps=30)
    assert all(seq.is_finished for seq in (light, other, urgent))
    assert other.num_preemptions <= 1
    assert_all_free(sched)


def test_a_long_prompt_runs_short_chunks_while_another_tenant_contends():
    clock = FakeClock(0.0)
    sched = make_fair_scheduler(clock=clock, max_num_batched_tokens=16)
    capped = FairShare("a", contended_prefill_tokens=4)
    long = shared(sched, 30, capped, arrival=0)
    assert chunks(step(sched)) == [(long, 0, 16, 0)]  # alone: the whole budget
    short = shared(sched, 3, FairShare("b", contended_prefill_tokens=4), arrival=1)
    assert chunks(step(sched)) == [(short, 0, 3, 1)]  # b joins a step (4) behind a's 16: b's prompt first
    assert chunks(step(sched)) == [(long, 16, 4, 0)]  # then a's chunk, short
    assert chunks(step(sched)) == [(long, 20, 4, 0)]  # b is done, yet may come back: short chunks
    clock.advance(CONTENTION_WINDOW_S + 1)
    assert chunks(step(sched)) == [(long, 24, 6, 1)]  # b gone quiet: the rest at once (6 > 4)
    drain(sched)
    assert_all_free(sched)


def shared(sched, prompt_len: int, share: FairShare, arrival: float, max_tokens: int = 1) -> Sequence:
    prompt = [1 + (i + int(arrival * 7)) % 40 for i in range(prompt_len)]
    return add(sched, prompt, arrival=arrival, share=share, max_tokens=max_tokens)


def make_fair_scheduler(**overrides):
    settings = {"enable_prefix_caching": False, "max_num_seqs": 2, "max_num_batched_tokens": 8} | overrides
    return make_scheduler(**settings)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "hybrid"])
def test_a_short_request_of_another_tenant_goes_before_a_flood(policy):
    sched = make_fair_scheduler(scheduler_policy=policy, max_num_seqs=1, max_num_batched_tokens=16)
    flood = [shared(sched, 6, A, arrival=i / 100) for i in range(4)]  # hybrid's aging: in one band
    assert chunks(step(sched)) == [(flood[0], 0, 6, 1)]
    late = shared(sched, 2, B, arrival=0.1)
    assert sched.fair.value(B) == 0 < sched.fair.value(A) == 6  # a step of b's own (128) behind a's, at most
    order = []
    for out in drain(sched):
        order += [item.seq for item in out.scheduled if item.start == 0]
    assert order == [late, *flood[1:]]  # b arrived last but is admitted at the first free seat
    assert_all_free(sched)


def test_without_tenants_the_same_queue_is_served_first_come_first_served():
    sched = make_fair_scheduler(max_num_seqs=1)
    seqs = [add(sched, [1, 2, 3, 4, 5, 6], arrival=i, max_tokens=1) for i in range(4)]
    late = add(sched, [9, 9], arrival=10, max_tokens=1)
    order = []
    for out in drain(sched):
        order += [item.seq for item in out.scheduled if item.start == 0]
    assert order == [*seqs, late]


def test_a_running_prefill_waits_its_next_chunk_for_a_less_served_tenant():
    sched = make_fair_scheduler(max_num_batched_tokens=4)
    long = shared(sched, 12, A, arrival=0)
    assert chunks(step(sched)) == [(long, 0, 4, 0)]
    short = shared(sched, 3, B, arrival=1)
    assert sched.fair.value(B) < sched.fair.value(A) == 4  # b joins behind a's counter
    # b is the less served: b's prompt goes alone (its step as short as its prompt), a's chunk next
    assert chunks(step(sched)) == [(short, 0, 3, 1)]
    assert chunks(step(sched)) == [(long, 4, 4, 0)]  # b finished (max_tokens 1): a alone again
    drain(sched)
    assert_all_free(sched)


def test_the_same_prompt_without_tenants_keeps_its_chunks():
    sched = make_fair_scheduler(max_num_batched_tokens=4)
    long = add(sched, list(range(1, 13)), arrival=0, max_tokens=1)
    step(sched)
    short = add(sched, [7, 8, 9], arrival=1, max_tokens=1)
    assert chunks(step(sched)) == [(long, 4, 4, 0)]
    assert chunks(step(sched)) == [(long, 8, 4, 1)]
    assert chunks(step(sched)) == [(short, 0, 3, 1)]


def test_weights_share_admissions_by_tokens_served():
    """Equal requests from a (weight 1) and b (weight 4), more than either could send alone: b gets
    four admissions for each of a's while both have requests queued."""
    sched = make_fair_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    heavy = FairShare("b", weight=4.0)
    for i in range(8):
        shared(sched, 4, A, arrival=i)
        shared(sched, 4, heavy, arrival=i + 0.5)
    order = []
    for out in drain(sched, max_steps=100):
        order += [item.seq.share.tenant for item in out.scheduled if item.start == 0]
    assert order[:10].count("b") == 8  # while both have requests queued: 4 to 1 (ties to fewer in flight)
    assert_all_free(sched)


def test_decode_tokens_count_too():
    """A tenant whose requests generate long outputs is charged for them: the other's next request
    goes first although it was served as many prompt tokens."""
    sched = make_fair_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    talker = shared(sched, 4, A, arrival=0, max_tokens=6)
    quiet = shared(sched, 4, B, arrival=0.5, max_tokens=1)
    step(sched)
    step(sched)
    step(sched)  # a: 4 prompt tokens + 2 decodes (x 2) = 8; b: 4 prompt tokens, finished
    assert (sched.fair.value(A), sched.fair.value(B)) == (8.0, 4.0) and quiet.is_finished
    again_a = shared(sched, 4, A, arrival=5)
    again_b = shared(sched, 4, B, arrival=6)
    out = step(sched)
    assert [item.seq for item in out.scheduled if item.start == 0] == [again_b]  # one seat free: b's
    assert not again_a.first_scheduled_time
    drain(sched)
    assert talker.is_finished
    assert_all_free(sched)


def test_queue_heads_say_each_tenant_apart():
    sched = make_fair_scheduler(max_num_seqs=1)
    shared(sched, 4, A, arrival=1.0)
    shared(sched, 4, A, arrival=2.0)
    shared(sched, 4, B, arrival=3.0)
    assert sched.queue_heads() == ((0, "a", 1.0), (0, "b", 3.0))
    step(sched)  # b's (a tie at 0: b has fewer in flight)
    assert sched.queue_heads() == ((0, "a", 1.0),)


def test_a_deferred_chunk_runs_when_the_queue_cannot_take_its_seat():
    """b is less served but finds no seat (a holds the only one): a's chunk is not held back for it."""
    sched = make_fair_scheduler(max_num_batched_tokens=4, max_num_seqs=1)
    long = shared(sched, 12, A, arrival=0)
    step(sched)
    short = shared(sched, 3, B, arrival=1)
    assert chunks(step(sched)) == [(long, 4, 4, 0)]  # a tie at 4: a's chunk
    out = step(sched)  # b (4) is less served than a (8), but no seat is free: a's last chunk runs
    assert chunks(out) == [(long, 8, 4, 1)] and sched.is_full and long.is_finished
    assert chunks(step(sched)) == [(short, 0, 3, 1)]
    assert_all_free(sched)


def test_the_floods_new_prompts_do_not_take_what_its_running_ones_were_deferred_from():
    """A step that admits b's prompt ahead of a's running chunk admits none of a's queued prompts either:
    else each of b's arrivals would start one more of a's prompts, until a's half-done prompts hold
    every seat (measured: 128 of 128 after 25 s of benchmarks/fairness.py)."""
    sched = make_fair_scheduler(max_num_batched_tokens=8, max_num_seqs=8)
    running = shared(sched, 20, A, arrival=0)
    step(sched)
    queued = [shared(sched, 20, A, arrival=1 + i) for i in range(3)]
    step(sched)  # a's running chunk (its queued ones wait behind it: the budget is spent)
    short = shared(sched, 3, B, arrival=9)
    out = step(sched)
    assert chunks(out) == [(short, 0, 3, 1)]  # b alone: a's chunk waits, a's queued prompts wait too
    assert sched.running == [running]  # b finished (max_tokens 1)
    assert all(seq in sched.waiting for seq in queued)
    drain(sched, max_steps=100)
    assert_all_free(sched)


def test_while_tenants_contend_a_steps_prompt_tokens_are_one_tenants():
    """b's prompt gets a step of its own prompt tokens (beside decodes): a's queued prompts, which would
    fill the rest of the cap, wait a step, so b's first token waits for a short step, not a full one."""
    clock = FakeClock(0.0)
    sched = make_fair_scheduler(clock=clock, max_num_seqs=8, max_num_batched_tokens=64)
    share_a, share_b = (
        FairShare("a", contended_prefill_tokens=16),
        FairShare("b", contended_prefill_tokens=16),
    )
    flood = [shared(sched, 4, share_a, arrival=i / 10, max_tokens=3) for i in range(2)]
    assert [c[0] for c in chunks(step(sched))] == flood  # one tenant: every prompt at once
    chat = shared(sched, 3, share_b, arrival=1)
    more = [shared(sched, 4, share_a, arrival=1 + i / 10, max_tokens=1) for i in range(2)]
    first = chunks(step(sched))
    assert [c for c in first if c[1] == 0] == [(chat, 0, 3, 1)]  # b's prompt alone ...
    assert {c[0] for c in first} == {chat, *flood}  # ... beside a's decodes
    second = chunks(step(sched))
    assert [c for c in second if c[1] == 0] == [(more[0], 0, 4, 1), (more[1], 0, 4, 1)]  # a's, in the cap
    drain(sched)
    assert_all_free(sched)


def test_a_tenants_step_takes_its_other_queued_prompts_though_it_passes_the_flood():
    """b's first prompt puts b past a (a's running chunk is deferred for it): b's second prompt, queued
    beside it, still joins b's step. a's prompts and chunks cannot join a step whose prompt tokens are b's,
    so holding b's second one back would only leave the cap's room empty and b's prompt a step behind a's
    next chunk (seen in benchmarks/fairness.py: a chat turn's first token a whole flood chunk later)."""
    sched = make_fair_scheduler(max_num_seqs=8, max_num_batched_tokens=8)
    share_a, share_b = (
        FairShare("a", contended_prefill_tokens=4),
        FairShare("b", contended_prefill_tokens=4),
    )
    flood = shared(sched, 16, share_a, arrival=0)
    assert chunks(step(sched)) == [(flood, 0, 8, 0)]  # one tenant: the whole budget
    earlier = shared(sched, 4, share_b, arrival=1, max_tokens=2)  # b joins a step (4) behind a's 8
    assert chunks(step(sched)) == [(earlier, 0, 4, 1)]
    assert chunks(step(sched)) == [(flood, 8, 4, 0), (earlier, 4, 1, 1)]  # a's chunk, b's decode (x 2)
    assert earlier.is_finished and (sched.fair.value(share_b), sched.fair.value(share_a)) == (10.0, 12.0)
    queued = [shared(sched, 4, share_a, arrival=2 + i) for i in range(2)]
    first, second = shared(sched, 3, share_b, arrival=4), shared(sched, 1, share_b, arrival=5)
    # b, back with its own 10 (past the 8 a lift would give), is the less served: b's step
    assert chunks(step(sched)) == [(first, 0, 3, 1), (second, 0, 1, 1)]
    assert sched.fair.value(share_b) > sched.fair.value(share_a)  # b passed a within its step
    # then a's chunk, at the contended cap, and a's next prompt whole in the rest of twice the cap
    assert chunks(step(sched)) == [(flood, 12, 4, 1), (queued[0], 0, 4, 1)]
    assert queued[1] in sched.waiting
    drain(sched, max_steps=100)
    assert_all_free(sched)
