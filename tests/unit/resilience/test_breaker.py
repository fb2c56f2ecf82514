import asyncio
import contextlib
import logging
import random
import re

import pybreaker
import pytest

from engine.errors import EngineDeadError, RequestRejectedError
from resilience.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, ModelBreaker
from resilience.deadline import StallDetected
from resilience.errors import BreakerOpenError, DeadlineExceeded
from tests.fakes import FakeClock, kwargs_id

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


async def slow(breaker: ModelBreaker, exc: BaseException | None = None) -> None:
    """A call whose first token came late; `exc`: the deadline that moved it on (excused: only slow)."""
    with contextlib.nullcontext() if exc is None else pytest.raises(type(exc), match=re.escape(str(exc))):
        async with breaker.calling_async() as call:
            call.mark_slow()
            if exc is not None:
                call.excuse()
                raise exc


async def trip(breaker: ModelBreaker) -> None:
    for _ in range(breaker.config.min_calls):
        await fail(breaker)
    assert breaker.state == OPEN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failure_rate_threshold": 0.0}, "failure_rate_threshold must be in (0, 1], got 0.0"),
        ({"failure_rate_threshold": 1.5}, "failure_rate_threshold must be in (0, 1], got 1.5"),
        ({"slow_call_rate_threshold": 0.0}, "slow_call_rate_threshold must be in (0, 1], got 0.0"),
        ({"slow_call_rate_threshold": float("nan")}, "slow_call_rate_threshold must be in (0, 1], got nan"),
        ({"min_calls": 0}, "min_calls must be >= 1, got 0"),
        ({"window_s": 0.0}, "window_s must be > 0, got 0.0"),
        ({"open_s": -1.0}, "open_s must be > 0, got -1.0"),
        ({"max_open_s": 5.0, "open_s": 10.0}, "max_open_s must be >= open_s (10.0), got 5.0"),
        ({"backoff_factor": 0.5}, "backoff_factor must be >= 1, got 0.5"),
        ({"jitter": 1.0}, "jitter must be in [0, 1), got 1.0"),
        ({"success_threshold": 0}, "success_threshold must be >= 1, got 0"),
    ],
    ids=kwargs_id,
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BreakerConfig(**kwargs)


def test_defaults_are_half_of_ten_calls_in_thirty_seconds():
    config = BreakerConfig()
    assert (
        config.failure_rate_threshold,
        config.slow_call_rate_threshold,
        config.min_calls,
        config.window_s,
    ) == (0.5, 0.5, 10, 30.0)


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


@pytest.mark.parametrize(
    "exc",
    [RequestRejectedError("prompt too long"), ValueError("bad top_p"), ConnectionResetError("client gone")],
)
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


async def test_a_stall_counts_as_a_failure(clock):
    breaker = make(clock)
    for _ in range(4):
        await fail(breaker, StallDetected("first_token", 10.0))
    assert (breaker.state, breaker.num_failed_calls, breaker.num_slow_calls) == (OPEN, 4, 0)


async def test_slow_calls_open_on_the_slow_call_rate(clock, caplog):
    breaker = make(clock)
    await run(breaker)
    await run(breaker)
    await slow(breaker)
    assert breaker.state == CLOSED
    with caplog.at_level(logging.WARNING, logger="resilience.breaker"):
        await slow(
            breaker, DeadlineExceeded("first_token", 10.0)
        )  # moved on at the deadline: slow, not failed
    assert (breaker.state, breaker.num_failed_calls, breaker.num_slow_calls) == (OPEN, 0, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "breaker primary: closed -> open (0 failed and 2 slow of 4 calls in 30 s; open for 10.0 s)"
    ]


async def test_failure_and_slow_call_rates_are_separate(clock):
    breaker = make(
        clock, BreakerConfig(failure_rate_threshold=0.5, slow_call_rate_threshold=0.75, min_calls=4)
    )
    await run(breaker)
    await slow(breaker)
    await fail(breaker)
    await slow(breaker)
    await run(breaker)
    assert breaker.state == CLOSED  # 3 of 5 bad, but 1 of 5 failed (< 50%) and 2 of 5 slow (< 75%)
    assert (breaker.num_failed_calls, breaker.num_slow_calls) == (1, 2)


async def test_excused_end_counts_only_its_slowness(clock):
    breaker = make(clock)
    for _ in range(10):  # the request's own deadline ran out after a timely first token: nobody's failure
        with pytest.raises(DeadlineExceeded, match="deadline exceeded at total"):
            async with breaker.calling_async() as call:
                call.excuse()
                raise DeadlineExceeded("total", 1.0)
    assert (breaker.state, breaker.num_failed_calls, breaker.num_slow_calls) == (CLOSED, 0, 0)
    assert breaker.circuit.fail_counter == 0
    for _ in range(4):
        await slow(breaker, DeadlineExceeded("total", 30.0))  # ran out with no first token by the deadline
    assert (breaker.state, breaker.num_failed_calls, breaker.num_slow_calls) == (OPEN, 0, 4)


async def test_slow_probe_reopens_with_a_longer_period(clock):
    breaker = make(clock)
    await trip(breaker)
    clock.advance(10.0)
    await slow(breaker)
    assert breaker.state == OPEN
    assert breaker.retry_after_s() == breaker.circuit.reset_timeout == 20.0


async def test_bad_calls_in_a_row_trip_pybreaker_itself_outside_the_window(clock):
    # one call per 2 s in a 1 s window: the window never holds min_calls, pybreaker's fail_max counts them
    breaker = make(clock, BreakerConfig(min_calls=4, window_s=1.0, jitter=0.0))
    counters = []
    for step in (fail, slow, fail):
        await step(breaker)
        counters.append(breaker.circuit.fail_counter)
        clock.advance(2.0)
    assert (counters, breaker.state) == ([1, 2, 3], CLOSED)
    await slow(breaker)
    assert breaker.state == OPEN


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
    assert changes == [
        ("primary", CLOSED, OPEN),
        ("primary", OPEN, HALF_OPEN),
        ("primary", HALF_OPEN, CLOSED),
    ]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        "breaker primary: closed -> open (4 failed and 0 slow of 4 calls in 30 s; open for 10.0 s)",
        "breaker primary: open -> half_open (open period over; letting one probe through)",
        "breaker primary: half_open -> closed (probe succeeded)",
    ]


async def test_pybreaker_holds_the_state(clock):
    breaker = make(clock)
    seen = []
    for step in (trip, lambda b: asyncio.sleep(0), run):
        await step(breaker)
        seen.append((breaker.state, type(breaker.circuit.state)))
        clock.advance(10.0)
    assert seen == [
        (OPEN, pybreaker.CircuitOpenState),
        (HALF_OPEN, pybreaker.CircuitHalfOpenState),
        (CLOSED, pybreaker.CircuitClosedState),
    ]
    assert breaker._cb is breaker.circuit


class Recorder(pybreaker.CircuitBreakerListener):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def failure(self, cb, exc) -> None:
        self.calls.append(("failure", type(exc).__name__, str(exc)))

    def success(self, cb) -> None:
        self.calls.append(("success",))

    def state_change(self, cb, old_state, new_state) -> None:
        self.calls.append(("state", old_state.name, new_state.name))


async def test_pybreaker_listeners_see_each_counted_outcome_and_nothing_else(clock):
    config = BreakerConfig(min_calls=3, failure_rate_threshold=0.6, slow_call_rate_threshold=0.3, jitter=0.0)
    breaker = make(clock, config)
    recorder = Recorder()
    breaker.circuit.add_listener(recorder)
    await run(breaker)
    await fail(breaker, ValueError("bad top_p"))  # the client's error: never reported
    await fail(breaker, EngineDeadError("boom"))
    await slow(breaker, DeadlineExceeded("first_token", 10.0))  # 1 of 3 slow: the slow-call rate trips
    clock.advance(30.0)
    await run(breaker)  # the probe
    assert recorder.calls == [
        ("success",),
        ("failure", "EngineDeadError", "boom"),
        ("failure", "SlowCallError", "primary: slow call"),
        ("state", "closed", "open"),
        ("state", "open", "half-open"),
        ("state", "half-open", "closed"),
        ("success",),
    ]  # pybreaker's order


async def test_pybreakers_own_open_timer_runs_on_the_injected_clock(clock):
    breaker = make(clock)
    await trip(breaker)
    clock.advance(9.0)
    with pytest.raises(pybreaker.CircuitBreakerError, match="Timeout not elapsed yet"):
        breaker.circuit.call(lambda: "too early")
    clock.advance(1.0)
    assert breaker.circuit.current_state == "open"  # nobody asked yet
    assert breaker.circuit.call(lambda: "probe") == "probe"  # pybreaker half-opens itself, the call closes it
    assert breaker.state == CLOSED
