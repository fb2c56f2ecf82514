"""Fixtures shared by every test folder: random-weight models of each supported family, made once
per test session, and the directory that measured figures go to."""

import os
from pathlib import Path

import pytest

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
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
