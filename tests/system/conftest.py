"""Fixtures of the system tier: `reaper` (every process a module starts, real replicas and nginx of
tests/system/replicas.py included) and `results_file`."""

import json
from pathlib import Path

import pytest

from tests.system.replicas import Reaper


@pytest.fixture(scope="module")
def reaper():
    """Every process a module starts; all stopped when the module ends, also after a failure."""
    processes = Reaper()
    yield processes
    processes.stop_all()


@pytest.fixture(scope="module")
def results_file(request, results_dir: Path):
    """`record(key, value)` into a JSON file named by the module's `RESULTS_NAME` under `results_dir`
    (a temp dir, or benchmarks/results/ under `make bench-resilience`), written after every call so
    a later failure keeps what was measured before it."""
    path = results_dir / request.module.RESULTS_NAME
    results: dict = {}

    def record(key: str, value) -> None:
        results[key] = value
        path.write_text(json.dumps(results, indent=2) + "\n")

    return record
