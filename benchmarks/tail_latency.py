"""Tail latency under load: pagedserve vs the static-batching baseline, same model, same Locust run.

    python benchmarks/tail_latency.py                     # models/pagedserve-coder-small, 64 users, 60 s a side
    python benchmarks/tail_latency.py --model DIR --users 64 --duration 60s --baseline-max-batch 32

Each server is started here on a free 127.0.0.1 port, alone (one side after the other, so they never
share the CPU), and stopped when its run ends:
  pagedserve  `python -m service serve --model DIR --dtype float32 --idle-timeout 120` (continuous
              batching, paged KV; the deadline is explained at --pagedserve-args)
  baseline    `python benchmarks/baseline_server.py --model DIR --dtype float32` (HF generate in static
              FIFO batches of up to --baseline-max-batch)
The load is `python -m loadtests.run` as a subprocess (Locust is never imported here): the same users,
seed, workload and duration against each side.

Writes benchmarks/results/tail_latency.json (p50/p90/p99 TTFT, ITL and end-to-end, errors and
throughput per side, the p99 end-to-end ratio and whether the target holds: pagedserve's p99 at
least 90% lower, with zero errors) and tail_latency.png: TTFT and end-to-end CDFs from Locust's own
response-time histograms (its --json-file, passed through loadtests.run; every request, times rounded
by Locust to 2 significant digits above 100 ms), kept in the JSON too. Prints one summary line.
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
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_MODEL = REPO_ROOT / "models" / "pagedserve-coder-small"
SIDES = ("pagedserve", "baseline")
TARGET_P99_E2E_REDUCTION = 0.9  # pagedserve's p99 end-to-end at least 90% below the baseline's
READY_TIMEOUT_S = 300.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory both sides serve")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--duration", default="60s", help="Locust run time per side, e.g. 60s, 2m")
    p.add_argument("--stop-timeout", type=int, default=180,
                   help="seconds Locust lets requests in flight at the end finish (a cut request is an error)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="both sides (the checkpoint's bfloat16 is 2-3x slower than float32 on most CPUs)")
    p.add_argument("--baseline-max-batch", type=int, default=32)
    # A 120 s progress deadline: with the default 10 s, requests queued behind 63 others on a busy CPU
    # can miss their first token in time, the breaker opens and the run turns into fast 503s (measured
    # at load average ~10: 8307 of 8405 requests; at ~6: none, but p99 TTFT 9.6 s, at the edge).
    # --pagedserve-args "" measures the defaults.
    p.add_argument("--pagedserve-args", default="--idle-timeout 120",
                   help="extra `pagedserve serve` flags, one string (default: %(default)s)")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of " + ",".join(SIDES))
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="", help="suffix of the result files: tail_latency-TAG.json")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(side: str, args: argparse.Namespace, port: int) -> list[str]:
    address = ["--host", "127.0.0.1", "--port", str(port)]
    if side == "pagedserve":
        return [sys.executable, "-m", "service", "serve", *address, "--model", str(args.model), "--dtype",
                args.dtype, *args.pagedserve_args.split()]
    return [sys.executable, str(REPO_ROOT / "benchmarks" / "baseline_server.py"), *address, "--model",
            str(args.model), "--dtype", args.dtype, "--max-batch", str(args.baseline_max_batch)]


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log_path: Path):
    """The server process, ready (GET /health/ready is 200); SIGTERM, then SIGKILL, on the way out."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
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
    # libgomp spin-waits by default: on 2 shared cores that makes every parallel op many times slower
    # (see benchmarks/offline.py). The same for both sides.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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


def run_load(url: str, args: argparse.Namespace, results_dir: Path) -> tuple[int, dict, list[dict]]:
    """loadtests.run's exit status, its summary, and Locust's final stats entries (with their
    response-time histograms: Locust's --json-file, written after the last request finished)."""
    stats_stem = results_dir / "locust_final"
    cmd = [sys.executable, "-m", "loadtests.run", "--host", url, "--users", str(args.users), "--duration",
           args.duration, "--seed", str(args.seed), "--stop-timeout", str(args.stop_timeout),
           "--max-error-rate", "0", "--results-dir", str(results_dir), "--", "--json-file", str(stats_stem)]
    rc = subprocess.run(cmd, cwd=REPO_ROOT).returncode
    runs = sorted(results_dir.glob("*/summary.json"))
    if not runs:
        raise RuntimeError(f"loadtests.run exited with {rc} and wrote no summary under {results_dir}")
    return rc, json.loads(runs[-1].read_text()), json.loads(stats_stem.with_suffix(".json").read_text())


def measure(side: str, args: argparse.Namespace, work_dir: Path) -> dict:
    port = free_port()
    cmd = server_command(side, args, port)
    print(f"[{side}] $ {' '.join(cmd)}", flush=True)
    load_before = os.getloadavg()
    with running_server(cmd, port, work_dir / f"{side}.log"):
        rc, summary, entries = run_load(f"http://127.0.0.1:{port}", args, work_dir / side)
    histograms = {metric: histogram(entries, metric) for metric in ("TTFT", "E2E")}
    for metric, counts in histograms.items():  # the histograms and the summary count the same requests
        if sum(counts.values()) != summary[f"{metric.lower()}_ms"]["count"]:
            raise RuntimeError(f"{side}: {metric} histogram has {sum(counts.values())} samples, the summary "
                               f"{summary[f'{metric.lower()}_ms']['count']}")
    return {
        "command": " ".join(cmd[1:]),
        "loadtests_exit_code": rc,
        **{k: summary[k] for k in ("model", "users", "duration_s", "requests", "failures", "error_rate",
                                   "requests_per_s", "output_tokens", "output_tokens_per_s")},
        **{name: {q: summary[name][q] for q in ("count", "p50", "p90", "p99", "max")}
           for name in ("ttft_ms", "itl_ms", "e2e_ms")},
        "errors": summary["errors"],
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        # what the CDFs are drawn from: {ms: requests}, every request kind merged (Locust rounds times
        # to 2 significant digits above 100 ms)
        "histograms": histograms,
    }


def histogram(entries: list[dict], request_type: str) -> dict[str, int]:
    """{milliseconds: requests} over every request kind of one event type (TTFT, E2E)."""
    merged: Counter[int] = Counter()
    for entry in entries:
        if entry["method"] == request_type:
            merged.update({int(ms): n for ms, n in entry["response_times"].items()})
    return {str(ms): merged[ms] for ms in sorted(merged)}


def cdf(counts: dict[str, int]) -> tuple[list[float], list[float]]:
    """Seconds, and the fraction of requests at or below each."""
    xs, ys, total, seen = [], [], sum(counts.values()), 0
    for ms, n in counts.items():
        seen += n
        xs.append(int(ms) / 1000)
        ys.append(seen / total)
    return xs, ys


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in zip(axes, ("TTFT", "E2E"), ("time to first token", "end-to-end latency"),
                                 strict=True):
        for side, color in zip(SIDES, ("tab:blue", "tab:red"), strict=True):
            counts = results.get(side, {}).get("histograms", {}).get(metric)
            if not counts:
                continue
            xs, ys = cdf(counts)
            p99 = results[side][f"{metric.lower()}_ms"]["p99"]
            ax.step(xs, ys, where="post", color=color,
                    label=f"{side} (p99 {p99 / 1000:.1f} s)" if p99 is not None else side)
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("seconds (log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right")
    first = next(iter(results[s] for s in SIDES if s in results))
    fig.suptitle(f"{first['model']}, {first['users']} Locust users, every request kind")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(results: dict) -> dict:
    if not all(side in results for side in SIDES):
        return {}
    ours, theirs = results["pagedserve"]["e2e_ms"]["p99"], results["baseline"]["e2e_ms"]["p99"]
    if not ours or not theirs:
        return {"p99_e2e_ratio": None, "target_met": False}
    ratio = ours / theirs
    return {"p99_e2e_ratio": round(ratio, 4), "p99_e2e_reduction": round(1 - ratio, 4),
            "p99_ttft_ratio": _ratio(results, "ttft_ms"),
            "target": f"pagedserve p99 e2e >= {TARGET_P99_E2E_REDUCTION:.0%} lower, zero errors",
            "target_met": 1 - ratio >= TARGET_P99_E2E_REDUCTION and results["pagedserve"]["failures"] == 0}


def _ratio(results: dict, name: str) -> float | None:
    ours, theirs = results["pagedserve"][name]["p99"], results["baseline"][name]["p99"]
    return round(ours / theirs, 4) if ours and theirs else None


def main() -> int:
    args = parse_args()
    sides = [s for s in args.sides.split(",") if s]
    if not set(sides) <= set(SIDES) or not sides:
        raise SystemExit(f"--sides must name some of {SIDES}, got {args.sides!r}")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model in {args.model} (run `make models`)")
    args.model = args.model.resolve()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tail-latency-") as tmp:
        for side in sides:
            results[side] = measure(side, args, Path(tmp))
    stem = "tail_latency" + (f"-{args.tag}" if args.tag else "")
    report = {"workload": {"users": args.users, "duration": args.duration, "seed": args.seed,
                           "stop_timeout_s": args.stop_timeout, "dtype": args.dtype, "baseline_max_batch": args.baseline_max_batch,
                           "pagedserve_args": args.pagedserve_args, "loadtests": "python -m loadtests.run",
                           "omp_wait_policy": server_env()["OMP_WAIT_POLICY"]},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              **results, "comparison": compare(results)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out_dir / f"{stem}.png")
    line = "; ".join(f"{s}: p99 ttft {results[s]['ttft_ms']['p99']} ms, p99 e2e {results[s]['e2e_ms']['p99']} ms, "
                     f"{results[s]['failures']} errors / {results[s]['requests']}" for s in sides)
    cmp = report["comparison"]
    if cmp:
        line += f"; p99 e2e ratio {cmp['p99_e2e_ratio']} (target met: {cmp['target_met']})"
    print(f"{line} -> {args.out_dir / stem}.json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
