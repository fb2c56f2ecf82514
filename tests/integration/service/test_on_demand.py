"""On-demand loading in process: a request for a model that is still loading after the first-token
timeout is answered by the on-demand fallback (degraded), the next one by the model itself."""

import asyncio
import shutil
import threading

from engine import AsyncEngine
from engine.config import EngineConfig
from service.app import create_app
from service.keys import STATE_KEY
from service.models import on_demand
from tests.harness import real_config, until

PROMPT = {
    "model": "extra",
    "prompt": "def add(a, b):\n",
    "max_tokens": 3,
    "temperature": 0.0,
    "ignore_eos": True,
}


async def test_a_model_still_loading_is_answered_by_the_fallback_then_by_itself(
    aiohttp_client, tiny_models, tmp_path
):
    models_dir = tmp_path / "models"
    shutil.copytree(tiny_models.fallback, models_dir / "extra")
    gate = threading.Event()

    def factory(config: EngineConfig) -> AsyncEngine:
        if config.model.endswith(
            "extra"
        ):  # the on-demand load waits for the test; the start-up models do not
            assert gate.wait(60)
        return AsyncEngine(config)

    app = create_app(
        real_config(tiny_models, models_dir=str(models_dir), first_token_timeout_s=1.0),
        engine_factory=factory,
    )
    client = await aiohttp_client(app)
    state = app[STATE_KEY]
    try:
        await until(lambda: state.is_ready, timeout=60)
        degraded = await client.post("/v1/completions", json=PROMPT)
        body = await degraded.json()
        assert degraded.status == 200 and body["usage"]["completion_tokens"] == 3, body
        assert (degraded.headers["x-pagedserve-served-model"], degraded.headers["x-pagedserve-degraded"]) == (
            "primary",
            "1",
        )
        health = await (await client.get("/health/ready")).json()
        assert health["models"]["extra"] == "loading" and health["status"] == "ready", health
    finally:
        gate.set()
    await until(lambda: "extra" in state.engines, timeout=60)
    served = await client.post("/v1/completions", json=PROMPT)
    assert served.status == 200 and (await served.json())["usage"]["completion_tokens"] == 3
    assert (
        served.headers["x-pagedserve-served-model"] == "extra"
        and "x-pagedserve-degraded" not in served.headers
    )


async def test_a_failed_on_demand_load_is_tried_again_after_a_backoff(
    aiohttp_client, tiny_models, tmp_path, monkeypatch
):
    monkeypatch.setattr(on_demand, "RETRY_FIRST_WAIT_S", 1.0)
    models_dir = tmp_path / "models"
    shutil.copytree(tiny_models.fallback, models_dir / "extra")
    attempts = []

    def factory(config: EngineConfig) -> AsyncEngine:
        if config.model.endswith("extra"):
            attempts.append(config.model)
            if len(attempts) == 1:
                raise OSError("the disk hiccupped")  # a transient failure: the next try works
        return AsyncEngine(config)

    app = create_app(
        real_config(tiny_models, models_dir=str(models_dir), first_token_timeout_s=1.0),
        engine_factory=factory,
    )
    client = await aiohttp_client(app)
    state = app[STATE_KEY]
    await until(lambda: state.is_ready, timeout=60)
    failed = await client.post("/v1/completions", json=PROMPT)
    body = await failed.json()
    assert failed.status == 400 and body["error"]["code"] == "load_failed", body
    within = await client.post(
        "/v1/completions", json=PROMPT
    )  # inside the backoff: its fallback, no new load
    assert within.status == 200 and within.headers["x-pagedserve-served-model"] == "primary", (
        await within.text()
    )
    assert len(attempts) == 1 and state.registry.entries["extra"].num_failures == 1
    await asyncio.sleep(1.1)
    served = await client.post("/v1/completions", json=PROMPT)
    assert served.status == 200 and served.headers["x-pagedserve-served-model"] == "extra", (
        await served.text()
    )
    assert len(attempts) == 2 and state.registry.entries["extra"].num_failures == 0
