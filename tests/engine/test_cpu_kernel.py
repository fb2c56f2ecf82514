"""The C decode-attention kernel against a float64 reference, and the engine's pure-torch path (used
without a compiler) against transformers."""

import math
import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, cpu_kernel

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine runs its pure-torch path")


def _reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Per sequence: gather its slots in order, softmax(q k^T) v in float64, GQA heads h -> h // groups."""
    num_seqs, num_heads, _ = q.shape
    groups = num_heads // k_cache.shape[0]
    out = torch.empty_like(q, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lens[s])
        slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size for p in range(n)])
        for h in range(num_heads):
            k = k_cache[h // groups, slots].double()
            v = v_cache[h // groups, slots].double()
            p = torch.softmax(k @ q[s, h].double() * scale, dim=0)
            out[s, h] = p @ v
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 1), (6, 2, 64, 32)])
@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size, num_threads, dtype):
    """bfloat16: the caches and q are bfloat16, the sums float32, so against float64 on the same bfloat16
    values only the output's rounding to bfloat16 differs."""
    kernel = cpu_kernel.load(num_threads)
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    num_blocks, lens = 256, torch.tensor([1, 5, block_size, block_size + 1, 3 * block_size - 1, 70])
    max_blocks = math.ceil(int(lens.max()) / block_size)
    k_cache = torch.randn(num_kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    # distinct blocks per sequence, shuffled; tables padded with block 0 as the model runner does
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    for s, n in enumerate(lens.tolist()):
        need = math.ceil(n / block_size)
        tables[s, :need] = torch.tensor([perm.pop() for _ in range(need)])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = kernel(q, k_cache, v_cache, tables, lens, block_size, scale)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bfloat16 output: 8 bits of mantissa
    torch.testing.assert_close(got.double(), _reference(q, k_cache, v_cache, tables, lens, block_size, scale),
                               rtol=tol, atol=tol)


def test_the_build_has_the_paths_this_cpu_can_run():
    """The AVX-512 kernel (and its AVX512-BF16 scores) is built where the CPU has it, so the test above ran
    it (its head_dims are multiples of 32 but one); elsewhere only the portable one is."""
    flags = set(cpu_kernel._cpu_flags().split())
    expected = ({"avx512f", "avx512bw"} <= flags) | (2 if {"avx512f", "avx512bw", "avx512_bf16"} <= flags else 0)
    assert cpu_kernel.load(1).features == expected


def test_engine_uses_kernel_on_cpu_fp32_and_bf16(random_model):
    for dtype in ("float32", "bfloat16"):
        assert LLM(random_model("tiny-llama"), dtype=dtype, max_model_len=128).engine.model_runner.decode_kernel \
            is not None
    llm = LLM(random_model("tiny-llama"), dtype="float16", max_model_len=128)
    assert llm.engine.model_runner.decode_kernel is None


def _run_in_child(args, queue):
    queue.put(cpu_kernel.load(2)(*args).tolist())


def test_kernel_works_in_a_forked_child():
    """A child forked after the kernel's thread pool started gets a pool of its own (no hang)."""
    kernel = cpu_kernel.load(2)
    k_cache, v_cache = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    args = (torch.randn(3, 4, 16), k_cache, v_cache, torch.tensor([[0, 1], [2, 3], [3, 0]]),
            torch.tensor([20, 32, 5]), 16, 0.25)
    expected = kernel(*args)  # the pool has run work before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_in_child, args=(args, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    torch.testing.assert_close(torch.tensor(got), expected)


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_the_kv_pool_memory_comes_in_huge_pages_where_the_kernel_allows():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    pool = cpu_kernel.huge_page_zeros((4, 8 << 20), torch.bfloat16)  # 64 MiB
    assert pool.shape == (4, 8 << 20) and pool.dtype == torch.bfloat16 and not pool.any()
    assert _anon_huge_kib(pool.data_ptr() + (32 << 20)) >= 2048  # at least one 2 MiB page

