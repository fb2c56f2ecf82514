"""Speculative decoding without a model: the n-gram lookup, the drafts the scheduler runs and what it
keeps of them (K/V positions, blocks), the sampler's chain over a draft's rows, and the config."""

import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import SampledToken, Sequence
from engine.core.speculative import lookup
from engine.executor.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams
from tests.unit.engine.test_scheduler import NUM_BLOCKS, add, assert_all_free, make_scheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


# --- the lookup ---------------------------------------------------------------------------------------
def test_lookup_takes_what_followed_the_last_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 2, 3, 4, 5, 6, 3]
    assert lookup(tokens, 1, 1, 3) == (4, 5, 6)  # the last 3 before the end is followed by 4, 5, 6
    assert lookup(tokens + [4], 1, 2, 2) == (5, 6)  # (3, 4) matched, not 4 alone
    assert lookup([5, 1, 7, 5, 2, 7], 1, 2, 4) == (5, 2, 7)  # (2, 7) never came before; 7 did, at 2
    assert lookup([1, 2, 3], 1, 3, 4) == ()  # nothing repeats
    assert lookup([4, 4, 4], 1, 2, 3) == (4,)  # (4, 4) at 0 overlaps the suffix: one token follows it


def test_lookup_matches_whole_tokens_only():
    # 256's second byte and the zeros after it spell 1 in the packed array: only whole tokens may match
    assert lookup([1, 77, 256, 0, 1], 1, 1, 1) == (77,)
    assert lookup([1 << 8, 1, 5, 1 << 8], 1, 1, 2) == (1, 5)
    assert lookup([0, 1, 9, 1 << 56], 1, 1, 2) == ()


# --- the scheduler ------------------------------------------------------------------------------------
def spec_scheduler(**overrides) -> Scheduler:
    return make_scheduler(speculative_config=NGRAM, **overrides)


def run_step(sched: Scheduler, accept: int, next_token: int = 8):
    """One step where every draft keeps its first `accept` tokens, then `next_token` is drawn."""
    out = sched.schedule()
    sampled = {}
    for item in out.scheduled:
        if item.draft:
            kept = item.draft[:accept]
            sampled[item.seq.seq_id] = [SampledToken(t) for t in kept] + [SampledToken(next_token)]
        elif item.num_samples:
            sampled[item.seq.seq_id] = [SampledToken(next_token)] * item.num_samples
    sched.postprocess(out, sampled)
    return out


def test_a_decode_runs_its_draft_and_keeps_what_the_sampler_kept():
    sched = spec_scheduler()
    seq = add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=20)
    run_step(sched, accept=0, next_token=6)  # the prompt; its first token, 6
    out = sched.schedule()
    [item] = out.scheduled
    assert (item.start, item.draft, item.num_new_tokens) == (7, (7, 5, 6), 4)  # after (5, 6): 7, 5, 6
    assert item.num_samples == 1
    assert [item.token_id_at(p) for p in range(7, 11)] == [6, 7, 5, 6]
    assert len(seq.block_table) == 3  # 11 positions
    sched.postprocess(out, {seq.seq_id: [SampledToken(7), SampledToken(9)]})  # 7 kept, 9 instead of 5
    assert seq.output_token_ids == [6, 7, 9]
    assert seq.num_computed_tokens == 9  # the draft's kept 7 has its K/V; 9 has none yet
    assert len(seq.block_table) == 3  # 10 tokens: the third block is still needed
    assert (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens) == (1, 3, 1)
    assert sched.accepted_per_position == [1, 0, 0]
    assert sched.accepted == {seq.seq_id: 1}
    run_step(sched, accept=0)  # (9) came nowhere before: a plain decode
    assert sched.accepted == {}
    sched.abort_seq(seq)
    assert_all_free(sched)


def test_a_rejected_draft_gives_back_the_blocks_it_took():
    sched = spec_scheduler()
    seq = add(sched, [1, 2, 3, 1, 2, 3], max_tokens=20)
    run_step(sched, accept=0, next_token=1)  # -> 7 tokens, 6 computed
    out = sched.schedule()
    assert out.scheduled[0].draft == (2, 3, 1) and len(seq.block_table) == 3  # positions 6..9
    sched.postprocess(out, {seq.seq_id: [SampledToken(4)]})  # nothing kept
    assert seq.num_tokens == 8 and seq.num_computed_tokens == 7 and len(seq.block_table) == 2
    assert sched.block_manager.num_free_blocks == NUM_BLOCKS - 2
    # the full block entered the prefix cache with the sequence's own tokens, never a draft's
    bm = sched.block_manager
    assert bm.blocks[seq.block_table[0]].token_ids == (1, 2, 3, 1)
    assert bm.blocks[seq.block_table[1]].block_hash is None
    out = sched.schedule()  # (1, 4) and 4 came nowhere before: a plain decode
    assert out.scheduled[0].draft == () and out.scheduled[0].num_new_tokens == 1
    sched.abort_seq(seq)
    assert_all_free(sched)


def test_a_stop_inside_the_kept_draft_ends_the_sequence_there():
    sched = spec_scheduler()
    seq = add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=20, stop_token_ids=[5])
    run_step(sched, accept=0, next_token=6)
    out = sched.schedule()
    assert out.scheduled[0].draft == (7, 5, 6)
    sched.postprocess(out, {seq.seq_id: [SampledToken(t) for t in (7, 5, 6, 1)]})  # all kept
    assert seq.output_token_ids == [6, 7, 5] and seq.finish_reason == "stop"  # 6 and 1 never came
    assert_all_free(sched)


def test_drafts_respect_max_tokens_the_budget_and_the_batch_size():
    sched = spec_scheduler()
    seq = add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=3)
    run_step(sched, accept=0, next_token=6)
    assert sched.schedule().scheduled[0].draft == (7,)  # 1 token out, 1 drawn after the draft: 3
    sched = spec_scheduler(max_num_batched_tokens=2)
    seq = add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=20)
    while not seq.output_token_ids:  # the prompt in chunks of 2
        run_step(sched, accept=0, next_token=6)
    assert [(i.num_new_tokens, i.draft) for i in sched.schedule().scheduled] == [(2, (7,))]
    spec = {**NGRAM, "disable_by_batch_size": 1}
    sched = make_scheduler(speculative_config=spec)
    for arrival in (0.0, 1.0):
        add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=20, arrival=arrival)
    run_step(sched, accept=0, next_token=6)
    assert all(not item.draft for item in sched.schedule().scheduled)  # two running: no drafts
    sched = make_scheduler(speculative_config={**NGRAM, "disable_by_batch_size": None})  # any size
    for arrival in range(3):
        add(sched, [5, 6, 5], max_tokens=20, arrival=float(arrival))
    run_step(sched, accept=0, next_token=6)
    assert [item.draft for item in sched.schedule().scheduled] == [(5, 6)] * 3


class _Grammar:
    """A grammar that takes tokens below `bound` (a JSON one: `plans`, no lookahead at all)."""

    def __init__(self, bound: int, plans: bool = False) -> None:
        self.bound, self.plans = bound, plans
        self.takes_drafts = not plans

    def lookahead(self, tokens):
        if self.plans:
            return []
        chain = []
        for token in tokens:
            if token >= self.bound:
                break
            chain.append(_Grammar(self.bound))
        return chain


def test_a_draft_under_a_grammar_stops_where_the_grammar_refuses_and_carries_its_matchers():
    sched = spec_scheduler()
    seq = add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=20)
    run_step(sched, accept=0, next_token=6)
    seq.grammar = _Grammar(bound=7)  # compiled by the engine; here a stand-in that takes 5 and 6, not 7
    seq.grammar.accept = lambda token_id: None
    [item] = sched.schedule().scheduled  # (7, 5, 6) proposed: 7 refused
    assert (item.draft, item.draft_grammars, item.num_new_tokens) == ((), (), 1)
    sched.abort_seq(seq)
    seq = add(sched, [5, 6, 5, 6, 5], max_tokens=20, arrival=1.0)
    run_step(sched, accept=0, next_token=6)
    seq.grammar = _Grammar(bound=6)  # takes 5, refuses 6
    [item] = sched.schedule().scheduled  # (5, 6) proposed: the draft is (5,)
    assert item.draft == (5,) and len(item.draft_grammars) == 1 and item.num_new_tokens == 2
    sched.abort_seq(seq)
    seq = add(sched, [5, 6, 5, 6, 5], max_tokens=20, arrival=2.0)
    run_step(sched, accept=0, next_token=6)
    seq.grammar = _Grammar(bound=99, plans=True)
    assert sched.schedule().scheduled[0].draft == ()  # a JSON constraint: no drafts
    sched.abort_seq(seq)
    assert_all_free(sched)


def test_without_a_speculative_config_nothing_is_drafted():
    sched = make_scheduler()
    add(sched, [5, 6, 7, 5, 6, 7, 5], max_tokens=20)
    run_step(sched, accept=0, next_token=6)
    assert sched.schedule().scheduled[0].draft == ()


def test_forked_choices_draft_each_on_its_own_blocks():
    sched = spec_scheduler()
    parent = add(sched, [5, 6, 7, 5, 6, 7], max_tokens=20, n=2, seed=1)  # 6 tokens: the second block shared
    run_step(sched, accept=0, next_token=5)
    child = next(s for s in sched.running if s is not parent)
    out = sched.schedule()
    assert [item.draft for item in out.scheduled] == [(6, 7, 5), (6, 7, 5)]
    tables = [item.seq.block_table for item in out.scheduled]
    assert tables[0][0] == tables[1][0] and tables[0][1] != tables[1][1]  # copy-on-write, then private
    sched.postprocess(
        out, {parent.seq_id: [SampledToken(6), SampledToken(1)], child.seq_id: [SampledToken(2)]}
    )
    assert parent.output_token_ids == [5, 6, 1] and child.output_token_ids == [5, 2]
    assert len(parent.block_table) == 3 and len(child.block_table) == 2  # 9 and 8 tokens
    for seq in (parent, child):
        sched.abort_seq(seq)
    assert_all_free(sched)


# --- the sampler's chain ------------------------------------------------------------------------------
def _draft_rows(seq: Sequence, draft: tuple[int, ...]) -> list[SampleRow]:
    return [SampleRow(seq, 1, offset, draft) for offset in range(len(draft) + 1)]


def test_the_sampler_keeps_a_draft_up_to_its_first_token_unlike_the_drawn_one():
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0), eos_token_ids=frozenset())
    logits = torch.full((4, 8), -5.0)
    for row, token in enumerate([4, 5, 1, 2]):  # greedy: 4, 5, 1, 2 at the draft's four positions
        logits[row, token] = 5.0
    tokens = Sampler()(logits.clone(), _draft_rows(seq, (4, 5, 6)))[seq.seq_id]
    assert [t.token_id for t in tokens] == [4, 5, 1]  # 4, 5 kept; 1 instead of 6; position 3 unused
    tokens = Sampler()(logits.clone(), _draft_rows(seq, (4, 5, 1)))[seq.seq_id]
    assert [t.token_id for t in tokens] == [4, 5, 1, 2]  # every draft token kept, one more drawn
    tokens = Sampler()(logits.clone(), _draft_rows(seq, (3, 5, 1)))[seq.seq_id]
    assert [t.token_id for t in tokens] == [4]


@pytest.mark.parametrize(
    "penalties",
    [
        {},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5, "frequency_penalty": 2.0},
        {"min_tokens": 3, "stop_token_ids": [0, 1, 2, 3, 4, 5, 6, 7]},
    ],
    ids=["plain", "repetition", "presence-frequency", "min_tokens"],
)
def test_a_drafts_rows_draw_what_the_positions_would_draw_one_step_at_a_time(penalties):
    """Seeded: the token at a draft's position j is the one drawn with the sequence j tokens longer,
    penalties and min_tokens' ban counting the draft's tokens before it."""
    params = SamplingParams(temperature=1.0, seed=3, logprobs=2, **penalties)
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 3
    seq = Sequence("r", [1, 2, 3], params, sampling_seed=3, eos_token_ids=frozenset())
    alone = []
    for row in range(4):  # one step at a time, each token appended
        [token] = Sampler()(logits[row : row + 1].clone(), [SampleRow(seq, 1)])[seq.seq_id]
        alone.append(token)
        seq.output_token_ids.append(token.token_id)
    seq.output_token_ids = []
    draft = tuple(t.token_id for t in alone[:3])
    chained = Sampler()(logits.clone(), _draft_rows(seq, draft))[seq.seq_id]
    assert [t.token_id for t in chained] == [t.token_id for t in alone]
    for one, other in zip(chained, alone, strict=True):
        assert one.logprobs == pytest.approx(other.logprobs)


# --- the config ---------------------------------------------------------------------------------------
def test_the_speculative_config_is_checked():
    assert EngineConfig(model="x", speculative_config=NGRAM).speculative_config == SpeculativeConfig(**NGRAM)
    # vLLM's inference: a config with a model drafts with it
    assert SpeculativeConfig(model="/m/tiny").method == "draft_model"
    assert SpeculativeConfig().method == "ngram"
    # where drafts stop paying: the method's own limit unless one is given (None: at any batch size)
    assert SpeculativeConfig().disable_by_batch_size == 16
    assert SpeculativeConfig(model="/m/tiny").disable_by_batch_size == 4
    assert SpeculativeConfig(model="/m/tiny", disable_by_batch_size=None).disable_by_batch_size is None
    for bad, message in (
        ({"method": "draft_model"}, "needs the draft model's directory"),
        ({"method": "ngram", "model": "/m/tiny"}, "for method 'draft_model'"),
        ({"method": "eagle"}, "must be one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"num_spec_tokens": 2}, "unknown keys"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="x", speculative_config=bad)
    with pytest.raises(ValueError, match="mapping"):
        EngineConfig(model="x", speculative_config="ngram")
