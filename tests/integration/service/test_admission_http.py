"""The bulkhead over HTTP: its bounds come from flags (default: what the engine itself holds), a
request's n counts, a full bulkhead is a 429, and a request that could never fit is a 400."""

import asyncio

from engine.faults import Fault
from service.cli import build_config, build_parser
from tests.harness import until

COMPLETIONS = "/v1/completions"


def test_flags_reach_the_config():
    args = build_parser().parse_args(
        ["serve", "--model", "/m/a", "--bulkhead-max-seqs", "6", "--bulkhead-max-tokens", "9000"]
    )
    config = build_config(args, {})
    assert (config.bulkhead_max_seqs, config.bulkhead_max_tokens) == (6, 9000)


async def test_default_bound_is_the_engines_capacity(start):
    h = await start(engine_kwargs={"max_num_seqs": 3, "max_num_waiting": 2})
    assert h.state.router.bulkhead("primary").max_num_seqs == 5


async def test_a_full_bulkhead_is_429_and_a_request_too_big_for_it_is_400(start):
    h = await start(bulkhead_max_seqs=3)
    h.primary.faults.inject(Fault("slow", delay_ms=30))
    held = asyncio.create_task(
        h.client.post(
            COMPLETIONS,
            json={"model": "primary", "prompt": "def f():", "n": 2, "max_tokens": 40, "ignore_eos": True},
        )
    )
    await until(lambda: h.state.router.bulkhead("primary").num_seqs == 2)
    full = await h.client.post(COMPLETIONS, json={"model": "primary", "prompt": "x", "n": 2, "max_tokens": 2})
    assert full.status == 429 and (await full.json())["error"]["code"] == "overloaded"
    never = await h.client.post(
        COMPLETIONS, json={"model": "primary", "prompt": ["a", "b"], "n": 2, "max_tokens": 2}
    )
    body = await never.json()
    assert never.status == 400 and "needs 4 sequences" in body["error"]["message"], body
    assert (await held).status == 200
    h.primary.faults.clear()
    await until(h.idle)


async def test_one_api_key_holds_at_most_its_share_of_a_models_seats(start):
    h = await start(api_keys=("key-a", "key-b"), max_key_share=0.25, engine_kwargs={"max_num_seqs": 8})
    body = {"model": "primary", "prompt": "def f(x):", "max_tokens": 2, "n": 3}
    response = await h.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-a"})
    assert response.status == 400
    assert (
        "one API key may hold at most 2 of the seats of model 'primary'"
        in (await response.json())["error"]["message"]
    )
    response = await h.client.post(
        "/v1/completions", json={**body, "n": 2}, headers={"Authorization": "Bearer key-b"}
    )
    assert response.status == 200 and len((await response.json())["choices"]) == 2


async def test_max_n_bounds_the_choices_of_one_request(start):
    h = await start(max_n=2)
    body = {"model": "primary", "prompt": "def f(x):", "max_tokens": 2}
    response = await h.client.post("/v1/completions", json={**body, "n": 3})
    error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == "n" and "at most 2 on this server" in error["message"]
    assert (await h.client.post("/v1/completions", json={**body, "n": 2})).status == 200
