"""Chaos on real server processes (small primary, tiny fallback), faults injected through
`/admin/faults` into the real engine loops:

1. a stalled primary under 20 concurrent requests: every one is served by the fallback after the
   progress deadline, the breaker opens, later requests skip the primary, a probe closes it again;
2. a leak: flagged within 3 heartbeats, out of rotation, engines recycled, memory back near the
   baseline; with `--leak-action exit` the process exits 75;
3. SIGTERM during 20 streams: all finish normally, new work gets 503, the process exits 0;
4. a primary failing every step: engine submissions stay within 1.1x of the requests (no storm).

Three servers load side by side at the start of the module (model loading dominates the run on two
cores): one for 1 and 4, one for the leak and then (recycled, healthy again) for 3, one that exits on
its leak. Measured figures go to chaos.json in the `results_dir` (a temp dir; benchmarks/results/
under `make bench-resilience`)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from tests.harness import API_KEY, SMALL, TINY, require_models
from tests.system.server import Server, start

PRIMARY, FALLBACK = SMALL.name, TINY.name
ADMIN_KEY = "chaos-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "def read_lines(path):\n"
RESULTS_NAME = "chaos.json"

IDLE_TIMEOUT_S = 2.0  # progress deadline
BREAKER_OPEN_S = 8.0  # first open period (drawn from [0.8, 1] x this)
HEARTBEAT_S = 1.0
LEAK_MIN_GROWTH = "32MiB"
LEAK_BYTES_PER_STEP = 32 * 2**20  # per loop tick (2 ticks/s idle): 64 MiB/s, two min-growths a beat
# Flagged in 2.1-2.3 s (about 2 beats) on an idle box. Twice 3 beats + 3 s: on a loaded 2-core box the
# beats and the leaking loop ticks both come late. A detector that needs many more beats still fails.
MAX_DETECT_S = 2 * 3 * HEARTBEAT_S + 3.0
NUM_CONCURRENT = 20
NUM_STORM_REQUESTS = 60

COMMON = [
    "--model",
    str(SMALL),
    "--fallback",
    str(TINY),
    "--api-key",
    API_KEY,
    "--admin-key",
    ADMIN_KEY,
    "--enable-fault-injection",
    "--kv-cache-memory",
    "32MiB",
]
LEAK = ["--heartbeat-interval", str(HEARTBEAT_S), "--leak-min-growth", LEAK_MIN_GROWTH]
SERVERS = {  # name -> extra flags
    "chaos": ["--idle-timeout", str(IDLE_TIMEOUT_S), "--breaker-open-seconds", str(BREAKER_OPEN_S)],
    # 20 streams of 64 tokens took 10-15 s to drain on 2 busy cores: more than the default 10 s
    "leak": [*LEAK, "--shutdown-timeout", "30"],
    "leak_exit": [*LEAK, "--leak-action", "exit"],
}
USED_BY = {
    "chaos_server": "chaos",
    "leak_server": "leak",
    "drain_server": "leak",
    "leak_exit_server": "leak_exit",
}

pytestmark = pytest.mark.timeout(240)


# --- fixtures ---------------------------------------------------------------------------------------
class Fleet:
    """The servers of this module by name. All that the selected tests use start at once; one that a
    test consumed (drained, exited) starts again for the next test that asks for it, so no test
    depends on which ran before it."""

    def __init__(self, logs: Path, names: set[str]) -> None:
        self.logs = logs
        self.servers: dict[str, Server] = {}
        self.num_starts: Counter[str] = Counter()
        for name in SERVERS:
            if name in names:
                self._start(name)

    def _start(self, name: str) -> None:
        self.num_starts[name] += 1
        self.servers[name] = start(
            [*COMMON, *SERVERS[name]], self.logs / f"{name}-{self.num_starts[name]}.log"
        )

    def ready(self, name: str) -> Server:
        server = self.servers.get(name)
        if server is None or server.process.poll() is not None:
            self._start(name)
        self.servers[name].wait_ready()
        return self.servers[name]

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def fleet(request, tmp_path_factory):
    require_models(SMALL, TINY)
    used = {
        USED_BY.get(name)
        for item in request.session.items
        if item.module is request.module
        for name in item.fixturenames
    }
    servers = Fleet(tmp_path_factory.mktemp("chaos"), used)
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture
def chaos_server(fleet):
    return fleet.ready("chaos")


@pytest.fixture
def leak_server(fleet):
    """In rotation: fresh, or back after an earlier test's recycle, or restarted after a drain."""
    return fleet.ready("leak")


@pytest.fixture
def leak_exit_server(fleet):
    return fleet.ready("leak_exit")


@pytest.fixture
def drain_server(fleet):
    """The leak server (one process less to load than a server of its own); the test consumes it."""
    return fleet.ready("leak")


@pytest.fixture(scope="module")
def figures(results_dir):
    """What the tests measured, merged into chaos.json in `results_dir` at the end of the module."""
    found: dict[str, dict] = {}
    load_at_start = os.getloadavg()[0]  # the figures are timings on a shared machine: say how busy it was
    yield found
    if not found:
        return
    path = results_dir / RESULTS_NAME
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(found)
    old["_run"] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": round(load_at_start, 2),
        "machine": platform.machine(),
        "primary": str(SMALL),
        "fallback": str(TINY),
    }
    path.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")


@pytest.fixture
async def client(chaos_server):
    async with openai.AsyncOpenAI(
        base_url=f"{chaos_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    ) as sdk:
        yield sdk


# --- helpers ----------------------------------------------------------------------------------------
def metrics(server: Server) -> dict[str, float]:
    """`name{labels}` -> value for every sample of /metrics."""
    status, _, body = server.get("/metrics")
    assert status == 200
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def per_model(samples: dict[str, float], name: str, model: str) -> float:
    return samples.get(f'pagedserve:{name}{{model_name="{model}"}}', 0.0)


def engine_requests(server: Server) -> dict[str, float]:
    samples = metrics(server)
    return {m: per_model(samples, "engine_requests_total", m) for m in (PRIMARY, FALLBACK)}


def ready(server: Server) -> tuple[int, dict]:
    status, _, body = server.get("/health/ready")
    return status, json.loads(body)


def fault(server: Server, method: str, body: dict | None = None) -> dict:
    status, _, reply = server.request(method, "/admin/faults", body, ADMIN)
    assert status == 200, reply
    return json.loads(reply)


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    """Poll `predicate` (blocking calls run in a thread) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


async def complete(sdk: openai.AsyncOpenAI, max_tokens: int = 8) -> tuple[float, object, dict]:
    """One completion of the primary: (seconds taken, parsed body, response headers)."""
    begin = time.monotonic()
    raw = await sdk.completions.with_raw_response.create(
        model=PRIMARY, prompt=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return time.monotonic() - begin, raw.parse(), dict(raw.headers)


async def close_breaker(server: Server, sdk: openai.AsyncOpenAI) -> None:
    """Leave the primary's breaker closed, as a fresh server has it: an open one (the storm test leaves
    it so) is waited out, then one request probes the healed primary."""

    def state() -> float:
        return per_model(metrics(server), "breaker_state", PRIMARY)

    if await asyncio.to_thread(state) == 0:
        return
    await wait_for(lambda: state() != 2, BREAKER_OPEN_S + 10, what="breaker out of its open period")
    _, body, _ = await complete(sdk, max_tokens=4)
    assert body.model == PRIMARY and await asyncio.to_thread(state) == 0


def assert_served_by_fallback(body, headers: dict) -> None:
    assert body.model == FALLBACK and body.choices[0].finish_reason in ("stop", "length")
    assert headers["x-pagedserve-served-model"] == FALLBACK and headers["x-pagedserve-degraded"] == "1"


# --- 1. stalled primary -----------------------------------------------------------------------------
# slow: 20 requests through a 2 s deadline, then an 8 s open period (about 11 s on an idle box). Its fast
# forms: tests/integration/resilience/test_router.py (stall -> fallback -> open -> one probe closes it, real engines)
# and the error storm below (failover to the fallback over HTTP, breaker opened).
@pytest.mark.slow
async def test_stalled_primary_fails_over_opens_breaker_and_a_probe_closes_it(chaos_server, client, figures):
    server = chaos_server
    await close_breaker(server, client)
    assert fault(server, "GET") == {PRIMARY: [], FALLBACK: []}
    fault(server, "POST", {"model": PRIMARY, "kind": "stall"})
    faulted = time.monotonic()
    done_at: list[float] = []

    async def one():
        _, body, headers = await complete(client)
        done_at.append(time.monotonic() - faulted)
        return body, headers

    try:
        answers = await asyncio.gather(*(one() for _ in range(NUM_CONCURRENT)))  # a client error raises here
        for body, headers in answers:
            assert_served_by_fallback(body, headers)
        first_fallback_s = min(done_at)
        print(f"\nstall: fault -> first fallback answer {first_fallback_s:.2f} s, last {max(done_at):.2f} s")
        assert IDLE_TIMEOUT_S * 0.9 <= first_fallback_s <= IDLE_TIMEOUT_S + 15

        # the deadlines tripped the breaker: the primary is skipped at once, without a deadline wait
        opened = metrics(server)
        assert per_model(opened, "breaker_state", PRIMARY) == 2
        status, body = ready(server)
        assert status == 200 and body["status"] == "degraded" and body["breakers"][PRIMARY] == "open"
        before = engine_requests(server)
        fast = [await complete(client, max_tokens=4) for _ in range(5)]
        for _, body, headers in fast:
            assert_served_by_fallback(body, headers)
        fast_s = [seconds for seconds, _, _ in fast]
        assert max(fast_s) < IDLE_TIMEOUT_S, fast_s
        assert engine_requests(server)[PRIMARY] == before[PRIMARY]
        assert per_model(metrics(server), "breaker_state", PRIMARY) == 2  # still open: no probe went in
    finally:
        fault(server, "DELETE")
    cleared = time.monotonic()

    # after the open period one probe goes to the primary and closes the breaker
    await wait_for(
        lambda: per_model(metrics(server), "breaker_state", PRIMARY) == 1,
        BREAKER_OPEN_S + 10,
        what="half-open breaker",
    )
    half_open_after_s = time.monotonic() - cleared
    _, body, headers = await complete(client, max_tokens=4)
    assert body.model == PRIMARY and headers["x-pagedserve-served-model"] == PRIMARY
    assert "x-pagedserve-degraded" not in headers
    assert per_model(metrics(server), "breaker_state", PRIMARY) == 0
    assert engine_requests(server)[PRIMARY] == before[PRIMARY] + 1
    status, body = ready(server)
    assert status == 200 and body["status"] == "ready"
    figures["stall_failover"] = {
        "idle_timeout_s": IDLE_TIMEOUT_S,
        "breaker_open_s": BREAKER_OPEN_S,
        "num_concurrent": NUM_CONCURRENT,
        "fault_to_first_fallback_s": round(first_fallback_s, 3),
        "fault_to_last_fallback_s": round(max(done_at), 3),
        "open_breaker_fallback_latency_s": [round(s, 3) for s in fast_s],
        "fault_cleared_to_half_open_s": round(half_open_after_s, 3),
        "failovers_total": opened.get("pagedserve:failovers_total"),
    }


# --- 4. no retry storm ------------------------------------------------------------------------------
async def test_failing_primary_causes_no_retry_storm(chaos_server, client, figures):
    server = chaos_server
    await close_breaker(server, client)
    before = metrics(server)
    before_engine = engine_requests(server)
    fault(server, "POST", {"model": PRIMARY, "kind": "error"})
    gate = asyncio.Semaphore(NUM_CONCURRENT)

    async def one() -> int:
        async with gate:
            try:
                _, body, headers = await complete(client, max_tokens=4)
            except openai.APIStatusError as exc:
                return exc.status_code
            assert_served_by_fallback(body, headers)
            return 200

    try:
        statuses = await asyncio.gather(*(one() for _ in range(NUM_STORM_REQUESTS)))
    finally:
        fault(server, "DELETE")
    after = metrics(server)
    added = {m: per_model(after, "engine_requests_total", m) - before_engine[m] for m in (PRIMARY, FALLBACK)}
    num_failovers = after["pagedserve:failovers_total"] - before["pagedserve:failovers_total"]
    num_ok = statuses.count(200)
    print(
        f"\nerror storm: {NUM_STORM_REQUESTS} requests -> engine submissions {added}, "
        f"{num_failovers:.0f} failovers, {num_ok} answered, others {sorted(set(statuses) - {200})}"
    )
    # 500 engine_error: the primary failed it and the retry budget refused a failover (work was done, so
    # nginx must not replay it); 503: refused before any work (breaker open, nothing else can serve)
    assert set(statuses) <= {200, 500, 503}
    assert num_ok >= 1  # the fallback answered some: "no storm" must not mean "nothing served"
    assert sum(added.values()) <= 1.1 * NUM_STORM_REQUESTS
    assert per_model(after, "breaker_state", PRIMARY) == 2
    figures["retry_storm"] = {
        "requests_sent": NUM_STORM_REQUESTS,
        "engine_requests": added,
        "engine_requests_total": sum(added.values()),
        "ratio": round(sum(added.values()) / NUM_STORM_REQUESTS, 3),
        "failovers": num_failovers,
        "answered": num_ok,
        "refused_503": statuses.count(503),
        "failed_500": statuses.count(500),
    }


# --- 2. leak ----------------------------------------------------------------------------------------
async def _detect_leak(server: Server) -> tuple[float, dict]:
    """Inject a leak into the primary once the detector is past its warm-up; seconds until
    /health/ready turns 503 (that body), or until the process is gone (`{"exited": code}`: with
    --leak-action exit and nothing in flight it may leave between two polls)."""
    await asyncio.sleep(3 * HEARTBEAT_S)  # a few flat idle samples before the growth
    fault(server, "POST", {"model": PRIMARY, "kind": "leak", "bytes_per_step": LEAK_BYTES_PER_STEP})
    faulted = time.monotonic()

    def flagged():
        try:
            status, body = ready(server)
        except OSError:  # the port closed: it must be on its way out
            return {"exited": server.process.wait(10)}
        return body if status == 503 else None

    body = await wait_for(flagged, 3 * MAX_DETECT_S, interval_s=0.05, what="leak flagged")
    return time.monotonic() - faulted, body


async def test_leak_is_flagged_then_engines_recycle_back_to_baseline(leak_server, figures):
    server = leak_server
    detect_s, body = await _detect_leak(server)
    print(f"\nleak: flagged after {detect_s:.2f} s ({detect_s / HEARTBEAT_S:.1f} heartbeats)")
    flagged_at = time.monotonic()
    assert "leak" in body["reason"] and body["leak"]
    assert metrics(server)["pagedserve:leak_suspected"] == 1  # the recycle reloads two models: seconds
    assert detect_s <= MAX_DETECT_S, body

    def back_in_rotation():
        status, body = ready(server)
        return body if status == 200 else None

    back = await wait_for(back_in_rotation, 90, interval_s=0.2, what="ready after the recycle")
    recycle_s = time.monotonic() - flagged_at
    recycle = back["last_recycle"]
    baseline, before, after = recycle["baseline_bytes"], recycle["before_bytes"], recycle["after_bytes"]
    print(
        f"leak: recycled; memory MiB baseline {baseline / 2**20:.0f}, before {before / 2**20:.0f}, "
        f"after {after / 2**20:.0f}"
    )
    assert back["leak"] is None and back["num_leaks"] == 1
    assert before > baseline and abs(after - baseline) <= 0.1 * baseline
    assert metrics(server)["pagedserve:leak_suspected"] == 0
    assert fault(server, "GET") == {PRIMARY: [], FALLBACK: []}  # the fresh engines carry no fault
    status, _, reply = server.post("/v1/completions", {"model": PRIMARY, "prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and json.loads(reply)["model"] == PRIMARY
    figures["leak_recycle"] = {
        "heartbeat_interval_s": HEARTBEAT_S,
        "leak_bytes_per_s": 2 * LEAK_BYTES_PER_STEP,
        "leak_min_growth": LEAK_MIN_GROWTH,
        "fault_to_not_ready_s": round(detect_s, 3),
        "heartbeats_to_detect": round(detect_s / HEARTBEAT_S, 2),
        "baseline_bytes": baseline,
        "before_recycle_bytes": before,
        "after_recycle_bytes": after,
        "after_vs_baseline": round(after / baseline, 4),
        "not_ready_to_ready_s": round(recycle_s, 3),
        "detail": body["leak"],
    }


async def test_leak_with_exit_action_exits_75(leak_exit_server, figures):
    server = leak_exit_server
    detect_s, body = await _detect_leak(server)
    if "exited" in body:  # nothing in flight: it may leave between two polls of /health/ready
        assert body == {"exited": 75}, body
    else:
        assert "leak" in body["reason"] and body["leak"], body
    flagged_at = time.monotonic()
    code = await asyncio.to_thread(server.process.wait, 60)
    exit_s = time.monotonic() - flagged_at
    print(f"\nleak (exit action): flagged after {detect_s:.2f} s, exit code {code} {exit_s:.2f} s later")
    assert code == 75, server.log()[-3000:]
    assert "memory leak confirmed" in server.log()
    assert detect_s <= MAX_DETECT_S, body
    figures["leak_exit"] = {
        "fault_to_not_ready_s": round(detect_s, 3),
        "not_ready_to_exit_s": round(exit_s, 3),
        "seen_as": "exit" if "exited" in body else "503",
        "exit_code": code,
    }


# --- 3. SIGTERM while streaming ---------------------------------------------------------------------
async def test_sigterm_drains_in_flight_streams_and_exits_0(drain_server, figures):
    server = drain_server
    started = 0
    all_started = asyncio.Event()

    async def stream(sdk: openai.AsyncOpenAI) -> tuple[str | None, int]:
        nonlocal started
        chunks = await sdk.completions.create(
            model=PRIMARY,
            prompt=PROMPT,
            max_tokens=64,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, num_tokens, seen = None, 0, False
        async for chunk in chunks:
            if not seen:
                seen, started = True, started + 1
                if started == NUM_CONCURRENT:
                    all_started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
        return reason, num_tokens

    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as sdk:
        streams = [asyncio.create_task(stream(sdk)) for _ in range(NUM_CONCURRENT)]
        try:
            await asyncio.wait_for(all_started.wait(), 60)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await wait_for(lambda: ready(server)[1].get("draining"), 10, interval_s=0.05, what="draining")
            status, headers, reply = await asyncio.to_thread(
                server.post, "/v1/completions", {"model": PRIMARY, "prompt": PROMPT, "max_tokens": 4}
            )
            assert status == 503 and json.loads(reply)["error"]["code"] == "draining", reply
            results = await asyncio.gather(*streams)
        finally:
            for task in streams:
                task.cancel()
    drained_s = time.monotonic() - signalled
    assert results == [("length", 64)] * NUM_CONCURRENT
    code = await asyncio.to_thread(server.process.wait, 40)
    print(f"\nsigterm: {NUM_CONCURRENT} streams finished {drained_s:.2f} s after the signal; exit {code}")
    assert code == 0, server.log()[-3000:]
    assert "draining" in server.log()
    figures["sigterm_drain"] = {
        "streams": NUM_CONCURRENT,
        "max_tokens": 64,
        "signal_to_streams_done_s": round(drained_s, 3),
        "exit_code": code,
        "new_request_status": status,
    }
