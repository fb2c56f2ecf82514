"""Hostile clients against a real replica (a primary and its fallback) behind the shipped nginx config.

Cheap cases (make test): requests whose own content must fail alone, each a 4xx naming the field, after
which both breakers are closed and the replica is ready:
- ten completions of two prompts each with a grammar that cannot start (Lark `start: start`, GBNF
  `root ::= root`): they used to open both breakers and take the replica out of rotation for 27 s;
- `guided_regex: "a{400000}"` (its mask stalls steps), a `$ref` loop, a plain body sent as gzip;
- keyless clients sending 1 MiB gzip bodies that inflate to 1 GiB: 401 without inflating them, while
  /health/live keeps answering.
Slow cases (make test-slow), the issue's acceptance runs: each attack kept up for 60 s while 8 normal
clients stream; their figures go to hostile.json in the results dir.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest

from deploy.nginx.render import NginxOptions
from tests.harness import SMALL, TINY, free_port, model_dirs_missing
from tests.system.replicas import NGINX, Nginx, Replica, http, start_and_wait

RESULTS_NAME = "hostile.json"
API_KEY = "hostile-key"
ATTACKER_KEY = "hostile-attacker-key"
REPLICA_ARGS = [
    "--model",
    str(SMALL),
    "--served-model-name",
    "primary",
    "--fallback",
    str(TINY),
    "--api-key",
    API_KEY,
    "--api-key",
    ATTACKER_KEY,
    "--max-key-share",
    "0.5",
    "--dtype",
    "float32",
    "--block-size",
    "8",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "8MiB",
    "--num-threads",
    "1",
]
OPTIONS = NginxOptions(worker_processes=1, worker_connections=512, rate_limit="off")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NORMAL = {"model": "primary", "prompt": "def add(a, b):\n", "max_tokens": 16, "temperature": 0}
CANNOT_START = ({"grammar": "start: start"}, {"grammar": "root ::= root"})
BOMB_INFLATED_BYTES = 1 << 30
LIVE_P99_MS = 100.0

pytestmark = [
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make nginx)"),
    pytest.mark.skipif(bool(model_dirs_missing(SMALL, TINY)), reason="the shipped models are missing"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def replica(reaper, tmp_path_factory) -> Replica:
    replica = Replica(
        "hostile", free_port(), REPLICA_ARGS, tmp_path_factory.mktemp("hostile") / "replica.log", reaper
    )
    start_and_wait([replica])
    return replica


@pytest.fixture(scope="module")
def nginx(replica, reaper):
    proxy = Nginx([replica.address], [], OPTIONS, reaper)
    proxy.start()
    yield proxy
    proxy.cleanup()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A gzip body of about 1 MiB that inflates to 1 GiB of zeros."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    data = b"".join(deflater.compress(zeros) for _ in range(BOMB_INFLATED_BYTES >> 20)) + deflater.flush()
    assert len(data) < 2 << 20
    return data


def post(
    url: str, body: bytes | dict, headers: dict | None = None, timeout: float = 60.0
) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def error_of(raw: bytes) -> dict:
    return json.loads(raw)["error"]


def breaker_states(replica: Replica) -> dict[str, float]:
    """Model -> 0 closed, 1 half-open, 2 open (a breaker no call reached yet is not listed: closed)."""
    _, _, body = http("GET", f"{replica.url}/metrics", timeout=10)
    found = re.finditer(
        r'^pagedserve:breaker_state\{[^}]*model_name="([^"]+)"[^}]*\} (\S+)$', body.decode(), re.M
    )
    return {m[1]: float(m[2]) for m in found}


def assert_in_rotation(replica: Replica, nginx: Nginx) -> None:
    assert all(state == 0 for state in breaker_states(replica).values()), breaker_states(replica)
    assert http("GET", f"{nginx.url}/health/ready", timeout=10)[0] == 200
    status, raw = post(f"{nginx.url}/v1/completions", NORMAL, AUTH)
    assert status == 200, raw


def grammar_attack(nginx: Nginx, i: int) -> tuple[int, dict]:
    body = {**NORMAL, "prompt": ["x", "y"], "structured_outputs": CANNOT_START[i % 2]}
    status, raw = post(f"{nginx.url}/v1/completions", body, AUTH)
    return status, error_of(raw)


def rss_bytes(replica: Replica) -> int:
    status = Path(f"/proc/{replica.process.pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) * 1024


class LiveProbe:
    """/health/live on the replica itself every 50 ms, in a thread: each answer's latency."""

    def __init__(self, replica: Replica) -> None:
        self.url = f"{replica.url}/health/live"
        self.latencies_ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LiveProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            start = time.monotonic()
            try:
                status = http("GET", self.url, timeout=5)[0]
            except OSError:
                status = 0
            self.latencies_ms.append((time.monotonic() - start) * 1000)
            self.failures += status != 200

    @property
    def p99_ms(self) -> float:
        return statistics.quantiles(self.latencies_ms, n=100)[98] if len(self.latencies_ms) > 1 else 0.0


# --- cheap cases -----------------------------------------------------------------------------------


def test_ten_grammar_requests_that_cannot_start_fail_alone(replica, nginx):
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: grammar_attack(nginx, i), range(10)))
    assert [status for status, _ in results] == [400] * 10
    assert all(
        err["param"] == "structured_outputs" and "cannot produce a first token" in err["message"]
        for _, err in results
    ), results[0]
    assert_in_rotation(replica, nginx)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("guided_regex", "a{400000}", "too costly"),
        ("guided_json", {"$ref": "#"}, "cannot produce a first token"),
        (
            "guided_json",
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            "cannot produce a first token",
        ),
    ],
)
def test_a_constraint_that_would_fail_in_a_step_is_a_400_naming_its_field(
    replica, nginx, field, value, message
):
    status, raw = post(f"{nginx.url}/v1/completions", {**NORMAL, field: value}, AUTH)
    assert status == 400 and error_of(raw)["param"] == field and message in error_of(raw)["message"], raw
    assert_in_rotation(replica, nginx)


def compile_bomb(i: int) -> dict:
    """A 21-pattern allOf: llguidance took 91 s and +4.9 GB to compile its like, in the server's own threads."""
    schema = {"type": "string", "allOf": [{"pattern": f"^.*{chr(97 + i)}.{{{k}}}$"} for k in range(21)]}
    return {
        **NORMAL,
        "response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}},
    }


def test_compile_bombs_are_stopped_in_their_workers_and_the_replica_keeps_its_memory(replica, nginx):
    baseline, peak = rss_bytes(replica), 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bombs = [pool.submit(post, f"{nginx.url}/v1/completions", compile_bomb(i), AUTH) for i in range(4)]
        while not all(b.done() for b in bombs):
            peak = max(peak, rss_bytes(replica))
            time.sleep(0.1)
    for status, raw in (b.result() for b in bombs):
        assert status == 400 and error_of(raw)["param"] == "response_format", raw
        assert re.search(
            "does not compile|did not compile within|needs more than", error_of(raw)["message"]
        ), raw
    assert peak < baseline + (500 << 20)
    assert_in_rotation(replica, nginx)


def test_a_plain_body_sent_as_gzip_is_a_400(replica, nginx):
    status, raw = post(f"{nginx.url}/v1/completions", NORMAL, {**AUTH, "Content-Encoding": "gzip"})
    assert status == 400 and error_of(raw)["code"] == "invalid_content_encoding", raw


def test_keyless_gzip_bombs_get_401_uninflated_and_liveness_holds(replica, nginx, bomb):
    baseline = rss_bytes(replica)
    with LiveProbe(replica) as probe, concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(
            pool.map(
                lambda _: post(f"{nginx.url}/v1/completions", bomb, {"Content-Encoding": "gzip"})[0], range(8)
            )
        )
        time.sleep(0.5)
    assert statuses == [401] * 8
    assert probe.failures == 0 and probe.latencies_ms
    assert rss_bytes(replica) < baseline + (64 << 20)  # nothing near 1 GiB was ever inflated
    # with the key, the same body stops at --max-body-bytes of inflated size
    status, raw = post(f"{nginx.url}/v1/completions", bomb, {**AUTH, "Content-Encoding": "gzip"})
    assert status == 413 and "inflates to more than" in error_of(raw)["message"]
    assert_in_rotation(replica, nginx)


# --- the acceptance runs: 60 s of each attack beside normal streaming clients ------------------------


def normal_streams(nginx: Nginx, stop: threading.Event, num_clients: int = 8) -> tuple[int, int]:
    """(streams completed, streams with any error) of `num_clients` closed-loop streaming clients."""
    counts = {"ok": 0, "bad": 0}
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            status, raw = post(f"{nginx.url}/v1/completions", {**NORMAL, "stream": True}, AUTH)
            good = status == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
            with lock:
                counts["ok" if good else "bad"] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(60)
    return counts["ok"], counts["bad"]


@pytest.mark.slow
def test_a_persistent_grammar_attack_beside_eight_streams(replica, nginx, results_file):
    """Fast twin: test_ten_grammar_requests_that_cannot_start_fail_alone."""
    stop = threading.Event()
    ready_failures, attack_statuses, open_breakers = 0, [], 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        normals = pool.submit(normal_streams, nginx, stop)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            attack_statuses.append(grammar_attack(nginx, len(attack_statuses))[0])
            ready_failures += http("GET", f"{nginx.url}/health/ready", timeout=10)[0] != 200
            open_breakers += any(state != 0 for state in breaker_states(replica).values())
            time.sleep(2)
        stop.set()
        ok, bad = normals.result()
    results_file(
        "grammar_attack",
        {
            "attack_requests": len(attack_statuses),
            "attack_4xx": sum(400 <= s < 500 for s in attack_statuses),
            "normal_streams_ok": ok,
            "normal_streams_failed": bad,
            "ready_failures": ready_failures,
            "samples_with_a_breaker_open": open_breakers,
        },
    )
    assert all(400 <= s < 500 for s in attack_statuses) and bad == 0 and ok > 0
    assert ready_failures == 0 and open_breakers == 0


@pytest.mark.slow
def test_eight_keyless_gzip_bomb_clients_for_a_minute(replica, nginx, bomb, results_file):
    """Fast twin: test_keyless_gzip_bombs_get_401_uninflated_and_liveness_holds."""
    baseline = rss_bytes(replica)
    stop = threading.Event()
    statuses: list[int] = []
    peak = baseline

    def attacker() -> None:
        while not stop.is_set():
            statuses.append(post(f"{nginx.url}/v1/completions", bomb, {"Content-Encoding": "gzip"})[0])

    with LiveProbe(replica) as probe:
        threads = [threading.Thread(target=attacker, daemon=True) for _ in range(8)]
        for thread in threads:
            thread.start()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            peak = max(peak, rss_bytes(replica))
            time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join(60)
    time.sleep(1)
    after = rss_bytes(replica)
    results_file(
        "gzip_bombs",
        {
            "requests": len(statuses),
            "answered_401": statuses.count(401),
            "live_probes": len(probe.latencies_ms),
            "live_failures": probe.failures,
            "live_p99_ms": round(probe.p99_ms, 1),
            "rss_baseline_mib": baseline >> 20,
            "rss_peak_mib": peak >> 20,
            "rss_after_mib": after >> 20,
        },
    )
    assert statuses and statuses.count(401) == len(statuses)
    assert probe.failures == 0 and probe.p99_ms < LIVE_P99_MS
    assert peak < baseline + (128 << 20) and after < baseline + (64 << 20)


def counter(replica: Replica, name: str, model: str) -> float:
    """A per-model counter of /metrics (0 when not exported yet)."""
    _, _, body = http("GET", f"{replica.url}/metrics", timeout=10)
    pattern = rf'^pagedserve:{name}(?:_total)?\{{[^}}]*model_name="{re.escape(model)}"[^}}]*\}} (\S+)$'
    return sum(float(m[1]) for m in re.finditer(pattern, body.decode(), re.M))


@pytest.mark.slow
def test_kv_pressure_from_ordinary_streams_is_queueing_not_a_sick_model(
    reaper, tmp_path_factory, results_file
):
    """Fast twin: test_router_deadlines' test_a_late_token_is_queueing_when_its_own_sequence_was_preempted.
    48 well-behaved streams of 300 tokens on a KV pool that holds about two of them, with a 1 s first-token
    deadline, so preempted streams wait between tokens far longer than it: no stream fails, and every late
    token counts as late_in_queue, none as slow; the primary's breaker stays closed."""
    replica = Replica(
        "kv-pressure",
        free_port(),
        [
            "--model",
            str(SMALL),
            "--served-model-name",
            "primary",
            "--fallback",
            str(TINY),
            "--api-key",
            API_KEY,
            "--dtype",
            "float32",
            "--block-size",
            "8",
            "--max-num-seqs",
            "32",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "4MiB",
            "--first-token-timeout",
            "1",
        ],
        tmp_path_factory.mktemp("kv") / "replica.log",
        reaper,
    )
    start_and_wait([replica])
    body = {**NORMAL, "max_tokens": 300, "ignore_eos": True, "stream": True}
    states = []
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        streams = [pool.submit(post, f"{replica.url}/v1/completions", body, AUTH, 300) for _ in range(48)]
        while not all(s.done() for s in streams):
            states.append(breaker_states(replica).get("primary", 0.0))
            time.sleep(1)
    results = [s.result() for s in streams]
    failed = [
        r for r in results if r[0] != 200 or b'"error"' in r[1] or not r[1].rstrip().endswith(b"[DONE]")
    ]
    figures = {
        "streams": len(results),
        "failed": len(failed),
        "preemptions": counter(replica, "num_preemptions", "primary"),
        "slow_calls": counter(replica, "slow_calls", "primary"),
        "late_in_queue": counter(replica, "late_in_queue", "primary"),
        "samples_with_the_breaker_open": sum(s != 0 for s in states),
    }
    results_file("kv_pressure", figures)
    replica.stop()
    assert figures["failed"] == 0 and figures["preemptions"] > 0, figures
    assert figures["slow_calls"] == 0 and figures["samples_with_the_breaker_open"] == 0, figures


def ttft_p99_ms(url: str, num: int = 12) -> tuple[float, int]:
    """(p99 time to the first SSE byte in ms, requests not answered 200) of `num` streams one after another."""
    times, failed = [], 0
    for _ in range(num):
        request = urllib.request.Request(
            f"{url}/v1/completions",
            method="POST",
            headers={"Content-Type": "application/json", **AUTH},
            data=json.dumps({**NORMAL, "stream": True}).encode(),
        )
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read(1)
                times.append((time.monotonic() - start) * 1000)
                response.read()
        except (urllib.error.HTTPError, OSError):
            failed += 1
    return (statistics.quantiles(times, n=100)[98] if len(times) > 1 else float("inf")), failed


@pytest.mark.slow
def test_an_idle_connection_flood_and_a_seat_hog_leave_normal_clients_served(replica, results_file):
    """Fast twins: test_hardening's idle-connection test; test_admission's owner share."""
    idle_p99, idle_failed = ttft_p99_ms(replica.url)
    flood = []
    for _ in range(1100):  # over --max-connections (1024): each sends one request, then stays open, idle
        sock = socket.create_connection(("127.0.0.1", replica.port))
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        flood.append(sock)
    for sock in flood:
        sock.recv(4096)
    flood_p99, flood_failed = ttft_p99_ms(replica.url)
    for sock in flood:
        sock.close()
    hog = {**NORMAL, "n": 8, "max_tokens": 400, "ignore_eos": True}
    attacker = {"Authorization": f"Bearer {ATTACKER_KEY}"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hogs = [pool.submit(post, f"{replica.url}/v1/completions", hog, attacker, 300) for _ in range(4)]
        time.sleep(1)
        hog_p99, hog_failed = ttft_p99_ms(replica.url)
        hog_statuses = sorted(h.result()[0] for h in hogs)
    results_file(
        "connections_and_seats",
        {
            "idle_ttft_p99_ms": round(idle_p99, 1),
            "flood_1100_idle_connections_ttft_p99_ms": round(flood_p99, 1),
            "seat_hog_ttft_p99_ms": round(hog_p99, 1),
            "failed": idle_failed + flood_failed + hog_failed,
            "hog_statuses": hog_statuses,
        },
    )
    assert idle_failed == flood_failed == hog_failed == 0
    assert hog_statuses.count(429) == 3 and hog_statuses.count(200) == 1  # a key holds at most 8 of 16 seats
    assert flood_p99 < max(2 * idle_p99, 100) and hog_p99 < max(2 * idle_p99, 100)
