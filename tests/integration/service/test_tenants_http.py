"""--tenants over HTTP on a real tiny engine: tenant keys are API keys, a tenant over its token rate or
its concurrency cap gets 429 with a Retry-After after which the same request is admitted, the tokens
counted are the tokens served (usage), the engine's scheduler sees the tenant, and /metrics says it all."""

import asyncio

from engine.faults import Fault
from service.tenants import parse_tenants
from tests.harness import until

COMPLETIONS = "/v1/completions"
TENANTS = parse_tenants(
    {
        "tenants": {
            "metered": {"keys": ["sk-metered"], "tokens_per_minute": 1200, "burst": 40},  # 20 tokens/s
            "capped": {"keys": ["sk-capped"], "max_concurrency": 1, "weight": 2.0},
        }
    }
)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


async def test_over_its_rate_a_tenant_gets_429_and_retry_after_then_is_admitted(start):
    h = await start(tenants=TENANTS)
    body = {"model": "primary", "prompt": "def f():", "max_tokens": 50, "ignore_eos": True, "temperature": 0}
    first = await h.client.post(COMPLETIONS, json=body, headers=auth("sk-metered"))
    assert first.status == 200, await first.text()
    usage = (await first.json())["usage"]
    refused = await h.client.post(COMPLETIONS, json=body, headers=auth("sk-metered"))
    error = (await refused.json())["error"]
    assert refused.status == 429 and error["code"] == "rate_limit_exceeded", error
    assert "tenant 'metered'" in error["message"]
    retry_after = int(refused.headers["Retry-After"])
    assert 1 <= retry_after <= 3  # 40 - 4 - 50 tokens, back to 4 at 20 a second: about 2.5 s
    other = await h.client.post(COMPLETIONS, json={**body, "max_tokens": 2}, headers=auth("sk-capped"))
    assert other.status == 200  # another tenant's bucket is its own
    await asyncio.sleep(retry_after)
    again = await h.client.post(COMPLETIONS, json=body, headers=auth("sk-metered"))
    assert again.status == 200, await again.text()
    usage2 = (await again.json())["usage"]
    limiter = h.state.tenants
    served = limiter.num_served["metered", "prompt"] + limiter.num_served["metered", "generation"]
    assert served == usage["total_tokens"] + usage2["total_tokens"]
    assert limiter.num_rejected["metered", "token_rate"] == 1 and limiter.num_in_flight["metered"] == 0
    metrics = await (await h.client.get("/metrics")).text()
    assert (
        f'pagedserve:tenant_tokens_total{{kind="generation",tenant="metered"}} {usage["completion_tokens"] + usage2["completion_tokens"]}.0'
        in metrics
    )
    assert 'pagedserve:tenant_rejections_total{reason="token_rate",tenant="metered"} 1.0' in metrics
    assert 'pagedserve:tenant_queue_time_seconds_count{tenant="metered"} 2.0' in metrics
    assert h.primary.engine.scheduler.fair.counters["metered"] > 0  # the engine weighed it as its tenant


async def test_over_its_concurrency_cap_a_tenant_gets_429_while_others_are_served(start):
    h = await start(tenants=TENANTS, api_keys=("plain-key",))
    h.primary.faults.inject(Fault("slow", delay_ms=30))
    body = {"model": "primary", "prompt": "x", "max_tokens": 30, "ignore_eos": True}
    held = asyncio.create_task(h.client.post(COMPLETIONS, json=body, headers=auth("sk-capped")))
    await until(lambda: h.state.tenants.num_in_flight["capped"] == 1)
    refused = await h.client.post(COMPLETIONS, json={**body, "stream": True}, headers=auth("sk-capped"))
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert (await refused.json())["error"]["code"] == "rate_limit_exceeded"
    plain = await h.client.post(COMPLETIONS, json={**body, "max_tokens": 1}, headers=auth("plain-key"))
    assert plain.status == 200  # an --api-key key: the default tenant, no cap
    assert h.state.tenants.num_in_flight["default"] == 0
    assert (await h.client.post(COMPLETIONS, json=body, headers=auth("sk-nobody"))).status == 401
    assert (await h.client.post(COMPLETIONS, json=body)).status == 401  # tenant keys close /v1 to keyless
    assert (await held).status == 200
    h.primary.faults.clear()
    assert h.state.tenants.num_in_flight["capped"] == 0
    await until(h.idle)


async def test_a_prompt_bigger_than_the_burst_is_a_400(start):
    h = await start(tenants=TENANTS)
    response = await h.client.post(
        COMPLETIONS,
        json={"model": "primary", "prompt": "word " * 60, "max_tokens": 1},
        headers=auth("sk-metered"),
    )
    body = await response.json()
    assert response.status == 400 and body["error"]["code"] == "tenant_quota_too_small", body
