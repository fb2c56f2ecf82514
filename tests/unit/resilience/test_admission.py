import asyncio
import re

import pytest

from engine.errors import RequestRejectedError
from resilience.admission import Bulkhead, BulkheadConfig
from resilience.errors import AdmissionRejected, QueueDelayExceeded
from tests.fakes import kwargs_id


def make(clock, **kwargs) -> Bulkhead:
    return Bulkhead("small", BulkheadConfig(**kwargs), clock=clock)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_tokens": 0}, "max_num_tokens must be >= 1, got 0"),
        ({"max_queue_delay_s": 0.0}, "max_queue_delay_s must be > 0 (None: off), got 0.0"),
        ({"max_owner_share": 1.5}, "max_owner_share must be in (0, 1] (None: off), got 1.5"),
        ({"min_retry_after_s": 0.0}, "need 0 < min_retry_after_s <= max_retry_after_s, got 0.0, 30.0"),
        (
            {"min_retry_after_s": 5.0, "max_retry_after_s": 2.0},
            "need 0 < min_retry_after_s <= max_retry_after_s, got 5.0, 2.0",
        ),
    ],
    ids=kwargs_id,
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BulkheadConfig(**kwargs)


def test_one_owner_holds_at_most_its_share_of_the_engines_seats(clock):
    """A key sending n=128 with long outputs took every seat of a model; others got no answer."""
    bulkhead = Bulkhead(
        "small", BulkheadConfig(max_owner_share=0.5), clock=clock, engine_capacity=40, engine_seats=8
    )
    first = bulkhead.try_acquire(10, 3, owner="key-a")
    with pytest.raises(AdmissionRejected) as info:
        bulkhead.try_acquire(10, 2, owner="key-a")
    assert info.value.reason == "this API key holds 3 sequences; 3 + 2 exceed its share, 4"
    with pytest.raises(
        RequestRejectedError, match="one API key may hold at most 4 of the seats of model 'small'"
    ):
        bulkhead.try_acquire(10, 5, owner="key-b")
    bulkhead.try_acquire(10, 4, owner="key-b")
    bulkhead.try_acquire(10, 8)  # no owner (no API keys): only the model's own bounds
    first.release()
    bulkhead.try_acquire(10, 4, owner="key-a")
    assert bulkhead.num_seqs_by_owner == {"key-a": 4, "key-b": 4}
    assert bulkhead.num_rejected == {"owner_share": 1}


def test_request_cap_refuses_at_once_and_release_makes_room(clock):
    bulkhead = make(clock, max_num_seqs=2, max_num_tokens=100)
    first, _second = bulkhead.try_acquire(10), bulkhead.try_acquire(10)
    assert not bulkhead.can_acquire(1)
    with pytest.raises(AdmissionRejected) as info:
        bulkhead.try_acquire(1)
    assert (info.value.model, info.value.reason) == ("small", "2 + 1 sequences exceed 2")
    assert info.value.retry_after_s == 1.0
    first.release()
    assert bulkhead.can_acquire(1)
    assert (bulkhead.num_seqs, bulkhead.num_tokens, bulkhead.num_rejected) == (1, 10, {"max_num_seqs": 1})


def test_token_cap_counts_prompt_and_max_tokens(clock):
    bulkhead = make(clock, max_num_seqs=10, max_num_tokens=100)
    bulkhead.try_acquire(60)
    with pytest.raises(AdmissionRejected, match="60 \\+ 50 tokens exceed 100"):
        bulkhead.try_acquire(50)
    bulkhead.try_acquire(40)
    assert (bulkhead.num_seqs, bulkhead.num_tokens, bulkhead.num_rejected) == (2, 100, {"max_num_tokens": 1})


def test_request_larger_than_the_bulkhead_is_a_request_error(clock):
    bulkhead = make(clock, max_num_tokens=100)
    with pytest.raises(
        RequestRejectedError,
        match=r"needs 101 tokens \(prompt \+ n x max_tokens\); model "
        r"'small' admits at most 100 at a time",
    ):
        bulkhead.try_acquire(101)
    with pytest.raises(ValueError, match="need num_tokens >= 0 and num_seqs >= 1, got -1, 1"):
        bulkhead.try_acquire(-1)
    assert not bulkhead.num_rejected


def test_sequences_count_n_and_default_to_the_engine_capacity(clock):
    bulkhead = Bulkhead("small", BulkheadConfig(), clock=clock, engine_capacity=6)
    assert bulkhead.max_num_seqs == 6 and bulkhead.config.max_num_tokens is None
    bulkhead.try_acquire(10_000_000, num_seqs=4)  # no token bound unless one is configured
    with pytest.raises(AdmissionRejected, match=r"4 \+ 4 sequences exceed 6"):
        bulkhead.try_acquire(1, num_seqs=4)
    with pytest.raises(RequestRejectedError, match="needs 7 sequences .*admits at most 6 at a time"):
        bulkhead.try_acquire(1, num_seqs=7)  # never fits, even when empty: a 4xx, not a 429 forever
    assert Bulkhead("x", BulkheadConfig(max_num_seqs=3), clock=clock, engine_capacity=6).max_num_seqs == 3


def test_release_is_idempotent(clock):
    bulkhead = make(clock, max_num_seqs=2, max_num_tokens=100)
    permit = bulkhead.try_acquire(30)
    bulkhead.try_acquire(20)
    permit.release()
    permit.release()
    with permit:
        pass
    assert (permit.is_released, bulkhead.num_seqs, bulkhead.num_tokens) == (True, 1, 20)


async def test_async_with_releases_on_error(clock):
    bulkhead = make(clock, max_num_seqs=1)
    with pytest.raises(RuntimeError, match="engine died"):
        async with bulkhead.try_acquire(5):
            assert bulkhead.num_seqs == 1
            raise RuntimeError("engine died")
    assert (bulkhead.num_seqs, bulkhead.num_tokens) == (0, 0)


async def test_releases_when_the_request_is_cancelled(clock):
    bulkhead = make(clock, max_num_seqs=1)
    holding = asyncio.Event()

    async def handler() -> None:
        async with bulkhead.try_acquire(5):
            holding.set()
            await asyncio.Event().wait()  # a stream the client walks away from

    task = asyncio.create_task(handler())
    await holding.wait()
    assert not bulkhead.can_acquire(5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (bulkhead.num_seqs, bulkhead.num_tokens) == (0, 0)


def test_retry_after_follows_hold_times_within_bounds(clock):
    bulkhead = make(clock, max_num_seqs=1, min_retry_after_s=1.0, max_retry_after_s=30.0)
    for hold_s, expected in [(4.0, 4.0), (4.0, 4.0), (14.0, 6.0), (0.0, 4.8)]:
        permit = bulkhead.try_acquire(1)
        clock.advance(hold_s)
        permit.release()
        assert bulkhead.retry_after_s() == pytest.approx(expected)
    for _ in range(50):
        with bulkhead.try_acquire(1):
            clock.advance(100.0)
    assert bulkhead.retry_after_s() == 30.0
    for _ in range(50):
        with bulkhead.try_acquire(1):
            pass
    assert bulkhead.retry_after_s() == 1.0


def test_a_queue_that_held_its_head_past_the_target_refuses_until_it_drains(clock):
    bulkhead = make(clock, max_num_seqs=4, max_queue_delay_s=5.0, max_retry_after_s=30.0)
    bulkhead.try_acquire(1, queue_delay_s=5.0)  # at the target: still admitted
    with pytest.raises(QueueDelayExceeded) as info:
        bulkhead.try_acquire(1, queue_delay_s=7.5)
    assert isinstance(info.value, AdmissionRejected)  # a 429 when no other model takes it
    assert (info.value.model, info.value.delay_s, info.value.retry_after_s) == ("small", 7.5, 7.5)
    assert info.value.reason == "its queue has held a request 7.5 s (target 5 s)"
    with pytest.raises(QueueDelayExceeded) as info:
        bulkhead.try_acquire(1, queue_delay_s=90.0)
    assert info.value.retry_after_s == 30.0  # within the Retry-After bounds
    bulkhead.try_acquire(1, queue_delay_s=0.0)  # drained: admitted again
    assert (bulkhead.num_seqs, bulkhead.num_rejected) == (2, {"queue_delay": 2})


def test_the_queue_delay_target_is_checked_after_what_never_fits_and_can_be_off(clock):
    bulkhead = make(clock, max_num_tokens=10, max_queue_delay_s=1.0)
    with pytest.raises(RequestRejectedError):  # a 4xx wins over a 429: waiting would never help
        bulkhead.try_acquire(11, queue_delay_s=60.0)
    unbounded = make(clock, max_queue_delay_s=None)
    unbounded.try_acquire(1, queue_delay_s=3600.0)
    assert not unbounded.num_rejected
