"""Greedy outputs token-identical to HF transformers `generate` (fp32, CPU) for every supported
family, own forward or generic backend, under chunked prefill, preemption (recompute and swap),
prefix-cache hits, n > 1 and block sizes 8, 16 and 32. Every scenario ends with every block free."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.harness import (
    FAMILIES,
    GENERIC_FAMILIES,
    MAX_MODEL_LEN,
    NUM_NEW,
    SCENARIOS,
    check_parity,
    hf_greedy,
    parity_prompts,
)


@pytest.fixture(scope="module")
def references(random_model):
    """HF generate, one prompt at a time (no padding), greedy; min_new_tokens masks EOS as min_tokens does."""
    cache = {}

    def get(preset: str) -> tuple[str, list[list[int]], list[list[int]]]:
        if preset not in cache:
            path = random_model(preset)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            prompts = parity_prompts(7, model.config.vocab_size)
            cache[preset] = (path, prompts, hf_greedy(model, prompts, NUM_NEW))
        return cache[preset]

    return get


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_matches_transformers(references, preset, scenario):
    path, prompts, expected = references(preset)
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, **SCENARIOS[scenario])
    check_parity(llm, prompts, expected)
    stats = llm.engine.stats()
    if scenario.startswith("preempt"):
        assert stats.num_preemptions > 0
    if scenario == "chunked_prefill":
        assert llm.engine.num_steps > NUM_NEW + 2  # 70-token prompts took several steps each


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("scenario", ["chunked_prefill", "block_size_8"])
def test_torch_decode_path_matches_transformers(references, preset, scenario, monkeypatch):
    """Without the C kernel (no compiler, PAGEDSERVE_CPU_KERNEL=0, CUDA, half precision) decode
    attention gathers the blocks and runs SDPA: the same tokens."""
    monkeypatch.setattr("engine.executor.attention.torch_backend.cpu_kernel.load", lambda num_threads: None)
    path, prompts, expected = references(preset)
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, **SCENARIOS[scenario])
    assert llm.engine.model_runner.attention.decode_kernel is None
    check_parity(llm, prompts, expected)


@pytest.mark.parametrize("preset", FAMILIES)
def test_prefix_cache_hits_give_same_tokens(references, preset):
    path, prompts, expected = references(preset)
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=8)
    check_parity(llm, prompts, expected)  # the first pass fills the cache
    hits_before = llm.engine.block_manager.num_prefix_hits
    check_parity(llm, prompts, expected)  # the second reads most prompts from it
    assert llm.engine.block_manager.num_prefix_hits - hits_before >= 8 * sum(
        (len(p) - 1) // 8 for p in prompts
    )


@pytest.mark.parametrize("preset", FAMILIES)
def test_flex_backend_matches_transformers(references, preset):
    """attention_backend "flex" (CUDA's default; unfused on CPU): decodes batched and every prefill
    chunk in one call per layer, mixed in each step by chunked prefill, then again from the prefix cache."""
    path, prompts, expected = references(preset)
    options = dict(
        dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, **SCENARIOS["chunked_prefill"]
    )
    if preset == "tiny-gemma2":  # soft-capped scores: the torch backend's alone (auto picks it on CUDA too)
        with pytest.raises(ValueError, match="'flex' does not soft-cap scores"):
            LLM(path, attention_backend="flex", **options)
        return
    llm = LLM(path, attention_backend="flex", **options)
    assert llm.engine.model_runner.attention.name == "flex"
    check_parity(llm, prompts, expected)
    hits_before = llm.engine.block_manager.num_prefix_hits
    check_parity(llm, prompts, expected)
    assert llm.engine.block_manager.num_prefix_hits > hits_before


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_linear_kernels_match_transformers(references, preset, kernel):
    """Both CPU linear kernels (`choose` picks one per machine at load), under chunked prefill."""
    path, prompts, expected = references(preset)
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        linear_kernel=kernel,
        **SCENARIOS["chunked_prefill"],
    )
    assert llm.engine.model_runner.linear_kernel == kernel
    assert (llm.engine.model_runner.row_counts is not None) == (kernel == "onednn")  # steps padded to them
    check_parity(llm, prompts, expected)


@pytest.mark.parametrize("preset", GENERIC_FAMILIES + FAMILIES)
def test_generic_backend_matches_transformers(references, preset):
    """HF's modules with our paged attention (sliding windows, soft-capping, sinks, MoE, learned positions,
    NoPE layers, as each family has them; the own forwards' families too, with model_impl "generic"):
    chunked prefill with n = 2, then prefix-cache hits, then preemption by recompute and by swap."""
    path, prompts, expected = references(preset)
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        model_impl="generic",
        **SCENARIOS["chunked_prefill"],
    )
    runner = llm.engine.model_runner
    assert runner.generic
    check_parity(llm, prompts, expected, n=2)
    hits_before = llm.engine.block_manager.num_prefix_hits
    check_parity(llm, prompts, expected)
    assert llm.engine.block_manager.num_prefix_hits > hits_before
    args = runner.model.args
    bytes_per_block = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4 * 8
    for mode in ("recompute", "swap"):
        small = LLM(
            path,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=32,
            block_size=8,
            model_impl="generic",
            kv_cache_memory=24 * bytes_per_block,
            preemption_mode=mode,
            swap_space=0.01,
        )
        check_parity(small, prompts, expected)
        assert small.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gpt-oss"])
@pytest.mark.parametrize("scenario", ["chunked_prefill", "preempt_recompute"])
def test_prompt_logprobs_match_transformers(references, preset, scenario):
    """vLLM's prompt_logprobs: each prompt token's log-probability under HF's forward of the same ids (1e-4),
    across chunk boundaries and preemption (a recomputed position is not scored twice), with n = 2; such a
    request computes its prompt even where the prefix cache holds it."""
    path, prompts, _ = references(preset)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, **SCENARIOS[scenario])
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, n=2, prompt_logprobs=1)
    for _ in range(2):  # the second pass finds every prompt cached, and computes it all the same
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                want = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
            got = out.prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None and out.num_cached_tokens == 0
            for i in range(1, len(prompt)):
                assert abs(got[i][prompt[i]] - want[i - 1, prompt[i]].item()) < 1e-4
                assert len(got[i]) in (1, 2)  # the top one, and the prompt's own token
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if scenario == "preempt_recompute":
        assert llm.engine.stats().num_preemptions > 0
