"""The open-loop arrival process and the arithmetic over its requests, kept free of Locust and gevent
so tests import it (importing locust monkey-patches the process) and the benchmark reads the same numbers.

Open loop: request i arrives at a fixed time drawn in advance (Poisson, exponential gaps at `rate`)
whether or not earlier ones finished, so a slow server meets the same arrivals as a fast one and its
queue shows up as a growing number in flight, not as fewer requests sent (coordinated omission).
"""

import math
import random
from collections.abc import Iterator

# The mix of the open-loop workload (weights): short chat turns, chat turns under one shared system
# prompt (prefix caching), and long completions that hold a static batch for their whole length.
MIX = {"chat-short": 5, "shared-system": 3, "long-completion": 2}
QUANTILES = (0.5, 0.9, 0.99, 0.999)
SHED_STATUSES = (429, 503)  # refused to protect the server: shed, not broken


def poisson_offsets(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the start, increasing, all < duration_s) of a Poisson process at `rate`/s."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    rng, offsets, t = random.Random(seed), [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        offsets.append(t)
    return offsets


def draw_kinds(seed: int, mix: dict[str, int] = MIX) -> Iterator[str]:
    """The kind of each request in arrival order, drawn independently with the mix's weights (endless)."""
    rng = random.Random(seed + 1)  # apart from the arrival gaps, so a rate change keeps the kinds
    kinds, weights = list(mix), list(mix.values())
    while True:
        yield rng.choices(kinds, weights=weights)[0]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency(values: list[float]) -> dict:
    """count, mean, p50/p90/p99/p99.9 and max, in ms rounded to 0.1."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 1)

    stats = {f"p{q * 100:g}": r(percentile(values, q)) for q in QUANTILES}
    return {
        "count": len(values),
        "mean": r(sum(values) / len(values) if values else None),
        **stats,
        "max": r(max(values, default=None)),
    }


def growth_per_s(series: list[tuple[float, int]], window_s: float) -> float | None:
    """Least-squares slope (requests/s) of the number in flight over the second half of the arrival
    window: about 0 when the server keeps up, the arrival rate minus the service rate when it does not."""
    half = [p for p in series if window_s / 2 <= p[0] <= window_s]
    if len(half) < 2:
        return None
    mean_t, mean_n = sum(t for t, _ in half) / len(half), sum(n for _, n in half) / len(half)
    var = sum((t - mean_t) ** 2 for t, _ in half)
    return round(sum((t - mean_t) * (n - mean_n) for t, n in half) / var, 4) if var else None


def throughput(records: list[dict], start_s: float, end_s: float) -> float:
    """Requests/s answered 200 whose end falls in [start_s, end_s). Lumpy where answers come in batches."""
    if end_s <= start_s:
        raise ValueError(f"empty window [{start_s}, {end_s})")
    done = [r for r in records if r["status"] == 200 and start_s <= r["start_s"] + r["e2e_ms"] / 1000 < end_s]
    return len(done) / (end_s - start_s)


def little_rate(
    records: list[dict], series: list[tuple[float, int]], start_s: float, end_s: float
) -> float | None:
    """Requests/s by Little's law, in flight / time in the system, over requests sent in [start_s, end_s):
    smooth where answers come in batches (a static batch of 32 every 25 s), since every request's own
    latency counts. Unfinished ones count at their age, which can only raise the rate."""
    in_flight = [n for t, n in series if start_s <= t < end_s]
    timed = [
        r["e2e_ms"] / 1000
        for r in records
        if start_s <= r["start_s"] < end_s and r["status"] in (200, None) and r["e2e_ms"] is not None
    ]
    if not in_flight or not timed or not sum(timed):
        return None
    return (sum(in_flight) / len(in_flight)) / (sum(timed) / len(timed))


def summarize_records(records: list[dict], series: list[tuple[float, int]], window_s: float) -> dict:
    """The figures of one run, from every request it sent (see open_loop.py for a record's fields).

    Latencies cover requests answered 200 plus the ones still unfinished when the run was cut, counted at
    their age then (a lower bound): leaving those out would make an overloaded server look fast."""
    num = len(records)
    ok = [r for r in records if r["status"] == 200]
    unfinished = [r for r in records if r["status"] is None]
    timed = ok + unfinished
    shed = {s: sum(r["status"] == s for r in records) for s in SHED_STATUSES}
    failed = num - len(ok)

    def share(n: int) -> float | None:
        return round(n / num, 4) if num else None

    return {
        "requests": num,
        "completed": len(ok),
        "failures": failed,
        "error_rate": failed / num if num else None,
        "requests_per_s": round(len(ok) / window_s, 3),
        "output_tokens": sum(r["output_tokens"] for r in ok),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in ok) / window_s, 3),
        "ttft_ms": latency([r["ttft_ms"] for r in timed if r["ttft_ms"] is not None]),
        "itl_ms": latency([gap for r in ok for gap in r["itl_ms"]]),
        "e2e_ms": latency([r["e2e_ms"] for r in timed]),
        "shares": {
            "ok": share(len(ok)),
            **{str(s): share(n) for s, n in shed.items()},
            "unfinished": share(len(unfinished)),
            "other_errors": share(failed - len(unfinished) - sum(shed.values())),
        },
        "degraded_share": round(sum(r["degraded"] for r in ok) / len(ok), 4) if ok else None,
        "in_flight": {
            "max": max((n for _, n in series), default=0),
            "mean": round(sum(n for _, n in series) / len(series), 2) if series else 0,
            "final": series[-1][1] if series else 0,
            "growth_per_s": growth_per_s(series, window_s),
        },
        "per_kind": {
            kind: {
                "requests": sum(r["kind"] == kind for r in records),
                "e2e_ms": latency([r["e2e_ms"] for r in timed if r["kind"] == kind]),
            }
            for kind in sorted({r["kind"] for r in records})
        },
        "errors": sorted({r["error"] for r in records if r["error"]})[:20],
    }
