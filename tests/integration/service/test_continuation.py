"""Streams that outlive an engine fault (resilience/router.py's continuation), through the official
`openai` client and raw SSE on the in-process app over real tiny engines: the primary's loop is
crashed for real mid-stream and rebuilt; every stream ends without an error, its text the undisturbed
run's, character for character, each token counted once."""

import asyncio
import json

import openai
import pytest

from engine.faults import Fault
from tests.harness import until

PROMPT = "def parse(text):"
CASES = {  # name -> completion fields; each runs to its max_tokens (the JSON one to its closing brace)
    "greedy": dict(temperature=0, max_tokens=48),
    "seeded-n2-logprobs": dict(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=40, logprobs=1),
    "json": dict(
        temperature=0.7,
        seed=3,
        max_tokens=64,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "p",
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
                        "required": ["name", "n"],
                        "additionalProperties": False,
                    },
                },
            }
        },
    ),
}


async def _stream(client, fields: dict) -> tuple[dict[int, str], dict[int, list], int]:
    """Per choice its text and its logprob tokens, and the completion tokens the usage counts."""
    extra = {"ignore_eos": True, **fields.get("extra_body", {})}  # a finished grammar ends the JSON case
    options = {k: v for k, v in fields.items() if k != "extra_body"}
    stream = await client.completions.create(
        model="primary",
        prompt=PROMPT,
        stream=True,
        extra_body=extra,
        stream_options={"include_usage": True},
        **options,
    )
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    usage = 0
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return texts, tokens, usage


@pytest.mark.parametrize("case", CASES)
async def test_a_stream_continues_across_an_engine_crash(sdk, case):
    client, h = sdk
    fields = CASES[case]
    expected = await _stream(client, fields)  # undisturbed, on the same engine
    h.primary.faults.inject(Fault("slow", delay_ms=30))  # spaces the steps: the crash lands mid-stream
    dying = h.primary
    before = dying.engine.num_generation_tokens
    task = asyncio.create_task(_stream(client, fields))
    await until(lambda: dying.engine.num_generation_tokens - before >= 8 * fields.get("n", 1) + 1)
    dying.faults.inject(Fault("crash"))
    got = await task
    assert got == expected
    assert dying.is_dead and h.primary is not dying  # rebuilt: the rest came from the new engine
    assert h.state.router.num_continuations == {("primary", "engine_dead", "primary"): 1}
    if case == "json":
        reply = json.loads(got[0][0])
        assert set(reply) == {"name", "n"}
    await until(lambda: h.idle())


async def test_the_stream_says_where_it_continued(start):
    """An SSE comment names the model the rest comes from; the chunks stay one stream (no error event)."""
    h = await start()
    h.primary.faults.inject(Fault("slow", delay_ms=30))
    dying = h.primary
    response = await h.client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    await until(lambda: dying.engine.num_generation_tokens >= 5)
    dying.faults.inject(Fault("crash"))
    raw = (await response.read()).decode()
    assert ": continued on primary (engine_dead)\n\n" in raw
    events = [e for e in raw.strip().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    scrape = await (await h.client.get("/metrics")).text()
    assert (
        'pagedserve:continuations_total{model_name="primary",reason="engine_dead",to="primary"} 1.0' in scrape
    )


async def test_without_continuations_the_fault_is_the_clients_error(start):
    h = await start(max_continuations=0)
    h.primary.faults.inject(Fault("slow", delay_ms=30))
    dying = h.primary
    async with openai.AsyncOpenAI(
        base_url=f"{h.client.make_url('/v1')}", api_key="x", max_retries=0
    ) as client:
        stream = await client.completions.create(
            model="primary", prompt=PROMPT, max_tokens=40, stream=True, extra_body={"ignore_eos": True}
        )
        await until(lambda: dying.engine.num_generation_tokens >= 5)
        dying.faults.inject(Fault("crash"))
        with pytest.raises(openai.APIError, match="engine"):
            async for _ in stream:
                pass
    assert not h.state.router.num_continuations


async def test_unloading_a_model_continues_its_streams_on_the_fallback_at_once(start):
    """32 streams in flight: no wait for them to finish, the engine stops at once and each stream goes on on
    the fallback (the same tokenizer) from the tokens it delivered; the unload itself is done within 2 s."""
    h = await start()
    h.primary.faults.inject(Fault("slow", delay_ms=30))
    body = {
        "prompt": PROMPT,
        "max_tokens": 60,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    responses = await asyncio.gather(*(h.client.post("/v1/completions", json=body) for _ in range(32)))
    await until(lambda: h.primary.engine.num_generation_tokens >= 32 * 5)
    started = asyncio.get_running_loop().time()
    await h.state.registry.unload("primary")
    assert asyncio.get_running_loop().time() - started < 2.0
    for response in responses:
        raw = (await response.read()).decode()
        assert ": continued on fallback (stopped)\n\n" in raw
        events = [json.loads(e[6:]) for e in raw.strip().split("\n\n") if e.startswith("data: {")]
        assert not any("error" in e for e in events)
        assert events[-1]["usage"]["completion_tokens"] == 60
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert h.state.router.num_continuations == {("primary", "stopped", "fallback"): 32}
    await until(lambda: h.idle("fallback"))


async def test_a_poison_request_is_quarantined_and_never_continued(start):
    """Isolated as the poison of a step: 500 request_failed, not continued; sent again, a 422
    request_quarantined before any engine sees it; changed, it is a new request."""
    h = await start()
    h.primary.faults.inject(Fault("poison", marker="POISON-PILL"))
    body = {"prompt": "x = 'POISON-PILL'", "max_tokens": 4}
    first = await h.client.post("/v1/completions", json=body)
    assert first.status == 500 and (await first.json())["error"]["code"] == "request_failed"
    assert not h.state.router.num_continuations
    prompts_before = h.primary.engine.num_prompt_tokens
    again = await h.client.post("/v1/completions", json=body)
    error = (await again.json())["error"]
    assert again.status == 422 and error["code"] == "request_quarantined", error
    assert h.primary.engine.num_prompt_tokens == prompts_before  # the engine never saw it
    changed = await h.client.post("/v1/completions", json={**body, "max_tokens": 5})
    assert changed.status == 500
    scrape = await (await h.client.get("/metrics")).text()
    assert "pagedserve:requests_quarantined_total 1.0" in scrape


async def test_a_mixed_load_survives_two_crashes(sdk):
    """Eight concurrent streams of every kind while the primary's engine is crashed twice (the second
    time, its rebuilt engine): none ends with an error, each text is the undisturbed run's, and
    continuations_total counts the streams in flight at each crash."""
    client, h = sdk
    kinds = [
        CASES["greedy"],
        CASES["seeded-n2-logprobs"],
        CASES["json"],
        dict(temperature=1.0, seed=9, max_tokens=48, stop=["):", "\n\n"]),
    ] * 2
    expected = await asyncio.gather(*(_stream(client, fields) for fields in kinds))
    in_flight = []
    h.primary.faults.inject(Fault("slow", delay_ms=40))
    tasks = [asyncio.create_task(_stream(client, fields)) for fields in kinds]
    for crash in range(2):
        if crash:  # the rebuilt engine: slowed as well, so the second crash lands mid-stream too
            h.primary.faults.inject(Fault("slow", delay_ms=40))
        dying, before = h.primary, h.primary.engine.num_generation_tokens
        await until(lambda d=dying, b=before: d.engine.num_generation_tokens - b >= 24)
        in_flight.append(dying.num_in_flight)
        dying.faults.inject(Fault("crash"))
        await until(lambda d=dying: h.engines.get("primary") not in (None, d), timeout=30)
    assert await asyncio.gather(*tasks) == expected
    assert h.state.router.num_continuations == {("primary", "engine_dead", "primary"): sum(in_flight)}
    await until(lambda: h.idle())
