"""A real server process with the shipped models (small primary, tiny fallback), driven by the official
`openai` client (sync and async) and by raw HTTP for every error case."""

import asyncio
import importlib.metadata
import json
import re
import time

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from tests.harness import API_KEY, BOS_ID, SMALL, TINY, require_models
from tests.system.server import launch

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "def read_lines(path):\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_models(SMALL, TINY)
    # two sequences per model, so a third request queues (disconnect-while-queued test)
    srv = launch(
        ["--model", str(SMALL), "--fallback", str(TINY), "--api-key", API_KEY, "--max-num-seqs", "2"],
        tmp_path_factory.mktemp("server-api") / "server.log",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]  # SIGTERM: graceful shutdown, exit 0
    assert "shutting down" in srv.log()


@pytest.fixture(scope="module")
def sdk(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield client
    client.close()


@pytest.fixture
async def async_sdk(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield client
    await client.close()


def test_loading_answers_503_with_retry_after(server):
    assert server.startup["status"] == 503 and server.startup["retry_after"] == "5"
    assert server.startup["body"]["error"]["code"] == "model_loading"


def test_models_health_version(server, sdk):
    models = sdk.models.list().data
    assert [m.id for m in models] == [SMALL.name, TINY.name]  # configuration order
    assert [(m.object, m.owned_by, m.fallback, m.max_model_len) for m in models] == [
        ("model", "pagedserve", TINY.name, 2048),
        ("model", "pagedserve", None, 2048),
    ]
    status, _, body = server.get("/health/live")
    assert (status, json.loads(body)) == (200, {"status": "live"})
    for path in ("/health", "/health/ready"):
        status, _, body = server.get(path)
        ready = json.loads(body)
        assert status == 200 and ready["status"] == "ready", (path, ready)
        assert ready["models"] == {SMALL.name: "ready", TINY.name: "ready"} and not ready["draining"]
        assert ready["leak"] is None and not ready["degraded"]
    status, _, body = server.get("/version")
    assert (status, json.loads(body)) == (200, {"version": importlib.metadata.version("pagedserve")})


def test_sync_completion(sdk):
    done = sdk.completions.create(model=TINY.name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.object == "text_completion" and done.model == TINY.name and done.id.startswith("cmpl-")
    assert done.choices[0].finish_reason in ("stop", "length") and done.choices[0].text
    assert 1 <= done.usage.completion_tokens <= 12 and done.usage.prompt_tokens > 0
    assert (done.choices[0].finish_reason == "length") == (done.usage.completion_tokens == 12)
    default_model = sdk.completions.create(model=SMALL.name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert default_model.model == SMALL.name


def test_streamed_text_equals_the_whole_text(sdk):
    args = dict(model=TINY.name, prompt=PROMPT, max_tokens=16, temperature=0)
    whole = sdk.completions.create(**args)
    chunks = list(sdk.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


async def test_async_chat(async_sdk):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "sort a list"},
    ]
    done = await async_sdk.chat.completions.create(
        model=TINY.name, messages=messages, max_tokens=12, temperature=0
    )
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content and done.model == TINY.name
    stream = await async_sdk.chat.completions.create(
        model=TINY.name, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content


async def test_async_completions_concurrently(async_sdk):
    results = await asyncio.gather(
        *[
            async_sdk.completions.create(
                model=TINY.name,
                prompt=f"x = {i}\n",
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for i in range(6)
        ]
    )
    assert [(r.model, r.choices[0].finish_reason, r.usage.completion_tokens) for r in results] == [
        (TINY.name, "length", 8)
    ] * 6
    assert len({r.id for r in results}) == 6


def test_n_and_several_prompts(sdk):
    ignore_eos = {"ignore_eos": True}
    done = sdk.completions.create(
        model=TINY.name, prompt=PROMPT, max_tokens=8, n=2, seed=5, extra_body=ignore_eos
    )
    assert [c.index for c in done.choices] == [0, 1] and done.usage.completion_tokens == 16
    prompts = ["import os\n", "class A:\n"]
    done = sdk.completions.create(
        model=TINY.name, prompt=prompts, max_tokens=4, n=2, temperature=0, extra_body=ignore_eos
    )
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    alone = [
        sdk.completions.create(model=TINY.name, prompt=p, max_tokens=4, temperature=0, extra_body=ignore_eos)
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.text for c in done.choices] == [
        alone[0],
        alone[0],
        alone[1],
        alone[1],
    ]  # choice i: prompt i // n
    chat = sdk.chat.completions.create(
        model=TINY.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=2,
        extra_body=ignore_eos,
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


def test_n_samples_differ_and_a_seed_fixes_them(sdk):
    # n=2: this server runs --max-num-seqs 2, and a request's n samples run side by side
    args = dict(
        model=TINY.name,
        prompt=PROMPT,
        max_tokens=16,
        n=2,
        temperature=1.0,
        top_p=0.9,
        seed=11,
        extra_body={"ignore_eos": True, "min_p": 0.01, "top_k": 100},
    )
    texts = [c.text for c in sdk.completions.create(**args).choices]
    assert len(set(texts)) == 2, texts  # n draws, not one draw copied n times
    assert [c.text for c in sdk.completions.create(**args).choices] == texts


async def test_mixed_sampling_parameters_in_one_batch(server, async_sdk):
    """Rows that filter differently share steps (once a crash: min_p broadcast as [B, B]); every request
    is served by the model it asked, filters that keep one token give the greedy text, and no step had
    to be re-run by poison isolation (which would hide such a bug from the client, not from /metrics)."""
    base = dict(model=TINY.name, prompt=PROMPT, max_tokens=16, temperature=1.0)
    greedy = (
        (await async_sdk.completions.create(**{**base, "temperature": 0}, extra_body={"ignore_eos": True}))
        .choices[0]
        .text
    )
    isolated = server.metric("isolated_steps_total", TINY.name)

    def create(extra: dict | None = None, **params):
        return async_sdk.completions.create(
            **{**base, **params}, extra_body={"ignore_eos": True, **(extra or {})}
        )

    results = await asyncio.gather(
        create({"top_k": 1}, seed=1),
        create({"min_p": 1.0}, seed=2),
        create(top_p=1e-6, seed=3),
        create(n=2, top_p=0.9, seed=4),
        create({"top_k": 40, "min_p": 0.05}, top_p=0.95, seed=5),
        create(seed=6),
    )
    assert [r.model for r in results] == [TINY.name] * 6
    assert [r.choices[0].text for r in results[:3]] == [greedy] * 3
    assert [r.usage.completion_tokens for r in results] == [16, 16, 16, 32, 16, 16]
    assert server.metric("isolated_steps_total", TINY.name) == isolated


def test_stop_strings(sdk):
    args = dict(model=TINY.name, prompt=PROMPT, max_tokens=24, temperature=0)
    text = sdk.completions.create(**args).choices[0].text
    stop = text.strip()[3:6] if len(text.strip()) >= 6 else text[:1]
    assert stop, f"greedy text too short to cut: {text!r}"
    cut = sdk.completions.create(**args, stop=[stop]).choices[0]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"


def test_seed_reproduces(sdk):
    args = dict(model=TINY.name, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95)
    first = [sdk.completions.create(**args, seed=1234).choices[0].text for _ in range(2)]
    assert first[0] == first[1]
    texts = {sdk.completions.create(**args, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(texts) > 1  # different seeds sample differently


def test_logprobs(sdk):
    done = sdk.completions.create(model=TINY.name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(lp.token_logprobs[i] >= max(lp.top_logprobs[i].values()) - 1e-4 for i in range(6))
    chat = sdk.chat.completions.create(
        model=TINY.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)


MULTIBYTE = "(你好|世界|🙂|🎉|ü|日本語)"


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "multibyte-regex"])
async def test_multibyte_stream_is_valid_utf8(server, constrained):
    """Free: whatever the model writes after a multi-byte prompt. Constrained: the output is made of
    multi-byte characters only (a guided regex), each split over several byte-level tokens."""
    prompt = "# 你好，世界 🙂🎉 ünïcödé\ns = '日本語のテキスト🚀"
    body = {"model": TINY.name, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    if constrained:
        body.update(guided_regex=MULTIBYTE + "{6,12}", max_tokens=200)  # room for 12 of the longest
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(f"{server.url}/v1/completions", json=body) as response:
            whole = (await response.json())["choices"][0]["text"]
        async with session.post(f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
            raw = await response.read()
    events = raw.decode("utf-8").strip().split("\n\n")  # strict decode: broken UTF-8 raises
    assert events[-1] == "data: [DONE]"
    deltas = [json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(deltas) == whole and whole
    if constrained:
        assert re.fullmatch(MULTIBYTE + "{6,12}", whole), whole
    # a multi-byte character split across tokens is held back until it is whole, never sent as U+FFFD
    assert "\ufffd" not in whole and not any("\ufffd" in d for d in deltas), deltas


def test_served_model_headers_and_request_id(server):
    status, headers, body = server.post(
        "/v1/completions", {"model": TINY.name, "prompt": "x", "max_tokens": 2}, {"X-Request-Id": "it-req-7"}
    )
    assert status == 200 and headers["x-pagedserve-served-model"] == TINY.name
    assert "x-pagedserve-degraded" not in headers and headers["X-Request-Id"] == "it-req-7"
    time.sleep(0.1)
    line = next(line for line in server.log().splitlines() if "request_id=it-req-7" in line)
    assert "status=200" in line and f"model={TINY.name}" in line and "completion_tokens=2" in line
    assert "ttft_s=" in line and "total_s=" in line and API_KEY not in server.log()


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens must be an integer"),
        ({"prompt": "x", "temperature": -0.5}, 400, "temperature must be non-negative"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]"),
        ({"prompt": "x", "n": 0}, 400, "n must be at least 1"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "maximum context length is"),
        ({"prompt": "x", "model": "no-such-model"}, 404, "does not exist"),
    ],
)
def test_error_cases(server, body, status, fragment):
    got, headers, raw = server.post("/v1/completions", body)
    error = json.loads(raw)["error"]
    assert got == status and fragment in error["message"], raw
    assert set(error) == {"message", "type", "param", "code"}


def test_context_error_says_the_numbers(server):
    status, _, raw = server.post("/v1/completions", {"model": TINY.name, "prompt": "x", "max_tokens": 100000})
    message = json.loads(raw)["error"]["message"]
    assert status == 400 and "100001" in message and "100000 to generate" in message


def test_auth_errors(server):
    status, _, raw = server.post("/v1/completions", {"prompt": "x"}, {"Authorization": ""})
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    status, headers, raw = server.post("/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer nope"})
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(raw)["error"]["type"] == "authentication_error"
    assert server.get("/metrics")[0] == 200 and server.get("/health")[0] == 200  # open


def test_body_over_4_mib_is_413(server):
    status, _, raw = server.post("/v1/completions", b'{"prompt": "' + b"x" * (4 * 2**20) + b'"}')
    assert status == 413 and "too large" in json.loads(raw)["error"]["message"]


def test_metrics_after_traffic(server, sdk):
    sdk.completions.create(model=TINY.name, prompt=PROMPT, max_tokens=3)
    _, _, body = server.get("/metrics")
    text = body.decode()
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
    ):
        assert f'pagedserve:{name}{{model_name="{TINY.name}"}}' in text, name
    assert f'pagedserve:request_success_total{{finished_reason="length",model_name="{TINY.name}"}}' in text
    assert 'pagedserve:http_requests_total{method="POST",route="/v1/completions",status="200"}' in text


async def test_disconnect_mid_stream_frees_everything_within_a_second(server):
    body = {"model": TINY.name, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        response = await session.post(f"{server.url}/v1/completions", json=body)
        await response.content.readline()
        await _until(lambda: server.metric("num_requests_running", TINY.name) == 1)
        response.close()
        closed = time.monotonic()
    await _until(lambda: _idle(server, TINY.name), timeout=1.0)
    assert time.monotonic() - closed < 1.0


async def test_disconnect_while_queued_frees_everything(server):
    long = {"model": TINY.name, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        running = [
            await session.post(f"{server.url}/v1/completions", json=long) for _ in range(2)
        ]  # both slots
        for response in running:
            await response.content.readline()
        queued = asyncio.create_task(session.post(f"{server.url}/v1/completions", json=long))
        await _until(lambda: server.metric("num_requests_waiting", TINY.name) == 1)
        queued.cancel()  # the client gives up while its request waits in the queue
        await _until(lambda: server.metric("num_requests_waiting", TINY.name) == 0, timeout=1.0)
        assert server.metric("num_requests_running", TINY.name) == 2
        for response in running:
            response.close()
    await _until(lambda: _idle(server, TINY.name), timeout=1.0)


def _idle(server, model: str) -> bool:
    return all(
        server.metric(name, model) == 0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.05)


async def test_completions_add_the_bos_as_hf_does_unless_asked_not_to(start, bos_model):
    """prompt_tokens counts the tokenizer's BOS (Llama 2/3 and Mistral add one: HF counts 10 where the
    server counted 9); add_special_tokens false gives the text alone; chat keeps its template's own."""
    h = await start(fallback_dir=bos_model)
    text = "def add(a, b):\n    return"
    expected = AutoTokenizer.from_pretrained(bos_model)(text).input_ids
    assert expected[0] == BOS_ID
    body = {"model": "fallback", "prompt": text, "max_tokens": 2, "temperature": 0}
    usage = (await (await h.client.post("/v1/completions", json=body)).json())["usage"]
    assert usage["prompt_tokens"] == len(expected)
    plain = (
        await (await h.client.post("/v1/completions", json={**body, "add_special_tokens": False})).json()
    )["usage"]
    assert plain["prompt_tokens"] == len(expected) - 1
    tokens = (await (await h.client.post("/tokenize", json={"model": "fallback", "prompt": text})).json())[
        "tokens"
    ]
    assert tokens == expected
    chat = (
        await (
            await h.client.post(
                "/tokenize", json={"model": "fallback", "messages": [{"role": "user", "content": "hi"}]}
            )
        ).json()
    )["tokens"]
    assert chat[0] == BOS_ID and chat[1] != BOS_ID
