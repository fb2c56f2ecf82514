"""Fixtures shared by every tier: random-weight models of each supported family, made once per test
session; the directory that measured figures go to; and in-process apps over real tiny engines (`start`,
`sdk`, used by tests/integration and by one test of tests/system/service/test_server_api.py).
Importable helpers are in tests/harness.py, fakes in tests/fakes.py; nothing imports this module.

Fixtures here import what they need when they run, so collecting the unit tier loads no torch."""

import gc
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.harness import BOS_ID, TINY, Harness, TinyModels, real_config, until

RESULTS_DIR_ENV = "PAGEDSERVE_RESULTS_DIR"


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """A server freezes the heap once its models load (service/models/supervision.py's freeze_heap); an
    in-process app of a test must not leave this process's heap frozen for the tests after it (what a
    test's app leaves in reference cycles would never be collected)."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    made: dict[str, str] = {}

    def get(preset: str = "tiny-llama") -> str:
        from benchmarks.make_model import make_random_model  # torch loads only for tests that need it

        if preset not in made:
            made[preset] = str(make_random_model(preset, tmp_path_factory.mktemp(preset), seed=1))
        return made[preset]

    return get


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    """Where tests that measure something (chaos, failover) write their JSON figures: a temp dir, so
    a test run never touches the tracked benchmarks/results/. `make bench-resilience` sets
    PAGEDSERVE_RESULTS_DIR=benchmarks/results to record them on purpose."""
    chosen = os.environ.get(RESULTS_DIR_ENV)
    path = Path(chosen).resolve() if chosen else tmp_path_factory.mktemp("results")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def bos_model(random_model, tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer prepends a BOS (id BOS_ID) to every text, as Llama's prepends <s>,
    and whose chat template starts with it, as Llama 3's does."""
    path = tmp_path_factory.mktemp("bos") / "tiny-llama-bos"
    shutil.copytree(random_model("tiny-llama"), path)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = next(t["content"] for t in spec["added_tokens"] if t["id"] == BOS_ID)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    # a template that starts with the BOS, as Llama 3's does
    (path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    return path


# --- in-process apps over real tiny engines ----------------------------------------------------------------
# Every app serves two real `engine.AsyncEngine`s on the CPU: "primary" is the shipped
# models/pagedserve-coder-tiny (trained, so its greedy text reads as Python), "fallback" a random-weight
# tiny Qwen2 made once per session (random_model). Each loads in about a second, so tests see what users
# see: sampling parameters that matter, real stats, real aborts and block frees.


@pytest.fixture(scope="session")
def tiny_models(random_model) -> TinyModels:
    if not (TINY / "config.json").is_file():
        pytest.fail(f"{TINY} is missing (run `make models`, or set PAGEDSERVE_TEST_TINY)")
    return TinyModels(TINY, Path(random_model("tiny-qwen2")))


@pytest.fixture
def start(aiohttp_client, tiny_models):
    """`await start(**config)` -> a Harness with a ready app on a test server (handler_cancellation on)."""
    from engine.config import EngineConfig
    from service.app import create_app

    gates: list[threading.Event] = []

    async def make(
        engine_kwargs: dict | None = None,
        wait_ready: bool = True,
        router_factory=None,
        load_gate: threading.Event | None = None,
        fallback_dir: Path | None = None,
        **config,
    ) -> Harness:
        """`engine_kwargs`: EngineConfig fields for both models; `load_gate`: loading blocks until it is
        set; `fallback_dir`: the fallback's model directory instead of the tiny Qwen2."""
        factory = None
        if load_gate is not None:
            gates.append(load_gate)

            def factory(cfg: EngineConfig):
                from engine import AsyncEngine

                assert load_gate.wait(30)
                return AsyncEngine(cfg)

        app = create_app(
            real_config(tiny_models, engine_kwargs, fallback_dir, **config),
            engine_factory=factory,
            router_factory=router_factory,
        )
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        harness = Harness(client, app)
        if wait_ready:
            await until(lambda: harness.state.is_ready or harness.state.fatal.is_set(), timeout=60)
            assert not harness.state.fatal.is_set(), harness.state.health.load_error
        return harness

    yield make
    for gate in gates:  # a test that failed while holding a load must not leave it blocked at teardown
        gate.set()


@pytest.fixture
async def sdk(start):
    """(the official openai AsyncOpenAI client, its Harness) on an app that takes the API key "k"."""
    import openai

    h = await start(api_keys=("k",))
    client = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="k", max_retries=0)
    yield client, h
    await client.close()
