"""What sharing the cores costs the engine's steps: step times of the shipped primary with 2 threads and
with 1, as OpenMP waits in the server (OMP_WAIT_POLICY=PASSIVE) and with a short spin, while another
process keeps one core busy for part of the time (as the server's event loop, a load generator or a
neighbour does).

    python benchmarks/core_sharing.py                       # about 2 minutes
    python benchmarks/core_sharing.py --duty 0 0.5 --tag half

Each configuration runs in a fresh process (libgomp reads its wait policy once, when torch loads it):
the engine serves (a) a 1,700-token prompt in 256-token chunks, as a contended tenant's prompt is served
(benchmarks/fairness.py), and (b) 32 sequences decoding side by side, --steps steps each, --rounds times
(the median step). The competitor is a process of its own that spins for `duty` of every 2 ms and
sleeps the rest. Writes benchmarks/results/core_sharing[-TAG].json and .png.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

ROOT = Path(__file__).resolve().parents[1]
WAITS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"},
}
PERIOD_S = 0.002


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "pagedserve-coder-small")
    p.add_argument(
        "--duty", type=float, nargs="+", default=[0.0, 0.15, 0.3], help="the competitor's busy share"
    )
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--waits", nargs="+", choices=list(WAITS), default=list(WAITS))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", type=int, default=24, help="decode steps a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a configuration's run, in its own process
    return p.parse_args()


def compete(duty: float) -> None:
    """Busy for `duty` of every PERIOD_S, asleep the rest, until killed."""
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < PERIOD_S * duty:
            pass
        time.sleep(PERIOD_S * (1 - duty))


def child(args: argparse.Namespace, threads: int) -> dict:
    """Median step seconds of each shape, in this process (its OpenMP settings are the environment's)."""
    from engine.config import EngineConfig
    from engine.frontend.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=str(args.model), dtype=args.dtype, max_num_batched_tokens=256, num_threads=threads)
    )
    text = (ROOT / "engine" / "core" / "scheduler.py").read_text()
    ids = engine.encode(text)[:1700]

    def steps(requests: list[tuple[list[int], int]], skip: int) -> list[float]:
        for i, (prompt, max_tokens) in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
        seconds = []
        while engine.has_unfinished_requests:
            started = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - started)
        return seconds[skip:]

    turn = iter(range(1, 1 << 30))  # each run's prompts rotated its own way: no prefix-cache hits

    def prefill() -> list[float]:  # the chunks past the first (the prompt's context grows)
        k = next(turn)
        return steps([(ids[k:] + ids[:k], 1)], skip=1)

    def decode() -> list[float]:  # 32 prompts of 32 tokens take 4 steps; then decode steps only
        k = next(turn)
        prompts = [(ids[k + 32 * i : k + 32 * i + 32], args.steps) for i in range(32)]
        return steps(prompts, skip=5)

    prefill(), decode()  # warm-up
    runner = engine.model_runner
    out = {"dtype": str(runner.dtype).removeprefix("torch."), "linear_kernel": runner.linear_kernel}
    for name, run in (("prefill_chunk", prefill), ("decode_32", decode)):
        out[name] = statistics.median(statistics.median(run()) for _ in range(args.rounds))
    return out


def measure(args: argparse.Namespace, threads: int, wait: str, duty: float) -> dict:
    """`child`'s figures for one configuration, from a fresh process, beside the competitor when duty > 0."""
    competitor = None
    if duty > 0:
        competitor = subprocess.Popen(
            [sys.executable, "-c", f"import benchmarks.core_sharing as c; c.compete({duty})"], cwd=ROOT
        )
    try:
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(threads),
                "--model",
                str(args.model),
                "--dtype",
                args.dtype,
                "--steps",
                str(args.steps),
                "--rounds",
                str(args.rounds),
            ],
            env={
                **{k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                **WAITS[wait],
            },
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args, int(args.child))))
        return
    from benchmarks.offline import machine_info

    load_before = os.getloadavg()
    runs = []
    for duty in args.duty:
        for wait in args.waits:
            for threads in args.threads:
                seconds = measure(args, threads, wait, duty)  # and what the engine loaded
                loaded = {"dtype": seconds.pop("dtype"), "linear_kernel": seconds.pop("linear_kernel")}
                runs.append(
                    {
                        "duty": duty,
                        "wait": wait,
                        "threads": threads,
                        **loaded,
                        "step_ms": {k: round(v * 1e3, 2) for k, v in seconds.items()},
                    }
                )
                print(runs[-1], flush=True)
    result = {
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "dtype": args.dtype,
        "waits": WAITS,
        "steps": args.steps,
        "rounds": args.rounds,
        "runs": runs,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": machine_info(),
    }
    out = ROOT / "benchmarks" / "results" / f"core_sharing{'-' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    from benchmarks import plots

    shapes = list(result["runs"][0]["step_ms"])
    fig, axes = plots.new(1, len(shapes), figsize=(9, 3.8))
    configs = sorted({(r["wait"], r["threads"]) for r in result["runs"]})
    duties = sorted({r["duty"] for r in result["runs"]})
    width = 0.8 / len(configs)
    for ax, shape in zip(axes, shapes, strict=True):
        for i, (wait, threads) in enumerate(configs):
            values = [
                next(
                    r["step_ms"][shape]
                    for r in result["runs"]
                    if (r["wait"], r["threads"], r["duty"]) == (wait, threads, d)
                )
                for d in duties
            ]
            ax.bar(
                [x + i * width for x in range(len(duties))],
                values,
                width,
                label=f"{wait}, {threads} thread(s)",
            )
        ax.set_xticks(
            [x + width * (len(configs) - 1) / 2 for x in range(len(duties))],
            [f"{d:.0%} busy" for d in duties],
        )
        ax.set_xlabel("the competitor's share of one core")
        ax.set_ylabel("median step (ms)")
        ax.set_title(shape.replace("_", " "), fontsize=10)
    axes[0].legend(fontsize=8)
    loaded = result["runs"][0]
    fig.suptitle(
        f"{Path(result['model']).name} ({loaded['dtype']}, {loaded['linear_kernel']}): "
        "step times while another process shares the cores",
        fontsize=10,
    )
    plots.save(fig, path)


if __name__ == "__main__":
    main()
