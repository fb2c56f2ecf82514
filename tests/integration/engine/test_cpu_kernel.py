"""The C decode-attention kernel against a float64 reference, and the engine's pure-torch path (used
without a compiler) against transformers."""

import ctypes
import itertools
import math
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import LLM
from engine.core.scheduler import ScheduledSeq
from engine.executor.attention.base import StepBatch
from engine.executor.attention.torch_backend import TorchBackend
from engine.kernels import cpu as cpu_kernel

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler: the engine runs its pure-torch path",
)


def _reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Per sequence: gather its slots in order, softmax(q k^T) v in float64, GQA heads h -> h // groups."""
    num_seqs, num_heads, _ = q.shape
    groups = num_heads // k_cache.shape[0]
    out = torch.empty_like(q, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lens[s])
        slots = torch.tensor(
            [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(n)]
        )
        for h in range(num_heads):
            k = k_cache[h // groups, slots].double()
            v = v_cache[h // groups, slots].double()
            p = torch.softmax(k @ q[s, h].double() * scale, dim=0)
            out[s, h] = p @ v
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    # AVX-512 where head_dim % 32 == 0: value tiles of up to 4 query heads (groups of 6 and 5 take two) and
    # 64 dimensions (128 takes two, 96 one and a half)
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 1), (6, 2, 64, 32), (12, 2, 128, 16), (10, 2, 96, 16)],
)
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
    torch.testing.assert_close(
        got.double(), _reference(q, k_cache, v_cache, tables, lens, block_size, scale), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])  # the AVX-512 kernel and the portable one
def test_kernel_reads_queries_in_place_in_the_projections_output(dtype, head_dim):
    """q as the layer hands it over: a view of the q/k/v projection's output, its rows further apart than
    its heads; and a layout the kernel copies first (heads apart, as the generic backend's transpose)."""
    kernel = cpu_kernel.load(2)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(2, 64, head_dim, generator=gen).to(dtype) for _ in range(2))
    tables, lens = torch.tensor([[3, 1], [0, 2], [2, 0]]), torch.tensor([20, 32, 5])
    heads = torch.randn(3, 6 + 2 * 2, head_dim, generator=gen).to(dtype)  # [T, H + 2 KVH, D]
    q = heads[:, :6]
    want = kernel(q.contiguous(), k_cache, v_cache, tables, lens, 16, 0.3)
    assert torch.equal(kernel(q, k_cache, v_cache, tables, lens, 16, 0.3), want)
    by_head = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(kernel(by_head, k_cache, v_cache, tables, lens, 16, 0.3), want)
    padded = torch.zeros(5, 6, head_dim, dtype=dtype)  # a layer's padding rows past the sequences'
    assert kernel(q, k_cache, v_cache, tables, lens, 16, 0.3, padded) is padded
    assert torch.equal(padded[:3], want) and not padded[3:].any()


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])  # the AVX-512 kernel and the portable one
def test_a_sequences_consecutive_rows_read_together_get_what_each_gets_alone(head_dim, dtype, num_threads):
    """A drafted step's verifying rows: a sequence's rows at consecutive positions in one work item
    (row_starts), its blocks read once for all of them; each row's output is bit for bit what it gets as a
    sequence of its own seeing the context up to itself."""
    kernel = cpu_kernel.load(num_threads)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(2, 512, head_dim, generator=gen).to(dtype) for _ in range(2))
    counts, lens = [1, 5, 3, 2], [40, 70, 3, 17]  # rows a sequence; the last row's context
    tables = torch.randperm(32, generator=gen)[:20].view(4, 5)
    q = torch.randn(sum(counts), 6, head_dim, generator=gen).to(dtype)
    row_starts = torch.tensor([0, *itertools.accumulate(counts)])
    grouped = kernel(q, k_cache, v_cache, tables, torch.tensor(lens), 16, 0.2, row_starts=row_starts)
    alone = kernel(
        q,
        k_cache,
        v_cache,
        tables.repeat_interleave(torch.tensor(counts), dim=0),
        torch.tensor([n - c + 1 + i for c, n in zip(counts, lens, strict=True) for i in range(c)]),
        16,
        0.2,
    )
    assert torch.equal(grouped, alone)
    with pytest.raises(ValueError, match="past its context"):  # 3 rows after a context of 2
        kernel(q, k_cache, v_cache, tables, torch.tensor([40, 70, 2, 17]), 16, 0.2, row_starts=row_starts)
    with pytest.raises(ValueError, match="outside q's rows"):
        kernel(q[:-1], k_cache, v_cache, tables, torch.tensor(lens), 16, 0.2, row_starts=row_starts)
    with pytest.raises(ValueError, match="row_starts"):
        kernel(q, k_cache, v_cache, tables, torch.tensor(lens), 16, 0.2, row_starts=row_starts[:-1])


def test_the_backend_groups_a_sequences_consecutive_decode_rows():
    """TorchBackend hands the kernel one entry per run of a sequence's rows at consecutive positions (as
    a drafted step's verifying rows come), and none where every sequence has one row."""
    a, b = (SimpleNamespace(block_table=table) for table in ([4, 7], [2]))
    backend = TorchBackend(torch.device("cpu"), torch.float32, None)

    def groups(decodes):
        return backend.build(StepBatch(16, 8, torch.zeros(len(decodes), dtype=torch.long), decodes, []))

    rows = [ScheduledSeq(a, p, 1, 1) for p in (20, 21, 22)] + [ScheduledSeq(b, 5, 1, 1)]
    tables, lens, starts = groups([*rows, ScheduledSeq(a, 30, 1, 1)]).decode_row_groups
    assert tables.tolist() == [[4, 7], [2, 0], [4, 7]]
    assert lens.tolist() == [23, 6, 31] and starts.tolist() == [0, 3, 4, 5]
    assert groups([rows[0], rows[3]]).decode_row_groups is None and groups([]).decode_row_groups is None


@pytest.mark.parametrize("shape", [(4099, 384), (1000, 77)])
def test_the_few_rows_product_is_f_linear_giving_each_row_what_it_gets_alone(shape):
    """The LM head of a decode step with its draft: F.linear's result within float rounding, and each row's
    logits bit for bit the same at any row count or thread count (greedy drafted tokens then match plain
    decoding's)."""
    kernel, one_thread = cpu_kernel.few_rows(2), cpu_kernel.few_rows(1)
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(*shape, generator=gen)
    x = torch.randn(kernel.MAX_ROWS, shape[1], generator=gen)
    for rows in range(1, kernel.MAX_ROWS + 1):
        got = kernel(x[:rows], weight)
        torch.testing.assert_close(got, torch.nn.functional.linear(x[:rows], weight), rtol=1e-5, atol=1e-4)
        assert torch.equal(got, one_thread(x[:rows], weight))
        assert all(torch.equal(got[r], kernel(x[r : r + 1], weight)[0]) for r in range(rows))
    assert not kernel.runs(torch.randn(kernel.MAX_ROWS + 1, shape[1]), weight)
    assert not kernel.runs(x[:2].bfloat16(), weight.bfloat16())
    with pytest.raises(ValueError, match="few_rows"):
        kernel(x[:2, :-1], weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_puts_new_rows_where_index_copy_does(dtype):
    kernel = cpu_kernel.load(1)
    gen = torch.Generator().manual_seed(4)
    heads = torch.randn(5, 4 + 2 * 2, 32, generator=gen).to(dtype)
    k, v = heads[:, 4:6], heads[:, 6:]  # views, rows 8 heads apart
    slots = torch.tensor([7, 0, 63, 12, 8])
    k_cache, v_cache = torch.randn(2, 64, 32, generator=gen).to(dtype), torch.zeros(2, 64, 32, dtype=dtype)
    want_k = k_cache.clone().index_copy_(1, slots, k.transpose(0, 1))
    want_v = v_cache.clone().index_copy_(1, slots, v.transpose(0, 1))
    kernel.write(k, v, slots, k_cache, v_cache)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(IndexError, match="outside the pool"):
        kernel.write(k, v, torch.tensor([1, 2, 64, 3, 4]), k_cache, v_cache)
    assert torch.equal(k_cache, want_k)  # nothing written: the slots are checked first
    with pytest.raises(ValueError, match="rows"):
        kernel.write(k.float() if dtype == torch.bfloat16 else k.bfloat16(), v, slots, k_cache, v_cache)


def test_the_build_has_the_paths_this_cpu_can_run():
    """The AVX-512 kernel (and its AVX512-BF16 scores) is built where the CPU has it, so the test above ran
    it (its head_dims are multiples of 32 but one); elsewhere only the portable one is."""
    flags = set(cpu_kernel._cpu_flags().split())
    expected = ({"avx512f", "avx512bw"} <= flags) | (
        2 if {"avx512f", "avx512bw", "avx512_bf16"} <= flags else 0
    )
    assert cpu_kernel.load(1).features == expected


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the image's portable x86-64 build")
def test_the_kernels_build_and_load_for_the_images_portable_cpu(monkeypatch, tmp_path):
    """Dockerfile.cpu builds the library for x86-64-v3 (AVX2, no AVX-512): every source compiles and the
    library loads there too (a helper declared only under AVX-512 once left an undefined symbol, and the
    image would have run the pure-torch paths)."""
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in cpu_kernel.CFLAGS]
    monkeypatch.setattr(cpu_kernel, "CFLAGS", flags)
    library = ctypes.CDLL(str(cpu_kernel._build(shutil.which("cc") or shutil.which("gcc"))))
    assert library.paged_decode_features() == 0  # the portable decode kernel only
    assert library.draft_step_f32 and library.pool_run


def test_engine_uses_kernel_on_cpu_fp32_and_bf16(random_model):
    for dtype in ("float32", "bfloat16"):
        assert (
            LLM(
                random_model("tiny-llama"), dtype=dtype, max_model_len=128
            ).engine.model_runner.attention.decode_kernel
            is not None
        )
    llm = LLM(random_model("tiny-llama"), dtype="float16", max_model_len=128)
    assert llm.engine.model_runner.attention.decode_kernel is None


def _run_in_child(args, queue):
    queue.put((cpu_kernel.load(2)(*args).tolist(), cpu_kernel._library().pool_openmp()))


def test_jobs_run_on_torchs_openmp_team():
    """Where torch loaded libgomp, a kernel's threads are OpenMP's (torch's own), not a second pool's."""
    with open("/proc/self/maps") as maps:
        libgomp = "libgomp" in maps.read()
    assert cpu_kernel._library().pool_openmp() == libgomp


@pytest.mark.parametrize(
    ("wait", "threshold"),
    [
        ({"GOMP_SPINCOUNT": "30000"}, "SPINNING_PARALLEL_ELEMENTS"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "PARALLEL_ELEMENTS"),
    ],
)
def test_small_elementwise_jobs_split_only_where_the_team_spins(wait, threshold):
    """OpenMP's threads spinning between ops (offline), a kernel of a few thousand elements already runs
    on two; asleep (the server), only one past a million elements pays for waking the second."""
    code = (
        "from engine.kernels import cpu as k; print(k._threads(2).parallel_elements == k." + threshold + ")"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, **wait}, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True"]


def test_kernel_works_in_a_forked_child():
    """A child forked after the kernel's thread pool started gets a pool of its own, never OpenMP's team
    (libgomp would wait for the parent's threads: a hang)."""
    kernel = cpu_kernel.load(2)
    k_cache, v_cache = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    args = (
        torch.randn(3, 4, 16),
        k_cache,
        v_cache,
        torch.tensor([[0, 1], [2, 3], [3, 0]]),
        torch.tensor([20, 32, 5]),
        16,
        0.25,
    )
    expected = kernel(*args)  # the pool has run work before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_in_child, args=(args, queue))
    child.start()
    got, child_openmp = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    torch.testing.assert_close(torch.tensor(got), expected)
    assert child_openmp == 0


def _pool_under_callers(queue) -> None:
    """A fresh process: the pool grows 1 -> 2 -> 5 -> 8 threads while three Python threads call at once."""
    import threading

    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(3, 256, 32, generator=gen), torch.randn(3, 256, 32, generator=gen)
    tables = torch.arange(64).reshape(8, 8) % 16
    args = (torch.randn(8, 6, 32, generator=gen), k_cache, v_cache, tables, torch.arange(8) * 15 + 3, 16, 0.2)
    expected = cpu_kernel.load(1)(*args)
    failures = []

    def call(kernel) -> None:
        for _ in range(200):
            if not torch.equal(kernel(*args), expected):
                failures.append("differs")

    for num_threads in (2, 5, 8):
        kernel = cpu_kernel.load(num_threads)
        callers = [threading.Thread(target=call, args=(kernel,)) for _ in range(3)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    queue.put(failures)


def test_the_pool_grows_and_takes_callers_in_turn_without_a_hang():
    """Workers started for a job see it (a worker that missed its first job hung the caller once), and
    callers on several threads take turns; every split gives the one-thread result bit for bit."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_pool_under_callers, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) == []
    finally:
        child.join(timeout=10)
        child.kill()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "dim"), [(1, 64), (7, 576), (300, 96), (2048, 576)]
)  # the last split over threads
@pytest.mark.parametrize("num_threads", [1, 2])
def test_rms_norm_matches_torch(dtype, rows, dim, num_threads):
    kernel = cpu_kernel.rms_norm(num_threads)
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, dim).mul(3).to(dtype), torch.randn(rows, dim).to(dtype)
    weight = torch.randn(dim).to(dtype)
    total, normed = kernel(x, weight, 1e-5, residual)
    assert torch.equal(total, x + residual)  # the add rounds as torch's does
    want = torch.nn.functional.rms_norm(x + residual, (dim,), weight, 1e-5)
    # float32: another summation order; bfloat16: the same float32 value rounded once, off by a rounding at most
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7
    assert ((normed.double() - want.double()).abs() <= 4 * ulp * want.double().abs() + 1e-30).all()
    assert torch.equal(kernel(x, weight, 1e-5), kernel(x.clone(), weight, 1e-5))
    assert torch.equal(kernel(total, weight, 1e-5), normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "num_q", "num_k", "head_dim"), [(1, 4, 2, 64), (33, 16, 8, 128), (600, 9, 3, 64)]
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_head_norm_is_the_rms_norm_of_each_q_and_k_head(dtype, tokens, num_q, num_k, head_dim, num_threads):
    """Qwen3's q_norm / k_norm in place on the q/k/v projection's output: each head as the row kernel
    normalizes it (so as F.rms_norm, within its rounding), v untouched."""
    kernel = cpu_kernel.rms_norm(num_threads)
    torch.manual_seed(tokens)
    heads = torch.randn(tokens, num_q + 2 * num_k, head_dim).mul(3).to(dtype)
    q_weight, k_weight = torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype)
    before = heads.clone()
    kernel.heads(heads, q_weight, k_weight, 1e-6, num_q, num_k)
    q, k, v = before.split([num_q, num_k, num_k], dim=1)
    assert torch.equal(heads[:, :num_q], kernel(q.contiguous(), q_weight, 1e-6))
    assert torch.equal(heads[:, num_q : num_q + num_k], kernel(k.contiguous(), k_weight, 1e-6))
    assert torch.equal(heads[:, num_q + num_k :], v)
    want = torch.nn.functional.rms_norm(q, (head_dim,), q_weight, 1e-6)
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7
    got = heads[:, :num_q].double()
    assert ((got - want.double()).abs() <= 4 * ulp * want.double().abs() + 1e-30).all()
    with pytest.raises(ValueError, match="head_norm"):
        kernel.heads(heads, q_weight, k_weight.double(), 1e-6, num_q, num_k)


def test_rms_norm_refuses_what_it_cannot_read():
    kernel = cpu_kernel.rms_norm(1)
    x, weight = torch.randn(4, 8), torch.randn(8)
    assert not kernel.runs(x.t(), torch.randn(4)) and not kernel.runs(x.double(), weight.double())
    assert not kernel.runs(torch.randn(2, 20000), torch.randn(20000))
    with pytest.raises(ValueError, match="contiguous"):
        kernel(x, weight, 1e-5, torch.randn(4, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        kernel(x, weight.to(torch.bfloat16), 1e-5)


def test_rms_norm_keeps_nan_and_inf():
    kernel = cpu_kernel.rms_norm(1)
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [float("inf"), 1.0, 1.0, 1.0]]).to(torch.bfloat16)
    normed = kernel(x, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    assert normed[0].isnan().all() and normed[1].isnan().any()  # as F.rms_norm: inf / inf
    assert torch.equal(
        normed.isnan(),
        torch.nn.functional.rms_norm(x, (4,), torch.ones(4, dtype=torch.bfloat16), 1e-5).isnan(),
    )


@pytest.mark.parametrize("num_threads", [1, 2])
def test_kernels_flush_denormals_and_leave_the_callers_float_mode_alone(num_threads):
    """Denormal operands cost ~100 cycles each: the kernels read and write them as zero (a bad adapter's
    activations made paged_decode 7x slower), and the calling thread's own arithmetic keeps them."""
    kernel = cpu_kernel.rms_norm(num_threads)
    rows = 4096 if num_threads > 1 else 1  # past PARALLEL_ELEMENTS: the pool's worker runs a part too
    x = torch.full((rows, 512), 1e-40)
    assert torch.equal(kernel(x, torch.ones(512), 1e-5), torch.zeros(rows, 512))
    want = torch.nn.functional.rms_norm(x[:1], (512,), torch.ones(512), 1e-5)
    assert want[0, 0].item() > 0  # torch on this thread, after the kernel: 1e-40 / sqrt(eps), not flushed
    assert (torch.tensor([1e-38]) / 1000).item() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "rotated", "head_dim"), [(1, 3, 2, 8), (37, 15, 12, 64), (2048, 15, 12, 64)]
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_rope_is_bit_for_bit_apply_rope(dtype, tokens, heads, rotated, head_dim, num_threads):
    from engine.executor.models.llama import apply_rope

    torch.manual_seed(tokens)
    x = torch.randn(tokens, heads, head_dim).mul(4).to(dtype)
    freqs = torch.arange(tokens)[:, None] * torch.rand(head_dim // 2)
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    rotated_x = x.clone()
    cpu_kernel.rope(num_threads)(rotated_x, rotated, cos, sin)
    assert torch.equal(rotated_x[:, :rotated], apply_rope(x[:, :rotated], cos, sin))
    assert torch.equal(rotated_x[:, rotated:], x[:, rotated:])  # v's heads untouched


def test_rope_refuses_what_it_cannot_read():
    kernel = cpu_kernel.rope(1)
    x, cos = torch.randn(4, 3, 8), torch.randn(4, 1, 4)
    assert not kernel.runs(x.transpose(0, 1), cos) and not kernel.runs(x, cos.double())
    assert not kernel.runs(x, torch.randn(3, 1, 4))
    with pytest.raises(ValueError, match="contiguous"):
        kernel(x, 4, cos, cos)


def _silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "n"), [(1, 8), (1, 1536), (37, 1000), (2048, 576)]
)  # the last split over threads
@pytest.mark.parametrize("num_threads", [1, 2])
def test_silu_mul_matches_torch(dtype, rows, n, num_threads):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * n).mul(6).to(dtype)
    got, want = cpu_kernel.silu_mul(num_threads)(x), _silu_mul(x)
    if dtype == torch.bfloat16:  # every rounding where aten rounds: equal (6M of 6M elements here), but two
        # exp polynomials a few float32 ulp apart can round to neighbouring bfloat16 values, rarely
        assert (got != want).float().mean() <= 1e-4
        assert ((got.float() - want.float()).abs() <= 2.0**-8 * want.float().abs()).all()
    else:  # another exp polynomial than aten's: a few ulp
        assert ((got.double() - want.double()).abs() <= 8 * 2.0**-23 * want.double().abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_at_the_edges_of_exp(dtype):
    gate = torch.tensor([0.0, -0.0, 1e-30, 80.0, 100.0, -80.0, -100.0, float("inf"), float("nan"), 3.0])
    up = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0, float("nan")])
    got = cpu_kernel.silu_mul(1)(torch.cat([gate, up])[None].to(dtype))[0].double()
    want = _silu_mul(torch.cat([gate, up])[None].to(dtype))[0].double()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[:5], want[:5]) and got[7] == want[7]
    # g = -100: e^100 overflows float32 in aten (-0 out); clamped here below overflow (about -4e-37 out)
    assert (got[5:7].abs() < 1e-30).all() and got[5] == pytest.approx(want[5].item(), rel=1e-2)


def test_silu_mul_refuses_what_it_cannot_read():
    kernel = cpu_kernel.silu_mul(1)
    assert not kernel.runs(torch.randn(4, 7)) and not kernel.runs(torch.randn(8, 4).t())
    assert not kernel.runs(torch.randn(4, 8).double())
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.randn(4, 7))


def _quantize_rows(x):
    """w8a8's torch expression (engine/executor/layers/quantization.py, without the C kernels)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(127)
    return (xf / scale).round_().to(torch.int8), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k"), [(1, 7), (3, 1536), (600, 2048)])  # the last split over threads
@pytest.mark.parametrize("num_threads", [1, 2])
def test_quantize_rows_is_bit_for_bit_the_torch_expression(dtype, rows, k, num_threads):
    torch.manual_seed(rows)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 50).to(dtype)
    x[0, : min(k, 4)] = torch.tensor([127.0, -63.5, 0.5, 2.5])[: min(k, 4)]  # ties round to even
    q, scale = cpu_kernel.int8_rows(num_threads).quantize(x)
    want_q, want_scale = _quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (rows, 1)
    assert torch.equal(scale, want_scale) and torch.equal(q, want_q)


def test_quantize_rows_keeps_zero_rows_and_leaves_nan_out():
    x = torch.tensor([[0.0, 0.0, -0.0], [1.0, float("nan"), -2.0], [float("inf"), 1.0, -1.0]])
    q, scale = cpu_kernel.int8_rows(1).quantize(x)
    assert q[0].tolist() == [0, 0, 0] and scale[0, 0] > 0  # no division by zero
    assert q[1].tolist() == [64, 0, -127] and scale[1, 0] == pytest.approx(2 / 127)
    assert q[2].tolist() == [0, 0, 0] and scale[2, 0] == float("inf")  # inf / inf: NaN, then 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_scale_rows_is_y_times_each_rows_scale(dtype, num_threads):
    y, scale = torch.randn(300, 4000), torch.rand(300, 1)
    want = (y * scale).to(dtype)
    got = cpu_kernel.int8_rows(num_threads).scale(y.clone(), scale, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_kernel.int8_rows(1).scale(y.t(), scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "rank", "n"), [(1, 8, 24), (37, 16, 1100), (300, 64, 40)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_lora_rows_adds_each_rows_own_adapters_delta(dtype, num_rows, rank, n, num_threads):
    """out[row] += (x[row] @ a[slot]) @ b[slot] for the adapter rows only, rounded where torch's products
    round (bfloat16: the rank-sized product, the delta, the sum)."""
    torch.manual_seed(num_rows)
    k, slots_total = 48, 5
    x = torch.randn(num_rows + 3, k).to(dtype)
    out = torch.randn(num_rows + 3, n).to(dtype)
    a = (torch.randn(slots_total, k, rank) / 4).to(dtype)
    b = (torch.randn(slots_total, rank, n) / 4).to(dtype)
    rows = torch.randperm(num_rows + 3)[:num_rows]  # three rows are the base's: untouched
    slots = torch.randint(0, slots_total, (num_rows,))
    want = out.clone()
    for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
        t = (x[row : row + 1] @ a[slot]).to(dtype)
        want[row] += ((t @ b[slot]).to(dtype))[0]
    got = out.clone()
    cpu_kernel.lora_rows(num_threads)(got, x, rows, slots, a, b)
    if dtype == torch.float32:  # another summation order: a few ulp
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same rounding points; sums in another order round to a neighbouring bfloat16, rarely
        assert (got != want).float().mean() <= 0.02
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)
    base_rows = [r for r in range(num_rows + 3) if r not in set(rows.tolist())]
    assert torch.equal(got[base_rows], out[base_rows])


def test_lora_rows_refuses_what_it_cannot_read():
    kernel = cpu_kernel.lora_rows(1)
    out, x = torch.zeros(4, 8), torch.zeros(4, 6)
    a, b = torch.zeros(2, 6, 3), torch.zeros(2, 3, 8)
    assert kernel.runs(out, x, a, b)
    assert not kernel.runs(out, x.t().contiguous().t(), a, b)  # not contiguous
    assert not kernel.runs(out, x.double(), a, b) and not kernel.runs(out, x, torch.zeros(2, 6, 300), b)
    with pytest.raises(ValueError, match="raw memory"):
        kernel(out, x, torch.tensor([0], dtype=torch.int32), torch.tensor([0]), a, b)


def _race_draws(p: torch.Tensor, seeds: list[int], num_threads: int = 1) -> list[int]:
    scores = p.repeat(len(seeds), 1) if p.dim() == 1 else p.clone()
    return cpu_kernel.race(num_threads)(scores, torch.tensor(seeds)).argmax(dim=-1).tolist()


def test_race_draws_follow_p():
    p = torch.softmax(torch.tensor([0.5, 2.0, 1.0, -1.0, 0.0, 1.5, -0.5, 0.2]), dim=-1)
    draws = 8000
    counts = torch.bincount(torch.tensor(_race_draws(p, list(range(draws)))), minlength=8).double()
    tolerance = 4 * torch.sqrt(p.double() * (1 - p.double()) / draws)  # 4 standard errors a token
    assert torch.all((counts / draws - p.double()).abs() <= tolerance), counts / draws
    assert _race_draws(torch.tensor([0.0, 0.0, 1.0, 0.0]), list(range(50))) == [2] * 50  # zeros never win


def test_race_draws_depend_on_their_seed_and_token_ids_only():
    """The same seed draws the same token whatever the rows around it and the thread split; a p moved in its
    last bits (another batch shape's rounding) keeps its token."""
    generator = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(300, 4096, generator=generator) * 2, dim=-1)
    seeds = [(2**61 + 7919 * i) for i in range(300)]
    alone = [_race_draws(p[i], [seeds[i]])[0] for i in range(0, 300, 37)]
    batched = _race_draws(p, seeds, num_threads=2)
    assert alone == batched[::37]
    order = torch.randperm(300, generator=generator)
    assert [batched[i] for i in order.tolist()] == _race_draws(
        p[order], [seeds[i] for i in order.tolist()], 2
    )
    nudged = p * (1 + 1e-6 * torch.randn(p.shape, generator=generator))
    assert sum(a != b for a, b in zip(_race_draws(nudged, seeds), batched, strict=True)) <= 1
    assert len(set(batched)) > 100  # it does sample
