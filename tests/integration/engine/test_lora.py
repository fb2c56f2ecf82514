"""LoRA adapters (engine/executor/lora.py) in PEFT's format: four tiny adapters of different ranks and
targets, mixed with base rows in one batch (chunked prefill, preemption, n > 1), give the greedy tokens
of HF transformers with each adapter merged into the base weights (W + alpha / r * B A, as PEFT's
merge_and_unload), on the own forward and on the generic backend. The prefix cache never shares a block
across adapters; the bank keeps at most max_loras, evicting the least recently used idle one; bad adapters
are refused with the reason."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.executor.lora import LoraBankFull, LoraError
from engine.kernels import cpu as cpu_kernel
from tests.harness import hf_greedy, parity_prompts, write_adapter

NUM_NEW = 8
# name -> (rank, alpha, targets, use_rslora)
ADAPTERS = {
    "attn-r4": (4, 8, ("q_proj", "v_proj"), False),
    "all-r16": (16, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "mlp-r8": (8, 32, ("gate_proj", "up_proj", "down_proj"), False),
    "o-r2-rs": (2, 4, ("o_proj",), True),
}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def adapted(random_model, tmp_path_factory):
    """(model dir, prompts, {adapter name or None: (dir, HF greedy outputs)})."""
    path = random_model("tiny-llama")
    return path, *_merged_outputs(path, ADAPTERS, tmp_path_factory.mktemp("loras"))


def _merged_outputs(path, adapters, root):
    """(prompts, {adapter name or None: (dir, HF greedy outputs with the adapter merged)})."""
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = parity_prompts(11, base.config.vocab_size)[:10]
    out = {None: (None, hf_greedy(base, prompts, NUM_NEW))}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(adapters.items()):
        pairs = write_adapter(base, root / name, rank, alpha, targets, rslora, seed)
        merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        scale = alpha / rank**0.5 if rslora else alpha / rank
        modules = dict(merged.named_modules())
        with torch.no_grad():
            for module_name, (a, b) in pairs.items():
                modules[module_name].weight += scale * (b @ a)
        out[name] = (root / name, hf_greedy(merged, prompts, NUM_NEW))
    return prompts, out


SCENARIOS = {
    "one_step": dict(block_size=16),
    "chunked_prefill": dict(block_size=16, max_num_batched_tokens=24),
    "preempt_recompute": dict(
        block_size=8, kv_cache_memory=40 * 8 * 2 * 2 * 2 * 16 * 4, preemption_mode="recompute"
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("with_base", [True, False])  # without: every row of a step is an adapter's
@pytest.mark.parametrize("kernel", [True, False])  # without: torch's batched products (CUDA's path)
def test_mixed_adapters_in_one_batch_match_merged_hf(adapted, scenario, n, with_base, kernel, monkeypatch):
    path, prompts, expected = adapted
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "lora_rows", lambda num_threads: None)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=32, **SCENARIOS[scenario])
    for name, (directory, _) in expected.items():
        if name is not None:
            llm.add_lora(name, str(directory))
    # the base (or not) and each adapter, over every prompt: all in one batch
    names = [name for name in expected if with_base or name is not None]
    batch = [(prompt, names[(i + j) % len(names)]) for i, prompt in enumerate(prompts) for j in range(2)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, n=n)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in batch], params, use_tqdm=False, lora=[name for _, name in batch]
    )
    for (prompt, name), out in zip(batch, outs, strict=True):
        want = expected[name][1][prompts.index(prompt)]
        assert [c.token_ids for c in out.outputs] == [want] * n, (name, scenario)
    assert len({tuple(expected[name][1][0]) for name in names}) > 1  # the adapters change the output
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(a.num_requests == 0 for a in llm.engine.model_runner.lora.adapters.values())
    if scenario == "preempt_recompute":
        assert llm.engine.stats().num_preemptions > 0


GENERIC = {  # the generic backend: HF's modules, adapted by their own names
    "tiny-olmo2": {
        "attn-r4": (4, 8, ("q_proj", "v_proj"), False),
        "all-r8": (
            8,
            16,
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            False,
        ),
    },
    "tiny-gpt-neox": {  # fused, interleaved q/k/v in one linear, and no *_proj names
        "qkv-r4": (4, 8, ("query_key_value",), False),
        "mlp-r8-rs": (8, 16, ("dense", "dense_h_to_4h", "dense_4h_to_h"), True),
    },
}


@pytest.mark.parametrize("preset", GENERIC)
def test_adapters_on_the_generic_backend_match_merged_hf(random_model, tmp_path, preset):
    path = random_model(preset)
    prompts, expected = _merged_outputs(path, GENERIC[preset], tmp_path)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=32, max_num_batched_tokens=24)
    assert llm.engine.model_runner.generic
    for name, (directory, _) in expected.items():
        if name is not None:
            llm.add_lora(name, str(directory))
    names = list(expected)
    batch = [(prompt, names[(i + j) % len(names)]) for i, prompt in enumerate(prompts) for j in range(2)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in batch], params, use_tqdm=False, lora=[name for _, name in batch]
    )
    for (prompt, name), out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == expected[name][1][prompts.index(prompt)], name
    assert len({tuple(expected[name][1][0]) for name in names}) > 1  # the adapters change the output
    # a module that is no linear layer is refused with the reason
    directory = next(d for d, _ in expected.values() if d is not None)
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    key = next(iter(tensors))
    layer_path = key.split(".layers.0.")[1].split(".lora_")[0]
    tensors = {k.replace(layer_path, "input_layernorm"): v for k, v in tensors.items() if ".layers.0." in k}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((directory / "adapter_config.json").read_text())
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="input_layernorm of layer 0 is not one of this model's adaptable"):
        llm.add_lora("bad", str(bad))


def test_the_prefix_cache_never_shares_a_block_across_adapters(adapted):
    path, prompts, expected = adapted
    llm = LLM(path, dtype="float32", max_model_len=128, block_size=8)
    llm.add_lora("attn-r4", str(expected["attn-r4"][0]))
    long = [p for p in prompts if len(p) >= 16]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    base = llm.generate([{"prompt_token_ids": p} for p in long], params, use_tqdm=False)
    hits = llm.engine.block_manager.num_prefix_hits
    lora = llm.generate([{"prompt_token_ids": p} for p in long], params, use_tqdm=False, lora="attn-r4")
    assert llm.engine.block_manager.num_prefix_hits == hits  # the same prompts, no block shared
    assert [o.outputs[0].token_ids for o in lora] == [expected["attn-r4"][1][prompts.index(p)] for p in long]
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in lora]
    llm.generate([{"prompt_token_ids": p} for p in long], params, use_tqdm=False, lora="attn-r4")
    assert llm.engine.block_manager.num_prefix_hits > hits  # within one adapter it does


def test_max_loras_evicts_the_least_recently_used_idle_adapter(adapted):
    path, prompts, expected = adapted
    llm = LLM(path, dtype="float32", max_model_len=128, max_loras=2)
    names = [n for n in expected if n is not None]
    llm.add_lora(names[0], str(expected[names[0]][0]))
    llm.add_lora(names[1], str(expected[names[1]][0]))
    llm.add_lora(names[0], str(expected[names[0]][0]))  # resident: touched, not reloaded
    llm.add_lora(names[2], str(expected[names[2]][0]))  # names[1] is the least recently used
    assert llm.engine.loras() == sorted([names[0], names[2]])
    llm.engine.add_request("held", prompts[0], SamplingParams(max_tokens=4), lora=names[0])
    llm.engine.add_request("held-2", prompts[1], SamplingParams(max_tokens=4), lora=names[2])
    with pytest.raises(LoraBankFull, match="every one has requests in flight"):
        llm.add_lora(names[3], str(expected[names[3]][0]))
    with pytest.raises(LoraError, match="1 requests use it"):
        llm.engine.remove_lora(names[0])
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    llm.engine.remove_lora(names[0])
    assert llm.engine.loras() == [names[2]]
    with pytest.raises(LoraError, match="is not loaded"):
        llm.engine.add_request("gone", prompts[0], SamplingParams(max_tokens=4), lora=names[0])
    assert not llm.engine.requests


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c, t: c.update(use_dora=True), "DoRA"),
        (lambda c, t: c.update(bias="all"), "bias"),
        (
            lambda c, t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)}),
            "decoder layers only",
        ),
        (lambda c, t: t.pop(next(k for k in t if k.endswith("lora_B.weight"))), "lora_A without lora_B"),
        (
            lambda c, t: t.update({k: torch.zeros(80, v.shape[1]) for k, v in t.items() if "lora_A" in k}),
            "ranks 1..64",
        ),
        (
            lambda c, t: t.update({k: torch.zeros(v.shape[0], 5) for k, v in t.items() if "lora_A" in k}),
            "another base model",
        ),
    ],
)
def test_a_bad_adapter_is_refused_with_the_reason(adapted, tmp_path, change, message):
    path, _, expected = adapted
    source = expected["attn-r4"][0]
    config = json.loads((source / "adapter_config.json").read_text())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    change(config, tensors)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    llm = LLM(path, dtype="float32", max_model_len=128)
    with pytest.raises(LoraError, match=message):
        llm.add_lora("bad", str(tmp_path))
    assert llm.engine.loras() == []
