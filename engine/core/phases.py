"""The phase markers of the hot path: named ranges a profile (engine/frontend/profiler.py) sorts a
step's time by. Torch-free: without a profile running, `phase` is a null context (1-2 us a call)."""

import sys
from contextlib import AbstractContextManager, nullcontext

STEP, SCHEDULE, RUN, POSTPROCESS = (
    "pagedserve::step",
    "pagedserve::schedule",
    "pagedserve::run",
    "pagedserve::postprocess",
)
SAMPLE, FORWARD, ATTENTION = "pagedserve::sample", "pagedserve::forward", "pagedserve::attention"
GEMM = (
    "pagedserve::gemm"  # around each int8 linear layer: its C kernel is a ctypes call the profiler cannot see
)
KV_WRITE = "pagedserve::kv_write"  # around the CPU backend's K/V write, a ctypes call where the kernel runs


def phase(name: str) -> AbstractContextManager:
    """A profiler range when a profile runs, else nothing. torch is looked up, never imported: a
    profile can only run in a process that has loaded it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(name)
