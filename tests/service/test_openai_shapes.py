"""The official `openai` client parses every response and error of the in-process app (fake engines)."""

import openai
import pytest


@pytest.fixture
async def sdk(start):
    h = await start(api_keys=("k",))
    client = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="k", max_retries=0)
    yield client, h
    await client.close()


async def test_completions(sdk):
    client, _ = sdk
    done = await client.completions.create(model="primary", prompt="hi", max_tokens=3, logprobs=1)
    assert done.choices[0].text == "hél" and done.usage.completion_tokens == 3
    assert done.choices[0].logprobs.tokens == ["h", "é", "l"]
    stream = await client.completions.create(model="primary", prompt="hi", max_tokens=3, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hél"
    assert chunks[-1].usage.total_tokens == 5


async def test_chat(sdk):
    client, _ = sdk
    messages = [{"role": "user", "content": "hi"}]
    done = await client.chat.completions.create(model="fallback", messages=messages, max_tokens=2, n=2,
                                                logprobs=True, top_logprobs=1)
    assert [c.message.content for c in done.choices] == ["hé", "él"] and done.model == "fallback"
    assert done.choices[0].logprobs.content[0].top_logprobs[0].token == "h"
    stream = await client.chat.completions.create(model="primary", messages=messages, max_tokens=2, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "hé"


async def test_errors_become_sdk_exceptions(sdk):
    client, h = sdk
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.completions.create(model="primary", prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi")
    bad = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()
    h.primary.is_overloaded = True
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model="primary", prompt="hi")
    models = await client.models.list()
    assert [m.id for m in models.data] == ["primary", "fallback"]
