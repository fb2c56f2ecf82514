"""Offline throughput: pagedserve vs HF static batching vs transformers' continuous batching.

    python benchmarks/offline.py                                   # the full run (tens of minutes on 2 cores)
    python benchmarks/offline.py --num-requests 8 --max-output 32 --systems pagedserve,static --tag quick

One process runs every system side by side on the same workload (timings on a shared 2-core VM are
noisy, so the systems see the same noise): random prompts of 32-512 token ids (special ids 0-3
excluded), 16-256 output tokens each with EOS ignored, greedy, fp32, on a random-weight
SmolLM-135M-shaped Llama (built by benchmarks/make_model.py if missing).

  pagedserve  engine.LLMEngine with per-request SamplingParams(max_tokens=out_len, ignore_eos=True),
              stepped until done (what LLM.generate does, but LLM.generate takes one SamplingParams)
  static      HF model.generate on FIFO batches of max_num_seqs requests, left-padded, each batch run to
              its longest output (min_new_tokens = max_new_tokens: no EOS stop); only each request's own
              output length counts as useful
  cb          transformers' ContinuousBatchingManager (the engine behind model.generate_batch), requests
              added one by one so each gets its own max_new_tokens; eos_token_id=-1

Writes benchmarks/results/offline{-TAG}.json and .png (or under --out-dir) and prints one summary line.
"""

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# libgomp's default spin-waiting makes every parallel op on 2 threads 10-30x slower when other processes
# share the 2 cores (measured: a 32x576x1536 linear 1.5 ms passive vs 44 ms spinning under load 7).
# Set before torch loads libgomp; export OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "benchmarks" / "models" / "smollm-135m"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SYSTEMS = ("pagedserve", "static", "cb")
NUM_SPECIAL_IDS = 4  # ids 0-3 are <|endoftext|>, <|im_start|>, <|im_end|>, <pad>
TARGETS = {"vs_static": 2.0, "vs_cb": 3.0, "kv_waste_pct": 4.0}
CB_POLL_S = 0.2  # how often the CB run samples its cache usage


@dataclass
class Request:
    prompt: list[int]
    out_len: int


def make_workload(num: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt_len, out_len = rng.randint(*prompt_range), rng.randint(*output_range)
        requests.append(Request([rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(prompt_len)], out_len))
    return requests


# --- pagedserve ------------------------------------------------------------------------------------
def _drive(engine, requests: list[Request], prefix: str) -> dict[str, list[int]]:
    from engine import SamplingParams
    for i, r in enumerate(requests):
        engine.add_request(f"{prefix}{i}", r.prompt, SamplingParams(temperature=0, max_tokens=r.out_len,
                                                                     ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return tokens


def run_pagedserve(args, requests: list[Request]) -> dict:
    from engine import LLM
    llm = LLM(model=str(args.model), dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              num_threads=args.threads, seed=args.seed,
              kv_cache_memory=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None)
    engine = llm.engine
    _drive(engine, [Request(list(range(NUM_SPECIAL_IDS, NUM_SPECIAL_IDS + 8)), 4)], "warmup")  # untimed
    steps0 = engine.num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = _drive(engine, requests, "r")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    outputs = [tokens[f"r{i}"] for i in range(len(requests))]
    layout = engine.model_runner.layout
    result = dict(
        wall_s=wall, cpu_s=cpu, outputs=outputs, num_steps=engine.num_steps - steps0,
        kv_waste_at_peak_pct=100 * engine.kv_waste_at_peak,
        peak_kv_bytes=engine.peak_used_blocks * layout.bytes_per_block,
        kv_pool_bytes=layout.total_bytes,
        details=dict(peak_used_blocks=engine.peak_used_blocks, num_blocks=layout.num_blocks,
                     block_size=layout.block_size, bytes_per_block=layout.bytes_per_block,
                     num_preemptions=engine.scheduler.num_preemptions,
                     api="LLMEngine.add_request per request + step() loop (as LLM._run)"))
    del llm, engine
    return result


# --- HF static batching ----------------------------------------------------------------------------
def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                local_files_only=True).eval()


def _kv_bytes(cache) -> tuple[int, int]:
    """(bytes of K+V over all layers, cached sequence length) of a DynamicCache."""
    total, seq_len = 0, 0
    for layer in cache.layers:
        total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        seq_len = layer.keys.shape[-2]
    return total, seq_len


@torch.inference_mode()
def _static_batch(model, batch: list[Request], pad_id: int) -> tuple[list[list[int]], int, int]:
    max_prompt, max_out = max(len(r.prompt) for r in batch), max(r.out_len for r in batch)
    ids = torch.tensor([[pad_id] * (max_prompt - len(r.prompt)) + r.prompt for r in batch])
    mask = torch.tensor([[0] * (max_prompt - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                         do_sample=False, pad_token_id=pad_id, return_dict_in_generate=True)
    generated = out.sequences[:, max_prompt:]
    assert generated.shape[1] == max_out, f"static batch stopped at {generated.shape[1]} of {max_out} tokens"
    kv_bytes, cache_len = _kv_bytes(out.cache)
    return [generated[i, :r.out_len].tolist() for i, r in enumerate(batch)], kv_bytes, cache_len


def run_static(args, requests: list[Request]) -> dict:
    model = load_hf(args.model)
    pad_id = model.generation_config.pad_token_id
    _static_batch(model, [Request(list(range(NUM_SPECIAL_IDS, NUM_SPECIAL_IDS + 8)), 4)], pad_id)  # untimed
    batches = [requests[i:i + args.max_num_seqs] for i in range(0, len(requests), args.max_num_seqs)]
    outputs, per_batch = [], []
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches:
        tokens, kv_bytes, cache_len = _static_batch(model, batch, pad_id)
        outputs += tokens
        # slots holding a request's own tokens: its prompt and all but its last output token (never fed back)
        filled = sum(len(r.prompt) + r.out_len - 1 for r in batch)
        per_batch.append(dict(size=len(batch), kv_bytes=kv_bytes, cache_len=cache_len,
                              waste_pct=100 * (1 - filled / (len(batch) * cache_len)),
                              generated_per_request=max(r.out_len for r in batch)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = max(per_batch, key=lambda b: b["kv_bytes"])
    del model
    return dict(wall_s=wall, cpu_s=cpu, outputs=outputs, num_steps=sum(b["generated_per_request"] for b in per_batch),
                kv_waste_at_peak_pct=peak["waste_pct"], peak_kv_bytes=peak["kv_bytes"], kv_pool_bytes=None,
                details=dict(batches=per_batch, api="model.generate, left-padded FIFO batches, "
                                                     "min_new_tokens=max_new_tokens=max out_len in batch",
                             waste_definition="largest batch's final DynamicCache [B, kv_heads, cache_len, head_dim]"
                                              "; filled = sum(prompt_len + out_len - 1); the rest is left padding "
                                              "and tokens past a request's own output length"))


# --- transformers continuous batching --------------------------------------------------------------
@torch.inference_mode()
def run_cb(args, requests: list[Request]) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    model = load_hf(args.model)
    max_len = max(len(r.prompt) for r in requests) + max(r.out_len for r in requests)
    num_blocks = args.max_num_seqs * -(-max_len // args.cb_page_size) + 2  # room for a full batch of the longest
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.out_len for r in requests), eos_token_id=-1,
                                  pad_token_id=model.generation_config.pad_token_id)
    cb_config = ContinuousBatchingConfig(page_size=args.cb_page_size, num_blocks=num_blocks,
                                         max_batch_tokens=args.max_num_batched_tokens,
                                         max_requests_per_batch=args.max_num_seqs, allow_block_sharing=False,
                                         seed=args.seed)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in requests),
                          max_generated_length=max(r.out_len for r in requests), num_requests=len(requests))
    results, peak_used = {}, 0
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=60, workload_hints=hints) as manager:
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

        manager.add_request(list(range(NUM_SPECIAL_IDS, NUM_SPECIAL_IDS + 8)), request_id="warmup",
                            max_new_tokens=4, eos_token_id=-1)
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
    return dict(wall_s=wall, cpu_s=cpu, outputs=[results[f"r{i}"].generated_tokens for i in range(len(requests))],
                num_steps=None, kv_waste_at_peak_pct=None, peak_kv_bytes=peak_used, kv_pool_bytes=pool_bytes,
                details=dict(page_size=args.cb_page_size, num_blocks=num_blocks, attn_implementation="sdpa",
                             api="model.continuous_batching_context_manager + manager.add_request(max_new_tokens="
                                 "out_len) per request (generate_batch takes one max_new_tokens for all)",
                             peak_kv_note=f"used pages sampled every <= {CB_POLL_S} s from the generation thread's "
                                          "PagedAttentionCache (total - compute_free_capacity); a lower bound",
                             kv_waste_note="not measured: the cache exposes no per-request filled-slot count"))


RUNNERS = {"pagedserve": run_pagedserve, "static": run_static, "cb": run_cb}


# --- report ----------------------------------------------------------------------------------------
def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy sanity check: identical requests, and the mean matching-prefix fraction."""
    prefixes = []
    for a, b in zip(reference, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n / max(len(a), 1))
    return dict(identical_requests=sum(a == b for a, b in zip(reference, other, strict=True)),
                mean_matching_prefix=sum(prefixes) / len(prefixes))


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None)
    import transformers
    return dict(cpu=cpu, cpu_count=os.cpu_count(), mem_bytes=mem, platform=platform.platform(),
                python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
                torch_threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))


def plot(systems: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(systems)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    bars = ax1.bar(names, [systems[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylabel("useful output tokens / s")
    ax1.set_title("Throughput")
    waste = [systems[n]["kv_waste_at_peak_pct"] for n in names]
    bars = ax2.bar(names, [w or 0 for w in waste], color="tab:orange")
    ax2.bar_label(bars, labels=["n/a" if w is None else f"{w:.1f}%" for w in waste])
    ax2.axhline(TARGETS["kv_waste_pct"], color="gray", linestyle="--", linewidth=1, label="4% target")
    ax2.set_ylabel("KV slots wasted at peak (%)")
    ax2.set_title("KV cache waste at peak")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.margins(y=0.12)
    fig.suptitle("Offline batch, SmolLM-135M shape, fp32, 2 CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch size of every system")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="pagedserve and cb token budget")
    p.add_argument("--block-size", type=int, default=16, help="pagedserve KV block size")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="pagedserve KV pool (default: engine's)")
    p.add_argument("--cb-page-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix for the result files (offline-TAG.json)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if not (args.model / "config.json").exists():
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
        from make_model import make_random_model
        make_random_model("smollm-135m", args.model, seed=args.seed)
    model_config = json.loads((args.model / "config.json").read_text())
    requests = make_workload(args.num_requests, model_config["vocab_size"], (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), args.seed)
    useful = sum(r.out_len for r in requests)

    figures, outputs = {}, {}
    for name in systems:
        load_before = os.getloadavg()[0]
        result = RUNNERS[name](args, requests)
        outputs[name] = result.pop("outputs")
        lengths = [len(o) for o in outputs[name]]
        assert lengths == [r.out_len for r in requests], f"{name}: output lengths differ from the workload"
        figures[name] = dict(output_tokens_per_s=useful / result["wall_s"],
                             output_tokens_per_cpu_s=useful / result["cpu_s"], useful_output_tokens=useful,
                             loadavg_1m_before=load_before, loadavg_1m_after=os.getloadavg()[0], **result)
        print(f"  {name}: {result['wall_s']:.1f} s, {figures[name]['output_tokens_per_s']:.1f} tok/s", flush=True)

    ratios, targets = {}, {}
    if "pagedserve" in figures:
        ps = figures["pagedserve"]["output_tokens_per_s"]
        for name, key in (("static", "vs_static"), ("cb", "vs_cb")):
            if name in figures:
                ratios[f"pagedserve_{key}"] = ps / figures[name]["output_tokens_per_s"]
                ratios[f"pagedserve_{key}_per_cpu_s"] = (figures["pagedserve"]["output_tokens_per_cpu_s"]
                                                         / figures[name]["output_tokens_per_cpu_s"])
                targets[f"pagedserve_{key}_>={TARGETS[key]}x"] = ratios[f"pagedserve_{key}"] >= TARGETS[key]
        targets[f"kv_waste_<{TARGETS['kv_waste_pct']}%"] = (figures["pagedserve"]["kv_waste_at_peak_pct"]
                                                           < TARGETS["kv_waste_pct"])
        for name in figures.keys() - {"pagedserve"}:
            figures[name]["greedy_agreement_with_pagedserve"] = agreement(outputs["pagedserve"], outputs[name])

    prompt_lens = [len(r.prompt) for r in requests]
    report = dict(
        workload=dict(num_requests=len(requests), prompt_len_range=[args.min_prompt, args.max_prompt],
                      output_len_range=[args.min_output, args.max_output], prompt_tokens=sum(prompt_lens),
                      useful_output_tokens=useful, seed=args.seed, ignore_eos=True, greedy=True, dtype="float32",
                      model=str(args.model.relative_to(REPO_ROOT) if args.model.is_relative_to(REPO_ROOT)
                                else args.model),
                      model_config={k: model_config.get(k) for k in (
                          "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size")},
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      prompt_ids="uniform over the vocabulary, special ids 0-3 excluded"),
        systems=figures, ratios=ratios, targets_met=targets, machine=machine_info(),
        notes="All systems run in one process, one after another, each after an untimed warm-up request. "
              "tokens/s = useful output tokens (each request's own out_len) / wall s. cpu_s is this process's CPU "
              "time (all threads) over the same span: on a shared 2-core VM, wall time follows the other "
              "processes' load (see loadavg_1m_*), CPU time much less, so the per-CPU-second ratios are the "
              "steadier comparison.")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "offline" + (f"-{args.tag}" if args.tag else "")
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(figures, args.out_dir / f"{stem}.png")
    summary = ", ".join(f"{n} {f['output_tokens_per_s']:.1f} tok/s ({f['wall_s']:.0f} s)" for n, f in figures.items())
    extra = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    waste = (f", pagedserve KV waste {figures['pagedserve']['kv_waste_at_peak_pct']:.2f}%"
             if "pagedserve" in figures else "")
    print(f"offline {len(requests)} requests: {summary}; {extra}{waste} -> {args.out_dir / stem}.json")


if __name__ == "__main__":
    main()
