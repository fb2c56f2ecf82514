"""The Dockerfiles, the compose file and the Prometheus config, checked without a Docker engine:
parsed, and `docker compose config` where the docker CLI has its compose plugin."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to parse the compose file")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy/docker-compose.yml"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def _args(instructions: list[tuple[str, str]], name: str) -> list[str]:
    return [args for op, args in instructions if op == name]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_has_what_a_replica_image_needs(name):
    ins = _instructions(ROOT / name)
    runs = " ".join(_args(ins, "RUN"))
    assert re.search(r"pip install --index-url \S+ torch==\$\{TORCH_VERSION\}", runs)
    assert _args(ins, "ARG").count("TORCH_VERSION=2.13.0") == 1
    assert "pip install -e ." in runs  # the CLI finds the shipped models beside the packages, in /app
    assert "COPY models/ models/" in [f"COPY {a}" for a in _args(ins, "COPY")]
    assert _args(ins, "EXPOSE") == ["8000"]
    env = " ".join(_args(ins, "ENV"))
    assert 'MODEL=""' in env  # empty: the shipped primary with its fallback
    assert "MAX_GPU_MEMORY_UTILIZATION=" in env
    assert "HF_HUB_OFFLINE=1" in env
    users = _args(ins, "USER")
    assert users and users[-1] not in ("root", "0")
    [healthcheck] = _args(ins, "HEALTHCHECK")
    assert "/health/live" in healthcheck and "--start-period=" in healthcheck
    assert _args(ins, "CMD") == ['["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]']
    # the user switch comes after every install step, so the image runs unprivileged
    ops = [op for op, _ in ins]
    assert max(i for i, op in enumerate(ops) if op == "RUN") < ops.index("USER")


def test_gpu_image_is_cuda_based_and_cpu_image_uses_the_cpu_index():
    gpu = _instructions(ROOT / "Dockerfile")
    assert _args(gpu, "FROM") == ["nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04"]
    assert any(a.startswith("TORCH_INDEX=https://download.pytorch.org/whl/cu") for a in _args(gpu, "ARG"))
    cpu = _instructions(ROOT / "Dockerfile.cpu")
    assert _args(cpu, "FROM") == ["python:3.11-slim"]
    assert "--index-url https://download.pytorch.org/whl/cpu torch==" in " ".join(_args(cpu, "RUN"))


def test_dockerignore_keeps_the_build_context_small():
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "tests", "loadtests", "benchmarks"} <= ignored
    # what the Dockerfiles COPY must stay in the context
    assert not {"models", "engine", "service", "resilience", "pyproject.toml", "README.md"} & ignored


def test_compose_runs_two_replicas_behind_nginx_and_prometheus(compose):
    services = compose["services"]
    assert set(services) == {"replica-1", "replica-2", "nginx", "prometheus"}
    for name in ("replica-1", "replica-2"):
        replica = services[name]
        assert replica["build"] == {"context": "..", "dockerfile": "Dockerfile"}
        assert replica["expose"] == ["8000"]
        assert set(replica["environment"]) == {"MODEL", "MAX_GPU_MEMORY_UTILIZATION"}
        assert "/health/live" in " ".join(replica["healthcheck"]["test"])
        assert replica["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    nginx = services["nginx"]
    assert nginx["ports"] == ["8080:8080"]
    assert "./nginx/compose.conf:/etc/nginx/pagedserve.conf:ro" in nginx["volumes"]
    assert "/health/live" in " ".join(nginx["healthcheck"]["test"])
    assert set(nginx["depends_on"]) == {"replica-1", "replica-2"}
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


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


def _has_compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _has_compose_plugin(), reason="docker CLI with the compose plugin is not installed")
def test_docker_compose_config_accepts_the_file():
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
