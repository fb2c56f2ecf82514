"""Token-fair scheduling between tenants, measured open-loop: a flooding tenant against a light one.

    python benchmarks/fairness.py                    # the shipped primary: about 8 minutes
    python benchmarks/fairness.py --duration 20s --drain 10s --tag quick

Tenant A ("flood") sends completions with ~2,000-token prompts (short answers) at --flood-factor (2x) the
replica's capacity for them; tenant B ("chat") sends short streamed chat turns at --chat-fraction (10%)
of the replica's capacity for those. Both capacities are measured first (loadtests/calibrate.py: Little's
law with requests always in flight). The same pagedserve server (the shipped primary alone, no fallback,
--max-queue-delay 0 so nothing is shed and the queue shows as waiting) runs twice, one after the other:
  tenants   --tenants FILE: A and B are tenants of weight 1 (no quotas): token-fair scheduling
  fifo      --api-key A --api-key B: no tenants, first come first served (today's default)
Each gets B alone, then A and B together (two Locust processes, loadtests/open_loop.py --kind/--api-key,
in parallel). Every run is bounded (arrivals for --duration, then --drain for what is in flight; the rest
counts as unfinished, its age as its time to first token).

Writes benchmarks/results/fairness[-TAG].json (per server and run: B's and A's TTFT quantiles, shares,
requests, load averages; B's p99 TTFT under the flood over B's alone, for each server; whether the
tenants' one is within --max-ratio) and fairness[-TAG].png. Exit 1 when the ratio is missed.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.tail_latency import free_port, running_server  # noqa: E402
from loadtests.calibrate import Load, capacity, run_load  # noqa: E402
from loadtests.run import parse_duration  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
KEYS = {"flood": "sk-fairness-flood", "chat": "sk-fairness-chat"}
KINDS = {"flood": "long-prompt", "chat": "chat-short"}
LONG_PROMPT_WORDS = 1550  # ~1,950 tokens of the shipped tokenizer: with the answer, within its 2,048
TENANTS_FILE = f"""
[tenants.flood]
keys = ["{KEYS["flood"]}"]

[tenants.chat]
keys = ["{KEYS["chat"]}"]
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "pagedserve-coder-small")
    p.add_argument("--duration", type=parse_duration, default="45s", help="arrivals of each run")
    p.add_argument("--drain", type=parse_duration, default="20s", help="then what is in flight gets this")
    p.add_argument("--calibrate-duration", type=parse_duration, default="30s")
    p.add_argument("--flood-factor", type=float, default=2.0, help="A's rate over the replica's capacity")
    p.add_argument("--chat-fraction", type=float, default=0.1, help="B's rate over the replica's capacity")
    p.add_argument("--max-ratio", type=float, default=2.0, help="B's p99 TTFT flooded / alone, with tenants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pagedserve-args", default="", help="more server flags, space-separated")
    p.add_argument("--tag", default="")
    p.add_argument(
        "--work-dir", type=Path, help="keep every run's records and server log here (default: a temp dir)"
    )
    p.add_argument("--servers", nargs="+", choices=("tenants", "fifo"), default=["tenants", "fifo"])
    return p.parse_args()


def server_command(args: argparse.Namespace, port: int, tenants: Path | None) -> list[str]:
    who = ["--tenants", str(tenants)] if tenants else ["--api-key", KEYS["flood"], "--api-key", KEYS["chat"]]
    return [
        str(Path(sys.executable).with_name("pagedserve")),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(args.model),
        "--max-queue-delay",
        "0",
        *who,
        *args.pagedserve_args.split(),
    ]


def tenant_options(tenant: str) -> list[str]:
    return [
        "--kind",
        KINDS[tenant],
        "--api-key",
        KEYS[tenant],
        "--long-prompt-words",
        str(LONG_PROMPT_WORDS),
        "--min-output-tokens",
        "4",
        "--max-output-tokens",
        "32" if tenant == "chat" else "8",
    ]


def figures(summary: dict, records: list[dict]) -> dict:
    timed = [r for r in records if r["status"] in (200, None)]  # unfinished: their age so far
    return {
        "requests": summary["requests"],
        "completed": summary["completed"],
        "shares": summary["shares"],
        "ttft_ms": summary["ttft_ms"],
        "e2e_ms": summary["e2e_ms"],
        "requests_per_s": summary["requests_per_s"],
        "ttft_ms_all": sorted(round(r["ttft_ms"], 1) for r in timed if r["ttft_ms"] is not None),
    }


def open_loop(url: str, rates: dict[str, float], args: argparse.Namespace, out: Path) -> dict:
    """One run: each tenant's Poisson arrivals from its own Locust process, side by side."""
    before, results, errors = os.getloadavg(), {}, []

    def one(tenant: str) -> None:
        load = Load(
            args.duration, args.drain, rate=rates[tenant], seed=args.seed + len(tenant), model=args.model.name
        )
        try:
            _rc, summary, records = run_load(url, load, out / tenant, tenant_options(tenant))
            results[tenant] = figures(summary, records)
        except Exception as exc:  # noqa: BLE001 - reported with the run
            errors.append(f"{tenant}: {exc}")

    threads = [threading.Thread(target=one, args=(tenant,)) for tenant in rates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    load_average = {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]}
    return {
        "rates": {k: round(v, 4) for k, v in rates.items()},
        **results,
        "errors": errors,
        "load_average": load_average,
    }


def p99(run: dict) -> float | None:
    return run.get("chat", {}).get("ttft_ms", {}).get("p99")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels, p50s, p99s = [], [], []
    for server in result["servers"]:
        for run in ("alone", "flooded"):
            ttft = result["servers"][server]["runs"][run].get("chat", {}).get("ttft_ms", {})
            labels.append(f"{server}\n{'B alone' if run == 'alone' else 'B + A flood'}")
            p50s.append(ttft.get("p50") or 0)
            p99s.append(ttft.get("p99") or 0)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], p50s, 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], p99s, 0.4, label="p99")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tenant B's time to first token (ms, log)")
    ratios = result["p99_ttft_ratio"]
    ax.set_title(
        f"B's p99 TTFT flooded / alone: tenants {ratios.get('tenants')}x, FIFO {ratios.get('fifo')}x "
        f"(A at {result['flood_factor']:g}x capacity)",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    args = parse_args()
    args.model = args.model.resolve()
    result: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "model": str(
            args.model.relative_to(REPO_ROOT) if args.model.is_relative_to(REPO_ROOT) else args.model
        ),
        "duration_s": args.duration,
        "drain_s": args.drain,
        "flood_factor": args.flood_factor,
        "chat_fraction": args.chat_fraction,
        "servers": {},
    }
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tenants_path = work / "tenants.toml"
        tenants_path.write_text(TENANTS_FILE)
        rates: dict[str, float] = {}
        for server in args.servers:
            port = free_port()
            url, cmd = (
                f"http://127.0.0.1:{port}",
                server_command(args, port, tenants_path if server == "tenants" else None),
            )
            print(f"[{server}] $ {' '.join(cmd)}", flush=True)
            with running_server(cmd, port, work / f"{server}.log"):
                if not rates:  # the replica's capacity for each kind, on the first server
                    for tenant, concurrency in (("flood", 4), ("chat", 16)):
                        cal = capacity(
                            url,
                            work / "calibrate" / tenant,
                            concurrency,
                            args.calibrate_duration,
                            tenant_options(tenant),
                            model=args.model.name,
                        )
                        result.setdefault("calibration", {})[tenant] = cal
                        factor = args.flood_factor if tenant == "flood" else args.chat_fraction
                        rates[tenant] = factor * cal["capacity_rps"]
                        print(f"[{server}] {tenant} capacity {cal['capacity_rps']:.3f} req/s", flush=True)
                runs = {}
                for name, sent in (("alone", {"chat": rates["chat"]}), ("flooded", rates)):
                    print(f"[{server}] {name}: {sent}", flush=True)
                    runs[name] = open_loop(url, sent, args, work / server / name)
                result["servers"][server] = {"command": " ".join(cmd), "runs": runs}
    result["p99_ttft_ratio"] = {
        server: round(p99(r["runs"]["flooded"]) / p99(r["runs"]["alone"]), 2)
        if p99(r["runs"]["flooded"]) and p99(r["runs"]["alone"])
        else None
        for server, r in result["servers"].items()
    }
    ratio = result["p99_ttft_ratio"].get("tenants")
    result["target"] = {"max_ratio": args.max_ratio, "met": ratio is not None and ratio <= args.max_ratio}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = "fairness" + (f"-{args.tag}" if args.tag else "")
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS_DIR / f"{stem}.png")
    print(
        f"B's p99 TTFT flooded / alone: tenants {ratio}x, FIFO {result['p99_ttft_ratio'].get('fifo')}x "
        f"(target <= {args.max_ratio:g}x: {'met' if result['target']['met'] else 'MISSED'}); "
        f"{RESULTS_DIR / stem}.json",
        flush=True,
    )
    return 0 if result["target"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
