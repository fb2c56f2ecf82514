"""Leak detection: pure logic over memory samples and a clock, so tests feed it generated series.

Each sample comes with the load at that moment: 0.0 idle (nothing running or waiting), else the
sequences the engines hold (running, queued) per sequence slot (> 0; above 1 with a backlog). Only
samples taken at comparable load are compared: idle ones with idle ones, busy ones with busy ones whose load is within `load_tolerance`
of the newest sample's. What load changes is not a leak: KV blocks are preallocated (no growth), the
allocator's working set for activations scales with the batch, so a sample at another load would
read a working-set change as growth; at the same load the working set is the same and what keeps
climbing is a leak. Under continuous traffic every sample is busy at about the same load, so a leak
is seen in `min_samples` beats as on an idle replica, instead of waiting for an idle moment. Only
after a warm-up (allocator pools, CUDA graphs and the first batches settle by then). The figure
trended is the sample's footprint: used memory less the allocator cache (reserved - allocated),
which grows and shrinks with load and which `empty_cache()` gives back.

Growth is flagged when, over some recent run of comparable samples (`min_samples` or more, within
`window_s`, ending with the newest), all of these hold:
- the least-squares slope is at least `min_slope_bytes_per_s`;
- the fitted growth (slope x span) is at least `min_growth_bytes`, above the noise;
- it grows like a line, not like a jump: against the sample index, a straight line fits the run
  better (smaller sum of squared residuals) than the best single step (two flat levels) does.
  A one-time jump (a new batch shape, a model loaded without `reset()`) is a step; a leak keeps
  climbing from one sample to the next.
Runs are tried from the longest to the shortest, so a leak that starts after a long flat stretch is
seen after `min_samples` comparable samples, not only once it fills the window.

Limits: a jump no larger than about `min_growth_bytes` plus the noise reads like the first samples of
a leak; simulated 10-minute runs with idle noise of +-10 MiB and jumps of 100 MiB to 1 GiB gave no
false alarm in 3000 seeds, +-16 MiB noise gave 1% (all 64-100 MiB jumps). Busy samples carry the
working-set difference between loads up to `load_tolerance` apart: it must stay below
`min_growth_bytes` (on CPU, with the shipped models, the process RSS took a one-time step of ~25 MiB
at the first burst of 64 streams, then moved by under 5 MiB between idle and 64 streams; on CUDA the footprint holds the live activations at the moment of the probe, so a
large model may need a smaller tolerance or a larger floor). Raise `min_samples` where memory is
noisier, `window_s` (hours) to catch slow leaks.
"""

import logging
import math
from collections import deque
from dataclasses import dataclass

from resilience.clock import Clock
from resilience.probes import MemorySample

logger = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True)
class LeakDetectorConfig:
    warmup_s: float = 120.0  # after start or reset(), samples are ignored this long
    window_s: float = 300.0  # samples older than this are forgotten
    min_samples: int = 3  # comparable samples in a run before it is judged
    min_slope_bytes_per_s: float = 64 * MIB / 3600  # 64 MiB/h
    min_growth_bytes: float = 64 * MIB  # must exceed the noise at one load, peak to peak
    max_samples: int = 64  # newest samples kept, whatever the window: bounds the work per check
    load_tolerance: float = 0.05  # busy samples compare when their loads (per slot) are this close

    def __post_init__(self) -> None:
        for name in ("warmup_s", "min_slope_bytes_per_s", "min_growth_bytes", "load_tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_samples < 3:
            raise ValueError(
                f"min_samples must be >= 3 (a line and a step fit any 2), got {self.min_samples}"
            )
        if self.max_samples < self.min_samples:
            raise ValueError(
                f"max_samples must be >= min_samples ({self.min_samples}), got {self.max_samples}"
            )


@dataclass(frozen=True)
class LeakReport:
    device: str
    slope_bytes_per_s: float
    growth_bytes: float  # fitted over the run
    span_s: float
    num_samples: int
    cache_growth_bytes: float  # allocator cache over the same run: not part of the growth above
    load: float = 0.0  # of the newest sample: 0.0 idle, else the sequences held per sequence slot

    def describe(self) -> str:
        at = "idle" if self.load == 0 else f"busy ({self.load:.2f} sequences held per slot)"
        return (
            f"{self.device}: +{self.growth_bytes / MIB:.0f} MiB over {self.span_s:.0f} s of {at} "
            f"samples ({self.slope_bytes_per_s * 3600 / MIB:.0f} MiB/h, {self.num_samples} samples; "
            f"allocator cache {self.cache_growth_bytes / MIB:+.0f} MiB apart)"
        )


@dataclass(frozen=True)
class _Point:
    time: float
    footprint_bytes: int
    cache_bytes: int
    load: float


class LeakDetector:
    def __init__(self, config: LeakDetectorConfig | None = None, *, clock: Clock) -> None:
        self.config = config or LeakDetectorConfig()
        self._clock = clock
        self._started_at = clock()
        self._points: deque[_Point] = deque(maxlen=self.config.max_samples)
        self._device = "unknown"
        self.num_busy_samples = 0  # taken under load, counted whether or not past the warm-up

    def reset(self) -> None:
        """Forget every sample and warm up again: after a model load or unload, or empty_cache()."""
        self._started_at = self._clock()
        self._points.clear()

    @property
    def num_samples(self) -> int:
        return len(self._points)

    def add(self, sample: MemorySample, load: float) -> LeakReport | None:
        """Take one heartbeat's sample with the load it was taken at (0.0 idle, else the sequences held per
        sequence slot); returns a report while sustained growth is seen."""
        if not 0 <= load < math.inf:
            raise ValueError(f"load must be a finite number >= 0, got {load}")
        now = self._clock()
        self.num_busy_samples += load > 0
        if now >= self._started_at + self.config.warmup_s:
            self._device = sample.device
            self._points.append(_Point(now, sample.footprint_bytes, sample.cache_bytes, load))
        while self._points and self._points[0].time <= now - self.config.window_s:
            self._points.popleft()
        return self.check()

    def check(self) -> LeakReport | None:
        """Judge the runs of samples comparable with the newest one, longest first."""
        if not self._points:
            return None
        load = self._points[-1].load
        points = [p for p in self._points if self._is_comparable(p.load, load)]
        slopes = _suffix_slopes([p.time for p in points], [float(p.footprint_bytes) for p in points])
        for start in range(len(points) - self.config.min_samples + 1):
            span_s = points[-1].time - points[start].time
            if (
                slopes[start] < self.config.min_slope_bytes_per_s
                or slopes[start] * span_s < self.config.min_growth_bytes
            ):
                continue  # the cheap tests first: O(n) for all runs, the shape test only for these
            report = self._judge(points[start:])
            if report is not None:
                return report
        return None

    def _is_comparable(self, load: float, newest_load: float) -> bool:
        if load == 0 or newest_load == 0:  # idle only with idle: no working set at all
            return load == newest_load
        return abs(load - newest_load) <= self.config.load_tolerance

    def _judge(self, points: list[_Point]) -> LeakReport | None:
        times = [p.time for p in points]
        values = [float(p.footprint_bytes) for p in points]
        slope, _ = _fit_line(times, values)
        span_s = times[-1] - times[0]
        if slope < self.config.min_slope_bytes_per_s or slope * span_s < self.config.min_growth_bytes:
            return None
        # the shape test counts samples, not seconds: a jump during a long stretch at another load
        # lands between two successive comparable samples however far apart they are, and must
        # still read as one step
        _, line_sse = _fit_line([float(i) for i in range(len(values))], values)
        if line_sse >= _best_step_sse(values):
            return None
        cache_slope, _ = _fit_line(times, [float(p.cache_bytes) for p in points])
        return LeakReport(
            self._device, slope, slope * span_s, span_s, len(points), cache_slope * span_s, points[-1].load
        )


def _suffix_slopes(times: list[float], values: list[float]) -> list[float]:
    """Least-squares slope of every run values[start:] against times[start:], for all starts in
    O(n) by running sums; relative to the newest point to keep the squares small."""
    slopes = [0.0] * len(times)
    sum_t = sum_v = sum_tt = sum_tv = 0.0
    for k, index in enumerate(range(len(times) - 1, -1, -1), start=1):
        t, v = times[index] - times[-1], values[index] - values[-1]
        sum_t, sum_v, sum_tt, sum_tv = sum_t + t, sum_v + v, sum_tt + t * t, sum_tv + t * v
        den = sum_tt - sum_t * sum_t / k
        slopes[index] = (sum_tv - sum_t * sum_v / k) / den if den > 0 else 0.0
    return slopes


def _fit_line(times: list[float], values: list[float]) -> tuple[float, float]:
    """Least-squares line: (slope per second, sum of squared residuals)."""
    mean_t, mean_v = sum(times) / len(times), sum(values) / len(values)
    den = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True)) / den if den else 0.0
    sse = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in zip(times, values, strict=True))
    return slope, sse


def _best_step_sse(values: list[float]) -> float:
    """Smallest sum of squared residuals of two flat levels split at one point; O(n) by prefix sums
    (sse = sum(v^2) - sum(v)^2 / n), values taken relative to the first to keep the squares small."""
    shifted = [v - values[0] for v in values]
    total, total_sq = sum(shifted), sum(v * v for v in shifted)
    best, head, head_sq = float("inf"), 0.0, 0.0
    for k, v in enumerate(shifted[:-1], start=1):
        head, head_sq = head + v, head_sq + v * v
        tail, tail_sq, n_tail = total - head, total_sq - head_sq, len(shifted) - k
        best = min(best, head_sq - head * head / k + tail_sq - tail * tail / n_tail)
    return best
