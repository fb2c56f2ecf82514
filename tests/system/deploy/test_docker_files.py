"""The Dockerfiles, the compose file, the Prometheus config and the image's helper scripts, checked without a
Docker engine: Dockerfiles parsed into stages and instructions (what each stage installs, the order of
dependency and source layers, what CMD runs), the compose file loaded as YAML, the alert rules run through
`promtool test rules` and the compose file through `docker compose config` where those tools exist."""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.harness import REPO

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to parse the compose file")

ROOT = REPO
COMPOSE = ROOT / "deploy/docker-compose.yml"
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
SOURCE_DIRS = ("engine/", "resilience/", "service/")
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|libc6-dev)\b")
DRAIN_CLEANUP_S = 20  # after --shutdown-timeout: 5 s cancelling what is left + ~15 s stopping the engines


# --- a small Dockerfile parser ------------------------------------------------------------------------


@dataclass
class Instruction:
    op: str  # upper case
    args: str  # continuation lines joined

    def words(self) -> list[str]:
        return json.loads(self.args) if self.args.startswith("[") else shlex.split(self.args)

    def flags(self) -> dict[str, str]:
        """`--from=kernel`, `--mount=...`: the options before the operands."""
        return dict(w[2:].partition("=")[::2] for w in self.words() if w.startswith("--"))

    def operands(self) -> list[str]:
        return [w for w in self.words() if not w.startswith("--")]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def ops(self, op: str) -> list[Instruction]:
        return [i for i in self.instructions if i.op == op]

    def index(self, predicate) -> int:
        return next(n for n, i in enumerate(self.instructions) if predicate(i))


@dataclass
class Dockerfile:
    global_args: list[str]
    stages: list[Stage]

    @property
    def runtime(self) -> Stage:
        return self.stages[-1]


def parse_dockerfile(path: Path) -> Dockerfile:
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\s*\\\n\s*", " ", "\n".join(lines))
    global_args: list[str] = []
    stages: list[Stage] = []
    for match in re.finditer(r"^\s*(\w+)\s+(.*?)\s*$", text, re.M):
        ins = Instruction(match.group(1).upper(), match.group(2))
        if ins.op == "FROM":
            base, _, name = ins.args.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip() or None))
        elif stages:
            stages[-1].instructions.append(ins)
        elif ins.op == "ARG":
            global_args.append(ins.args)
    return Dockerfile(global_args, stages)


@pytest.fixture(scope="module", params=DOCKERFILES)
def dockerfile(request) -> tuple[str, Dockerfile]:
    return request.param, parse_dockerfile(ROOT / request.param)


def _copies_sources(ins: Instruction) -> bool:
    return ins.op == "COPY" and any(s in ins.operands()[:-1] for s in SOURCE_DIRS)


# --- Dockerfiles ----------------------------------------------------------------------------------------


def test_base_images_take_a_digest_argument(dockerfile):
    # digests cannot be looked up here: the tag stays, and an ARG (empty by default) appends @sha256:...
    _, df = dockerfile
    for stage in df.stages:
        digest_args = re.findall(r"\$\{(\w+_DIGEST)\}", stage.base)
        assert len(digest_args) == 1, stage.base
        assert f'{digest_args[0]}=""' in df.global_args


def test_dependencies_are_installed_before_the_sources_are_copied(dockerfile):
    _, df = dockerfile
    stage = df.runtime
    torch_layer = stage.index(lambda i: i.op == "RUN" and "torch==" in i.args)
    pyproject = stage.index(lambda i: i.op == "COPY" and i.operands()[:-1] == ["pyproject.toml"])
    deps_layer = stage.index(lambda i: i.op == "RUN" and "pip install -r /tmp/requirements.txt" in i.args)
    first_source = stage.index(_copies_sources)
    assert torch_layer < pyproject < deps_layer < first_source
    # nothing but pyproject.toml is copied before the dependency layers: a code edit invalidates none of them
    early_copies = [i.operands()[:-1] for i in stage.instructions[:deps_layer] if i.op == "COPY"]
    assert early_copies == [["pyproject.toml"]]
    # after the sources: the project alone, its dependencies already there
    [project_install] = [i for i in stage.ops("RUN") if "pip install" in i.args and "-e ." in i.args]
    assert "--no-deps" in project_install.args
    assert stage.instructions.index(project_install) > first_source


def test_the_requirements_snippet_lists_the_project_dependencies(dockerfile):
    _, df = dockerfile
    [run] = [i for i in df.runtime.ops("RUN") if "pip install -r" in i.args]
    snippet = re.search(r'python -c "(.*?)" >', run.args).group(1)  # as the shell passes it: \\n stays
    out = subprocess.run(
        [sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()
    assert out == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in out


def test_torch_comes_from_the_right_index(dockerfile):
    name, df = dockerfile
    [torch_run] = [i for i in df.runtime.ops("RUN") if "torch==${TORCH_VERSION}" in i.args]
    index = "https://download.pytorch.org/whl/cpu" if name == "Dockerfile.cpu" else "${TORCH_INDEX}"
    assert f"--index-url {index} torch==" in torch_run.args
    assert any(a == "TORCH_VERSION=2.13.0" for a in (i.args for i in df.runtime.ops("ARG")))


def test_runtime_image_has_no_compiler(dockerfile):
    _, df = dockerfile
    for ins in df.runtime.ops("RUN"):
        assert not COMPILERS.search(ins.args), ins.args


def test_cpu_kernel_is_built_in_a_build_stage_with_the_engines_flags():
    """Every source engine/kernels/cpu.py compiles, in its order and with its flags (but -march), and the
    checksum prebuilt-kernel-cc compares over the same sources."""
    df = parse_dockerfile(ROOT / "Dockerfile.cpu")
    assert [s.name for s in df.stages] == ["kernel", "runtime"]
    kernel = df.stages[0]
    [build] = [i for i in kernel.ops("RUN") if "paged_attention.c" in i.args]
    words = shlex.split(build.args)
    gcc = words.index("gcc")
    first = words.index("/src/paged_attention.c", gcc)
    assert words[gcc + 1 : first] == [
        f if f != "-march=native" else "-march=${KERNEL_MARCH}" for f in _engine_cflags()
    ]
    sources = [f"/src/{name}" for name in _engine_sources()]
    assert words[first : first + len(sources)] == sources
    summed = words.index("cat", first)
    assert (
        words[summed + 1 : summed + 1 + len(sources)] == sources
        and words[summed + 1 + len(sources)] == "/src/*.h"
    )
    assert any(i.operands() == ["engine/kernels/csrc/", "/src/"] for i in kernel.ops("COPY"))
    runtime = df.runtime
    assert any(i.flags().get("from") == "kernel" for i in runtime.ops("COPY"))
    assert "CC=/opt/pagedserve/prebuilt-kernel-cc" in " ".join(i.args for i in runtime.ops("ENV"))


def _engine_sources() -> list[str]:
    from engine.kernels.cpu import SOURCES

    return [path.name for path in SOURCES]


def _engine_cflags() -> list[str]:
    tree = ast.parse((ROOT / "engine/kernels/cpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CFLAGS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("engine/kernels/cpu.py has no CFLAGS")


def _env(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage.ops("ENV"):
        env.update(dict(w.split("=", 1) for w in shlex.split(ins.args)))
    return env


def test_cmd_honours_host_port_and_shutdown_timeout(dockerfile):
    _, df = dockerfile
    stage = df.runtime
    [cmd] = stage.ops("CMD")
    argv = json.loads(cmd.args)  # exec form: no shell stays as PID 1 / between init and the server
    assert argv[:2] == ["sh", "-c"] and argv[2].startswith("exec pagedserve serve ")
    assert "--host" not in argv[2] and "--port" not in argv[2]  # the server reads HOST and PORT itself
    assert '--shutdown-timeout "$SHUTDOWN_TIMEOUT"' in argv[2]
    env = _env(stage)
    assert (env["HOST"], env["PORT"]) == ("0.0.0.0", "8000")
    assert [i.args for i in stage.ops("EXPOSE")] == [env["PORT"]]
    assert float(env["SHUTDOWN_TIMEOUT"]) > 0
    assert {"MODEL": "", "HF_HUB_OFFLINE": "1"}.items() <= env.items()
    assert "MAX_GPU_MEMORY_UTILIZATION" in env
    assert [i.args for i in stage.ops("STOPSIGNAL")] == ["SIGTERM"]


def test_healthcheck_runs_the_restarting_check(dockerfile):
    _, df = dockerfile
    stage = df.runtime
    [healthcheck] = stage.ops("HEALTHCHECK")
    options, _, command = healthcheck.args.partition(" CMD ")
    assert json.loads(command) == ["python", "/opt/pagedserve/healthcheck.py"]
    start_period = re.search(r"--start-period=(\d+)s", options).group(1)
    assert _env(stage)["HEALTHCHECK_START_PERIOD"] == start_period
    assert any(
        "deploy/image/healthcheck.py" in i.operands()[:-1] and i.operands()[-1] == "/opt/pagedserve/"
        for i in stage.ops("COPY")
    )


def test_runs_unprivileged_after_every_install(dockerfile):
    _, df = dockerfile
    ops = [i.op for i in df.runtime.instructions]
    users = df.runtime.ops("USER")
    assert users and users[-1].args not in ("root", "0")
    assert max(n for n, op in enumerate(ops) if op == "RUN") < ops.index("USER")
    assert any(i.operands() == ["models/", "models/"] for i in df.runtime.ops("COPY"))


def test_gpu_image_is_cuda_based():
    df = parse_dockerfile(ROOT / "Dockerfile")
    assert df.runtime.base == "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04${CUDA_DIGEST}"
    assert any(
        a.startswith("TORCH_INDEX=https://download.pytorch.org/whl/cu")
        for a in (i.args for i in df.runtime.ops("ARG"))
    )


# --- .dockerignore ----------------------------------------------------------------------------------------


def _is_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last pattern matching the path or one of its parents wins."""
    ignored = False
    parts = path.rstrip("/").split("/")
    for pattern in patterns:
        negated, pattern = pattern.startswith("!"), pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            ignored = not negated
    return ignored


def test_dockerignore_keeps_the_context_small_and_what_is_copied():
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for path in (".git", ".venv", "tests", "loadtests", "benchmarks", "deploy/nginx/compose.conf"):
        assert _is_ignored(path, patterns), path
    for name in DOCKERFILES:
        for stage in parse_dockerfile(ROOT / name).stages:
            for ins in stage.ops("COPY"):
                if "from" in ins.flags():
                    continue
                for source in ins.operands()[:-1]:
                    assert (ROOT / source).exists(), source
                    assert not _is_ignored(source, patterns), f"{name}: COPY {source} is in .dockerignore"


# --- the image's helper scripts -----------------------------------------------------------------------------


def test_prebuilt_kernel_cc_hands_over_the_built_library(tmp_path):
    from engine.kernels.cpu import HEADERS, SOURCES

    lib = tmp_path / "kernels.so"
    lib.write_bytes(b"\x7fELF prebuilt")
    summed = b"".join(p.read_bytes() for p in (*SOURCES, *sorted(HEADERS)))
    (tmp_path / "kernels.so.source.sha256").write_text(hashlib.sha256(summed).hexdigest() + "\n")
    cc = ROOT / "deploy/image/prebuilt-kernel-cc"
    env = {**os.environ, "PAGEDSERVE_PREBUILT_KERNEL": str(lib)}
    out = tmp_path / "out.so"
    # the command line engine/kernels/cpu.py runs
    argv = [str(cc), *_engine_cflags(), *map(str, SOURCES), "-o", str(out), "-lm"]
    assert subprocess.run(argv, env=env, capture_output=True, timeout=10).returncode == 0
    assert out.read_bytes() == lib.read_bytes()
    edited = tmp_path / "csrc"
    edited.mkdir()
    for path in (*SOURCES, *HEADERS):  # one source edited, the rest as they are
        (edited / path.name).write_bytes(
            path.read_bytes() + (b"\n// edited\n" if path == SOURCES[-1] else b"")
        )
    result = subprocess.run(
        [str(cc), *(str(edited / p.name) for p in SOURCES), "-o", str(tmp_path / "x.so")],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 1 and "are not the sources" in result.stderr
    assert not (tmp_path / "x.so").exists()


@pytest.fixture
def healthcheck(tmp_path, monkeypatch):
    """deploy/image/healthcheck.py loaded as a module, its state file under tmp_path, os.kill recorded."""
    spec = importlib.util.spec_from_file_location(
        "pagedserve_healthcheck", ROOT / "deploy/image/healthcheck.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "COUNTER", tmp_path / "failures")
    monkeypatch.setattr(module, "START_PERIOD_S", 0.0)
    monkeypatch.setattr(module, "KILL_AFTER", 3)
    module.kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: module.kills.append((pid, sig)))  # never a real signal
    return module


class _Live(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health/live" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def live_server():
    server = HTTPServer(("127.0.0.1", 0), _Live)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_healthcheck_passes_on_a_live_replica_and_resets_the_count(healthcheck, live_server, monkeypatch):
    monkeypatch.setenv("PORT", str(live_server.server_address[1]))
    healthcheck.COUNTER.write_text(f"{healthcheck.init_start_ticks()} 2")
    assert healthcheck.main() == 0
    assert healthcheck.read_failures(healthcheck.init_start_ticks()) == 0
    assert healthcheck.kills == []


def test_healthcheck_stops_the_replica_after_failures_in_a_row(healthcheck, live_server, monkeypatch):
    _Live.status = 503  # a dead engine: /health/live answers 503
    try:
        monkeypatch.setenv("PORT", str(live_server.server_address[1]))
        codes = [healthcheck.main() for _ in range(6)]
    finally:
        _Live.status = 200
    assert codes == [1] * 6
    # SIGTERM to the init (passed on: the replica drains and exits) at the 3rd to 5th failure, then SIGKILL
    # to every process but PID 1 when the replica ignored it
    assert healthcheck.kills == [(1, signal.SIGTERM)] * 3 + [(-1, signal.SIGKILL)]


def test_healthcheck_counts_nothing_while_loading_or_for_an_earlier_run(healthcheck, monkeypatch):
    monkeypatch.setenv("PORT", "1")  # nothing listens: refused
    monkeypatch.setattr(healthcheck, "START_PERIOD_S", 1e12)
    assert [healthcheck.main() for _ in range(5)] == [1] * 5
    assert healthcheck.kills == [] and not healthcheck.COUNTER.exists()
    monkeypatch.setattr(healthcheck, "START_PERIOD_S", 0.0)
    healthcheck.COUNTER.write_text(
        f"{healthcheck.init_start_ticks() + 1} 9"
    )  # left by the run before a restart
    assert healthcheck.main() == 1
    assert healthcheck.read_failures(healthcheck.init_start_ticks()) == 1 and healthcheck.kills == []


def test_the_image_command_serves_on_host_and_port_from_the_environment(tmp_path):
    # the CPU image's CMD and HEALTHCHECK, run here as the image would: the environment names the address
    # and the drain, the liveness check passes on the running replica, SIGTERM ends it within the grace
    df = parse_dockerfile(ROOT / "Dockerfile.cpu")
    argv = json.loads(df.runtime.ops("CMD")[0].args)
    tiny = ROOT / "models/pagedserve-coder-tiny"
    if not (tiny / "config.json").is_file():
        pytest.skip("the shipped tiny model is missing (make models)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        k: v for k, v in os.environ.items() if k not in ("API_KEY", "ADMIN_KEY", "MAX_GPU_MEMORY_UTILIZATION")
    }
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        HOST="127.0.0.1",
        PORT=str(port),
        SHUTDOWN_TIMEOUT="3",
        MODEL=str(tiny),
        HF_HUB_OFFLINE="1",
        HEALTHCHECK_STATE=str(tmp_path / "failures"),
        HEALTHCHECK_START_PERIOD="0",
    )
    log = (tmp_path / "replica.log").open("wb")
    process = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not _answers(f"http://127.0.0.1:{port}/health/ready"):
            assert process.poll() is None, (tmp_path / "replica.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the replica did not turn ready in 180 s"
            time.sleep(0.2)
        check = subprocess.run(
            [sys.executable, str(ROOT / "deploy/image/healthcheck.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)  # exec: the shell is gone, the server gets it
        assert process.wait(timeout=3 + DRAIN_CLEANUP_S) == 0
        stop_s = time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()
    assert stop_s < 3 + DRAIN_CLEANUP_S


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# --- compose ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _seconds(duration: str) -> float:
    """A compose duration: 1m30s, 50s, 500ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


REPLICAS = ("replica-1", "replica-2")


def test_compose_runs_two_replicas_behind_nginx_and_prometheus(compose):
    services = compose["services"]
    assert set(services) == {*REPLICAS, "nginx", "prometheus", "grafana"}
    for name in REPLICAS:
        replica = services[name]
        assert replica["build"] == {"context": "..", "dockerfile": "Dockerfile"}
        assert replica["expose"] == ["8000"] and "ports" not in replica  # reached through nginx only
        assert replica["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    nginx = services["nginx"]
    assert "./nginx/compose.conf:/etc/nginx/pagedserve.conf:ro" in nginx["volumes"]
    assert set(nginx["depends_on"]) == set(REPLICAS)


def test_every_service_restarts_and_has_a_healthcheck(compose):
    for name, service in compose["services"].items():
        assert service["restart"] in ("always", "unless-stopped"), name
        assert service["init"] is True, name
        check = service["healthcheck"]
        assert check["test"][0] == "CMD" and check["retries"] >= 1, name
    for name in REPLICAS:
        check = compose["services"][name]["healthcheck"]
        assert check["test"] == ["CMD", "python", "/opt/pagedserve/healthcheck.py"]  # probes /health/live
        env = compose["services"][name]["environment"]
        assert _seconds(check["start_period"]) == float(env["HEALTHCHECK_START_PERIOD"])


def test_keys_are_required_and_ports_bound_to_loopback(compose):
    for name in REPLICAS:
        env = compose["services"][name]["environment"]
        for key in ("API_KEY", "ADMIN_KEY"):
            assert re.fullmatch(rf"\$\{{{key}:\?[^}}]+\}}", env[key]), env[key]  # compose refuses to start
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_grace_period_covers_the_drain(compose):
    for name in REPLICAS:
        replica = compose["services"][name]
        shutdown_s = float(replica["environment"]["SHUTDOWN_TIMEOUT"])
        assert _seconds(replica["stop_grace_period"]) >= shutdown_s + DRAIN_CLEANUP_S


def test_mounted_files_exist_and_name_the_compose_replicas(compose):
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            assert (COMPOSE.parent / volume.split(":")[0]).is_file(), volume
    nginx_conf = (ROOT / "deploy/nginx/compose.conf").read_text()
    assert re.findall(r"^\s*server (\S+) ", nginx_conf, re.M) == ["replica-1:8000", "replica-2:8000"]
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["replica-1:8000", "replica-2:8000"]
    assert prometheus["rule_files"] == ["alerts.yml"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]


def test_alert_rules_cover_the_failure_modes_with_exported_metrics():
    rules = [
        r for g in yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())["groups"] for r in g["rules"]
    ]
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert {
        "PagedserveReplicaDown",
        "PagedserveLeakSuspected",
        "PagedserveBreakerOpen",
        "PagedserveDegradedShareHigh",
        "PagedserveErrorRateHigh",
    } <= alerts
    recorded = {r["record"] for r in rules if "record" in r}
    metrics_source = (ROOT / "service/metrics.py").read_text()
    for rule in rules:
        for metric in re.findall(r"pagedserve:[a-z_]+(?::[a-z0-9_]+)?", rule["expr"]):
            if metric in recorded:
                continue
            base = metric.removeprefix("pagedserve:").removesuffix("_total")
            # a Counter("pagedserve:x") is exported as pagedserve:x_total; families by their full name
            assert f'{{PREFIX}}{base}"' in metrics_source, f"{metric} is not exported by service/metrics.py"


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_promtool_accepts_the_config_and_the_alerts_fire():
    for argv in (["check", "config", "deploy/prometheus.yml"], ["test", "rules", "deploy/alerts_test.yml"]):
        result = subprocess.run([PROMTOOL, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def _compose_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        return "the docker CLI has no compose plugin"
    return None


@pytest.mark.skipif(_compose_unavailable() is not None, reason=str(_compose_unavailable()))
def test_docker_compose_config_accepts_the_file_and_requires_the_keys():
    env = {**os.environ, "API_KEY": "k", "ADMIN_KEY": "a"}
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    bare = {k: v for k, v in env.items() if k not in ("API_KEY", "ADMIN_KEY")}
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        env=bare,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "set API_KEY" in result.stderr + result.stdout
