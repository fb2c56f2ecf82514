"""Weight-only quantization: the decoder layers' linear weights as int8, with a float32 scale per output
row and group of inputs (w = q * scale), activations in the model's dtype.

    method  where the integers come from                          group
    int8    a float checkpoint, quantized at load (symmetric,     the whole row (per channel)
            scale = max |w| / 127 per row)
    w8a8    as int8; and a product over many rows (prefill)       the whole row
            quantizes its activations per row too (dynamic,
            symmetric) and runs as an int8 x int8 product
    awq     an AutoAWQ checkpoint (4-bit, GEMM packing)           quantization_config.group_size
    gptq    a GPTQ checkpoint (4-bit, gptq or gptq_v2 format)     quantization_config.group_size

AWQ and GPTQ store unsigned 4-bit values q with a zero point z per group: w = (q - z) * scale. At load,
q - z (in -15..15) is kept as int8, so every method runs the same kernels and w is reproduced exactly.
Memory: 1 byte per weight (a quarter of float32; 4-bit checkpoints take twice their file size).
The LM head and the embedding stay in the model's dtype, as vLLM keeps them.

On CPU, a step with few rows (decode) reads the int8 bytes directly (engine/kernels/csrc/int8_linear.c, a
quarter of float32's traffic); a step with many rows (prefill) dequantizes a slice of rows at a time
into a reused float32 buffer and runs the GEMM on it. Where one path overtakes the other depends on the
machine's GEMM (AVX2, AVX-512, AMX): `calibrate_kernel_rows` measures it at load. Without the C kernels, and on CUDA, a layer
dequantizes its weight per call (correct, not fast).

w8a8 runs its products as int8 x int8, each row of x quantized with its own scale (max |x| / 127) and
the result scaled back by both scales (in C: engine/kernels/csrc/int8_rows.c). On CPU the int8 weight is
reordered once, at load, into oneDNN's blocked layout (`Int8Linear.pack`; exact: int32 sums) and
`calibrate_kernel_rows` times those products against the C kernel from one row up: where oneDNN wins at
one row, every step's products are int8 x int8 and the plain int8 copy is dropped (1 byte a weight);
otherwise the plain copy stays for the decode kernel (2 bytes a weight). Without oneDNN's int8 operators:
`torch._int_mm` on the plain weight (which it reorders on every call). benchmarks/int8_prefill.py, 2-core
Xeon with AMX, a 128-token prefill on the Qwen2-1.5B shape: bf16 288 ms, w8a8 0.90x that (on `_int_mm`
with torch ops around it: 1.70x), int8 by dequantized slices 4.48x; batch-1 decode 10.8 tok/s in w8a8
(oneDNN from one row), 8.9 in int8; the activations' rounding against float32: docs/models.md#quantization.
"""

import functools
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QUANTIZATIONS as METHODS
from engine.kernels import cpu as cpu_kernel

KERNEL_MAX_ROWS = (
    32  # rows of x up to which a layer reads int8 directly, until calibrate_kernel_rows measures
)
CALIBRATION_ROWS = (1, 8, 16, 32, 64)
SCRATCH_ELEMENTS = 1 << 20  # float32 weights dequantized at a time for a GEMM (4 MiB, stays in cache)
ROW_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # w8a8's activations in C (cpu_kernel.int8_rows)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs columns 0,2,4,6,1,3,5,7 into nibbles 0..7


@dataclass(frozen=True)
class QuantConfig:
    method: str
    group_size: int | None  # inputs sharing one scale; None: the whole row
    zero_offset: int = 0  # GPTQ's original format stores each zero point minus one

    @property
    def from_checkpoint(self) -> bool:
        """The integers are in the checkpoint (qweight / qzeros / scales), not made at load."""
        return self.method not in ("int8", "w8a8")


FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_SCALE = (
    "weight_scale_inv"  # the leaf of an FP8 weight's scale: w = fp8 * scale, per block of weight_block_size
)


def fp8_block_size(model_config: dict) -> tuple[int, int] | None | bool:
    """An FP8 checkpoint's (rows, columns) per scale, None for one scale per tensor; False: not FP8.
    FP8 checkpoints (quant_method fp8, as Qwen3-*-FP8 ship) are dequantized at load to the serving dtype."""
    spec = model_config.get("quantization_config") or {}
    if str(spec.get("quant_method", "")).lower() != "fp8":
        return False
    if str(spec.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"FP8 format {spec.get('fmt')!r} is not supported (e4m3 only)")
    block = spec.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"FP8 weight_block_size must be two positive integers, got {block!r}")
    return block[0], block[1]


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """weight [out, in] float8 times its scale ([ceil(out / rows), ceil(in / columns)], or one), in dtype."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is not None:
        rows, cols = block
        s = s.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    return (w * s).to(dtype)


def resolve(requested: str | None, model_config: dict) -> QuantConfig | None:
    """The quantization a model runs with: its checkpoint's own (config.json's quantization_config) or,
    for a float checkpoint, the one asked for. A mismatch or a format we cannot read raises ValueError.
    FP8 checkpoints run in the serving dtype (dequantized at load: `fp8_block_size`); int8 may be asked
    on top of that."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {requested!r}")
    spec = model_config.get("quantization_config")
    if fp8_block_size(model_config) is not False:
        spec = None
    if not spec:
        if requested in ("awq", "gptq"):
            raise ValueError(
                f"quantization {requested!r} needs a {requested.upper()} checkpoint; this one has no "
                "quantization_config (use 'int8' or 'w8a8' to quantize a float checkpoint at load)"
            )
        return QuantConfig(requested, None) if requested in ("int8", "w8a8") else None
    method = str(spec.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"checkpoint quantization {method!r} is not supported; supported: awq, gptq, fp8")
    if requested not in (None, method):
        raise ValueError(f"quantization {requested!r} asked for, but the checkpoint is {method.upper()}")
    bits = spec.get("bits", spec.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method.upper()} checkpoints with {bits} bits are not supported (4 bits only)")
    group_size = spec.get("group_size", spec.get("q_group_size"))
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise ValueError(
            f"{method.upper()} group_size must be a positive integer (or -1 in GPTQ), got {group_size!r}"
        )
    if method == "awq":
        version = str(spec.get("version", "gemm")).lower()
        if version != "gemm" or spec.get("zero_point", True) is not True:
            raise ValueError(
                f"AWQ version {version!r} with zero_point={spec.get('zero_point')!r} is not supported "
                "(GEMM packing with zero points only)"
            )
        return QuantConfig("awq", group_size)
    fmt = spec.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    return QuantConfig(
        "gptq", None if group_size == -1 else group_size, zero_offset=1 if fmt == "gptq" else 0
    )


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: (q [n, k] int8, scale [n, k / group_size] float32) with q * scale ~ weight."""
    n, k = weight.shape
    groups = weight.float().reshape(n, -1, group_size or k)
    scale = (groups.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale as a [n, k] weight (the reference the kernels are tested against)."""
    n, k = q.shape
    return (q.float().reshape(n, scale.shape[1], -1) * scale[..., None]).reshape(n, k).to(dtype)


def _unpack_4bit(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values (nibble i = value i, low bits first) -> uint8 values,
    the eight of each word consecutive along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:  # [r, c] -> [r, 8, c] -> [8r, c]
        values = packed[:, None, :] >> shifts[None, :, None]
    else:  # [r, c] -> [r, c, 8] -> [r, 8c]
        values = packed[:, :, None] >> shifts[None, None, :]
    return (values & 0xF).to(torch.uint8).flatten(dim, dim + 1)


def unpack_layer(
    quant: QuantConfig, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One AWQ or GPTQ layer (its packed tensors as stored) -> (q - zero as int8 [n, k], scale [n, groups])."""
    if quant.method == "awq":  # qweight [k, n/8] and qzeros [groups, n/8], columns interleaved in each word
        order = torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].flatten()
        values, zeros = _unpack_4bit(qweight, 1)[:, order], _unpack_4bit(qzeros, 1)[:, order]
    else:  # GPTQ: qweight [k/8, n] packed along the inputs, qzeros [groups, n/8] along the outputs
        values, zeros = _unpack_4bit(qweight, 0), _unpack_4bit(qzeros, 1) + quant.zero_offset
    k, n = values.shape
    groups = scales.shape[0]
    if zeros.shape != (groups, n) or scales.shape != (groups, n) or k % groups:
        raise ValueError(
            f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit one {quant.method.upper()} layer"
        )
    centered = values.to(torch.int16) - zeros.to(torch.int16).repeat_interleave(k // groups, dim=0)
    return centered.to(torch.int8).T.contiguous(), scales.float().T.contiguous()


def check_g_idx(g_idx: torch.Tensor, group_size: int | None, name: str) -> None:
    """GPTQ's g_idx maps each input to its group; only the plain order (input i in group i // group_size)
    is supported: act-order (desc_act) checkpoints permute it."""
    k = g_idx.numel()
    if not torch.equal(g_idx.long(), torch.arange(k) // (group_size or k)):
        raise ValueError(
            f"{name}: GPTQ act-order (desc_act) checkpoints are not supported (g_idx is not in input order)"
        )


class Int8Linear(nn.Module):
    """y = x @ (weight * scales)^T + bias, weight int8 [out, in], scales float32 [out, in / group_size];
    with int8_activations (w8a8, per-channel weights only), a product over many rows quantizes x too."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int | None,
        dtype: torch.dtype,
        int8_activations: bool = False,
    ) -> None:
        super().__init__()
        self.group_size = group_size or in_features
        if in_features % self.group_size:
            raise ValueError(
                f"quantization group_size {group_size} does not divide the layer's {in_features} inputs"
            )
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        self.scales = nn.Parameter(
            torch.empty(out_features, in_features // self.group_size, dtype=torch.float32),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        if int8_activations and self.group_size != in_features:
            raise ValueError("int8 activations need one weight scale per output row (group_size None)")
        self.int8_activations = int8_activations
        self.kernel_max_rows = KERNEL_MAX_ROWS
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed", None)  # w8a8 on CPU: the weight in oneDNN's layout (pack)
        self.register_buffer("zero_points", None)  # ... and its zero points (symmetric: zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_kernel.int8_linear(torch.get_num_threads()) if x.device.type == "cpu" else None
        if kernel is not None and x.shape[0] <= self.kernel_max_rows:
            y = kernel(x.float(), self.weight, self.scales, self.group_size).to(x.dtype)
        elif kernel is not None:
            y = self._many_rows(kernel, x)
        elif self.int8_activations and x.device.type == "cpu":
            y = self._int8_product(x)
        else:
            y = F.linear(x, dequantize(self.weight, self.scales, x.dtype))
        return y if self.bias is None else y + self.bias

    def _many_rows(self, kernel: cpu_kernel.Int8LinearKernel, x: torch.Tensor) -> torch.Tensor:
        """A CPU product past the direct kernel's rows (calibrate_kernel_rows times it against it)."""
        return self._int8_product(x) if self.int8_activations else self._gemm_by_slices(kernel, x)

    def pack(self) -> bool:
        """w8a8 on CPU: reorder the int8 weight once for oneDNN's int8 x int8 products (about 2.5x
        `_int_mm`'s speed on the plain weight, whose reorder it pays on every call). False where it
        does not apply (weight-only int8, another device, a torch without oneDNN's int8 operators)."""
        if not (self.int8_activations and self.weight.device.type == "cpu" and onednn_int8()):
            return False
        self.packed = torch.ops.onednn.qlinear_prepack(self.weight.detach(), None)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        return True

    def drop_plain_weight(self) -> None:
        """After `pack`, where the direct kernel never runs (kernel_max_rows 0): the packed copy alone."""
        self.weight = nn.Parameter(self.weight.new_empty(0, self.in_features), requires_grad=False)

    def _int8_product(self, x: torch.Tensor) -> torch.Tensor:
        """x quantized per row (symmetric, max |x| / 127), times the int8 weight in int32, scaled back."""
        rows = cpu_kernel.int8_rows(torch.get_num_threads()) if x.dtype in ROW_KERNEL_DTYPES else None
        if rows is not None:
            xq, x_scale = rows.quantize(x)
        else:
            xf = x.float()
            x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(127)
            xq = (xf / x_scale).round_().to(torch.int8)  # (not in place: x.float() of float32 x is x)
        if self.packed is None:
            y = torch._int_mm(xq, self.weight.t()).float().mul_(self.scales.view(1, -1))
        else:  # oneDNN applies the weight's scales
            y = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 0, self.packed, self.scales.view(-1), self.zero_points, None, 1.0, 0,
                torch.float32, "none", [], "",
            )  # fmt: skip
        if rows is not None:
            return rows.scale(y, x_scale, x.dtype)
        return y.mul_(x_scale).to(x.dtype)

    def _gemm_by_slices(self, kernel: cpu_kernel.Int8LinearKernel, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.weight.shape
        rows = max(1, SCRATCH_ELEMENTS // in_features)
        y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        for lo in range(0, out_features, rows):
            hi = min(lo + rows, out_features)
            w = kernel.dequantize(
                self.weight[lo:hi], self.scales[lo:hi], self.group_size, out=_scratch(hi - lo, in_features)
            )
            y[:, lo:hi] = F.linear(x, w.to(x.dtype))
        return y


@torch.no_grad()
def calibrate_kernel_rows(model: nn.Module, dtype: torch.dtype) -> int | None:
    """Pack the w8a8 layers (Int8Linear.pack), then time both CPU paths on the model's largest int8 layer
    at 1..64 rows of x; every int8 layer then reads int8 directly up to the most rows at which that was
    not slower (0: never, and packed layers drop their plain weight). Returns that number (None: no int8
    layer on CPU, or no C kernel). About a second for a 1.5B model."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if not layers or layers[0].weight.device.type != "cpu":
        return None
    packed = [layer.pack() for layer in layers]
    kernel = cpu_kernel.int8_linear(torch.get_num_threads())
    best = 0
    if kernel is not None:
        big = max(layers, key=lambda m: m.weight.numel())
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, big.in_features).to(dtype)
            direct = fastest(lambda: kernel(x.float(), big.weight, big.scales, big.group_size))  # noqa: B023
            many_rows = fastest(lambda: big._many_rows(kernel, x))  # noqa: B023
            if direct > many_rows:
                break
            best = rows
    for layer, is_packed in zip(layers, packed, strict=True):
        layer.kernel_max_rows = best
        if is_packed and best == 0:
            layer.drop_plain_weight()
    return best if kernel is not None else None


@functools.cache
def onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear operators (x86 builds do) and they compute the exact
    product on this CPU, checked once against `_int_mm` on int8 values of the whole range: on a 2-core
    AVX2 EPYC (torch 2.13, no VNNI) they returned another product at 99% of the outputs."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randint(-127, 128, (rows, 64), dtype=torch.int8, generator=gen) for rows in (32, 16))
    packed = torch.ops.onednn.qlinear_prepack(w, None)
    got = torch.ops.onednn.qlinear_pointwise(
        x, 1.0, 0, packed, torch.ones(16), torch.zeros(16).long(),
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip
    return torch.equal(got, torch._int_mm(x, w.t()).float())


def fastest(fn, repeats: int = 3, min_seconds: float = 0.0) -> float:
    """Best single time of fn, over at least `repeats` runs and `min_seconds` (small shapes take microseconds)."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats or spent < min_seconds:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


_local = threading.local()  # one scratch buffer per thread: two engines' loops never share one


def _scratch(rows: int, cols: int) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        buf = _local.buf = torch.empty(max(rows * cols, SCRATCH_ELEMENTS), dtype=torch.float32)
    return buf[: rows * cols].view(rows, cols)
