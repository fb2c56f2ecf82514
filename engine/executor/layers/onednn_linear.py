"""CPU linear layers through oneDNN with each weight reordered once, at load, into the blocked layout its
GEMM reads (what inductor's CPU weight freezing and vLLM's CPU build do), instead of aten's F.linear,
which reads the weight as it lies on every call.

On a 2-core AMD EPYC (AVX2) the SmolLM-135M layer shapes ran 3.5x faster at 1 row, 4.4x at 8, 2.1x at
32 and 1.8x at 128; the Qwen2-1.5B ones 1.65x at 1 row (17 GB/s of weights against aten's 10). Whether
it pays is measured at load on the loaded model's own layers at the batch shapes it serves (`choose`),
never assumed: EngineConfig.linear_kernel "auto" keeps oneDNN unless aten runs those layers MARGIN
faster; it is the default (aten under tensor parallelism and --compile). On a 2-core EPYC with
AVX512-BF16, benchmarks/offline.py ran 222 tok/s on oneDNN against 145 on aten in float32, 333 against
320 in bf16. The choice is made once per model shape and dtype in a process: each kernel's products keep
their own memory for good (see EXACT_ROWS): coder-small bf16 loaded on oneDNN, then on aten, kept +96
MiB (471 -> 568 MiB), and a server kept +101 MB over ten reloads in CI.
Results differ from F.linear by float rounding only (another summation order).
bf16 weights need AVX512 (BW/VL/DQ) or AVX-NE-CONVERT for the reorder; without, bf16 stays on aten.
"""

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

BATCH_HINT = 32  # rows the reorder is tuned for (vLLM's CPU build uses the same)
CHOICE_LAYERS = 2  # decoder layers timed (every layer has the same shapes)
CHOICE_ROUNDS = 7  # timings of each kernel at each row count, the kernels taking turns
CHOICE_MAX_PREFILL_ROWS = 256  # the prefill chunk timed, at most
MARGIN = 0.05  # aten must be this much faster over one step of each timed kind to displace oneDNN
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


class TransposedLinear(nn.Module):
    """nn.Linear's forward on its weight held transposed ([in, out], contiguous), for aten's float32 products
    on CPU: a product of a few rows then costs about what one row does, where on nn.Linear's [out, in] MKL
    took about twice (the shipped primary's 384 x 2048 on one thread: 103 us at one row, 202 at four, 107 on
    the transposed weight), which a drafted step's verifying rows and small batches pay."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_t", weight.detach().t().contiguous())
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        """nn.Linear's [out, in] view of it."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None and x.dim() == 2:
            return torch.addmm(self.bias, x, self.weight_t)
        out = torch.matmul(x, self.weight_t)
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True)
class LinearChoice:
    chosen: str  # "onednn" or "aten"
    seconds: dict[
        str, dict[int, float]
    ]  # kernel -> rows -> median time of CHOICE_LAYERS layers' dense halves
    error: str | None = None  # why oneDNN could not run here

    def to_dict(self) -> dict:
        return {
            "chosen": self.chosen,
            "error": self.error,
            "layers_timed": CHOICE_LAYERS,
            "margin": MARGIN,
            "seconds": {k: {str(r): round(s, 6) for r, s in v.items()} for k, v in self.seconds.items()},
        }


_CHOICES: dict[tuple, LinearChoice] = {}  # one choice per model shape, dtype and process


def choose(model: nn.Module, dtype: torch.dtype, row_counts: tuple[int, ...]) -> LinearChoice:
    """Time the dense halves of the model's first CHOICE_LAYERS layers (every GEMM, norm and activation of
    a step but attention, which neither kernel runs) on aten's products and on reordered oneDNN ones, at
    each of `row_counts` (a decode step of one sequence, a full batch of them, a prefill chunk), the two
    taking turns CHOICE_ROUNDS times; oneDNN stands unless aten is faster by MARGIN. One product of one
    shape timed for 10 ms (the probe before this) flipped between the kernels from one start to the next,
    where whole runs differed 1.9x (issue 39). A reload takes the first load's choice: each kernel's
    products keep their memory for good (a server kept +101 MB over ten reloads that flipped)."""
    key = (type(model).__name__, model.args, dtype, row_counts)
    if key not in _CHOICES:
        _CHOICES[key] = _time_kernels(model, dtype, row_counts)
    return _CHOICES[key]


def reorder_error(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot reorder weights of `dtype` on this CPU, or None."""
    try:
        PackedLinear(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


@torch.inference_mode()
def _time_kernels(model: nn.Module, dtype: torch.dtype, row_counts: tuple[int, ...]) -> LinearChoice:
    error = reorder_error(dtype)
    if error is not None:
        return LinearChoice("aten", {}, error)
    layers = model.layers[:CHOICE_LAYERS]
    slots = [
        (layers.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], linear)
        for name, linear in layers.named_modules()
        if type(linear) is nn.Linear
    ]
    kernels = {
        "aten": [linear for _, _, linear in slots],
        "onednn": [PackedLinear(linear.weight, linear.bias) for _, _, linear in slots],
    }
    a, device = model.args, model.norm.weight.device
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = {
        rows: (
            torch.randn(rows, a.hidden_size, generator=gen, device=device).to(dtype) * 0.1,
            torch.ones(rows, 1, a.rotary_dim // 2, dtype=dtype, device=device),
            torch.zeros(rows, a.num_heads, a.head_dim, dtype=dtype, device=device),
        )
        for rows in row_counts
    }

    def run(rows: int) -> float:
        x, cos_sin, attn = inputs[rows]
        started = time.perf_counter()
        for layer in layers:
            layer.before_attention(x, x, cos_sin, cos_sin)
            layer.after_attention(x, attn)
        return time.perf_counter() - started

    samples: dict[str, dict[int, list[float]]] = {k: {r: [] for r in row_counts} for k in kernels}
    try:
        for turn in range(CHOICE_ROUNDS + 1):  # the first round warms up (oneDNN's primitives, first touch)
            for kernel in kernels if turn % 2 else reversed(kernels):
                for (parent, leaf, _), module in zip(slots, kernels[kernel], strict=True):
                    setattr(parent, leaf, module)
                for rows in row_counts:
                    seconds = run(rows)
                    if turn:
                        samples[kernel][rows].append(seconds)
    finally:
        for parent, leaf, linear in slots:
            setattr(parent, leaf, linear)
    medians = {k: {r: statistics.median(v) for r, v in by_rows.items()} for k, by_rows in samples.items()}
    total = {k: sum(by_rows.values()) for k, by_rows in medians.items()}  # one step of each kind
    return LinearChoice("aten" if total["aten"] * (1 + MARGIN) < total["onednn"] else "onednn", medians)


def replace_linears(module: nn.Module, kind: type[PackedLinear | TransposedLinear]) -> int:
    """Replace every float nn.Linear under `module` by `kind` (oneDNN's reordered weight, or the transposed
    one aten's float32 products run on); returns how many."""
    targets = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear]
    for name, linear in targets:
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, kind(linear.weight, linear.bias))
    return len(targets)


def bucket(rows: int) -> int:
    """The row count a product of `rows` rows runs at (see EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (
        (rows - 1).bit_length() - STEPS_PER_OCTAVE.bit_length()
    )  # rows in (2^k, 2^(k+1)]: 2^k / STEPS
    return -(-rows // step) * step
