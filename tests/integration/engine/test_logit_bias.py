"""logit_bias in a real engine: ids outside the vocabulary are refused, and a bias of -100 keeps a
token out of what it generates (the sampler's and SamplingParams' part: tests/unit/engine/test_logit_bias.py)."""

import pytest

from engine import EngineConfig, LLMEngine
from engine.errors import RequestRejectedError
from engine.sampling_params import SamplingParams


def test_the_engine_refuses_ids_outside_its_vocabulary(random_model):
    engine = LLMEngine(
        EngineConfig(
            model=random_model("tiny-llama"),
            dtype="float32",
            block_size=4,
            kv_cache_memory=2**20,
            max_model_len=64,
            num_threads=1,
        )
    )
    vocab = engine.vocab_size
    engine.check_request([1, 2], SamplingParams(logit_bias={vocab - 1: 5.0}))
    with pytest.raises(RequestRejectedError, match=rf"logit_bias: {vocab} is outside the vocabulary"):
        engine.check_request([1, 2], SamplingParams(logit_bias={vocab: 5.0}))
    banned = SamplingParams(temperature=0, max_tokens=4, logit_bias={t: -100 for t in range(min(vocab, 300))})
    engine.add_request("biased", [1, 2, 3], banned)
    tokens = []
    while engine.has_unfinished_requests:
        for output in engine.step():
            tokens.extend(output.outputs[0].token_ids)
    assert tokens and all(t >= 300 for t in tokens)
