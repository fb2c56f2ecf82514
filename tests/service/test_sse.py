"""SSE framing, chunk shapes, multi-prompt indexing, served-model headers, request ids."""

import json

from service.router import RoutedOutput
from service.sse import DONE, SSE_HEADERS, encode_event


def _events(raw: bytes) -> list:
    text = raw.decode("utf-8")  # strict: broken UTF-8 raises
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def test_event_framing():
    assert encode_event({"a": "你好🙂"}) == 'data: {"a":"你好🙂"}\n\n'.encode()
    assert encode_event({"t": "line\nbreak"}) == b'data: {"t":"line\\nbreak"}\n\n'  # never a raw newline
    assert DONE == b"data: [DONE]\n\n"
    assert SSE_HEADERS["Cache-Control"] == "no-cache" and SSE_HEADERS["X-Accel-Buffering"] == "no"


async def test_completion_stream(start):
    h = await start()
    response = await h.client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["x-pagedserve-served-model"] == "primary"
    events = _events(await response.read())
    *chunks, usage = events
    assert {c["object"] for c in events} == {"text_completion"} and len({c["id"] for c in events}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "héllo wörld "
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 12,
                                                         "total_tokens": 14}


async def test_chat_stream_role_then_content(start):
    h = await start()
    response = await h.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    events = _events(await response.read())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "hél"
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["object"] == "chat.completion.chunk"
    assert all(e["usage"] is None for e in events)  # no usage chunk unless asked


async def test_several_prompts_times_n_index_the_choices(start):
    h = await start()
    body = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2}
    choices = (await (await h.client.post("/v1/completions", json=body)).json())["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["hé", "él", "hé", "él"]
    events = _events(await (await h.client.post("/v1/completions", json={**body, "stream": True})).read())
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "hé", 1: "él", 2: "hé", 3: "él"}
    ids = [r[0] for r in h.primary.requests if not r[0].startswith("warmup")]
    assert sorted(i.rsplit("-", 1)[1] for i in ids) == ["0", "0", "1", "1"]  # one engine request per prompt


async def test_request_id_echoed_or_made(start):
    h = await start()
    response = await h.client.post("/v1/completions", json={"prompt": "hi", "stream": True},
                                   headers={"X-Request-Id": "abc-123"})
    assert response.headers["X-Request-Id"] == "abc-123"
    response = await h.client.get("/health", headers={"X-Request-Id": "has spaces\tand tabs"})
    made = response.headers["X-Request-Id"]
    assert made != "has spaces\tand tabs" and len(made) == 32


async def test_degraded_to_the_fallback_says_so(start):
    h = await start()
    h.primary.is_dead = True
    response = await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    body = await response.json()
    assert body["model"] == "fallback"
    assert response.headers["x-pagedserve-served-model"] == "fallback"
    assert response.headers["x-pagedserve-degraded"] == "1"
    response = await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert response.headers["x-pagedserve-degraded"] == "1"
    assert {e["model"] for e in _events(await response.read())} == {"fallback"}


async def test_every_generation_goes_through_the_router(start):
    seen = []

    class RecordingRouter:
        def __init__(self, engines, fallbacks):
            self.engines = engines
            assert dict(fallbacks) == {"primary": "fallback", "fallback": None}

        async def generate(self, req):
            seen.append(req)
            async for output in self.engines["fallback"].generate(req.prompt, req.params, req.request_id):
                yield RoutedOutput(output, "fallback", True)

    h = await start(router_factory=RecordingRouter)
    response = await h.client.post("/v1/completions", json={"prompt": "hi", "priority": 3})
    assert response.headers["x-pagedserve-degraded"] == "1" and (await response.json())["model"] == "fallback"
    assert [(r.model, r.prompt, r.priority, r.deadline) for r in seen] == [("primary", "hi", 3, None)]
    assert seen[0].request_id.startswith("cmpl-") and seen[0].request_id.endswith("-0")


async def test_non_streamed_shapes(start):
    h = await start()
    body = await (await h.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
    })).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hé"} and choice["finish_reason"] == "length"
    first = choice["logprobs"]["content"][0]
    assert first == {"token": "h", "logprob": -0.5, "bytes": [104],
                     "top_logprobs": [{"token": "h", "logprob": -0.5, "bytes": [104]},
                                      {"token": "x", "logprob": -1.5, "bytes": [120]}]}
    body = await (await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                                "logprobs": 4})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["h", "é", "l"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["top_logprobs"][0] == {"h": -0.5, "x": -1.5, "y": -2.5, "z": -9999.0}  # no -inf in JSON
