"""/metrics: vLLM's per-step and per-request series (iteration_tokens_total, cache_config_info, the request
token and parameter histograms, the phase times) say exactly what a real tiny engine did for known
requests. Each test reads the difference between a scrape after start-up (the warm-up generation) and
one after its requests, so only what they did counts."""

from itertools import pairwise

from prometheus_client.parser import text_string_to_metric_families

from engine.faults import Fault
from engine.stats import ITERATION_TOKEN_BUCKETS, SECONDS_BUCKETS
from service.metrics import N_BUCKETS, TOKEN_BUCKETS
from tests.harness import until

PRIMARY = ("model_name", "primary")
# no full block of 8 in common: neither prompt finds the other's blocks in the prefix cache
PROMPT_A = "def read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"
PROMPT_B = "class Stack:\n    def __init__(self):\n        self.items = []\n"
SLOW_S = 0.02  # the slow fault's pause before every step


async def _scrape(h) -> dict[tuple[str, tuple], float]:
    text = await (await h.client.get("/metrics")).text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _histogram(samples: dict, name: str) -> dict[str, float]:
    """The primary's `le` buckets, count and sum of one histogram: {"1.0": ..., "+Inf": ..., "count": ..., "sum": ...}
    (the request path's histograms show a model only once it observed something for it)."""
    found = {
        labels[0][1]: value
        for (sample, labels), value in samples.items()
        if sample == f"pagedserve:{name}_bucket" and labels[1] == PRIMARY
    }
    found["count"] = samples.get((f"pagedserve:{name}_count", (PRIMARY,)), 0.0)
    found["sum"] = samples.get((f"pagedserve:{name}_sum", (PRIMARY,)), 0.0)
    return found


def _delta(before: dict, after: dict, name: str) -> dict[str, float]:
    old, new = _histogram(before, name), _histogram(after, name)
    return {key: new[key] - old.get(key, 0.0) for key in new}


def _expected(values: list[float], bounds: tuple[float, ...]) -> dict[str, float]:
    """What a histogram with these bounds holds after observing values (cumulative buckets)."""
    buckets = {str(float(b)): float(sum(v <= b for v in values)) for b in bounds}
    return {**buckets, "+Inf": float(len(values)), "count": float(len(values)), "sum": float(sum(values))}


async def _complete(h, **body) -> dict:
    response = await h.client.post("/v1/completions", json={"ignore_eos": True, **body})
    assert response.status == 200, await response.text()
    return await response.json() if not body.get("stream") else {"text": await response.text()}


async def test_step_and_request_series_say_what_ran(start):
    h = await start()
    await until(h.idle)
    before = await _scrape(h)
    warmup = len(h.primary.encode("Hello"))  # engine.client.WARMUP_PROMPT: one step, one token
    assert _histogram(before, "iteration_tokens_total") == _expected([warmup], ITERATION_TOKEN_BUCKETS)
    assert _histogram(before, "request_inference_time_seconds")["count"] == 1
    assert _histogram(before, "request_prompt_tokens")["count"] == 0  # the warm-up is no HTTP request
    num_a, num_b = len(h.primary.encode(PROMPT_A)), len(h.primary.encode(PROMPT_B))
    assert num_a > 16 and num_b > 16  # prefills of whole blocks, not single tokens
    h.primary.faults.inject(Fault("slow", delay_ms=int(SLOW_S * 1000)))
    await _complete(h, prompt=PROMPT_A, max_tokens=5)
    await _complete(h, prompt=PROMPT_B, max_tokens=3, n=2, stream=True)
    await until(h.idle)
    after = await _scrape(h)
    assert (
        after[("pagedserve:prefix_cache_hits_total", (PRIMARY,))]
        == before[("pagedserve:prefix_cache_hits_total", (PRIMARY,))]
    )  # every step below prefilled its whole prompt
    # one step per token of the single choice, its first one after the whole prompt; n=2 fans out at
    # the first token, then both choices decode side by side
    steps = [num_a, 1, 1, 1, 1] + [num_b, 2, 2]
    assert _delta(before, after, "iteration_tokens_total") == _expected(steps, ITERATION_TOKEN_BUCKETS)
    # per finished request: its prompt, all its choices' tokens, its n and max_tokens
    assert _delta(before, after, "request_prompt_tokens") == _expected([num_a, num_b], TOKEN_BUCKETS)
    assert _delta(before, after, "request_generation_tokens") == _expected([5, 2 * 3], TOKEN_BUCKETS)
    assert _delta(before, after, "request_params_n") == _expected([1, 2], N_BUCKETS)
    assert _delta(before, after, "request_params_max_tokens") == _expected([5, 3], TOKEN_BUCKETS)
    _check_phases(before, after, num_decode_steps=4 + 2)
    await _complete(h, prompt=[PROMPT_A, PROMPT_B], max_tokens=4)  # two prompts: two engine requests
    await until(h.idle)
    both = await _scrape(h)
    assert _delta(after, both, "request_prompt_tokens") == _expected([num_a, num_b], TOKEN_BUCKETS)
    assert _delta(after, both, "request_generation_tokens") == _expected([4, 4], TOKEN_BUCKETS)
    assert _delta(after, both, "request_params_max_tokens") == _expected([4, 4], TOKEN_BUCKETS)


def _check_phases(before: dict, after: dict, num_decode_steps: int) -> None:
    """Two requests finished: prefill + decode = inference for each, inference within each one's HTTP
    latency, and every decode step waited for the slow fault (lower bounds only: timings are noisy)."""
    prefill, decode, inference = (
        _delta(before, after, f"request_{phase}_time_seconds") for phase in ("prefill", "decode", "inference")
    )
    for phase in (prefill, decode, inference, _delta(before, after, "request_queue_time_seconds")):
        assert phase["count"] == phase["+Inf"] == 2
        assert list(phase) == [*(str(b) for b in SECONDS_BUCKETS), "+Inf", "count", "sum"]
        assert all(phase[str(a)] <= phase[str(b)] for a, b in pairwise(SECONDS_BUCKETS))  # cumulative
    assert abs(prefill["sum"] + decode["sum"] - inference["sum"]) < 1e-9
    assert inference["sum"] <= _delta(before, after, "e2e_request_latency_seconds")["sum"]
    assert prefill["sum"] <= _delta(before, after, "time_to_first_token_seconds")["sum"]
    assert decode["sum"] >= num_decode_steps * SLOW_S


async def test_cache_config_info_describes_each_pool(start):
    h = await start()
    samples = await _scrape(h)
    for name, engine in h.engines.items():
        expected = {
            "model_name": name,
            "block_size": "8",
            "num_gpu_blocks": str(engine.stats().num_total_blocks),
            "num_cpu_blocks": "0",
            "cache_dtype": "float32",
            "enable_prefix_caching": "True",
            "swap_space": "1.0",
            "gpu_memory_utilization": "0.9",
        }  # tests/harness.py's ENGINE_DEFAULTS
        assert samples[("pagedserve:cache_config_info", tuple(sorted(expected.items())))] == 1
    assert sum(key[0] == "pagedserve:cache_config_info" for key in samples) == 2


async def test_engine_config_info_says_what_each_engine_chose_at_load(start):
    h = await start()
    samples = await _scrape(h)
    for name, engine in h.engines.items():
        runner = engine.engine.model_runner
        labels = {
            "model_name": name,
            "dtype": "float32",
            "linear_kernel": runner.linear_kernel,
            "attention_backend": runner.attention.name,
            "single_thread_upto": str(runner.step_threads.single_thread_upto if runner.step_threads else 0),
        }
        assert samples[("pagedserve:engine_config_info", tuple(sorted(labels.items())))] == 1
        assert engine.linear_choice == (runner.linear_choice.to_dict() if runner.linear_choice else None)
        assert engine.step_threads == (runner.step_threads.to_dict() if runner.step_threads else None)
    ready = await (await h.client.get("/health/ready")).json()
    assert {e["linear_kernel"] for e in ready["engines"].values()} <= {"aten", "onednn"}
    for name, report in ready["engines"].items():
        assert report["step_threads"] == h.engines[name].step_threads
    assert sum(key[0] == "pagedserve:engine_config_info" for key in samples) == 2


async def test_aborted_and_refused_requests_are_not_finished_requests(start):
    h = await start()
    await until(h.idle)
    before = await _scrape(h)
    h.primary.faults.inject(Fault("slow", delay_ms=20))
    response = await h.client.post(
        "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}
    )
    assert (await response.content.readline()).startswith(b"data: ")
    response.close()  # the client goes away: the engine aborts the request
    assert (await h.client.post("/v1/completions", json={"prompt": "hi", "temperature": -1})).status == 400
    await until(h.idle)
    after = await _scrape(h)
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert _delta(before, after, name)["count"] == 0, name
    ran = _delta(before, after, "iteration_tokens_total")  # the steps it did run are real steps
    generated = (
        after[("pagedserve:generation_tokens_total", (PRIMARY,))]
        - before[("pagedserve:generation_tokens_total", (PRIMARY,))]
    )
    assert ran["count"] == generated >= 1 and ran["sum"] == len(h.primary.encode("def f(x):")) + generated - 1
