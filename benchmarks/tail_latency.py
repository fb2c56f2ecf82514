"""Tail latency under open-loop load: pagedserve vs the static FIFO baseline at the same arrival rates.

    python benchmarks/tail_latency.py                      # the shipped models: about an hour, at most 2
    python benchmarks/tail_latency.py --model models/pagedserve-coder-tiny --fallback "" --long-output-tokens 64 \\
        --duration 30s --drain 30s --calibrate-duration 60s --tag small-scale     # about 10 minutes

Each server is started here on a free 127.0.0.1 port, alone (one after the other, so they never share
the CPU), and stopped when its runs end:
  baseline    `benchmarks/baseline_server.py --model M --dtype D --max-batch B` (HF generate in static
              FIFO batches: a batch runs until its longest request is done, then the next one starts)
  pagedserve  `pagedserve serve --model M --fallback F --dtype D` (continuous batching, paged KV, its
              resilience defaults: 10 s first-token deadline, breaker, fallback, bulkhead)
First the baseline's capacity is measured (loadtests/calibrate.py: Little's law at --calibrate-concurrency
requests always in flight), then both servers get Poisson arrivals (loadtests/open_loop.py, one Locust
process per run) at the same rates, --fractions of that capacity, with a mixed workload (short chat
turns, chat under one shared system prompt, long completions). pagedserve's own capacity is measured too,
and runs at --overload x that show what it does past it (shed with 429/503, degrade to the
fallback, or queue without bound). Every run is bounded (arrivals for --duration, then --drain for what
is in flight; the rest counts as unfinished, at its age) and the whole benchmark stops by itself before
--max-minutes, skipping the runs that would not fit.

Writes benchmarks/results/tail_latency[-TAG].json (per side and rate: p50/p90/p99/p99.9 of TTFT, ITL and
end-to-end, shares of 200/429/503/unfinished/other, the degraded share, requests in flight; the p99
ratios per rate and whether pagedserve's are >= 90% lower; the load average around each run), and two
PNGs: tail_latency[-TAG]-cdf.png and tail_latency[-TAG]-vs-rate.png. Prints one summary line.
"""

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # loadtests/ (no Locust import: it runs as its own process)

from benchmarks.tail_plots import plot_cdf, plot_vs_rate  # noqa: E402
from engine.config import set_openmp_defaults  # noqa: E402
from loadtests.calibrate import Load, capacity, run_load  # noqa: E402
from loadtests.run import parse_duration  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MODELS = REPO_ROOT / "models"
SIDES = ("baseline", "pagedserve")  # the baseline first: its capacity sets every rate
TARGET_REDUCTION = 0.9  # the seed's claim: p99 >= 90% lower than FIFO
READY_TIMEOUT_S = 300.0
STOP_SPARE_S = 120.0  # stopping a server, writing results: kept out of the run budget


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=MODELS / "pagedserve-coder-small", help="both sides serve it"
    )
    p.add_argument(
        "--fallback",
        default=str(MODELS / "pagedserve-coder-tiny"),
        help="pagedserve's fallback model directory; '' for none",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="both sides (bfloat16 checkpoints run 2-3x slower than float32 on most CPUs)",
    )
    p.add_argument("--baseline-max-batch", type=int, default=32)
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` flags, one string")
    p.add_argument("--fractions", default="0.5,0.8,1.0,1.2", help="rates, as fractions of the FIFO capacity")
    p.add_argument(
        "--overload",
        default="1.2",
        help="rates past pagedserve's own capacity, as multiples of it (comma-separated; '' or 0: none)",
    )
    p.add_argument(
        "--baseline-from",
        type=Path,
        help="take the FIFO side (its capacity and runs) from this "
        "earlier result instead of measuring it again: the baseline does not change with our code",
    )
    p.add_argument("--duration", type=parse_duration, default=parse_duration("300s"), help="arrivals per run")
    p.add_argument(
        "--drain",
        type=parse_duration,
        default=parse_duration("120s"),
        help="after the arrivals, how long requests in flight get",
    )
    p.add_argument(
        "--calibrate-duration",
        type=parse_duration,
        default=parse_duration("180s"),
        help="at least 4 static batches: its first quarter is left out as the ramp",
    )
    p.add_argument("--calibrate-concurrency", type=int, default=64)
    p.add_argument("--long-output-tokens", type=int, default=256, help="max_tokens of a long completion")
    p.add_argument("--max-minutes", type=float, default=120.0, help="the whole benchmark stops before this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="", help="suffix of the result files: tail_latency-TAG.json")
    args = p.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    args.overload = [float(x) for x in args.overload.split(",") if x and float(x) != 0]
    if not args.fractions or min(args.fractions) <= 0 or min(args.overload, default=1) <= 0:
        p.error("--fractions must be positive numbers and --overload not negative")
    if not (args.model / "config.json").is_file():
        p.error(f"no model in {args.model} (run `make models`)")
    return args


def server_command(side: str, args: argparse.Namespace, port: int) -> list[str]:
    address = ["--host", "127.0.0.1", "--port", str(port)]
    if side == "pagedserve":
        fallback = ["--fallback", args.fallback] if args.fallback else []
        return [
            str(Path(sys.executable).with_name("pagedserve")),
            "serve",
            *address,
            "--model",
            str(args.model),
            *fallback,
            "--dtype",
            args.dtype,
            *args.pagedserve_args.split(),
        ]
    return [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "baseline_server.py"),
        *address,
        "--model",
        str(args.model),
        "--dtype",
        args.dtype,
        "--max-batch",
        str(args.baseline_max_batch),
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log_path: Path):
    """The server process, ready (GET /health/ready is 200); SIGTERM, then SIGKILL, on the way out."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_ready(process, f"http://127.0.0.1:{port}/health/ready", log_path)
            yield
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(10)


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "PORT", "HOST", "API_KEY")}
    # libgomp spin-waits long by default: on 2 shared cores that makes every parallel op many times slower
    # (engine/config.py). The same for both sides.
    set_openmp_defaults(env)
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def wait_ready(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready within {READY_TIMEOUT_S:.0f} s: {log_path.read_text()[-2000:]}")


def one_run(url: str, load: Load, out: Path, fraction: float, of: str) -> dict:
    """The figures of one open-loop run, with the raw TTFT and e2e the CDFs are drawn from."""
    before = os.getloadavg()
    rc, summary, records = run_load(url, load, out)
    timed = [r for r in records if r["status"] in (200, None)]
    return {
        "label": f"{fraction:g}x {of}",
        "fraction": fraction,
        "of": of,
        "rate": round(load.rate, 4),
        "locust_exit_code": rc,
        **{
            k: summary[k]
            for k in (
                "model",
                "requests",
                "completed",
                "failures",
                "requests_per_s",
                "output_tokens_per_s",
                "ttft_ms",
                "itl_ms",
                "e2e_ms",
                "shares",
                "degraded_share",
                "in_flight",
                "errors",
            )
        },
        "load_average": {
            "before": [round(x, 2) for x in before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "ttft_ms_all": sorted(round(r["ttft_ms"], 1) for r in timed if r["ttft_ms"] is not None),
        "e2e_ms_all": sorted(round(r["e2e_ms"], 1) for r in timed),
    }


def measure_side(
    side: str, args: argparse.Namespace, fifo_rps: float | None, deadline: float, work: Path
) -> dict:
    """Calibrate, then the runs at the fractions of the FIFO capacity (this side's, for the baseline)."""
    port, options = free_port(), {"seed": args.seed, "long_output_tokens": args.long_output_tokens}
    url, cmd = f"http://127.0.0.1:{port}", server_command(side, args, port)
    print(f"[{side}] $ {' '.join(cmd)}", flush=True)
    result: dict = {"command": " ".join(cmd), "runs": [], "skipped": []}
    calibration = Load(
        args.calibrate_duration, args.calibrate_duration, closed_loop=args.calibrate_concurrency
    )
    if time.monotonic() + calibration.max_seconds + READY_TIMEOUT_S > deadline:
        result["skipped"].append({"label": "calibration", "why": "past --max-minutes"})
        return result
    try:
        with running_server(cmd, port, work / f"{side}.log"):
            result["calibration"] = capacity(
                url, work / side / "calibrate", args.calibrate_concurrency, args.calibrate_duration, **options
            )
            own_rps = result["calibration"]["capacity_rps"]
            plan = [(f, "FIFO", f * (fifo_rps or own_rps)) for f in args.fractions]
            if side == "pagedserve":
                plan += [(x, "own", x * own_rps) for x in args.overload]
            for fraction, of, rate in plan:
                load = Load(args.duration, args.drain, rate=rate, **options)
                if time.monotonic() + load.max_seconds > deadline:
                    result["skipped"].append(
                        {"label": f"{fraction:g}x {of}", "rate": round(rate, 4), "why": "past --max-minutes"}
                    )
                    continue
                print(f"[{side}] {fraction:g}x {of} capacity: {rate:.3f} req/s", flush=True)
                result["runs"].append(one_run(url, load, work / side / f"{fraction:g}x-{of}", fraction, of))
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # keep what was measured; say what stopped it
        print(f"[{side}] stopped: {e}", file=sys.stderr, flush=True)
        result["error"] = str(e)
    return result


def compare(results: dict) -> list[dict]:
    """Per FIFO fraction both sides ran: the p99 ratios (pagedserve / baseline) and the target."""
    theirs = {r["label"]: r for r in results.get("baseline", {}).get("runs", [])}
    rows = []
    for ours in results.get("pagedserve", {}).get("runs", []):
        base = theirs.get(ours["label"])
        if base is None:
            continue
        ratios = {
            f"p99_{m}_ratio": _ratio(ours[f"{m}_ms"]["p99"], base[f"{m}_ms"]["p99"]) for m in ("ttft", "e2e")
        }
        rows.append(
            {
                "label": ours["label"],
                "rate": ours["rate"],
                **ratios,
                "in_flight_max": {
                    "pagedserve": ours["in_flight"]["max"],
                    "baseline": base["in_flight"]["max"],
                },
                "target_met": all(r is not None and 1 - r >= TARGET_REDUCTION for r in ratios.values())
                and ours["failures"] == 0,
            }
        )
    return rows


def overload(results: dict) -> dict:
    """What each side did in its runs past capacity: shed, degraded, or queued (in flight growing)."""

    def figures(run: dict) -> dict:
        return {
            "label": run["label"],
            "rate": run["rate"],
            "shares": run["shares"],
            "degraded_share": run["degraded_share"],
            "in_flight": run["in_flight"],
            "p99_ttft_ms": run["ttft_ms"]["p99"],
            "p99_e2e_ms": run["e2e_ms"]["p99"],
        }

    return {
        side: [figures(run) for run in results.get(side, {}).get("runs", []) if run["fraction"] > 1]
        for side in SIDES
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 4) if ours and theirs else None


def main() -> int:
    args = parse_args()
    args.model = args.model.resolve()
    deadline = time.monotonic() + args.max_minutes * 60 - STOP_SPARE_S
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tail-latency-") as tmp:
        if args.baseline_from:
            results["baseline"] = {
                **json.loads(args.baseline_from.read_text())["baseline"],
                "taken_from": str(args.baseline_from),
            }
        else:
            results["baseline"] = measure_side("baseline", args, None, deadline, Path(tmp))
        if "calibration" not in results["baseline"]:
            raise SystemExit(f"no FIFO capacity, so no rates: {results['baseline']}")
        fifo_rps = results["baseline"]["calibration"]["capacity_rps"]
        results["pagedserve"] = measure_side("pagedserve", args, fifo_rps, deadline, Path(tmp))
    stem = "tail_latency" + (f"-{args.tag}" if args.tag else "")
    report = {
        "workload": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "omp_wait_policy": server_env()["OMP_WAIT_POLICY"],
        "gomp_spincount": server_env().get("GOMP_SPINCOUNT"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "fifo_capacity_rps": results["baseline"]["calibration"]["capacity_rps"],
        **results,
        "comparison": compare(results),
        "overload": overload(results),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_cdf(report, args.out_dir / f"{stem}-cdf.png")
    plot_vs_rate(report, args.out_dir / f"{stem}-vs-rate.png")
    line = "; ".join(
        f"{row['label']}: p99 ttft x{row['p99_ttft_ratio']}, p99 e2e x{row['p99_e2e_ratio']}, "
        f"in flight {row['in_flight_max']}"
        for row in report["comparison"]
    )
    past = "; ".join(
        f"{side} {o['label']}: shares {o['shares']}, degraded {o['degraded_share']}, in flight "
        f"+{o['in_flight']['growth_per_s']}/s"
        for side, runs in report["overload"].items()
        for o in runs
    )
    print(
        f"FIFO capacity {report['fifo_capacity_rps']} req/s; {line}; past capacity: {past} -> "
        f"{args.out_dir / stem}.json, -cdf.png, -vs-rate.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
