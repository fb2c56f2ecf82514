"""The common OpenAI/vLLM surface beyond completions and chat, through the official `openai` client and
raw HTTP on in-process apps over real tiny engines: GET /v1/models/{id}, /tokenize and /detokenize,
CORS, logit_bias, echo, clear 400s for the vLLM fields we do not implement, and the per-request
metric series."""

import re

import openai
import pytest

from service.cli import build_config, build_parser

ORIGIN = "https://app.example.com"
KEY = {"Authorization": "Bearer k"}


async def _post(h, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    resp = await h.client.post(path, json=body, headers={**KEY, **(headers or {})})
    return resp.status, await resp.json()


# --- GET /v1/models/{id} ----------------------------------------------------------------------------
async def test_models_retrieve(sdk):
    client, h = sdk
    model = await client.models.retrieve("fallback")
    assert (model.id, model.object, model.owned_by) == ("fallback", "model", "pagedserve")
    assert model.model_extra["max_model_len"] == h.engines["fallback"].max_model_len
    listed = await client.models.list()
    assert (await client.models.retrieve("primary")).model_dump() == listed.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist") as info:
        await client.models.retrieve("nope")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    resp = await h.client.get("/v1/models/primary")
    assert resp.status == 401  # guarded like every /v1 route


# --- /tokenize, /detokenize ---------------------------------------------------------------------------
async def test_tokenize_and_detokenize_round_trip(start):
    h = await start(api_keys=("k",))
    prompt = "def add(a, b):\n    return a + b"
    status, body = await _post(h, "/tokenize", {"model": "primary", "prompt": prompt})
    tokens = h.primary.encode(prompt)
    assert status == 200 and body == {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": h.primary.max_model_len,
    }
    status, body = await _post(h, "/detokenize", {"model": "primary", "tokens": tokens})
    assert (status, body) == (200, {"prompt": prompt})
    messages = [{"role": "user", "content": "hi"}]
    status, body = await _post(h, "/tokenize", {"model": "fallback", "messages": messages})
    expected = h.engines["fallback"].encode(h.engines["fallback"].apply_chat_template(messages))
    assert status == 200 and body["tokens"] == expected and body["count"] == len(expected)
    status, body = await _post(h, "/tokenize", {"prompt": "x"})  # no model: the primary
    assert status == 200 and body["tokens"] == h.primary.encode("x")


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "primary"}, 400, "prompt"),
        ("/tokenize", {"model": "primary", "prompt": 5}, 400, "prompt"),
        (
            "/tokenize",
            {"model": "primary", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            400,
            "prompt",
        ),
        (
            "/tokenize",
            {"model": "primary", "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        ("/tokenize", {"model": 5, "prompt": "x"}, 400, "model"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "primary"}, 400, "tokens"),
        ("/detokenize", {"model": "primary", "tokens": [1, "2"]}, 400, "tokens"),
        ("/detokenize", {"model": "primary", "tokens": [1, True]}, 400, "tokens"),
        ("/detokenize", {"model": "primary", "tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"model": "primary", "tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"model": "primary", "tokens": [10**40]}, 400, "tokens"),
    ],
)
async def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(start, path, body, status, param):
    h = await start(api_keys=("k",))
    got, answer = await _post(h, path, body)
    assert got == status and answer["error"]["param"] == param, answer


async def test_tokenizer_endpoints_need_the_api_key_and_json(start):
    h = await start(api_keys=("k",))
    for path in ("/tokenize", "/detokenize"):
        resp = await h.client.post(path, json={"prompt": "x", "tokens": [1]})
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await h.client.post(path, json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
        assert resp.status == 401
        resp = await h.client.post(path, data="prompt=x", headers={**KEY, "Content-Type": "text/plain"})
        assert resp.status == 415
    open_app = await start()
    resp = await open_app.client.post("/tokenize", json={"prompt": "x"})
    assert resp.status == 200


# --- CORS -------------------------------------------------------------------------------------------
def _preflight(origin: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }


async def test_no_cors_by_default(start):
    h = await start(api_keys=("k",))
    resp = await h.client.options("/v1/chat/completions", headers=_preflight(ORIGIN))
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"
    resp = await h.client.get("/v1/models", headers={**KEY, "Origin": ORIGIN})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await h.client.options("/v1/models")  # a plain OPTIONS, no browser involved
    assert resp.status == 204 and resp.headers["Allow"] == "GET, POST, OPTIONS"


async def test_cors_for_allowed_origins(start):
    h = await start(api_keys=("k",), allowed_origins=(ORIGIN,))
    resp = await h.client.options(
        "/v1/chat/completions", headers=_preflight(ORIGIN)
    )  # no key: preflights carry none
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert resp.headers["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert resp.headers["Vary"] == "Origin"
    resp = await h.client.options("/tokenize", headers=_preflight(ORIGIN))
    assert resp.status == 204
    resp = await h.client.options("/v1/completions", headers=_preflight("https://evil.example.com"))
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await h.client.get("/v1/models", headers={**KEY, "Origin": ORIGIN})
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"]
    resp = await h.client.get("/v1/models", headers={"Origin": ORIGIN})  # errors too: the page can read them
    assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    resp = await h.client.post(
        "/v1/completions",
        headers={**KEY, "Origin": ORIGIN},
        json={"model": "primary", "prompt": "hi", "max_tokens": 2, "stream": True},
    )
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    await resp.read()
    resp = await h.client.get("/health", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in resp.headers  # only the API


async def test_cors_any_origin(start):
    h = await start(allowed_origins=("*",))
    resp = await h.client.options("/v1/models", headers=_preflight("http://localhost:3000"))
    assert resp.status == 204 and resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"


def test_allowed_origins_flag():
    args = build_parser().parse_args(
        ["serve", "--allowed-origins", ORIGIN, "--allowed-origins", "http://a:1"]
    )
    assert build_config(args, {}).allowed_origins == (ORIGIN, "http://a:1")
    assert build_config(build_parser().parse_args(["serve"]), {}).allowed_origins == ()
    from service.config import ConfigError

    with pytest.raises(ConfigError, match="allowed_origins must be"):
        build_config(build_parser().parse_args(["serve", "--allowed-origins", "app.example.com/x"]), {})


# --- logit_bias -----------------------------------------------------------------------------------
async def test_logit_bias_steers_generation(sdk):
    client, h = sdk
    token_id = h.primary.encode(" banana")[0]
    greedy = dict(model="primary", prompt="def", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    done = await client.completions.create(**greedy, logit_bias={str(token_id): 100})
    assert h.primary.encode(done.choices[0].text) == [token_id] * 3
    # the generated tokens, not the text encoded again ("_" three times reads back as "__", "_")
    plain = await client.completions.create(**greedy, logprobs=0)
    banned_text = plain.choices[0].logprobs.tokens[0]
    [banned] = h.primary.encode(banned_text)
    done = await client.completions.create(**greedy, logprobs=0, logit_bias={str(banned): -100})
    assert banned_text not in done.choices[0].logprobs.tokens
    chat = await client.chat.completions.create(
        model="primary",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        logit_bias={str(token_id): 100},
        extra_body={"ignore_eos": True},
    )
    assert h.primary.encode(chat.choices[0].message.content) == [token_id] * 2


@pytest.mark.parametrize(
    ("bias", "param", "code"),
    [
        ({"1": 101}, "logit_bias", None),
        ({"x": 1}, "logit_bias", None),
        ({"1": "a"}, "logit_bias", None),
        ({str(i): 1 for i in range(301)}, "logit_bias", None),
        ({"1000000": 1}, None, "request_rejected"),
    ],
)
async def test_logit_bias_refusals(sdk, bias, param, code):
    client, _ = sdk
    with pytest.raises(openai.BadRequestError, match="logit_bias") as info:
        await client.completions.create(model="primary", prompt="hi", max_tokens=1, logit_bias=bias)
    assert (info.value.body["param"], info.value.body["code"]) == (param, code)


# --- echo -----------------------------------------------------------------------------------------
async def test_echo(sdk):
    client, h = sdk
    prompt = "def add(a, b):"
    expected = await h.greedy(prompt, 3, ignore_eos=True)
    greedy = dict(model="primary", max_tokens=3, temperature=0, echo=True, extra_body={"ignore_eos": True})
    done = await client.completions.create(prompt=[prompt, "x"], n=2, **greedy)
    assert [c.text for c in done.choices][:2] == [prompt + expected] * 2
    assert all(c.text.startswith("x") for c in done.choices[2:])
    stream = await client.completions.create(prompt=prompt, stream=True, **greedy)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == prompt + expected
    done = await client.completions.create(prompt=h.primary.encode(prompt), **greedy)  # token ids: decoded
    assert done.choices[0].text == prompt + expected


async def test_echo_with_logprobs_scores_the_prompt_as_hf_does(sdk, tiny_models):
    """What lm-evaluation-harness sends to score a continuation: echo, logprobs, max_tokens 1. The prompt's
    tokens come first in logprobs, the first with null scores, each other one its log-probability under HF
    transformers' forward of the same ids (float32, 1e-4); vLLM's prompt_logprobs carries the same numbers."""
    import torch
    from transformers import AutoModelForCausalLM

    client, h = sdk
    ids = h.primary.encode("def add(a, b):\n    return a + b\n")
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(tiny_models.primary, dtype=torch.float32)
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = [None] + [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
    greedy = dict(
        model="primary",
        prompt=ids,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
    )
    for done in [
        await client.completions.create(**greedy),
        _fold([c async for c in await client.completions.create(stream=True, **greedy)]),
    ]:
        logprobs = done.choices[0].logprobs
        assert len(logprobs.tokens) == len(ids) + 1 and logprobs.top_logprobs[0] is None
        got = logprobs.token_logprobs[: len(ids)]
        assert got[0] is None and all(abs(g - w) < 1e-4 for g, w in zip(got[1:], want[1:], strict=True))
        assert all(len(top) >= 2 for top in logprobs.top_logprobs[1:])
        echoed = h.primary.tokenizer.decode(ids)
        assert done.choices[0].text.startswith(echoed) and logprobs.text_offset[len(ids)] == len(echoed)
        prompt_logprobs = done.choices[0].model_extra["prompt_logprobs"]
        assert prompt_logprobs[0] is None
        assert [e[str(t)]["logprob"] for e, t in zip(prompt_logprobs[1:], ids[1:], strict=True)] == got[1:]
    assert h.idle()


def _fold(chunks: list) -> object:
    """A stream's chunks as one completion of one choice: texts joined, logprobs concatenated."""
    first = chunks[0].choices[0]
    for chunk in chunks[1:]:
        for choice in chunk.choices:
            first.text += choice.text
            if choice.logprobs:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(first.logprobs, key).extend(getattr(choice.logprobs, key))
    return chunks[0]


async def test_echo_refusals(sdk):
    client, _ = sdk
    with pytest.raises(openai.BadRequestError, match="echo is not supported for chat") as info:
        await client.chat.completions.create(
            model="primary",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"echo": True},
        )
    assert info.value.body["param"] == "echo"


# --- unsupported vLLM fields ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [  # structured output and tools: tests/integration/service/test_structured*.py
        ("truncate_prompt_tokens", 8),
        ("functions", [{"name": "f"}]),
    ],
)
async def test_unimplemented_fields_are_clear_400s(sdk, field, value):
    client, _ = sdk
    with pytest.raises(openai.BadRequestError, match=field) as info:
        await client.chat.completions.create(
            model="primary",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={field: value},
        )
    assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match=field):
        await client.completions.create(model="primary", prompt="hi", max_tokens=1, extra_body={field: value})


# --- metrics ----------------------------------------------------------------------------------------
async def test_per_request_series(sdk):
    client, h = sdk
    prompt_tokens = len(h.primary.encode("hello"))
    await client.completions.create(
        model="primary", prompt="hello", max_tokens=3, n=2, temperature=0, extra_body={"ignore_eos": True}
    )
    text = await (await h.client.get("/metrics")).text()

    def value(series: str) -> float:
        match = re.search(rf'^pagedserve:{series}{{model_name="primary"}} (\S+)$', text, re.MULTILINE)
        assert match, series
        return float(match.group(1))

    assert value("request_prompt_tokens_sum") == prompt_tokens and value("request_prompt_tokens_count") == 1
    assert value("request_generation_tokens_sum") == 6
    assert value("request_params_n_sum") == 2 and value("request_params_max_tokens_sum") == 3
    assert 'pagedserve:request_params_n_bucket{le="2.0",model_name="primary"} 1.0' in text
    assert 'pagedserve:request_params_max_tokens_bucket{le="5.0",model_name="primary"} 1.0' in text
