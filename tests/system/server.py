"""A real `python -m service` process on 127.0.0.1 for system tests; killed in a finalizer.

The models (tests/harness.py's SMALL and TINY) are the shipped ones by default; PAGEDSERVE_TEST_SMALL /
PAGEDSERVE_TEST_TINY point elsewhere (e.g. while the shipped ones are being retrained)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import API_KEY, REPO, free_port

START_TIMEOUT_S = 180  # torch import + model load on 2 busy cores


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path
    startup: dict = field(default_factory=dict)  # what a request got while models were loading

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        return _request(f"{self.url}{path}")

    def request(
        self, method: str, path: str, body: dict | None = None, headers: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """Any method, e.g. `DELETE /admin/faults` with the admin key in `headers`."""
        return _request(f"{self.url}{path}", body, headers, method=method)

    def wait_ready(self) -> None:
        """Block until /health/ready is 200 (a `start`ed server); stops the process if it never is."""
        try:
            _wait_ready(self)
        except BaseException:
            self.stop()
            raise

    def post(
        self, path: str, body: dict | bytes, headers: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        return _request(f"{self.url}{path}", body, {"Authorization": f"Bearer {API_KEY}", **(headers or {})})

    def metric(self, name: str, model: str) -> float:
        _, _, body = self.get("/metrics")
        prefix = f'pagedserve:{name}{{model_name="{model}"}} '
        for line in body.decode().splitlines():
            if line.startswith(prefix):
                return float(line[len(prefix) :])
        raise AssertionError(f"{prefix!r} not in /metrics")

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def launch(args: list[str], log_path: Path) -> Server:
    """Start the server and wait until /health/ready is 200; on the way, send one completion while
    the models load and keep its answer (503 with Retry-After expected)."""
    server = start(args, log_path)
    server.wait_ready()
    return server


@contextlib.contextmanager
def running(args: list[str], log_path: Path) -> Iterator[Server]:
    """A launched server, stopped when the block ends (a fixture's `with running(...) as s: yield s`)."""
    server = launch(args, log_path)
    try:
        yield server
    finally:
        server.stop()


def start(args: list[str], log_path: Path) -> Server:
    """Start the server without waiting (several can load side by side); `wait_ready()` later."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("MODEL", "PORT", "API_KEY", "ADMIN_KEY", "HOST", "MAX_GPU_MEMORY_UTILIZATION"):
        env.pop(name, None)
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return Server(process, port, log_path)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"server exited with {server.process.returncode}:\n{server.log()[-3000:]}")
        try:
            status, _, _ = server.get("/health/ready")
        except OSError:
            time.sleep(0.2)
            continue
        if status == 200:
            return
        if not server.startup:
            status, headers, body = _request(
                f"{server.url}/v1/completions", {"prompt": "hi"}, {"Authorization": f"Bearer {API_KEY}"}
            )
            server.startup = {
                "status": status,
                "retry_after": headers.get("Retry-After"),
                "body": json.loads(body),
            }
        time.sleep(0.3)
    raise AssertionError(f"server not ready in {START_TIMEOUT_S} s:\n{server.log()[-3000:]}")


def _request(
    url: str, body: dict | bytes | None = None, headers: dict | None = None, method: str | None = None
) -> tuple[int, dict, bytes]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
