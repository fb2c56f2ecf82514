"""The router's deadlines and retries on fake engines (tests/fakes.py's FakeEngine; real time, timeouts
of a tenth of a second): the first-token deadline counted from arrival moves a request to the next model
and counts a slow call; the last model that can serve has none; the request's own deadline ends it (never
a failover, never the model's fault); a stalled loop is a failure; tenacity resubmits once to the same
model after a transient engine error before the first output, never a poison request, never past the
budget."""

import asyncio
import contextlib
import time

import pytest

import resilience.router
from engine.errors import EngineStepError, RequestFailedError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from resilience.admission import BulkheadConfig
from resilience.breaker import BreakerConfig
from resilience.deadline import StallDetected
from resilience.errors import DeadlineExceeded, NoModelAvailable, QueueDelayExceeded
from resilience.retry import RetryBudgetConfig, retry_policy
from resilience.router import GenerateRequest, ModelRouter, RouterConfig
from tests.fakes import FakeEngine, fake_output

TIMEOUT_S = 0.2  # first-token deadline; the fakes answer in 0 s or hang
PARAMS = SamplingParams(max_tokens=3)


def make_router(engines: dict[str, FakeEngine], **options) -> ModelRouter:
    names = list(engines)
    fallbacks = {name: (names[i + 1] if i + 1 < len(names) else None) for i, name in enumerate(names)}
    breaker = BreakerConfig(
        min_calls=4, window_s=60, open_s=30, jitter=0, ignored=RouterConfig().breaker.ignored
    )
    config = RouterConfig(
        **{"first_token_timeout_s": TIMEOUT_S, "stall_timeout_s": 5.0, "breaker": breaker, **options}
    )
    return ModelRouter(engines, fallbacks, config)


async def serve(
    router: ModelRouter, request_id: str = "r", **fields
) -> tuple[set[str], set[bool], list[str]]:
    """(served models, degraded flags, outputs) of one request for "big"."""
    routed = [r async for r in router.generate(GenerateRequest(request_id, "big", "x", PARAMS, **fields))]
    return (
        {r.served_model for r in routed},
        {r.degraded for r in routed},
        [r.output.request_id for r in routed],
    )


async def test_no_first_token_by_the_deadline_moves_to_the_next_model_as_a_slow_call():
    engines = {"big": FakeEngine(ttft_s=60.0), "small": FakeEngine()}
    router = make_router(engines)
    started = time.monotonic()
    assert await serve(router) == ({"small"}, {True}, ["r:0", "r:1", "r:2"])
    assert TIMEOUT_S <= time.monotonic() - started < 10 * TIMEOUT_S
    assert engines["big"].aborted == ["r"]  # aborted there: its KV blocks are freed
    assert (router.num_slow_calls, router.num_deadline_hits) == ({"big": 1}, {("big", "first_token"): 1})
    breaker = router.breaker("big")
    assert (breaker.num_slow_calls, breaker.num_failed_calls, breaker.circuit.fail_counter) == (1, 0, 1)
    assert router.num_failovers == 1 and router.retry_budget.num_retries == 0  # a deadline spends no budget


async def test_the_first_token_deadline_counts_from_arrival():
    engines = {"big": FakeEngine(ttft_s=TIMEOUT_S / 2), "small": FakeEngine()}
    router = make_router(engines)
    assert (await serve(router, "fresh"))[0] == {"big"}  # in time when it just arrived
    arrived = time.monotonic() - 0.75 * TIMEOUT_S  # three quarters of it spent queueing before the router
    assert (await serve(router, "queued", arrival=arrived))[0] == {"small"}
    assert router.num_deadline_hits == {("big", "first_token"): 1}


async def test_the_last_model_that_can_serve_has_no_first_token_deadline_but_counts_slow():
    engines = {"big": FakeEngine(ttft_s=2 * TIMEOUT_S), "small": FakeEngine()}
    router = make_router(engines)
    router.breaker("small").circuit.open()
    assert await serve(router) == ({"big"}, {False}, ["r:0", "r:1", "r:2"])
    assert router.num_slow_calls == {"big": 1} and router.num_deadline_hits == {}
    assert router.breaker("big").num_slow_calls == 1


async def test_each_model_of_the_ladder_gets_its_own_first_token_window():
    # mid answers in 3/4 of a window, after big used a whole one: in time for mid's own window
    engines = {
        "big": FakeEngine(ttft_s=60.0),
        "mid": FakeEngine(ttft_s=0.75 * TIMEOUT_S),
        "small": FakeEngine(),
    }
    router = make_router(engines)
    assert (await serve(router))[:2] == ({"mid"}, {True})
    assert router.num_slow_calls == {"big": 1}
    assert engines["small"].request_ids == []


async def test_the_requests_own_deadline_ends_it_without_failover_or_blame():
    engines = {"big": FakeEngine(ttft_s=60.0), "small": FakeEngine()}
    router = make_router(engines, first_token_timeout_s=5.0)
    with pytest.raises(NoModelAvailable) as info:
        await serve(router, deadline=time.monotonic() + TIMEOUT_S)
    assert isinstance(info.value.__cause__, DeadlineExceeded) and info.value.__cause__.stage == "total"
    assert engines["small"].request_ids == [] and engines["big"].aborted == ["r"]
    assert router.num_deadline_hits == {("big", "total"): 1} and router.num_slow_calls == {}
    breaker = router.breaker("big")
    assert (breaker.num_failed_calls, breaker.num_slow_calls, breaker.circuit.fail_counter) == (0, 0, 0)


async def test_the_requests_own_deadline_cuts_a_stream_after_its_first_output():
    engines = {"big": FakeEngine(hang_after=1), "small": FakeEngine()}
    router = make_router(engines)
    received = []
    with pytest.raises(DeadlineExceeded, match="deadline exceeded at total"):
        async for routed in router.generate(
            GenerateRequest("r", "big", "x", PARAMS, deadline=time.monotonic() + TIMEOUT_S)
        ):
            received.append(routed.output.request_id)
    assert received == ["r:0"] and engines["small"].request_ids == []
    assert router.breaker("big").num_failed_calls == 0


async def test_a_stalled_loop_is_a_failure_and_fails_over():
    engines = {"big": FakeEngine(ttft_s=60.0, is_stalled=True), "small": FakeEngine()}
    router = make_router(engines, stall_timeout_s=TIMEOUT_S / 2, first_token_timeout_s=5.0)
    assert (await serve(router))[0] == {"small"}
    assert router.num_deadline_hits == {("big", "stall"): 1} and router.num_slow_calls == {}
    assert router.breaker("big").num_failed_calls == 1


async def test_a_loop_silent_since_before_arrival_is_a_stall_at_the_first_token_deadline():
    # the two timeouts are equal (as the service sets them): the first-token deadline, counted from
    # arrival, fires first, and finds a loop that has not stepped for the whole stall timeout
    engines = {"big": FakeEngine(ttft_s=60.0, is_stalled=True), "small": FakeEngine()}
    engines["big"]._stalled_since -= 1.0
    router = make_router(engines, stall_timeout_s=TIMEOUT_S)
    assert (await serve(router))[0] == {"small"}
    assert router.num_deadline_hits == {("big", "stall"): 1} and router.num_slow_calls == {}
    assert router.breaker("big").num_failed_calls == 1


async def test_sustained_slowness_opens_the_breaker_and_sheds_to_the_fallback():
    engines = {"big": FakeEngine(ttft_s=60.0), "small": FakeEngine()}
    router = make_router(engines)
    results = await asyncio.gather(*[serve(router, f"r{i}") for i in range(4)])
    assert [served for served, _, _ in results] == [{"small"}] * 4
    assert router.breaker("big").state == "open"  # 4 of 4 slow
    started = time.monotonic()
    assert (await serve(router, "shed"))[:2] == ({"small"}, {True})
    assert time.monotonic() - started < TIMEOUT_S  # no deadline wait: straight to the fallback
    assert len(engines["big"].request_ids) == 4


async def test_a_transient_engine_error_is_resubmitted_once_to_the_same_model():
    engines = {"big": FakeEngine(errors=[EngineStepError("nan in logits")]), "small": FakeEngine()}
    router = make_router(engines)
    assert await serve(router) == ({"big"}, {False}, ["r-retry1:0", "r-retry1:1", "r-retry1:2"])
    assert engines["big"].request_ids == ["r", "r-retry1"] and engines["small"].request_ids == []
    assert router.num_retries == {"big": 1} and router.retry_budget.num_retries == 1
    assert router.breaker("big").num_failed_calls == 1


async def test_a_second_transient_error_fails_over_after_the_one_retry():
    errors = [EngineStepError("first"), EngineStepError("second")]
    engines = {"big": FakeEngine(errors=errors), "small": FakeEngine()}
    router = make_router(engines)
    assert (await serve(router))[:2] == ({"small"}, {True})
    assert engines["big"].request_ids == ["r", "r-retry1"]
    assert (
        router.num_retries == {"big": 1} and router.retry_budget.num_retries == 2
    )  # the retry, the failover


async def test_a_resubmit_refused_by_a_breaker_opened_during_its_backoff_fails_over(monkeypatch):
    engines = {"big": FakeEngine(errors=[EngineStepError("nan in logits")]), "small": FakeEngine()}
    router = make_router(engines)

    async def sleep(seconds: float) -> None:  # other requests trip the breaker while this one backs off
        router.breaker("big").circuit.open()

    def policy(*args, **kwargs):
        return retry_policy(*args, sleep=sleep, **kwargs)

    monkeypatch.setattr(resilience.router, "retry_policy", policy)
    assert (await serve(router))[:2] == ({"small"}, {True})  # not a 503 for the refused resubmit
    assert engines["big"].request_ids == ["r"] and router.num_retries == {}
    assert router.retry_budget.num_retries == 2  # the refused resubmit, the failover


async def test_a_poison_request_is_neither_retried_nor_failed_over():
    engines = {
        "big": FakeEngine(errors=[RequestFailedError("isolated as the step's cause")]),
        "small": FakeEngine(),
    }
    router = make_router(engines)
    with pytest.raises(RequestFailedError, match="isolated as the step's cause"):
        await serve(router)
    assert engines["big"].request_ids == ["r"] and engines["small"].request_ids == []
    assert router.num_retries == {} and router.breaker("big").num_failed_calls == 0


async def test_no_retry_and_no_failover_once_the_budget_is_spent():
    engines = {"big": FakeEngine(errors=[EngineStepError("nan in logits")]), "small": FakeEngine()}
    router = make_router(engines, retry_budget=RetryBudgetConfig(ratio=0.0, min_retries=0))
    with pytest.raises(NoModelAvailable) as info:
        await serve(router)
    assert isinstance(info.value.__cause__, EngineStepError)
    assert engines["big"].request_ids == ["r"] and engines["small"].request_ids == []


@pytest.mark.parametrize("max_continuations", [0, 2])
async def test_an_error_after_the_first_output_is_never_retried_but_continued(max_continuations):
    """Never resubmitted whole: with continuations on, the rest comes from the next model (the failed
    model's engine lives, so it is not waited for); off, the error goes to the client."""

    class FailsMidStream(FakeEngine):
        async def generate(self, prompt, params, request_id, *args, **kwargs):  # FakeEngine.generate's
            self.request_ids.append(request_id)
            yield fake_output(f"{request_id}:0")
            raise EngineStepError("mid-stream")

    engines = {"big": FailsMidStream(), "small": FakeEngine()}
    router = make_router(engines, max_continuations=max_continuations)
    received = []
    with (
        pytest.raises(EngineStepError, match="mid-stream")
        if not max_continuations
        else contextlib.nullcontext()
    ):
        async for routed in router.generate(GenerateRequest("r", "big", "x", PARAMS)):
            received.append(routed.output.request_id)
    assert engines["big"].request_ids == ["r"]
    if max_continuations:
        assert received == ["r:0", "r-cont1:0", "r-cont1:1", "r-cont1:2"]
        assert engines["small"].request_ids == ["r-cont1"]
        assert router.num_continuations == {("big", "model_failed", "small"): 1}
    else:
        assert received == ["r:0"] and engines["small"].request_ids == []


async def test_a_queue_standing_past_the_target_sheds_to_the_fallback_at_once():
    engines = {"big": FakeEngine(queue_delay=6.0), "small": FakeEngine(queue_delay=1.0)}  # target: 5 s
    router = make_router(engines)
    started = time.monotonic()
    assert await serve(router, priority=3) == ({"small"}, {True}, ["r:0", "r:1", "r:2"])
    assert time.monotonic() - started < TIMEOUT_S  # no first-token window spent waiting on big
    assert engines["big"].request_ids == [] and engines["big"].delay_asked_for == [3]
    assert router.bulkhead("big").num_rejected == {"queue_delay": 1} and router.bulkhead("big").num_seqs == 0
    breaker = router.breaker("big")  # overload is not sickness: no call, no failure, no budget spent
    assert (breaker.num_failed_calls, breaker.num_slow_calls, breaker.circuit.fail_counter) == (0, 0, 0)
    assert router.num_failovers == 1 and router.retry_budget.num_retries == 0


async def test_when_every_queue_stands_past_the_target_the_request_is_refused_with_retry_after():
    engines = {"big": FakeEngine(queue_delay=6.0), "small": FakeEngine(queue_delay=8.0)}
    router = make_router(engines)
    with pytest.raises(NoModelAvailable) as info:
        await serve(router)
    cause = info.value.__cause__
    assert isinstance(cause, QueueDelayExceeded) and (cause.model, cause.retry_after_s) == ("small", 8.0)
    assert engines["big"].request_ids == engines["small"].request_ids == []
    assert await serve(make_router(engines, bulkhead=BulkheadConfig(max_queue_delay_s=None))) == (
        {"big"},
        {False},
        ["r:0", "r:1", "r:2"],
    )  # off: admitted whatever the queue


async def test_a_request_late_behind_a_full_batch_moves_on_without_blaming_the_model():
    engines = {"big": FakeEngine(ttft_s=60.0), "small": FakeEngine(ttft_s=2 * TIMEOUT_S)}
    engines["big"].is_full = engines["small"].is_full = True  # a burst: every seat taken, more waiting
    router = make_router(engines)
    assert (await serve(router))[:2] == ({"small"}, {True})  # still moved on at the deadline
    assert router.num_deadline_hits == {("big", "first_token"): 1}
    assert router.num_slow_calls == {} and router.num_late_in_queue == {
        "big": 1,
        "small": 1,
    }  # late on the last too
    for name in engines:
        breaker = router.breaker(name)
        assert (breaker.num_slow_calls, breaker.num_failed_calls, breaker.circuit.fail_counter) == (0, 0, 0)


@pytest.mark.parametrize(
    ("num_preemptions", "slow", "late_in_queue"), [(1, {"big": 1}, {}), (2, {}, {"big": 1})]
)
async def test_a_late_token_is_queueing_when_its_own_sequence_was_preempted_since_the_last(
    num_preemptions, slow, late_in_queue
):
    """KV pressure: a preempted sequence waits, rescheduled, and its next token comes late while the
    batch has room again (is_full is False by then): its own preemption count says it queued."""

    class PreemptedMidStream(FakeEngine):
        async def generate(self, prompt, params, request_id, *args, **kwargs):  # FakeEngine.generate's
            yield RequestOutput(f"{request_id}:0", None, [], [], metrics={"num_preemptions": 1})
            await asyncio.sleep(2 * TIMEOUT_S)
            yield RequestOutput(f"{request_id}:1", None, [], [], metrics={"num_preemptions": num_preemptions})

    engines = {"big": PreemptedMidStream(), "small": FakeEngine()}
    router = make_router(engines)
    assert await serve(router) == ({"big"}, {False}, ["r:0", "r:1"])
    assert router.num_slow_calls == slow and router.num_late_in_queue == late_in_queue
    assert router.breaker("big").num_slow_calls == len(slow)


def test_stall_is_a_deadline_kind_of_its_own():
    assert issubclass(StallDetected, DeadlineExceeded)
    with pytest.raises(ValueError, match="first_token_timeout_s must be > 0, got 0"):
        RouterConfig(first_token_timeout_s=0)
    with pytest.raises(ValueError, match="stall_timeout_s must be > 0, got -1"):
        RouterConfig(stall_timeout_s=-1)
