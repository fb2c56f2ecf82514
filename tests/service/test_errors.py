"""Every error is OpenAI-shaped JSON from the one middleware, with the right status and Retry-After."""

import json
import logging
import threading

import pytest

from engine.errors import EngineDeadError, EngineOverloadedError, EngineStepError, RequestRejectedError
from resilience.errors import AdmissionRejected, BreakerOpenError, DeadlineExceeded, NoModelAvailable
from service.errors import ERROR_TYPES, InvalidRequestError, classify
from tests.service.conftest import until

COMPLETIONS = "/v1/completions"


async def _error(response, status: int) -> dict:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ERROR_TYPES[status]
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


async def test_invalid_json_is_400(start):
    h = await start()
    for data in (b"{bad", b"", b"\xff\xfe", b'{"prompt": NaN}'):
        err = await _error(await h.client.post(COMPLETIONS, data=data), 400)
        assert "JSON" in err["message"] or "empty" in err["message"]


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("temperature", -1, "temperature must be non-negative, got -1"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("n", 0, "n must be at least 1, got 0"),
    ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
    ("max_tokens", "many", "max_tokens must be an integer, got a string"),
    ("stream", 1, "stream must be a boolean"),
])
async def test_wrong_types_and_ranges_are_400_naming_the_param(start, field, value, fragment):
    h = await start()
    err = await _error(await h.client.post(COMPLETIONS, json={"prompt": "hi", field: value}), 400)
    assert err["param"] == field and fragment in err["message"]


async def test_unknown_model_is_404(start):
    h = await start()
    err = await _error(await h.client.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found") and "gpt-9" in err["message"]
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    await _error(await h.client.post("/v1/chat/completions", json=chat), 404)


async def test_body_over_the_limit_is_413(start):
    h = await start(max_body_bytes=2048)
    err = await _error(await h.client.post(COMPLETIONS, json={"prompt": "x" * 4096}), 413)
    assert "too large" in err["message"]


async def test_prompt_plus_max_tokens_over_context_is_400_with_the_numbers(start):
    h = await start()  # fake context: 64 tokens
    err = await _error(await h.client.post(COMPLETIONS, json={"prompt": "x" * 60, "max_tokens": 10}), 400)
    assert "64" in err["message"] and "70" in err["message"] and "60 in the prompt" in err["message"]
    assert [r[0] for r in h.primary.requests] == ["warmup-primary"]  # refused before the engine saw it


async def test_overload_is_429_with_retry_after(start):
    h = await start()
    h.primary.is_overloaded = True
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    await _error(response, 429)
    assert response.headers["Retry-After"] == "1"


async def test_dead_engines_are_503_with_retry_after(start):
    h = await start()
    h.engines["primary"].is_dead = h.engines["fallback"].is_dead = True
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    assert (await _error(response, 503))["message"] == "no model of ['primary', 'fallback'] can serve now"
    assert int(response.headers["Retry-After"]) >= 1
    assert (await h.client.get("/health/ready")).status == 503


async def test_loading_is_503_and_ready_turns_200_after(start):
    gate = threading.Event()
    h = await start(wait_ready=False, load_gate=gate)
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi"})
    assert (await _error(response, 503))["code"] == "model_loading" and "Retry-After" in response.headers
    ready = await h.client.get("/health/ready")
    assert ready.status == 503 and (await ready.json())["reason"].startswith("models are loading")
    assert (await h.client.get("/health/live")).status == 200
    gate.set()
    await until(lambda: h.state.is_ready)
    assert (await h.client.get("/health")).status == 200


async def test_a_model_that_fails_to_load_sets_fatal(start):
    h = await start(wait_ready=False, load_error=OSError("out of memory"))
    await until(h.state.fatal.is_set)
    body = await (await h.client.get("/health/ready")).json()
    assert "fallback: out of memory" in body["reason"]


async def test_unexpected_error_is_500_with_request_id_in_body_and_log(start, caplog):
    h = await start()
    h.primary.error = RuntimeError("secret internals")
    with caplog.at_level(logging.ERROR):
        response = await h.client.post(COMPLETIONS, json={"prompt": "hi"}, headers={"X-Request-Id": "req-42"})
        err = await _error(response, 500)
    assert err["message"] == "internal error; request id req-42" and "secret" not in err["message"]
    assert any("request_id=req-42" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_error_after_the_stream_began_is_an_error_event_then_done(start):
    h = await start()
    h.primary.error = EngineDeadError("the engine loop died")
    response = await h.client.post(COMPLETIONS, json={"prompt": "hi", "stream": True})
    assert response.status == 200
    events = (await response.text()).strip().split("\n\n")
    last_chunk, error, done = events[-3:]
    assert json.loads(last_chunk[len("data: "):])["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "error", "stop_reason": None}]
    assert json.loads(error[len("data: "):])["error"]["message"] == "the engine loop died"
    assert done == "data: [DONE]"


async def test_unknown_route_and_method_are_json(start):
    h = await start()
    await _error(await h.client.get("/v2/nothing"), 404)
    response = await h.client.get(COMPLETIONS)
    await _error(response, 405)
    assert response.headers["Allow"] == "POST"


async def test_draining_is_503(start):
    h = await start()
    h.state.health.start_draining()
    assert (await _error(await h.client.post(COMPLETIONS, json={"prompt": "hi"}), 503))["code"] == "draining"


def test_classify_families():
    assert classify(InvalidRequestError("bad", param="n"))[:3] == (400, "bad", "n")
    assert classify(RequestRejectedError("too long"))[0] == 400
    assert classify(EngineOverloadedError("full"), 2, 7)[::4] == (429, 2)
    assert classify(EngineDeadError("dead"), 2, 7)[::4] == (503, 7)
    assert classify(EngineStepError("nan in logits"), 2, 7)[::3] == (503, "engine_error")
    assert classify(TimeoutError())[:2] == (500, "internal error")


def test_classify_resilience_errors():
    assert classify(AdmissionRejected("m", "queue full", 1.2))[::4] == (429, 2)
    assert classify(BreakerOpenError("m", "open", 0.1))[::4] == (503, 1)
    assert classify(NoModelAvailable("every model refused", 3))[::4] == (503, 3)
    assert classify(DeadlineExceeded("first_token", 10.0), 1, 5)[::3] == (503, "deadline_exceeded")


async def test_ready_is_503_when_no_model_of_a_ladder_can_serve(start):
    h = await start()
    h.state.router.can_serve = lambda model: model != "primary"  # as with both breakers of its ladder open
    response = await h.client.get("/health/ready")
    assert response.status == 503
    assert (await response.json())["reason"] == "no model of the fallback ladder can serve: ['primary']"
