"""A client that goes away aborts its engine requests: mid-stream, mid-queue, with several prompts; and
shutdown drains in-flight generations, then cancels what is left."""

import asyncio

from service.app import drain
from tests.service.conftest import until


def _user_requests(engine) -> list[str]:
    return [r[0] for r in engine.requests if not r[0].startswith("warmup")]


async def test_disconnect_mid_stream_aborts(start):
    h = await start(engine_kwargs={"delay": 0.02})
    response = await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stream": True})
    assert (await response.content.readline()).startswith(b"data: ")
    response.close()  # the client goes away
    await until(lambda: _user_requests(h.primary) and not h.primary.running)
    assert h.primary.aborted == _user_requests(h.primary) and h.primary.finished == ["warmup-primary"]
    assert not h.state.generations


async def test_disconnect_mid_queue_aborts(start):
    h = await start()
    h.primary.hold.clear()  # requests wait before their first token, like a full batch
    task = asyncio.create_task(h.client.post("/v1/completions", json={"prompt": "hi"}))
    await until(lambda: h.primary.waiting)
    task.cancel()
    await until(lambda: not h.primary.waiting and h.primary.aborted)
    assert h.primary.aborted == _user_requests(h.primary)


async def test_disconnect_aborts_every_prompt_of_a_request(start):
    h = await start(engine_kwargs={"delay": 0.02})
    response = await h.client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 40,
                                                             "stream": True})
    await response.content.readline()
    response.close()
    await until(lambda: len(h.primary.aborted) == 3 and not h.primary.running)
    assert sorted(h.primary.aborted) == sorted(_user_requests(h.primary))


async def test_metrics_show_the_abort(start):
    h = await start(engine_kwargs={"delay": 0.02})
    response = await h.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True})
    await response.content.readline()
    during = await (await h.client.get("/metrics")).text()
    assert 'pagedserve:num_requests_running{model_name="primary"} 1.0' in during
    response.close()
    await until(lambda: not h.primary.running)
    after = await (await h.client.get("/metrics")).text()
    assert 'pagedserve:num_requests_running{model_name="primary"} 0.0' in after
    assert 'pagedserve:kv_cache_usage_perc{model_name="primary"} 0.0' in after


async def test_drain_lets_short_requests_finish_and_cancels_the_rest(start):
    h = await start(engine_kwargs={"delay": 0.01}, shutdown_timeout=0.3)
    short = asyncio.create_task(h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}))
    long = await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 60, "stream": True})
    await long.content.readline()
    await drain(h.app)
    assert (await short).status == 200
    assert len(h.primary.aborted) == 1 and not h.primary.running
    events = (await long.read()).decode().strip().split("\n\n")
    assert len(events) < 60 and "shutting down" in events[-2] and events[-1] == "data: [DONE]"
    refused = await h.client.post("/v1/completions", json={"prompt": "hi"})
    assert refused.status == 503 and refused.headers["Retry-After"] == "5"
    assert (await h.client.get("/health/ready")).status == 503
