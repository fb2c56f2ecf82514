"""Run a Locust suite headless against a pagedserve endpoint and gate on its final numbers.

    python -m loadtests.run --host http://127.0.0.1:8080 --users 64 --duration 60s \\
        --p99-ttft-ms 2000 --p99-e2e-ms 10000 --max-error-rate 0
    python -m loadtests.run --host URL --shape step --duration 120s ...     # 16 -> 32 -> 64 -> 96 users
    python -m loadtests.run --host URL --open-loop --rate-fraction 0.5 --duration 60s \\
        --p99-ttft-ms 10000 --p99-e2e-multiple 10 --max-error-rate 0    # calibrated open loop (make loadtest)

Locust runs as its own process (importing it monkey-patches ssl through gevent). Its CSV files and HTML
report, and the summary JSON the locustfile writes from Locust's final stats when it quits, go to
loadtests/results/<time>-<shape>/. The gates are read from that summary and written back into it; the
exit status is 0 when every gate holds, 1 when one is missed, 2 when the run produced no summary.
Arguments after `--` go to Locust unchanged (for example `-- --processes 2` or user class names).

--open-loop runs loadtests/open_loop.py instead (Poisson arrivals, every request on its own greenlet)
at --rate, or at --rate-fraction of the capacity measured first (loadtests/calibrate.py: the server's
throughput with --calibrate-concurrency requests always in flight), so the load fits the machine it
runs on. --p99-e2e-multiple gates p99 end-to-end latency on a multiple of the same workload's unloaded
p99 (one request at a time, measured before), a figure that also scales with the machine. Its
unloaded/, calibrate/ and run/ results go under one directory; run/summary.json holds all of it.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from loadtests.calibrate import Load, capacity, run_load, unloaded

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
STEP_SHAPE = HERE / "step_shape.py"
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?$")


def parse_duration(text: str) -> int:
    """Seconds in `90`, `90s`, `2m`, `1h30m`; the forms Locust's --run-time takes."""
    match = _DURATION.match(text.strip())
    if not text.strip() or not match:
        raise argparse.ArgumentTypeError(f"duration must look like 60s, 2m or 1h30m, got {text!r}")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total < 1:
        raise argparse.ArgumentTypeError(f"duration must be at least 1 s, got {text!r}")
    return total


def check_gates(
    summary: dict,
    p99_ttft_ms: float | None,
    p99_itl_ms: float | None,
    p99_e2e_ms: float | None,
    max_error_rate: float | None,
    min_requests: int,
) -> list[str]:
    """One line per missed gate; empty when the run passes."""
    missed = []
    if summary["requests"] < min_requests:
        missed.append(f"requests {summary['requests']} < {min_requests}")
    for name, limit in (("ttft_ms", p99_ttft_ms), ("itl_ms", p99_itl_ms), ("e2e_ms", p99_e2e_ms)):
        p99 = summary[name]["p99"]
        if limit is not None and (p99 is None or p99 > limit):
            missed.append(f"p99 {name} {p99} > {limit}" if p99 is not None else f"p99 {name}: no samples")
    rate = summary["error_rate"]
    if max_error_rate is not None and (rate is None or rate > max_error_rate):
        missed.append(f"error_rate {rate} > {max_error_rate} ({summary['failures']} failures)")
    return missed


def e2e_limit_ms(
    p99_e2e_ms: float | None, multiple: float | None, unloaded_p99_ms: float | None
) -> float | None:
    """The p99 end-to-end gate: the tighter of a fixed limit and `multiple` x the unloaded p99."""
    scaled = None if multiple is None or unloaded_p99_ms is None else multiple * unloaded_p99_ms
    limits = [x for x in (p99_e2e_ms, scaled) if x is not None]
    return round(min(limits), 1) if limits else None


def locust_command(args: argparse.Namespace, out: Path, locust_args: list[str]) -> list[str]:
    files = f"{LOCUSTFILE},{STEP_SHAPE}" if args.shape == "step" else str(LOCUSTFILE)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        files,
        "--headless",
        "--host",
        args.host,
        "--run-time",
        f"{args.duration}s",
        "--stop-timeout",
        str(args.stop_timeout),
        "--csv",
        str(out / "locust"),
        "--html",
        str(out / "report.html"),
        "--only-summary",
        "--summary-json",
        str(out / "summary.json"),
        "--seed",
        str(args.seed),
        "--min-output-tokens",
        str(args.min_output_tokens),
        "--max-output-tokens",
        str(args.max_output_tokens),
    ]
    if args.shape == "fixed":
        cmd += ["--users", str(args.users), "--spawn-rate", str(args.spawn_rate or args.users)]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + locust_args


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    locust_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--users", type=int, default=64, help="concurrent users of the fixed run")
    p.add_argument(
        "--spawn-rate", type=float, default=None, help="users started per second (default: all in 1 s)"
    )
    p.add_argument("--duration", type=parse_duration, default=parse_duration("60s"), help="e.g. 60s, 5m")
    p.add_argument(
        "--shape",
        choices=("fixed", "step"),
        default="fixed",
        help="fixed: --users throughout; step: 16 -> 32 -> 64 -> 96 users, a quarter of --duration each",
    )
    p.add_argument("--model", default="", help="default: the first model of GET /v1/models")
    p.add_argument("--p99-ttft-ms", type=float, default=None)
    p.add_argument("--p99-itl-ms", type=float, default=None)
    p.add_argument("--p99-e2e-ms", type=float, default=None)
    p.add_argument("--max-error-rate", type=float, default=None, help="failures / requests, e.g. 0")
    p.add_argument("--min-requests", type=int, default=1, help="a run with fewer completed requests fails")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-output-tokens", type=int, default=16)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--stop-timeout", type=int, default=30, help="seconds for in-flight requests at the end")
    p.add_argument("--results-dir", type=Path, default=HERE / "results")
    o = p.add_argument_group("open loop")
    o.add_argument("--open-loop", action="store_true", help="Poisson arrivals (loadtests/open_loop.py)")
    o.add_argument("--rate", type=float, default=None, help="arrivals per second")
    o.add_argument("--rate-fraction", type=float, default=None, help="instead: this fraction of the capacity")
    o.add_argument("--capacity", type=float, default=None, help="requests/s; skips the calibration run")
    o.add_argument(
        "--calibrate-concurrency", type=int, default=64, help="requests in flight while calibrating"
    )
    o.add_argument("--calibrate-duration", type=parse_duration, default=parse_duration("60s"))
    o.add_argument(
        "--p99-e2e-multiple", type=float, default=None, help="p99 e2e gate, x the unloaded p99 e2e"
    )
    o.add_argument("--unloaded-duration", type=parse_duration, default=parse_duration("30s"))
    o.add_argument(
        "--drain",
        type=parse_duration,
        default=parse_duration("60s"),
        help="after --duration, how long requests in flight get (then they count as failures)",
    )
    o.add_argument("--long-output-tokens", type=int, default=256)
    args = p.parse_args(argv)
    if args.users < 1:
        p.error(f"--users must be at least 1, got {args.users}")
    if args.open_loop and (args.rate is None) == (args.rate_fraction is None):
        p.error("--open-loop needs one of --rate and --rate-fraction")
    if any(
        x is not None and x <= 0
        for x in (args.rate, args.rate_fraction, args.capacity, args.p99_e2e_multiple)
    ):
        p.error("--rate, --rate-fraction, --capacity and --p99-e2e-multiple must be positive")
    return args, locust_args


def open_loop(args: argparse.Namespace, out: Path, locust_args: list[str]) -> tuple[Path, dict]:
    """Unloaded reference (if gated on it), calibration (unless --rate or --capacity), then the run."""
    options = {"seed": args.seed, "model": args.model, "long_output_tokens": args.long_output_tokens}
    calibration: dict = {}
    if args.p99_e2e_multiple is not None:
        calibration["unloaded"] = unloaded(args.host, out / "unloaded", args.unloaded_duration, **options)
    rate = args.rate
    if rate is None:
        if args.capacity is None:
            calibration["capacity"] = capacity(
                args.host, out / "calibrate", args.calibrate_concurrency, args.calibrate_duration, **options
            )
        capacity_rps = args.capacity or calibration["capacity"]["capacity_rps"]
        rate = args.rate_fraction * capacity_rps
        calibration |= {"capacity_rps": capacity_rps, "rate_fraction": args.rate_fraction}
    calibration["rate"] = round(rate, 4)
    rc, summary, _records = run_load(
        args.host, Load(args.duration, args.drain, rate=rate, **options), out / "run", locust_args
    )
    unloaded_p99 = calibration.get("unloaded", {}).get("e2e_ms", {}).get("p99")
    summary |= {
        "calibration": calibration,
        "locust_exit_code": rc,
        "p99_e2e_limit_ms": e2e_limit_ms(args.p99_e2e_ms, args.p99_e2e_multiple, unloaded_p99),
    }
    return out / "run" / "summary.json", summary


def closed_loop(args: argparse.Namespace, out: Path, locust_args: list[str]) -> tuple[Path, dict] | None:
    cmd = locust_command(args, out, locust_args)
    print("$", " ".join(cmd), flush=True)
    # no timeout needed beyond Locust's own: --run-time plus --stop-timeout bound the run
    rc = subprocess.run(cmd, cwd=HERE.parent).returncode
    summary_path = out / "summary.json"
    if not summary_path.exists():
        print(f"FAILED: locust exited with {rc} and wrote no summary ({summary_path})", file=sys.stderr)
        return None
    summary = json.loads(summary_path.read_text())
    summary |= {"locust_exit_code": rc, "p99_e2e_limit_ms": args.p99_e2e_ms}
    return summary_path, summary


def main(argv: list[str] | None = None) -> int:
    args, locust_args = parse_args(sys.argv[1:] if argv is None else argv)
    label = f"step-{args.duration}s" if args.shape == "step" else f"fixed-{args.users}u-{args.duration}s"
    label = f"open-{args.duration}s" if args.open_loop else label
    out = args.results_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        done = open_loop(args, out, locust_args) if args.open_loop else closed_loop(args, out, locust_args)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # a run that produced no figures to gate
        print(f"FAILED: {e}", file=sys.stderr)
        return 2
    if done is None:
        return 2
    summary_path, summary = done
    gates = {
        "p99_ttft_ms": args.p99_ttft_ms,
        "p99_itl_ms": args.p99_itl_ms,
        "p99_e2e_ms": summary["p99_e2e_limit_ms"],
        "max_error_rate": args.max_error_rate,
        "min_requests": args.min_requests,
    }
    missed = check_gates(summary, **gates)
    summary.update(gates=gates, gate_failures=missed, passed=not missed)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"{'PASSED' if not missed else 'FAILED'}: {summary['requests']} requests, "
        f"{summary['requests_per_s']} req/s, {summary['output_tokens_per_s']} tok/s, "
        f"p99 ttft {summary['ttft_ms']['p99']} ms, p99 itl {summary['itl_ms']['p99']} ms, "
        f"p99 e2e {summary['e2e_ms']['p99']} ms, error rate {summary['error_rate']} -> {summary_path}"
    )
    if args.open_loop:
        c = summary["calibration"]
        print(
            f"  open loop at {c['rate']} req/s ({c.get('rate_fraction', '-')} x capacity {c.get('capacity_rps', '-')}"
            f" req/s), in flight max {summary['in_flight']['max']}, growth {summary['in_flight']['growth_per_s']}/s;"
            f" unloaded p99 e2e {c.get('unloaded', {}).get('e2e_ms', {}).get('p99', '-')} ms, "
            f"gate {summary['p99_e2e_limit_ms']} ms"
        )
    for line in missed:
        print(f"  missed: {line}")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
