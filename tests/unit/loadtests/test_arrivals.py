"""The open-loop arithmetic (loadtests/arrivals.py) and the gates of loadtests/run.py, without Locust:
arrival times, the workload mix, percentiles, in-flight growth, capacity by Little's law, the summary of
a run's records, and the limits a run is held to. The real open loop runs in test_open_loop.py."""

import math
import statistics
from itertools import islice

import pytest

from loadtests.arrivals import (
    MIX,
    draw_kinds,
    growth_per_s,
    latency,
    little_rate,
    percentile,
    poisson_offsets,
    summarize_records,
    throughput,
)
from loadtests.run import check_gates, e2e_limit_ms


def record(
    kind="chat-short", start_s=0.0, status=200, ttft_ms=100.0, e2e_ms=1000.0, degraded=False, error=None
):
    return {
        "kind": kind,
        "start_s": start_s,
        "status": status,
        "error": error,
        "ttft_ms": ttft_ms,
        "e2e_ms": e2e_ms,
        "itl_ms": [10.0, 30.0],
        "output_tokens": 3,
        "degraded": degraded,
    }


def test_poisson_offsets_have_the_rate_and_exponential_gaps():
    offsets = poisson_offsets(rate=10, duration_s=1000, seed=3)
    assert offsets == sorted(offsets) and offsets[0] > 0 and offsets[-1] < 1000
    assert abs(len(offsets) - 10_000) < 4 * math.sqrt(10_000)  # 4 sigma of a Poisson count
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


def test_poisson_offsets_are_fixed_by_the_seed():
    assert poisson_offsets(2, 60, seed=1) == poisson_offsets(2, 60, seed=1) != poisson_offsets(2, 60, seed=2)
    with pytest.raises(ValueError, match="positive"):
        poisson_offsets(0, 60, seed=1)


def test_kinds_follow_the_mix_weights():
    kinds = list(islice(draw_kinds(seed=0), 20_000))
    total = sum(MIX.values())
    for kind, weight in MIX.items():
        assert kinds.count(kind) / len(kinds) == pytest.approx(weight / total, abs=0.02)
    assert list(islice(draw_kinds(seed=0), 50)) == kinds[:50]


def test_percentile_interpolates_between_ranks():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, q) for q in (0.0, 0.5, 0.9, 0.99, 1.0)] == [
        1.0,
        3.0,
        4.6,
        pytest.approx(4.96),
        5.0,
    ]
    assert percentile([], 0.5) is None
    assert latency([1.0, 2.0, 3.0, 4.0]) == {
        "count": 4,
        "mean": 2.5,
        "p50": 2.5,
        "p90": 3.7,
        "p99": 4.0,
        "p99.9": 4.0,
        "max": 4.0,
    }


def test_growth_is_the_slope_of_the_second_half_of_the_window():
    queueing = [(t / 2, 3 * t) for t in range(41)]  # +6 in flight per second, samples every 0.5 s
    assert growth_per_s(queueing, window_s=20) == pytest.approx(6.0)
    steady = [(t / 2, 8 + t % 2) for t in range(41)]
    assert abs(growth_per_s(steady, window_s=20)) < 0.1
    draining = queueing + [(20 + t / 2, 120 - 10 * t) for t in range(1, 12)]  # after the window: ignored
    assert growth_per_s(draining, window_s=20) == pytest.approx(6.0)
    assert growth_per_s([], window_s=20) is None


def test_capacity_by_littles_law_and_by_counting():
    # a closed loop of 4, every request 2 s: 2 requests/s however the answers bunch up
    records = [record(start_s=s, e2e_ms=2000.0) for s in (0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4)]
    series = [(t / 2, 4) for t in range(12)]
    assert little_rate(records, series, start_s=0, end_s=6) == pytest.approx(2.0)
    # counting answers is lumpy: they come at 2, 4 and 6 s, and the last batch falls out of [0, 6)
    assert throughput(records, start_s=0, end_s=6) == pytest.approx(8 / 6)
    assert throughput(records, start_s=1, end_s=5) == pytest.approx(8 / 4)


def test_summary_counts_shed_unfinished_and_degraded():
    records = [record(e2e_ms=100.0 * i, degraded=i % 4 == 0) for i in range(1, 9)]
    records += [
        record(status=429, ttft_ms=None, e2e_ms=None, error="HTTP 429"),
        record(status=503, ttft_ms=None, e2e_ms=None, error="HTTP 503"),
        record(status=None, ttft_ms=5000.0, e2e_ms=9000.0),  # cut at the end, 9 s old
        record(status=0, ttft_ms=None, e2e_ms=None, error="dropped at the cap"),
    ]
    s = summarize_records(records, [(0.0, 1), (1.0, 3), (2.0, 2)], window_s=2.0)
    assert (s["requests"], s["completed"], s["failures"]) == (12, 8, 4)
    assert s["error_rate"] == pytest.approx(4 / 12)
    assert s["shares"] == {
        "ok": 0.6667,
        "429": 0.0833,
        "503": 0.0833,
        "unfinished": 0.0833,
        "other_errors": 0.0833,
    }
    assert s["degraded_share"] == 0.25
    assert s["e2e_ms"]["count"] == 9 and s["e2e_ms"]["max"] == 9000.0  # the unfinished one, at its age
    assert s["ttft_ms"]["max"] == 5000.0
    assert s["itl_ms"]["count"] == 16  # gaps of answered requests only
    assert s["in_flight"] == {"max": 3, "mean": 2.0, "final": 2, "growth_per_s": -1.0}  # 3 -> 2 over [1, 2] s
    assert s["requests_per_s"] == 4.0
    assert s["errors"] == ["HTTP 429", "HTTP 503", "dropped at the cap"]


def test_e2e_gate_is_the_tighter_of_fixed_and_scaled():
    assert e2e_limit_ms(None, 4, 1500.0) == 6000.0
    assert e2e_limit_ms(5000.0, 4, 1500.0) == 5000.0
    assert e2e_limit_ms(9000.0, 4, 1500.0) == 6000.0
    assert e2e_limit_ms(9000.0, None, 1500.0) == 9000.0
    assert e2e_limit_ms(None, 4, None) is None


def test_gates_name_what_an_open_loop_run_missed():
    s = summarize_records(
        [record(ttft_ms=12_000.0, e2e_ms=30_000.0), record(status=503, error="HTTP 503")],
        [(0.0, 2)],
        window_s=1.0,
    )
    missed = check_gates(
        s,
        p99_ttft_ms=10_000,
        p99_itl_ms=None,
        p99_e2e_ms=e2e_limit_ms(None, 4, 2000.0),
        max_error_rate=0,
        min_requests=1,
    )
    assert missed == [
        "p99 ttft_ms 12000.0 > 10000",
        "p99 e2e_ms 30000.0 > 8000.0",
        "error_rate 0.5 > 0 (1 failures)",
    ]
    ok = summarize_records([record()], [(0.0, 1)], window_s=1.0)
    assert check_gates(ok, 10_000, None, 8000.0, 0, 1) == []
