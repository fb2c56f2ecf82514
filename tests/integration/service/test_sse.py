"""SSE framing, chunk shapes, multi-prompt indexing, served-model headers, request ids: over real tiny
engines, with every text checked against what the engine itself generates greedily."""

import json
import math
import threading
import time

import pytest

from engine.faults import Fault
from resilience.router import ModelRouter
from service.api.sse import DONE, SSE_HEADERS, encode_event
from tests.harness import TINY, until


def _events(raw: bytes) -> list:
    text = raw.decode("utf-8")  # strict: broken UTF-8 raises
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: ") :]) for b in blocks[:-1]]


def test_event_framing():
    assert encode_event({"a": "你好🙂"}) == 'data: {"a":"你好🙂"}\n\n'.encode()
    assert encode_event({"t": "line\nbreak"}) == b'data: {"t":"line\\nbreak"}\n\n'  # never a raw newline
    numbers = {"p": 1e-05, "n": None, "l": [-9999.0, 0, 2**53]}
    assert (
        json.loads(encode_event(numbers)[6:]) == numbers and b" " not in encode_event(numbers)[6:]
    )  # compact
    # a lone surrogate (an echoed error message) cannot be UTF-8: escaped, and still JSON
    assert encode_event({"m": "bad \ud800"}) == b'data: {"m":"bad \\ud800"}\n\n'
    assert json.loads(encode_event({"m": "\ud800é"})[6:]) == {"m": "\ud800é"}
    assert DONE == b"data: [DONE]\n\n"
    assert SSE_HEADERS["Cache-Control"] == "no-cache" and SSE_HEADERS["X-Accel-Buffering"] == "no"


async def test_completion_stream(start):
    h = await start()
    response = await h.client.post(
        "/v1/completions",
        json={
            "prompt": "def add(a, b):",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["x-pagedserve-served-model"] == "primary"
    events = _events(await response.read())
    *chunks, usage = events
    assert {c["object"] for c in events} == {"text_completion"} and len({c["id"] for c in events}) == 1
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == await h.greedy("def add(a, b):", 12, ignore_eos=True) and text.strip()
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]
    num_prompt = len(h.primary.encode("def add(a, b):"))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 12,
        "total_tokens": num_prompt + 12,
    }


async def test_a_stream_interval_streams_the_same_text_in_fewer_events(start):
    h = await start(engine_kwargs={"stream_interval": 4})
    body = {
        "prompt": "def add(a, b):",
        "max_tokens": 13,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    *chunks, usage = _events(await (await h.client.post("/v1/completions", json=body)).read())
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == await h.greedy("def add(a, b):", 13, ignore_eos=True)
    # the first token at once, then 4 a chunk, the last 0 (13 = 1 + 3 x 4)
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [1, 4, 4, 4]
    assert choices[-1]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 13
    messages = [{"role": "user", "content": "sort a list"}]
    events = _events(
        await (
            await h.client.post(
                "/v1/chat/completions",
                json={
                    "messages": messages,
                    "max_tokens": 6,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
        ).read()
    )
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == await h.greedy(h.primary.apply_chat_template(messages), 6, ignore_eos=True)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "spec",
    [{"method": "ngram", "num_speculative_tokens": 4}, {"model": str(TINY), "num_speculative_tokens": 3}],
    ids=["ngram", "draft_model"],
)
async def test_speculative_drafts_stream_their_kept_tokens_and_count_them_on_metrics(start, spec):
    h = await start(engine_kwargs={"speculative_config": spec})
    prompt = "for i in range(10):\n    print(i)\nfor j in range(10):\n"
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    whole = (await (await h.client.post("/v1/completions", json=body)).json())["choices"][0]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    *chunks, usage = _events(await (await h.client.post("/v1/completions", json=body)).read())
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == usage["usage"]["completion_tokens"] == 40
    assert max(len(c["logprobs"]["tokens"]) for c in choices) > 1  # a kept draft: tokens of one step
    text = await (await h.client.get("/metrics")).text()
    counts = {
        name: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagedserve:spec_decode_num_") and 'model_name="primary"' in line
        for name in [line.split("{")[0].removeprefix("pagedserve:spec_decode_num_")]
    }
    assert counts["drafts_total"] > 0 and counts["draft_tokens_total"] >= counts["accepted_tokens_total"] > 0
    first = 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="primary",position="0"} '
    assert float(next(line for line in text.splitlines() if line.startswith(first))[len(first) :]) > 0
    # /health/ready says how each engine drafts: the method, and a draft model's load-time choice
    report = (await (await h.client.get("/health/ready")).json())["engines"]["primary"]["speculative"]
    assert report["method"] == ("draft_model" if "model" in spec else "ngram")
    assert report["num_speculative_tokens"] == spec["num_speculative_tokens"]
    if "model" in spec:
        assert report["chosen"] in report["step_ms"] and report["model"] == str(TINY)


async def test_chat_stream_role_then_content(start):
    h = await start()
    messages = [{"role": "user", "content": "sort a list"}]
    response = await h.client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    events = _events(await response.read())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == await h.greedy(h.primary.apply_chat_template(messages), 6, ignore_eos=True)
    assert (
        events[-1]["choices"][0]["finish_reason"] == "length"
        and events[-1]["object"] == "chat.completion.chunk"
    )
    assert all(e["usage"] is None for e in events)  # no usage chunk unless asked


async def test_several_prompts_times_n_index_the_choices(start):
    h = await start()
    prompts = ["def read(path):", "class Stack:"]
    expected = [await h.greedy(p, 4, ignore_eos=True) for p in prompts]
    assert expected[0] != expected[1]  # otherwise the index order below would prove nothing
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    choices = (await (await h.client.post("/v1/completions", json=body)).json())["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert h.state.router.num_engine_requests == {"primary": 2}  # one engine request per prompt, n inside it
    events = _events(await (await h.client.post("/v1/completions", json={**body, "stream": True})).read())
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    assert h.state.router.num_engine_requests == {"primary": 4}


async def test_request_id_echoed_or_made(start):
    h = await start()
    response = await h.client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "abc-123"},
    )
    assert response.headers["X-Request-Id"] == "abc-123"
    assert len(_events(await response.read())) >= 1
    response = await h.client.get("/health", headers={"X-Request-Id": "has spaces\tand tabs"})
    made = response.headers["X-Request-Id"]
    assert made != "has spaces\tand tabs" and len(made) == 32


async def test_degraded_to_the_fallback_says_so(start):
    gate = threading.Event()
    gate.set()
    h = await start(load_gate=gate)
    dead = h.primary
    gate.clear()  # holds the rebuild of the crashed primary, so the fallback must serve meanwhile
    try:
        dead.faults.inject(Fault("crash"))  # the primary's loop dies for real
        await until(lambda: dead.is_dead)
        expected = await h.greedy("hi", 2, name="fallback", ignore_eos=True)
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        response = await h.client.post("/v1/completions", json=body)
        done = await response.json()
        assert done["model"] == "fallback" and done["choices"][0]["text"] == expected
        assert response.headers["x-pagedserve-served-model"] == "fallback"
        assert response.headers["x-pagedserve-degraded"] == "1"
        response = await h.client.post("/v1/completions", json={**body, "stream": True})
        assert response.headers["x-pagedserve-degraded"] == "1"
        events = _events(await response.read())
        assert {e["model"] for e in events} == {"fallback"}
        assert "".join(e["choices"][0]["text"] for e in events) == expected
    finally:
        gate.set()


async def test_every_generation_goes_through_the_router(start):
    seen = []

    class RecordingRouter(ModelRouter):  # the real router, recording what the app hands it
        def __init__(self, engines, fallbacks) -> None:
            assert dict(fallbacks) == {"primary": "fallback", "fallback": None}
            super().__init__(engines, fallbacks)

        async def generate(self, req):
            seen.append(req)
            async for routed in super().generate(req):
                yield routed

    h = await start(router_factory=RecordingRouter)
    response = await h.client.post("/v1/completions", json={"prompt": "hi", "priority": 3, "max_tokens": 2})
    assert (
        response.headers["x-pagedserve-served-model"] == "primary"
        and "x-pagedserve-degraded" not in response.headers
    )
    assert (await response.json())["model"] == "primary"
    assert [(r.model, r.prompt, r.priority) for r in seen] == [("primary", "hi", 3)]
    assert 500 < seen[0].deadline - time.monotonic() <= 600  # --request-timeout's default 600 s, from arrival
    assert seen[0].request_id.startswith("cmpl-") and seen[0].request_id.endswith("-0")
    assert seen[0].params.max_tokens == 2


async def test_non_streamed_shapes(start):
    h = await start()
    messages = [{"role": "user", "content": "hi"}]
    body = await (
        await h.client.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "max_tokens": 3,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 2,
            },
        )
    ).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    expected = await h.greedy(h.primary.apply_chat_template(messages), 3, ignore_eos=True)
    assert (
        choice["message"] == {"role": "assistant", "content": expected}
        and choice["finish_reason"] == "length"
    )
    content = choice["logprobs"]["content"]
    assert len(content) == 3 and "".join(c["token"] for c in content) == expected
    for entry in content:  # greedy: the sampled token is the most likely one, listed first
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        first, second = entry["top_logprobs"]
        assert first["token"] == entry["token"] and math.isclose(
            first["logprob"], entry["logprob"], abs_tol=1e-4
        )
        assert 0 >= first["logprob"] >= second["logprob"]
    body = await (
        await h.client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 4},
        )
    ).json()
    logprobs = body["choices"][0]["logprobs"]
    tokens = logprobs["tokens"]
    assert "".join(tokens) == body["choices"][0]["text"] == await h.greedy("hi", 3, ignore_eos=True)
    assert logprobs["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(3)]
    for token, chosen, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 4 and max(top, key=top.get) == token
        assert all(-9999.0 <= v <= 0 and math.isfinite(v) for v in top.values())  # no -inf in JSON
        assert math.isclose(chosen, top[token], abs_tol=1e-4)
