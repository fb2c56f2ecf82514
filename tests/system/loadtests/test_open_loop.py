"""The open loop for real: `python -m loadtests.run --open-loop`, Locust as its own process (importing it
here would monkey-patch this process through gevent).

Fast: against a server that takes DELAY_S before its first token (a stand-in whose slowness is fixed,
which no real server offers), every Poisson arrival is sent on time: the rate does not drop because
answers are slow, and the backlog shows as requests in flight; an impossible TTFT gate fails the run.
Slow (make test-slow): a real `pagedserve serve` with the tiny model, calibrated, then run at half its
measured capacity under the gates `make loadtest` uses, which must hold."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from loadtests.arrivals import poisson_offsets
from tests.harness import REPO, TINY, free_port, model_dirs_missing
from tests.system.replicas import Reaper, Replica, start_and_wait

DELAY_S = 1.5  # the stand-in's time to first token
RATE, SECONDS, SEED = 20.0, 3, 0  # ~60 arrivals; a closed loop waiting on answers would send far fewer


async def slow_stream(request: web.Request) -> web.StreamResponse:
    await request.json()
    await asyncio.sleep(DELAY_S)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for text in ("a", "b", "c"):
        await response.write(
            b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"
        )
    await response.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
    return response


def run_command(host: str, results_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loadtests.run",
        "--host",
        host,
        "--open-loop",
        "--results-dir",
        str(results_dir),
        "--seed",
        str(SEED),
        *args,
    ]


async def test_every_arrival_is_sent_on_time_however_slow_the_answers(aiohttp_server, tmp_path):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow_stream)
    app.router.add_post("/v1/completions", slow_stream)
    server = await aiohttp_server(app)
    cmd = run_command(
        f"http://127.0.0.1:{server.port}",
        tmp_path,
        "--model",
        "stub",
        "--rate",
        str(RATE),
        "--duration",
        f"{SECONDS}s",
        "--drain",
        "10s",
        "--p99-ttft-ms",
        "1",
        "--max-error-rate",
        "0",
    )
    process = await asyncio.create_subprocess_exec(
        *cmd, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output = (await asyncio.wait_for(process.communicate(), 90))[0].decode()
    assert process.returncode == 1, output[-3000:]  # ran, and only the impossible gate failed
    [run_dir] = tmp_path.glob("*/run")
    summary, records = (
        json.loads((run_dir / name).read_text()) for name in ("summary.json", "requests.json")
    )
    offsets = poisson_offsets(RATE, SECONDS, SEED)
    assert summary["gate_failures"] == [f"p99 ttft_ms {summary['ttft_ms']['p99']} > 1.0"]
    assert summary["requests"] == summary["completed"] == len(offsets), summary["errors"]
    # each request left when its arrival came, not when an earlier answer did
    lags = [
        r["start_s"] - offset
        for r, offset in zip(sorted(records, key=lambda r: r["start_s"]), offsets, strict=True)
    ]
    assert max(lags) < DELAY_S / 2, lags
    assert summary["in_flight"]["max"] >= RATE * DELAY_S / 2  # ~30 waiting at once
    assert summary["ttft_ms"]["p50"] >= DELAY_S * 1000
    assert {r["kind"] for r in records} == {"chat-short", "shared-system", "long-completion"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_loadtest_gates_hold_on_a_real_server(tmp_path):
    """The fast test of this behaviour is the one above (arrivals and gating against a stand-in)."""
    missing = model_dirs_missing(TINY)
    if missing:
        pytest.fail(f"model directories missing: {missing} (run `make models`)")
    reaper = Reaper()
    server = Replica(
        "open-loop",
        free_port(),
        ["--model", str(TINY), "--dtype", "float32"],
        tmp_path / "replica.log",
        reaper,
    )
    try:
        start_and_wait([server])
        cmd = run_command(
            server.url,
            tmp_path / "runs",
            "--rate-fraction",
            "0.5",
            "--duration",
            "30s",
            "--calibrate-duration",
            "30s",
            "--calibrate-concurrency",
            "32",
            "--unloaded-duration",
            "20s",
            "--p99-ttft-ms",
            "10000",
            "--p99-e2e-multiple",
            "10",
            "--max-error-rate",
            "0",
        )
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    finally:
        reaper.stop_all()
    output = done.stdout + done.stderr
    [summary_path] = (tmp_path / "runs").glob("*/run/summary.json")
    summary = json.loads(summary_path.read_text())
    c = summary["calibration"]
    print(
        f"open loop at {c['rate']} req/s = 0.5 x {c['capacity_rps']}: {summary['requests']} requests, in flight "
        f"max {summary['in_flight']['max']}, p99 ttft {summary['ttft_ms']['p99']} ms, p99 e2e "
        f"{summary['e2e_ms']['p99']} ms (gate {summary['p99_e2e_limit_ms']}, unloaded {c['unloaded']['e2e_ms']['p99']})"
    )
    assert done.returncode == 0, f"{summary['gate_failures']}\n{output[-3000:]}"
    assert summary["passed"] is True and summary["failures"] == 0
    assert c["rate"] == pytest.approx(0.5 * c["capacity_rps"], rel=1e-3)
    assert summary["requests"] == len(poisson_offsets(c["rate"], 30, SEED))
    assert summary["model"] == TINY.resolve().name
