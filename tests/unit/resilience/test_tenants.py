"""Tenant quotas (resilience/tenants.py) on a fake clock: the token bucket, the honest Retry-After, the
concurrency cap, and tokens counted as served."""

import pytest

from resilience.errors import RetryLater
from resilience.tenants import Tenant, TenantLimiter, TenantLimitExceeded, TenantRequestTooLarge, TokenBucket
from tests.fakes import FakeClock

RATED = Tenant("a", tokens_per_minute=600, burst=100)  # 10 tokens a second, 100 at most


def test_bucket_refills_at_its_rate_up_to_its_size_and_may_be_overdrawn():
    clock = FakeClock(0.0)
    bucket = TokenBucket(10.0, 100.0, clock)
    bucket.take(130)
    assert bucket.level == -30
    assert bucket.seconds_until(20) == 5.0
    clock.now = 5.0
    assert bucket.level == 20
    clock.now = 1000.0
    assert bucket.level == 100


def test_retry_after_is_when_the_same_request_is_admitted():
    clock = FakeClock(0.0)
    limiter = TenantLimiter([RATED], clock)
    first = limiter.admit(RATED, 30)
    first.serve_prompt(30)
    first.serve_generated(60)  # generated past the level: 100 - 90 = 10 left
    first.release()
    with pytest.raises(TenantLimitExceeded) as refused:
        limiter.admit(RATED, 25)
    assert refused.value.reason == "token_rate" and isinstance(refused.value, RetryLater)
    assert refused.value.retry_after_s == pytest.approx(1.5)
    assert refused.value.retry_after_header == "2"
    clock.now = refused.value.retry_after_s - 0.01  # just before: still refused
    with pytest.raises(TenantLimitExceeded):
        limiter.admit(RATED, 25)
    clock.now = int(refused.value.retry_after_header)
    limiter.admit(RATED, 25).release()
    assert limiter.num_rejected["a", "token_rate"] == 2


def test_tokens_counted_are_the_tokens_served_and_an_unserved_prompt_is_given_back():
    clock = FakeClock(0.0)
    limiter = TenantLimiter([RATED], clock)
    served = limiter.admit(RATED, 20)
    served.serve_prompt(12)  # one of two prompts answered; the other's request ended without output
    served.serve_generated(5)
    served.release()
    served.release()  # idempotent
    assert limiter.buckets["a"].level == 100 - 12 - 5  # the other prompt's 8 tokens came back
    assert (limiter.num_served["a", "prompt"], limiter.num_served["a", "generation"]) == (12, 5)
    assert served.num_served == 17 and limiter.num_in_flight["a"] == 0


def test_the_concurrency_cap_refuses_while_the_tenant_has_that_many_in_flight():
    capped = Tenant("c", max_concurrency=2)
    limiter = TenantLimiter([capped], FakeClock(0.0))
    held = [limiter.admit(capped, 1), limiter.admit(capped, 1)]
    with pytest.raises(TenantLimitExceeded, match="2 requests in flight") as refused:
        limiter.admit(capped, 1)
    assert refused.value.reason == "concurrency" and refused.value.retry_after_header == "1"
    held[0].release()
    limiter.admit(capped, 1)
    assert limiter.num_in_flight["c"] == 2
    assert "c" not in limiter.buckets  # no rate: no bucket


def test_a_prompt_bigger_than_the_burst_is_refused_as_too_large_not_as_later():
    limiter = TenantLimiter([RATED], FakeClock(0.0))
    with pytest.raises(TenantRequestTooLarge, match="101 prompt tokens exceed the tenant's burst of 100"):
        limiter.admit(RATED, 101)
    assert limiter.num_rejected["a", "too_large"] == 1 and limiter.num_in_flight["a"] == 0


def test_other_tenants_are_not_touched():
    clock = FakeClock(0.0)
    other = Tenant("b", tokens_per_minute=60)
    limiter = TenantLimiter([RATED, other], clock)
    limiter.admit(RATED, 100)
    limiter.admit(other, 60)
    with pytest.raises(TenantLimitExceeded):
        limiter.admit(RATED, 1)
    assert limiter.buckets["b"].level == 0 and limiter.buckets["b"].capacity == 60  # burst: a minute


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight": 0}, "weight must be a positive number"),
        ({"weight": float("nan")}, "weight must be a positive number"),
        ({"priority": 1.5}, "priority must be an integer"),
        ({"tokens_per_minute": -1}, "tokens_per_minute must be a positive number"),
        ({"tokens_per_minute": 60, "burst": 0}, "burst must be an integer >= 1"),
        ({"max_concurrency": True}, "max_concurrency must be an integer >= 1"),
        ({"burst": 5}, "a burst needs tokens_per_minute"),
    ],
)
def test_a_tenant_checks_itself(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tenant("t", **kwargs)
