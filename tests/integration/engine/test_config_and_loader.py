"""Model directories are checked before anything heavy, fast; a sharded or odd checkpoint loads as the
whole one does, or is refused naming what is wrong (EngineConfig's own checks:
tests/unit/engine/test_config_and_loader.py)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from engine.config import OFFLINE_SPIN_COUNT
from engine.errors import ModelValidationError
from engine.executor.loader import validate_model_dir


@pytest.fixture
def model_dir(tmp_path, random_model):
    target = tmp_path / "m"
    shutil.copytree(random_model("tiny-llama"), target)
    return target


def _fails_fast(path, match):
    started = time.monotonic()
    with pytest.raises(ModelValidationError, match=match):
        validate_model_dir(path)
    assert time.monotonic() - started < 5.0  # milliseconds: no weights read; 5 s for a loaded 2-core box


def test_valid_directory(model_dir):
    files = validate_model_dir(model_dir)
    assert files.architecture == "LlamaForCausalLM" and files.chat_template


def test_missing_tokenizer_json(model_dir):
    (model_dir / "tokenizer.json").unlink()
    _fails_fast(model_dir, "tokenizer.json is missing")


def test_missing_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    _fails_fast(model_dir, "model.safetensors is missing")


def test_pickle_only_weights_are_refused(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    _fails_fast(model_dir, "pytorch_model.bin.*pickle is never loaded")


def test_not_a_directory(model_dir, tmp_path):
    _fails_fast(model_dir / "config.json", "is not a directory")
    _fails_fast(tmp_path / "nowhere", "does not exist")


def test_bad_config_and_remote_code(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    _fails_fast(model_dir, "remote code")
    (model_dir / "config.json").write_text("{not json")
    _fails_fast(model_dir, "config.json is not valid JSON")


@pytest.mark.parametrize(
    "name", ["chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json", "sub/vocab.txt"]
)
def test_a_file_linked_out_of_the_model_directory_is_refused(model_dir, tmp_path, name):
    """transformers opens whatever tokenizer files it finds: a link to a file outside would let any API
    user read it (/tokenize renders the chat template)."""
    secret = tmp_path / "secret.txt"
    secret.write_text(json.dumps({"secret": "root:x:0:0"}))
    link = model_dir / name
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    _fails_fast(model_dir, f"{name} links outside .*refused")
    assert (
        validate_model_dir(model_dir, files_root=tmp_path).path == model_dir.resolve()
    )  # inside the root given


def test_links_inside_the_directory_or_its_root_are_followed(model_dir, tmp_path):
    """An HF cache snapshot links its files into ../../blobs: inside a models root that holds both."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (model_dir / "generation_config.json").rename(blobs / "abc123")
    (model_dir / "generation_config.json").symlink_to(blobs / "abc123")
    (model_dir / "copy.json").symlink_to(model_dir / "config.json")
    _fails_fast(model_dir, "generation_config.json links outside")
    assert validate_model_dir(model_dir, files_root=tmp_path).path == model_dir.resolve()


def _shard(model_dir) -> dict:
    """Rename the weights to an indexed shard, as HF's sharded repos hold them; the index's weight map."""
    from safetensors import safe_open

    shard = "model-00001-of-00001.safetensors"
    (model_dir / "model.safetensors").rename(model_dir / shard)
    with safe_open(model_dir / shard, "pt") as f:
        weight_map = dict.fromkeys(f.keys(), shard)
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return weight_map


def test_an_index_chooses_the_weight_files_and_strays_are_left_out_with_a_warning(model_dir, caplog):
    """A mistralai-style repo (shards + consolidated.safetensors) or a stale model.safetensors beside
    the shards: the index decides, as HF and vLLM load them."""
    _shard(model_dir)
    shutil.copy(model_dir / "model-00001-of-00001.safetensors", model_dir / "consolidated.safetensors")
    (model_dir / "model.safetensors").write_bytes(b"stale")
    files = validate_model_dir(model_dir)
    assert [p.name for p in files.weight_files] == ["model-00001-of-00001.safetensors"]
    assert (
        "['consolidated.safetensors', 'model.safetensors'] not in model.safetensors.index.json" in caplog.text
    )


def test_an_index_naming_a_missing_or_foreign_file_is_refused(model_dir):
    weight_map = _shard(model_dir)
    index = model_dir / "model.safetensors.index.json"
    first = next(iter(weight_map))
    index.write_text(json.dumps({"weight_map": {**weight_map, first: "model-00002-of-00002.safetensors"}}))
    _fails_fast(model_dir, "names model-00002-of-00002.safetensors, which is missing")
    index.write_text(json.dumps({"weight_map": {**weight_map, first: "../x.safetensors"}}))
    _fails_fast(model_dir, "only .safetensors files of the model directory")


def test_without_an_index_consolidated_weights_beside_hf_ones_are_left_out(model_dir):
    shutil.copy(model_dir / "model.safetensors", model_dir / "consolidated.safetensors")
    assert [p.name for p in validate_model_dir(model_dir).weight_files] == ["model.safetensors"]


def test_a_sharded_repo_serves_the_same_tokens(model_dir, random_model):
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    whole = LLM(random_model("tiny-llama"), dtype="float32", max_model_len=64).generate(
        [[5, 6, 7]], params, use_tqdm=False
    )
    _shard(model_dir)
    sharded = LLM(str(model_dir), dtype="float32", max_model_len=64).generate(
        [[5, 6, 7]], params, use_tqdm=False
    )
    assert sharded[0].outputs[0].token_ids == whole[0].outputs[0].token_ids


def test_max_model_len_follows_yarn_and_above_the_model_is_an_error(random_model):
    from transformers import LlamaConfig

    from engine import LLM
    from engine.executor.loader import supported_max_len

    yarn = LlamaConfig(
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "rope_theta": 10000.0,
        },
    )
    assert supported_max_len(yarn) == 4096
    assert supported_max_len(LlamaConfig(max_position_embeddings=1024)) == 1024
    with pytest.raises(ValueError, match="max_model_len 4096 is above what the model supports \\(1024"):
        LLM(random_model("tiny-llama"), dtype="float32", max_model_len=4096)


def test_the_loader_refuses_what_no_forward_serves_and_knows_every_forward(model_dir):
    from engine.executor.loader import OWN_ARCHITECTURES
    from engine.executor.models import MODEL_CLASSES

    assert set(MODEL_CLASSES) == set(OWN_ARCHITECTURES)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(
        json.dumps({**config, "architectures": ["Gemma3ForConditionalGeneration"]})
    )
    _fails_fast(
        model_dir, "architecture Gemma3ForConditionalGeneration is not supported: neither an own forward"
    )
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                **config,
                "architectures": ["Qwen3NextForCausalLM"],
                "layer_types": ["linear_attention", "full_attention"],
            }
        )
    )
    _fails_fast(model_dir, "has linear_attention layers, whose state a paged KV cache does not hold")
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    assert validate_model_dir(model_dir).architecture == "GPTNeoXForCausalLM"  # the generic backend's
    (model_dir / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "longrope"}})
    )
    _fails_fast(model_dir, "rope_type 'longrope' is not supported")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            "lacks model.layers.1.self_attn.k_proj.weight$",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][:64]}
            ),
            r"misshapen model.layers.0.mlp.up_proj.weight \(64, 64\) \(expected \(128, 64\)\)",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.extra.weight": t["model.norm.weight"].clone()}),
            "has tensors no layer takes: model.layers.0.mlp.extra.weight",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_fails_before_any_weight_is_read(
    model_dir, monkeypatch, edit, message
):
    """Found from the safetensors headers, named as the checkpoint names it (k_proj, not our fused qkv)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine import LLM

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    edit(tensors)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        model_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    monkeypatch.setattr(
        "engine.executor.models._read_safetensors", lambda *a: pytest.fail("a weight was read")
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), dtype="float32", max_model_len=64)


@pytest.mark.parametrize(
    ("preset", "name"),
    [
        ("tiny-phi3", "model.layers.1.self_attn.qkv_proj.weight"),  # fused in the checkpoint
        ("tiny-mixtral", "model.layers.0.block_sparse_moe.experts.3.w3.weight"),
        ("tiny-qwen3-moe", "model.layers.1.mlp.gate.weight"),
    ],
)
def test_own_forwards_name_a_missing_tensor_as_their_checkpoint_does(
    random_model, tmp_path, monkeypatch, preset, name
):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine import LLM

    path = tmp_path / preset
    shutil.copytree(random_model(preset), path)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert name in f.keys()  # noqa: SIM118 (safe_open is no dict)
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != name}  # noqa: SIM118
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(
        "engine.executor.models._read_safetensors", lambda *a: pytest.fail("a weight was read")
    )
    with pytest.raises(ValueError, match=f"lacks {name}$"):
        LLM(str(path), dtype="float32", max_model_len=64)


def test_asking_for_the_offline_engine_sets_its_wait_before_torch_loads():
    code = (
        "import os, sys, engine; assert 'torch' not in sys.modules; engine.LLM;"
        "assert 'torch' in sys.modules; e = os.environ;"
        "print(e.get('GOMP_SPINCOUNT'), e.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [OFFLINE_SPIN_COUNT, "None"]
