"""HTTP serving overhead: output tokens/s with 64 concurrent streaming clients against a real
`pagedserve serve` process, next to the same workload run offline through `LLM.generate` on the same
model and engine options, plus the p99 latency of `/health/live` during the HTTP run.

    python benchmarks/serving.py                       # shipped primary model, 64 requests
    python benchmarks/serving.py --model benchmarks/models/smollm-135m --num-requests 64

Writes benchmarks/results/serving.json; prints one summary line. Targets: HTTP >= 90% of offline
tokens/s; /health/live p99 < 50 ms.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server sets it: the offline side runs alike

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serving.json"
ENGINE_FLAGS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "dtype": "float32"}


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(4, vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


def run_offline(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, **ENGINE_FLAGS)
    llm.generate([{"prompt_token_ids": requests[0][0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    engine = llm.engine
    started = time.monotonic()
    for i, (prompt, num_out) in enumerate(requests):
        engine.add_request(f"off-{i}", prompt, SamplingParams(temperature=0, max_tokens=num_out, ignore_eos=True))
    while engine.has_unfinished_requests:
        engine.step()
    seconds = time.monotonic() - started
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


async def _probe_live(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, samples: list[float]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        async with session.get(f"{url}/health/live") as response:
            await response.read()
        samples.append((time.monotonic() - started) * 1000)
        await asyncio.sleep(0.05)


async def run_http(url: str, model: str, requests: list[tuple[list[int], int]]) -> dict:
    connector = aiohttp.TCPConnector(limit=len(requests) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        stop, live_ms = asyncio.Event(), []
        probe = asyncio.create_task(_probe_live(session, url, stop, live_ms))
        started = time.monotonic()
        await asyncio.gather(*[_stream_one(session, url, model, p, n) for p, n in requests])
        seconds = time.monotonic() - started
        stop.set()
        await probe
    tokens = sum(n for _, n in requests)
    live_ms.sort()
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / seconds, 2),
            "health_live_ms": {"count": len(live_ms), "p50": round(statistics.median(live_ms), 2),
                               "p99": round(live_ms[int(0.99 * (len(live_ms) - 1))], 2),
                               "max": round(live_ms[-1], 2)}}


def start_server(model: str, port: int) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
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
    args = p.parse_args()
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    requests = workload(args, vocab_size)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port)
    try:
        asyncio.run(wait_ready(url))
        http = asyncio.run(run_http(url, "bench", requests))
    finally:
        server.terminate()
        server.wait(60)
    offline = run_offline(args, requests)  # after the server is gone: the two never share the CPU
    result = {"model": args.model, "engine": ENGINE_FLAGS, "workload": vars(args), "http": http, "offline": offline,
              "http_vs_offline": round(http["tokens_per_s"] / offline["tokens_per_s"], 3),
              "targets": {"http_vs_offline_min": 0.9, "health_live_p99_ms_max": 50}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"HTTP {http['tokens_per_s']} tok/s vs offline {offline['tokens_per_s']} tok/s "
          f"({result['http_vs_offline']:.0%}); /health/live p99 {http['health_live_ms']['p99']} ms")


if __name__ == "__main__":
    main()
