"""Serving defaults a newcomer can rely on: a chat request that names no max_tokens stops at
--default-max-tokens (capped by the context left), never runs to the end of the context."""

CHAT = "/v1/chat/completions"


async def test_chat_without_max_tokens_stops_at_the_default(start):
    h = await start(default_max_tokens=7)
    body = {
        "model": "primary",
        "messages": [{"role": "user", "content": "Write a loop"}],
        "temperature": 0,
        "ignore_eos": True,
    }
    response = await h.client.post(CHAT, json=body)
    assert response.status == 200, await response.text()
    data = await response.json()
    assert data["usage"]["completion_tokens"] == 7 and data["choices"][0]["finish_reason"] == "length"
    asked = await (await h.client.post(CHAT, json={**body, "max_tokens": 3})).json()
    assert asked["usage"]["completion_tokens"] == 3  # what the client asks for wins


async def test_the_default_never_overruns_the_context(start):
    h = await start(default_max_tokens=500, engine_kwargs={"max_model_len": 64})
    body = {
        "model": "primary",
        "messages": [{"role": "user", "content": "def f(x): return x " * 3}],
        "temperature": 0,
        "ignore_eos": True,
    }
    data = await (await h.client.post(CHAT, json=body)).json()
    usage = data["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64, usage  # filled the context, no 400
