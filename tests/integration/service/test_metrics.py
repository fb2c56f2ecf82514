"""/metrics: vLLM's names with the pagedserve: prefix and a model_name label; one registry per app."""

from prometheus_client.parser import text_string_to_metric_families

from engine import AsyncEngine
from service.metrics import Metrics
from tests.harness import real_config, until


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"


async def test_names_labels_and_values(start):
    h = await start()
    num_prompt = len(h.primary.encode(PROMPT))
    assert num_prompt >= 16  # two full blocks of 8: the second request finds them in the prefix cache
    for body in (
        {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True},
        {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "n": 2, "stream": True},
        {"prompt": "hi", "temperature": -1},
    ):
        await (await h.client.post("/v1/completions", json=body)).read()  # to its end: the request is over
    await until(h.idle)  # the loop publishes its stats after the iteration that delivered the last token
    response = await h.client.get("/metrics")
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = _samples(await response.text())
    primary = (("model_name", "primary"),)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert samples[(f"pagedserve:{name}", primary)] == 0, name
    warmup = len(h.primary.encode("Hello"))  # engine.client.WARMUP_PROMPT, one token generated
    # in prompt tokens, once per request (n samples share one prompt); the second request finds the
    # first one's full blocks of 8 in the prefix cache
    assert samples[("pagedserve:prefix_cache_queries_total", primary)] == warmup + 2 * num_prompt
    assert samples[("pagedserve:prefix_cache_hits_total", primary)] == num_prompt // 8 * 8
    assert samples[("pagedserve:num_preemptions_total", primary)] == 0  # a 4 MiB pool is plenty here
    assert samples[("pagedserve:prompt_tokens_total", primary)] == warmup + 2 * num_prompt
    assert samples[("pagedserve:generation_tokens_total", primary)] == 1 + 4 + 2 * 4
    assert samples[("pagedserve:request_success_total", (("finished_reason", "length"), *primary))] == 3
    assert samples[("pagedserve:time_to_first_token_seconds_count", primary)] == 2
    assert samples[("pagedserve:e2e_request_latency_seconds_count", primary)] == 2
    assert samples[("pagedserve:request_queue_time_seconds_count", primary)] == 2
    assert 0 <= samples[("pagedserve:request_queue_time_seconds_sum", primary)] < 5
    # 4 tokens: 3 intervals for the single choice; 2 choices x 4 tokens in 4 deltas: 3 deltas of 2 tokens
    assert samples[("pagedserve:inter_token_latency_seconds_count", primary)] == 3 + 6
    http = "pagedserve:http_requests_total"
    assert samples[(http, (("method", "POST"), ("route", "/v1/completions"), ("status", "200")))] == 2
    assert samples[(http, (("method", "POST"), ("route", "/v1/completions"), ("status", "400")))] == 1


async def test_unmatched_paths_share_one_label(start):
    h = await start()
    for path in ("/a", "/b/c", "/d"):
        await h.client.get(path)
    samples = _samples(await (await h.client.get("/metrics")).text())
    key = ("pagedserve:http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404")))
    assert samples[key] == 3


def test_two_apps_do_not_share_a_registry(tiny_models):
    engine = AsyncEngine(real_config(tiny_models).models[0].engine)  # never started: stats() as loaded
    first, second = Metrics(lambda: {"m": engine}), Metrics(lambda: {})
    first.observe_http("GET", "/x", 200)
    assert b'route="/x"' in first.render() and b'route="/x"' not in second.render()
    assert b'model_name="m"' in first.render() and b'model_name="m"' not in second.render()
