"""engine.frontend.profiler on a real tiny engine: every step's time lands in exactly one category of the
hot-spot table, none negative, and the JSON carries the documented keys."""

import json

import pytest
import torch

from engine.core.phases import phase
from engine.frontend.profiler import CATEGORIES, SUM_TOLERANCE, ProfileSettings, _scope, run_profile

# 2 x 12 prompt tokens under an 8-token budget: prefill chunks, then decode steps
TINY = ProfileSettings(
    batch_size=2, prompt_len=12, output_len=3, max_num_batched_tokens=8, device="cpu", num_threads=1
)
KEYS = {
    "step_seconds",
    "attributed_seconds",
    "categories",
    "host_breakdown_seconds",
    "model",
    "settings",
    "device",
    "dtype",
    "num_steps",
    "wall_seconds",
    "step_mean_seconds",
    "unprofiled_step_mean_seconds",
    "num_preemptions",
    "top_ops",
    "machine",
    "by_step_kind",
    "cpu_seconds_per_wall_second",
}


@pytest.fixture(scope="module")
def result(random_model) -> dict:
    return run_profile(random_model(), TINY)


def test_categories_sum_to_the_step_time(result):
    figures = result["categories"]
    assert list(figures) == list(CATEGORIES)
    assert all(f["seconds"] >= 0 and f["share"] >= 0 for f in figures.values())
    total = sum(f["seconds"] for f in figures.values())
    assert total == pytest.approx(result["step_seconds"], rel=SUM_TOLERANCE)
    assert sum(f["share"] for f in figures.values()) == pytest.approx(1.0, abs=SUM_TOLERANCE)
    assert sum(result["host_breakdown_seconds"].values()) == pytest.approx(
        figures["host"]["seconds"], rel=1e-6
    )
    # every part of the table ran: prefill and decode attention, K/V writes, GEMMs, norms, the sampler
    assert all(f["seconds"] > 0 for f in figures.values()), figures
    assert result["step_seconds"] <= result["wall_seconds"]  # the ranges sit inside the timed steps
    prefill, decode = result["by_step_kind"]["prefill"], result["by_step_kind"]["decode"]
    assert prefill["num_steps"] >= 3 and decode["num_steps"] >= 1  # 24 prompt tokens need 3 steps of 8
    assert prefill["num_steps"] + decode["num_steps"] == result["num_steps"]
    assert prefill["step_seconds"] + decode["step_seconds"] == pytest.approx(result["step_seconds"])
    # decode attention too (on CPU the C kernel, which the profiler sees only as its range's self time)
    assert decode["categories"]["attention"]["seconds"] > 0, decode["categories"]


def test_the_json_has_the_documented_keys(result):
    assert set(result) >= KEYS
    json.dumps(result)  # JSON-ready as it is
    assert {"seconds", "share", "per_step_mean_seconds"} == set(result["categories"]["gemm"])
    assert 0 < len(result["top_ops"]) <= 15
    assert {"name", "calls", "self_seconds", "share"} == set(result["top_ops"][0])
    assert not any(op["name"].startswith("pagedserve::") for op in result["top_ops"])
    machine = result["machine"]
    assert len(machine["load_average_before"]) == len(machine["load_average_after"]) == 3
    assert machine["torch_threads"] >= 1 and "cpu" in machine


def test_an_int8_model_profiles_with_its_layers_as_gemm(random_model):
    result = run_profile(random_model(), ProfileSettings(**{**TINY.__dict__, "quantization": "int8"}))
    assert result["settings"]["quantization"] == "int8"
    decode = result["by_step_kind"]["decode"]["categories"]
    assert decode["gemm"]["seconds"] > 0 and decode["attention"]["seconds"] > 0, decode


def test_max_steps_bounds_the_profiled_steps(random_model):
    assert run_profile(random_model(), ProfileSettings(**{**TINY.__dict__, "max_steps": 2}))["num_steps"] == 2


def test_scope_rules():
    assert _scope("aten::linear", "run") == "gemm"  # the LM head, outside the forward
    assert _scope("aten::mm", "forward") == "gemm"
    assert (
        _scope("mkldnn::_linear_pointwise", "forward") == "gemm"
    )  # engine/executor/layers/onednn_linear.py's layers
    assert _scope("aten::index_copy_", "attention_module") == "kv_write"
    assert _scope("aten::index_copy_", "run") == "run"  # a block copy before the forward is host work
    assert _scope("aten::mul", "attention_module") == "elementwise"  # plain arithmetic inside attend
    assert _scope("aten::index_select", "attention_module") == "attention"  # a block gather
    assert _scope("aten::bmm", "attention") == "attention"  # SDPA's math path stays attention
    assert _scope("aten::rms_norm", "forward") == "elementwise"
    assert _scope("aten::tensor", "run") == "run"
    assert _scope("pagedserve::sample", "run") == "sampling"
    assert (
        _scope("pagedserve::gemm", "forward") == "gemm"
    )  # an int8 layer: its C kernel is the range's self time


def test_phase_is_free_without_a_profiler():
    with phase("pagedserve::schedule") as ctx:
        assert ctx is None  # a nullcontext: no range is recorded
    with torch.profiler.profile() as prof, phase("pagedserve::schedule"):
        pass
    assert any(e.name == "pagedserve::schedule" for e in prof.events())


def test_settings_validate_themselves():
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        ProfileSettings(batch_size=0)
    with pytest.raises(ValueError, match="max_steps must be at least 1"):
        ProfileSettings(max_steps=0)
