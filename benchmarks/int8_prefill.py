"""int8 prefill against bf16's, and what int8 activations cost in accuracy (issue 39, item 4).

    python benchmarks/int8_prefill.py          # makes benchmarks/models/qwen2-1.5b (bf16) if missing

Speed: one process loads the Qwen2-1.5B-shaped random model three ways, bf16 (no quantization), int8
(weight-only, bf16 activations: a prompt's products run on dequantized slices) and w8a8 (int8 weights,
each row of a prompt's activations rounded to int8: int8 x int8 products), and times the prefill of one
--prompt-tokens prompt (max_tokens 1, prefix cache off), --repeats rounds, the three taking turns; the
figure is each one's median.
Accuracy: on the shipped primary (trained), float32 against int8 and w8a8 (float32 activations), the
log-probability of every token of held-out text given the ones before it (this repository's Python
source, which the model was not trained on): perplexity, and the mean |difference| per token from
float32's. Writes benchmarks/results/int8_prefill.json and .png. Target (#39): int8 prefill no slower than
bf16's.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.config import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # as the server sets it

ROOT = Path(__file__).resolve().parents[1]
BIG = ROOT / "benchmarks" / "models" / "qwen2-1.5b"
HELD_OUT = ("engine/core/scheduler.py", "engine/executor/lora.py", "resilience/leak_detector.py")
METHODS = (None, "int8", "w8a8")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BIG)
    p.add_argument("--accuracy-model", type=Path, default=ROOT / "models" / "pagedserve-coder-small")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--text-tokens", type=int, default=1024, help="held-out tokens scored per file")
    return p.parse_args()


def prefill_seconds(llm, prompt: list[int]) -> float:
    from engine import SamplingParams

    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - started


def speed(args: argparse.Namespace) -> dict:
    from engine import LLM

    if not (args.model / "config.json").is_file():
        make = [sys.executable, str(ROOT / "benchmarks" / "make_model.py"), "--preset", args.model.name]
        subprocess.run([*make, "--dtype", "bfloat16"], check=True)
    llms = {
        str(method): LLM(
            str(args.model),
            dtype="bfloat16",
            quantization=method,
            max_model_len=4 * args.prompt_tokens,
            max_num_seqs=4,
            enable_prefix_caching=False,
            kv_cache_memory=256 * 2**20,
        )
        for method in METHODS
    }
    vocab = next(iter(llms.values())).engine.vocab_size
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(args.repeats + 1):  # round 0 warms up
        for name, llm in llms.items():
            prompt = [(r * 7919 + i * 104729) % (vocab - 4) + 4 for i in range(args.prompt_tokens)]
            took = prefill_seconds(llm, prompt)
            if r:
                seconds[name].append(took)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "prompt_tokens": args.prompt_tokens,
        "seconds": {name: [round(s, 4) for s in v] for name, v in seconds.items()},
        "median_s": {name: round(s, 4) for name, s in medians.items()},
        "vs_bf16": {name: round(s / medians["None"], 3) for name, s in medians.items()},
    }


def accuracy(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams

    scores: dict[str, list[float]] = {}
    for method in METHODS:
        llm = LLM(str(args.accuracy_model), dtype="float32", quantization=method, enable_prefix_caching=False)
        prompts = []
        for name in HELD_OUT:
            ids = llm.engine.tokenizer.encode((ROOT / name).read_text())[: args.text_tokens]
            prompts.append({"prompt_token_ids": ids})
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scores[str(method)] = [
            entry[token]
            for out in outs
            for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)
        ]
        del llm
    reference = scores["None"]
    return {
        "model": str(args.accuracy_model.relative_to(ROOT)),
        "text": list(HELD_OUT),
        "tokens_scored": len(reference),
        "perplexity": {name: round(math.exp(-statistics.fmean(s)), 4) for name, s in scores.items()},
        "mean_abs_logprob_diff_vs_fp32": {
            name: round(statistics.fmean(abs(a - b) for a, b in zip(s, reference, strict=True)), 5)
            for name, s in scores.items()
        },
    }


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()
    result = {"speed": speed(args), "accuracy": accuracy(args)}
    result["load_average"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
    }
    ratio = result["speed"]["vs_bf16"]
    result["targets_met"] = {"int8_prefill_no_slower_than_bf16": min(ratio["int8"], ratio["w8a8"]) <= 1.0}
    out = ROOT / "benchmarks" / "results" / "int8_prefill.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    ppl = result["accuracy"]["perplexity"]
    bf16_ms = result["speed"]["median_s"]["None"] * 1000
    print(
        f"prefill of {args.prompt_tokens} tokens, median: bf16 {bf16_ms:.0f} ms, "
        f"int8 {ratio['int8']:.2f}x, w8a8 {ratio['w8a8']:.2f}x of bf16's; perplexity fp32 {ppl['None']:.3f}, "
        f"int8 {ppl['int8']:.3f}, w8a8 {ppl['w8a8']:.3f}; {out}",
        flush=True,
    )
    return 0 if all(result["targets_met"].values()) else 1


def plot(result: dict, path: Path) -> None:
    from benchmarks import plots

    names = {"None": "bf16", "int8": "int8 (weight-only)", "w8a8": "w8a8"}
    medians = result["speed"]["median_s"]
    fig, ax = plots.new(figsize=(7, 4))
    ax.bar(
        [names[n] for n in medians],
        [s * 1000 for s in medians.values()],
        color=["gray", "tab:blue", "tab:green"],
    )
    ax.set_ylabel(f"prefill of {result['speed']['prompt_tokens']} tokens, ms (median)")
    ppl = result["accuracy"]["perplexity"]
    ax.set_title(
        f"{result['speed']['model']}; perplexity (coder-small, fp32 activations): fp32 {ppl['None']:.3f}, "
        f"int8 {ppl['int8']:.3f}, w8a8 {ppl['w8a8']:.3f}",
        fontsize=8,
    )
    plots.save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
