"""LoRA adapters' cost: 32 streams over 8 adapters in one batch against the same 32 streams on the base
model, offline on one engine, taking turns; and the time to load and unload one adapter.

    python benchmarks/lora.py                          # the shipped primary, rank 16, all seven targets
    python benchmarks/lora.py --rank 64 --repeats 5 --tag r64

The adapters are random-weight PEFT directories (q/k/v/o/gate/up/down, --rank) written for the model
(tests/harness.py's write_adapter). Each round runs both sides on the same request shapes with their own
token ids (no prefix-cache hits across runs), the side first alternating between rounds: this VM's speed
drifts within minutes. The ratio is the median over rounds of adapters / base in the same round.
Load and unload: --repeats times each, a rank-16 (--rank) adapter from a warm page cache.
Writes benchmarks/results/lora[-TAG].json and .png. Targets (#38): >= 70% of the base's tok/s; load and
unload under 1 s.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.config import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # as the server sets it

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "pagedserve-coder-small")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tag", default="")
    return p.parse_args()


def run(llm, names: list[str | None], args: argparse.Namespace, salt: int) -> dict:
    from engine import SamplingParams

    rng = random.Random(salt)
    vocab = llm.engine.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)]} for _ in names
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    started = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False, lora=names)
    seconds = time.monotonic() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def main() -> int:
    args = parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from tests.harness import write_adapter

    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    load_avg_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="loras-") as tmp:
        dirs = []
        for i in range(args.adapters + 1):  # one more for the load / unload timing
            path = Path(tmp) / f"adapter-{i}"
            write_adapter(base, path, args.rank, 2 * args.rank, TARGETS, seed=i)
            dirs.append(path)
        del base
        llm = LLM(
            str(args.model),
            dtype=args.dtype,
            max_num_seqs=args.streams,
            max_loras=args.adapters + 1,
            kv_cache_memory=256 * 2**20,
        )
        names = [f"adapter-{i}" for i in range(args.adapters)]
        for name, path in zip(names, dirs, strict=False):
            llm.add_lora(name, str(path))
        mixed = [names[i % len(names)] for i in range(args.streams)]
        run(llm, [None] * args.streams, args, salt=-1)  # warm-up: both paths once
        run(llm, mixed, args, salt=-2)
        rounds = []
        for r in range(args.repeats):
            sides = [("base", [None] * args.streams), ("adapters", mixed)]
            result = {}
            for side, side_names in sides if r % 2 == 0 else sides[::-1]:
                result[side] = run(llm, side_names, args, salt=2 * r + (side == "adapters"))
            result["ratio"] = round(result["adapters"]["tokens_per_s"] / result["base"]["tokens_per_s"], 3)
            rounds.append(result)
            print(
                f"round {r}: base {result['base']['tokens_per_s']} tok/s, adapters "
                f"{result['adapters']['tokens_per_s']} ({result['ratio']:.2f})",
                flush=True,
            )
        loads, unloads = [], []
        for _ in range(args.repeats):
            started = time.monotonic()
            llm.add_lora("timed", str(dirs[-1]))
            loads.append(time.monotonic() - started)
            started = time.monotonic()
            llm.engine.remove_lora("timed")
            unloads.append(time.monotonic() - started)
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "dtype": args.dtype,
        "adapters": args.adapters,
        "streams": args.streams,
        "rank": args.rank,
        "targets": TARGETS,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "rounds": rounds,
        "median_ratio": ratio,
        "load_s": [round(s, 4) for s in loads],
        "unload_s": [round(s, 4) for s in unloads],
        "load_average": {
            "before": [round(x, 2) for x in load_avg_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "targets_met": {
            "throughput_ratio_0.7": ratio >= 0.7,
            "load_unload_under_1s": max(loads + unloads) < 1.0,
        },
    }
    stem = "lora" + (f"-{args.tag}" if args.tag else "")
    out = ROOT / "benchmarks" / "results" / f"{stem}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(
        f"{args.adapters} adapters x {args.streams} streams: {ratio:.2f} of the base's tok/s (median of "
        f"{args.repeats}); load {max(loads) * 1000:.0f} ms, unload {max(unloads) * 1000:.1f} ms at most; {out}",
        flush=True,
    )
    return 0 if all(result["targets_met"].values()) else 1


def plot(result: dict, path: Path) -> None:
    from benchmarks import plots

    fig, ax = plots.new(figsize=(7, 4))
    rounds = range(len(result["rounds"]))
    for side in ("base", "adapters"):
        ax.plot(rounds, [r[side]["tokens_per_s"] for r in result["rounds"]], marker="o", label=side)
    ax.set_xlabel("round")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{result['streams']} streams, {result['adapters']} rank-{result['rank']} adapters: "
        f"{result['median_ratio']:.2f}x the base",
        fontsize=10,
    )
    ax.legend()
    plots.save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
