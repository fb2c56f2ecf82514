"""The router on real engines (tiny random models): a stalled, failing or slow primary degrades to its
fallback before the first token, its breaker opens (on failures or on slow calls) and sends requests
straight to the fallback, a half-open breaker lets one probe through, and nothing streamed is ever
retried."""

import asyncio

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.faults import Fault
from resilience.admission import BulkheadConfig
from resilience.breaker import BreakerConfig
from resilience.errors import AdmissionRejected, DeadlineExceeded, NoModelAvailable
from resilience.retry import RetryBudgetConfig
from resilience.router import GenerateRequest, ModelRouter, RouterConfig

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
async def engines(random_model):
    made = {
        name: AsyncEngine(EngineConfig(model=random_model(preset), dtype="float32", block_size=8))
        for name, preset in (("big", "tiny-llama"), ("small", "tiny-qwen2"))
    }
    for engine in made.values():
        engine.start()
    yield made
    for engine in made.values():
        engine.stop()


OPEN_S = 3.0


def _router(engines, **options) -> ModelRouter:
    # open for 3 s: long enough that a loaded box still sees it open right after the requests that opened it
    breaker = BreakerConfig(
        min_calls=4,
        window_s=60,
        open_s=OPEN_S,
        max_open_s=2 * OPEN_S,
        jitter=0,
        ignored=RouterConfig().breaker.ignored,
    )
    # 10 s deadlines unless a test needs a short one: a tiny model steps in milliseconds, but in a loaded
    # CI run a thread of the 2-core box has gone unscheduled for over a second (a 1 s stall timeout
    # once cut a healthy fallback's streams)
    config = RouterConfig(
        **{"first_token_timeout_s": 10.0, "stall_timeout_s": 10.0, "breaker": breaker, **options}
    )
    return ModelRouter(engines, {"big": "small", "small": None}, config)


async def _run(router: ModelRouter, i: int, model: str = "big") -> tuple[str, str]:
    served, text = None, ""
    async for routed in router.generate(
        GenerateRequest(f"r{i}", model, "def f(x):", PARAMS, num_prompt_tokens=5)
    ):
        served = routed.served_model
        text += "".join(o.text for o in routed.output.outputs)
    return served, text


async def test_healthy_primary_serves(engines):
    assert await _run(_router(engines), 0) == ("big", (await _run(_router(engines), 1))[1])


async def test_stalled_primary_degrades_then_breaker_opens_then_one_probe_closes_it(engines):
    router = _router(engines, first_token_timeout_s=1.0)  # the stalled primary misses it
    engines["big"].faults.inject(Fault("stall"))
    served = await asyncio.gather(*[_run(router, i) for i in range(8)])
    assert {s for s, _ in served} == {"small"}  # every request answered, by the fallback
    assert router.breaker("big").state == "open"
    before = router.num_engine_requests["big"]
    assert (await _run(router, 100))[0] == "small"  # straight to the fallback
    assert router.num_engine_requests["big"] == before
    engines["big"].faults.clear()
    await asyncio.sleep(OPEN_S + 0.1)  # the open period passes: half-open
    assert router.breaker("big").state == "half_open"
    results = await asyncio.gather(*[_run(router, 200 + i) for i in range(4)])
    assert sorted(s for s, _ in results).count("big") == 1  # exactly one probe
    assert router.breaker("big").state == "closed"
    assert (await _run(router, 300))[0] == "big"


async def test_slow_primary_sheds_to_the_fallback_until_a_fast_probe_closes_its_breaker(engines):
    # every step of the primary takes 2 s: no first token within the 1 s deadline, though its loop is alive
    router = _router(engines, first_token_timeout_s=1.0)
    engines["big"].faults.inject(Fault("slow", delay_ms=2000))
    served = await asyncio.gather(*[_run(router, i) for i in range(4)])
    assert {s for s, _ in served} == {"small"} and all(text for _, text in served)
    assert router.breaker("big").state == "open"  # on slow calls alone
    assert (router.num_slow_calls["big"], router.breaker("big").num_failed_calls) == (4, 0)
    assert router.num_deadline_hits == {("big", "first_token"): 4}
    before = router.num_engine_requests["big"]
    assert (await _run(router, 100))[0] == "small"
    assert router.num_engine_requests["big"] == before  # shed at once, no deadline wait
    engines["big"].faults.clear()
    await asyncio.sleep(max(OPEN_S, 2.0) + 0.5)  # the open period and the loop's last 2 s sleep pass
    results = await asyncio.gather(*[_run(router, 200 + i) for i in range(4)])
    assert sorted(s for s, _ in results).count("big") == 1  # one probe, fast again
    assert router.breaker("big").state == "closed"


async def test_a_probe_with_a_fast_first_token_and_slow_later_ones_reopens_the_breaker(engines):
    router = _router(engines, first_token_timeout_s=1.0)
    engines["big"].faults.inject(Fault("slow", delay_ms=2000))
    await asyncio.gather(*[_run(router, i) for i in range(4)])
    assert router.breaker("big").state == "open"
    engines["big"].faults.clear()
    await asyncio.sleep(max(OPEN_S, 2.0) + 0.5)
    assert router.breaker("big").state == "half_open"
    # a long probe: on an idle box the engine runs ahead of its consumer, so the slowdown injected at the
    # first output must find steps still to run; it is cleared once one gap has shown it
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    served, last, slowest = [], None, 0.0
    try:
        async for routed in router.generate(
            GenerateRequest("probe", "big", "def f(x):", params, num_prompt_tokens=5)
        ):
            now = asyncio.get_running_loop().time()
            served.append(routed.served_model)
            slowest = max(slowest, now - last) if last is not None else 0.0
            last = now
            if len(served) == 1:  # the probe's first token came fast; now each step takes 2.5 s (> 1 s)
                engines["big"].faults.inject(Fault("slow", delay_ms=2500))
            elif slowest > 2.0:
                engines["big"].faults.clear()
    finally:
        engines["big"].faults.clear()
    assert slowest > 2.0, slowest  # the probe did stream slowly after its first token
    assert set(served) == {"big"} and len(served) > 1  # the stream itself goes on to the end
    assert router.breaker("big").state == "open"  # judged on the whole call, not on its first token
    assert router.num_slow_calls["big"] == 5


async def test_error_fault_fails_over_within_the_retry_budget(engines):
    # 30 requests: the budget allows max(min_retries 2, 20% of 30) = 6 resubmits after a fast failure, to
    # the same model (at most 3: the 4th failure opens the breaker) or to the fallback
    # about retries, not deadlines (the 10 s ones): 30 requests at once on a loaded box missed a 1 s
    # first-token deadline (at load 5 every one did, and all 30 reached the fallback: deadline failovers are free)
    router = _router(engines, retry_budget=RetryBudgetConfig(ratio=0.2, min_retries=2))
    engines["big"].faults.inject(Fault("error"))
    results = await asyncio.gather(*[_run(router, i) for i in range(30)], return_exceptions=True)
    served = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(served) + len(refused) == 30
    # every request is either answered by the fallback or refused; failovers happened, but no more than
    # the budget pays for (the breaker opening later sends requests straight to the fallback: no retry)
    assert served, [repr(r) for r in refused]
    assert {s for s, _ in served} == {"small"}
    assert all(text for _, text in served)
    assert all(isinstance(r, NoModelAvailable) for r in refused), [repr(r) for r in refused]
    assert router.retry_budget.num_retries <= 6
    assert router.num_engine_requests["small"] == len(served)
    assert router.num_engine_requests["big"] == 30 + router.num_retries["big"] <= 33
    assert sum(router.num_engine_requests.values()) <= 30 * 1.2


async def test_whole_ladder_down_is_a_fast_503(engines):
    # "fast" = without waiting for any deadline: a 5 s idle timeout, and the refusal must come in a
    # fifth of it (it takes about a millisecond; the margin is for a loaded 2-core box)
    router = _router(engines, first_token_timeout_s=5.0, stall_timeout_s=5.0)
    for name in ("big", "small"):
        router.breaker(name).circuit.open()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NoModelAvailable, match=r"no model of \['big', 'small'\] can serve now") as info:
        await _run(router, 0)
    assert loop.time() - started < 0.2 * router.config.first_token_timeout_s
    assert info.value.retry_after_s >= 0.4
    assert router.num_engine_requests == {}  # no engine saw it


async def test_full_bulkhead_is_429_not_a_degrade(engines):
    router = _router(engines, bulkhead=BulkheadConfig(max_num_seqs=1))
    first = router.generate(GenerateRequest("a", "big", "x", SamplingParams(max_tokens=50, ignore_eos=True)))
    await anext(first)
    with pytest.raises(AdmissionRejected, match=r"model 'big' is at capacity: 1 \+ 1 sequences exceed 1"):
        await _run(router, 1)
    await first.aclose()
    assert router.bulkhead("big").num_seqs == 0


async def test_a_stream_that_stalls_after_its_first_token_continues_on_the_next_model(engines):
    """The stalled model's engine still lives: the stream goes on on the fallback (same tokenizer), its
    first output marked; with continuations off the stall is the client's error, as before."""
    router = _router(engines, stall_timeout_s=1.0)
    stream = router.generate(
        GenerateRequest("s", "big", "x", SamplingParams(max_tokens=200, ignore_eos=True))
    )
    first = await anext(stream)
    assert first.served_model == "big"
    engines["big"].faults.inject(Fault("stall"))
    rest = [routed async for routed in stream]  # a step of big may still land before the stall
    moved = next(i for i, r in enumerate(rest) if r.served_model == "small")
    assert {r.served_model for r in rest[:moved]} <= {"big"} and {r.served_model for r in rest[moved:]} == {
        "small"
    }
    assert rest[moved].continued == "stall" and not any(r.continued for r in rest[moved + 1 :])
    assert sum(len(o.token_ids) for r in [first, *rest] for o in r.output.outputs) == 200
    assert router.num_continuations == {("big", "stall", "small"): 1}
    engines["big"].faults.clear()
    router = _router(engines, stall_timeout_s=1.0, max_continuations=0)
    stream = router.generate(
        GenerateRequest("s2", "big", "x", SamplingParams(max_tokens=200, ignore_eos=True))
    )
    await anext(stream)
    engines["big"].faults.inject(Fault("stall"))
    with pytest.raises(DeadlineExceeded, match="deadline exceeded at between_tokens") as info:
        async for _ in stream:
            pass
    assert info.value.stage == "between_tokens"
    assert router.num_engine_requests.get("small", 0) == 0
    engines["big"].faults.clear()
