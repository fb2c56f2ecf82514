"""Fixtures of the unit tier: fakes only (tests/fakes.py), no model, no process. The tier holds itself to
that: a unit test that starts a process (subprocess, multiprocessing) fails, naming where it belongs.
The sampler draws with torch here: its C race would build the kernels (a compiler process) where no
earlier test has (tests/integration/engine/test_cpu_kernel.py tests it)."""

import multiprocessing.process
import subprocess

import pytest

from engine.kernels import cpu as cpu_kernel
from tests.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def _no_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(
            "a unit test starts no process: this test belongs in tests/integration or tests/system"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(autouse=True)
def _torch_draws(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "race", lambda num_threads: None)
