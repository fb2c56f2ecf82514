"""Sliding-window attention really masked: greedy tokens of prompts longer than the window, and
generations that run past it, identical to HF transformers `generate` (fp32, CPU), under the
scheduling paths of test_equivalence (chunked prefill, preemption by recompute and swap, prefix-cache
hits) and both decode paths (C kernel for full-attention layers, torch for windowed ones past the
window; torch for all). Mistral windows every layer; Qwen2 with max_window_layers=1 mixes a full
layer 0 with a windowed layer 1."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from tests.harness import MAX_MODEL_LEN, NUM_NEW, SCENARIOS, check_parity, hf_greedy, parity_prompts

WINDOW = 12  # below most prompts (up to 70 tokens), and not a multiple of any block size tested
MODELS = {
    "mistral": ("tiny-mistral", dict(sliding_window=WINDOW)),
    "qwen2-mixed": ("tiny-qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """name -> (checkpoint path, prompts, HF's greedy tokens), made once per module."""
    from benchmarks.make_model import make_random_model

    cache = {}

    def get(name: str) -> tuple[str, list[list[int]], list[list[int]]]:
        if name not in cache:
            preset, overrides = MODELS[name]
            path = str(make_random_model(preset, tmp_path_factory.mktemp(name), seed=1, **overrides))
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            prompts = parity_prompts(11, model.config.vocab_size)
            cache[name] = (path, prompts, hf_greedy(model, prompts, NUM_NEW))
        return cache[name]

    return get


def test_window_changes_the_tokens(windowed):
    """The case is not vacuous: the same weights with full attention give other tokens. And the
    window no longer caps max_model_len (it did while attention past it was not masked)."""
    path, prompts, expected = windowed("mistral")
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None)
    ids = max(prompts, key=len)
    out = full.generate(
        torch.tensor([ids]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
    )[0, len(ids) :].tolist()
    assert out != expected[prompts.index(ids)]
    assert LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN).engine.max_model_len == MAX_MODEL_LEN


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "scenario", ["chunked_prefill", "preempt_recompute", "preempt_swap", "block_size_16"]
)
def test_greedy_matches_transformers(windowed, name, scenario):
    path, prompts, expected = windowed(name)
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, **SCENARIOS[scenario])
    check_parity(llm, prompts, expected)
    if scenario.startswith("preempt"):
        assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("name", MODELS)
def test_torch_decode_path_and_prefix_cache(windowed, name, monkeypatch):
    monkeypatch.setattr("engine.executor.attention.torch_backend.cpu_kernel.load", lambda num_threads: None)
    path, prompts, expected = windowed(name)
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=8)
    assert llm.engine.model_runner.attention.decode_kernel is None
    check_parity(llm, prompts, expected)
    hits_before = llm.engine.block_manager.num_prefix_hits
    check_parity(llm, prompts, expected)  # the second pass reads most prompts from the cache
    assert llm.engine.block_manager.num_prefix_hits > hits_before


@pytest.mark.parametrize("name", MODELS)
def test_flex_backend_masks_the_window(windowed, name):
    path, prompts, expected = windowed(name)
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        attention_backend="flex",
        **SCENARIOS["chunked_prefill"],
    )
    check_parity(llm, prompts, expected)
