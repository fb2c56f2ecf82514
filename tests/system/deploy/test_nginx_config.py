"""The rendered nginx config: `nginx -t` accepts it, and a real nginx in front of tiny aiohttp stand-in
replicas follows the status contract of deploy/README.md: a 503 (refused before any work) is replayed on
the next replica and counts towards max_fails; a 500 (work started, or a poison request) is neither
replayed nor counted; a 429 (overload) is passed to the client and never marks a replica down. SSE
streams through unbuffered; nginx's own per-client limits answer 429 in the OpenAI shape."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from deploy.nginx.render import NginxOptions, render
from tests.harness import REPO

ROOT = REPO
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install -y nginx)")
# one worker: max_fails is then counted by one process and the test's request order is the one nginx sees
TEST_OPTIONS = NginxOptions(worker_processes=1, worker_connections=64, fail_timeout="30s")


@pytest.fixture
def prefix():
    # not pytest's tmp_path: its parents are 0700 and nginx workers run as `nobody` when started as root
    path = Path(tempfile.mkdtemp(prefix="pagedserve-nginx-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _nginx_t(prefix: Path, text: str) -> subprocess.CompletedProcess:
    conf = prefix / "nginx.conf"
    conf.write_text(text)
    return subprocess.run(
        [NGINX, "-t", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=10,
    )


# --- the config as text ---------------------------------------------------------------------------


def test_render_has_the_failover_and_streaming_directives():
    text = render(["127.0.0.1:8001", "127.0.0.1:8002"], ["127.0.0.1:8003"], "127.0.0.1:8080", "/srv/ngx")
    assert re.findall(r"^\s*server (\S+) (.*);$", text, re.M) == [
        ("127.0.0.1:8001", "max_fails=3 fail_timeout=10s"),
        ("127.0.0.1:8002", "max_fails=3 fail_timeout=10s"),
        ("127.0.0.1:8003", "max_fails=3 fail_timeout=10s backup"),
    ]
    # replayed: refused connections and 503s only; never 429/500/502/504 or a timeout (see the contract)
    [generation_policy] = re.findall(r"^ {8}proxy_next_upstream (.*);$", text, re.M)
    assert generation_policy == "error http_503 non_idempotent"
    probe_policies = re.findall(r"^ {12}proxy_next_upstream (.*);$", text, re.M)
    assert probe_policies == ["error timeout http_503"] * 3  # /health, /health/ready, /metrics: GETs only
    for directive in (
        "proxy_next_upstream_tries 3;",
        "proxy_next_upstream_timeout 15s;",
        "keepalive 32;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_buffering off;",
        "proxy_cache off;",
        "proxy_read_timeout 300s;",
        "proxy_connect_timeout 2s;",
        "listen 127.0.0.1:8080;",
        "pid /srv/ngx/nginx.pid;",
        "error_log /srv/ngx/error.log warn;",
        "location /v1/ {",
        "location = /health {",
        "location = /health/ready {",
        "location = /health/live {",
        "location = /metrics {",
        "limit_req_zone $binary_remote_addr zone=pagedserve_rate:10m rate=50r/s;",
        "limit_req zone=pagedserve_rate burst=100 nodelay;",
        "limit_conn pagedserve_conns 128;",
        "limit_req_status 429;",
        "limit_conn_status 429;",
        "proxy_set_header X-Request-ID $pagedserve_request_id;",
    ):
        assert directive in text, directive
    temp_paths = re.findall(r"^\s*(\w+_temp_path) (\S+);$", text, re.M)
    assert {name for name, _ in temp_paths} == {
        "client_body_temp_path",
        "proxy_temp_path",
        "fastcgi_temp_path",
        "uwsgi_temp_path",
        "scgi_temp_path",
    }
    assert all(path.startswith("/srv/ngx/") for _, path in temp_paths)
    assert not re.search(r"\{\{\w+\}\}", text)


def test_options_reach_the_text():
    options = NginxOptions(
        max_fails=5,
        fail_timeout="20s",
        next_upstream_tries=2,
        read_timeout="600s",
        metrics_allow=("127.0.0.1",),
    )
    text = render(["a:1"], [], "9000", "/p", options)
    assert "server a:1 max_fails=5 fail_timeout=20s;" in text
    assert "proxy_next_upstream_tries 2;" in text
    assert "proxy_read_timeout 600s;" in text
    assert "allow 127.0.0.1;\n            deny all;" in text
    assert "backup" not in text.split("upstream pagedserve {")[1].split("}")[0]


def test_client_limits_are_options():
    text = render(
        ["a:1"], [], "9000", "/p", NginxOptions(rate_limit="5r/s", rate_burst=7, max_conns_per_client=3)
    )
    assert "zone=pagedserve_rate:10m rate=5r/s;" in text
    assert "limit_req zone=pagedserve_rate burst=7 nodelay;" in text
    assert "limit_conn pagedserve_conns 3;" in text
    off = render(["a:1"], [], "9000", "/p", NginxOptions(rate_limit="off", max_conns_per_client=0))
    assert not re.search(r"^\s*limit_(req|conn) ", off, re.M)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([], [], "8080", "/p"), "at least one primary"),
        ((["localhost"], [], "8080", "/p"), "host:port"),
        ((["a:1"], ["b:70000"], "8080", "/p"), "host:port"),
        ((["a:1"], [], "nope", "/p"), "listen"),
        ((["a:1"], [], "8080", "relative/dir"), "absolute"),
    ],
)
def test_render_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        render(*args)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fail_timeout", "ten"),
        ("next_upstream_tries", 0),
        ("max_fails", 0),
        ("worker_processes", 0),
        ("max_body_size", "8 MB"),
        ("metrics_allow", ("not-an-ip",)),
        ("rate_limit", "50/s"),
        ("rate_limit", "0r/s"),
        ("rate_burst", -1),
        ("max_conns_per_client", -1),
    ],
)
def test_options_validate_themselves(field, value):
    with pytest.raises(ValueError, match=field):
        NginxOptions(**{field: value})


def test_cli_prints_what_render_returns():
    argv = [
        "--primary",
        "127.0.0.1:8001",
        "--primary",
        "127.0.0.1:8002",
        "--backup",
        "127.0.0.1:8003",
        "--listen",
        "127.0.0.1:8080",
        "--prefix",
        "/srv/ngx",
        "--rate-limit",
        "9r/s",
        "--rate-burst",
        "4",
        "--max-conns-per-client",
        "0",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "deploy.nginx.render", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    options = NginxOptions(rate_limit="9r/s", rate_burst=4, max_conns_per_client=0)
    assert out == render(
        ["127.0.0.1:8001", "127.0.0.1:8002"], ["127.0.0.1:8003"], "127.0.0.1:8080", "/srv/ngx", options
    )


def test_compose_config_is_the_rendered_one():
    # deploy/nginx/compose.conf is committed for docker compose; it must never drift from the template
    expected = render(["replica-1:8000", "replica-2:8000"], [], "8080", "/tmp/pagedserve-nginx")
    assert (ROOT / "deploy/nginx/compose.conf").read_text() == expected


# --- nginx -t --------------------------------------------------------------------------------------


@needs_nginx
@pytest.mark.parametrize(
    ("primaries", "backups"),
    [
        (["127.0.0.1:8001", "127.0.0.1:8002"], ["127.0.0.1:8003"]),
        (["127.0.0.1:8001"], ["127.0.0.1:8002"]),
        (["127.0.0.1:8001"], []),
        (["unix:/tmp/pagedserve.sock", "[::1]:8002"], []),
    ],
)
def test_nginx_accepts_the_config(prefix, primaries, backups):
    result = _nginx_t(prefix, render(primaries, backups, "127.0.0.1:18080", str(prefix)))
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


@needs_nginx
def test_nginx_accepts_the_config_without_client_limits(prefix):
    options = NginxOptions(rate_limit="off", max_conns_per_client=0)
    result = _nginx_t(
        prefix, render(["127.0.0.1:8001"], ["127.0.0.1:8002"], "127.0.0.1:18080", str(prefix), options)
    )
    assert result.returncode == 0, result.stderr


@needs_nginx
def test_nginx_accepts_the_compose_config(prefix):
    # the committed compose.conf, with its replica names swapped for addresses that resolve here
    text = (ROOT / "deploy/nginx/compose.conf").read_text().replace("/tmp/pagedserve-nginx", str(prefix))
    text = text.replace("replica-1:8000", "127.0.0.1:8001").replace("replica-2:8000", "127.0.0.1:8002")
    result = _nginx_t(prefix, text.replace("listen 8080;", "listen 127.0.0.1:18080;"))
    assert result.returncode == 0, result.stderr


# --- a real nginx in front of a draining and a healthy replica -------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a stand-in replica answers to everything but a healthy one's 200: the replica's own error bodies
REFUSALS = {
    503: ("draining", "unavailable", "draining"),  # refused before any work: nginx replays it
    429: ("waiting queue full", "rate_limit_exceeded", "overloaded"),  # overload: passed on, never counted
    500: ("the request made the engine fail", "server_error", "request_failed"),  # work started: passed on
}


STALL, RESET = -1, -2  # stand-in behaviours without a status of their own


class Replica:
    """A stand-in for a pagedserve replica: healthy (`status` None), or answering `status` (503, 429, 500)
    with the replica's error shape on everything."""

    def __init__(self, name: str, is_draining: bool = False, status: int | None = None) -> None:
        self.name = name
        self.status = 503 if is_draining else status
        self.hits: list[str] = []
        self.release_stream = asyncio.Event()  # the healthy SSE stream stops half-way until this is set
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(f"{request.method} {request.path}")
        if self.status == STALL:  # working on it, silently: nginx's read timeout runs out first
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release_stream.wait(), timeout=10)
        if self.status == RESET:  # the process died mid-request: the connection closes with no answer
            request.transport.abort()
            return web.Response()
        if self.status is not None:
            message, kind, code = REFUSALS[self.status]
            headers = {"X-Replica": self.name, **({"Retry-After": "1"} if self.status != 500 else {})}
            return web.json_response(
                {"error": {"message": message, "type": kind, "param": None, "code": code}},
                status=self.status,
                headers=headers,
            )
        if request.path == "/v1/chat/completions":
            return await self.stream(request)
        return web.json_response(
            {"replica": self.name, "path": request.path}, headers={"X-Replica": self.name}
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(b'data: {"delta": "first"}\n\n')
        await asyncio.wait_for(self.release_stream.wait(), timeout=5)
        await response.write(b'data: {"delta": "second"}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def replicas():
    draining, healthy = Replica("draining", is_draining=True), Replica("healthy", is_draining=False)
    await draining.start()
    await healthy.start()
    yield draining, healthy
    healthy.release_stream.set()
    await draining.runner.cleanup()
    await healthy.runner.cleanup()


def _start_nginx(
    prefix: Path, primaries: list[str], backups: list[str], options: NginxOptions = TEST_OPTIONS
) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render(primaries, backups, f"127.0.0.1:{port}", str(prefix), options))
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with {proc.returncode}: {proc.stderr.read().decode()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    _stop_nginx(proc)
    raise RuntimeError(f"nginx did not listen on 127.0.0.1:{port} within 5 s")


def _stop_nginx(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: fast shutdown of the master and its workers
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    proc.stderr.close()


@pytest.fixture
def nginx_factory(prefix):
    started: list[subprocess.Popen] = []

    def start(primaries: list[str], backups: list[str], options: NginxOptions = TEST_OPTIONS) -> str:
        proc, port = _start_nginx(prefix, primaries, backups, options)
        started.append(proc)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in started:
        _stop_nginx(proc)


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session


@needs_nginx
@pytest.mark.timeout(10)
async def test_posts_are_replayed_away_from_a_draining_replica(replicas, nginx_factory, client, prefix):
    draining, healthy = replicas
    base = nginx_factory([f"127.0.0.1:{draining.port}", f"127.0.0.1:{healthy.port}"], [])
    statuses = []
    for i in range(12):
        async with client.post(f"{base}/v1/completions", json={"prompt": str(i), "max_tokens": 4}) as r:
            statuses.append((r.status, (await r.json())["replica"]))
    assert statuses == [(200, "healthy")] * 12
    assert len(healthy.hits) == 12
    # passive health: after max_fails=3 answers of 503 the draining replica is out for fail_timeout
    assert 1 <= len(draining.hits) <= 3
    if len(draining.hits) == 3:
        assert "upstream server temporarily disabled" in (prefix / "error.log").read_text()


@needs_nginx
@pytest.mark.timeout(10)
async def test_sse_streams_through_unbuffered(replicas, nginx_factory, client):
    draining, healthy = replicas
    base = nginx_factory([f"127.0.0.1:{healthy.port}"], [f"127.0.0.1:{draining.port}"])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.post(f"{base}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(r.content.readline(), timeout=3)
        # the replica is still parked mid-stream: this chunk reached us before the response finished
        assert first == b'data: {"delta": "first"}\n'
        assert not healthy.release_stream.is_set()
        healthy.release_stream.set()
        rest = await asyncio.wait_for(r.content.read(), timeout=3)
    assert rest.split(b"\n\n")[-2:] == [b"data: [DONE]", b""]
    assert b'"second"' in rest


@needs_nginx
@pytest.mark.timeout(10)
async def test_health_routes_and_errors(replicas, nginx_factory, client):
    draining, healthy = replicas
    base = nginx_factory([f"127.0.0.1:{draining.port}", f"127.0.0.1:{healthy.port}"], [])
    for path in ("/health", "/health/ready", "/metrics"):
        async with client.get(base + path) as r:
            assert (r.status, r.headers["X-Replica"]) == (200, "healthy"), path
    async with client.get(f"{base}/health/live") as r:
        assert (r.status, json.loads(await r.text())) == (200, {"status": "live", "component": "nginx"})
    for path in ("/tokenize", "/detokenize"):  # vLLM's tokenizer routes reach a replica too
        async with client.post(base + path, json={"prompt": "hi"}) as r:
            assert (r.status, r.headers["X-Replica"], (await r.json())["path"]) == (200, "healthy", path)
    async with client.get(f"{base}/admin/models") as r:
        assert r.status == 404
        assert (await r.json(content_type=None))["error"]["code"] == 404


@needs_nginx
@pytest.mark.timeout(10)
async def test_when_every_replica_drains_the_client_sees_503_then_502(replicas, nginx_factory, client):
    draining, _ = replicas
    other = Replica("draining-2", is_draining=True)
    await other.start()
    try:
        base = nginx_factory([f"127.0.0.1:{draining.port}"], [f"127.0.0.1:{other.port}"])
        async with client.post(f"{base}/v1/completions", json={"prompt": "x"}) as r:
            # the replica's own 503 and Retry-After pass through: clients back off and retry
            assert (r.status, r.headers["Retry-After"]) == (503, "1")
            assert (await r.json())["error"]["message"] == "draining"
        statuses = []
        for _ in range(6):
            async with client.post(f"{base}/v1/completions", json={"prompt": "x"}) as r:
                statuses.append(r.status)
                body, retry_after = await r.json(content_type=None), r.headers.get("Retry-After")
        # Both out after max_fails each: nginx answers by itself, in the OpenAI error shape. (A 503 that
        # ends the last allowed try is passed on as the answer and not counted as a failure, so the
        # backup needs a few more requests than the primary before it is out.)
        assert statuses[-1] == 502
        assert (body["error"]["code"], retry_after) == (502, "1")
        assert len(draining.hits) == 3  # the primary was taken out after max_fails; the backup was tried
        assert len(other.hits) >= 1
    finally:
        await other.runner.cleanup()


@pytest.fixture
async def stand_ins():
    """Start stand-in replicas by status; all cleaned up at the end."""
    started: list[Replica] = []

    async def start(name: str, status: int | None) -> Replica:
        replica = Replica(name, status=status)
        await replica.start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.release_stream.set()
        await replica.runner.cleanup()


@needs_nginx
@pytest.mark.timeout(15)
async def test_a_500_is_passed_on_never_replayed_and_never_marks_the_replica_down(
    stand_ins, nginx_factory, client, prefix
):
    # a poison request answered 500 by one replica must not be carried to the next one
    failing, healthy = await stand_ins("failing", 500), await stand_ins("healthy", None)
    base = nginx_factory(
        [f"127.0.0.1:{failing.port}", f"127.0.0.1:{healthy.port}"],
        [],
        NginxOptions(worker_processes=1, worker_connections=64, fail_timeout="30s", max_fails=1),
    )
    statuses = Counter()
    for i in range(10):
        async with client.post(f"{base}/v1/completions", json={"prompt": str(i)}) as r:
            statuses[r.status] += 1
            if r.status == 500:
                assert (await r.json())["error"]["code"] == "request_failed"  # the replica's body, untouched
    # least_conn alternates between the two: with max_fails=1, a counted 500 would take `failing` out
    assert statuses == {500: 5, 200: 5}
    assert len(failing.hits) == 5 and len(healthy.hits) == 5
    assert "temporarily disabled" not in (prefix / "error.log").read_text()


@needs_nginx
@pytest.mark.timeout(15)
async def test_429s_are_passed_on_and_never_turn_into_502(stand_ins, nginx_factory, client, prefix):
    # both primaries saturated: every answer is the replicas' own 429, never nginx's 502
    first, second = await stand_ins("busy-1", 429), await stand_ins("busy-2", 429)
    base = nginx_factory(
        [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"],
        [],
        NginxOptions(worker_processes=1, worker_connections=64, fail_timeout="30s", max_fails=1),
    )
    statuses = Counter()
    for i in range(12):
        async with client.post(f"{base}/v1/completions", json={"prompt": str(i)}) as r:
            statuses[r.status] += 1
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "overloaded"
    assert statuses == {429: 12}
    assert len(first.hits) + len(second.hits) == 12  # one try each: a 429 is not replayed
    assert "temporarily disabled" not in (prefix / "error.log").read_text()


@needs_nginx
@pytest.mark.timeout(15)
async def test_a_429_primary_is_not_skipped_for_the_backup(stand_ins, nginx_factory, client):
    # overload is not an outage: the backup takes traffic only when primaries are down, and 429 never
    # marks one down (with max_fails=1 a single counted 429 would send the next request to the backup)
    busy, backup = await stand_ins("busy", 429), await stand_ins("backup", None)
    base = nginx_factory(
        [f"127.0.0.1:{busy.port}"],
        [f"127.0.0.1:{backup.port}"],
        NginxOptions(worker_processes=1, worker_connections=64, fail_timeout="30s", max_fails=1),
    )
    for i in range(6):
        async with client.post(f"{base}/v1/completions", json={"prompt": str(i)}) as r:
            assert r.status == 429
    assert (len(busy.hits), len(backup.hits)) == (6, 0)


@needs_nginx
@pytest.mark.timeout(15)
async def test_nginx_rate_limit_answers_429_in_the_openai_shape(stand_ins, nginx_factory, client):
    healthy = await stand_ins("healthy", None)
    options = NginxOptions(worker_processes=1, worker_connections=64, rate_limit="1r/m", rate_burst=2)
    base = nginx_factory([f"127.0.0.1:{healthy.port}"], [], options)
    statuses, bodies = [], []
    for i in range(5):
        async with client.post(f"{base}/v1/completions", json={"prompt": str(i)}) as r:
            statuses.append(r.status)
            bodies.append((await r.json(content_type=None), r.headers.get("Retry-After")))
    assert statuses == [200, 200, 200, 429, 429]  # the rate's first request + a burst of 2, then refused
    assert bodies[-1] == (
        {
            "error": {
                "message": "too many requests from this client",
                "type": "rate_limit_exceeded",
                "code": 429,
            }
        },
        "1",
    )
    assert len(healthy.hits) == 3
    async with client.get(f"{base}/health") as r:  # probes are not rate limited
        assert r.status == 200


@needs_nginx
@pytest.mark.timeout(15)
async def test_a_read_timeout_is_not_replayed(stand_ins, nginx_factory, client):
    # the replica may be working on it: nginx answers 504 itself and never sends it to a second replica
    stalled, healthy = await stand_ins("stalled", STALL), await stand_ins("healthy", None)
    options = NginxOptions(worker_processes=1, worker_connections=64, read_timeout="1s")
    base = nginx_factory([f"127.0.0.1:{stalled.port}"], [f"127.0.0.1:{healthy.port}"], options)
    async with client.post(f"{base}/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 504
        assert (await r.json(content_type=None))["error"]["code"] == 504
    assert (len(stalled.hits), len(healthy.hits)) == (1, 0)


@needs_nginx
@pytest.mark.timeout(15)
async def test_a_connection_closed_without_an_answer_is_replayed(stand_ins, nginx_factory, client):
    # what a killed or drained-away replica looks like; also the residual risk in deploy/README.md: a
    # request that crashes a whole replica process is replayed on the next one
    dying, healthy = await stand_ins("dying", RESET), await stand_ins("healthy", None)
    base = nginx_factory([f"127.0.0.1:{dying.port}"], [f"127.0.0.1:{healthy.port}"])
    async with client.post(f"{base}/v1/completions", json={"prompt": "x"}) as r:
        assert (r.status, (await r.json())["replica"]) == (200, "healthy")
    assert (len(dying.hits), len(healthy.hits)) == (1, 1)
