"""Multi-model hot switching in one real server process: admin load/unload, the memory budget with
LRU eviction of idle models, draining on unload, path confinement, and memory that really comes back.

One server for the module: a pinned start-up model plus a models root (a temp dir) holding copies of
the shipped tiny and small models; each test unloads what it loaded."""

import asyncio
import json
import os
import shutil
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.harness import API_KEY, REPO, SMALL, TINY, require_models
from tests.system.server import Server, launch

ADMIN_KEY = "admin-test-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MiB = 2**20
QUOTA = 40 * MiB  # each run-time tiny model; the budget holds the start-up model and two of them
BUDGET = 110 * MiB
BIG_QUOTA = 80 * MiB  # the small model, for the memory cycles
RESULTS = REPO / "benchmarks" / "results" / "registry.json"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    require_models(SMALL, TINY)
    root = tmp_path_factory.mktemp("models-root")
    for name in ("start", "a", "b", "c"):
        shutil.copytree(TINY, root / name)
    shutil.copytree(SMALL, root / "big")
    shutil.copytree(TINY, root / "no-tokenizer")
    (root / "no-tokenizer" / "tokenizer.json").unlink()
    (root / "escape").symlink_to(TINY)  # inside the root by name, outside once resolved
    shutil.copytree(TINY, root / "linked-template")  # its chat template is a link to a file outside the root
    secret = tmp_path_factory.mktemp("outside") / "secret.txt"
    secret.write_text("a line of a file outside the models root")
    (root / "linked-template" / "chat_template.jinja").unlink()
    (root / "linked-template" / "chat_template.jinja").symlink_to(secret)
    return root


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    srv = launch(
        [
            "--model",
            str(root / "start"),
            "--served-model-name",
            "start",
            "--models-root",
            str(root),
            "--memory-budget",
            str(BUDGET),
            "--kv-cache-memory",
            "4MiB",
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--shutdown-timeout",
            "30",
        ],
        tmp_path_factory.mktemp("registry") / "server.log",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def call(
    server: Server, method: str, path: str, body: dict | None = None, headers: dict | None = None
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.url}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def admin(server: Server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    status, raw = call(server, method, path, body, ADMIN)
    return status, json.loads(raw)


def load(server: Server, name: str, path: str, **extra) -> dict:
    status, body = admin(server, "POST", "/admin/models/load", {"name": name, "path": path, **extra})
    assert status == 200, body
    return body


def unload(server: Server, name: str) -> dict:
    status, body = admin(server, "POST", "/admin/models/unload", {"name": name})
    assert status == 200, body
    return body


def states(server: Server) -> dict[str, str]:
    return {m["name"]: m["state"] for m in admin(server, "GET", "/admin/models")[1]["models"]}


def served(server: Server) -> list[str]:
    return [m["id"] for m in json.loads(call(server, "GET", "/v1/models", headers=AUTH)[1])["data"]]


def complete(server: Server, model: str, max_tokens: int = 4) -> tuple[int, dict]:
    status, _, raw = server.post(
        "/v1/completions",
        {"model": model, "prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True},
    )
    return status, json.loads(raw)


def assert_served(server: Server, model: str, max_tokens: int = 4) -> None:
    """A completion asked of `model` is answered by it, in full."""
    status, body = complete(server, model, max_tokens)
    assert status == 200 and body["model"] == model, body
    assert (
        body["usage"]["completion_tokens"] == max_tokens and body["choices"][0]["finish_reason"] == "length"
    ), body


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_admin_api_needs_the_admin_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):
        status, raw = call(server, "POST", "/admin/models/load", {"name": "x", "path": "a"}, headers)
        assert status == 401, raw
        assert call(server, "GET", "/admin/models", headers=headers)[0] == 401
        assert call(server, "POST", "/admin/models/unload", {"name": "start"}, headers)[0] == 401
    assert states(server) == {"start": "ready"}


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("/etc", "outside the models root"),
        ("../", "outside the models root"),
        ("escape", "outside the models root"),
        ("missing", "does not exist"),
        ("no-tokenizer", "tokenizer.json is missing"),
        ("linked-template", "chat_template.jinja links outside"),
    ],
)
def test_bad_model_paths_are_400_with_the_reason(server, path, fragment):
    status, body = admin(server, "POST", "/admin/models/load", {"name": "bad", "path": path})
    assert status == 400 and fragment in body["error"]["message"], body
    assert "bad" not in states(server)
    # a draft model's path is confined alike
    draft = {"name": "bad", "path": "a", "speculative_config": {"model": path}}
    status, body = admin(server, "POST", "/admin/models/load", draft)
    assert status == 400 and fragment in body["error"]["message"], body
    assert body["error"]["param"] == "speculative_config"
    assert "bad" not in states(server)


def test_a_model_loads_with_a_draft_model_under_the_root_and_drafts(server):
    load(
        server,
        "drafted",
        "a",
        quota_bytes=QUOTA,
        speculative_config={"model": "b", "num_speculative_tokens": 3},
    )
    status, body = complete(server, "drafted", max_tokens=32)
    assert status == 200 and body["usage"]["completion_tokens"] == 32, body
    metrics = call(server, "GET", "/metrics", headers=AUTH)[1].decode()
    drafted = 'pagedserve:spec_decode_num_draft_tokens_total{model_name="drafted"} '
    assert float(next(line for line in metrics.splitlines() if line.startswith(drafted))[len(drafted) :]) > 0
    unload(server, "drafted")
    assert states(server) == {"start": "ready"}


def test_a_load_over_budget_evicts_the_least_recently_used_idle_model(server, root):
    load(server, "a", "a", quota_bytes=QUOTA)
    load(server, "b", str(root / "b"), quota_bytes=QUOTA, fallback="start")  # absolute paths work too
    assert_served(server, "b")
    failures, done = [], threading.Event()

    def keep_a_busy() -> None:  # a stays in flight the whole time: it must never be the victim
        while not done.is_set():
            status, body = complete(server, "a", max_tokens=16)
            if status != 200:
                failures.append(body)

    busy = threading.Thread(target=keep_a_busy)
    busy.start()
    try:
        time.sleep(0.3)
        entry = load(server, "c", "c", quota_bytes=QUOTA)
        assert entry["state"] == "ready" and entry["memory_bytes"] == QUOTA
        assert states(server) == {"start": "ready", "a": "ready", "c": "ready"}  # b was idle and least recent
        assert_served(server, "c")
        status, body = complete(server, "b")
        assert status == 404, body
        # nothing idle is left to evict (a busy, start pinned, c idle but not enough): 507 says the numbers
        status, body = admin(
            server, "POST", "/admin/models/load", {"name": "d", "path": "b", "quota_bytes": "300MiB"}
        )
        assert status == 507 and "needs 314572800 bytes" in body["error"]["message"], body
        assert states(server) == {"start": "ready", "a": "ready", "c": "ready"}
    finally:
        done.set()
        busy.join()
    assert not failures, failures[:3]
    assert served(server) == ["start", "a", "c"]
    listing = admin(server, "GET", "/admin/models")[1]
    assert listing["memory_budget_bytes"] == BUDGET and listing["used_bytes"] <= BUDGET
    unload(server, "a")
    unload(server, "c")
    assert states(server) == {"start": "ready"}


async def test_unloading_a_model_lets_its_streams_finish(server):
    load(server, "a", "a", quota_bytes=QUOTA)
    body = {"model": "a", "prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(server.url, headers=AUTH) as session:
        async with session.post("/v1/completions", json=body) as stream:
            assert stream.status == 200
            first = await stream.content.readline()
            assert first.startswith(b"data: ")
            unloading = asyncio.create_task(
                session.post("/admin/models/unload", json={"name": "a"}, headers=ADMIN)
            )
            await _until(lambda: states(server).get("a") == "draining")
            async with session.post(
                "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1}
            ) as late:
                assert late.status == 503 and (await late.json())["error"]["code"] == "model_unloading"
            rest = (first + await stream.content.read()).decode()
        assert rest.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
        assert sum(len(c["text"]) > 0 for e in events for c in e["choices"]) > 100
        response = await unloading
        assert response.status == 200, await response.text()
    assert states(server) == {"start": "ready"} and served(server) == ["start"]


@pytest.mark.slow  # a latency figure: on a loaded 2-core box the loader's GIL-held C code stretches it
def test_live_stays_fast_while_a_model_loads(server):
    """Loading runs in a worker thread; what the event loop still feels is the GIL held by C code of the
    loader (tokenizer parsing: ~20-30 ms on these 2 cores), so p99 is taken over three loads."""
    idle = _live_latencies(server, 0.5)  # what the host itself costs (2 cores shared with other jobs)
    latencies = []
    for _ in range(3):
        result: dict = {}
        loader = threading.Thread(
            target=lambda out=result: out.update(
                load=admin(
                    server,
                    "POST",
                    "/admin/models/load",
                    {"name": "big", "path": "big", "quota_bytes": BIG_QUOTA},
                )
            )
        )
        loader.start()
        while loader.is_alive():
            start = time.perf_counter()
            assert server.get("/health/live")[0] == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.001)
        loader.join()
        assert result["load"][0] == 200, result
        unload(server, "big")
    p99, idle_p99 = statistics.quantiles(latencies, n=100)[98], statistics.quantiles(idle, n=100)[98]
    # the target is 50 ms; a shared 2-core CI host stretches the loader's GIL-held C code, so the
    # test allows twice that above the host's own idle p99 (measured figures: benchmarks/results)
    assert p99 < 0.100 + idle_p99, (
        f"p99 {p99 * 1000:.1f} ms over {len(latencies)} probes (max "
        f"{max(latencies) * 1000:.1f} ms); idle p99 {idle_p99 * 1000:.1f} ms"
    )


def _live_latencies(server: Server, seconds: float) -> list[float]:
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        assert server.get("/health/live")[0] == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.001)
    return latencies


def test_memory_comes_back_after_ten_load_unload_cycles(server):
    # one cycle first: the first load of a model pays one-time costs (its architecture's code, allocator
    # arenas, thread pools: ~100 MiB here) that stay; what must not stay is anything per cycle
    load(server, "big", "big", quota_bytes=BIG_QUOTA)
    unload(server, "big")
    before = rss_bytes(server.process.pid)
    loads, unloads, peaks = [], [], []
    for _ in range(10):
        start = time.perf_counter()
        entry = load(server, "big", "big", quota_bytes=BIG_QUOTA)
        loads.append(time.perf_counter() - start)
        assert_served(server, "big")
        peaks.append(rss_bytes(server.process.pid))
        start = time.perf_counter()
        unload(server, "big")
        unloads.append(time.perf_counter() - start)
    after = rss_bytes(server.process.pid)
    assert abs(after - before) <= 0.10 * before, f"RSS {before} -> {after} bytes"
    if os.environ.get("PAGEDSERVE_RECORD_RESULTS"):
        RESULTS.write_text(
            json.dumps(
                {
                    "model": "pagedserve-coder-small (copy), cpu",
                    "quota_bytes": BIG_QUOTA,
                    "weight_bytes": entry["weight_bytes"],
                    "kv_cache_bytes": entry["kv_cache_bytes"],
                    "load_seconds": [round(s, 3) for s in loads],
                    "unload_seconds": [round(s, 3) for s in unloads],
                    "server_load_seconds": entry["load_seconds"],
                    "rss_before_bytes": before,
                    "rss_after_bytes": after,
                    "rss_loaded_bytes": peaks,
                    "rss_change_pct": round(100 * (after - before) / before, 2),
                },
                indent=2,
            )
            + "\n"
        )


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_on_demand_loading_with_a_model_cap(root, tmp_path_factory):
    srv = launch(
        [
            "--model",
            str(root / "start"),
            "--served-model-name",
            "start",
            "--models-root",
            str(root),
            "--models-dir",
            str(root),
            "--max-loaded-models",
            "2",
            "--kv-cache-memory",
            "4MiB",
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
        ],
        tmp_path_factory.mktemp("on-demand") / "server.log",
    )
    try:
        assert_served(srv, "a")  # not loaded: loaded first, the request waits
        assert states(srv) == {"start": "ready", "a": "ready"}
        status, body = complete(srv, "b")  # the cap is 2: a (idle) makes room, start is pinned
        assert status == 200 and body["model"] == "b", body
        assert states(srv) == {"start": "ready", "b": "ready"}
        for name in ("nope", "../a"):
            status, body = complete(srv, name)
            assert status == 404 and body["error"]["code"] == "model_not_found", body
        assert 'pagedserve:models_loaded{state="ready"} 2.0' in srv.get("/metrics")[2].decode()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
