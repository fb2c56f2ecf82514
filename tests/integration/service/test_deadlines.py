"""Request deadlines over HTTP on real tiny engines: a primary with no first token by
--first-token-timeout is left for the fallback (x-pagedserve-degraded: 1); the x-pagedserve-timeout
header asks for less than --request-timeout and gets 504 deadline_exceeded when it runs out, before the
first byte or, for a stream, as an error event then [DONE]; bad header values are a 400 (the options:
tests/unit/service/test_deadlines.py)."""

import json
import time

import pytest

from engine.faults import Fault
from tests.harness import until

COMPLETIONS = "/v1/completions"
TIMEOUT_HEADER = "x-pagedserve-timeout"
SHORT = {"prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True}


async def _error(response, status: int) -> dict:
    assert response.status == status, await response.text()
    return (await response.json())["error"]


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf", "1e309", "soon", ""])
async def test_a_bad_timeout_header_is_400(start, value):
    h = await start()
    err = await _error(await h.client.post(COMPLETIONS, json=SHORT, headers={TIMEOUT_HEADER: value}), 400)
    assert err["code"] == "invalid_timeout"
    assert (
        err["message"] == f"x-pagedserve-timeout must be a positive finite number of seconds, got {value!r}"
    )
    assert h.state.router.num_engine_requests == {}


async def test_a_slow_primary_is_left_for_the_fallback_at_the_first_token_deadline(start):
    # a stall timeout of its own: at the first-token timeout's 0.5 s (its default) the 1.5 s step raced the
    # deadline, and a stall (the model's failure, never slow) won about one run in 13
    h = await start(first_token_timeout_s=0.5, stall_timeout_s=5.0)
    h.primary.faults.inject(Fault("slow", delay_ms=1500))  # its loop lives, its first token comes too late
    started = time.monotonic()
    response = await h.client.post(COMPLETIONS, json=SHORT)
    assert response.status == 200, await response.text()
    assert (response.headers["x-pagedserve-served-model"], response.headers["x-pagedserve-degraded"]) == (
        "fallback",
        "1",
    )
    assert (await response.json())["usage"]["completion_tokens"] == 4
    assert time.monotonic() - started >= 0.5
    router = h.state.router
    assert router.num_slow_calls == {"primary": 1}
    assert router.num_deadline_hits == {("primary", "first_token"): 1}
    h.primary.faults.clear()
    await until(h.idle)  # the abandoned request was aborted on the primary: its blocks are free


async def test_the_clients_timeout_is_a_504_without_failover(start):
    h = await start()
    h.primary.faults.inject(Fault("slow", delay_ms=1500))
    started = time.monotonic()
    response = await h.client.post(COMPLETIONS, json=SHORT, headers={TIMEOUT_HEADER: "0.3"})
    err = await _error(response, 504)
    assert err["code"] == "deadline_exceeded" and "deadline exceeded at total" in err["message"], err
    assert time.monotonic() - started < 1.4  # not the primary's first token, nor the 10 s deadline
    assert h.state.router.num_engine_requests == {"primary": 1}  # never resubmitted to the fallback
    assert (
        h.state.router.breaker("primary").num_failed_calls == 0
    )  # the client's budget, not the model's fault
    h.primary.faults.clear()
    await until(h.idle)


async def test_the_request_timeout_ends_a_started_stream_with_an_error_event(start):
    h = await start(request_timeout_s=1.0)
    h.primary.faults.inject(Fault("slow", delay_ms=200))  # a token per 0.2 s: a few before the timeout
    body = {**SHORT, "max_tokens": 200, "stream": True}
    response = await h.client.post(COMPLETIONS, json=body, headers={TIMEOUT_HEADER: "100"})  # capped at 1 s
    assert response.status == 200 and response.headers["x-pagedserve-served-model"] == "primary"
    events = (await response.read()).decode().strip().split("\n\n")
    last_chunk, error, done = events[-3:]
    assert json.loads(last_chunk[len("data: ") :])["choices"][0]["finish_reason"] == "error"
    error = json.loads(error[len("data: ") :])["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error", error
    assert done == "data: [DONE]"
    assert 2 <= len(events) - 3 < 50  # some tokens went out, far from max_tokens
    h.primary.faults.clear()
    await until(h.idle)
