"""In-process apps over real tiny engines, for the HTTP layer's own tests.

Every app serves two real `engine.AsyncEngine`s on the CPU: "primary" is the shipped
models/pagedserve-coder-tiny (trained, so its greedy text reads as Python), "fallback" a random-weight
tiny Qwen2 made once per session (tests/conftest.py::random_model). Each loads in about a second, so
tests see what users see: sampling parameters that matter, real stats, real aborts and block frees."""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from service.app import create_app
from service.config import ModelSpec, ServerConfig
from service.keys import STATE_KEY
from tests.service.server import TINY

# small on purpose: tests that need a long stream or a short context say so through engine_kwargs
ENGINE_DEFAULTS = dict(dtype="float32", device="cpu", block_size=8, kv_cache_memory=4 * 2**20, max_model_len=256,
                       num_threads=1)  # 1 thread: the box has 2 cores shared with other test runs


@dataclass(frozen=True)
class TinyModels:
    primary: Path
    fallback: Path


@pytest.fixture(scope="session")
def tiny_models(random_model) -> TinyModels:
    if not (TINY / "config.json").is_file():
        pytest.fail(f"{TINY} is missing (run `make models`, or set PAGEDSERVE_TEST_TINY)")
    return TinyModels(TINY, Path(random_model("tiny-qwen2")))


@dataclass
class Harness:
    client: Any  # aiohttp.test_utils.TestClient
    app: Any

    @property
    def state(self):
        return self.app[STATE_KEY]

    @property
    def engines(self) -> dict[str, Any]:
        """Served name -> the engine serving it now (a rebuilt engine replaces a dead one here)."""
        return self.state.engines

    @property
    def primary(self) -> Any:
        return self.engines["primary"]

    def idle(self, name: str = "primary") -> bool:
        """Nothing runs or waits on the model's engine and every KV block is free again."""
        stats = self.engines[name].stats()
        return (not self.engines[name].engine.requests and stats.num_running == stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_total_blocks)

    async def greedy(self, prompt: str | list[int], max_tokens: int, name: str = "primary", **params) -> str:
        """What the engine itself generates greedily, without the HTTP layer (the reference text)."""
        engine = self.engines[name]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        text = ""
        async for output in engine.generate(prompt, sampling, f"reference-{uuid.uuid4().hex}"):
            text += output.outputs[0].text
        return text


def real_config(models: TinyModels, engine_kwargs: dict | None = None, fallback_dir: Path | None = None,
                **overrides) -> ServerConfig:
    options = {**ENGINE_DEFAULTS, **(engine_kwargs or {})}
    specs = (ModelSpec("primary", EngineConfig(model=str(models.primary), **options), "fallback"),
             ModelSpec("fallback", EngineConfig(model=str(fallback_dir or models.fallback), **options)))
    return ServerConfig(**{"models": specs, "shutdown_timeout": 1.0, **overrides})


@pytest.fixture
def start(aiohttp_client, tiny_models):
    """`await start(**config)` -> a Harness with a ready app on a test server (handler_cancellation on)."""
    gates: list[threading.Event] = []

    async def make(engine_kwargs: dict | None = None, wait_ready: bool = True, router_factory=None,
                   load_gate: threading.Event | None = None, fallback_dir: Path | None = None,
                   **config) -> Harness:
        """`engine_kwargs`: EngineConfig fields for both models; `load_gate`: loading blocks until it is
        set; `fallback_dir`: the fallback's model directory instead of the tiny Qwen2."""
        factory = None
        if load_gate is not None:
            gates.append(load_gate)
            def factory(cfg: EngineConfig):
                from engine import AsyncEngine

                assert load_gate.wait(30)
                return AsyncEngine(cfg)

        app = create_app(real_config(tiny_models, engine_kwargs, fallback_dir, **config), engine_factory=factory,
                         router_factory=router_factory)
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
    h = await start(api_keys=("k",))
    client = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="k", max_retries=0)
    yield client, h
    await client.close()


async def until(predicate, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Generous default: the box has 2 cores shared with other test runs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
