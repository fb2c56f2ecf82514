"""The HTTP edge against clients that misbehave on purpose, on a real server with small limits: a
stream nobody reads, a body or a request head that never completes, more connections than the cap,
a forged access-log line, version probing, absolute paths, concurrent health probes, and keys for
health details and metrics. The error path's own failure modes are tested in process."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from engine.config import EngineConfig
from service import errors
from service.access import escape
from service.api.sse import encode_event
from service.body import parse_json
from service.config import ModelSpec, ServerConfig
from service.errors import FALLBACK_BODY, InvalidRequestError, error_middleware
from service.keys import CONFIG_KEY
from tests.harness import API_KEY, TINY, require_models
from tests.system.server import launch

ADMIN_KEY = "hardening-admin-key"
MAX_CONNECTIONS = 4
WRITE_TIMEOUT_S = 2
HEADER_TIMEOUT_S = 3
BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_models(TINY)
    srv = launch(
        [
            "--model",
            str(TINY),
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--max-connections",
            str(MAX_CONNECTIONS),
            "--stream-write-timeout",
            str(WRITE_TIMEOUT_S),
            "--header-timeout",
            str(HEADER_TIMEOUT_S),
            "--body-read-timeout",
            str(BODY_TIMEOUT_S),
            "--health-details-auth",
            "--metrics-auth",
            "--kv-cache-memory",
            "16MiB",
        ],
        tmp_path_factory.mktemp("hardening") / "server.log",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def get(server, path: str, key: str | None = API_KEY) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{server.url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def connect(server, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def engine_figures(server) -> dict[str, float]:
    _, _, body = get(server, "/metrics")
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    return {
        line.split("{")[0].removeprefix("pagedserve:"): float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(tuple(f"pagedserve:{n}{{" for n in names))
    }


def test_server_header_names_no_version(server):
    for path in ("/health/live", "/nothing", "/v1/models"):
        _, headers, _ = get(server, path)
        assert headers["Server"] == "pagedserve", path
    with connect(server) as sock:  # a malformed request line is answered by aiohttp's parser itself
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.") and b"Server: pagedserve\r\n" in answer
    assert b"Python" not in answer and b"aiohttp" not in answer


def test_models_show_paths_relative_to_the_models_root(server):
    status, _, body = get(server, "/v1/models")
    assert status == 200
    assert [m["root"] for m in json.loads(body)["data"]] == [TINY.name]


def test_an_encoded_newline_cannot_forge_an_access_log_line(server):
    status, _, _ = get(server, "/v1/x%0Arequest_id=forged%20status=200%0D")
    assert status == 404
    time.sleep(0.2)
    lines = server.log().splitlines()
    assert not any(line.startswith("request_id=forged") for line in lines)
    assert any("/v1/x\\nrequest_id=forged\\x20status=200\\r status=404" in line for line in lines)


def test_malformed_requests_log_one_warning_without_the_key_or_a_traceback(server):
    """aiohttp quoted the bad header line (the key with it) in a traceback at ERROR, once per request."""
    before = len(server.log().splitlines())
    for _ in range(5):
        with connect(server) as sock:
            sock.sendall(
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + API_KEY.encode()
                + b"\x01\r\n\r\n"
            )
            assert sock.recv(4096).startswith(b"HTTP/1.0 400")
    time.sleep(0.2)
    new = server.log().splitlines()[before:]
    assert API_KEY not in "\n".join(new) and not any("Traceback" in line for line in new)
    assert len([line for line in new if "WARNING aiohttp.server: malformed request (400" in line]) == 1


def test_concurrent_health_generate_calls_all_succeed(server):
    time.sleep(6)  # past health_generate_skip_s (5 s) since the last token: every call runs its probe
    results: list[int] = []

    def call() -> None:
        results.append(get(server, "/health/generate", key=None)[0])

    threads = [threading.Thread(target=call) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [200] * 20


def test_health_details_only_with_a_key(server):
    for path, status in (("/health/ready", "ready"), ("/health", "ready"), ("/health/live", "live")):
        for key in (None, "wrong-key"):
            code, _, body = get(server, path, key=key)
            assert (code, json.loads(body)) == (200, {"status": status}), (path, key)
    for key in (API_KEY, ADMIN_KEY):
        code, _, body = get(server, "/health/ready", key=key)
        assert code == 200 and {"models", "breakers", "memory"} <= set(json.loads(body)), key


def test_metrics_need_an_api_key(server):
    code, _, body = get(server, "/metrics", key=None)
    assert code == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    code, _, body = get(server, "/metrics")
    assert code == 200 and b"pagedserve:num_requests_running" in body


def test_busy_connections_over_the_cap_get_503_and_probes_still_answer(server):
    busy = [connect(server) for _ in range(MAX_CONNECTIONS)]  # each in a request whose body never comes
    try:
        for sock in busy:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
            )
        time.sleep(0.2)
        code, headers, body = get(server, "/v1/models")
        assert code == 503 and headers["Retry-After"] and headers.get("Connection") == "close"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert get(server, "/health/live", key=None)[0] == 200
        code, _, body = get(server, "/health/ready")  # the listener is saturated: out of rotation meanwhile
        assert code == 503 and "listener saturated" in json.loads(body)["reason"]
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.5)
    assert get(server, "/v1/models")[0] == 200
    assert get(server, "/health/ready")[0] == 200


@pytest.fixture(scope="module")
def per_client_server(tmp_path_factory):
    require_models(TINY)
    srv = launch(
        [
            "--model",
            str(TINY),
            "--max-connections-per-client",
            "2",
            "--body-read-timeout",
            "3",
            "--kv-cache-memory",
            "16MiB",
        ],
        tmp_path_factory.mktemp("per-client") / "server.log",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_one_client_address_holds_at_most_its_connections_and_others_are_served(per_client_server):
    srv = per_client_server
    busy = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
    try:
        for sock in busy:  # each in a request whose body never comes
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", srv.port)) as third:
            third.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = read_all(third)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections from 127.0.0.1" in answer
        with socket.create_connection(("127.0.0.1", srv.port), source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(other).startswith(b"HTTP/1.1 200")  # another address is served
        assert srv.get("/health/ready")[0] == 200  # one client is not the listener
    finally:
        for sock in busy:
            sock.close()


def test_idle_connections_at_the_cap_are_closed_oldest_first_for_new_ones(server):
    """1,100 idle keep-alive connections made every new /v1 request 503 while /health stayed 200."""
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in idle:  # one request each, then kept alive, idle
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)
        for _ in range(3):
            assert get(server, "/v1/models")[0] == 200
        assert idle[0].recv(4096) == b""  # the oldest idle one was closed to make room
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_just_opened_is_not_closed_as_idle_at_the_cap(server):
    """Connections past the cap close an idle one, but not one that opened a moment ago and has not sent
    its request yet (it is on its way): 20 concurrent health probes lost one request that way."""
    fresh = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        assert get(server, "/health/live", key=None)[0] == 200  # one more, past the cap: none is idle yet
        for sock in fresh:
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for sock in fresh:
            sock.close()


def test_a_connection_that_never_finishes_its_request_head_is_closed(server):
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
        assert read_all(sock) == b""
        assert HEADER_TIMEOUT_S - 0.5 < time.monotonic() - start < HEADER_TIMEOUT_S + 15


def test_a_body_that_never_arrives_is_408(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '
        )
        start = time.monotonic()
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 408 "), head[:200]
        assert time.monotonic() - start < BODY_TIMEOUT_S + 15
        assert b'"the request body did not arrive within 2 s"' in head


def test_a_client_that_stops_reading_a_stream_releases_its_request(server):
    """4 choices x 1200 tokens with 20 logprobs each is megabytes of events: far more than the socket
    buffers hold, so the server's writes block, time out after WRITE_TIMEOUT_S, and the request is
    aborted well before it could have finished."""
    body = json.dumps(
        {
            "model": TINY.name,
            "prompt": "def f(x):",
            "stream": True,
            "max_tokens": 1200,
            "n": 4,
            "logprobs": 20,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    with connect(server, receive_buffer=4096) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        deadline = time.monotonic() + 240
        while engine_figures(server)["num_requests_running"] == 0:  # admitted
            assert time.monotonic() < deadline
            time.sleep(0.1)
        while any(engine_figures(server).values()):  # never read: aborted by the write timeout
            assert time.monotonic() < deadline, engine_figures(server)
            time.sleep(0.5)
    time.sleep(0.3)
    line = next(x for x in reversed(server.log().splitlines()) if "POST /v1/completions" in x)
    assert "note=client_gone" in line, line
    completion_tokens = int(line.split("completion_tokens=")[1].split()[0])
    assert completion_tokens < 4 * 1200, line
    assert get(server, "/health/ready")[0] == 200


# in process: the error path itself


def _config() -> ServerConfig:
    return ServerConfig(models=(ModelSpec("m", EngineConfig(model="/nowhere/m")),))


async def test_an_error_message_with_a_lone_surrogate_still_renders(aiohttp_client):
    async def handler(request: web.Request) -> web.Response:
        raise InvalidRequestError("bad value \ud800", param="x\udc00")

    app = web.Application(middlewares=[error_middleware])
    app[CONFIG_KEY] = _config()
    app.router.add_get("/", handler)
    client = await aiohttp_client(app)
    response = await client.get("/")
    assert response.status == 400
    error = json.loads(await response.read())["error"]  # ASCII escapes: the same JSON value
    assert (error["message"], error["param"]) == ("bad value \ud800", "x\udc00")


async def test_a_failing_error_renderer_falls_back_to_fixed_json(aiohttp_client, monkeypatch):
    def broken(request, exc):
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    async def handler(request: web.Request) -> web.Response:
        raise ValueError("anything")

    monkeypatch.setattr(errors, "to_response", broken)
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/", handler)
    client = await aiohttp_client(app)
    response = await client.get("/")
    assert response.status == 500 and response.content_type == "application/json"
    assert await response.read() == FALLBACK_BODY
    assert json.loads(FALLBACK_BODY)["error"]["type"] == "internal_server_error"


def test_sse_events_and_log_fields_survive_surrogates_and_newlines():
    assert encode_event({"error": {"message": "\ud800"}}) == b'data: {"error":{"message":"\\ud800"}}\n\n'
    assert encode_event({"text": "é"}) == 'data: {"text":"é"}\n\n'.encode()
    assert escape("/v1/a\nb c\\d\ud800é") == "/v1/a\\nb\\x20c\\\\d\\ud800\\xe9"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (
            b'{"a": "' + b"[" * 100 + b'\\" \\\\"}',
            None,
        ),  # brackets, an escaped quote and backslash inside strings
        (b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}", None),  # 32 levels
        (b'{"a": ' + b"[" * 32 + b"]" * 32 + b"}", "nested more than 32 levels"),
        (b'{"a": ' + b'{"b": [' * 16 + b"]}" * 16 + b"}", "nested more than 32 levels"),  # 33, alternating
        (b"[" * 100_000, "more than 16384 arrays and objects"),
        (b'{"a": "[[[[', "not valid JSON"),  # unterminated: not mistaken for depth
        (b'{"a": [1}', "not valid JSON"),
        (b'{"a": "\\\\ud800"}', None),  # an escaped backslash, then text: no surrogate
        (b'{"a": "\\ud83d\\ude00"}', None),  # a pair
        (b'{"a": ["x", {"b": "\\udc00"}]}', "in a[1].b holds a lone UTF-16 surrogate"),
    ],
)
def test_parse_json_bounds(raw: bytes, fragment: str | None):
    if fragment is None:
        assert isinstance(parse_json(raw), dict)
        return
    with pytest.raises(InvalidRequestError) as info:
        parse_json(raw)
    assert fragment in info.value.message


def test_parse_json_refuses_a_body_of_tiny_lists_at_c_speed():
    """A Python walk of this 2.4 MB body took 10 s of event loop on this machine; generous bound for a
    busy box."""
    raw = json.dumps({"prompt": [[1]] * 600_000}).encode()
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError):
        parse_json(raw)
    assert time.perf_counter() - start < 1.0
