"""A start-up model an admin unloaded is gone: 404 model_not_found, not `model_loading` forever; and a
model being drained for unload sends new requests down its ladder instead of refusing them."""

import asyncio

from engine.faults import Fault
from tests.harness import until

COMPLETIONS = "/v1/completions"


async def test_an_unloaded_start_up_model_is_404(start):
    h = await start()
    await h.state.registry.unload("fallback")
    response = await h.client.post(COMPLETIONS, json={"model": "fallback", "prompt": "hi", "max_tokens": 2})
    body = await response.json()
    assert response.status == 404 and body["error"]["code"] == "model_not_found", body


async def test_new_requests_to_a_draining_model_go_to_its_fallback(start):
    h = await start(
        shutdown_timeout=30.0, max_continuations=0
    )  # the drain (continuations: test_continuation.py)
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    running = await h.client.post(
        COMPLETIONS,
        json={"model": "primary", "prompt": "def f():", "max_tokens": 40, "ignore_eos": True, "stream": True},
    )
    assert (await running.content.readline()).startswith(b"data: ")
    unloading = asyncio.create_task(h.state.registry.unload("primary"))
    await until(lambda: "primary" not in h.state.engines)  # draining: out of the router's engines
    late = await h.client.post(COMPLETIONS, json={"model": "primary", "prompt": "hi", "max_tokens": 2})
    assert late.status == 200, await late.text()
    assert (
        late.headers["x-pagedserve-served-model"] == "fallback"
        and late.headers["x-pagedserve-degraded"] == "1"
    )
    await running.read()
    await unloading


async def test_the_tokenizer_and_model_routes_agree_an_unloaded_model_is_gone(start):
    h = await start()
    await h.state.registry.unload("fallback")
    assert (await h.client.get("/v1/models/fallback")).status == 404
    response = await h.client.post("/tokenize", json={"model": "fallback", "prompt": "hi"})
    assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"


async def test_a_loaded_model_leaves_the_collectors_generations(start):
    """service/models/supervision.py's freeze_heap: a full collection no longer walks the model."""
    import gc

    await start()
    assert gc.get_freeze_count() > 10_000
