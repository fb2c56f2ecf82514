"""Imports flow one way: service -> resilience -> engine (DESIGN.md). Walk every import with ast."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"engine": 0, "resilience": 1, "service": 2}
NEVER_IN_ENGINE = {"aiohttp", "pybreaker", "tenacity", "prometheus_client"}
TORCH_FREE = ("engine/block_manager.py", "engine/scheduler.py", "engine/sequence.py")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_follow_service_resilience_engine():
    wrong = []
    for package, rank in RANK.items():
        for path in (ROOT / package).rglob("*.py"):
            for name in _imports(path):
                if name in RANK and RANK[name] > rank:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_engine_imports_no_http_or_resilience_library():
    wrong = [f"{p.relative_to(ROOT)} imports {n}" for p in (ROOT / "engine").rglob("*.py")
             for n in _imports(p) & NEVER_IN_ENGINE]
    assert wrong == []


def test_scheduling_core_is_torch_free():
    for rel in TORCH_FREE:
        path = ROOT / rel
        assert path.exists(), rel
        assert "torch" not in _imports(path), rel


def test_no_process_imports_locust():
    # importing locust monkey-patches ssl through gevent: only loadtests/ run it, as their own process
    wrong = [str(p.relative_to(ROOT)) for pkg in ("engine", "resilience", "service", "tests")
             for p in (ROOT / pkg).rglob("*.py") if "locust" in _imports(p)]
    assert wrong == []
