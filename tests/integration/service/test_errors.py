"""Every error is OpenAI-shaped JSON from the one middleware, with the right status and Retry-After, over
real tiny engines: real overload, real loop deaths (the `crash` fault) and real failed steps."""

import asyncio
import json
import logging
import os
import signal
import threading

import pytest

from engine.errors import (
    EngineDeadError,
    EngineNotRunningError,
    EngineOverloadedError,
    EngineStepError,
    RequestRejectedError,
)
from engine.faults import Fault
from resilience.errors import AdmissionRejected, BreakerOpenError, DeadlineExceeded, NoModelAvailable
from service.errors import ERROR_TYPES, InvalidRequestError, classify
from tests.harness import until

COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}
# a stream that outlasts the test's checks: the slow fault spaces the steps, ignore_eos keeps it going
LONG = {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}


async def _error(response, status: int) -> dict:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ERROR_TYPES[status]
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


def _events(raw: bytes) -> list[str]:
    return raw.decode("utf-8").strip().split("\n\n")


async def test_invalid_json_is_400(start):
    h = await start()
    for data, fragment in (
        (b"{bad", "not valid JSON"),
        (b"", "empty"),
        (b"\xff\xfe", "not valid UTF-8"),
        (b'{"prompt": NaN}', "NaN is not a JSON number"),
    ):
        err = await _error(await h.client.post(COMPLETIONS, data=data, headers=JSON), 400)
        assert fragment in err["message"], (data, err)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("temperature", -1, "temperature must be non-negative, got -1"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("n", 0, "n must be at least 1, got 0"),
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("max_tokens", "many", "max_tokens must be an integer, got a string"),
        ("stream", 1, "stream must be a boolean"),
    ],
)
async def test_wrong_types_and_ranges_are_400_naming_the_param(start, field, value, fragment):
    h = await start()
    err = await _error(await h.client.post(COMPLETIONS, json={"prompt": "hi", field: value}), 400)
    assert err["param"] == field and fragment in err["message"], err
    assert h.state.router.num_engine_requests == {}  # refused before any engine saw it


async def test_unknown_model_is_404(start):
    h = await start()
    err = await _error(await h.client.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found") and "gpt-9" in err["message"]
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    err = await _error(await h.client.post("/v1/chat/completions", json=chat), 404)
    assert err["message"] == "The model `gpt-9` does not exist."


async def test_body_over_the_limit_is_413(start):
    h = await start(max_body_bytes=2048)
    err = await _error(await h.client.post(COMPLETIONS, json={"prompt": "x" * 4096}), 413)
    assert "too large" in err["message"]


async def test_prompt_plus_max_tokens_over_context_is_400_with_the_numbers(start):
    h = await start(engine_kwargs={"max_model_len": 64})
    err = await _error(await h.client.post(COMPLETIONS, json={"prompt": [17] * 60, "max_tokens": 10}), 400)
    assert "64" in err["message"] and "70" in err["message"] and "60 in the prompt" in err["message"], err
    assert h.state.router.num_engine_requests == {}  # refused before the engine saw it
    ok = await h.client.post(COMPLETIONS, json={"prompt": [17] * 60, "max_tokens": 4, "ignore_eos": True})
    assert (await ok.json())["usage"] == {"prompt_tokens": 60, "completion_tokens": 4, "total_tokens": 64}


async def test_overload_is_429_with_retry_after(start):
    # one running slot and one waiting slot: the third concurrent request finds the real queue full
    h = await start(engine_kwargs={"max_num_seqs": 1, "max_num_waiting": 1})
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    running = await h.client.post(COMPLETIONS, json=LONG)
    assert (await running.content.readline()).startswith(b"data: ")
    waiting = asyncio.create_task(h.client.post(COMPLETIONS, json=LONG))
    await until(lambda: h.primary.stats().num_waiting == 1)
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    err = await _error(response, 429)
    assert response.headers["Retry-After"] == "1"
    # the bulkhead holds what the engine holds (1 running + 1 waiting): it refuses the third at once
    assert err["code"] == "overloaded" and "2 + 1 sequences exceed 2" in err["message"], err
    running.close()
    (await waiting).close()
    await until(h.idle)


async def test_a_crashed_engine_heals_in_process(start):
    """A loop death for real: the request it was serving ends with 500 engine_dead (nginx must not
    replay it), a request arriving while the engine is rebuilt is refused with 503 + Retry-After
    (before any work: nginx may replay it), and the replica comes back ready with a new engine."""
    gate = threading.Event()
    gate.set()
    # the gate holds the rebuild open below, so the 503 is certain; no continuation (test_continuation.py)
    h = await start(load_gate=gate, max_continuations=0)
    primary, fallback = h.engines["primary"], h.engines["fallback"]
    in_flight = await h.client.post(COMPLETIONS, json=LONG)
    assert (await in_flight.content.readline()).startswith(b"data: ")
    gate.clear()
    fallback.faults.inject(Fault("crash"))  # the fallback first, so that nothing can fail over
    primary.faults.inject(Fault("crash"))
    events = _events(await in_flight.read())
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert (error["code"], error["type"]) == ("engine_dead", "internal_server_error"), error
    assert events[-1] == "data: [DONE]"
    await until(lambda: primary.is_dead and fallback.is_dead)
    # the primary's rebuild waits on the gate (and the fallback's on the registry lock behind it)
    await until(lambda: "primary" not in h.engines)
    refused = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    err = await _error(refused, 503)
    assert err["code"] == "engine_rebuilding" and int(refused.headers["Retry-After"]) >= 1, err
    ready = await h.client.get("/health/ready")
    assert ready.status == 503 and "rebuilding engine of 'primary'" in (await ready.json())["reason"]
    assert (await h.client.get("/health/live")).status == 200  # rebuilding in process: no restart wanted
    gate.set()
    await until(h.state.health.is_ready, timeout=60)
    assert h.engines["primary"] is not primary and not h.primary.is_dead
    assert (await h.client.get("/health/ready")).status == 200
    metrics = await (await h.client.get("/metrics")).text()
    assert "pagedserve:engine_rebuilds_total 2.0" in metrics
    done = await h.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert done.status == 200 and (await done.json())["usage"]["completion_tokens"] == 3


async def test_a_killed_tensor_parallel_rank_heals_in_process(start):
    """Both models split over 2 processes: killing the primary's second rank mid-stream does not end that
    stream (it continues on the rebuilt primary, or on the fallback if the rebuild outlasts the
    first-token timeout), and the replica is ready again, with a new primary, without a restart."""
    h = await start(engine_kwargs={"tensor_parallel_size": 2})
    primary = h.engines["primary"]
    in_flight = await h.client.post(COMPLETIONS, json={**LONG, "max_tokens": 60})
    assert (await in_flight.content.readline()).startswith(b"data: ")
    os.kill(primary.engine.model_runner.ranks.pids[0], signal.SIGKILL)
    events = _events(await in_flight.read())
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert [(m, r) for m, r, _ in h.state.router.num_continuations] == [("primary", "engine_dead")]
    await until(lambda: h.engines.get("primary") not in (None, primary), timeout=120)
    await until(h.state.health.is_ready, timeout=60)
    assert (await h.client.get("/health/ready")).status == 200
    done = await h.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert done.status == 200 and done.headers["x-pagedserve-served-model"] == "primary"
    assert (await done.json())["usage"]["completion_tokens"] == 3


async def test_loading_is_503_and_ready_turns_200_after(start):
    gate = threading.Event()
    h = await start(wait_ready=False, load_gate=gate)
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    assert (await _error(response, 503))["code"] == "model_loading" and "Retry-After" in response.headers
    ready = await h.client.get("/health/ready")
    assert ready.status == 503 and (await ready.json())["reason"].startswith("models are loading")
    assert (await h.client.get("/health/live")).status == 200
    gate.set()
    await until(lambda: h.state.is_ready, timeout=60)
    assert (await h.client.get("/health")).status == 200
    done = await h.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert (await done.json())["usage"]["completion_tokens"] == 2


async def test_a_model_that_fails_to_load_sets_fatal(start, tmp_path):
    (tmp_path / "broken").mkdir()  # a real model directory that cannot load: no config.json
    h = await start(wait_ready=False, fallback_dir=tmp_path / "broken")
    await until(h.state.fatal.is_set, timeout=60)
    body = await (await h.client.get("/health/ready")).json()
    assert (
        body["reason"].startswith("a model failed to load: fallback: ") and "config.json" in body["reason"]
    ), body


async def test_unexpected_error_is_500_with_request_id_in_body_and_log(start, caplog):
    # a fake router: an exception no part of the stack raises on purpose (a bug) cannot be produced by
    # the real parts; what is tested is that the middleware hides it and names the request id
    class BrokenRouter:
        def __init__(self, engines, fallbacks) -> None:
            pass

        def can_serve(self, model: str) -> bool:
            return True

        async def generate(self, req):
            raise RuntimeError("secret internals")
            yield

    h = await start(router_factory=BrokenRouter)
    with caplog.at_level(logging.ERROR):
        response = await h.client.post(COMPLETIONS, json={"prompt": "hi"}, headers={"X-Request-Id": "req-42"})
        err = await _error(response, 500)
    assert err["message"] == "internal error; request id req-42" and "secret" not in err["message"]
    assert any("request_id=req-42" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_error_after_the_stream_began_is_an_error_event_then_done(start):
    h = await start(
        max_continuations=0
    )  # with them, the stream continues on the fallback (test_continuation.py)
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    response = await h.client.post(COMPLETIONS, json=LONG)
    assert response.status == 200
    first = await response.content.readline()
    assert json.loads(first[len("data: ") :])["choices"][0]["finish_reason"] is None
    h.primary.faults.inject(Fault("error", seconds=5))  # the real step fails every request it holds
    events = _events(first + await response.read())
    last_chunk, error, done = events[-3:]
    assert json.loads(last_chunk[len("data: ") :])["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "error", "stop_reason": None}
    ]
    error = json.loads(error[len("data: ") :])["error"]
    assert error["message"] == "injected fault: the engine step failed" and error["code"] == "engine_error", (
        error
    )
    assert done == "data: [DONE]"
    assert len(events) < 200  # it ended early, with the error, not after max_tokens
    await until(h.idle)


async def test_unknown_route_and_method_are_json(start):
    h = await start()
    assert (await _error(await h.client.get("/v2/nothing"), 404))["message"] == "not found"
    response = await h.client.get(COMPLETIONS)
    assert (await _error(response, 405))["message"] == "method GET not allowed"
    assert response.headers["Allow"] == "POST"


async def test_draining_is_503(start):
    h = await start()
    h.state.health.start_draining()
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    err = await _error(response, 503)
    assert err["code"] == "draining" and err["message"] == "the server is shutting down", err
    assert response.headers["Retry-After"] == "5"


def test_classify_families():
    assert classify(InvalidRequestError("bad", param="n"))[:3] == (400, "bad", "n")
    assert classify(RequestRejectedError("too long"))[0] == 400
    assert classify(EngineOverloadedError("full"), 2, 7)[::4] == (429, 2)
    assert classify(EngineDeadError("dead"), 2, 7)[::3] == (500, "engine_dead")  # died while serving it
    assert classify(EngineNotRunningError("stopped"), 2, 7)[::3] == (503, "engine_dead")  # refused at arrival
    refused = NoModelAvailable("no model", 1.0)
    refused.__cause__ = EngineNotRunningError("stopped")
    assert classify(refused, 2, 7)[::3] + classify(refused, 2, 7)[4:] == (503, "engine_dead", 7)
    assert classify(EngineStepError("nan in logits"), 2, 7)[::3] == (500, "engine_error")
    assert classify(TimeoutError())[:2] == (500, "internal error")


def test_classify_resilience_errors():
    assert classify(AdmissionRejected("m", "queue full", 1.2))[::4] == (429, 2)
    assert classify(BreakerOpenError("m", "open", 0.1))[::4] == (503, 1)
    assert classify(NoModelAvailable("every model refused", 3))[::4] == (503, 3)
    assert classify(DeadlineExceeded("first_token", 10.0), 1, 5)[::3] == (504, "deadline_exceeded")


async def test_ready_is_503_when_every_breaker_is_open(start):
    h = await start()
    for engine in h.engines.values():  # both models fail every step: their breakers open for real
        engine.faults.inject(Fault("error"))
    for _ in range(12):  # each breaker opens after 10 calls of which half failed (BreakerConfig)
        for model in ("primary", "fallback"):
            response = await h.client.post(
                COMPLETIONS, json={"model": model, "prompt": "hi", "max_tokens": 2}
            )
            assert response.status in (500, 503), await response.text()
    assert {h.state.router.breaker(name).state for name in ("primary", "fallback")} == {"open"}
    response = await h.client.get("/health/ready")
    assert response.status == 503
    reason = (await response.json())["reason"]
    assert "breaker of 'fallback' is open" in reason and "breaker of 'primary' is open" in reason, reason
    assert not h.state.router.can_serve("primary")
    refused = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    assert (await _error(refused, 503))["message"].startswith(
        "no model of ['primary', 'fallback'] can serve now"
    )
