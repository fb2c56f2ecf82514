"""The official `openai` client parses every response and error of the in-process app (real tiny engines),
and the sampling parameters it sends work, alone and mixed in one batch (a mixed batch once crashed the
sampler: min_p broadcast as [B, B])."""

import asyncio

import openai
import pytest

from engine.faults import Fault
from tests.harness import until


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
    expected = await h.greedy(
        h.engines["fallback"].apply_chat_template(messages), 2, name="fallback", ignore_eos=True
    )
    done = await client.chat.completions.create(
        model="fallback",
        messages=messages,
        max_tokens=2,
        n=2,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert [c.message.content for c in done.choices] == [expected, expected] and done.model == "fallback"
    first = done.choices[0].logprobs.content[0]
    assert first.top_logprobs[0].token == first.token and expected.startswith(first.token)
    stream = await client.chat.completions.create(
        model="primary",
        messages=messages,
        max_tokens=2,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
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
    long = dict(
        model="primary", prompt="def f(x):", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    running = await client.completions.create(**long)
    await anext(running)
    waiting = asyncio.create_task(client.completions.create(**long))
    await until(lambda: h.primary.stats().num_waiting == 1)
    # the bulkhead holds what the engine holds, so it refuses what the engine's queue would
    with pytest.raises(openai.RateLimitError, match="at capacity: .* sequences exceed"):
        await client.completions.create(model="primary", prompt="hi")
    await running.close()
    await (await waiting).close()
    await until(h.idle)
    await client.close()


PROMPT = "def read_lines(path):"


async def _counters(h, model: str = "primary") -> dict[str, float]:
    """The primary's poison-isolation counters, as an operator reads them on /metrics."""
    text = await (await h.client.get("/metrics")).text()
    counters = {}
    for name in ("isolated_steps_total", "requests_failed_in_engine_total"):
        prefix = f'pagedserve:{name}{{model_name="{model}"}} '
        counters[name] = float(
            next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :]
        )
    return counters


async def test_sampling_parameters_mixed_in_one_batch(sdk):
    """Requests that filter differently run in the same steps; each row keeps its own filter. Filters that
    leave one token (top_k 1, a tiny top_p, min_p 1) must give the greedy text even at temperature 1."""
    client, h = sdk
    expected = await h.greedy(PROMPT, 16, ignore_eos=True)
    h.primary.faults.inject(Fault("slow", delay_ms=10))  # 16 spaced steps: the 6 requests surely overlap
    base = dict(model="primary", prompt=PROMPT, max_tokens=16, temperature=1.0)

    def create(**params):
        extra = {k: params.pop(k) for k in ("top_k", "min_p") if k in params}
        return client.completions.create(**{**base, **params}, extra_body={"ignore_eos": True, **extra})

    results = await asyncio.gather(
        create(top_k=1, seed=1),
        create(top_p=1e-6, seed=2),
        create(min_p=1.0, seed=3),
        create(temperature=0),
        create(n=2, top_p=0.9, seed=4),
        create(top_k=50, min_p=0.05, top_p=0.95, seed=5),
    )
    assert all(
        r.model == "primary" for r in results
    )  # served by the primary, not failed over to the fallback
    assert [r.choices[0].text for r in results[:4]] == [expected] * 4
    assert [len(r.choices) for r in results] == [1, 1, 1, 1, 2, 1]
    assert [r.usage.completion_tokens for r in results] == [16, 16, 16, 16, 32, 16]
    assert all(c.finish_reason == "length" for r in results for c in r.choices)
    await until(h.idle)
    # every step ran whole: a step that raised would have been re-run in parts (poison isolation), which
    # hides a sampler bug from the client but not from /metrics
    assert await _counters(h) == {"isolated_steps_total": 0, "requests_failed_in_engine_total": 0}
    assert not h.primary.is_dead


async def test_n_with_top_p_streams_every_choice(sdk):
    client, h = sdk
    stream = await client.completions.create(
        model="primary",
        prompt=PROMPT,
        max_tokens=12,
        n=2,
        top_p=0.9,
        seed=9,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    finish = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert chunk.model == "primary" and finish == {0: "length", 1: "length"}
    assert all(len(h.primary.encode(t)) >= 1 for t in texts.values()), texts
    await until(h.idle)
    assert (await _counters(h))[
        "isolated_steps_total"
    ] == 0  # no step raised (two rows of one request, top_p)


async def test_top_k_alone_keeps_the_loop_alive(sdk):
    client, h = sdk
    expected = await h.greedy(PROMPT, 8, ignore_eos=True)
    for top_k in (1, 1, 5):  # one request at a time: a batch of one row
        done = await client.completions.create(
            model="primary",
            prompt=PROMPT,
            max_tokens=8,
            seed=top_k,
            extra_body={"ignore_eos": True, "top_k": top_k},
        )
        assert done.model == "primary" and done.usage.completion_tokens == 8
        if top_k == 1:
            assert done.choices[0].text == expected
    assert not h.primary.is_dead and not h.engines["fallback"].is_dead
    assert h.state.router.num_engine_requests == {"primary": 3}  # nothing failed over
    await until(h.idle)
    assert (await _counters(h))["isolated_steps_total"] == 0


async def test_fan_out_draws_n_different_samples(sdk):
    client, _ = sdk
    # the random-weight fallback: near-uniform logits, so 4 samples of 8 tokens are surely all different
    done = await client.completions.create(
        model="fallback",
        prompt=PROMPT,
        max_tokens=8,
        n=4,
        temperature=1.0,
        seed=21,
        extra_body={"ignore_eos": True},
    )
    texts = [c.text for c in done.choices]
    assert len(set(texts)) == 4, texts
    again = await client.completions.create(
        model="fallback",
        prompt=PROMPT,
        max_tokens=8,
        n=4,
        temperature=1.0,
        seed=21,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == texts  # the seed fixes all four
