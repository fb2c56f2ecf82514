"""What running steps of few tokens on one thread buys over HTTP: two `pagedserve serve` processes on the
same model, one with `--step-threads auto` (the default: engine/executor/step_threads.py) and one with
`--step-threads all`, taking turns on the same workloads.

    python benchmarks/step_threads.py                       # shipped primary, the dtype --dtype auto picks
    python benchmarks/step_threads.py --dtype float32 --tag fp32

Each round runs, on each server in turn (the order alternates from round to round): one stream, a few
completions one after the other (a lone user's tokens/s), then --num-requests concurrent streams with
benchmarks/serving.py's mixed shapes. Every run has its own token ids (no prefix-cache hits across runs).
Reports the medians over rounds, auto / all, each server's choice as /health/ready shows it, and the
CPU seconds per wall-second of each server's engine (every thread but the event loop's). Writes
benchmarks/results/step_threads{-TAG}.json and .png; load average before and after (above 1.5 on 2
cores the figures are not clean).
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

if not __package__:  # python benchmarks/step_threads.py: the repository root leads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import plots  # noqa: E402
from benchmarks.offline import machine_info  # noqa: E402
from benchmarks.serving import _stream_one, cpu_seconds, free_port, start_server, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
MODES = ("auto", "all")
VOCAB_LOW = 4  # special ids below


def requests(rng: random.Random, count: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int):
    return [
        ([rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
        for _ in range(count)
    ]


async def run(session, url: str, pid: int, batch: list[tuple[list[int], int]], concurrent: bool) -> dict:
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    if concurrent:
        tokens = sum(await asyncio.gather(*(_stream_one(session, url, "bench", p, n) for p, n in batch)))
    else:
        tokens = 0
        for p, n in batch:
            tokens += await _stream_one(session, url, "bench", p, n)
    seconds = time.monotonic() - started
    engine_cpu = cpu_seconds(pid)["engine"] - cpu_before["engine"]
    return {
        "tokens_per_s": round(tokens / seconds, 2),
        "engine_cpu_per_wall_s": round(engine_cpu / seconds, 2),
    }


async def measure(args: argparse.Namespace, servers: dict[str, tuple]) -> dict:
    rng = random.Random(args.seed)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    connector = aiohttp.TCPConnector(limit=args.num_requests + 4)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=3600)
    ) as session:
        choices = {}
        for mode, (process, url) in servers.items():
            await wait_ready(session, url)
            async with session.get(f"{url}/health/ready") as response:
                engine = next(iter((await response.json())["engines"].values()))
            choices[mode] = {k: engine[k] for k in ("dtype", "linear_kernel", "step_threads")}
            await run(
                session, url, process.pid, requests(rng, 1, (64, 128), (16, 16), vocab), False
            )  # warm-up
        runs: dict[str, dict[str, list[dict]]] = {m: {"one_stream": [], "concurrent": []} for m in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for kind, concurrent in (("one_stream", False), ("concurrent", True)):
                for mode in order:
                    batch = (
                        requests(rng, args.num_requests, (32, 512), (16, 256), vocab)
                        if concurrent
                        else requests(rng, args.one_stream_requests, (64, 128), (128, 128), vocab)
                    )
                    process, url = servers[mode]
                    runs[mode][kind].append(await run(session, url, process.pid, batch, concurrent))
                    print(f"round {r} {mode} {kind}: {runs[mode][kind][-1]}", flush=True)
    medians = {
        mode: {
            kind: {k: statistics.median(run[k] for run in values) for k in values[0]}
            for kind, values in by_kind.items()
        }
        for mode, by_kind in runs.items()
    }
    return {
        "choices": choices,
        "runs": runs,
        "medians": medians,
        "auto_vs_all": {
            kind: round(medians["auto"][kind]["tokens_per_s"] / medians["all"][kind]["tokens_per_s"], 3)
            for kind in ("one_stream", "concurrent")
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "pagedserve-coder-small"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one-stream-requests", type=int, default=4, help="128-token completions one by one")
    p.add_argument("--num-requests", type=int, default=64, help="concurrent streams")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    engine = {"dtype": args.dtype, "max_num_seqs": 64, "kv_cache_memory": 256 * 2**20}
    load_before = os.getloadavg()
    servers = {}
    try:
        for mode in MODES:
            port = free_port()
            servers[mode] = (
                start_server(args.model, port, {**engine, "step_threads": mode}),
                f"http://127.0.0.1:{port}",
            )
        result = asyncio.run(measure(args, servers))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    result = {
        "model": args.model,
        "engine": engine,
        **result,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": machine_info(),
    }
    name = f"step_threads{'-' + args.tag if args.tag else ''}"
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    fig, axes = plots.new(1, 2, figsize=(8, 3.2))
    for ax, kind, title in zip(
        axes, ("one_stream", "concurrent"), ("one stream", f"{args.num_requests} streams"), strict=True
    ):
        ax.bar(
            MODES,
            [result["medians"][m][kind]["tokens_per_s"] for m in MODES],
            color=["tab:green", "tab:gray"],
        )
        ax.set_title(f"{title}: auto / all {result['auto_vs_all'][kind]:.2f}x")
        ax.set_ylabel("output tokens/s (median of rounds)")
    plots.save(fig, RESULTS_DIR / f"{name}.png")
    print(
        f"auto / all: {result['auto_vs_all']} ({result['choices']['auto']['step_threads']['single_thread_upto']} "
        f"tokens on one thread) -> {RESULTS_DIR / name}.json"
    )


if __name__ == "__main__":
    main()
