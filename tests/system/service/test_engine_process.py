"""`--engine-process` on a real server: the engine loop runs in a child of the server process; the
OpenAI client streams from it; a crashed loop and a killed engine process are each rebuilt in a new
child while the server process stays; a stopped server leaves no engine process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.harness import API_KEY, TINY, require_models
from tests.system.server import Server, launch

ADMIN_KEY = "engine-process-admin-key"
MODEL = TINY.name

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_models(TINY)
    server = launch(
        [
            "--model",
            str(TINY),
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--engine-process",
            "--enable-fault-injection",
            "--kv-cache-memory",
            "16MiB",
        ],
        tmp_path_factory.mktemp("engine-process") / "server.log",
    )
    yield server
    engine = _engine_pid(server)
    server.stop()
    assert engine is not None
    _wait_gone(engine)


def _engine_pid(server: Server) -> int | None:
    """The server's live child running the engine (multiprocessing's resource tracker is a child too;
    an engine process that has exited but is not reaped yet has no command line)."""
    children = []
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            children += [int(pid) for pid in (task / "children").read_text().split()]
    engines = []
    for pid in children:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                engines.append(pid)
    assert len(engines) <= 1, engines
    return engines[0] if engines else None


def _wait_gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and b"zombie" not in _state(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.1)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"


def _ready_again(server: Server, old_engine: int) -> int:
    """Wait for /health/ready 200 with a new engine process; its pid."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, _, body = server.get("/health/ready")
        engine = _engine_pid(server)
        if status == 200 and engine not in (None, old_engine):
            return engine
        time.sleep(0.1)
    pytest.fail(f"not ready with a new engine process: {body[:300]!r}")


def _completes(server: Server) -> None:
    status, _, body = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "def f():", "max_tokens": 4, "ignore_eos": True},
        {"Authorization": f"Bearer {API_KEY}"},
    )
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, body


def test_the_openai_client_streams_from_the_engine_process(server):
    assert _engine_pid(server) is not None
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a loop."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 16
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=24,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_crashed_loop_is_rebuilt_in_a_new_engine_process(server):
    """A stream in flight when the loop dies goes on in the new engine process (resilience/router.py's
    continuation): no error, every token once; the same server process serves on."""
    pid, engine = server.process.pid, _engine_pid(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(
        model=MODEL,
        prompt="def f():",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    chunks = [next(iter(stream))]
    status, _, body = server.request(
        "POST", "/admin/faults", {"model": MODEL, "kind": "crash"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status == 200, body
    chunks += list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage.completion_tokens == 400
    _ready_again(server, engine)
    _wait_gone(engine)
    assert server.process.poll() is None and server.process.pid == pid
    metrics = server.get("/metrics")[2].decode()
    assert (
        f'pagedserve:continuations_total{{model_name="{MODEL}",reason="engine_dead",to="{MODEL}"}} 1.0'
        in metrics
    )
    _completes(server)


def test_a_killed_engine_process_is_rebuilt(server):
    engine, deaths = _engine_pid(server), _deaths(server)
    os.kill(engine, signal.SIGKILL)
    _ready_again(server, engine)
    _completes(server)
    assert _deaths(server) == deaths + 1


def _deaths(server: Server) -> float:
    lines = server.get("/metrics")[2].decode().splitlines()
    return next(
        float(line.split()[-1]) for line in lines if line.startswith("pagedserve:engine_deaths_total ")
    )
