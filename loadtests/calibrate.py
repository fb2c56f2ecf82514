"""Open-loop runs as subprocesses, and the two measurements that make their rates and gates fit the machine:

- capacity: requests/s a server answers when it is never idle (--closed-loop N, N above what it batches),
  by Little's law (N / mean latency) over requests sent in the last three quarters of the window (the
  first quarter is the ramp to a full batch), each given time to finish; an open loop above it has an
  ever-growing number in flight;
- unloaded: the same workload one request at a time, the latency no load can beat.

No Locust here (importing it monkey-patches the process): `python -m locust -f loadtests/open_loop.py`
runs as its own process, bounded by its own --run-time and a subprocess timeout above it.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtests.arrivals import little_rate, throughput

HERE = Path(__file__).resolve().parent
OPEN_LOOP = HERE / "open_loop.py"
RAMP_SHARE = 0.25  # of a calibration window, left out of its throughput
SPARE_S = 30  # Locust's start-up and summary, on top of arrivals + drain


@dataclass(frozen=True)
class Load:
    """What one open_loop.py run sends: Poisson `rate`/s, or `closed_loop` requests back to back."""

    seconds: float
    drain_s: float
    rate: float | None = None
    closed_loop: int | None = None
    seed: int = 0
    model: str = ""
    long_output_tokens: int = 256
    max_in_flight: int = 512

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.closed_loop is None):
            raise ValueError(f"give one of rate and closed_loop, got {self.rate} and {self.closed_loop}")
        if self.seconds <= 0 or self.drain_s < 0:
            raise ValueError(
                f"seconds must be positive and drain_s not negative, got {self.seconds}, {self.drain_s}"
            )

    @property
    def max_seconds(self) -> float:
        """The most the run can take: Locust's --run-time, which the run reaches only if it cannot drain."""
        return self.seconds + self.drain_s + SPARE_S


def locust_command(host: str, load: Load, out: Path, extra: list[str] = ()) -> list[str]:
    mode = (
        ["--arrival-rate", f"{load.rate:.4f}"]
        if load.rate is not None
        else ["--closed-loop", str(load.closed_loop)]
    )
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(OPEN_LOOP),
        "--headless",
        "--host",
        host,
        "--users",
        "1",
        "--spawn-rate",
        "1",
        "--run-time",
        f"{int(load.max_seconds)}s",
        "--only-summary",
        "--csv",
        str(out / "locust"),
        "--html",
        str(out / "report.html"),
        *mode,
        "--arrival-seconds",
        str(load.seconds),
        "--drain-seconds",
        str(load.drain_s),
        "--seed",
        str(load.seed),
        "--long-output-tokens",
        str(load.long_output_tokens),
        "--max-in-flight",
        str(load.max_in_flight),
        "--summary-json",
        str(out / "summary.json"),
        "--records-json",
        str(out / "requests.json"),
        *(["--model", load.model] if load.model else []),
        *extra,
    ]


def run_load(host: str, load: Load, out: Path, extra: list[str] = ()) -> tuple[int, dict, list[dict]]:
    """Locust's exit status, the run's summary and its request records (see open_loop.py)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = locust_command(host, load, out, list(extra))
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=HERE.parent, timeout=load.max_seconds + 60).returncode
    if not (out / "summary.json").exists():
        raise RuntimeError(f"locust exited with {rc} and wrote no summary in {out}")
    return rc, json.loads((out / "summary.json").read_text()), json.loads((out / "requests.json").read_text())


def capacity(
    host: str, out: Path, concurrency: int, seconds: float, extra: list[str] = (), **load_options
) -> dict:
    """The saturated throughput (requests/s) and the run behind it; `extra`: more open_loop.py options
    (a --kind, an --api-key)."""
    load = Load(seconds, drain_s=seconds, closed_loop=concurrency, **load_options)
    rc, summary, records = run_load(host, load, out, list(extra))
    if any(r["status"] not in (200, None) for r in records):
        raise RuntimeError(f"calibration at {concurrency} in flight had errors: {summary['errors']}")
    rps = little_rate(records, summary["in_flight_series"], seconds * RAMP_SHARE, seconds)
    if not rps:
        raise RuntimeError(
            f"no request sent after the first {seconds * RAMP_SHARE:.0f} s at {concurrency} in flight "
            "(answers slower than that): calibrate for longer"
        )
    return {
        "capacity_rps": round(rps, 4),
        "answered_rps": round(throughput(records, seconds * RAMP_SHARE, seconds), 4),
        "concurrency": concurrency,
        "seconds": seconds,
        "locust_exit_code": rc,
        "degraded_share": summary["degraded_share"],
        "ttft_ms": summary["ttft_ms"],
        "e2e_ms": summary["e2e_ms"],
    }


def unloaded(host: str, out: Path, seconds: float, **load_options) -> dict:
    """The workload one request at a time: its latencies are the floor the gates scale."""
    _rc, summary, _records = run_load(
        host, Load(seconds, drain_s=seconds, closed_loop=1, **load_options), out
    )
    if summary["failures"] or not summary["completed"]:
        raise RuntimeError(f"unloaded run: {summary['completed']} answered, errors {summary['errors']}")
    return {
        "seconds": seconds,
        "requests": summary["completed"],
        **{name: summary[name] for name in ("ttft_ms", "itl_ms", "e2e_ms")},
    }
