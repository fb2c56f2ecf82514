"""HTTP serving overhead: output tokens/s with 64 concurrent streaming clients against a real
`pagedserve serve` process, next to the same workload run offline through `LLM.generate` on the same
model and engine options, plus the p99 latency of `/health/live` during the HTTP run, probed from a
process of its own on a fresh connection every 50 ms, as a kubelet does.

    python benchmarks/serving.py                       # shipped primary model, 64 requests
    python benchmarks/serving.py --model benchmarks/models/smollm-135m --num-requests 64

Both sides get the same engine options, a KV pool that holds the whole workload (a preemption on one
side and not the other would be measured as HTTP overhead) and the same warm-up request, then run the
workload --repeats times, each repeat with its own prompts (seed, seed + 1, ...: no prefix-cache hits
across repeats); the ratio compares the last (warm) runs, every run is in the JSON with its preemption
count. Writes benchmarks/results/serving.json; prints one summary line. Targets (#14):
HTTP >= 95% of offline tokens/s; /health/live p99 < 20 ms.
"""

import argparse
import asyncio
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import aiohttp

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server sets it: the offline side runs alike

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serving.json"
ENGINE_FLAGS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "dtype": "float32",
                "kv_cache_memory": 256 * 2**20}


def workload(args: argparse.Namespace, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


def run_offline(args: argparse.Namespace, workloads: list[list[tuple[list[int], int]]]) -> list[dict]:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, **ENGINE_FLAGS)
    llm.generate([{"prompt_token_ids": workloads[0][0][0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    engine = llm.engine
    runs = []
    for repeat, requests in enumerate(workloads):
        preempted = engine.stats().num_preemptions
        started = time.monotonic()
        for i, (prompt, num_out) in enumerate(requests):
            engine.add_request(f"off-{repeat}-{i}", prompt,
                               SamplingParams(temperature=0, max_tokens=num_out, ignore_eos=True))
        while engine.has_unfinished_requests:
            engine.step()
        seconds = time.monotonic() - started
        runs.append({**_rate(seconds, requests), "num_preemptions": engine.stats().num_preemptions - preempted})
    return runs


def _rate(seconds: float, requests: list[tuple[list[int], int]]) -> dict:
    tokens = sum(n for _, n in requests)
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / seconds, 2)}


async def _stream_one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], num_out: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": num_out, "temperature": 0, "ignore_eos": True,
            "stream": True}
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


async def run_http(url: str, model: str, workloads: list[list[tuple[list[int], int]]]) -> list[dict]:
    connector = aiohttp.TCPConnector(limit=len(workloads[0]) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await _stream_one(session, url, model, workloads[0][0][0], 2)  # the offline side's warm-up request
        runs = []
        for requests in workloads:
            preempted = await _preemptions(session, url)
            probe = subprocess.Popen([sys.executable, __file__, "--probe", url], stdout=subprocess.PIPE, text=True)
            started = time.monotonic()
            await asyncio.gather(*[_stream_one(session, url, model, p, n) for p, n in requests])
            seconds = time.monotonic() - started
            probe.terminate()
            live_ms = sorted(float(line) for line in probe.communicate(timeout=30)[0].split())
            runs.append({**_rate(seconds, requests), "num_preemptions": await _preemptions(session, url) - preempted,
                         "health_live_ms": {"count": len(live_ms), "p50": round(statistics.median(live_ms), 2),
                                            "p99": round(live_ms[int(0.99 * (len(live_ms) - 1))], 2),
                                            "max": round(live_ms[-1], 2)}})
    return runs


async def _preemptions(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("pagedserve:num_preemptions_total{"))


def start_server(model: str, port: int, engine_process: bool = False) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()] + ["--engine-process"] * engine_process
    command = [sys.executable, "-m", "service", "serve", "--model", model, "--served-model-name", "bench",
               "--port", str(port), "--max-num-waiting", "4096", *flags]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "pagedserve-coder-small"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="workload runs per side; the ratio compares the last")
    p.add_argument("--engine-process", action="store_true",
                   help="the server runs its engine loop in a process of its own (--engine-process)")
    p.add_argument("--tag", default="", help="suffix of the result file")
    p.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)  # the /health/live prober's own process
    args = p.parse_args()
    if args.probe:
        probe_live(args.probe)
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    workloads = [workload(args, vocab_size, args.seed + repeat) for repeat in range(args.repeats)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    loadavg_before = os.getloadavg()
    server = start_server(args.model, port, args.engine_process)
    try:
        asyncio.run(wait_ready(url))
        http = asyncio.run(run_http(url, "bench", workloads))
    finally:
        server.terminate()
        server.wait(60)
    offline = run_offline(args, workloads)  # after the server is gone: the two never share the CPU
    live_p99 = max(run["health_live_ms"]["p99"] for run in http)
    result = {"model": args.model, "engine": ENGINE_FLAGS, "engine_process": args.engine_process, "workload": vars(args), "http": http, "offline": offline,
              "http_vs_offline": round(http[-1]["tokens_per_s"] / offline[-1]["tokens_per_s"], 3),
              "http_vs_offline_first_run": round(http[0]["tokens_per_s"] / offline[0]["tokens_per_s"], 3),
              "health_live_p99_ms": live_p99, "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
              "targets": {"http_vs_offline_min": 0.95, "health_live_p99_ms_max": 20}}
    path = RESULTS.with_name(f"serving{'-' + args.tag if args.tag else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"HTTP {http[-1]['tokens_per_s']} tok/s vs offline {offline[-1]['tokens_per_s']} tok/s "
          f"({result['http_vs_offline']:.0%}; first runs {result['http_vs_offline_first_run']:.0%}); "
          f"/health/live p99 {live_p99} ms; load {loadavg_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}")


if __name__ == "__main__":
    main()
