import asyncio
import logging
import random
import re

import pytest

from engine.errors import EngineDeadError, RequestRejectedError
from resilience.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, ModelBreaker
from resilience.errors import BreakerOpenError, DeadlineExceeded
from tests.resilience.fakes import FakeClock

# no jitter: open periods are exact, so the fake clock can step right across them
SMALL = BreakerConfig(min_calls=4, window_s=30.0, open_s=10.0, max_open_s=35.0, jitter=0.0)


def make(clock: FakeClock, config: BreakerConfig = SMALL, **kwargs) -> ModelBreaker:
    return ModelBreaker("primary", config, clock=clock, **kwargs)


async def run(breaker: ModelBreaker, exc: BaseException | None = None) -> None:
    async with breaker.calling_async():
        await asyncio.sleep(0)
        if exc is not None:
            raise exc


async def fail(breaker: ModelBreaker, exc: BaseException | None = None) -> None:
    exc = exc or EngineDeadError("boom")
    with pytest.raises(type(exc), match=re.escape(str(exc))) as info:
        await run(breaker, exc)
    assert info.value is exc  # the engine's own error, never wrapped or replaced by the breaker


async def trip(breaker: ModelBreaker) -> None:
    for _ in range(breaker.config.min_calls):
        await fail(breaker)
    assert breaker.state == OPEN


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"failure_rate_threshold": 0.0}, "failure_rate_threshold must be in (0, 1], got 0.0"),
    ({"failure_rate_threshold": 1.5}, "failure_rate_threshold must be in (0, 1], got 1.5"),
    ({"min_calls": 0}, "min_calls must be >= 1, got 0"),
    ({"window_s": 0.0}, "window_s must be > 0, got 0.0"),
    ({"open_s": -1.0}, "open_s must be > 0, got -1.0"),
    ({"max_open_s": 5.0, "open_s": 10.0}, "max_open_s must be >= open_s (10.0), got 5.0"),
    ({"backoff_factor": 0.5}, "backoff_factor must be >= 1, got 0.5"),
    ({"jitter": 1.0}, "jitter must be in [0, 1), got 1.0"),
    ({"success_threshold": 0}, "success_threshold must be >= 1, got 0"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BreakerConfig(**kwargs)


def test_defaults_are_half_of_ten_calls_in_thirty_seconds():
    config = BreakerConfig()
    assert (config.failure_rate_threshold, config.min_calls, config.window_s) == (0.5, 10, 30.0)


async def test_below_minimum_volume_never_opens(clock):
    breaker = make(clock)
    for _ in range(3):
        await fail(breaker)
    assert breaker.state == CLOSED


async def test_opens_at_failure_rate_not_before(clock):
    breaker = make(clock, BreakerConfig(min_calls=10, jitter=0.0))
    for _ in range(6):
        await run(breaker)
    for _ in range(5):
        await fail(breaker)
    assert breaker.state == CLOSED  # 5 of 11 < 50%
    await fail(breaker)
    assert breaker.state == OPEN  # 6 of 12


async def test_window_forgets_old_failures(clock):
    breaker = make(clock)
    for _ in range(3):
        await fail(breaker)
    clock.advance(30.0)  # those three fall out of the 30 s window
    await run(breaker)
    await run(breaker)
    await fail(breaker)
    assert breaker.state == CLOSED  # 1 of 3 in the window, below min_calls
    await fail(breaker)
    assert breaker.state == OPEN  # 2 of 4


async def test_tripping_call_raises_its_own_error_not_circuit_breaker_error(clock):
    breaker = make(clock)
    for _ in range(3):
        await fail(breaker)
    with pytest.raises(EngineDeadError, match="fourth"):
        await run(breaker, EngineDeadError("fourth"))
    assert breaker.state == OPEN


async def test_open_refuses_fast_and_half_opens_on_the_injected_clock(clock):
    breaker = make(clock)
    await trip(breaker)
    with pytest.raises(BreakerOpenError) as info:
        await run(breaker)
    assert (info.value.model, info.value.state, info.value.retry_after_s) == ("primary", OPEN, 10.0)
    clock.advance(9.5)
    assert breaker.state == OPEN
    assert breaker.retry_after_s() == pytest.approx(0.5)
    clock.advance(0.5)
    assert breaker.state == HALF_OPEN
    assert breaker.is_call_permitted()


async def test_half_open_admits_exactly_one_probe(clock):
    breaker = make(clock)
    await trip(breaker)
    clock.advance(10.0)
    release = asyncio.Event()

    async def probe() -> None:
        async with breaker.calling_async() as call:
            assert call.is_probe
            await release.wait()

    task = asyncio.create_task(probe())
    await asyncio.sleep(0)
    refused = 0
    for _ in range(5):
        with pytest.raises(BreakerOpenError) as info:
            await run(breaker)
        refused += 1
        assert info.value.state == HALF_OPEN
    assert not breaker.is_call_permitted()
    release.set()
    await task
    assert (refused, breaker.state) == (5, CLOSED)


async def test_failed_probe_reopens_with_exponential_capped_period(clock):
    breaker = make(clock)
    await trip(breaker)
    periods = []
    for _ in range(4):
        periods.append(breaker.retry_after_s())
        clock.advance(periods[-1])
        await fail(breaker)  # the probe
        assert breaker.state == OPEN
    assert periods == [10.0, 20.0, 35.0, 35.0]
    clock.advance(35.0)
    await run(breaker)
    assert breaker.state == CLOSED
    await trip(breaker)
    assert breaker.retry_after_s() == 10.0  # a close resets the backoff


async def test_open_period_is_jittered_within_bounds(clock):
    config = BreakerConfig(min_calls=1, open_s=10.0, jitter=0.5)
    periods = set()
    for seed in range(20):
        breaker = ModelBreaker("m", config, clock=clock, rng=random.Random(seed))
        await fail(breaker)
        periods.add(round(breaker.retry_after_s(), 6))
    assert all(5.0 <= p <= 10.0 for p in periods)
    assert len(periods) == 20


async def test_success_threshold_needs_that_many_probes(clock):
    breaker = make(clock, BreakerConfig(min_calls=1, open_s=10.0, jitter=0.0, success_threshold=2))
    await fail(breaker)
    clock.advance(10.0)
    await run(breaker)
    assert breaker.state == HALF_OPEN
    await run(breaker)
    assert breaker.state == CLOSED


async def test_cancellation_never_counts_and_propagates_unchanged(clock):
    breaker = make(clock, BreakerConfig(min_calls=1, jitter=0.0))
    started = asyncio.Event()

    async def hang() -> None:
        async with breaker.calling_async():
            started.set()
            await asyncio.Event().wait()

    for _ in range(3):
        started.clear()
        task = asyncio.create_task(hang())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert breaker.state == CLOSED


async def test_cancelled_probe_neither_closes_nor_reopens(clock):
    breaker = make(clock)
    await trip(breaker)
    clock.advance(10.0)
    started = asyncio.Event()

    async def hang() -> None:
        async with breaker.calling_async():
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hang())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert breaker.state == HALF_OPEN
    assert breaker.is_call_permitted()  # the probe slot is free again


@pytest.mark.parametrize("exc", [RequestRejectedError("prompt too long"), ValueError("bad top_p"),
                                 ConnectionResetError("client gone")])
async def test_client_errors_count_as_nothing(clock, exc):
    breaker = make(clock)
    for _ in range(3):
        await fail(breaker)
    for _ in range(10):
        await fail(breaker, exc)
    assert breaker.state == CLOSED  # neither failures (would trip) ...
    await fail(breaker)
    assert breaker.state == OPEN  # ... nor successes (would dilute the rate): 4 of 4
    clock.advance(10.0)
    await fail(breaker, exc)
    assert breaker.state == HALF_OPEN  # and never close a half-open breaker


async def test_consumer_closing_the_stream_counts_as_nothing(clock):
    breaker = make(clock)
    await trip(breaker)
    clock.advance(10.0)

    async def stream():
        async with breaker.calling_async():
            for i in range(10):
                yield i

    agen = stream()
    assert await anext(agen) == 0
    await agen.aclose()  # GeneratorExit at the yield, inside the breaker
    assert breaker.state == HALF_OPEN
    assert breaker.is_call_permitted()


async def test_deadline_hits_and_marked_calls_count_as_failures(clock):
    breaker = make(clock)
    for _ in range(2):
        await fail(breaker, DeadlineExceeded("first_token", 10.0))
    for _ in range(2):
        async with breaker.calling_async() as call:
            call.mark_failed()  # e.g. a first token slower than the slow-call threshold
    assert breaker.state == OPEN


async def test_marked_probe_reopens(clock):
    breaker = make(clock)
    await trip(breaker)
    clock.advance(10.0)
    async with breaker.calling_async() as call:
        call.mark_failed()
    assert breaker.state == OPEN
    assert breaker.retry_after_s() == 20.0


async def test_call_admitted_before_the_trip_counts_for_nothing_after_it(clock):
    changes = []
    config = BreakerConfig(min_calls=1, open_s=10.0, jitter=0.0)
    breaker = make(clock, config, listeners=[lambda *change: changes.append(change[1:])])
    release = asyncio.Event()

    async def slow_failure() -> None:
        async with breaker.calling_async():
            await release.wait()
            raise EngineDeadError("late")

    task = asyncio.create_task(slow_failure())
    await asyncio.sleep(0)
    await fail(breaker)
    clock.advance(5.0)
    assert breaker.state == OPEN
    clock.advance(5.0)
    assert breaker.state == HALF_OPEN
    release.set()
    with pytest.raises(EngineDeadError, match="late"):
        await task
    assert breaker.state == HALF_OPEN  # the late failure is no failed probe
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN)]


async def test_listeners_and_one_log_line_per_change(clock, caplog):
    changes = []
    breaker = make(clock, listeners=[lambda *change: changes.append(change)])
    breaker.add_listener(lambda *change: 1 / 0)  # a broken listener must not break the breaker
    with caplog.at_level(logging.WARNING, logger="resilience.breaker"):
        await trip(breaker)
        clock.advance(10.0)
        await run(breaker)
    assert changes == [("primary", CLOSED, OPEN), ("primary", OPEN, HALF_OPEN), ("primary", HALF_OPEN, CLOSED)]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["breaker primary: closed -> open (4 of 4 calls failed in 30 s; open for 10.0 s)",
                     "breaker primary: open -> half_open (open period over; letting one probe through)",
                     "breaker primary: half_open -> closed (probe succeeded)"]


async def test_pybreaker_holds_the_state(clock):
    breaker = make(clock)
    seen = []
    for step in (trip, lambda b: asyncio.sleep(0), run):
        await step(breaker)
        seen.append((breaker.state, breaker._cb.current_state))
        clock.advance(10.0)
    assert seen == [(OPEN, "open"), (HALF_OPEN, "half-open"), (CLOSED, "closed")]
