"""Admission by queue delay over HTTP on real tiny engines (one sequence at a time, slowed by the `slow`
fault, so a queue stands): while the primary's queue has held its head longer than --max-queue-delay, a
new request is served by the fallback at once (x-pagedserve-degraded: 1); when the fallback's queue stands
too, it gets 429 `overloaded` with a Retry-After; /metrics counts both sheds and shows the delay."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.faults import Fault
from service.cli import build_config, build_parser
from service.config import ConfigError
from tests.harness import until

COMPLETIONS = "/v1/completions"
SHORT = {"prompt": "def f(x):", "max_tokens": 2, "ignore_eos": True}
MAX_DELAY_S = 0.3


def test_the_flag_its_default_and_off():
    def config(*argv: str):
        return build_config(build_parser().parse_args(["serve", *argv]), {})

    assert config().queue_delay_target_s == 2.5  # a quarter of the first-token timeout
    assert config("--first-token-timeout", "4").queue_delay_target_s == 1.0
    assert config("--max-queue-delay", "0.5").queue_delay_target_s == 0.5
    assert config("--max-queue-delay", "0").queue_delay_target_s is None  # off
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(
            ConfigError,
            match=f"max_queue_delay must be a non-negative number of seconds \\(0: off\\), got {bad}",
        ):
            config("--max-queue-delay", bad)


async def _queue_behind_one(h, model: str) -> list[asyncio.Task]:
    """One long request runs on `model`, a second waits behind it until its queue delay passes the target."""
    h.engines[model].faults.inject(Fault("slow", delay_ms=150))
    body = {**SHORT, "model": model, "max_tokens": 40}
    tasks = [asyncio.create_task(h.client.post(COMPLETIONS, json=body)) for _ in range(2)]
    await until(lambda: h.engines[model].queue_delay_s() > MAX_DELAY_S)
    return tasks


async def _metrics(h) -> dict[tuple[str, tuple], float]:
    text = await (await h.client.get("/metrics")).text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_a_standing_queue_sheds_to_the_fallback_then_refuses_with_retry_after(start):
    h = await start(engine_kwargs={"max_num_seqs": 1}, max_queue_delay_s=MAX_DELAY_S)
    tasks = await _queue_behind_one(h, "primary")
    samples = await _metrics(h)
    assert samples[("pagedserve:queue_delay_seconds", (("model_name", "primary"),))] > MAX_DELAY_S
    response = await h.client.post(COMPLETIONS, json={**SHORT, "model": "primary"})
    assert response.status == 200, await response.text()
    assert (response.headers["x-pagedserve-served-model"], response.headers["x-pagedserve-degraded"]) == (
        "fallback",
        "1",
    )

    tasks += await _queue_behind_one(h, "fallback")
    response = await h.client.post(COMPLETIONS, json={**SHORT, "model": "primary"})
    assert response.status == 429, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == "overloaded" and "its queue has held a request" in error["message"]
    assert int(response.headers["Retry-After"]) >= 1

    samples = await _metrics(h)
    rejections = {
        name: samples[
            ("pagedserve:admission_rejections_total", (("model_name", name), ("reason", "queue_delay")))
        ]
        for name in ("primary", "fallback")
    }
    assert rejections == {"primary": 2, "fallback": 1}
    router = h.state.router
    assert router.breaker("primary").num_failed_calls == 0 and router.num_slow_calls == {}  # not sickness
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for name in ("primary", "fallback"):
        h.engines[name].faults.clear()
        await until(lambda name=name: h.idle(name))  # the abandoned requests gave their blocks back
