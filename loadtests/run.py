"""Run a Locust suite headless against a pagedserve endpoint and gate on its final numbers.

    python -m loadtests.run --host http://127.0.0.1:8080 --users 64 --duration 60s \\
        --p99-ttft-ms 2000 --p99-e2e-ms 10000 --max-error-rate 0
    python -m loadtests.run --host URL --shape step --duration 120s ...     # 16 -> 32 -> 64 -> 96 users

Locust runs as its own process (importing it monkey-patches ssl through gevent). Its CSV files and HTML
report, and the summary JSON the locustfile writes from Locust's final stats when it quits, go to
loadtests/results/<time>-<shape>/. The gates are read from that summary and written back into it; the
exit status is 0 when every gate holds, 1 when one is missed, 2 when the run produced no summary.
Arguments after `--` go to Locust unchanged (for example `-- --processes 2` or user class names).
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

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


def check_gates(summary: dict, p99_ttft_ms: float | None, p99_itl_ms: float | None,
                p99_e2e_ms: float | None, max_error_rate: float | None, min_requests: int) -> list[str]:
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


def locust_command(args: argparse.Namespace, out: Path, locust_args: list[str]) -> list[str]:
    files = f"{LOCUSTFILE},{STEP_SHAPE}" if args.shape == "step" else str(LOCUSTFILE)
    cmd = [sys.executable, "-m", "locust", "-f", files, "--headless", "--host", args.host,
           "--run-time", f"{args.duration}s", "--stop-timeout", str(args.stop_timeout),
           "--csv", str(out / "locust"), "--html", str(out / "report.html"), "--only-summary",
           "--summary-json", str(out / "summary.json"), "--seed", str(args.seed),
           "--min-output-tokens", str(args.min_output_tokens), "--max-output-tokens", str(args.max_output_tokens)]
    if args.shape == "fixed":
        cmd += ["--users", str(args.users), "--spawn-rate", str(args.spawn_rate or args.users)]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + locust_args


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    locust_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--users", type=int, default=64, help="concurrent users of the fixed run")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all in 1 s)")
    p.add_argument("--duration", type=parse_duration, default=parse_duration("60s"), help="e.g. 60s, 5m")
    p.add_argument("--shape", choices=("fixed", "step"), default="fixed",
                   help="fixed: --users throughout; step: 16 -> 32 -> 64 -> 96 users, a quarter of --duration each")
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
    args = p.parse_args(argv)
    if args.users < 1:
        p.error(f"--users must be at least 1, got {args.users}")
    return args, locust_args


def main(argv: list[str] | None = None) -> int:
    args, locust_args = parse_args(sys.argv[1:] if argv is None else argv)
    label = f"step-{args.duration}s" if args.shape == "step" else f"fixed-{args.users}u-{args.duration}s"
    out = args.results_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = locust_command(args, out, locust_args)
    print("$", " ".join(cmd), flush=True)
    # no timeout needed beyond Locust's own: --run-time plus --stop-timeout bound the run
    rc = subprocess.run(cmd, cwd=HERE.parent).returncode
    summary_path = out / "summary.json"
    if not summary_path.exists():
        print(f"FAILED: locust exited with {rc} and wrote no summary ({summary_path})", file=sys.stderr)
        return 2
    summary = json.loads(summary_path.read_text())
    gates = {"p99_ttft_ms": args.p99_ttft_ms, "p99_itl_ms": args.p99_itl_ms, "p99_e2e_ms": args.p99_e2e_ms,
             "max_error_rate": args.max_error_rate, "min_requests": args.min_requests}
    missed = check_gates(summary, **gates)
    summary.update(gates=gates, gate_failures=missed, passed=not missed, locust_exit_code=rc)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'PASSED' if not missed else 'FAILED'}: {summary['requests']} requests, "
          f"{summary['requests_per_s']} req/s, {summary['output_tokens_per_s']} tok/s, "
          f"p99 ttft {summary['ttft_ms']['p99']} ms, p99 itl {summary['itl_ms']['p99']} ms, "
          f"p99 e2e {summary['e2e_ms']['p99']} ms, error rate {summary['error_rate']} -> {summary_path}")
    for line in missed:
        print(f"  missed: {line}")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
