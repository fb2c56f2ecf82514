"""The official `openai` client parses every response and error of the in-process app (real tiny engines)."""

import asyncio

import openai
import pytest

from engine.faults import Fault
from tests.service.conftest import until


@pytest.fixture
async def sdk(start):
    h = await start(api_keys=("k",))
    client = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="k", max_retries=0)
    yield client, h
    await client.close()


async def test_completions(sdk):
    client, h = sdk
    expected = await h.greedy("hi", 3, ignore_eos=True)
    greedy = dict(model="primary", prompt="hi", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    done = await client.completions.create(**greedy, logprobs=1)
    assert done.choices[0].text == expected and done.usage.completion_tokens == 3
    assert "".join(done.choices[0].logprobs.tokens) == expected and len(done.choices[0].logprobs.tokens) == 3
    stream = await client.completions.create(**greedy, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == len(h.primary.encode("hi")) + 3


async def test_chat(sdk):
    client, h = sdk
    messages = [{"role": "user", "content": "hi"}]
    expected = await h.greedy(h.engines["fallback"].apply_chat_template(messages), 2, name="fallback",
                              ignore_eos=True)
    done = await client.chat.completions.create(model="fallback", messages=messages, max_tokens=2, n=2,
                                                temperature=0, logprobs=True, top_logprobs=1,
                                                extra_body={"ignore_eos": True})
    assert [c.message.content for c in done.choices] == [expected, expected] and done.model == "fallback"
    first = done.choices[0].logprobs.content[0]
    assert first.top_logprobs[0].token == first.token and expected.startswith(first.token)
    stream = await client.chat.completions.create(model="primary", messages=messages, max_tokens=2, stream=True,
                                                  temperature=0, extra_body={"ignore_eos": True})
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == await h.greedy(h.primary.apply_chat_template(messages), 2, ignore_eos=True)


async def test_errors_become_sdk_exceptions(sdk):
    client, h = sdk
    with pytest.raises(openai.BadRequestError, match="temperature must be non-negative"):
        await client.completions.create(model="primary", prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        await client.completions.create(model="nope", prompt="hi")
    bad = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        await bad.models.list()
    await bad.close()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["primary", "fallback"]


async def test_overload_becomes_rate_limit_error(start):
    # one running slot, one waiting slot: a third request finds the real engine's queue full
    h = await start(api_keys=("k",), engine_kwargs={"max_num_seqs": 1, "max_num_waiting": 1})
    client = openai.AsyncOpenAI(base_url=str(h.client.make_url("/v1")), api_key="k", max_retries=0)
    long = dict(model="primary", prompt="def f(x):", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    running = await client.completions.create(**long)
    await anext(running)
    waiting = asyncio.create_task(client.completions.create(**long))
    await until(lambda: h.primary.stats().num_waiting == 1)
    with pytest.raises(openai.RateLimitError, match="waiting queue is full"):
        await client.completions.create(model="primary", prompt="hi")
    await running.close()
    await (await waiting).close()
    await until(h.idle)
    await client.close()
