"""A drain that runs out of time before a request's first token answers it 503 `draining` (nginx
may replay it on another replica), stream or not, instead of dropping the connection."""

import asyncio

from engine.faults import Fault
from service.app import drain
from tests.harness import until

COMPLETIONS = "/v1/completions"


async def test_requests_without_a_first_token_get_503_draining(start):
    h = await start(shutdown_timeout=1.0)
    for engine in h.engines.values():  # no step runs: nobody gets a first token before the drain ends
        engine.faults.inject(Fault("stall"))
    body = {"model": "primary", "prompt": "def f():", "max_tokens": 4}
    plain = asyncio.create_task(h.client.post(COMPLETIONS, json=body))
    streamed = asyncio.create_task(h.client.post(COMPLETIONS, json={**body, "stream": True}))
    await until(lambda: len(h.state.generations) == 2)
    await drain(h.app)
    for response in (await plain, await streamed):
        assert response.status == 503, await response.text()
        assert (await response.json())["error"]["code"] == "draining"
        assert response.headers["Retry-After"] == "5"
    for engine in h.engines.values():
        engine.faults.clear()
    await until(h.idle)
