"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding on the same engine
settings, offline, taking turns: greedy continuations of held-out code (the shipped models' validation
files: every 20th file of this machine's Python standard library, models/train.py), at batch 1 (one request
at a time) and at batch 32 (32 requests at once, where drafts are off by default: above 16 running for
n-gram drafts, above 4 for a draft model's).

    python benchmarks/speculative.py                       # the shipped primary, 4 draft tokens
    python benchmarks/speculative.py --num-speculative-tokens 6 --tag k6
    python benchmarks/speculative.py --draft models/pagedserve-coder-tiny --num-speculative-tokens 3 \
        --tag draft-model

Each prompt is the --prompt-tokens tokens that end with a `def` line of a held-out file; each request
generates up to --max-tokens tokens, greedily (or seeded, at --temperature). Both engines load the same
linear kernel (--linear-kernel, or the plain one's load-time choice, which sets the plain engine's speed at
batch 1: the shipped primary's float32 steps ran 266-288 tok/s on aten's products, 213-224 on oneDNN's).
Rounds alternate which side runs first (this VM's speed drifts within minutes); the ratio is the median
over rounds of speculative / plain tokens per second in the same round. The texts must be identical: the
run fails otherwise. Writes benchmarks/results/speculative[-TAG].json and .png. Target (#39): >= 1.8x at
batch 1 with a draft model; at batch 32 no slower.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.config import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # as the server sets it

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "pagedserve-coder-small")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--linear-kernel", default="auto", help="both engines' (auto: the plain one's load-time choice)"
    )
    p.add_argument("--draft", type=Path, help="a draft model's directory (method draft_model; else ngram)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--disable-by-batch-size", type=int, help="the engine's default: 16")
    p.add_argument("--prompts", type=int, default=8, help="requests at batch 1, one after the other")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="above 0: seeded draws (seed 0)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="")
    return p.parse_args()


def held_out_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """From each held-out file, for its first `def` line past 2,000 characters, and past 6,000: the
    prompt_tokens tokens that end with that line (the files in order, then the second places)."""
    sys.path.insert(0, str(ROOT / "models"))  # train.py imports its neighbours as a script does
    from train import load_corpus

    _, held_out = load_corpus()
    prompts = []
    for offset in (2000, 6000):
        for text in held_out:
            at = text.find("def ", offset)
            if at < 0:
                continue
            end = text.find("\n", at) + 1
            ids = tokenizer.encode(text[max(0, end - 8 * prompt_tokens) : end])[-prompt_tokens:]
            if len(ids) == prompt_tokens:
                prompts.append(ids)
            if len(prompts) == count:
                return prompts
    raise SystemExit(f"only {len(prompts)} held-out prompts of {prompt_tokens} tokens")


def timed(llm, prompts: list[list[int]], params, one_at_a_time: bool) -> tuple[float, list[list[int]]]:
    """Seconds to serve the prompts (one request at a time, or all at once) and the tokens of each."""
    started = time.perf_counter()
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = [
        out
        for batch in batches
        for out in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    ]
    return time.perf_counter() - started, [out.outputs[0].token_ids for out in outs]


def main() -> None:
    args = parse_args()
    from benchmarks.offline import machine_info
    from engine import LLM, SamplingParams

    load_before = os.getloadavg()
    options = dict(dtype=args.dtype, max_model_len=args.prompt_tokens + args.max_tokens + 8, max_num_seqs=64)
    plain = LLM(str(args.model), linear_kernel=args.linear_kernel, **options)
    kernel = plain.engine.model_runner.linear_kernel
    method = "ngram" if args.draft is None else "draft_model"
    spec = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft is None:
        spec.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    else:
        spec["model"] = str(args.draft)
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    speculative = LLM(str(args.model), linear_kernel=kernel, speculative_config=spec, **options)
    llms = {"plain": plain, method: speculative}
    prompts = held_out_prompts(plain.engine.tokenizer, max(args.prompts, args.batch), args.prompt_tokens)
    params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up: every shape once
        timed(llm, prompts[:2], params, one_at_a_time=False)
    shapes = {
        "batch_1": (prompts[: args.prompts], True),
        f"batch_{args.batch}": (prompts[: args.batch], False),
    }
    tok_s: dict[str, dict[str, list[float]]] = {shape: {name: [] for name in llms} for shape in shapes}
    texts: dict[str, dict[str, list[list[int]]]] = {shape: {} for shape in shapes}
    counts = {name: llm.engine.stats() for name, llm in llms.items()}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for shape, (shape_prompts, one_at_a_time) in shapes.items():
            for name in order:
                seconds, tokens = timed(llms[name], shape_prompts, params, one_at_a_time)
                tok_s[shape][name].append(sum(map(len, tokens)) / seconds)
                if texts[shape].setdefault(name, tokens) != tokens:
                    raise SystemExit(f"{name} gave other tokens in round {r} at {shape}")
            print(shape, {name: round(v[-1], 1) for name, v in tok_s[shape].items()}, flush=True)
    identical = {shape: texts[shape]["plain"] == texts[shape][method] for shape in shapes}
    after = speculative.engine.stats()
    drafts = after.spec_num_drafts - counts[method].spec_num_drafts
    draft_tokens = after.spec_num_draft_tokens - counts[method].spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - counts[method].spec_num_accepted_tokens
    result = {
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "dtype": args.dtype,
        "linear_kernel": kernel,
        "speculative_config": spec,
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "rounds": args.rounds,
        "tok_s": {shape: {n: [round(v, 2) for v in s] for n, s in by.items()} for shape, by in tok_s.items()},
        "ratio_median": {
            shape: round(statistics.median(s / p for s, p in zip(by[method], by["plain"], strict=True)), 3)
            for shape, by in tok_s.items()
        },
        "identical_tokens": identical,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "mean_tokens_per_drafted_step": round(1 + accepted / drafts, 3) if drafts else None,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": machine_info(),
    }
    out = ROOT / "benchmarks" / "results" / f"speculative{'-' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("ratio_median", "identical_tokens", "acceptance_rate")}))
    if not all(identical.values()):
        raise SystemExit("speculative decoding changed the tokens")


def plot(result: dict, path: Path) -> None:
    from benchmarks import plots

    fig, axes = plots.new(1, len(result["tok_s"]), figsize=(8, 3.5))
    for ax, (shape, by) in zip(axes, result["tok_s"].items(), strict=True):
        for i, values in enumerate(by.values()):
            ax.bar(i, statistics.median(values), color=("tab:gray", "tab:blue")[i])
            ax.plot([i] * len(values), values, "k.", markersize=4)
        ax.set_xticks(range(len(by)), list(by))
        ax.set_title(f"{shape.replace('_', ' ')}: x{result['ratio_median'][shape]}")
        ax.set_ylabel("tokens / s")
    spec = result["speculative_config"]
    drafts = "n-gram" if spec["method"] == "ngram" else f"{Path(spec['model']).name}'s"
    fig.suptitle(f"speculative decoding with {drafts} drafts, {Path(result['model']).name} {result['dtype']}")
    plots.save(fig, path)


if __name__ == "__main__":
    main()
