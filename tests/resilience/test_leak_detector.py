"""The leak detector on generated 10-minute series, one sample per 30 s heartbeat."""

import random
import re

import pytest

from resilience.leak_detector import MIB, LeakDetector, LeakDetectorConfig
from resilience.probes import MemorySample
from tests.resilience.fakes import FakeClock

BEAT_S = 30.0
NUM_BEATS = 21  # 0 .. 600 s
Beat = tuple[bool, MemorySample]  # (is_busy, sample)


def cuda_sample(footprint: float, cache: float = 0.0, non_torch: float = 300 * MIB) -> MemorySample:
    allocated = int(footprint - non_torch)
    return MemorySample("cuda:0", used_bytes=int(footprint + cache), allocated_bytes=allocated,
                        reserved_bytes=allocated + int(cache))


def normal_load(rng: random.Random, is_cuda: bool) -> list[Beat]:
    """Half the beats busy (activations, in-flight KV: up to +300 MiB), +-10 MiB idle noise, a
    400 MiB warm-up jump at 60 s, a one-time 200 MiB jump at 330 s, allocator cache growing to 512 MiB."""
    beats, cache = [], 0.0
    for i in range(NUM_BEATS):
        is_busy = rng.random() < 0.5
        footprint = 1024 * MIB + rng.uniform(-10, 10) * MIB
        footprint += 400 * MIB * (i * BEAT_S >= 60) + 200 * MIB * (i * BEAT_S >= 330)
        footprint += rng.uniform(0, 300) * MIB * is_busy
        cache = min(512 * MIB, cache + rng.choice([0, 32, 64]) * MIB)
        sample = cuda_sample(footprint, cache) if is_cuda else MemorySample("cpu", used_bytes=int(footprint))
        beats.append((is_busy, sample))
    return beats


def leaking(rng: random.Random, start: int, kind: str) -> list[Beat]:
    """Idle server leaking 64 MiB per heartbeat from beat `start` on, with +-10 MiB noise."""
    beats = []
    for i in range(NUM_BEATS):
        leaked = 64 * MIB * max(0, i - start + 1)
        base = 1024 * MIB + rng.uniform(-10, 10) * MIB
        sample = {"rss": MemorySample("cpu", used_bytes=int(base + leaked)),
                  "tensors": cuda_sample(base + leaked),  # allocated grows
                  "non_torch": cuda_sample(base + leaked, non_torch=300 * MIB + leaked)}[kind]
        beats.append((False, sample))
    return beats


def feed(beats: list[Beat], config: LeakDetectorConfig | None = None) -> list[bool]:
    clock = FakeClock(0.0)
    detector = LeakDetector(config, clock=clock)
    flags = []
    for i, (is_busy, sample) in enumerate(beats):
        clock.now = i * BEAT_S
        flags.append(detector.add(sample, is_busy) is not None)
    return flags


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"warmup_s": -1.0}, "warmup_s must be >= 0, got -1.0"),
    ({"window_s": 0.0}, "window_s must be > 0, got 0.0"),
    ({"min_samples": 2}, "min_samples must be >= 3 (a line and a step fit any 2), got 2"),
    ({"min_growth_bytes": -1.0}, "min_growth_bytes must be >= 0, got -1.0"),
    ({"min_slope_bytes_per_s": -1.0}, "min_slope_bytes_per_s must be >= 0, got -1.0"),
    ({"min_samples": 5, "max_samples": 4}, "max_samples must be >= min_samples (5), got 4"),
])
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
        assert any(flags[start:start + 3]), seed


def test_allocator_cache_growth_is_not_a_leak_but_the_same_growth_in_tensors_is():
    cache_growth = [(False, cuda_sample(1024 * MIB, cache=64 * MIB * i)) for i in range(NUM_BEATS)]
    tensor_growth = [(False, cuda_sample(1024 * MIB + 64 * MIB * i)) for i in range(NUM_BEATS)]
    assert [s.used_bytes for _, s in cache_growth] == [s.used_bytes for _, s in tensor_growth]
    assert not any(feed(cache_growth))
    assert feed(tensor_growth)[6]  # warm-up ends at 120 s (beat 4); beats 4, 5, 6 rise


def test_report_keeps_cache_apart():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=0.0), clock=clock)
    report = None
    for i in range(3):
        report = detector.add(cuda_sample(1024 * MIB + 64 * MIB * i, cache=32 * MIB * i), is_busy=False)
        clock.advance(BEAT_S)
    assert report is not None
    assert (report.device, report.num_samples, report.span_s) == ("cuda:0", 3, 60.0)
    assert report.growth_bytes == pytest.approx(128 * MIB)
    assert report.cache_growth_bytes == pytest.approx(64 * MIB)
    assert report.describe() == ("cuda:0: +128 MiB over 60 s of idle samples (7680 MiB/h, 3 samples; "
                                 "allocator cache +64 MiB apart)")


def test_busy_samples_are_not_compared():
    beats = [(i % 2 == 1, MemorySample("cpu", used_bytes=(1024 + 64 * i * (i % 2)) * MIB))
             for i in range(NUM_BEATS)]  # every busy sample higher than the last; idle ones flat
    assert not any(feed(beats))


def test_growth_below_the_floor_or_slope_is_not_flagged():
    slow = [(False, MemorySample("cpu", used_bytes=(1024 + 4 * i) * MIB)) for i in range(NUM_BEATS)]
    assert not any(feed(slow))  # 4 MiB per beat: 40 MiB over the 300 s window, under the 64 MiB floor
    assert any(feed(slow, LeakDetectorConfig(min_growth_bytes=32 * MIB)))
    assert not any(feed(slow, LeakDetectorConfig(min_growth_bytes=32 * MIB,
                                                 min_slope_bytes_per_s=1 * MIB)))  # 0.13 MiB/s


def test_reset_restarts_the_warm_up():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=60.0), clock=clock)
    for i in range(6):
        clock.now = i * BEAT_S
        detector.add(MemorySample("cpu", used_bytes=(1024 + 64 * i) * MIB), is_busy=False)
    assert detector.check() is not None
    detector.reset()  # e.g. a model was loaded
    for i in range(6, 9):
        clock.now = i * BEAT_S
        assert detector.add(MemorySample("cpu", used_bytes=(1024 + 64 * i) * MIB), is_busy=False) is None
    assert detector.num_idle_samples == 2  # reset at 150 s: 180 s fell in the new warm-up


def test_old_samples_leave_the_window():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=0.0, window_s=90.0), clock=clock)
    for i in range(10):
        clock.now = i * BEAT_S
        detector.add(MemorySample("cpu", used_bytes=1024 * MIB), is_busy=False)
    assert detector.num_idle_samples == 3


def test_keeps_at_most_max_samples_however_fast_they_come():
    clock = FakeClock(0.0)
    detector = LeakDetector(LeakDetectorConfig(warmup_s=0.0, max_samples=8), clock=clock)
    for i in range(100):
        clock.now = i * 0.001
        detector.add(MemorySample("cpu", used_bytes=(1024 + 64 * i) * MIB), is_busy=False)
    assert detector.num_idle_samples == 8
    assert detector.check() is not None
