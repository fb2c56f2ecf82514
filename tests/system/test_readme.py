"""Every code block of README.md runs as written against a real server started as `make run` starts
it (the shipped models, default options, plus an admin key for the multi-model block), so the README
cannot rot. Blocks say what they are: ```bash and ```python run, ```text is output shown. The
Quick start's `make run` / `make test` lines are the set-up commands themselves: CI runs `make test`
(`.ci/run`) and the server here is `make run`'s command line."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from models.chat_pairs import defines_function
from tests.harness import REPO, SMALL, TINY, require_models
from tests.system.server import Server, launch

README = REPO / "README.md"
MODELS_DOC = REPO / "docs" / "models.md"  # its supported-models table is generated
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LANGUAGES = ("bash", "python", "text")
ADMIN_KEY = "readme-admin-key"
SETUP_COMMANDS = ("make run", "make test")
BLOCK_TIMEOUT_S = 120
# the README's chat example asks for a function: so many of CHAT_SEEDS seeded answers must parse and define one
CHAT_SEEDS, CHAT_MIN_PARSED = 10, 6


def blocks() -> list[tuple[int, str, str]]:
    """(line, language, code) of every fenced block."""
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def runnable() -> list[tuple[int, str, str]]:
    return [(line, lang, code) for line, lang, code in blocks() if lang != "text"]


def test_every_block_says_what_it_is():
    found = blocks()
    assert len(found) >= 6, found  # the fence pattern still matches the README's blocks
    unlabelled = [line for line, lang, _ in found if lang not in LANGUAGES]
    assert not unlabelled, f"README blocks at lines {unlabelled} need a language among {LANGUAGES}"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    require_models(SMALL, TINY)
    srv = launch(["--admin-key", ADMIN_KEY], tmp_path_factory.mktemp("readme") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _on(code: str, server: Server) -> str:
    return code.replace("localhost:8000", f"127.0.0.1:{server.port}").replace(
        "127.0.0.1:8000", f"127.0.0.1:{server.port}"
    )


def _json_values(out: str) -> list:
    """The JSON documents printed one after the other (curl prints no newline between them)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while (at := _skip_space(out, at)) < len(out):
        value, at = decoder.raw_decode(out, at)
        values.append(value)
    return values


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


@pytest.mark.parametrize(("line", "lang", "code"), runnable(), ids=[f"line{b[0]}" for b in runnable()])
def test_block_runs(server, line, lang, code):
    env = {**os.environ, "ADMIN_KEY": ADMIN_KEY, "PYTHONPATH": str(REPO)}
    if lang == "python":
        result = subprocess.run(
            [sys.executable, "-c", _on(code, server)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip(), f"the block at line {line} printed nothing"
        if "LLM(" in code:  # the offline API prints a completion, then its finish reason
            assert result.stdout.rstrip().endswith(("length", "stop")), result.stdout
        return
    commands = [c for c in code.splitlines() if not c.startswith(SETUP_COMMANDS)]
    if not commands:
        assert all(c.split("#")[0].strip() in SETUP_COMMANDS for c in code.splitlines()), code
        return
    script = "set -euo pipefail\n" + _on("\n".join(commands), server)
    result = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    values = _json_values(result.stdout)
    assert values, f"the block at line {line} printed no JSON: {result.stdout[:500]!r}"
    errors = [v for v in values if isinstance(v, dict) and isinstance(v.get("error"), dict)]  # OpenAI-shaped
    assert not errors, errors


def _chat_example() -> dict:
    """The keyword arguments of the README's first `chat.completions.create(...)` call (literals all)."""
    code = next(code for _, lang, code in blocks() if lang == "python" and "chat.completions.create(" in code)
    call = next(
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "create"
    )
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def test_readme_chat_example_answers_with_a_function_that_parses(server):
    """The shipped primary was trained on chat pairs (models/chat_pairs.py): asked the README's question
    with seeds 0..9 (the README shows one of them), most answers are Python that parses and defines a function."""
    example = _chat_example()
    assert "seed" in example and example.get("temperature", 1.0) > 0, "the example shows one seeded sample"
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=BLOCK_TIMEOUT_S)

    def answer(seed: int) -> str:
        reply = client.chat.completions.create(**{**example, "stream": False, "seed": seed})
        return reply.choices[0].message.content

    with ThreadPoolExecutor(CHAT_SEEDS) as pool:
        answers = list(pool.map(answer, range(CHAT_SEEDS)))
    parsed = [seed for seed, text in enumerate(answers) if defines_function(text)]
    assert len(parsed) >= CHAT_MIN_PARSED, f"{len(parsed)}/{CHAT_SEEDS} parse: {answers}"


def test_supported_models_table_is_the_engines():
    """docs/models.md's "Supported models" table is what engine.executor.models generates from its registry."""
    from engine.executor.models import supported_models_markdown

    table = re.search(
        r"<!-- supported-models: .*? -->\n(.*?)<!-- /supported-models -->", MODELS_DOC.read_text(), re.DOTALL
    )
    assert table is not None, "docs/models.md lost its supported-models markers"
    assert table.group(1) == supported_models_markdown(), (
        f"paste this table into docs/models.md:\n{supported_models_markdown()}"
    )


def test_every_doc_the_code_cites_is_in_the_repository():
    """A path like docs/style.md or benchmarks/results/x.json named in the code or the docs exists
    (globs and templated names aside)."""
    cited = re.compile(
        r"(?<![\w/.-])((?:docs|deploy|benchmarks|loadtests|models)/[\w./-]*\w"
        r"\.(?:md|py|json|sh|conf|yaml|yml))"
    )
    missing = set()
    for path in [
        *REPO.glob("*.md"),
        *REPO.glob("docs/*.md"),
        *(p for d in ("engine", "service", "resilience") for p in (REPO / d).rglob("*.py")),
    ]:
        for name in cited.findall(path.read_text()):
            if not (REPO / name).exists():
                missing.add(f"{path.relative_to(REPO)} -> {name}")
    assert not missing, sorted(missing)
