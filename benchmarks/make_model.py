"""Write a random-weight HF checkpoint of a known architecture, sharing the shipped tokenizer.

    python benchmarks/make_model.py --preset smollm-135m              # -> benchmarks/models/smollm-135m
    python benchmarks/make_model.py --preset tiny-qwen2 /tmp/q2 --dtype bfloat16

Benchmarks need the shapes of real models (SmolLM-135M, Qwen2-1.5B) without downloading them; tests
need tiny models of each supported family. vocab_size is always len(tokenizer) of the shipped
models/pagedserve-coder-small, so every generated id decodes (a larger vocab would emit ids the
tokenizer silently drops), which makes the big presets a little smaller than their namesakes.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO_ROOT / "models" / "pagedserve-coder-small"
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "models"  # gitignored
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORM_JITTER = 0.1  # norm scales become 1 + N(0, 0.1): non-trivial, but keep activations in range

# tiny presets: one shape, four families; tied/untied embeddings alternate so both paths are exercised.
# initializer_range 0.1 (not 0.02) so that logits of a 64-wide model are far from uniform.
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=1024, initializer_range=0.1, rms_norm_eps=1e-6)

# name -> (config class, config kwargs)
PRESETS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "smollm-135m": (LlamaConfig, dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Qwen2 always has q/k/v biases (and none on o_proj); the family needs no flag for them
    "qwen2-1.5b": (Qwen2Config, dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        intermediate_size=8960, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "tiny-llama": (LlamaConfig, dict(
        _TINY, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "tiny-qwen2": (Qwen2Config, dict(
        _TINY, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3: RMSNorm on q and k per head (q_norm, k_norm), no biases
    "tiny-qwen3": (Qwen3Config, dict(
        _TINY, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # as Mistral-7B v0.2+: no sliding window, rope_theta 1e6 (which also sets it apart from tiny-llama)
    "tiny-mistral": (MistralConfig, dict(
        _TINY, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def build_config(preset: str, tokenizer, **overrides) -> PretrainedConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    config_cls, kwargs = PRESETS[preset]
    special = dict(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return config_cls(**{**kwargs, **special, **overrides})


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


def make_random_model(preset: str, out: str | Path, *, seed: int = 0, dtype: str = "float32",
                      **overrides) -> Path:
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
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, im_end],
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("out", nargs="?", type=Path, help="output directory (default: benchmarks/models/PRESET)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args()
    out = make_random_model(args.preset, args.out or DEFAULT_OUT_DIR / args.preset, seed=args.seed,
                            dtype=args.dtype)
    config = json.loads((out / "config.json").read_text())
    num_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{args.preset}: {config['architectures'][0]}, vocab {config['vocab_size']}, "
          f"{num_bytes / 1e6:.1f} MB {args.dtype} -> {out}")


if __name__ == "__main__":
    main()
