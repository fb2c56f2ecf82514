"""`--dtype auto` on CPU: measure, at start-up, whether this machine multiplies the model's matrices
faster in float32 or bfloat16, serve that one and report it (log, /health).

Our machines differ: an Intel Xeon with AMX-BF16 ran bf16 GEMMs 2.7-3.3x faster than fp32 at 32-512
rows, an AMD EPYC without AMX ran bf16 slower at every shape. So nothing is assumed from the CPU's
name or flags: the probe times the shapes a step runs (decode of one sequence, a decode batch, a
prefill chunk) against a weight of the model's own hidden x intermediate size, in both dtypes, and
chooses bf16 only when it wins clearly over the geometric mean of the shapes (a tie is fp32's).
bf16 products run through oneDNN, which keeps memory for every row count it has run: the model
runner bounds a step's row counts and runs them all at load (engine/executor/layers/onednn_linear.py's bucket).
It stays well under a second: fp32 first (fast everywhere), then bf16 from the smallest shape up, given up at the first
shape where one bf16 product takes several times the fp32 one (on a CPU without native bf16, a
256-row product of a 1536 x 8960 weight took 22 s against 0.3 s in fp32); the weight is capped.
The product is the one the model runs: F.linear on a weight laid out [out, in], as nn.Linear holds it.
The layout matters: on an AMD EPYC with AVX512-BF16, bf16 x @ w on a [in, out] weight ran 4x slower
than fp32 at one row, while F.linear on [out, in] ran bf16 1.8x faster at one row and 3.3-4.7x faster
at 8-512 rows; a probe of the other layout chose fp32 there.
"""

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

ROWS = (1, 32, 256)  # one decoding sequence, a decode batch, a prefill chunk
MIN_SPEEDUP = 1.1  # bf16 must beat fp32 by this much (geometric mean over ROWS) to be chosen
GIVE_UP_SLOWDOWN = 4.0  # a bf16 warm-up this many times the fp32 best ends the probe: fp32
# ... plus this: a warm-up includes oneDNN building its kernel for the shape (measured 9 ms for a bf16
# 576 x 1536 product at one row whose runs then took 0.04 ms), which says nothing of the speed
KERNEL_BUILD_S = 0.05
MAX_WEIGHT_ELEMENTS = 1024 * 4096  # the probe's weight is capped: 16 MiB in fp32
REPEATS = 3  # timed runs per shape and dtype (after one warm-up); the fastest counts


@dataclass(frozen=True)
class DtypeProbe:
    """What the probe measured and chose; JSON-able through `to_dict` (logged, shown in /health)."""

    chosen: str  # "float32" | "bfloat16"
    speedup: float  # fp32 time / bf16 time, geometric mean over the shapes (> 1: bf16 faster)
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # dtype -> rows -> best time (bf16:
    # the shapes measured before the probe gave up)
    probe_seconds: float = 0.0  # the probe's own cost

    def to_dict(self) -> dict[str, object]:
        return {
            "chosen": self.chosen,
            "bf16_speedup": round(self.speedup, 3),
            "probe_seconds": round(self.probe_seconds, 3),
            "seconds": {
                dtype: {str(rows): round(s, 6) for rows, s in by_rows.items()}
                for dtype, by_rows in self.seconds.items()
            },
        }


@functools.cache  # once per shape and process: the machine does not change while it runs
def probe_cpu_dtype(hidden_size: int, intermediate_size: int) -> DtypeProbe:
    """Time F.linear(x[rows, hidden], w[intermediate, hidden]) in fp32 and bf16; choose the faster."""
    start = time.perf_counter()
    hidden, inner = _capped(hidden_size, intermediate_size)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(inner, hidden, generator=generator)  # [out, in]: nn.Linear's layout
    inputs = {rows: torch.randn(rows, hidden, generator=generator) for rows in ROWS}
    fp32 = {rows: _best_time(inputs[rows], weight)[0] for rows in ROWS}
    bf16: dict[int, float] = {}
    weight = weight.to(torch.bfloat16)
    for rows in ROWS:
        bf16[rows], gave_up = _best_time(
            inputs[rows].to(torch.bfloat16), weight, GIVE_UP_SLOWDOWN * fp32[rows] + KERNEL_BUILD_S
        )
        if gave_up:
            break
    speedup = math.exp(sum(math.log(fp32[r] / bf16[r]) for r in bf16) / len(bf16))
    chosen = "bfloat16" if speedup >= MIN_SPEEDUP and len(bf16) == len(ROWS) else "float32"
    probe = DtypeProbe(chosen, speedup, {"float32": fp32, "bfloat16": bf16}, time.perf_counter() - start)
    logger.info(
        "dtype auto on CPU: %s (bf16 %.2fx fp32 on %dx%d GEMMs; probe %.0f ms)",
        chosen,
        speedup,
        hidden,
        inner,
        1000 * probe.probe_seconds,
    )
    return probe


def _capped(hidden: int, inner: int) -> tuple[int, int]:
    """The model's shape, scaled down (keeping its aspect) when the weight would exceed the cap."""
    if hidden * inner <= MAX_WEIGHT_ELEMENTS:
        return hidden, inner
    scale = math.sqrt(MAX_WEIGHT_ELEMENTS / (hidden * inner))
    return max(64, int(hidden * scale)), max(64, int(inner * scale))


def _best_time(x: torch.Tensor, w: torch.Tensor, give_up_s: float = math.inf) -> tuple[float, bool]:
    """(best of REPEATS timed products, False), or (the warm-up's time, True) when the warm-up alone
    took longer than `give_up_s` (clearly slower: not worth timing further)."""
    began = time.perf_counter()
    torch.nn.functional.linear(
        x, w
    )  # warm-up: the kernel choice and first-touch pages are not the machine's speed
    warm_up_s = time.perf_counter() - began
    if warm_up_s > give_up_s:
        return warm_up_s, True
    best = math.inf
    for _ in range(REPEATS):
        began = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - began)
    return best, False
