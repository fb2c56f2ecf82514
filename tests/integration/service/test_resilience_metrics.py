"""/metrics says what the resilience layer did: admissions, retry budget, isolation, rebuilds."""

from prometheus_client.parser import text_string_to_metric_families


async def _samples(h) -> dict[tuple[str, tuple], float]:
    text = await (await h.client.get("/metrics")).text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_resilience_series_after_a_request(start):
    h = await start()
    response = await h.client.post(
        "/v1/completions",
        json={"model": "primary", "prompt": "def f():", "max_tokens": 2, "n": 2, "ignore_eos": True},
    )
    assert response.status == 200, await response.text()
    samples = await _samples(h)
    primary = (("model_name", "primary"),)
    assert samples[("pagedserve:admitted_seqs", primary)] == 0  # the permit of n=2 was given back
    for reason in ("max_num_seqs", "max_num_tokens", "queue_delay"):
        assert samples[("pagedserve:admission_rejections_total", (*primary, ("reason", reason)))] == 0
    assert samples[("pagedserve:queue_delay_seconds", primary)] == 0  # nothing waits
    assert samples[("pagedserve:retry_budget_requests", ())] >= 1
    assert samples[("pagedserve:retry_budget_retries", ())] == 0
    assert samples[("pagedserve:isolated_steps_total", primary)] == 0
    assert samples[("pagedserve:requests_failed_in_engine_total", primary)] == 0
    assert samples[("pagedserve:engine_deaths_total", ())] == 0
    assert samples[("pagedserve:engine_rebuilds_total", ())] == 0
