"""A client that goes away aborts its engine requests: mid-stream, mid-queue, with several prompts; and
shutdown drains in-flight generations, then cancels what is left. Real tiny engines: "aborted" means
the engine holds no request and every KV block is free again."""

import asyncio

from engine.faults import Fault
from service.app import drain
from tests.harness import until

COMPLETIONS = "/v1/completions"
# long enough to still run when the client leaves: ignore_eos, and the slow fault spaces the steps
LONG = {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}


def _success_total(metrics: str) -> float:
    """Requests of the primary that finished (an aborted one never counts)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pagedserve:request_success_total{") and 'model_name="primary"' in line
    )


async def test_disconnect_mid_stream_aborts(start):
    h = await start()
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    response = await h.client.post(COMPLETIONS, json=LONG)
    assert (await response.content.readline()).startswith(b"data: ")
    await until(lambda: h.primary.stats().num_running == 1)
    response.close()  # the client goes away
    await until(h.idle)
    assert h.primary.stats().num_generation_tokens < 1 + 200  # warm-up + far fewer than asked
    assert not h.state.generations
    assert _success_total(await (await h.client.get("/metrics")).text()) == 0


async def test_disconnect_mid_queue_aborts(start):
    h = await start(engine_kwargs={"max_num_seqs": 1})  # one slot: a second request waits in the queue
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    running = await h.client.post(COMPLETIONS, json=LONG)
    await running.content.readline()
    task = asyncio.create_task(h.client.post(COMPLETIONS, json={"prompt": "queued", "max_tokens": 4}))
    await until(lambda: h.primary.stats().num_waiting == 1)
    task.cancel()
    await until(lambda: h.primary.stats().num_waiting == 0)
    assert h.primary.stats().num_running == 1 and len(h.primary.engine.requests) == 1  # the running one only
    running.close()
    await until(h.idle)


async def test_disconnect_aborts_every_prompt_of_a_request(start):
    h = await start()
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    response = await h.client.post(COMPLETIONS, json={**LONG, "prompt": ["a", "b", "c"]})
    await response.content.readline()
    await until(lambda: len(h.primary.engine.requests) == 3)
    response.close()
    await until(h.idle)
    assert h.state.router.num_engine_requests == {"primary": 3}


async def test_metrics_show_the_abort(start):
    h = await start()
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    response = await h.client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        },
    )
    await response.content.readline()
    await until(lambda: h.primary.stats().num_running == 1)
    during = await (await h.client.get("/metrics")).text()
    assert 'pagedserve:num_requests_running{model_name="primary"} 1.0' in during
    usage = 'pagedserve:kv_cache_usage_perc{model_name="primary"} '
    assert float(next(line for line in during.splitlines() if line.startswith(usage))[len(usage) :]) > 0
    response.close()
    await until(h.idle)
    after = await (await h.client.get("/metrics")).text()
    assert 'pagedserve:num_requests_running{model_name="primary"} 0.0' in after
    assert 'pagedserve:kv_cache_usage_perc{model_name="primary"} 0.0' in after


async def test_drain_lets_short_requests_finish_and_cancels_the_rest(start):
    # 3 s of drain: ample for 3 tokens on a loaded box; 800 tokens 20 ms apart need 16 s at least
    h = await start(shutdown_timeout=3.0, engine_kwargs={"max_model_len": 1024})
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    short = asyncio.create_task(
        h.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    )
    long = await h.client.post(COMPLETIONS, json={**LONG, "max_tokens": 800})
    await long.content.readline()
    await until(lambda: len(h.state.generations) == 2)  # both in flight when the drain begins
    await drain(h.app)
    done = await short
    assert done.status == 200 and (await done.json())["usage"]["completion_tokens"] == 3
    events = (await long.read()).decode().strip().split("\n\n")
    assert len(events) < 800 and "shutting down" in events[-2] and events[-1] == "data: [DONE]"
    await until(h.idle)
    refused = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    assert refused.status == 503 and refused.headers["Retry-After"] == "5"
    assert (await refused.json())["error"]["code"] == "draining"
    assert (await h.client.get("/health/ready")).status == 503
