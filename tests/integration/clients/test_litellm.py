"""LiteLLM against the server: completion, streaming, and its Router falling back between our models."""

import litellm
from litellm import Router

from tests.harness import free_port


def params(h) -> dict:
    return {"api_base": str(h.client.make_url("/v1")), "api_key": "k"}


async def test_completion_and_streaming(start):
    h = await start(api_keys=("k",))
    response = await litellm.acompletion(
        model="openai/primary",
        messages=[{"role": "user", "content": "Write a loop"}],
        max_tokens=6,
        temperature=0.0,
        **params(h),
    )
    text = response.choices[0].message.content
    assert text and response.usage.completion_tokens == 6
    stream = await litellm.acompletion(
        model="openai/primary",
        messages=[{"role": "user", "content": "Write a loop"}],
        max_tokens=6,
        temperature=0.0,
        stream=True,
        **params(h),
    )
    assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream]) == text


async def test_the_router_falls_back_to_our_other_model_when_a_deployment_is_down(start):
    h = await start(api_keys=("k",))
    down = {"api_base": f"http://127.0.0.1:{free_port()}/v1", "api_key": "k"}  # nothing listens there
    router = Router(
        model_list=[
            {"model_name": "coder", "litellm_params": {"model": "openai/primary", **down}},
            {"model_name": "coder-fallback", "litellm_params": {"model": "openai/fallback", **params(h)}},
        ],
        fallbacks=[{"coder": ["coder-fallback"]}],
        num_retries=0,
    )
    response = await router.acompletion(
        model="coder", messages=[{"role": "user", "content": "Write a loop"}], max_tokens=4, temperature=0.0
    )
    assert response.choices[0].message.content and response.model.endswith("fallback"), response.model
