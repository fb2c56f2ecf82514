"""The CPU kernels in engine/kernels/csrc (decode attention, the int8 linear layer and w8a8's activations,
LoRA deltas, sampling's race, RMSNorm, RoPE, SiLU * up, a draft model's whole step): built on first use,
called via ctypes.

The C sources are compiled with the system compiler (`cc`, or $CC) for this machine's CPU into one
library in $PAGEDSERVE_KERNEL_CACHE (default ~/.cache/pagedserve/kernels), named by a hash of the
sources, the flags and the CPU's feature flags, so a copy never runs on a CPU it was not built for.
Building takes about a second. Without a compiler, or with PAGEDSERVE_CPU_KERNEL=0, `load()`,
`int8_linear()`, `int8_rows()`, `lora_rows()`, `race()`, `rms_norm()`, `rope()`, `silu_mul()` and
`draft_step()` return None and the engine keeps its pure-torch paths (same results up to float rounding,
slower; sampling's race draws its own numbers there, torch's).
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from engine.config import openmp_spins

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.c",
        "int8_linear.c",
        "int8_rows.c",
        "lora_rows.c",
        "race.c",
        "rms_norm.c",
        "rope.c",
        "silu_mul.c",
        "thread_pool.c",
        "draft_step.c",
        "few_rows.c",
    )
)
HEADERS = (CSRC / "kernel_math.h",)
# -fopenmp-simd: the simd pragmas only, no OpenMP runtime (torch brings its own); threads: csrc/thread_pool.c
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11", "-pthread"]
# each kernel's index in csrc/thread_pool.c's table, by the dtype it runs in
KERNELS = {
    "paged_decode": {torch.float32: 0, torch.bfloat16: 1},
    "int8_linear": 2,
    "int8_dequantize": 3,
    "rms_norm": {torch.float32: 4, torch.bfloat16: 5},
    "rope": {torch.float32: 6, torch.bfloat16: 7},
    "silu_mul": {torch.float32: 8, torch.bfloat16: 9},
    "quantize_rows": {torch.float32: 10, torch.bfloat16: 11},
    "scale_rows": {torch.float32: 12, torch.bfloat16: 13},
    "lora_rows": {torch.float32: 14, torch.bfloat16: 15},
    "race_scores": 16,
    "head_norm": {torch.float32: 18, torch.bfloat16: 19},
    "few_rows": 20,
}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# below this many elements an elementwise kernel (RMSNorm, RoPE, SiLU * up) runs on the calling thread
# alone: where the other threads sleep between ops (OMP_WAIT_POLICY=PASSIVE, the server's; thread_pool.c's
# own workers) it is done before a second one would have woken (~90 us on a 2-core Xeon: SiLU * up of
# [128, 1536] bf16 took 256 us on one thread, 238 on two) ...
PARALLEL_ELEMENTS = 1 << 20
# ... and where OpenMP's team spins between ops (offline engines: engine/config.py) one waits microseconds:
# [16, 1536] took 38.8 us on one thread, 22.3 on two; RMSNorm with the residual of [16, 576] 9.9 and 7.9
SPINNING_PARALLEL_ELEMENTS = 8192


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _build(compiler: str) -> Path:
    key = hashlib.sha256(
        b"\0".join(
            [
                *(p.read_bytes() for p in SOURCES + HEADERS),
                " ".join(CFLAGS).encode(),
                compiler.encode(),
                _cpu_flags().encode(),
            ]
        )
    ).hexdigest()[:16]
    cache_dir = Path(
        os.environ.get("PAGEDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pagedserve" / "kernels"
    )
    target = cache_dir / f"pagedserve-kernels-{key}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # build aside, then rename: atomic for racers
            built = Path(tmp) / target.name
            subprocess.run(
                [compiler, *CFLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            built.replace(target)
    return target


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the CPU kernels fall back to slower pure-torch paths")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning(
            "building the CPU kernels failed (%s %s): using the pure-torch paths",
            e,
            detail.decode(errors="replace")[-500:],
        )
        return None


class Threads:
    """Runs a kernel over [0, work) split into `num_threads` ranges: the calling thread takes the first, the
    others OpenMP's team (torch's threads, where torch loaded libgomp) or else the C pool of
    csrc/thread_pool.c; ctypes releases the GIL for the whole call, and no worker needs it."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self.num_threads = max(1, num_threads)
        # run_sized's threshold: the team's threads spin between ops (config.openmp_spins) or sleep
        self.parallel_elements = (
            SPINNING_PARALLEL_ELEMENTS if library.pool_openmp() and openmp_spins() else PARALLEL_ELEMENTS
        )
        self._pool_run = library.pool_run
        self._pool_run.argtypes = [ctypes.c_int, ctypes.POINTER(_i64), _i64, ctypes.c_float, _i64, _i64]
        self._pool_run.restype = ctypes.c_int

    def run(
        self, kernel: int, ints: tuple[int, ...], work: int, f: float = 0.0, num_threads: int | None = None
    ) -> int:
        """Kernel `kernel` (an index of thread_pool.c's table) with its integer and pointer arguments `ints`
        and float argument `f` over every range (on num_threads, by default on as many as torch runs on
        in this step's thread, at most the pool's); 0, or the first error code a range returned."""
        num_threads = num_threads or min(self.num_threads, torch.get_num_threads())
        code = self._pool_run(kernel, (_i64 * len(ints))(*ints), len(ints), f, work, num_threads)
        if code in (-2, -3):  # KERNELS and thread_pool.c's table disagree: a bug, never a result
            raise RuntimeError(
                f"thread_pool.c refused kernel {kernel} with {len(ints)} arguments (code {code})"
            )
        return code

    def run_sized(self, kernel: int, ints: tuple[int, ...], work: int, elements: int, f: float = 0.0) -> int:
        """`run`, on this thread alone when the kernel touches fewer than `parallel_elements`."""
        return self.run(kernel, ints, work, f, None if elements >= self.parallel_elements else 1)


@cache
def _threads(num_threads: int) -> Threads:
    return Threads(_library(), num_threads)


class DecodeKernel:
    """paged_decode_f32 / _bf16 (by the caches' dtype), its work items (sequence x KV head) split over
    threads; `write` puts a step's new K/V rows into the pool (kv_write)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self._kernels = KERNELS["paged_decode"]
        self.threads = threads
        # 0: the portable kernel only; bit 1: an AVX-512 one for head_dim % 32 == 0; bit 2: its bf16 scores
        # on AVX512-BF16 (what the compiler targeted: this machine's CPU)
        self.features = library.paged_decode_features()
        self._kv_write = library.kv_write
        self._kv_write.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]
        self._kv_write.restype = ctypes.c_int

    @classmethod
    def _rows(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, *rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` (queries or new K/V, [n, heads, head_dim]) as the kernels read them, each token's heads
        contiguous (a copy where they are not), after checking them and the caches."""
        if not (
            k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in cls.DTYPES
            and all(
                r.dtype == k_cache.dtype and r.dim() == 3 and r.shape[2] == k_cache.shape[2] for r in rows
            )
        ):
            raise ValueError(
                "paged_decode reads raw memory: contiguous float32 or bfloat16 caches [num_kv_heads, "
                "num_slots, head_dim], and rows [n, heads, head_dim] of their dtype"
            )
        return [r if r.stride(2) == 1 and r.stride(1) == r.shape[2] else r.contiguous() for r in rows]

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor | None = None,
        row_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [num_rows, num_heads, head_dim] in the caches' dtype (read in place where each row's heads are
        contiguous: a view of the q/k/v projection's output); caches [num_kv_heads, num_slots, head_dim]
        contiguous, float32 or bfloat16 (sums in float32 either way); block_tables [num_seqs, max_blocks] and
        context_lens [num_seqs] int64. A sequence has one query row (row_starts None: num_rows == num_seqs),
        or rows row_starts[s] .. row_starts[s + 1] - 1 (int64 [num_seqs + 1]) at consecutive positions, the
        last at context_lens[s] - 1: a drafted step's verifying rows, whose blocks are then read once for all
        of them, each row's result the one it gets alone. Returns [num_rows, num_heads, head_dim] in q's
        dtype: `out`, where given (contiguous, at least num_rows rows: its first num_rows written)."""
        (q,) = self._rows(k_cache, v_cache, q)
        if not (block_tables.is_contiguous() and block_tables.dtype == context_lens.dtype == torch.int64):
            raise ValueError("paged_decode reads raw memory: int64 block tables (contiguous) and lengths")
        context_lens = context_lens.contiguous()
        num_seqs = block_tables.shape[0]
        num_rows, num_heads, head_dim = q.shape
        if context_lens.shape != (num_seqs,) or (
            (num_rows != num_seqs)
            if row_starts is None
            else not (
                row_starts.dtype == torch.int64
                and row_starts.shape == (num_seqs + 1,)
                and row_starts.is_contiguous()
            )
        ):
            raise ValueError(
                "paged_decode reads raw memory: a length and a table per sequence, and a query row per "
                "sequence or int64 row_starts [num_seqs + 1]"
            )
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif not (
            out.is_contiguous()
            and out.dtype == q.dtype
            and out.shape[0] >= num_rows
            and out.shape[1:] == q.shape[1:]
        ):
            raise ValueError("paged_decode writes raw memory: a contiguous out like q, at least its rows")
        num_kv_heads, num_slots, _ = k_cache.shape
        ints = (
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            0 if row_starts is None else row_starts.data_ptr(),
            num_rows,
            out.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            num_slots,
            block_size,
            block_tables.shape[1],
        )
        code = self.threads.run(self._kernels[k_cache.dtype], ints, num_seqs * num_kv_heads, scale)
        if code == -4:
            raise ValueError("paged_decode: a sequence's row_starts outside q's rows or past its context")
        if code:
            raise MemoryError("paged_decode: out of memory for its scratch buffer")
        return out

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """k_cache[:, slots[t]] = k[t] and v_cache[:, slots[t]] = v[t] for k, v [n, num_kv_heads, head_dim]
        in the caches' dtype and slots [n] int64: index_copy_'s result."""
        k, v = self._rows(k_cache, v_cache, k, v)
        if not (slots.dtype == torch.int64 and slots.shape == (k.shape[0],) == (v.shape[0],)) or (
            k.shape[1] != k_cache.shape[0] or v.shape[1] != k_cache.shape[0]
        ):
            raise ValueError("kv_write: int64 slots, one per row of k and v, and the caches' head count")
        slots = slots.contiguous()
        num_kv_heads, num_slots, head_dim = k_cache.shape
        code = self._kv_write(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            slots.data_ptr(),
            k.shape[0],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            num_kv_heads,
            head_dim,
            num_slots,
            k_cache.element_size(),
        )
        if code:
            raise IndexError(f"kv_write: a slot outside the pool's {num_slots}")


class Int8LinearKernel:
    """Weights q [n, k] int8 times scale [n, k / group_size] float32 (both contiguous), output rows split
    over threads: `__call__` is x @ (q * scale)^T read straight from the int8 bytes (few rows of x),
    `dequantize` writes q * scale as float32 (for a GEMM over many rows)."""

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self.threads = threads

    @staticmethod
    def _check(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
        if not (
            q.is_contiguous()
            and scale.is_contiguous()
            and q.dtype == torch.int8
            and scale.dtype == torch.float32
            and group_size > 0
            and q.shape[1] % group_size == 0
            and scale.shape == (q.shape[0], q.shape[1] // group_size)
        ):
            raise ValueError(
                "the int8 kernels read raw memory: contiguous int8 weights [n, k] and float32 "
                "scales [n, k / group_size]"
            )

    def __call__(
        self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        """x [m, k] float32 -> [m, n] float32."""
        self._check(q, scale, group_size)
        if x.dtype != torch.float32 or x.shape[1] != q.shape[1]:
            raise ValueError(f"x must be float32 [m, {q.shape[1]}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        (m, k), n = x.shape, q.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        self.threads.run(
            KERNELS["int8_linear"],
            (x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k, group_size),
            n,
        )
        return y

    def dequantize(
        self, q: torch.Tensor, scale: torch.Tensor, group_size: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q * scale as float32 [n, k], into `out` (contiguous, that shape) when given."""
        self._check(q, scale, group_size)
        w = torch.empty(q.shape, dtype=torch.float32) if out is None else out
        if w.shape != q.shape or w.dtype != torch.float32 or not w.is_contiguous():
            raise ValueError(f"out must be contiguous float32 {tuple(q.shape)}")
        self.threads.run(
            KERNELS["int8_dequantize"],
            (q.data_ptr(), scale.data_ptr(), w.data_ptr(), *q.shape, group_size),
            q.shape[0],
        )
        return w


class RMSNormKernel:
    """rms_norm_f32 / _bf16: F.rms_norm over the last dimension in one pass per row, optionally after the
    residual add (engine/kernels/csrc/rms_norm.c); rows split over threads past Threads.parallel_elements."""

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self._kernels = KERNELS["rms_norm"]
        self.threads = threads

    def runs(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this kernel can normalize x (rows of x's last dimension) by weight."""
        return (
            x.device.type == "cpu"
            and x.dtype in self._kernels
            and weight.dtype == x.dtype
            and x.is_contiguous()
            and weight.is_contiguous()
            and x.dim() >= 1
            and x.shape[-1] == weight.numel() <= 16384
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """F.rms_norm(x, weight.shape, weight, eps); with `residual` (like x), (s, F.rms_norm(s, ...)) for
        s = x + residual."""
        if not self.runs(x, weight) or (
            residual is not None
            and (residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous())
        ):
            raise ValueError(
                "rms_norm reads raw memory: contiguous CPU float32 or bfloat16 x, weight and residual "
                "of one dtype, x's last dimension the weight's size (at most 16384)"
            )
        out = torch.empty_like(x)
        total = None if residual is None else torch.empty_like(x)
        dim = x.shape[-1]
        rows = x.numel() // dim
        ints = (
            x.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            0 if total is None else total.data_ptr(),
            out.data_ptr(),
            dim,
        )
        self.threads.run_sized(
            self._kernels[x.dtype], ints, rows, x.numel(), eps
        )  # fails only on rows `runs` refuses
        return out if total is None else (total, out)

    def heads(
        self,
        x: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        num_q: int,
        num_k: int,
    ) -> None:
        """In place on x [T, heads, head_dim] (a q/k/v projection's output): each token's first num_q heads
        become F.rms_norm of them by q_weight, the next num_k by k_weight (Qwen3's q_norm and k_norm)."""
        if not (
            self.runs(x, q_weight)
            and x.dim() == 3
            and k_weight.dtype == x.dtype
            and k_weight.is_contiguous()
            and k_weight.numel() == x.shape[2]
            and num_q >= 0
            and num_k >= 0
            and num_q + num_k <= x.shape[1]
        ):
            raise ValueError(
                "head_norm reads raw memory: a contiguous CPU float32 or bfloat16 x [T, heads, head_dim] and "
                "weights of its dtype, head_dim values each"
            )
        ints = (x.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), x.shape[1], num_q, num_k, x.shape[2])
        self.threads.run_sized(KERNELS["head_norm"][x.dtype], ints, x.shape[0], x.numel(), eps)


class RopeKernel:
    """rope_f32 / _bf16: RoPE in place on the first heads of a q/k/v projection's output, bit for bit
    what engine/executor/models/llama.py's apply_rope computes (engine/kernels/csrc/rope.c); tokens are split over threads
    only past Threads.parallel_elements."""

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self._kernels = KERNELS["rope"]
        self.threads = threads

    def runs(self, heads: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether this kernel can rotate heads [T, H, D] by cos/sin [T, 1, D / 2] (or [T, D / 2])."""
        return (
            heads.device.type == "cpu"
            and heads.dtype in self._kernels
            and cos.dtype == heads.dtype
            and heads.dim() == 3
            and heads.is_contiguous()
            and heads.shape[2] % 2 == 0
            and cos.numel() == heads.shape[0] * heads.shape[2] // 2
        )

    def __call__(self, heads: torch.Tensor, rotated: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """heads[:, :rotated] = apply_rope(heads[:, :rotated], cos, sin), in place."""
        if not (
            self.runs(heads, cos)
            and sin.shape == cos.shape
            and sin.dtype == cos.dtype
            and 0 <= rotated <= heads.shape[1]
        ):
            raise ValueError(
                "rope reads raw memory: contiguous CPU float32 or bfloat16 heads [T, H, D] and cos, "
                "sin of its dtype with T x D / 2 values"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
        tokens, num_heads, head_dim = heads.shape
        shared = (heads.data_ptr(), cos.data_ptr(), sin.data_ptr(), num_heads, rotated, head_dim)
        self.threads.run_sized(self._kernels[heads.dtype], shared, tokens, heads.numel())


class SiluMulKernel:
    """silu_mul_f32 / _bf16: F.silu(gate) * up for x = [gate | up] (the fused gate/up projection's output) in
    one pass (engine/kernels/csrc/silu_mul.c); rows split over threads past Threads.parallel_elements."""

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self._kernels = KERNELS["silu_mul"]
        self.threads = threads

    def runs(self, x: torch.Tensor) -> bool:
        """Whether this kernel can read x [..., 2n]."""
        return (
            x.device.type == "cpu"
            and x.dtype in self._kernels
            and x.is_contiguous()
            and x.dim() >= 1
            and x.shape[-1] % 2 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2n] -> [..., n]: what `gate, up = x.chunk(2, dim=-1); F.silu(gate) * up` gives."""
        if not self.runs(x):
            raise ValueError(
                "silu_mul reads raw memory: a contiguous CPU float32 or bfloat16 x with an even "
                "last dimension"
            )
        n = x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], n)
        self.threads.run_sized(
            self._kernels[x.dtype], (x.data_ptr(), out.data_ptr(), n), out.numel() // max(n, 1), out.numel()
        )
        return out


class FewRowsKernel:
    """few_rows_f32 (engine/kernels/csrc/few_rows.c): F.linear(x, w) for up to MAX_ROWS rows of float32 x and
    a float32 weight [out, in], the weight read once for all rows and each row's result the same at any row
    count; the weight's rows split over threads."""

    # up to here it beat F.linear on a 4096 x 384 weight out of cache (2-core Xeon, 2 threads): 138, 164, 231
    # and 307 us at 5, 8, 12 and 16 rows against 270, 383, 537 and 373; at 32 rows 646 against 580
    MAX_ROWS = 16

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self.threads = threads

    def runs(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this kernel computes F.linear(x, weight): x [rows <= MAX_ROWS, in], weight [out, in]."""
        return (
            x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and x.dim() == weight.dim() == 2
            and 0 < x.shape[0] <= self.MAX_ROWS
            and x.shape[1] == weight.shape[1]
            and x.is_contiguous()
            and weight.is_contiguous()
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.runs(x, weight):
            raise ValueError(
                f"few_rows reads raw memory: contiguous CPU float32 x [1..{self.MAX_ROWS}, in] and weight "
                "[out, in]"
            )
        (rows, n_in), n_out = x.shape, weight.shape[0]
        out = x.new_empty(rows, n_out)
        ints = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, n_in, n_out)
        self.threads.run(KERNELS["few_rows"], ints, n_out)
        return out


class Int8RowsKernel:
    """w8a8's activations (engine/kernels/csrc/int8_rows.c), float32 or bfloat16, rows split over threads
    past Threads.parallel_elements: `quantize` rounds each row of x to int8 with its own scale, `scale`
    multiplies an int8 product's float32 rows back by them."""

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self.threads = threads

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [m, k] -> (q [m, k] int8, scale [m, 1] float32), q * scale ~ x (round half to even)."""
        if x.device.type != "cpu" or x.dtype not in KERNELS["quantize_rows"] or x.dim() != 2:
            raise ValueError(
                f"quantize_rows takes a CPU float32 or bfloat16 [m, k] x, got {x.dtype} {x.dim()}-d"
            )
        x = x.contiguous()
        (m, k) = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        scale = torch.empty(m, 1, dtype=torch.float32)
        self.threads.run_sized(
            KERNELS["quantize_rows"][x.dtype], (x.data_ptr(), q.data_ptr(), scale.data_ptr(), k), m, x.numel()
        )
        return q, scale

    def scale(self, y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [m, n] float32 (contiguous) times scale [m, 1] row by row, in `dtype` (float32: y in place)."""
        if not (
            y.dtype == torch.float32
            and y.is_contiguous()
            and y.dim() == 2
            and scale.dtype == torch.float32
            and scale.is_contiguous()
            and scale.numel() == y.shape[0]
            and dtype in KERNELS["scale_rows"]
        ):
            raise ValueError(
                "scale_rows takes contiguous float32 y [m, n] and scale [m, 1], out in float32 or bfloat16"
            )
        (m, n), kernel = y.shape, KERNELS["scale_rows"][dtype]
        if dtype == torch.float32:
            self.threads.run_sized(kernel, (y.data_ptr(), scale.data_ptr(), n), m, y.numel())
            return y
        out = torch.empty(m, n, dtype=dtype)
        self.threads.run_sized(kernel, (y.data_ptr(), scale.data_ptr(), out.data_ptr(), n), m, y.numel())
        return out


class LoraRowsKernel:
    """lora_rows_f32 / _bf16 (engine/kernels/csrc/lora_rows.c): out[rows[i]] += (x[rows[i]] @ a[slots[i]]) @
    b[slots[i]] for every adapter row i, in place, rows split over threads."""

    MAX_RANK = 256

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self.threads = threads

    def runs(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether this kernel can add into out [m, n] the deltas of x [m', in] by stacks a [s, in, r] and
        b [s, r, n] (contiguous CPU tensors of one dtype)."""
        tensors = (out, x, a, b)
        return (
            out.dtype in KERNELS["lora_rows"]
            and all(t.device.type == "cpu" and t.dtype == out.dtype and t.is_contiguous() for t in tensors)
            and out.dim() == x.dim() == 2
            and a.dim() == b.dim() == 3
            and x.shape[1] == a.shape[1]
            and a.shape[2] == b.shape[1] <= self.MAX_RANK
            and b.shape[2] == out.shape[1]
        )

    def __call__(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> None:
        """rows, slots: int64 [k], each row (of x and of out) and its adapter's slot in the stacks; the
        caller guarantees they are in range (the kernel reads raw memory)."""
        if not self.runs(out, x, a, b) or rows.dtype != torch.int64 or slots.dtype != torch.int64:
            raise ValueError(
                "lora_rows reads raw memory: contiguous CPU out [m, n], x [m, in], a [s, in, r <= 256] and "
                "b [s, r, n] of one float32 or bfloat16 dtype; int64 rows and slots"
            )
        ints = (
            x.data_ptr(),
            out.data_ptr(),
            rows.data_ptr(),
            slots.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            *a.shape[1:],
            b.shape[2],
        )
        self.threads.run(KERNELS["lora_rows"][out.dtype], ints, rows.numel())


class RaceKernel:
    """race_scores_f32 (engine/kernels/csrc/race.c): p[r] /= E(seeds[r], token) in place, each token's
    exponential noise a hash of its draw's seed and its id; rows split over threads past
    Threads.parallel_elements."""

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self.threads = threads

    def __call__(self, p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """p [rows, vocab] float32 (contiguous, CPU; overwritten), seeds [rows] int64 -> p, the scores."""
        if not (
            p.device.type == "cpu"
            and p.dtype == torch.float32
            and p.is_contiguous()
            and p.dim() == 2
            and seeds.dtype == torch.int64
            and seeds.is_contiguous()
            and seeds.shape == (p.shape[0],)
        ):
            raise ValueError(
                "race_scores takes contiguous CPU float32 p [rows, vocab] and int64 seeds [rows]"
            )
        rows, vocab = p.shape
        self.threads.run_sized(
            KERNELS["race_scores"], (p.data_ptr(), seeds.data_ptr(), vocab), rows, p.numel()
        )
        return p


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not Linux / no libc symbol
        return None
    fn.argtypes, fn.restype = [_ptr, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on CPU, its memory first marked for transparent huge pages (madvise, where THP is in
    "madvise" mode; a no-op where it is "never" or the call is missing). For the KV pool: the decode kernel
    reads each sequence's blocks from scattered 4 KiB pages, one TLB miss each; with 2 MiB pages it ran
    1.4x faster on blocks spread over a 147 MiB pool (1.58 -> 1.10 ms a layer, 32 x 340 tokens, bf16)."""
    t = torch.empty(shape, dtype=dtype)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and last > first and madvise(first, last - first, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return t.zero_()  # the first touch: where the advice took, pages come in huge


class DraftStepKernel:
    """draft_step_f32 (engine/kernels/csrc/draft_step.c): a draft model's greedy tokens, a whole float32
    decode step of a small Llama-family model a token, in one call (engine/executor/draft_model.py's
    FusedDraftStep binds a model to it)."""

    DIMS = 11  # the C side's D_NUM
    WEIGHTS = 7  # its W_NUM: pointers a layer

    def __init__(self, library: ctypes.CDLL, threads: Threads) -> None:
        self._step = library.draft_step_f32
        self._step.argtypes = [_ptr, ctypes.c_float, ctypes.c_float, ctypes.c_float, *[_ptr] * 12, _i64]
        self._step.restype = ctypes.c_int

    def __call__(
        self,
        dims: tuple[int, ...],
        floats: tuple[float, float, float],
        pointers: tuple[int, ...],
        threads: int,
    ) -> None:
        """dims: the C side's D_NUM sizes; floats: (RMSNorm's eps, the attention scale, RoPE's cos/sin scale);
        pointers: the 12 that follow them in draft_step_f32, every index in them checked by the caller;
        threads: the parts the call runs in (on csrc/thread_pool.c's workers)."""
        if len(dims) != self.DIMS or len(pointers) != 12:
            raise ValueError(f"draft_step_f32 takes {self.DIMS} sizes and 12 pointers")
        code = self._step((_i64 * self.DIMS)(*dims), *floats, *pointers, threads)
        if code:
            raise RuntimeError(f"draft_step_f32 failed ({code})")


@cache
def _kernel(kind: type, num_threads: int):
    """One `kind` of kernel for this machine (one per kind and thread count), or None (no compiler, a failed
    build, or PAGEDSERVE_CPU_KERNEL=0)."""
    library = _library()
    return None if library is None else kind(library, _threads(num_threads))


def load(num_threads: int) -> DecodeKernel | None:
    """The decode-attention kernel for this machine, or None."""
    return _kernel(DecodeKernel, num_threads)


def int8_linear(num_threads: int) -> Int8LinearKernel | None:
    """The int8 linear-layer kernel for this machine, or None."""
    return _kernel(Int8LinearKernel, num_threads)


def int8_rows(num_threads: int) -> Int8RowsKernel | None:
    """w8a8's activation kernels for this machine, or None."""
    return _kernel(Int8RowsKernel, num_threads)


def lora_rows(num_threads: int) -> LoraRowsKernel | None:
    """The LoRA delta kernel for this machine, or None."""
    return _kernel(LoraRowsKernel, num_threads)


def few_rows(num_threads: int) -> FewRowsKernel | None:
    """The few-rows product kernel for this machine, or None."""
    return _kernel(FewRowsKernel, num_threads)


def race(num_threads: int) -> RaceKernel | None:
    """Sampling's race kernel for this machine, or None."""
    return _kernel(RaceKernel, num_threads)


def rms_norm(num_threads: int) -> RMSNormKernel | None:
    """The RMSNorm kernel for this machine, or None."""
    return _kernel(RMSNormKernel, num_threads)


def rope(num_threads: int) -> RopeKernel | None:
    """The RoPE kernel for this machine, or None."""
    return _kernel(RopeKernel, num_threads)


def silu_mul(num_threads: int) -> SiluMulKernel | None:
    """The SiLU * up kernel for this machine, or None."""
    return _kernel(SiluMulKernel, num_threads)


def draft_step() -> DraftStepKernel | None:
    """The draft model's one-call step for this machine, or None."""
    return _kernel(DraftStepKernel, 1)
