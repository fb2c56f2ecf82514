"""Fixtures of the unit tier: fakes only (tests/fakes.py), no model, no process. The tier holds itself to
that: a unit test that starts a process (subprocess, multiprocessing) fails, naming where it belongs."""

import multiprocessing.process
import subprocess

import pytest

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
