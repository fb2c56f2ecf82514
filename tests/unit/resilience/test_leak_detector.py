"""The leak detector on generated series: 10 minutes of 30 s heartbeats, idle or busy, and 10 minutes of
1 s heartbeats under continuous or varying traffic."""

import random
import re

import pytest

from resilience.leak_detector import MIB, LeakDetector, LeakDetectorConfig
from resilience.probes import MemorySample
from tests.fakes import FakeClock, kwargs_id

BEAT_S = 30.0
NUM_BEATS = 21  # 0 .. 600 s
Beat = tuple[float, MemorySample]  # (load: 0.0 idle, else the sequences held per sequence slot, sample)


def cuda_sample(footprint: float, cache: float = 0.0, non_torch: float = 300 * MIB) -> MemorySample:
    allocated = int(footprint - non_torch)
    return MemorySample(
        "cuda:0",
        used_bytes=int(footprint + cache),
        allocated_bytes=allocated,
        reserved_bytes=allocated + int(cache),
    )


def normal_load(rng: random.Random, is_cuda: bool) -> list[Beat]:
    """Half the beats busy at a random load (an activation working set of 300 MiB x load), +-10 MiB
    noise, a 400 MiB warm-up jump at 60 s, a one-time 200 MiB jump at 330 s, allocator cache growing
    to 512 MiB."""
    beats, cache = [], 0.0
    for i in range(NUM_BEATS):
        is_busy = rng.random() < 0.5
        load = rng.uniform(0.05, 1.0) if is_busy else 0.0
        footprint = 1024 * MIB + rng.uniform(-10, 10) * MIB
        footprint += 400 * MIB * (i * BEAT_S >= 60) + 200 * MIB * (i * BEAT_S >= 330)
        footprint += 300 * MIB * load
        cache = min(512 * MIB, cache + rng.choice([0, 32, 64]) * MIB)
        sample = cuda_sample(footprint, cache) if is_cuda else MemorySample("cpu", used_bytes=int(footprint))
        beats.append((load, sample))
    return beats


def leaking(rng: random.Random, start: int, kind: str) -> list[Beat]:
    """Idle server leaking 64 MiB per heartbeat from beat `start` on, with +-10 MiB noise."""
    beats = []
    for i in range(NUM_BEATS):
        leaked = 64 * MIB * max(0, i - start + 1)
        base = 1024 * MIB + rng.uniform(-10, 10) * MIB
        sample = {
            "rss": MemorySample("cpu", used_bytes=int(base + leaked)),
            "tensors": cuda_sample(base + leaked),  # allocated grows
            "non_torch": cuda_sample(base + leaked, non_torch=300 * MIB + leaked),
        }[kind]
        beats.append((0.0, sample))
    return beats


def feed(beats: list[Beat], config: LeakDetectorConfig | None = None, beat_s: float = BEAT_S) -> list[bool]:
    clock = FakeClock(0.0)
    detector = LeakDetector(config, clock=clock)
    flags = []
    for i, (load, sample) in enumerate(beats):
        clock.now = i * beat_s
        flags.append(detector.add(sample, load) is not None)
    return flags


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_s": -1.0}, "warmup_s must be >= 0, got -1.0"),
        ({"window_s": 0.0}, "window_s must be > 0, got 0.0"),
        ({"min_samples": 2}, "min_samples must be >= 3 (a line and a step fit any 2), got 2"),
        ({"min_growth_bytes": -1.0}, "min_growth_bytes must be >= 0, got -1.0"),
        ({"min_slope_bytes_per_s": -1.0}, "min_slope_bytes_per_s must be >= 0, got -1.0"),
        ({"min_samples": 5, "max_samples": 4}, "max_samples must be >= min_samples (5), got 4"),
        ({"load_tolerance": -0.1}, "load_tolerance must be >= 0, got -0.1"),
    ],
    ids=kwargs_id,
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LeakDetectorConfig(**kwargs)


@pytest.mark.parametrize("is_cuda", [True, False])
def test_ten_minutes_of_normal_load_never_flags(is_cuda):
    for seed in range(50):
        assert not any(feed(normal_load(random.Random(seed), is_cuda))), seed


@pytest.mark.parametrize("kind", ["rss", "tensors", "non_torch"])
@pytest.mark.parametrize("start", [4, 9, 14])  # right after warm-up, and after flat stretches
def test_flags_64_mib_per_heartbeat_within_three_heartbeats(kind, start):
    for seed in range(20):
        flags = feed(leaking(random.Random(seed), start, kind))
        assert not any(flags[:start]), seed
        assert any(flags[start : start + 3]), seed


def test_allocator_cache_growth_is_not_a_leak_but_the_same_growth_in_tensors_is():
    cache_growth = [(0.0, cuda_sample(1024 * MIB, cache=64 * MIB * i)) for i in range(NUM_BEATS)]
    tensor_growth = [(0.0, cuda_sample(1024 * MIB + 64 * MIB * i)) for i in range(NUM_BEATS)]
    assert [s.used_bytes for _, s in cache_growth] == [s.used_bytes for _, s in tensor_growth]
    assert not any(feed(cache_growth))
    assert feed(tensor_growth)[6]  # warm-up ends at 120 s (beat 4); beats 4, 5, 6 rise


def test_report_keeps_cache_apart():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=0.0), clock=clock)
    report = None
    for i in range(3):
        report = detector.add(cuda_sample(1024 * MIB + 64 * MIB * i, cache=32 * MIB * i), load=0.0)
        clock.advance(BEAT_S)
    assert report is not None
    assert (report.device, report.num_samples, report.span_s) == ("cuda:0", 3, 60.0)
    assert report.growth_bytes == pytest.approx(128 * MIB)
    assert report.cache_growth_bytes == pytest.approx(64 * MIB)
    assert report.describe() == (
        "cuda:0: +128 MiB over 60 s of idle samples (7680 MiB/h, 3 samples; allocator cache +64 MiB apart)"
    )


def test_samples_at_other_loads_are_not_compared():
    jumps = [
        (0.5 * (i % 2), MemorySample("cpu", used_bytes=(1024 + 300 * (i % 2)) * MIB))
        for i in range(NUM_BEATS)
    ]  # busy every other beat with 300 MiB of working set
    assert not any(feed(jumps))
    steps = [
        (0.25 * (i % 4), MemorySample("cpu", used_bytes=(1024 + 200 * (i % 4)) * MIB))
        for i in range(NUM_BEATS)
    ]  # 0, 25, 50, 75 % of the slots, +200 MiB of working set each
    assert not any(feed(steps))


def test_growth_below_the_floor_or_slope_is_not_flagged():
    slow = [(0.0, MemorySample("cpu", used_bytes=(1024 + 4 * i) * MIB)) for i in range(NUM_BEATS)]
    assert not any(feed(slow))  # 4 MiB per beat: 40 MiB over the 300 s window, under the 64 MiB floor
    assert any(feed(slow, LeakDetectorConfig(min_growth_bytes=32 * MIB)))
    assert not any(
        feed(slow, LeakDetectorConfig(min_growth_bytes=32 * MIB, min_slope_bytes_per_s=1 * MIB))
    )  # 0.13 MiB/s


def test_reset_restarts_the_warm_up():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=60.0), clock=clock)
    for i in range(6):
        clock.now = i * BEAT_S
        detector.add(MemorySample("cpu", used_bytes=(1024 + 64 * i) * MIB), load=0.0)
    assert detector.check() is not None
    detector.reset()  # e.g. a model was loaded
    for i in range(6, 9):
        clock.now = i * BEAT_S
        assert detector.add(MemorySample("cpu", used_bytes=(1024 + 64 * i) * MIB), load=0.0) is None
    assert detector.num_samples == 2  # reset at 150 s: 180 s fell in the new warm-up


def test_old_samples_leave_the_window():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=0.0, window_s=90.0), clock=clock)
    for i in range(10):
        clock.now = i * BEAT_S
        detector.add(MemorySample("cpu", used_bytes=1024 * MIB), load=0.0)
    assert detector.num_samples == 3


def test_keeps_at_most_max_samples_however_fast_they_come():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=0.0, max_samples=8), clock=clock)
    for i in range(100):
        clock.now = i * 0.001
        detector.add(MemorySample("cpu", used_bytes=(1024 + 64 * i) * MIB), load=0.0)
    assert detector.num_samples == 8
    assert detector.check() is not None


# --- under traffic: 1 s heartbeats, as the real-server tests run them -------------------------------
TRAFFIC = LeakDetectorConfig(warmup_s=3.0)  # what supervision builds for a 1 s heartbeat (3 beats of warm-up)
WORKING_SET = 300 * MIB  # activations at full load (every sequence slot running)


def traffic(
    rng: random.Random, loads: list[float], leak_from: int | None = None, leak_per_beat: float = 64 * MIB
) -> list[Beat]:
    """One sample per second at the given loads: a working set of WORKING_SET x load, +-10 MiB of
    noise, a one-time 25 MiB step at the first burst (the allocator's pools), and from `leak_from` on
    `leak_per_beat` more each beat."""
    beats, has_burst = [], False
    for i, load in enumerate(loads):
        has_burst = has_burst or load > 0
        footprint = 1024 * MIB + 25 * MIB * has_burst + WORKING_SET * load + rng.uniform(-10, 10) * MIB
        footprint += leak_per_beat * max(0, i - leak_from + 1) if leak_from is not None else 0
        beats.append((load, MemorySample("cpu", used_bytes=int(footprint))))
    return beats


def continuous_load(rng: random.Random, num_beats: int) -> list[float]:
    """64 users on 256 slots (two engines of 128): 56 to 64 sequences running."""
    return [rng.randint(56, 64) / 256 for _ in range(num_beats)]


def varying_load(rng: random.Random, num_beats: int = 600) -> list[float]:
    """Every 20 s a new target among idle, 8, 16, 32, 64 and 128 users, reached by a 10 s ramp
    (users arrive and leave gradually), with +-4 sequences of jitter while busy."""
    loads, level = [], 0.0
    while len(loads) < num_beats:
        target = rng.choice([0, 8, 16, 32, 64, 128]) / 256
        for k in range(1, 21):
            value = level + (target - level) * min(1.0, k / 10)
            loads.append(0.0 if value == 0 else min(1.0, max(1e-3, value + rng.randint(-4, 4) / 256)))
        level = target
    return loads[:num_beats]


@pytest.mark.parametrize("leak_from", [10, 60, 300])
def test_leak_under_continuous_traffic_is_flagged_within_three_heartbeats(leak_from):
    for seed in range(20):
        rng = random.Random(seed)
        flags = feed(traffic(rng, continuous_load(rng, leak_from + 10), leak_from), TRAFFIC, beat_s=1.0)
        assert not any(flags[:leak_from]), seed
        assert any(flags[leak_from : leak_from + 3]), seed


def test_leak_under_varying_traffic_is_flagged_once_the_load_holds_still():
    """A leak that starts while users arrive or leave is seen once the load settles (a ramp takes
    10 s): 12 heartbeats at most; within 3 in 95% of 300 seeds."""
    num_fast = 0
    for seed in range(100):
        rng = random.Random(seed)
        loads = varying_load(rng)
        leak_from = rng.randrange(30, 590)
        flags = feed(traffic(rng, loads[: leak_from + 12], leak_from), TRAFFIC, beat_s=1.0)
        assert not any(flags[:leak_from]), seed
        assert any(flags[leak_from:]), (seed, loads[leak_from - 3 : leak_from + 3])
        num_fast += any(flags[leak_from : leak_from + 3])
    assert num_fast >= 90


def test_ten_minutes_of_varying_traffic_never_flags():
    for seed in range(60):  # 0 in 1000 seeds when written
        rng = random.Random(seed)
        assert not any(feed(traffic(rng, varying_load(rng)), TRAFFIC, beat_s=1.0)), seed


def test_report_says_the_load_it_was_seen_at():
    rng = random.Random(0)
    clock = FakeClock(0.0)
    detector = LeakDetector(TRAFFIC, clock=clock)
    report = None
    for load, sample in traffic(rng, [0.25] * 8, leak_from=4):
        report = detector.add(sample, load)
        clock.advance(1.0)
    assert report is not None and report.load == 0.25
    assert "of busy (0.25 sequences held per slot) samples" in report.describe()


@pytest.mark.parametrize("load", [-0.5, float("inf"), float("nan")])
def test_a_load_below_zero_or_not_finite_is_refused(load):
    detector = LeakDetector(clock=FakeClock(0.0))
    with pytest.raises(ValueError, match="load must be a finite number"):
        detector.add(MemorySample("cpu", used_bytes=1), load=load)
