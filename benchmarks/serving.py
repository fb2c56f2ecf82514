"""HTTP serving overhead: output tokens/s with 64 concurrent streaming clients against a real
`pagedserve serve` process, next to the same workload run offline through `LLM.generate` on the same
model and engine options, plus the p99 latency of `/health/live` during the HTTP runs, probed from a
process of its own on a fresh connection every 50 ms, as a kubelet does.

    python benchmarks/serving.py                       # shipped primary model, 64 requests
    python benchmarks/serving.py --model benchmarks/models/smollm-135m --num-requests 64
    python benchmarks/serving.py --stream-interval 1 4 --repeats 8 --tag stream-interval  # two servers

Every side gets the same engine options, a KV pool that holds the whole workload (a preemption on one
side and not the other would be measured as HTTP overhead) and the same warm-up request. With several
--stream-interval values there is one server per value (tokens go out every N of a stream, the engine
option). The sides take turns, --repeats rounds, each round starting one side later (offline, HTTP at
each interval): this VM's speed drifts by tens of percent within minutes, and a side measured after the
others would carry that drift. Offline runs with the largest interval (it builds the fewest output
objects: the baseline is never slowed by them). Every run has the same request shapes (prompt and output
lengths from --seed) and its own token ids: the same work, and no prefix-cache hits across runs. A
ratio is the median over rounds of HTTP / offline in the same round; every run is in the JSON with its
preemption count, and each HTTP run with the CPU time of the server's event loop (its main thread), of
its engine (every other thread, and the engine process's), and of this client, which shares the
machine's cores with the server. Writes benchmarks/results/serving.json and .png (each round's tok/s).
Targets (#14): HTTP >= 95% of offline tokens/s; /health/live p99 < 20 ms.
"""

import argparse
import asyncio
import http.client
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import aiohttp

if not __package__:  # python benchmarks/serving.py: the repository root, not benchmarks/, leads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import plots  # noqa: E402
from engine.config import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # as the server sets it: the offline side runs alike

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serving.json"
ENGINE_FLAGS = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "dtype": "float32",
    "kv_cache_memory": 256 * 2**20,
}


def workload(args: argparse.Namespace, vocab_size: int, salt: int) -> list[tuple[list[int], int]]:
    """Request shapes from --seed, the same in every run; token ids from `salt`, a run's own."""
    shapes, tokens = random.Random(args.seed), random.Random(f"{args.seed}-{salt}")
    return [
        (
            [
                tokens.randrange(4, vocab_size)
                for _ in range(shapes.randint(args.min_prompt, args.max_prompt))
            ],
            shapes.randint(args.min_output, args.max_output),
        )
        for _ in range(args.num_requests)
    ]


def run_offline(engine, name: str, requests: list[tuple[list[int], int]]) -> dict:
    from engine import SamplingParams

    preempted = engine.stats().num_preemptions
    started = time.monotonic()
    for i, (prompt, num_out) in enumerate(requests):
        engine.add_request(
            f"{name}-{i}", prompt, SamplingParams(temperature=0, max_tokens=num_out, ignore_eos=True)
        )
    while engine.has_unfinished_requests:
        engine.step()
    seconds = time.monotonic() - started
    return {**_rate(seconds, requests), "num_preemptions": engine.stats().num_preemptions - preempted}


TICKS = os.sysconf("SC_CLK_TCK")


def _thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of `pid`."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        if stat := _read(f"/proc/{pid}/task/{tid}/stat"):
            fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
            seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:  # the thread ended meanwhile
        return ""


def cpu_seconds(pid: int) -> dict[str, float]:
    """The server's CPU so far: its event loop (the main thread) and its engine (every other thread and
    child process: the engine loop, torch's threads, the engine process), and this client's."""
    threads = _thread_seconds(pid)
    children = [child for tid in threads for child in _read(f"/proc/{pid}/task/{tid}/children").split()]
    engine = sum(s for tid, s in threads.items() if tid != pid)
    engine += sum(sum(_thread_seconds(int(child)).values()) for child in children)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"event_loop": threads[pid], "engine": engine, "client": usage.ru_utime + usage.ru_stime}


def _rate(seconds: float, requests: list[tuple[list[int], int]]) -> dict:
    tokens = sum(n for _, n in requests)
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / seconds, 2)}


async def _stream_one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], num_out: int
) -> int:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": num_out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                tokens += 1  # one chunk per engine delta; the usage count below is authoritative
    return tokens


def probe_live(url: str) -> None:
    """--probe URL: GET /health/live every 50 ms on a fresh connection, as a kubelet probes, from a
    process of its own (the benchmark's client loop, busy with 64 streams, would add its own delay);
    one latency in ms per line, until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    address = urllib.parse.urlsplit(url)
    while True:
        started = time.monotonic()
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        connection.request("GET", "/health/live")
        connection.getresponse().read()
        connection.close()
        print(f"{(time.monotonic() - started) * 1000:.3f}", flush=True)
        time.sleep(0.05)


async def run_http(url: str, model: str, server_pid: int, requests: list[tuple[list[int], int]]) -> dict:
    connector = aiohttp.TCPConnector(limit=len(requests) + 4)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=3600)
    ) as session:
        preempted = await _preemptions(session, url)
        probe = subprocess.Popen(
            [sys.executable, __file__, "--probe", url], stdout=subprocess.PIPE, text=True
        )
        cpu_before = cpu_seconds(server_pid)
        started = time.monotonic()
        await asyncio.gather(*[_stream_one(session, url, model, p, n) for p, n in requests])
        seconds = time.monotonic() - started
        cpu = {k: round(v - cpu_before[k], 2) for k, v in cpu_seconds(server_pid).items()}
        probe.terminate()
        live_ms = sorted(float(line) for line in probe.communicate(timeout=30)[0].split())
        run = _rate(seconds, requests)
        return {
            **run,
            "num_preemptions": await _preemptions(session, url) - preempted,
            "cpu_seconds": cpu,
            "event_loop_us_per_token": round(1e6 * cpu["event_loop"] / run["output_tokens"], 1),
            "client_us_per_token": round(1e6 * cpu["client"] / run["output_tokens"], 1),
            "health_live_ms": {
                "count": len(live_ms),
                "p50": round(statistics.median(live_ms), 2),
                "p99": round(live_ms[int(0.99 * (len(live_ms) - 1))], 2),
                "max": round(live_ms[-1], 2),
            },
        }


async def warm_http(url: str, model: str, prompt: list[int]) -> None:
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, url)
        await _stream_one(session, url, model, prompt, 2)  # the offline side's warm-up request


async def _preemptions(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("pagedserve:num_preemptions_total{")
    )


def start_server(model: str, port: int, engine: dict, engine_process: bool = False) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()] + [
        "--engine-process"
    ] * engine_process
    command = [
        sys.executable,
        "-m",
        "service",
        "serve",
        "--model",
        model,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--max-num-waiting",
        "4096",
        *flags,
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{url}/health/ready") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} never turned ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plot(result: dict, path: Path) -> None:
    rounds = range(1, len(result["offline"]) + 1)
    width = 0.8 / (1 + len(result["streams"]))
    fig, ax = plots.new(figsize=(8, 3.5))
    ax.bar(
        [i - 0.4 + width / 2 for i in rounds],
        [r["tokens_per_s"] for r in result["offline"]],
        width=width,
        label="offline",
        color="#bbb",
    )
    for k, side in enumerate(result["streams"], start=1):
        bars = ax.bar(
            [i - 0.4 + width * (k + 0.5) for i in rounds],
            [r["tokens_per_s"] for r in side["http"]],
            width=width,
            label=f"HTTP, 64 streams, --stream-interval {side['stream_interval']}",
        )
        ax.bar_label(bars, labels=[f"{r:.0%}" for r in side["http_vs_offline_rounds"]], fontsize=7)
    ax.set_xticks(list(rounds), [f"round {i}" for i in rounds])
    ax.set_ylabel("output tok/s")
    medians = ", ".join(
        f"{s['http_vs_offline']:.0%} at interval {s['stream_interval']}" for s in result["streams"]
    )
    ax.set_title(
        f"HTTP vs offline (median): {medians}; /health/live p99 {result['health_live_p99_ms']} ms; "
        f"load {result['loadavg_before'][0]:.1f}-{result['loadavg_after'][0]:.1f}",
        fontsize=8,
    )
    ax.legend(fontsize=7, loc="lower right")
    plots.save(fig, path)


def _summary(side: dict) -> dict:
    http = side["http"]
    return {
        **side,
        "http_vs_offline": round(statistics.median(side["http_vs_offline_rounds"]), 3),
        "event_loop_us_per_token": statistics.median(run["event_loop_us_per_token"] for run in http),
        "client_us_per_token": statistics.median(run["client_us_per_token"] for run in http),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "pagedserve-coder-small"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=4, help="rounds of runs (one a side); a ratio is the median of rounds"
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="the server runs its engine loop in a process of its own (--engine-process)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        nargs="+",
        default=[1],
        help="one server per value, with that --stream-interval (default 1: each token as it comes)",
    )
    p.add_argument("--tag", default="", help="suffix of the result file")
    p.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)  # the /health/live prober's own process
    args = p.parse_args()
    if args.probe:
        probe_live(args.probe)
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    loadavg_before = os.getloadavg()
    servers = {}  # stream interval -> (server, its URL)
    for interval in args.stream_interval:
        port = free_port()
        servers[interval] = (
            start_server(
                args.model, port, {**ENGINE_FLAGS, "stream_interval": interval}, args.engine_process
            ),
            f"http://127.0.0.1:{port}",
        )
    http: dict[int, list[dict]] = {interval: [] for interval in servers}
    offline: list[dict] = []
    try:
        from engine import LLM, SamplingParams

        warm_prompt = workload(args, vocab_size, -1)[0][0]
        for _, url in servers.values():
            asyncio.run(warm_http(url, "bench", warm_prompt))
        # offline makes the fewest output objects of all the intervals measured: the baseline is not slowed by them
        llm = LLM(model=args.model, **ENGINE_FLAGS, stream_interval=max(servers))  # idle while a server runs
        llm.generate([{"prompt_token_ids": warm_prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
        sides = ["offline", *servers]
        for repeat in range(args.repeats):
            for turn, side in enumerate(sides[repeat % len(sides) :] + sides[: repeat % len(sides)]):
                requests = workload(args, vocab_size, len(sides) * repeat + turn)
                if side == "offline":
                    offline.append(run_offline(llm.engine, f"off-{repeat}", requests))
                else:
                    server, url = servers[side]
                    http[side].append(asyncio.run(run_http(url, "bench", server.pid, requests)))
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(60)
    streams = [
        _summary(
            {
                "stream_interval": interval,
                "http": runs,
                "http_vs_offline_rounds": [
                    round(h["tokens_per_s"] / o["tokens_per_s"], 3)
                    for h, o in zip(runs, offline, strict=True)
                ],
            }
        )
        for interval, runs in http.items()
    ]
    result = {
        "model": args.model,
        "engine": ENGINE_FLAGS,
        "engine_process": args.engine_process,
        "workload": vars(args),
        "offline": offline,
        "streams": streams,
        "health_live_p99_ms": max(run["health_live_ms"]["p99"] for runs in http.values() for run in runs),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "targets": {"http_vs_offline_min": 0.95, "health_live_p99_ms_max": 20},
    }
    path = RESULTS.with_name(f"serving{'-' + args.tag if args.tag else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    print(f"offline {[r['tokens_per_s'] for r in offline]} tok/s")
    for side in streams:
        print(
            f"--stream-interval {side['stream_interval']}: HTTP vs offline {side['http_vs_offline']:.0%} (median of "
            f"rounds {side['http_vs_offline_rounds']}; HTTP {[r['tokens_per_s'] for r in side['http']]} tok/s); "
            f"event loop {side['event_loop_us_per_token']} us/token, client {side['client_us_per_token']} us/token"
        )
    print(
        f"/health/live p99 {result['health_live_p99_ms']} ms; load {loadavg_before[0]:.2f} -> "
        f"{result['loadavg_after'][0]:.2f}"
    )


if __name__ == "__main__":
    main()
