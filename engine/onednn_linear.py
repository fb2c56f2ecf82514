"""CPU linear layers through oneDNN with each weight reordered once, at load, into the blocked layout its
GEMM reads (what inductor's CPU weight freezing and vLLM's CPU build do), instead of aten's F.linear,
which reads the weight as it lies on every call.

On a 2-core AMD EPYC (AVX2) the SmolLM-135M layer shapes ran 3.5x faster at 1 row, 4.4x at 8, 2.1x at
32 and 1.8x at 128; the Qwen2-1.5B ones 1.65x at 1 row (17 GB/s of weights against aten's 10). Whether
it pays is measured at load on the model's own shape (`probe`, tens of milliseconds), never assumed:
EngineConfig.linear_kernel "auto" takes oneDNN only where it is at least 10% faster at 1 and 32 rows
together. The default is "aten" for now: a server that loaded and unloaded a model ten times on oneDNN
kept +225 MB (test_registry's memory test), which a replica that hot-swaps models cannot afford.
Results differ from F.linear by float rounding only (another summation order).
bf16 weights need AVX512 (BW/VL/DQ) or AVX-NE-CONVERT for the reorder; without, bf16 stays on aten.
"""

from dataclasses import dataclass

import torch
from torch import nn

from engine.quantization import fastest

PROBE_ROWS = (1, 32)  # a decode step of one sequence, a batch of them
MIN_GAIN = 1.1  # oneDNN must be this much faster over the probe's shapes
BATCH_HINT = 32  # rows the reorder is tuned for (vLLM's CPU build uses the same)
# oneDNN keeps memory for every row count it has run (measured: 600 distinct counts on one 384x1024
# weight, +615 MiB, and still growing on a second pass), which a leak detector rightly flags. So the
# row counts are bounded: exact up to EXACT_ROWS (decode batches), above that padded up to a multiple
# of ROW_BUCKET (prefill chunks: at most ROW_BUCKET - 1 wasted rows), and all of them run once at load
# (`warm_up`). Measured on coder-small: +79 MiB in the first pass of a varied workload, then flat
# (aten: +51 -> +73 MiB).
EXACT_ROWS = 64
ROW_BUCKET = 64


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight [out, in] reordered for oneDNN (a mkldnn tensor, held as a buffer)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = bucket(rows)
        if padded != rows:
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]


@dataclass(frozen=True)
class LinearProbe:
    chosen: str  # "onednn" or "aten"
    seconds: dict[str, dict[int, float]]  # kernel -> rows -> best time of one product
    shape: tuple[int, int]  # (in_features, out_features) timed
    error: str | None = None  # why oneDNN could not run here

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "shape": list(self.shape), "error": self.error,
                "seconds": {k: {str(r): round(s, 6) for r, s in v.items()} for k, v in self.seconds.items()}}


def probe(in_features: int, out_features: int, dtype: torch.dtype) -> LinearProbe:
    """Time F.linear against the reordered oneDNN product on one weight of the model's shape."""
    weight = torch.randn(out_features, in_features).to(dtype)
    try:
        packed = PackedLinear(weight)
    except RuntimeError as exc:  # no oneDNN reorder for this dtype on this CPU
        return LinearProbe("aten", {}, (in_features, out_features), str(exc).splitlines()[0])
    seconds: dict[str, dict[int, float]] = {"aten": {}, "onednn": {}}
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features).to(dtype)
            # a warm-up each (first-touch pages, oneDNN's primitive cache), then at least 10 ms of runs
            for kernel, product in (("aten", lambda x=x: torch.nn.functional.linear(x, weight)),
                                    ("onednn", lambda x=x: packed(x))):
                product()
                seconds[kernel][rows] = fastest(product, min_seconds=0.01)
    faster = sum(seconds["aten"].values()) >= MIN_GAIN * sum(seconds["onednn"].values())
    return LinearProbe("onednn" if faster else "aten", seconds, (in_features, out_features))


def pack_linears(module: nn.Module) -> int:
    """Replace every float nn.Linear under `module` by its PackedLinear; returns how many."""
    targets = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear]
    for name, linear in targets:
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, PackedLinear(linear.weight, linear.bias))
    return len(targets)


def bucket(rows: int) -> int:
    """The row count a product of `rows` rows runs at."""
    return rows if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET


@torch.inference_mode()
def warm_up(module: nn.Module, max_rows: int) -> int:
    """Run every PackedLinear shape under `module` once at every row count a step of up to max_rows
    tokens can use, so oneDNN's memory for them is taken before serving (and before a leak detector's
    baseline), not as new counts arrive. Layers of one model share shapes: pass one layer. Returns the
    number of row counts run."""
    counts = sorted({bucket(rows) for rows in range(1, max_rows + 1)})
    shapes = {(m.in_features, m.out_features): m for m in module.modules() if isinstance(m, PackedLinear)}
    for linear in shapes.values():
        for rows in counts:
            linear(torch.zeros(rows, linear.in_features, dtype=linear.weight.dtype))
    return len(counts)
