"""engine/models' own forward against HF transformers as the reference: logits of every family (and a
scaled RoPE) in float32, bfloat16 within a stated distance of float32, the checkpoint mapping's
errors. Engine-level greedy parity of the owned forward is tests/integration/engine/test_equivalence.py (every
family and scheduling path) and test_owned_model_window.py (sliding windows)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.executor.attention.torch_backend import AttentionMetadata, PrefillSegment
from engine.executor.loader import validate_model_dir
from engine.executor.models import load_model
from engine.executor.models.llama import LlamaForCausalLM
from tests.harness import FAMILIES

BLOCK_SIZE = 8
# bfloat16 keeps 8 bits of mantissa: the logits of these random models (|logit| up to ~4) move by
# 0.06-0.09 from float32 (measured over the four families), and 1-2 of 40 positions' argmax flip
# where two logits nearly tie; the bounds leave about 3x room
BF16_LOGIT_ATOL = 0.25
BF16_MIN_ARGMAX_AGREEMENT = 0.9


def _prompt(vocab_size: int, length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def _logits(model: LlamaForCausalLM, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Every position's logits [T, vocab], slots 0..T-1 of a fresh pool; with `chunk`, the prompt goes
    in two steps, the second reading the first's K/V back from the pool."""
    args, num_tokens = model.args, len(ids)
    num_slots = -(-num_tokens // BLOCK_SIZE) * BLOCK_SIZE
    dtype = model.embed_tokens.weight.dtype
    model.bind_kv_caches(
        [
            tuple(torch.zeros(args.num_kv_heads, num_slots, args.head_dim, dtype=dtype) for _ in range(2))
            for _ in range(args.num_layers)
        ]
    )
    bounds = [0, chunk, num_tokens] if chunk else [0, num_tokens]
    out = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        positions = torch.arange(start, end)
        key_pos = torch.arange(end)[None, :]
        segment = (
            PrefillSegment(0, end - start, None, None)
            if start == 0
            else PrefillSegment(0, end - start, torch.arange(end), key_pos <= positions[:, None])
        )
        meta = AttentionMetadata(BLOCK_SIZE, positions, 0, None, None, None, None, [segment])
        with torch.inference_mode():
            out.append(model.compute_logits(model(ids[start:end], positions, meta)).float())
    return torch.cat(out)


def _hf_logits(path: str, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.inference_mode():
        return hf(ids[None]).logits[0]


def _owned(path: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(validate_model_dir(path), dtype, torch.device("cpu"))


@pytest.mark.parametrize("preset", FAMILIES)
def test_logits_match_transformers(random_model, preset):
    """_logits builds no window masks: a model with windowed layers gets a prompt inside its window
    (windows are held to HF by the engine's tests, test_equivalence and test_owned_model_window)."""
    path = random_model(preset)
    model = _owned(path)
    window = min((w for w in model.args.sliding_windows if w is not None), default=None)
    ids = _prompt(model.args.vocab_size, length=window or 40)
    expected = _hf_logits(path, ids)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(model, ids, chunk=len(ids) // 2 + 1), expected, rtol=1e-5, atol=1e-5)


def test_scaled_rope_matches_transformers(random_model, tmp_path):
    """Llama 3.1's frequency-scaled RoPE comes from transformers' own table of RoPE types."""
    from benchmarks.make_model import make_random_model

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    path = str(make_random_model("tiny-llama", tmp_path, seed=1, rope_parameters=rope))
    model = _owned(path)
    ((inv_freq, scale),) = model.ropes.values()
    assert scale == 1.0 and not torch.equal(inv_freq, _owned(random_model("tiny-llama")).ropes[None][0])
    ids = _prompt(model.args.vocab_size)
    torch.testing.assert_close(_logits(model, ids), _hf_logits(path, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunks_mask_is_what_sdpa_makes_of_it_converted_once_a_step(dtype):
    """PrefillSegment.sdpa_mask: 0 or -inf in q's dtype, SDPA's output the same bit for bit as with the
    bool mask, built at the step's first layer and reused by the others (a windowed layer's apart)."""
    positions, key_pos = torch.arange(5, 12), torch.arange(12)[None, :]
    causal = key_pos <= positions[:, None]
    window = causal & (key_pos > positions[:, None] - 4)
    seg = PrefillSegment(0, 7, torch.arange(12), causal, window)
    additive = seg.sdpa_mask(False, dtype)
    assert additive.dtype == dtype and additive is seg.sdpa_mask(False, dtype)
    assert seg.sdpa_mask(True, dtype) is not additive
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, heads, n, 16, generator=generator).to(dtype) for heads, n in ((4, 7), (2, 12), (2, 12))
    )
    for is_windowed, mask in ((False, causal), (True, window)):
        assert torch.equal(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=seg.sdpa_mask(is_windowed, dtype), enable_gqa=True
            ),
        )
    assert PrefillSegment(0, 7, None, None).sdpa_mask(True, dtype) is None  # causal: SDPA's is_causal


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_close_to_fp32(random_model, preset):
    """Within BF16_LOGIT_ATOL of float32, or where HF's own bfloat16 forward strays further (Gemma 3's
    embeddings scaled by sqrt(hidden): 0.31 on a 16-token prompt), within 1.5x of HF's stray."""
    path = random_model(preset)
    fp32, bf16 = _owned(path), _owned(path, torch.bfloat16)
    ids = _prompt(fp32.args.vocab_size)
    reference, got = _logits(fp32, ids), _logits(bf16, ids, chunk=17)
    hf_stray = (_hf_logits(path, ids, torch.bfloat16).float() - _hf_logits(path, ids)).abs().max().item()
    assert (got - reference).abs().max().item() < max(BF16_LOGIT_ATOL, 1.5 * hf_stray)
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean().item() >= BF16_MIN_ARGMAX_AGREEMENT


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_rows_leave_the_tokens_alone(random_model, dtype, preset):
    """row_bucket pads a step with rows that the dense layers carry and attention never sees (and an
    expert's rows with rows no token reads): every token's logits stay as they were, to float rounding
    (another row count, another GEMM blocking)."""
    model = _owned(random_model(preset), dtype)
    ids = _prompt(model.args.vocab_size)
    unpadded = _logits(model, ids, chunk=17)
    model.row_bucket = lambda rows: rows + 5
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(_logits(model, ids, chunk=17), unpadded, rtol=tolerance, atol=tolerance)


def test_fused_weights_hold_hf_projections(random_model):
    path = random_model("tiny-qwen2")
    model = _owned(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[1]
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    torch.testing.assert_close(
        attn.qkv_proj.weight,
        torch.cat([hf.self_attn.q_proj.weight, hf.self_attn.k_proj.weight, hf.self_attn.v_proj.weight]),
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        attn.qkv_proj.bias,
        torch.cat([hf.self_attn.q_proj.bias, hf.self_attn.k_proj.bias, hf.self_attn.v_proj.bias]),
        rtol=0,
        atol=0,
    )
    assert attn.o_proj.bias is None  # Qwen2: biases on q/k/v only
    torch.testing.assert_close(
        mlp.gate_up_proj.weight, torch.cat([hf.mlp.gate_proj.weight, hf.mlp.up_proj.weight]), rtol=0, atol=0
    )


def test_checkpoint_mismatches_raise(random_model):
    path = random_model("tiny-llama")
    model = _owned(path)
    with pytest.raises(ValueError, match="model.layers.0.mlp.fc1.weight has no place"):
        model.load_weights([("model.layers.0.mlp.fc1.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"k_proj.weight: shape \(3, 64\), expected \(32, 64\)"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 64))])
    with pytest.raises(ValueError, match="checkpoint lacks 1 tensors"):
        model.load_weights([(name, t) for name, t in _hf_names(path) if name != "model.norm.weight"])


def test_a_quantized_fused_projection_is_refused(random_model):
    """Phi-3's fused qkv_proj is split by rows at load; AWQ / GPTQ pack those rows along another axis."""
    model = _owned(random_model("tiny-phi3"))
    with pytest.raises(ValueError, match="qkv_proj.qweight: a quantized fused projection is not supported"):
        model.load_weights(
            [("model.layers.0.self_attn.qkv_proj.qweight", torch.zeros(64, 16, dtype=torch.int32))]
        )


def _hf_names(path: str) -> list[tuple[str, torch.Tensor]]:
    return list(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items())


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_engine_close_to_fp32(random_model, preset):
    """The whole bfloat16 path (torch decode attention, bf16 masks, chunked prefill) against float32:
    each prompt's first greedy token comes from its prefill logits, so it agrees as those do."""
    path = random_model(preset)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, max_model_len=128, block_size=8, max_num_batched_tokens=24)
        prompts = [
            _prompt(llm.engine.vocab_size, length, seed=length).tolist() for length in (5, 17, 33, 40, 64)
        ]
        outs[dtype] = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
    assert all(len(o) == 4 for o in outs["bfloat16"])
    first = [a[0] == b[0] for a, b in zip(outs["float32"], outs["bfloat16"], strict=True)]
    assert sum(first) >= len(first) - 1
