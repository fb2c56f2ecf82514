"""dtype="auto" on the CPU: a real engine serves in what the probe chose (the probe itself:
tests/unit/engine/test_dtype_probe.py)."""

import pytest
import torch

from engine.executor.dtype_probe import probe_cpu_dtype


@pytest.fixture(autouse=True)
def fresh_probe():
    """Each test measures anew (the probe is cached per shape for the process)."""
    probe_cpu_dtype.cache_clear()
    yield
    probe_cpu_dtype.cache_clear()


def test_dtype_auto_on_cpu_serves_in_what_the_probe_chose(random_model):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine(
        EngineConfig(model=random_model("tiny-llama"), dtype="auto", device="cpu", block_size=8)
    )
    probe = engine.dtype_probe
    assert probe is not None and engine.dtype == probe.chosen
    assert engine.engine.model_runner.dtype == getattr(torch, probe.chosen)
    pinned = AsyncEngine(
        EngineConfig(model=random_model("tiny-llama"), dtype="float32", device="cpu", block_size=8)
    )
    assert (pinned.dtype, pinned.dtype_probe) == ("float32", None)
