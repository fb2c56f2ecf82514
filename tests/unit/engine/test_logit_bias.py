"""logit_bias: SamplingParams checks its shape, and the sampler adds each bias to its row's logits only
(after penalties, before the min_tokens ban). The engine's vocabulary check:
tests/integration/engine/test_logit_bias.py."""

import pytest
import torch

from engine.core.sequence import Sequence
from engine.executor.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams


def _seq(params: SamplingParams, seed: int = 0) -> Sequence:
    return Sequence("r", [1, 2, 3], params, sampling_seed=seed, eos_token_ids=frozenset({0}))


def _logits(rows: int = 1) -> torch.Tensor:
    return torch.tensor([0.5, 2.0, 1.0, -1.0, 0.0, 1.5, -0.5, 0.2]).repeat(rows, 1)


def _greedy(bias: dict[int, float], **params) -> int:
    out = Sampler()(_logits(), [SampleRow(_seq(SamplingParams(temperature=0, logit_bias=bias, **params)), 1)])
    return next(iter(out.values()))[0].token_id


def test_a_bias_moves_the_greedy_choice():
    assert _greedy({}) == 1
    assert _greedy({6: 3.0}) == 6  # -0.5 + 3 beats 2.0
    assert _greedy({1: -100}) == 5  # the next best once 1 is banned


def test_bias_applies_to_its_own_row_only():
    rows = [
        SampleRow(_seq(SamplingParams(temperature=0, logit_bias={3: 100})), 1),
        SampleRow(_seq(SamplingParams(temperature=0)), 1),
    ]
    out = Sampler()(_logits(2), rows)
    assert [out[r.seq.seq_id][0].token_id for r in rows] == [3, 1]


def test_sampled_rows_never_draw_a_token_biased_by_minus_100():
    params = SamplingParams(temperature=1.0, seed=7, logit_bias={t: -100 for t in range(1, 8)})
    draws = {
        next(iter(Sampler()(_logits(), [SampleRow(_seq(params, seed=s), 1)]).values()))[0].token_id
        for s in range(30)
    }
    assert draws == {0}


def test_a_bias_does_not_lift_a_token_min_tokens_bans():
    assert _greedy({0: 100}, min_tokens=1) != 0  # eos stays banned until min_tokens
    assert _greedy({0: 100}) == 0


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({1: 100.5}, "logit_bias values must be in [-100, 100]"),
        ({1: float("nan")}, "logit_bias values must be finite numbers"),
        ({1: True}, "logit_bias values must be finite numbers"),
        ({"1": 1.0}, "logit_bias keys must be integer token ids"),
        ({-1: 1.0}, "logit_bias keys must be non-negative token ids"),
        ({t: 1.0 for t in range(301)}, "logit_bias must hold at most 300 entries, got 301"),
    ],
)
def test_sampling_params_check_the_shape(bias, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(logit_bias=bias)
    assert str(info.value) == message
