"""Write a random-weight HF checkpoint of a known architecture, sharing the shipped tokenizer.

    python benchmarks/make_model.py --preset smollm-135m              # -> benchmarks/models/smollm-135m
    python benchmarks/make_model.py --preset tiny-qwen2 /tmp/q2 --dtype bfloat16
    python benchmarks/make_model.py --preset qwen2-1.5b --quantize awq    # -> ...qwen2-1.5b-awq (+ -dequantized)

Benchmarks need the shapes of real models (SmolLM-135M, Qwen2-1.5B) without downloading them; tests
need tiny models of each supported family. vocab_size is always len(tokenizer) of the shipped
models/pagedserve-coder-small, so every generated id decodes (a larger vocab would emit ids the
tokenizer silently drops), which makes the big presets a little smaller than their namesakes.
"""

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO_ROOT / "models" / "pagedserve-coder-small"
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "models"  # gitignored
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORM_JITTER = 0.1  # norm scales become 1 + N(0, 0.1): non-trivial, but keep activations in range

# tiny presets: one shape, four families; tied/untied embeddings alternate so both paths are exercised.
# initializer_range 0.1 (not 0.02) so that logits of a 64-wide model are far from uniform.
_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_TINY_WINDOW = 16  # windowed layers of the tiny presets: shorter than the tests' prompts
_MOE = dict(num_experts_per_tok=2)

# name -> (config class, config kwargs)
PRESETS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "smollm-135m": (
        LlamaConfig,
        dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            intermediate_size=1536,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Qwen2 always has q/k/v biases (and none on o_proj); the family needs no flag for them
    "qwen2-1.5b": (
        Qwen2Config,
        dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=8960,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # a Qwen3 shape of issue 39 (head_dim 128), where the linear-kernel choice once cost 1.56x
    "qwen3-250m": (
        Qwen3Config,
        dict(
            hidden_size=1024,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # benchmark shapes for the generic backend (benchmarks/offline.py --model): a Qwen3-MoE of ~200 M
    # parameters (8 experts, top 2) and a Gemma 2 of ~100 M (Gemma 3 270M's widths, Gemma 2's soft-capping)
    "qwen3-moe-200m": (
        Qwen3MoeConfig,
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=768,
            intermediate_size=2048,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # the SmolLM-135M shape as Phi-3 lays it out (fused qkv_proj and gate_up_proj): own forward vs generic
    "phi3-135m": (
        Phi3Config,
        dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            tie_word_embeddings=False,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "gemma2-100m": (
        Gemma2Config,
        dict(
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=2048,
            sliding_window=512,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "gemma3-100m": (
        Gemma3TextConfig,
        dict(  # the same widths, Gemma 3's way: q/k norms, no soft-capping
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=2048,
            sliding_window=512,
            query_pre_attn_scalar=256,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "tiny-llama": (
        LlamaConfig,
        dict(
            _TINY, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        ),
    ),
    "tiny-qwen2": (
        Qwen2Config,
        dict(
            _TINY, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}
        ),
    ),
    # Qwen3: RMSNorm on q and k per head (q_norm, k_norm), no biases
    "tiny-qwen3": (
        Qwen3Config,
        dict(
            _TINY, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}
        ),
    ),
    # as Mistral-7B v0.2+: no sliding window, rope_theta 1e6 (which also sets it apart from tiny-llama)
    "tiny-mistral": (
        MistralConfig,
        dict(
            _TINY,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # the generic backend's families (engine/executor/models/generic.py): each one's own twist, tiny
    "tiny-gemma2": (
        Gemma2Config,
        dict(  # soft-capped scores and logits, local + global layers, sandwich norms
            _TINY,
            sliding_window=_TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=0.5,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
            rope_parameters=_ROPE,
        ),
    ),
    "tiny-gemma3": (
        Gemma3TextConfig,
        dict(  # q/k norms, local layers with their own RoPE base
            _TINY,
            sliding_window=_TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "tiny-phi3": (
        Phi3Config,
        dict(  # fused qkv and gate_up in the checkpoint, partial rotary
            _TINY,
            tie_word_embeddings=False,
            partial_rotary_factor=0.5,
            rope_parameters=_ROPE,
            sliding_window=None,
        ),
    ),
    "tiny-gpt2": (
        GPT2Config,
        dict(  # learned positions, no RoPE, LayerNorm, Conv1D weights
            n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=1024, initializer_range=0.1
        ),
    ),
    "tiny-gpt-neox": (
        GPTNeoXConfig,
        dict(  # parallel residual, partial rotary, interleaved qkv
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=1024,
            initializer_range=0.1,
            tie_word_embeddings=False,
        ),
    ),
    "tiny-olmo2": (Olmo2Config, dict(_TINY, tie_word_embeddings=False, rope_parameters=_ROPE)),  # norms after
    "tiny-granite": (
        GraniteConfig,
        dict(  # multipliers on embeddings, residuals, attention and logits
            _TINY,
            tie_word_embeddings=True,
            rope_parameters=_ROPE,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        ),
    ),
    "tiny-stablelm": (
        StableLmConfig,
        dict(  # LayerNorm, partial rotary, q/k/v bias
            _TINY,
            tie_word_embeddings=False,
            use_qkv_bias=True,
            partial_rotary_factor=0.25,
            rope_parameters=_ROPE,
        ),
    ),
    "tiny-starcoder2": (
        Starcoder2Config,
        dict(  # LayerNorm, biases everywhere, GELU MLP
            _TINY, tie_word_embeddings=True, sliding_window=None, use_bias=True, rope_parameters=_ROPE
        ),
    ),
    "tiny-mixtral": (
        MixtralConfig,
        dict(  # 4 experts, top 2, renormalised
            _TINY,
            **_MOE,
            num_local_experts=4,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters=_ROPE,
        ),
    ),
    "tiny-qwen3-moe": (
        Qwen3MoeConfig,
        dict(  # 4 experts, top 2, q/k norms
            _TINY,
            **_MOE,
            num_experts=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "tiny-smollm3": (
        SmolLM3Config,
        dict(  # NoPE on every 2nd layer
            _TINY, tie_word_embeddings=True, no_rope_layer_interval=2, rope_parameters=_ROPE
        ),
    ),
    "tiny-gpt-oss": (
        GptOssConfig,
        dict(  # attention sinks, local + global layers, 4 experts top 2
            _TINY,
            **_MOE,
            num_local_experts=4,
            sliding_window=_TINY_WINDOW,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=_ROPE,
        ),
    ),
}


def build_config(preset: str, tokenizer, **overrides) -> PretrainedConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    config_cls, kwargs = PRESETS[preset]
    special = dict(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # a deep copy: config classes write into the dicts they are given (Phi-3 puts its partial_rotary_factor
    # into rope_parameters), which presets share
    return config_cls(**copy.deepcopy({**kwargs, **special, **overrides}))


@torch.no_grad()
def randomize(model: torch.nn.Module, init_std: float, seed: int) -> None:
    """Re-draw every parameter from one seeded generator, independent of transformers' own init.

    Matrices ~ N(0, init_std); biases ~ N(0, init_std) rather than zeros; 1-D weights (RMSNorm scales,
    q/k norms included) ~ 1 + N(0, NORM_JITTER) rather than ones, so a runner that drops a bias or a
    norm gives different logits from transformers. Tied weights are visited once (named_parameters).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith(".bias"):
            param.copy_(noise * init_std)
        elif param.dim() == 1:
            param.copy_(1.0 + noise * NORM_JITTER)
        else:
            param.copy_(noise * init_std)


def make_random_model(
    preset: str, out: str | Path, *, seed: int = 0, dtype: str = "float32", **overrides
) -> Path:
    """Write a random-weight checkpoint of preset (config fields replaced by overrides) to out."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = build_config(preset, tokenizer, **overrides)
    torch.manual_seed(seed)  # transformers' init draws from the global generator; randomize() redraws all
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, config.initializer_range, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.to(DTYPES[dtype]).save_pretrained(out)
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, im_end], pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    return out


# AWQ and GPTQ 4-bit checkpoints, in the formats AutoAWQ (GEMM) and GPTQ tools write
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ puts columns 0,2,4,6,1,3,5,7 of each eight in nibbles 0..7


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[r, 8c] values 0..15 -> [r, c] int32, value j of each eight in bits 4j..4j+3."""
    words = (values.to(torch.int64).view(values.shape[0], -1, 8) << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_4bit(weight: torch.Tensor, group_size: int, symmetric: bool):
    """weight [n, k] -> (q [n, k], zeros [n, k / group_size], both 0..15, and scales float16 alike) with
    w ~ (q - zero) * scale per group of inputs; symmetric: zero 8, as GPTQ's sym=True."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide a layer's {k} inputs; choose one that does"
        )
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    if symmetric:
        scales = (torch.maximum(-lo, hi) * 2 / 15).clamp_min(1e-6).half()
        zeros = torch.full_like(lo, 8)
    else:
        scales = ((hi - lo) / 15).clamp_min(1e-6).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.clamp(torch.round(w / scales.float()[..., None]) + zeros[..., None], 0, 15)
    return q.view(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (float8_e4m3fn [n, k], float32 scales [ceil(n / block), ceil(k / block)]), one scale
    per block x block tile (max |w| / 448), as Qwen3-*-FP8 store weight and weight_scale_inv."""
    n, k = weight.shape
    tiles = (
        F.pad(weight.float(), (0, -k % block, 0, -n % block))
        .unflatten(0, (-1, block))
        .unflatten(2, (-1, block))
    )
    scales = (tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)
    full = scales.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (weight.float() / full).to(torch.float8_e4m3fn), scales


def make_quantized_model(
    src: str | Path, out: str | Path, method: str, group_size: int = 128
) -> tuple[Path, Path]:
    """Write the float checkpoint src with its decoder layers' linear weights as AWQ (GEMM, zero points) or
    GPTQ (sym, original format: zeros stored minus one) 4-bit tensors, or as FP8 (e4m3, one scale per
    group_size x group_size block), to out, and the same model with those weights dequantized, in float32,
    to out-dequantized: the reference the engine's logits are checked against. Returns both directories."""
    if method not in ("awq", "gptq", "fp8"):
        raise ValueError(f"method must be 'awq', 'gptq' or 'fp8', got {method!r}")
    src, out = Path(src), Path(out)
    reference = out.with_name(out.name + "-dequantized")
    for d in (out, reference):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    packed, dequantized = {}, {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else None
                if module not in QUANTIZED_MODULES:
                    packed[name] = dequantized[name] = tensor
                    continue
                if method == "fp8":
                    packed[name], scales = quantize_fp8(tensor, group_size)
                    packed[f"{name.removesuffix('.weight')}.weight_scale_inv"] = scales
                    dequantized[name] = (
                        packed[name].float()
                        * scales.repeat_interleave(group_size, 0)[: tensor.shape[0]].repeat_interleave(
                            group_size, 1
                        )[:, : tensor.shape[1]]
                    )
                    continue
                q, zeros, scales = quantize_4bit(tensor, group_size, symmetric=method == "gptq")
                dequantized[name] = (
                    q.float() - zeros.float().repeat_interleave(group_size, 1)
                ) * scales.float().repeat_interleave(group_size, 1)
                prefix = name.removesuffix(".weight")
                if method == "awq":  # qweight [k, n/8], qzeros [groups, n/8], columns interleaved
                    order = torch.arange(q.shape[0]).view(-1, 8)[:, list(AWQ_ORDER)].flatten()
                    packed[f"{prefix}.qweight"] = pack_nibbles(q.T[:, order])
                    packed[f"{prefix}.qzeros"] = pack_nibbles(zeros.T[:, order])
                else:  # qweight [k/8, n] packed along the inputs; qzeros [groups, n/8] minus one
                    packed[f"{prefix}.qweight"] = pack_nibbles(q).T
                    packed[f"{prefix}.qzeros"] = pack_nibbles(zeros.T - 1)
                    packed[f"{prefix}.g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // group_size
                packed[f"{prefix}.scales"] = scales.T.contiguous()
    save_file(
        {k: v.contiguous() for k, v in packed.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    save_file(
        {k: v.contiguous() for k, v in dequantized.items()},
        reference / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "awq": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        },
        "gptq": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "sym": True,
            "desc_act": False,
            "checkpoint_format": "gptq",
        },
        "fp8": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [group_size, group_size],
        },
    }[method]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("out", nargs="?", type=Path, help="output directory (default: benchmarks/models/PRESET)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--quantize",
        choices=("awq", "gptq", "fp8"),
        help="also write OUT-awq / OUT-gptq (4-bit) / OUT-fp8 and its dequantized float32 reference",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="inputs per 4-bit scale; FP8: rows and columns per scale (with --quantize)",
    )
    args = p.parse_args()
    out = make_random_model(
        args.preset, args.out or DEFAULT_OUT_DIR / args.preset, seed=args.seed, dtype=args.dtype
    )
    if args.quantize:
        quantized, _ = make_quantized_model(
            out, out.with_name(f"{out.name}-{args.quantize}"), args.quantize, args.group_size
        )
        print(f"{args.quantize}: {quantized} (+ {quantized.name}-dequantized)")
    config = json.loads((out / "config.json").read_text())
    num_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(
        f"{args.preset}: {config['architectures'][0]}, vocab {config['vocab_size']}, "
        f"{num_bytes / 1e6:.1f} MB {args.dtype} -> {out}"
    )


if __name__ == "__main__":
    main()
