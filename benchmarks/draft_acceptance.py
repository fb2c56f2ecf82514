"""Would a draft model pay for speculative decoding here? How often a draft model's greedy token is the
target's, on held-out code, and what drafting k tokens with it would buy at batch 1 on this machine.

    python benchmarks/draft_acceptance.py                  # the shipped pair: tiny drafts for the primary
    python benchmarks/draft_acceptance.py --draft DIR --tag mine

The target continues held-out code greedily (the prompts of benchmarks/speculative.py); the draft reads
the same prompt and continuation in one forward pass (teacher-forced, HF transformers, float32), so its
greedy token at each position is what it would draft there while its earlier drafts were all kept. A
verify step keeps the draft up to its first miss plus the target's token there: tokens per step for k
drafts follow from the run of matches at each position. Costs are measured with our engine (rounds
taking turns, medians): a decode step of the draft at one row, and of the target at 1..k+1 rows (k+1
sequences' rows stand for the verify step's k+1 positions of one). Projected speedup at k drafts:

    target_step(1) x tokens_per_step(k) / (k x draft_step(1) + target_step(k + 1))

and the draft step (ms) that would reach --goal (1.8x, #39) at each k. A projection, not a run: the
draft's prefill is left out, and its step is a whole engine step (scheduling and sampling included): a
draft loop of its own could be leaner, and `draft_ms_for_goal` says how lean it would have to be.
Writes benchmarks/results/draft_acceptance[-TAG].json and .png.
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
    p.add_argument("--target", type=Path, default=ROOT / "models" / "pagedserve-coder-small")
    p.add_argument("--draft", type=Path, default=ROOT / "models" / "pagedserve-coder-tiny")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-draft-tokens", type=int, default=6, help="project k = 1 .. this")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--goal", type=float, default=1.8)
    p.add_argument("--tag", default="")
    return p.parse_args()


def matches(draft_path: Path, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[bool]]:
    """For each continuation token: is the draft's greedy token there the target's?"""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, continuations, strict=True):
            logits = model(torch.tensor([prompt + tokens])).logits[0]
            guesses = logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1].argmax(-1).tolist()
            out.append([g == t for g, t in zip(guesses, tokens, strict=True)])
    return out


def tokens_per_step(hits: list[list[bool]], k: int) -> float:
    """Tokens a verify step yields with up to k drafts: the kept run of matches, plus the target's token."""
    tokens = steps = 0
    for row in hits:
        at = 0
        while at < len(row):
            kept = 0
            while kept < k and at + kept < len(row) and row[at + kept]:
                kept += 1
            at += kept + 1
            steps += 1
        tokens += len(row)
    return tokens / steps


def step_seconds(llm, prompts: list[list[int]], steps: int) -> float:
    """One decode step of len(prompts) rows: generating steps + 1 tokens less generating 1, over steps."""
    from engine import SamplingParams

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started

    return (run(steps + 1) - run(1)) / steps


def main() -> None:
    args = parse_args()
    from benchmarks.offline import machine_info
    from benchmarks.speculative import held_out_prompts
    from engine import LLM, SamplingParams

    load_before = os.getloadavg()
    options = dict(max_model_len=args.prompt_tokens + args.max_tokens + 8)
    target = LLM(str(args.target), **options)
    draft = LLM(str(args.draft), **options)
    prompts = held_out_prompts(target.engine.tokenizer, args.prompts, args.prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    continuations = [
        list(out.outputs[0].token_ids)
        for out in target.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    hits = matches(args.draft, prompts, continuations)
    k_max = args.max_draft_tokens
    rows = range(1, k_max + 2)
    timings: dict[str, list[float]] = {"draft_1": [], **{f"target_{b}": [] for b in rows}}
    for llm in (target, draft):  # warm-up
        step_seconds(llm, prompts[:2], 4)
    for r in range(args.rounds):
        order = ("draft", "target") if r % 2 == 0 else ("target", "draft")
        for name in order:
            if name == "draft":
                timings["draft_1"].append(step_seconds(draft, prompts[:1], 64))
            else:
                for b in rows:
                    timings[f"target_{b}"].append(step_seconds(target, prompts[:b], 64))
    ms = {name: round(statistics.median(values) * 1e3, 3) for name, values in timings.items()}
    projection = {}
    for k in range(1, k_max + 1):
        per_step = tokens_per_step(hits, k)
        verify = ms[f"target_{k + 1}"]
        projection[k] = {
            "tokens_per_step": round(per_step, 3),
            "speedup": round(ms["target_1"] * per_step / (k * ms["draft_1"] + verify), 3),
            # the draft step (ms) at which k drafts would reach the goal; negative: not even free drafts
            "draft_ms_for_goal": round((ms["target_1"] * per_step / args.goal - verify) / k, 3),
        }
    result = {
        "target": str(args.target.relative_to(ROOT) if args.target.is_relative_to(ROOT) else args.target),
        "draft": str(args.draft.relative_to(ROOT) if args.draft.is_relative_to(ROOT) else args.draft),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "match_rate": round(sum(map(sum, hits)) / sum(map(len, hits)), 4),
        "step_ms": ms,
        "step_ms_all": {name: [round(v * 1e3, 3) for v in values] for name, values in timings.items()},
        "goal": args.goal,
        "projection": projection,
        "best": max(projection, key=lambda k: projection[k]["speedup"]),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": machine_info(),
    }
    out = ROOT / "benchmarks" / "results" / f"draft_acceptance{'-' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("match_rate", "step_ms", "projection", "best")}, indent=1))


def plot(result: dict, path: Path) -> None:
    from benchmarks import plots

    fig, ax = plots.new(figsize=(7, 3.5))
    ks = list(result["projection"])
    ax.bar(ks, [result["projection"][k]["speedup"] for k in ks], color="tab:blue")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(result["goal"], color="tab:red", linestyle="--", label=f"goal {result['goal']:g}x")
    ax.set_xlabel("draft tokens a step (k)")
    ax.set_ylabel("projected speedup, batch 1")
    ax.set_title(
        f"{Path(result['draft']).name} drafting for {Path(result['target']).name}: "
        f"{result['match_rate']:.0%} of tokens match",
        fontsize=10,
    )
    ax.legend()
    plots.save(fig, path)


if __name__ == "__main__":
    main()
