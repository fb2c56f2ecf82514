"""The CPU decode-attention kernel (engine/csrc/paged_attention.c): built on first use, called via ctypes.

The C source is compiled with the system compiler (`cc`, or $CC) for this machine's CPU into
$PAGEDSERVE_KERNEL_CACHE (default ~/.cache/pagedserve/kernels), named by a hash of the source, the
flags and the CPU's feature flags, so a copy never runs on a CPU it was not built for. Building takes
well under a second. Without a compiler, or with PAGEDSERVE_CPU_KERNEL=0, `load()` returns None and
the engine keeps its pure-torch path (same results, slower).
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.c"
# -fopenmp-simd: the simd pragmas only, no OpenMP runtime (torch brings its own); threads come from the caller
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11"]
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(CFLAGS).encode(), compiler.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    cache_dir = Path(os.environ.get("PAGEDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pagedserve" / "kernels")
    target = cache_dir / f"paged_attention-{key}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # build aside, then rename: atomic for racers
            built = Path(tmp) / target.name
            subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                           capture_output=True, timeout=120)
            built.replace(target)
    return target


class DecodeKernel:
    """paged_decode_f32, its work items (sequence x KV head) split over `num_threads` threads."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._fn = library.paged_decode_f32
        self._fn.argtypes = [_ptr] * 6 + [_i64] * 6 + [ctypes.c_float, _i64, _i64]
        self._fn.restype = ctypes.c_int
        self.num_threads = max(1, num_threads)
        self._pool = self._new_pool()
        # a forked child has none of the parent's threads: the old pool would take work and never run it
        os.register_at_fork(after_in_child=self._renew_pool)

    def _new_pool(self) -> ThreadPoolExecutor | None:
        return ThreadPoolExecutor(self.num_threads - 1, "pagedserve-attn") if self.num_threads > 1 else None

    def _renew_pool(self) -> None:
        self._pool = self._new_pool()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        """q [num_seqs, num_heads, head_dim] float32; caches [num_kv_heads, num_slots, head_dim] contiguous;
        block_tables [num_seqs, max_blocks] and context_lens [num_seqs] int64. Returns like q."""
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
                and k_cache.dtype == v_cache.dtype == q.dtype == torch.float32
                and block_tables.dtype == context_lens.dtype == torch.int64):
            raise ValueError("paged_decode_f32 reads raw memory: contiguous float32 caches and int64 tables only")
        q, context_lens = q.contiguous(), context_lens.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, num_slots, _ = k_cache.shape
        shared = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                  context_lens.data_ptr(), out.data_ptr(), num_heads, num_kv_heads, head_dim, num_slots,
                  block_size, block_tables.shape[1], scale)
        work = num_seqs * num_kv_heads
        bounds = [work * i // self.num_threads for i in range(self.num_threads + 1)]
        ranges = [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
        futures = [self._pool.submit(self._fn, *shared, lo, hi) for lo, hi in ranges[1:]] if self._pool else []
        codes = [self._fn(*shared, *ranges[0])] + [f.result() for f in futures]
        if any(codes):
            raise MemoryError("paged_decode_f32: out of memory for its scratch buffer")
        return out


@cache
def load(num_threads: int) -> DecodeKernel | None:
    """The kernel for this machine, or None (no compiler, a failed build, or PAGEDSERVE_CPU_KERNEL=0)."""
    if os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: decode attention on CPU uses the slower pure-torch path")
        return None
    try:
        return DecodeKernel(ctypes.CDLL(str(_build(compiler))), num_threads)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("building the CPU attention kernel failed (%s %s): using the pure-torch path",
                       e, detail.decode(errors="replace")[-500:])
        return None
