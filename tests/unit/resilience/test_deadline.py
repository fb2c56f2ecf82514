import asyncio
import time

import pytest

from resilience.deadline import Deadlines, StallDetected
from resilience.errors import DeadlineExceeded
from tests.fakes import FakeClock

TICK_S = 0.005  # real idle timeouts in these tests: a few ms


class Source:
    """A fake engine stream: yields `items`, then hangs or ends; records how it was closed."""

    def __init__(
        self, items: list[int], hang: bool = False, clock: FakeClock | None = None, step_s: float = 0.0
    ) -> None:
        self.items, self.hang, self.clock, self.step_s = items, hang, clock, step_s
        self.num_yielded = 0
        self.closed_by: str | None = None

    async def stream(self):
        try:
            for item in self.items:
                if self.clock is not None:
                    self.clock.advance(self.step_s)
                self.num_yielded += 1
                yield item
            if self.hang:
                await asyncio.Event().wait()
        except (asyncio.CancelledError, GeneratorExit) as exc:
            self.closed_by = type(exc).__name__  # where the engine would abort the request
            raise
        else:
            self.closed_by = "end"


async def watched(source, *args, **kwargs):
    """What the router does with an engine stream: every item through `Deadlines.next`, the stream
    closed on the way out."""
    deadlines = Deadlines(*args, **kwargs)
    try:
        while True:
            try:
                yield await deadlines.next(source)
            except StopAsyncIteration:
                return
    finally:
        if hasattr(source, "aclose"):
            await source.aclose()


async def collect(source, *args, **kwargs) -> list[int]:
    return [item async for item in watched(source, *args, **kwargs)]


async def test_passes_items_through_until_the_end():
    source = Source([1, 2, 3])
    assert await collect(source.stream(), 1.0) == [1, 2, 3]
    assert source.closed_by == "end"


async def test_no_first_token_in_time_aborts_the_stream():
    source = Source([], hang=True)
    with pytest.raises(StallDetected) as info:  # no alive_at: nothing says the producer is busy
        await collect(source.stream(), TICK_S)
    assert (info.value.stage, info.value.timeout_s) == ("first_token", TICK_S)
    assert source.closed_by == "CancelledError"


async def test_stall_between_tokens_keeps_what_was_streamed():
    source = Source([7, 8], hang=True)
    received = []
    with pytest.raises(DeadlineExceeded) as info:
        async for item in watched(source.stream(), TICK_S):
            received.append(item)
    assert (received, info.value.stage) == ([7, 8], "between_tokens")
    assert source.closed_by == "CancelledError"


async def test_total_deadline_on_the_fake_clock(clock):
    # every item takes 4 s of fake time: the third lands at +12 s, past the 10 s deadline
    source = Source(list(range(100)), clock=clock, step_s=4.0)
    received = []
    with pytest.raises(DeadlineExceeded) as info:
        async for item in watched(source.stream(), 5.0, clock.now + 10.0, clock=clock):
            received.append(item)
    assert (received, info.value.stage) == ([0, 1, 2], "total")
    assert source.closed_by == "GeneratorExit"


async def test_total_deadline_closer_than_idle_timeout_blames_total(clock):
    source = Source([], hang=True)
    with pytest.raises(DeadlineExceeded) as info:
        await collect(source.stream(), 10.0, clock.now + TICK_S, clock=clock)
    assert (info.value.stage, info.value.timeout_s) == ("total", pytest.approx(TICK_S))
    assert source.closed_by == "CancelledError"


async def test_deadline_already_past_never_waits(clock):
    source = Source([1], hang=True)
    with pytest.raises(DeadlineExceeded) as info:
        await collect(source.stream(), 10.0, clock.now, clock=clock)
    assert info.value.stage == "total"
    assert source.num_yielded == 0


async def test_source_timeout_error_is_not_a_deadline():
    async def failing():
        yield 1
        raise TimeoutError("engine's own")

    with pytest.raises(TimeoutError, match="engine's own") as info:
        await collect(failing(), 1.0)
    assert not isinstance(info.value, DeadlineExceeded)


async def test_consumer_leaving_early_closes_the_source():
    source = Source([1, 2, 3], hang=True)
    wrapped = watched(source.stream(), 1.0)
    assert await anext(wrapped) == 1
    await wrapped.aclose()
    assert source.closed_by == "GeneratorExit"


async def test_consumer_cancelled_while_waiting_closes_the_source():
    source = Source([1], hang=True)
    task = asyncio.create_task(collect(source.stream(), 1.0))
    await asyncio.sleep(TICK_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed_by == "CancelledError"


async def test_plain_async_iterator_without_aclose():
    class Countdown:
        def __init__(self) -> None:
            self.n = 3

        def __aiter__(self):
            return self

        async def __anext__(self) -> int:
            if self.n == 0:
                raise StopAsyncIteration
            self.n -= 1
            return self.n

    assert await collect(Countdown(), 1.0) == [2, 1, 0]


@pytest.mark.parametrize("stall_timeout_s", [0.0, -1.0])
async def test_rejects_non_positive_stall_timeout(stall_timeout_s):
    with pytest.raises(ValueError, match=f"stall_timeout_s must be > 0, got {stall_timeout_s}"):
        await collect(Source([1]).stream(), stall_timeout_s)


def test_deadline_exceeded_checks_its_stage():
    with pytest.raises(ValueError, match="stage must be one of .*, got 'prefill'"):
        DeadlineExceeded("prefill", 1.0)
    assert isinstance(DeadlineExceeded("total", 1.0), TimeoutError)


async def test_a_late_item_from_a_busy_producer_is_queued_not_stalled():
    async def late():
        await asyncio.sleep(0.3)
        yield 1

    busy = [i async for i in watched(late(), 0.1, alive_at=time.monotonic)]  # steps keep coming
    assert busy == [1]
    with pytest.raises(StallDetected) as info:  # its last step was a second ago: stalled
        _ = [i async for i in watched(late(), 0.1, alive_at=lambda: time.monotonic() - 1.0)]
    assert info.value.stage == "first_token"


async def test_first_item_deadline_fires_even_while_the_producer_is_busy():
    source = Source([], hang=True)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeadlineExceeded, match="deadline exceeded at first_token") as info:
        await collect(
            source.stream(), 10.0, first_item_deadline=time.monotonic() + 0.05, alive_at=time.monotonic
        )
    assert not isinstance(info.value, StallDetected)  # slow, not broken
    assert info.value.timeout_s == pytest.approx(0.05, abs=0.01)
    assert 0.04 <= loop.time() - started < 5.0
    assert source.closed_by == "CancelledError"


async def test_first_item_deadline_does_not_bound_later_items():
    async def slow_after_first():
        yield 1
        await asyncio.sleep(0.1)
        yield 2

    deadline = time.monotonic() + 0.05
    assert await collect(slow_after_first(), 10.0, first_item_deadline=deadline, alive_at=time.monotonic) == [
        1,
        2,
    ]


async def test_first_item_deadline_already_past_never_starts_the_source(clock):
    source = Source([1])
    with pytest.raises(DeadlineExceeded, match="deadline exceeded at first_token after 0.000 s"):
        await collect(source.stream(), 10.0, first_item_deadline=clock.now, clock=clock)
    assert source.num_yielded == 0


async def test_total_before_first_item_deadline_blames_total(clock):
    source = Source([], hang=True)
    with pytest.raises(DeadlineExceeded) as info:
        await collect(
            source.stream(), 10.0, clock.now + TICK_S, first_item_deadline=clock.now + 1.0, clock=clock
        )
    assert (info.value.stage, info.value.timeout_s) == ("total", pytest.approx(TICK_S))


async def test_busy_producer_is_checked_again_a_stall_timeout_after_its_last_step():
    # at the first check (0.1 s in) the producer has just stepped: the next check is 0.1 s after that
    # step; by then it has been silent, so the wait ends as a stall at about 0.2 s
    loop = asyncio.get_running_loop()
    started = loop.time()
    steps = iter([time.monotonic() + 0.1])

    def alive_at() -> float:
        return next(steps, started)

    with pytest.raises(StallDetected, match="deadline exceeded at first_token"):
        await collect(Source([], hang=True).stream(), 0.1, alive_at=alive_at)
    assert 0.19 <= loop.time() - started < 5.0


async def test_at_the_first_item_deadline_a_producer_silent_all_along_is_stalled_not_slow():
    silent_since = time.monotonic() - 1.0
    with pytest.raises(StallDetected, match="deadline exceeded at first_token"):
        await collect(
            Source([], hang=True).stream(),
            0.5,
            first_item_deadline=time.monotonic() + 0.05,
            alive_at=lambda: silent_since,
        )


async def test_waits_in_the_callers_task_with_no_task_per_item():
    tasks_seen = []

    async def engine_like():
        for i in range(3):
            await asyncio.sleep(0)  # an item that is not ready at once: the caller waits for it
            tasks_seen.append(len(asyncio.all_tasks()))
            yield i

    deadlines = Deadlines(1.0, time.monotonic() + 10.0, first_item_deadline=time.monotonic() + 5.0)
    stream = engine_like()
    assert [await deadlines.next(stream) for _ in range(3)] == [0, 1, 2]
    assert tasks_seen == [1, 1, 1]  # the test's own task only
    assert not deadlines.is_first


async def test_a_timer_that_found_the_producer_busy_does_not_cancel_the_wait():
    # three stall checks pass while the producer steps; the item then arrives in the same wait
    async def late():
        await asyncio.sleep(0.35)
        yield "late"

    deadlines = Deadlines(0.1, alive_at=time.monotonic)
    assert await deadlines.next(late()) == "late"
    assert asyncio.current_task().cancelling() == 0


async def test_one_timer_serves_a_stream_of_many_items(monkeypatch):
    """A timer per item cost the event loop ~10 us a streamed token; the stream's one timer is armed
    once and left alone while items keep coming."""
    loop = asyncio.get_running_loop()
    armed = []
    call_later = loop.call_later
    monkeypatch.setattr(loop, "call_later", lambda *args: armed.append(args[0]) or call_later(*args))

    async def steady():
        for i in range(200):
            await asyncio.sleep(0)  # not ready at once: every item is a wait
            yield i

    deadlines = Deadlines(10.0, time.monotonic() + 60.0, first_item_deadline=time.monotonic() + 30.0)
    stream = steady()
    assert [await deadlines.next(stream) for _ in range(200)] == list(range(200))
    assert len(armed) == 1
    deadlines.close()
    deadlines.close()  # idempotent


async def test_a_timer_armed_in_an_earlier_wait_still_catches_a_later_stall():
    # items for ~3 stall timeouts, each well inside it: the timer keeps coming due early and is armed
    # again; then the producer hangs and the stall is caught a stall timeout after the last item
    stall_s = 0.1

    async def then_hang():
        for i in range(15):
            await asyncio.sleep(stall_s / 5)
            yield i
        await asyncio.Event().wait()

    deadlines, stream, received = Deadlines(stall_s), then_hang(), []
    with pytest.raises(StallDetected) as info:
        while True:
            received.append(await deadlines.next(stream))
            last_item = time.monotonic()
    waited = time.monotonic() - last_item
    await stream.aclose()
    assert received == list(range(15)) and info.value.stage == "between_tokens"
    assert stall_s <= waited < stall_s + 0.4  # on time, not a whole timeout late
