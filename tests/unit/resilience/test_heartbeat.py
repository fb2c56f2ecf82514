import asyncio
import threading

import pytest

from resilience.errors import ProbeError
from resilience.heartbeat import DEFAULT_MAX_NUM_SEQS, Heartbeat, engine_load
from resilience.leak_detector import MIB, LeakDetector, LeakDetectorConfig
from resilience.probes import MemorySample
from tests.fakes import FakeStatsEngine, kwargs_id

NO_WARMUP = LeakDetectorConfig(warmup_s=0.0)


class GrowingProbe:
    """+64 MiB per call; each call advances the fake clock by one 30 s heartbeat."""

    def __init__(self, clock, step_bytes: int = 64 * MIB) -> None:
        self.clock, self.step_bytes = clock, step_bytes
        self.num_calls = 0
        self.thread_ids: set[int] = set()

    def __call__(self) -> MemorySample:
        self.thread_ids.add(threading.get_ident())
        self.num_calls += 1
        self.clock.advance(30.0)
        return MemorySample("cpu", used_bytes=1024 * MIB + self.num_calls * self.step_bytes)


def make(clock, probe, **kwargs) -> Heartbeat:
    return Heartbeat(probe, LeakDetector(NO_WARMUP, clock=clock), clock=clock, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": 0.0}, "interval_s must be > 0, got 0.0"),
        ({"probe_timeout_s": -1.0}, "probe_timeout_s must be > 0, got -1.0"),
    ],
    ids=kwargs_id,
)
def test_rejects_bad_intervals(clock, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(clock, GrowingProbe(clock), **kwargs)


async def test_beat_feeds_the_detector_and_reports_a_leak_once(clock):
    leaks = []
    probe = GrowingProbe(clock)
    heartbeat = make(clock, probe, on_leak=leaks.append)
    for _ in range(5):
        sample = await heartbeat.beat()
    assert heartbeat.last_sample == sample
    assert heartbeat.last_sample_at == clock.now
    assert len(leaks) == 1  # flagged at the third beat; later beats keep the flag without repeating
    assert leaks[0].num_samples == 3
    assert heartbeat.last_report is not None
    assert threading.get_ident() not in probe.thread_ids  # probed off the event loop


async def test_samples_carry_the_load_and_a_leak_under_load_is_still_flagged(clock):
    leaks = []
    heartbeat = make(clock, GrowingProbe(clock), load=lambda: 0.25, on_leak=leaks.append)
    for _ in range(5):
        await heartbeat.beat()
    assert heartbeat._detector.num_busy_samples == 5
    assert len(leaks) == 1 and leaks[0].load == 0.25


async def test_a_sample_takes_the_higher_load_of_the_probe_call_s_two_ends(clock):
    loads = iter([0.0, 0.5] * 5)  # idle when the probe starts, busy when it answers: not idle
    heartbeat = make(clock, GrowingProbe(clock), load=lambda: next(loads))
    for _ in range(5):
        await heartbeat.beat()
    assert heartbeat._detector.num_busy_samples == 5
    assert heartbeat.last_report is not None and heartbeat.last_report.load == 0.5


def test_engine_load_is_the_sequences_held_per_sequence_slot():
    assert engine_load([]) == 0.0
    assert engine_load([FakeStatsEngine(0, max_num_seqs=8), FakeStatsEngine(0)]) == 0.0
    assert engine_load([FakeStatsEngine(64, max_num_seqs=128), FakeStatsEngine(0, max_num_seqs=128)]) == 0.25
    assert engine_load([FakeStatsEngine(0, num_waiting=3, max_num_seqs=8)]) == 3 / 8  # queued: busy
    assert engine_load([FakeStatsEngine(8, num_waiting=24, max_num_seqs=8)]) == 4.0  # a backlog
    assert engine_load([FakeStatsEngine(32)]) == 32 / DEFAULT_MAX_NUM_SEQS  # a fake without a config


async def test_memory_that_grows_with_a_growing_backlog_is_no_leak(clock):
    """Overload: every slot running and the queue growing by 400 requests a beat, memory with it."""
    leaks = []
    backlog = iter(range(0, 4000, 400))
    heartbeat = make(
        clock,
        GrowingProbe(clock),
        load=lambda: engine_load([FakeStatsEngine(128, num_waiting=next(backlog), max_num_seqs=128)]),
        on_leak=leaks.append,
    )
    for _ in range(4):
        await heartbeat.beat()
    assert heartbeat._detector.num_busy_samples == 4 and leaks == []


async def test_probe_errors_are_reported_and_the_beat_goes_on(clock):
    errors = []
    calls = iter([ProbeError("NVML: GPU is lost", is_fatal=True), MemorySample("cpu", used_bytes=1)])

    def probe() -> MemorySample:
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    heartbeat = make(clock, probe, on_probe_error=errors.append)
    assert await heartbeat.beat() is None
    assert await heartbeat.beat() == MemorySample("cpu", used_bytes=1)
    assert [(str(e), e.is_fatal) for e in errors] == [("NVML: GPU is lost", True)]
    assert heartbeat.num_probe_errors == 1


async def test_hung_probe_is_reported_then_fatal_and_never_stacked(clock):
    errors, release, num_calls = [], threading.Event(), [0]

    def probe() -> MemorySample:
        num_calls[0] += 1
        release.wait(5.0)
        return MemorySample("cpu", used_bytes=1)

    heartbeat = make(clock, probe, probe_timeout_s=0.005, on_probe_error=errors.append)
    assert await heartbeat.beat() is None
    clock.advance(30.0)
    assert await heartbeat.beat() is None
    assert [(str(e), e.is_fatal) for e in errors] == [
        ("memory probe did not answer within 0.005 s", False),
        ("memory probe hung for 30.0 s", True),
    ]
    release.set()
    async with asyncio.timeout(10.0):
        while heartbeat._pending is not None:
            await asyncio.sleep(0.001)
    # the probe answers again; a worker thread can wait well over 5 ms for a core on a loaded box, so
    # the next beat gets a timeout that only a hung probe would miss
    heartbeat.probe_timeout_s = 10.0
    assert await heartbeat.beat() == MemorySample("cpu", used_bytes=1)
    assert num_calls[0] == 2


async def test_start_runs_beats_until_stop_despite_a_failing_callback(clock):
    loop, enough, num_calls = asyncio.get_running_loop(), asyncio.Event(), [0]

    def flaky_probe() -> MemorySample:  # runs in a worker thread
        num_calls[0] += 1
        if num_calls[0] == 5:
            loop.call_soon_threadsafe(enough.set)
        if num_calls[0] % 2:
            raise ProbeError("flaky")
        return MemorySample("cpu", used_bytes=1)

    def broken_callback(exc: BaseException) -> None:
        raise RuntimeError("broken callback")

    heartbeat = make(
        clock, flaky_probe, interval_s=0.001, probe_timeout_s=1.0, on_probe_error=broken_callback
    )
    heartbeat.start()
    with pytest.raises(RuntimeError, match="heartbeat already running"):
        heartbeat.start()
    async with asyncio.timeout(30.0):  # 5 beats 1 ms apart; generous for a loaded 2-core box
        await enough.wait()
    async with asyncio.timeout(10.0):  # a cancel swallowed inside beat() would hang here
        await heartbeat.stop()
    assert not heartbeat.is_running
    assert heartbeat.num_probe_errors >= 2 and heartbeat.last_sample == MemorySample("cpu", used_bytes=1)
    num_beats = heartbeat.num_beats
    await asyncio.sleep(0.01)
    assert heartbeat.num_beats == num_beats  # stopped for good
