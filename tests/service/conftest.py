"""In-process apps over fake engines (`fakes.FakeEngine`), for the HTTP layer's own tests."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from engine.config import EngineConfig
from service.app import create_app
from service.config import ModelSpec, ServerConfig
from service.keys import STATE_KEY
from tests.service.fakes import FakeEngine


@dataclass
class Harness:
    client: object
    app: object
    engines: dict[str, FakeEngine] = field(default_factory=dict)

    @property
    def primary(self) -> FakeEngine:
        return self.engines["primary"]

    @property
    def state(self):
        return self.app[STATE_KEY]


def fake_config(**overrides) -> ServerConfig:
    models = (ModelSpec("primary", EngineConfig(model="/fake/primary"), "fallback"),
              ModelSpec("fallback", EngineConfig(model="/fake/fallback")))
    return ServerConfig(**{"models": models, "shutdown_timeout": 1.0, **overrides})


@pytest.fixture
def start(aiohttp_client):
    """`await start(**config)` -> a Harness with a ready app on a test server (handler_cancellation on)."""

    async def make(engine_kwargs: dict | None = None, wait_ready: bool = True, router_factory=None,
                   routes=None, load_gate: threading.Event | None = None, load_error: Exception | None = None,
                   **config) -> Harness:
        """`load_gate`: loading blocks until it is set; `load_error`: loading the fallback raises it."""
        engines: dict[str, FakeEngine] = {}

        def factory(cfg: EngineConfig) -> FakeEngine:
            if load_gate is not None:
                assert load_gate.wait(10)
            if load_error is not None and cfg.model.endswith("fallback"):
                raise load_error
            engine = FakeEngine(cfg, **(engine_kwargs or {}))
            engines[cfg.model.rsplit("/", 1)[-1]] = engine
            return engine

        app = create_app(fake_config(**config), engine_factory=factory, router_factory=router_factory)
        if routes:
            app.router.add_routes(routes)
        client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
        harness = Harness(client, app, engines)
        if wait_ready:
            await until(lambda: harness.state.is_ready)
        return harness

    return make


async def until(predicate, timeout: float = 5.0, interval: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
