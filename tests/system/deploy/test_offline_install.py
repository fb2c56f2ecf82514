"""`make wheelhouse` then `make install-offline` into a fresh venv with the network off: pip gets --no-index
and the wheelhouse alone (no pip config, no PIP_* variables, so neither an index nor another find-links
directory is seen), inside a network namespace of its own (`unshare -n`: loopback only) where the machine
allows one. The installed venv then imports the packages and completes a prompt offline.

Slow (a 300 MB download the first time, then a ~2 min install on 2 cores): `make test-slow`. Its fast
counterpart is the Makefile check below, which runs in `make test`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import REPO

ROOT = REPO
WHEELHOUSE = Path(os.environ.get("PAGEDSERVE_WHEELHOUSE", ROOT / "wheelhouse"))
TINY = ROOT / "models" / "pagedserve-coder-tiny"


def _make_dry_run(target: str, **variables: str) -> str:
    args = ["make", "-n", "-C", str(ROOT), target, *(f"{k}={v}" for k, v in variables.items())]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_install_offline_uses_the_wheelhouse_alone():
    commands = [
        c
        for c in _make_dry_run("install-offline", VENV="/tmp/v", WHEELHOUSE="/tmp/w").splitlines()
        if "pip install" in c
    ]
    assert commands, "install-offline runs no pip install"
    for command in commands:
        assert "--no-index" in command and "--find-links /tmp/w" in command, command
    assert any("torch==2.13.0" in c for c in commands) and any(
        "-e '.[dev,load,clients]'" in c for c in commands
    )
    [download] = [
        c for c in _make_dry_run("wheelhouse", WHEELHOUSE="/tmp/w").splitlines() if "pip download" in c
    ]
    # what install-offline asks for, plus the build backend of the editable install; wheels only
    assert "-d /tmp/w" in download and "--only-binary :all:" in download
    words = download.split()
    assert {"torch==2.13.0", "'.[dev,load,clients]'", "pip", "setuptools"} <= set(
        words[words.index("/tmp/w") + 1 :]
    )
    assert "/wheelhouse/" in (ROOT / ".gitignore").read_text().splitlines()


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment without any pip setting: no index, no extra find-links, no config file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "VIRTUAL_ENV"}
    return {
        **env,
        "PIP_CONFIG_FILE": os.devnull,
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "PIP_NO_CACHE_DIR": "1",
    }


def _network_off() -> list[str]:
    """`unshare -n` where a network namespace can be made (root here), else nothing: --no-index still holds."""
    if (
        shutil.which("unshare")
        and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    ):
        return ["unshare", "-n"]
    return []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_make_install_offline_into_a_fresh_venv_with_the_network_off(tmp_path):
    # the download, with the network (as a user would, where PyPI is reachable); incremental when it exists
    download = subprocess.run(
        ["make", "-C", str(ROOT), "wheelhouse", f"WHEELHOUSE={WHEELHOUSE}"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert download.returncode == 0, download.stdout[-3000:] + download.stderr[-3000:]
    assert list(WHEELHOUSE.glob("torch-2.13.0*.whl")), "no torch 2.13.0 wheel in the wheelhouse"
    assert not [p.name for p in WHEELHOUSE.iterdir() if not p.name.endswith(".whl")]

    offline, env, venv = _network_off(), _offline_env(tmp_path), tmp_path / "venv"
    if offline:
        probe = subprocess.run(
            [*offline, "python3", "-c", "import socket; print(socket.if_nameindex())"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert re.fullmatch(r"\[\(1, 'lo'\)\]\s*", probe.stdout), probe.stdout  # loopback only
    install = subprocess.run(
        [*offline, "make", "-C", str(ROOT), "install-offline", f"VENV={venv}", f"WHEELHOUSE={WHEELHOUSE}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert (venv / ".installed").exists()

    python = str(venv / "bin" / "python")
    check = subprocess.run(
        [
            *offline,
            python,
            "-c",
            "import torch, transformers, aiohttp, pybreaker, tenacity, pytest, kubernetes_validate;"
            "import engine, resilience, service; print(torch.__version__)",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip() == "2.13.0+cpu"
    assert (
        subprocess.run(
            [*offline, python, "-m", "pip", "check"], env=env, capture_output=True, text=True, timeout=120
        ).returncode
        == 0
    )
    generate = subprocess.run(
        [
            *offline,
            str(venv / "bin" / "pagedserve"),
            "generate",
            "def add(a, b):",
            "--model",
            str(TINY),
            "--max-tokens",
            "4",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generate.returncode == 0, generate.stderr[-3000:]
    assert generate.stdout.strip()
