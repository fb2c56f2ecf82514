"""The CPU dtype probe: it measures, stays cheap, and chooses by its own figures (a real engine serving
in what it chose: tests/integration/engine/test_dtype_probe.py)."""

import json
import math
import time

import pytest
import torch

from engine.executor import dtype_probe
from engine.executor.dtype_probe import MIN_SPEEDUP, ROWS, DtypeProbe, probe_cpu_dtype


@pytest.fixture(autouse=True)
def fresh_probe():
    """Each test measures anew (the probe is cached per shape for the process)."""
    probe_cpu_dtype.cache_clear()
    yield
    probe_cpu_dtype.cache_clear()


def test_probe_measures_both_dtypes_and_chooses_by_its_figures():
    probe = probe_cpu_dtype(576, 1536)  # the SmolLM-135M shape
    assert set(probe.seconds) == {"float32", "bfloat16"}
    assert set(probe.seconds["float32"]) == set(ROWS) and all(
        s > 0 for s in probe.seconds["float32"].values()
    )
    assert probe.seconds["bfloat16"] and set(probe.seconds["bfloat16"]) <= set(ROWS)
    is_complete = set(probe.seconds["bfloat16"]) == set(ROWS)
    assert probe.chosen == ("bfloat16" if probe.speedup >= MIN_SPEEDUP and is_complete else "float32")
    assert probe.probe_seconds < 5.0  # well under a second on an idle box; a shared 2-core box gets margin
    assert probe_cpu_dtype(576, 1536) is probe  # measured once per shape
    report = probe.to_dict()
    assert json.loads(json.dumps(report)) == report and report["chosen"] == probe.chosen


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "chosen"),
    [
        (2.0, 1.0, "bfloat16"),  # an AMX machine: bf16 twice as fast
        (1.0, 2.0, "float32"),  # an EPYC without AMX: bf16 slower
        (1.05, 1.0, "float32"),  # a tie keeps fp32, whose CPU path is the tuned one
    ],
)
def test_the_choice_follows_the_measured_ratio(monkeypatch, fp32_s, bf16_s, chosen):
    times = {"torch.float32": fp32_s, "torch.bfloat16": bf16_s}
    monkeypatch.setattr(
        dtype_probe, "_best_time", lambda x, w, give_up_s=math.inf: (times[str(x.dtype)], False)
    )
    probe = probe_cpu_dtype(64, 128)
    assert (probe.chosen, round(probe.speedup, 3)) == (chosen, round(fp32_s / bf16_s, 3))


def test_bf16_far_slower_on_the_first_shape_ends_the_probe_there(monkeypatch):
    calls = []

    def best_time(x, w, give_up_s=math.inf):
        calls.append((str(x.dtype), x.shape[0]))
        if x.dtype == torch.bfloat16:
            return 10.0, give_up_s < 10.0  # the warm-up alone: far over GIVE_UP_SLOWDOWN x fp32
        return 0.1, False

    monkeypatch.setattr(dtype_probe, "_best_time", best_time)
    probe = probe_cpu_dtype(64, 128)
    assert probe.chosen == "float32" and probe.seconds["bfloat16"] == {ROWS[0]: 10.0}
    assert calls == [("torch.float32", r) for r in ROWS] + [("torch.bfloat16", ROWS[0])]


def test_the_probe_times_the_models_own_product_and_forgives_a_kernel_build(monkeypatch):
    """It times F.linear on an [out, in] weight, as nn.Linear runs it (the layout decides the speed: one
    EPYC ran bf16 4x slower than fp32 in x @ w[in, out], 1.8-4.7x faster in F.linear), and a first call
    that builds the shape's kernel (oneDNN JIT) is not taken for a slow dtype."""
    real_linear, shapes, built = torch.nn.functional.linear, set(), set()

    def linear(x, w, bias=None):
        shapes.add(tuple(w.shape))
        if x.dtype == torch.bfloat16 and x.shape[0] not in built:
            built.add(x.shape[0])
            time.sleep(0.02)  # the kernel build of the first call per shape
        return real_linear(x, w, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    probe = probe_cpu_dtype(64, 128)
    assert shapes == {(128, 64)}
    assert set(probe.seconds["bfloat16"]) == set(ROWS)  # no shape given up for its build
    assert all(s < 0.02 for s in probe.seconds["bfloat16"].values())  # the build is not in the figures


def test_a_big_model_is_probed_on_a_capped_weight():
    hidden, inner = dtype_probe._capped(8192, 28672)  # a 70B-class layer: 940 MiB in fp32
    assert hidden * inner <= dtype_probe.MAX_WEIGHT_ELEMENTS
    assert abs(inner / hidden - 28672 / 8192) < 0.05


def test_to_dict_is_plain_json():
    probe = DtypeProbe("float32", 0.5, {"float32": {1: 1e-4}}, 0.01)
    assert probe.to_dict() == {
        "chosen": "float32",
        "bf16_speedup": 0.5,
        "probe_seconds": 0.01,
        "seconds": {"float32": {"1": 0.0001}},
    }
