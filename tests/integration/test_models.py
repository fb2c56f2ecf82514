"""The shipped models (models/) and the random checkpoints of benchmarks/make_model.py."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.make_model import PRESETS, build_config, make_random_model
from tests.harness import REPO

ROOT = REPO
SHIPPED = [ROOT / "models" / "pagedserve-coder-small", ROOT / "models" / "pagedserve-coder-tiny"]
TINY_PRESETS = sorted(name for name in PRESETS if name.startswith("tiny-"))
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=SHIPPED, ids=lambda p: p.name)
def shipped(request):
    path = request.param
    return path, AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_shipped_model_loads_offline_with_matching_vocab(shipped):
    path, model, tokenizer = shipped
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.config.vocab_size == len(tokenizer) == 4096
    ids = tokenizer("def f(x):\n    return x\n", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_shipped_special_tokens_and_generation_config(shipped):
    path, model, tokenizer = shipped
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [0, 1, 2, 3]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<pad>")
    assert tokenizer("<|im_end|>", add_special_tokens=False).input_ids == [2]
    assert model.generation_config.eos_token_id == [0, 2]


def test_shipped_chat_template_renders_chatml(shipped):
    _, _, tokenizer = shipped
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == CHATML
    assert tokenizer.apply_chat_template(messages, tokenize=False).endswith("hi<|im_end|>\n")


def test_shipped_training_report_beats_baseline(shipped):
    path, model, tokenizer = shipped
    report = json.loads((path / "training.json").read_text())
    assert report["vocab_size"] == len(tokenizer)
    assert report["uniform_baseline"] == pytest.approx(math.log(len(tokenizer)), abs=1e-3)
    assert report["val_loss"] <= 0.6 * math.log(len(tokenizer))
    assert report["chat_val_loss"] <= 0.6 * math.log(
        len(tokenizer)
    )  # held-out answers of models/chat_pairs.py
    assert report["params"] == sum(p.numel() for p in model.parameters())
    assert report["train_tokens"] > 0 and report["train_seconds"] > 0
    assert report["sample"]["prompt"] and report["sample"]["continuation"]


def test_shipped_fallback_is_distilled_to_draft_the_primarys_tokens(monkeypatch):
    """The fallback learned the primary's next-token distribution (models/train.py's TEACHERS), so as the
    primary's draft model it proposes the tokens the primary keeps: over the first 512 tokens of 8 held-out
    files their greedy next tokens agree at 67% (the same-sized model trained on the data alone: 49%)."""
    primary_dir, fallback_dir = SHIPPED
    assert json.loads((fallback_dir / "training.json").read_text())["distilled_from"] == primary_dir.name
    monkeypatch.syspath_prepend(str(ROOT / "models"))  # train.py imports its neighbours as a script does
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what importing train.py sets: undone after the test
    from train import load_corpus

    _, held_out = load_corpus()
    tokenizer = AutoTokenizer.from_pretrained(primary_dir)
    primary, fallback = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in SHIPPED)
    agree = total = 0
    for text in held_out[:8]:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :512]
        with torch.no_grad():
            picks = [model(input_ids=ids).logits.argmax(-1) for model in (primary, fallback)]
        agree, total = agree + int((picks[0] == picks[1]).sum()), total + picks[0].numel()
    assert agree / total >= 0.6, (agree, total)


def test_shipped_weights_are_bf16_safetensors_under_60_mb():
    weights = [p for d in SHIPPED for p in d.glob("*.safetensors")]
    assert [p.name for p in weights] == ["model.safetensors"] * 2
    assert sum(p.stat().st_size for p in weights) < 60_000_000
    with safe_open(weights[0], "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each tiny preset built once (seed 0, float32) and shared by the tests below."""
    return {preset: make_random_model(preset, tmp_path_factory.mktemp(preset)) for preset in TINY_PRESETS}


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_preset_builds_and_loads(preset, tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[preset])
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[preset])
    assert model.config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert model.config.model_type.startswith(preset.removeprefix("tiny-").replace("-", "_"))  # gemma3_text
    assert (tiny_dirs[preset] / "generation_config.json").is_file()
    assert (tiny_dirs[preset] / "chat_template.jinja").is_file()
    ids = tokenizer("import os\nprint(os.getcwd())\n", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    # non-degenerate: logits spread out, and positions disagree on their argmax
    assert logits.std(dim=-1).min() > 0.3
    assert len(set(logits.argmax(dim=-1).tolist())) > 1


def test_tiny_presets_exercise_their_architecture(tiny_dirs):
    def weights(preset: str) -> dict[str, torch.Tensor]:
        with safe_open(tiny_dirs[preset] / "model.safetensors", "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)

    qwen2 = weights("tiny-qwen2")
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert qwen2[f"model.layers.0.self_attn.{proj}.bias"].abs().min() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert not torch.allclose(weights("tiny-qwen3")["model.layers.0.self_attn.q_norm.weight"], torch.ones(16))
    llama = weights("tiny-llama")
    assert "model.layers.0.self_attn.q_proj.bias" not in llama
    assert not torch.allclose(llama["model.norm.weight"], torch.ones(64))
    assert "lm_head.weight" in llama and "lm_head.weight" not in qwen2  # untied vs tied


def test_make_random_model_is_seeded_and_takes_dtype_and_overrides(tiny_dirs, tmp_path):
    out = make_random_model("tiny-llama", tmp_path / "bf16", seed=0, dtype="bfloat16", num_hidden_layers=1)
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 1
    with (
        safe_open(tiny_dirs["tiny-llama"] / "model.safetensors", "pt") as fa,
        safe_open(out / "model.safetensors", "pt") as fb,
    ):
        # the embedding is drawn first, so it is the same whatever follows it
        wa, wb = fa.get_tensor("model.embed_tokens.weight"), fb.get_tensor("model.embed_tokens.weight")
    assert wb.dtype == torch.bfloat16
    assert torch.equal(wa.to(torch.bfloat16), wb)
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_random_model("tiny-llama", tmp_path / "bad", dtype="int8")


def test_big_presets_have_their_namesakes_shapes():
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED[0])
    smollm = build_config("smollm-135m", tokenizer)
    assert (smollm.model_type, smollm.hidden_size, smollm.num_hidden_layers) == ("llama", 576, 30)
    assert (smollm.num_attention_heads, smollm.num_key_value_heads, smollm.intermediate_size) == (9, 3, 1536)
    assert smollm.tie_word_embeddings and smollm.vocab_size == len(tokenizer)
    qwen2 = build_config("qwen2-1.5b", tokenizer)
    assert (qwen2.model_type, qwen2.hidden_size, qwen2.num_hidden_layers) == ("qwen2", 1536, 28)
    assert (qwen2.num_attention_heads, qwen2.num_key_value_heads, qwen2.intermediate_size) == (12, 2, 8960)
    with pytest.raises(ValueError, match="unknown preset"):
        build_config("gpt-5", tokenizer)
