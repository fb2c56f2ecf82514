import asyncio
import re

import pybreaker
import pytest

from engine.errors import EngineOverloadedError
from resilience.errors import AdmissionRejected, BreakerOpenError
from resilience.retry import RetryBudget, RetryBudgetConfig, RetryConfig, retry_policy
from tests.fakes import FakeClock, kwargs_id


class Op:
    """Fails with the given errors in turn, then succeeds; sleeps advance the fake clock."""

    def __init__(self, clock: FakeClock, errors: list[BaseException]) -> None:
        self.clock, self.errors = clock, list(errors)
        self.num_calls = 0
        self.sleeps: list[float] = []

    async def __call__(self) -> str:
        self.num_calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.advance(seconds)


async def run(op: Op, **kwargs) -> str:
    async for attempt in retry_policy(sleep=op.sleep, clock=op.clock, **kwargs):
        with attempt:
            return await op()
    raise AssertionError("unreachable: reraise=True")


def test_budget_allows_ratio_of_requests(clock):
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, window_s=10.0, min_retries=3), clock=clock)
    for _ in range(100):
        budget.record_request()
    spent = sum(budget.try_spend() for _ in range(50))
    assert (spent, budget.num_retries, budget.can_retry()) == (10, 10, False)


def test_budget_minimum_serves_low_traffic_and_window_refills(clock):
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, window_s=10.0, min_retries=3), clock=clock)
    budget.record_request()
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    clock.advance(10.0)
    assert (budget.num_requests, budget.num_retries, budget.can_retry()) == (0, 0, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio": 1.5}, "ratio must be in [0, 1], got 1.5"),
        ({"ratio": -0.1}, "ratio must be in [0, 1], got -0.1"),
        ({"window_s": 0.0}, "window_s must be > 0, got 0.0"),
        ({"min_retries": -1}, "min_retries must be >= 0, got -1"),
    ],
    ids=kwargs_id,
)
def test_budget_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RetryBudgetConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be >= 1, got 0"),
        ({"initial_wait_s": 0.0}, "need 0 < initial_wait_s <= max_wait_s, got 0.0, 2.0"),
        ({"initial_wait_s": 3.0, "max_wait_s": 2.0}, "need 0 < initial_wait_s <= max_wait_s, got 3.0, 2.0"),
    ],
    ids=kwargs_id,
)
def test_retry_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RetryConfig(**kwargs)


async def test_retries_transient_errors_with_full_jitter_backoff(clock):
    op = Op(clock, [EngineOverloadedError("queue full"), ConnectionError("reset")])
    config = RetryConfig(max_attempts=3, initial_wait_s=0.1, max_wait_s=2.0)
    assert await run(op, config=config) == "ok"
    assert op.num_calls == 3
    assert len(op.sleeps) == 2
    assert 0 <= op.sleeps[0] <= 0.1 and 0 <= op.sleeps[1] <= 0.2


async def test_gives_up_after_max_attempts_with_the_original_error(clock):
    op = Op(clock, [EngineOverloadedError(str(i)) for i in range(5)])
    with pytest.raises(EngineOverloadedError, match="^2$"):  # the last of the three attempts
        await run(op, config=RetryConfig(max_attempts=3))
    assert op.num_calls == 3


@pytest.mark.parametrize(
    "exc",
    [
        BreakerOpenError("m", "open", 5.0),
        AdmissionRejected("m", "full", 1.0),
        pybreaker.CircuitBreakerError("open"),
    ],
)
async def test_never_retries_refusals(clock, exc):
    op = Op(clock, [exc])
    with pytest.raises(type(exc)) as info:
        await run(op, config=RetryConfig(retry_on=(Exception,)))  # even when asked to retry everything
    assert info.value is exc
    assert op.num_calls == 1


async def test_request_errors_are_not_retried_by_default(clock):
    op = Op(clock, [ValueError("bad top_p")])
    with pytest.raises(ValueError, match="bad top_p"):
        await run(op)
    assert op.num_calls == 1


async def test_cancellation_is_never_retried(clock):
    op = Op(clock, [asyncio.CancelledError()])
    with pytest.raises(asyncio.CancelledError):
        await run(op, config=RetryConfig(retry_on=(BaseException,)))
    assert op.num_calls == 1


async def test_stops_when_the_wait_would_pass_the_deadline(clock):
    op = Op(clock, [EngineOverloadedError("a"), EngineOverloadedError("b")])
    config = RetryConfig(max_attempts=5, initial_wait_s=1.0, max_wait_s=1.0)
    with pytest.raises(EngineOverloadedError, match="^a$"):
        await run(op, config=config, deadline=clock.now)  # already due
    assert op.num_calls == 1


async def test_deadline_leaves_room_for_retries_before_it(clock):
    op = Op(clock, [EngineOverloadedError("a")])
    assert await run(op, config=RetryConfig(max_attempts=3), deadline=clock.now + 60.0) == "ok"
    assert op.num_calls == 2


@pytest.mark.parametrize(("permitted", "num_calls"), [(True, 3), (False, 1)])
async def test_stops_when_the_breaker_refuses(clock, permitted, num_calls):
    op = Op(clock, [EngineOverloadedError("a"), EngineOverloadedError("b")])
    if permitted:
        assert await run(op, is_call_permitted=lambda: True) == "ok"
    else:
        with pytest.raises(EngineOverloadedError, match="^a$"):
            await run(op, is_call_permitted=lambda: False)
    assert op.num_calls == num_calls


async def test_spent_budget_stops_retries_and_bounds_retry_traffic(clock):
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, window_s=100.0, min_retries=3), clock=clock)
    num_calls = 0
    for _ in range(500):  # a 100% failure injection
        op = Op(clock, [EngineOverloadedError("down")] * 3)
        with pytest.raises(EngineOverloadedError, match="down"):
            await run(
                op, config=RetryConfig(max_attempts=3, initial_wait_s=1e-6, max_wait_s=1e-6), budget=budget
            )
        num_calls += op.num_calls
    assert budget.num_requests == 500
    assert num_calls - 500 == budget.num_retries <= 0.1 * 500


async def test_budget_is_not_charged_when_another_stop_wins(clock):
    budget = RetryBudget(RetryBudgetConfig(min_retries=3), clock=clock)
    op = Op(clock, [EngineOverloadedError("a")])
    with pytest.raises(EngineOverloadedError, match="^a$"):
        await run(op, config=RetryConfig(max_attempts=1), budget=budget)
    assert (budget.num_requests, budget.num_retries) == (1, 0)
