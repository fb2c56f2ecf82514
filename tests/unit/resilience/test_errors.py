import asyncio

import pytest

from resilience.breaker import OPEN, BreakerConfig, ModelBreaker
from resilience.deadline import Deadlines
from resilience.errors import (
    AdmissionRejected,
    BreakerOpenError,
    DeadlineExceeded,
    NoModelAvailable,
    RetryLater,
)


@pytest.mark.parametrize(("retry_after_s", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (2.01, "3")])
def test_retry_after_header_is_whole_seconds_rounded_up(retry_after_s, header):
    assert NoModelAvailable("every model refused", retry_after_s).retry_after_header == header


def test_refusals_share_one_family():
    errors = [
        BreakerOpenError("m", "open", 3.0),
        AdmissionRejected("m", "full", 1.0),
        NoModelAvailable("x", 2.0),
    ]
    assert all(isinstance(e, RetryLater) for e in errors)
    assert str(errors[0]) == "breaker of model 'm' is open"
    with pytest.raises(ValueError, match="retry_after_s must be >= 0, got -1.0"):
        RetryLater("negative", -1.0)


async def test_stalled_streams_trip_the_breaker_and_are_aborted(clock):
    breaker = ModelBreaker("primary", BreakerConfig(min_calls=2, jitter=0.0), clock=clock)
    aborted = []

    async def stalled_engine(request_id: str):
        try:
            await asyncio.Event().wait()
            yield "never"
        except asyncio.CancelledError:
            aborted.append(request_id)
            raise

    for request_id in ("a", "b"):
        with pytest.raises(DeadlineExceeded, match="deadline exceeded at first_token after 0.005 s"):
            async with breaker.calling_async():
                await Deadlines(0.005).next(stalled_engine(request_id))
    assert (aborted, breaker.state) == (["a", "b"], OPEN)
