"""Real processes for deploy tests: `pagedserve serve` replicas and an nginx rendered by
`deploy.nginx.render`, all on free 127.0.0.1 ports, each in its own session so a stop never misses
a child. Every start is registered with a `Reaper`, whose `stop_all()` a fixture finalizer calls,
so nothing outlives a failed test.

The models (tests/harness.py's SMALL and TINY) are the shipped ones by default; PAGEDSERVE_TEST_SMALL /
PAGEDSERVE_TEST_TINY point elsewhere (e.g. a throwaway random model while the shipped ones are being trained)."""

from __future__ import annotations

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
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from deploy.nginx.render import NginxOptions, render
from tests.harness import REPO, free_port

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
READY_TIMEOUT_S = 180.0  # torch import + model load + warm-up on 2 busy cores
STOP_TIMEOUT_S = 20.0  # SIGTERM drains for the replica's --shutdown-timeout (10 s default) + slack
# a replica reads these from the environment; the test's own flags must be the only configuration
_SERVER_ENV = ("MODEL", "PORT", "HOST", "API_KEY", "ADMIN_KEY", "MAX_GPU_MEMORY_UTILIZATION")
_GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def world_readable_dir(prefix: str) -> Path:
    """A fresh 0755 directory under /tmp: nginx workers run as `nobody` when started as root, and
    pytest's tmp_path has 0700 parents."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


def http(
    method: str, url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    """One blocking request; (status, headers, body). Connection errors raise OSError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class Reaper:
    """Every process a test started; `stop_all()` ends the ones still running (SIGKILL to the group
    after a grace period), in reverse start order."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def add(self, process: subprocess.Popen) -> subprocess.Popen:
        self.processes.append(process)
        return process

    def stop_all(self, grace_s: float = 10.0) -> None:
        running = [p for p in reversed(self.processes) if p.poll() is None]
        for process in running:  # all signalled first: they drain and exit in parallel
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in running:
            stop_process(process, signal.SIGTERM, max(0.1, deadline - time.monotonic()))
        self.processes.clear()


def stop_process(process: subprocess.Popen, sig: int, timeout_s: float) -> int:
    """Send `sig`; after `timeout_s` SIGKILL the whole process group. The exit status."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(
                process.pid, signal.SIGKILL
            )  # its own session: the group is the process and its children
            process.wait(10)
    return process.returncode


@dataclass
class Replica:
    """One `pagedserve serve` process on a fixed port, restartable on the same port."""

    name: str
    port: int
    args: list[str]  # everything but --host/--port
    log_path: Path
    reaper: Reaper
    process: subprocess.Popen | None = None
    num_starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Launch (not waiting for readiness); the log of every start goes to the same file."""
        if self.is_running:
            raise RuntimeError(f"replica {self.name} is already running (pid {self.process.pid})")
        env = {k: v for k, v in os.environ.items() if k not in _SERVER_ENV}
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")  # OpenMP: the server sets it (engine/config.py)
        self.num_starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start #{self.num_starts} of {self.name} ===\n".encode())
            log.flush()
            cmd = [
                sys.executable,
                "-m",
                "service",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *self.args,
            ]
            self.process = self.reaper.add(
                subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def is_ready(self) -> bool:
        try:
            return http("GET", f"{self.url}/health/ready", timeout=2)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_running:
                raise AssertionError(
                    f"replica {self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.2)
        raise AssertionError(f"replica {self.name} not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def kill(self) -> int:
        """SIGKILL: no drain, no cleanup; streams in flight break."""
        return stop_process(self.process, signal.SIGKILL, 10)

    def terminate(self) -> None:
        """SIGTERM without waiting: the replica drains while the caller watches."""
        os.kill(self.process.pid, signal.SIGTERM)

    def wait_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return self.process.wait(timeout_s)

    def stop(self) -> int | None:
        return None if self.process is None else stop_process(self.process, signal.SIGTERM, STOP_TIMEOUT_S)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def num_served(self) -> int:
        """Generation requests this process answered 200 (its `pagedserve:http_requests` counter)."""
        _, _, body = http("GET", f"{self.url}/metrics", timeout=5)
        total = 0
        for line in body.decode().splitlines():
            match = _HTTP_REQUESTS.match(line)
            if match and match["route"] in _GENERATION_ROUTES and match["status"] == "200":
                total += int(float(match["value"]))
        return total


_HTTP_REQUESTS = re.compile(
    r'^pagedserve:http_requests_total\{(?=[^}]*route="(?P<route>[^"]*)")'
    r'(?=[^}]*status="(?P<status>\d+)")[^}]*\} (?P<value>\S+)$'
)


def start_and_wait(replicas: list[Replica], timeout_s: float = READY_TIMEOUT_S) -> float:
    """Start every replica that is not running, all at once, and wait until each is ready; seconds taken."""
    started = time.monotonic()
    for replica in replicas:
        if not replica.is_running:
            replica.start()
    for replica in replicas:
        replica.wait_ready(max(1.0, timeout_s - (time.monotonic() - started)))
    return time.monotonic() - started


@dataclass
class AccessEntry:
    """One line of the nginx access log (the template's `pagedserve` log_format)."""

    request_id: str
    path: str
    status: int
    upstreams: list[str]  # every replica tried, in order; the last one answered
    upstream_statuses: list[str]


_ACCESS = re.compile(
    r'"(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d+) \d+ rid=(?P<rid>\S+) '
    r"upstream=(?P<upstream>.*?) upstream_status=(?P<ustatus>.*?) rt="
)


@dataclass
class Nginx:
    """nginx in the foreground (`-g 'daemon off;'`) with the rendered config, under its own prefix."""

    primaries: list[str]
    backups: list[str]
    options: NginxOptions
    reaper: Reaper
    prefix: Path = field(default_factory=lambda: world_readable_dir("pagedserve-nginx-"))
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        if NGINX is None:
            raise RuntimeError("nginx is not installed")
        conf = self.prefix / "nginx.conf"
        conf.write_text(
            render(self.primaries, self.backups, f"127.0.0.1:{self.port}", str(self.prefix), self.options)
        )
        cmd = [
            NGINX,
            "-p",
            str(self.prefix),
            "-e",
            str(self.prefix / "error.log"),
            "-c",
            str(conf),
            "-g",
            "daemon off;",
        ]
        self.process = self.reaper.add(
            subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}:\n{self.error_log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(
            f"nginx did not listen on {self.url} within {timeout_s:.0f} s:\n{self.error_log()}"
        )

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM, 5)  # SIGTERM: fast shutdown of master and workers

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.prefix, ignore_errors=True)

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def access_log(self) -> dict[str, AccessEntry]:
        """Entries by request id (the client's X-Request-ID)."""
        path = self.prefix / "access.log"
        entries = {}
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            match = _ACCESS.search(line)
            if match:
                entries[match["rid"]] = AccessEntry(
                    match["rid"],
                    match["path"],
                    int(match["status"]),
                    [u.strip() for u in re.split(r"[,:] (?=\d|-|unix)", match["upstream"])],
                    [s.strip() for s in re.split(r"[,:] ", match["ustatus"])],
                )
        return entries
