"""Imports flow one way: service -> resilience -> engine, and inside engine/ from the frontend down
through its wings to the torch-free root seam; no import circle anywhere, function-level imports
included. Every import is walked with ast."""

import ast
from pathlib import Path

from tests.harness import REPO

ROOT = REPO
RANK = {"engine": 0, "resilience": 1, "service": 2}
NEVER_IN_ENGINE = {"aiohttp", "pybreaker", "tenacity", "prometheus_client"}
# engine/'s wings, each importing only lower ones (and the root seam, rank 0) and itself
WINGS = {"core": 1, "kernels": 1, "structured": 2, "executor": 3, "frontend": 4}
ROOT_SEAM = {
    "__init__",
    "client",
    "config",
    "errors",
    "fair_share",
    "faults",
    "outputs",
    "sampling_params",
    "stats",
}
PACKAGES = ("engine", "resilience", "service")


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
    wrong = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in (ROOT / "engine").rglob("*.py")
        for n in _imports(p) & NEVER_IN_ENGINE
    ]
    assert wrong == []


def test_the_root_seam_and_core_are_torch_free():
    paths = [ROOT / "engine" / f"{name}.py" for name in ROOT_SEAM] + sorted(
        (ROOT / "engine" / "core").glob("*.py")
    )
    assert [str(p.relative_to(ROOT)) for p in paths if "torch" in _imports(p)] == []


def test_engine_has_no_module_outside_a_wing_but_the_root_seam():
    assert {p.stem for p in (ROOT / "engine").glob("*.py")} == ROOT_SEAM
    assert {p.name for p in (ROOT / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        WINGS
    )


def test_the_openai_surface_and_model_management_stay_apart():
    """service/api/ (parse, generate, format) and service/models/ (registry, admin, supervision) each use
    the server's root modules, never each other: the app (service/app.py, routes.py) wires them."""
    wrong = [
        f"{_module_name(path)} imports {target}"
        for side, other in (("api", "models"), ("models", "api"))
        for path in (ROOT / "service" / side).rglob("*.py")
        for target in _project_imports(path)
        if target.startswith(f"service.{other}")
    ]
    assert wrong == []


def test_engine_wings_import_only_downward():
    """The package's façade (engine/__init__.py, lazy) and type-only imports are exempt."""
    wrong = []
    for path in (ROOT / "engine").rglob("*.py"):
        name = _module_name(path)
        if name == "engine":
            continue
        for target in _project_imports(path, include_type_only=False):
            if target.startswith("engine.") and _wing_rank(target) > _wing_rank(name):
                wrong.append(f"{name} imports {target}")
    assert wrong == []


def test_no_import_circle_in_the_project():
    graph = {
        _module_name(p): _project_imports(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
    }
    assert find_circle(graph) is None


def test_the_circle_finder_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module -> modules it imports) as a path back to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _wing_rank(module: str) -> int:
    parts = module.split(".")
    return WINGS.get(parts[1], 0) if len(parts) > 1 else 0


def _project_imports(path: Path, include_type_only: bool = True) -> set[str]:
    """The project modules `path` imports, wherever the import stands (a function's too); `from p
    import m` counts module p.m when m is a module, else p."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = (
        set()
        if include_type_only
        else {id(n) for node in ast.walk(tree) if _is_type_checking(node) for n in ast.walk(node)}
    )
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(_module_of(f"{node.module}.{alias.name}") or node.module for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES and _module_of(name)}


def _module_of(name: str) -> str | None:
    path = ROOT.joinpath(*name.split("."))
    return name if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else None


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def test_no_process_imports_locust():
    # importing locust monkey-patches ssl through gevent: only loadtests/ run it, as their own process
    wrong = [
        str(p.relative_to(ROOT))
        for pkg in ("engine", "resilience", "service", "tests")
        for p in (ROOT / pkg).rglob("*.py")
        if "locust" in _imports(p)
    ]
    assert wrong == []
