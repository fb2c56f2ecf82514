"""The generic backend (engine/executor/models/generic.py) beyond float32 greedy parity (test_equivalence.py):
bfloat16 within a stated tolerance of float32 HF, and each refusal with its reason."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Model, GraniteForCausalLM

from engine import LLM, SamplingParams
from engine.executor.models import TESTED_GENERIC
from tests.harness import GENERIC_FAMILIES

# bfloat16 keeps 8 bits of mantissa: over the tiny presets a first token's logprob lands within this of
# float32 HF's for the same token (measured: at most 0.047, Gemma 2)
BF16_LOGPROB_TOLERANCE = 0.15


@pytest.mark.parametrize("preset", GENERIC_FAMILIES)
def test_bfloat16_logprobs_within_tolerance_of_float32_transformers(random_model, preset):
    path = random_model(preset)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(3)
    prompts = [[rng.randrange(4, hf.config.vocab_size) for _ in range(n)] for n in (2, 9, 30, 60)]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, block_size=8, max_num_batched_tokens=24)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
        got = out.outputs[0].logprobs[0]
        assert len(got) >= 5
        for token, logprob in got.items():
            assert abs(logprob - expected[token].item()) < BF16_LOGPROB_TOLERANCE, (token, logprob)


def test_what_the_generic_backend_cannot_do_is_refused(random_model):
    path = random_model("tiny-gpt-neox")
    for options, reason in [
        (dict(quantization="int8"), "generic backend, which has no quantization \\(own"),
        (dict(compile=True), "generic backend, which has no --compile"),
        (dict(tensor_parallel_size=2), "generic backend, which has no tensor parallelism"),
        (dict(model_impl="own"), "model_impl 'own' asked for, but GPTNeoXForCausalLM has no own"),
    ]:
        with pytest.raises(ValueError, match=reason):
            LLM(path, dtype="float32", max_model_len=64, **options)


def test_a_layer_that_never_reaches_the_interface_is_refused(random_model, monkeypatch):
    """As a state-space layer would: the dry forward at load finds the layer and names the reason."""
    original = GPT2Model.forward

    def forward(self, *args, **kwargs):  # layer 1 answers without attention
        self.h[1].attn.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GPT2Model, "forward", forward)
    with pytest.raises(ValueError, match="1 of its 2 layers do not attend through transformers' attention"):
        LLM(random_model("tiny-gpt2"), dtype="float32", max_model_len=64)


def test_a_logits_tail_the_backend_does_not_know_is_refused(random_model, monkeypatch):
    """A forward that does more to its logits than the config says: compared with HF's own at load."""
    original = GraniteForCausalLM.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    monkeypatch.setattr(GraniteForCausalLM, "forward", forward)
    with pytest.raises(ValueError, match="does more to the logits than the LM head"):
        LLM(random_model("tiny-granite"), dtype="float32", max_model_len=64)


def test_the_tested_architectures_are_the_presets_the_tests_run():
    """TESTED_GENERIC (docs/models.md's table) names exactly the architectures of GENERIC_FAMILIES."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from benchmarks.make_model import PRESETS

    assert {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[PRESETS[p][0].model_type] for p in GENERIC_FAMILIES} == set(
        TESTED_GENERIC
    )
