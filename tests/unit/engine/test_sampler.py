"""Sampler: seeded reproducibility whatever the batch, filters never sample outside the allowed
set, and at temperature 1 the empirical distribution matches softmax (torch's draws: tests/unit/conftest.py;
the C race is tested in tests/integration/engine/test_cpu_kernel.py)."""

import math

import pytest
import torch

from engine.core.sequence import Sequence
from engine.executor.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams

VOCAB = 8


def _seq(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), outputs=()) -> Sequence:
    seq = Sequence("r", list(prompt), params, sampling_seed=seed, eos_token_ids=frozenset({0}))
    seq.output_token_ids = list(outputs)
    return seq


def _logits(rows: int = 1) -> torch.Tensor:
    base = torch.tensor([0.5, 2.0, 1.0, -1.0, 0.0, 1.5, -0.5, 0.2])
    return base.repeat(rows, 1)


def test_greedy_is_argmax():
    out = Sampler()(_logits(), [SampleRow(_seq(SamplingParams(temperature=0)), 1)])
    assert [t.token_id for t in next(iter(out.values()))] == [1]


def test_seeded_samples_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler()(_logits(), [SampleRow(_seq(params, seed=42, outputs=[5] * k), 1)]) for k in range(20)]
    tokens_alone = [next(iter(o.values()))[0].token_id for o in alone]
    batched = []
    for k in range(20):
        others = [SampleRow(_seq(SamplingParams(temperature=1.0), seed=s), 1) for s in range(k % 4)]
        target = _seq(params, seed=42, outputs=[5] * k)
        rows = others + [SampleRow(target, 1)]
        batched.append(Sampler()(_logits(len(rows)), rows)[target.seq_id][0].token_id)
    assert tokens_alone == batched
    assert len(set(tokens_alone)) > 1  # it does sample


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(temperature=1.0, top_k=2), {1, 5}),
        (SamplingParams(temperature=1.0, top_p=0.5), {1, 5}),
        (SamplingParams(temperature=1.0, min_p=0.5), {1, 5}),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.99), {1, 5, 2}),
    ],
)
def test_filters_never_sample_outside_the_allowed_set(params, allowed):
    seen = set()
    for seed in range(300):
        seq = _seq(params, seed=seed)
        seen.add(Sampler()(_logits(), [SampleRow(seq, 1)])[seq.seq_id][0].token_id)
    assert seen == allowed


def test_temperature_one_matches_softmax():
    probs = torch.softmax(_logits()[0], dim=-1)
    counts = torch.zeros(VOCAB)
    draws = 4000
    for seed in range(draws):
        seq = _seq(SamplingParams(temperature=1.0), seed=seed)
        counts[Sampler()(_logits(), [SampleRow(seq, 1)])[seq.seq_id][0].token_id] += 1
    empirical = counts / draws
    tolerance = 4 * torch.sqrt(probs * (1 - probs) / draws)  # 4 standard errors per token
    assert torch.all((empirical - probs).abs() <= tolerance), (empirical, probs)


def test_fan_out_draws_n_different_streams():
    draws = []  # [seed][child]
    for seed in range(20):
        seq = _seq(SamplingParams(temperature=1.0, n=4), seed=seed)
        tokens = [t.token_id for t in Sampler()(_logits(), [SampleRow(seq, 4)])[seq.seq_id]]
        again = [t.token_id for t in Sampler()(_logits(), [SampleRow(seq, 4)])[seq.seq_id]]
        assert len(tokens) == 4 and tokens == again  # reproducible from the seed
        draws.append(tokens)
    # each child draws its own stream: over 20 seeds, two children agreeing everywhere by chance has
    # probability below 0.3**20
    streams = {tuple(draws[seed][child] for seed in range(20)) for child in range(4)}
    assert len(streams) == 4, draws


def test_penalties_and_min_tokens():
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0)
    seq = _seq(greedy, prompt=(1,))  # token 1 is the argmax but already seen
    assert Sampler()(_logits(), [SampleRow(seq, 1)])[seq.seq_id][0].token_id == 5
    freq = _seq(SamplingParams(temperature=0, frequency_penalty=1.0), outputs=[1])
    assert Sampler()(_logits(), [SampleRow(freq, 1)])[freq.seq_id][0].token_id == 5
    logits = _logits()
    logits[0, 0] = 10.0  # EOS is the argmax
    early = _seq(SamplingParams(temperature=0, min_tokens=2), outputs=[4])
    assert Sampler()(logits, [SampleRow(early, 1)])[early.seq_id][0].token_id == 1


def test_logprobs_hold_top_n_and_the_sampled_token():
    seq = _seq(SamplingParams(temperature=0, logprobs=2))
    token = Sampler()(_logits(), [SampleRow(seq, 1)])[seq.seq_id][0]
    expected = torch.log_softmax(_logits()[0], dim=-1)
    assert set(token.logprobs) == {1, 5}
    assert math.isclose(token.logprobs[1], float(expected[1]), rel_tol=1e-6)


def test_top_p_one_cuts_nothing_where_the_summed_probabilities_pass_one():
    """top_p 1.0 is off. On peaked rows a float32 running sum of the sorted probabilities passes 1.0 before
    the last token (on an AVX2 EPYC: all 64 rows here), which must not cut the tail of the top k or of
    the whole row."""
    from engine.executor.sampler import NUCLEUS_CANDIDATES, _filter, _filter_sorted

    vocab = 3 * NUCLEUS_CANDIDATES
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0)) * 4
    top_p, min_p = torch.ones(64), torch.zeros(64)
    for k in (100, NUCLEUS_CANDIDATES, vocab):  # top-k among the candidates, and sorting whole rows
        top_k = torch.full((64,), k)
        assert ((~_filter(logits, top_k, top_p, min_p).isinf()).sum(dim=-1) == k).all()
    kept = ~_filter_sorted(logits, torch.zeros(64, dtype=torch.long), top_p, min_p).isinf()
    assert kept.all()


def test_filters_over_the_most_likely_tokens_match_sorting_whole_rows():
    """`_filter` looks among each row's most likely tokens (torch.topk) and sorts whole rows only where a
    nucleus reaches past them: the same tokens survive, with the same logits, as sorting every row."""
    from engine.executor.sampler import NUCLEUS_CANDIDATES, _filter, _filter_sorted

    vocab = 3 * NUCLEUS_CANDIDATES
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(8, vocab, generator=generator) * 4
    logits[5] = torch.randn(vocab, generator=generator) * 0.01  # flat: its 0.99 nucleus is most of the row
    top_k = torch.tensor([0, 5, 0, 40, 0, 0, 2000, 0])
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.5, 0.95, 0.99, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0])
    got, want = _filter(logits, top_k, top_p, min_p), _filter_sorted(logits, top_k, top_p, min_p)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], want[~want.isinf()])
    kept = (~got.isinf()).sum(dim=-1).tolist()
    assert (
        kept[1] == 5 and kept[5] > NUCLEUS_CANDIDATES and kept[7] == vocab
    )  # top-k; past the candidates; none
