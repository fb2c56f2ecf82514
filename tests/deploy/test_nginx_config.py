"""The rendered nginx config: `nginx -t` accepts it, and a real nginx in front of two tiny aiohttp
replicas (one draining, one healthy) replays POSTs away from the draining one and streams SSE unbuffered."""

import asyncio
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
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from deploy.nginx.render import NginxOptions, render

ROOT = Path(__file__).resolve().parents[2]
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
    return subprocess.run([NGINX, "-t", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
                          capture_output=True, text=True, timeout=10)


# --- the config as text ---------------------------------------------------------------------------


def test_render_has_the_failover_and_streaming_directives():
    text = render(["127.0.0.1:8001", "127.0.0.1:8002"], ["127.0.0.1:8003"], "127.0.0.1:8080", "/srv/ngx")
    assert re.findall(r"^\s*server (\S+) (.*);$", text, re.M) == [
        ("127.0.0.1:8001", "max_fails=3 fail_timeout=10s"),
        ("127.0.0.1:8002", "max_fails=3 fail_timeout=10s"),
        ("127.0.0.1:8003", "max_fails=3 fail_timeout=10s backup"),
    ]
    for directive in (
        "proxy_next_upstream error timeout http_502 http_503 http_504 http_429 non_idempotent;",
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
    ):
        assert directive in text, directive
    temp_paths = re.findall(r"^\s*(\w+_temp_path) (\S+);$", text, re.M)
    assert {name for name, _ in temp_paths} == {"client_body_temp_path", "proxy_temp_path", "fastcgi_temp_path",
                                                "uwsgi_temp_path", "scgi_temp_path"}
    assert all(path.startswith("/srv/ngx/") for _, path in temp_paths)
    assert not re.search(r"\{\{\w+\}\}", text)


def test_options_reach_the_text():
    options = NginxOptions(max_fails=5, fail_timeout="20s", next_upstream_tries=2, read_timeout="600s",
                           metrics_allow=("127.0.0.1",))
    text = render(["a:1"], [], "9000", "/p", options)
    assert "server a:1 max_fails=5 fail_timeout=20s;" in text
    assert "proxy_next_upstream_tries 2;" in text
    assert "proxy_read_timeout 600s;" in text
    assert "allow 127.0.0.1;\n            deny all;" in text
    assert "backup" not in text.split("upstream pagedserve {")[1].split("}")[0]


@pytest.mark.parametrize(("args", "message"), [
    (([], [], "8080", "/p"), "at least one primary"),
    ((["localhost"], [], "8080", "/p"), "host:port"),
    ((["a:1"], ["b:70000"], "8080", "/p"), "host:port"),
    ((["a:1"], [], "nope", "/p"), "listen"),
    ((["a:1"], [], "8080", "relative/dir"), "absolute"),
])
def test_render_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        render(*args)


@pytest.mark.parametrize(("field", "value"), [
    ("fail_timeout", "ten"), ("next_upstream_tries", 0), ("max_fails", 0), ("worker_processes", 0),
    ("max_body_size", "8 MB"), ("metrics_allow", ("not-an-ip",)),
])
def test_options_validate_themselves(field, value):
    with pytest.raises(ValueError, match=field):
        NginxOptions(**{field: value})


def test_cli_prints_what_render_returns():
    argv = ["--primary", "127.0.0.1:8001", "--primary", "127.0.0.1:8002", "--backup", "127.0.0.1:8003",
            "--listen", "127.0.0.1:8080", "--prefix", "/srv/ngx"]
    out = subprocess.run([sys.executable, "-m", "deploy.nginx.render", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert out == render(["127.0.0.1:8001", "127.0.0.1:8002"], ["127.0.0.1:8003"], "127.0.0.1:8080", "/srv/ngx")


def test_compose_config_is_the_rendered_one():
    # deploy/nginx/compose.conf is committed for docker compose; it must never drift from the template
    expected = render(["replica-1:8000", "replica-2:8000"], [], "8080", "/tmp/pagedserve-nginx")
    assert (ROOT / "deploy/nginx/compose.conf").read_text() == expected


# --- nginx -t --------------------------------------------------------------------------------------


@needs_nginx
@pytest.mark.parametrize(("primaries", "backups"), [
    (["127.0.0.1:8001", "127.0.0.1:8002"], ["127.0.0.1:8003"]),
    (["127.0.0.1:8001"], ["127.0.0.1:8002"]),
    (["127.0.0.1:8001"], []),
    (["unix:/tmp/pagedserve.sock", "[::1]:8002"], []),
])
def test_nginx_accepts_the_config(prefix, primaries, backups):
    result = _nginx_t(prefix, render(primaries, backups, "127.0.0.1:18080", str(prefix)))
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


# --- a real nginx in front of a draining and a healthy replica -------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """A stand-in for a pagedserve replica: healthy, or draining (503 + Retry-After on everything)."""

    def __init__(self, name: str, is_draining: bool) -> None:
        self.name = name
        self.is_draining = is_draining
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
        if self.is_draining:
            return web.json_response({"error": {"message": "draining", "type": "unavailable", "code": 503}},
                                     status=503, headers={"Retry-After": "1", "X-Replica": self.name})
        if request.path == "/v1/chat/completions":
            return await self.stream(request)
        return web.json_response({"replica": self.name, "path": request.path}, headers={"X-Replica": self.name})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
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


def _start_nginx(prefix: Path, primaries: list[str], backups: list[str]) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render(primaries, backups, f"127.0.0.1:{port}", str(prefix), TEST_OPTIONS))
    proc = subprocess.Popen([NGINX, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf),
                             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
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

    def start(primaries: list[str], backups: list[str]) -> str:
        proc, port = _start_nginx(prefix, primaries, backups)
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
