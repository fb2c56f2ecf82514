"""Fixtures shared by every test folder: random-weight models of each supported family, made once
per test session, and the directory that measured figures go to."""

import json
import os
import shutil
from pathlib import Path

import pytest

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-mixtral",
            "tiny-qwen3-moe", "tiny-gemma2", "tiny-gemma3")  # own forwards
GENERIC_FAMILIES = ("tiny-gpt2", "tiny-gpt-neox", "tiny-olmo2", "tiny-granite", "tiny-stablelm",
                    "tiny-starcoder2", "tiny-smollm3",
                    "tiny-gpt-oss")  # the generic backend (engine/executor/models/generic.py)
RESULTS_DIR_ENV = "PAGEDSERVE_RESULTS_DIR"


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    made: dict[str, str] = {}

    def get(preset: str = "tiny-llama") -> str:
        from benchmarks.make_model import make_random_model  # torch loads only for tests that need it

        if preset not in made:
            made[preset] = str(make_random_model(preset, tmp_path_factory.mktemp(preset), seed=1))
        return made[preset]

    return get


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    """Where tests that measure something (chaos, failover) write their JSON figures: a temp dir, so
    a test run never touches the tracked benchmarks/results/. `make bench-resilience` sets
    PAGEDSERVE_RESULTS_DIR=benchmarks/results to record them on purpose."""
    chosen = os.environ.get(RESULTS_DIR_ENV)
    path = Path(chosen).resolve() if chosen else tmp_path_factory.mktemp("results")
    path.mkdir(parents=True, exist_ok=True)
    return path


BOS_ID = 1  # the BOS bos_model's tokenizer prepends


@pytest.fixture(scope="session")
def bos_model(random_model, tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer prepends a BOS (id BOS_ID) to every text, as Llama's prepends <s>,
    and whose chat template starts with it, as Llama 3's does."""
    path = tmp_path_factory.mktemp("bos") / "tiny-llama-bos"
    shutil.copytree(random_model("tiny-llama"), path)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = next(t["content"] for t in spec["added_tokens"] if t["id"] == BOS_ID)
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    # a template that starts with the BOS, as Llama 3's does
    (path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return path
