"""CPU linear layers through oneDNN with each weight reordered once, at load, into the blocked layout its
GEMM reads (what inductor's CPU weight freezing and vLLM's CPU build do), instead of aten's F.linear,
which reads the weight as it lies on every call.

On a 2-core AMD EPYC (AVX2) the SmolLM-135M layer shapes ran 3.5x faster at 1 row, 4.4x at 8, 2.1x at
32 and 1.8x at 128; the Qwen2-1.5B ones 1.65x at 1 row (17 GB/s of weights against aten's 10). Whether
it pays is measured at load on the model's own shape (`probe`, tens of milliseconds), never assumed:
EngineConfig.linear_kernel "auto" takes oneDNN only where it is at least 10% faster at 1 and 32 rows
together; it is the default (aten under tensor parallelism and --compile). On a 2-core EPYC with
AVX512-BF16, benchmarks/offline.py ran 222 tok/s on oneDNN against 145 on aten in float32, 333 against
320 in bf16. The probe runs once per shape and dtype in a process: where the two are close (bf16 on a
CPU whose aten bf16 products are oneDNN's too), a probe per load flipped between them, and each kernel's
products keep their own memory for good (see EXACT_ROWS): coder-small bf16 loaded on oneDNN, then on
aten, kept +96 MiB (471 -> 568 MiB), and a server kept +101 MB over ten reloads in CI.
Results differ from F.linear by float rounding only (another summation order).
bf16 weights need AVX512 (BW/VL/DQ) or AVX-NE-CONVERT for the reorder; without, bf16 stays on aten.
"""

import functools
from dataclasses import dataclass

import torch
from torch import nn

from engine.executor.layers.quantization import fastest

PROBE_ROWS = (1, 32)  # a decode step of one sequence, a batch of them
MIN_GAIN = 1.1  # oneDNN must be this much faster over the probe's shapes
BATCH_HINT = 32  # rows the reorder is tuned for (vLLM's CPU build uses the same)
# oneDNN keeps memory for every row count a product has run, for good: about 0.7 MiB per count and weight
# shape whatever the shape (measured on an AVX512-BF16 EPYC: bf16 F.linear on five weights from 384 x 640
# to 1536 x 8960, rows 2..41), and across 2048 distinct counts it kept growing on a second pass (+925 then
# +1914 MiB on coder-small's five shapes). That holds for aten's own bf16 and fp16 products (oneDNN runs
# them) as for PackedLinear; aten's float32 products (MKL) stay flat (+24 MiB over rows 1..599 of 1536 x 8960,
# twice). A server's step sizes vary, so a model that runs oneDNN products runs them at a bounded set of row
# counts (`bucket`): exact up to EXACT_ROWS (decode batches), above that rounded up to one of STEPS_PER_OCTAVE
# counts per doubling (at most 1/STEPS_PER_OCTAVE of a product's rows wasted: a product's time grows about
# linearly in its rows above ~16). LlamaForCausalLM pads its steps to them (`row_bucket`) and runs them all
# at load (`warm_up_rows`): up to 2048 tokens a step, 44 counts (coder-small bf16: +~150 MiB, once).
EXACT_ROWS = 16
STEPS_PER_OCTAVE = 4  # a power of two, at most EXACT_ROWS


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight [out, in] reordered for oneDNN (a mkldnn tensor, held as a buffer)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@dataclass(frozen=True)
class LinearProbe:
    chosen: str  # "onednn" or "aten"
    seconds: dict[str, dict[int, float]]  # kernel -> rows -> best time of one product
    shape: tuple[int, int]  # (in_features, out_features) timed
    error: str | None = None  # why oneDNN could not run here

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "shape": list(self.shape), "error": self.error,
                "seconds": {k: {str(r): round(s, 6) for r, s in v.items()} for k, v in self.seconds.items()}}


@functools.cache  # once per shape, dtype and process: a reload must choose what the first load chose
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
    """The row count a product of `rows` rows runs at (see EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - STEPS_PER_OCTAVE.bit_length())  # rows in (2^k, 2^(k+1)]: 2^k / STEPS
    return -(-rows // step) * step
