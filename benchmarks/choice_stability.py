"""Is the load-time linear-kernel choice (`--linear-kernel auto`, engine/executor/layers/onednn_linear.py's
`choose`) the same on every start, and is it the faster kernel by whole-run throughput? (issue 39) Each
start's step-thread choice (engine/executor/step_threads.py: the largest step run on one thread) is counted
too.

    python benchmarks/choice_stability.py                          # SmolLM-135M shape, fp32, 10 starts
    python benchmarks/choice_stability.py --model benchmarks/models/qwen2-1.5b --dtype bfloat16 --starts 5

Each start is a fresh process that loads the model as the engine does (OpenMP set as the
server sets it) and reports what `choose` timed and chose. Then benchmarks/offline.py runs the same model with
each kernel forced, one after the other, in one run of this script: the kernel with the higher tok/s is
the right choice. Writes benchmarks/results/choice_stability{-TAG}.json and .png, with the load average
before and after (above 1.5 on 2 cores the figures are not clean).
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # run as a script: the repository root, where `benchmarks` is, leads sys.path

from benchmarks import plots  # noqa: E402
from engine.config import set_openmp_defaults  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
LOAD = """
import json, sys
from engine import LLM
runner = LLM(sys.argv[1], dtype=sys.argv[2], num_threads=int(sys.argv[3]), max_num_seqs=32,
             max_num_batched_tokens=2048).engine.model_runner  # offline.py's batch
threads = runner.step_threads
print(json.dumps({"chosen": runner.linear_kernel, "choice": runner.linear_choice.to_dict(),
                  "single_thread_upto": threads.single_thread_upto if threads else 0}))
"""


def start_once(model: str, dtype: str, threads: int) -> dict:
    env = dict(os.environ)
    set_openmp_defaults(env)
    done = subprocess.run(
        [sys.executable, "-c", LOAD, model, dtype, str(threads)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def offline(model: str, dtype: str, kernel: str, args: argparse.Namespace) -> float:
    """benchmarks/offline.py's pagedserve tok/s with `kernel` forced."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "offline.py"),
                "--model",
                model,
                "--systems",
                "pagedserve",
                "--dtypes",
                dtype,
                "--linear-kernel",
                kernel,
                "--num-requests",
                str(args.num_requests),
                "--threads",
                str(args.threads),
                "--out-dir",
                out,
                "--tag",
                kernel,
            ],
            cwd=ROOT,
            check=True,
            timeout=3600,
            stdout=subprocess.DEVNULL,
        )
        result = json.loads(next(Path(out).glob("*.json")).read_text())
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    return result["systems"][f"pagedserve {short}"]["output_tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "benchmarks" / "models" / "smollm-135m"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--starts", type=int, default=10)
    p.add_argument("--num-requests", type=int, default=32, help="offline.py's workload, once per kernel")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"{args.model}: no such model; make it with benchmarks/make_model.py --preset smollm-135m")
    loadavg_before = os.getloadavg()
    starts = [start_once(args.model, args.dtype, args.threads) for _ in range(args.starts)]
    tok_s = {kernel: offline(args.model, args.dtype, kernel, args) for kernel in ("aten", "onednn")}
    counts = collections.Counter(s["chosen"] for s in starts)
    faster = max(tok_s, key=tok_s.get)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "starts": starts,
        "choices": dict(counts),
        "single_thread_upto": dict(collections.Counter(s["single_thread_upto"] for s in starts)),
        "offline_tokens_per_s": tok_s,
        "faster": faster,
        "targets_met": {
            "same_choice_every_start": len(counts) == 1,
            "chose_the_faster": counts.get(faster, 0) == args.starts,
        },
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
    }
    name = f"choice_stability{'-' + args.tag if args.tag else ''}"
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    fig, (left, right) = plots.new(1, 2, figsize=(9, 3.5))
    left.bar(list(counts), list(counts.values()))
    left.set_title(f"choice over {args.starts} starts")
    right.bar(list(tok_s), list(tok_s.values()))
    right.set_title("offline tok/s, kernel forced")
    plots.save(fig, RESULTS_DIR / f"{name}.png")
    print(
        f"choice over {args.starts} starts: {dict(counts)}; offline tok/s {tok_s}: faster {faster}; "
        f"single_thread_upto {result['single_thread_upto']} -> {RESULTS_DIR / name}.json"
    )


if __name__ == "__main__":
    main()
