"""EngineConfig validates itself; model directories are checked before anything heavy, fast."""

import json
import shutil
import time

import pytest

from engine.config import EngineConfig
from engine.errors import ModelValidationError
from engine.executor.loader import validate_model_dir


@pytest.mark.parametrize("options,message", [
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(block_size=512), "block_size must be a power of two"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(scheduler_policy="lifo"), "scheduler_policy"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=10**9), r"max_num_seqs must be in 1\.\.16384"),
    (dict(max_num_batched_tokens=10**9), r"max_num_batched_tokens must be in 1\.\.1048576"),
    (dict(max_num_waiting=10**9), "max_num_waiting must be in"),
    (dict(attention_backend="triton"), "attention_backend must be one of"),
    (dict(linear_kernel="mkl"), "linear_kernel must be one of"),
    (dict(linear_kernel="onednn", compile=True), "compile runs aten's linear layers"),
])
def test_config_rejects_bad_values(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


def test_config_accepts_aliases_and_auto():
    assert EngineConfig(model="m", dtype="bf16", block_size="auto").dtype == "bfloat16"


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


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json",
                                  "sub/vocab.txt"])
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
    assert validate_model_dir(model_dir, files_root=tmp_path).path == model_dir.resolve()  # inside the root given


def test_links_inside_the_directory_or_its_root_are_followed(model_dir, tmp_path):
    """An HF cache snapshot links its files into ../../blobs: inside a models root that holds both."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (model_dir / "generation_config.json").rename(blobs / "abc123")
    (model_dir / "generation_config.json").symlink_to(blobs / "abc123")
    (model_dir / "copy.json").symlink_to(model_dir / "config.json")
    _fails_fast(model_dir, "generation_config.json links outside")
    assert validate_model_dir(model_dir, files_root=tmp_path).path == model_dir.resolve()
