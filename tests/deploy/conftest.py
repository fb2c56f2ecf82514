"""Fixtures for the deploy tests that run real processes (tests/deploy/replicas.py)."""

import json
from pathlib import Path

import pytest

from tests.deploy.replicas import REPO, Reaper

RESULTS_DIR = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def reaper():
    """Every process a module starts; all stopped when the module ends, also after a failure."""
    processes = Reaper()
    yield processes
    processes.stop_all()


@pytest.fixture(scope="module")
def results_file(request):
    """`record(key, value)` into a JSON file under benchmarks/results/ (named by the module's
    `RESULTS_NAME`), written after every call so a later failure keeps what was measured before it."""
    path: Path = RESULTS_DIR / request.module.RESULTS_NAME
    results: dict = {}

    def record(key: str, value) -> None:
        results[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")

    return record
