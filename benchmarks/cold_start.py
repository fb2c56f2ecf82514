"""Cold start: how long `make run` (`pagedserve serve`, the shipped default models) takes from the process's
start to `/health/ready` answering 200, and then to the end of a first short completion (compiled code may
be built on the first call, not at load). Target (#13): under 20 s on 2 cores.

    python benchmarks/cold_start.py                  # default, then --compile with an empty and a filled cache
    python benchmarks/cold_start.py --modes default --repeats 5

Modes: `default` (what `make run` starts); `compile-empty` (`--compile`, TORCHINDUCTOR_CACHE_DIR a new empty
directory: a replica's first start on a fresh host); `compile-cached` (`--compile`, the directory the last
compile-empty run filled: a restart). Every start is a new process on a free port, stopped once measured.
Writes benchmarks/results/cold_start{-TAG}.json and .png with the load average before and after (above 1.5
on 2 cores the figures are not clean).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # run as a script: the repository root, where `benchmarks` is, leads sys.path

from benchmarks import plots  # noqa: E402
from benchmarks.serving import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cold_start.json"
SERVE = [str(Path(sys.executable).with_name("pagedserve")), "serve"]


def _status(url: str, body: dict | None = None, timeout_s: float = 2.0) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def start_once(flags: list[str], env: dict[str, str], limit_s: float) -> dict:
    """Seconds from spawning the server to /health/ready 200, and to the end of a first 8-token completion."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    # the server's log goes to a file, not a pipe: one that logs more than a pipe holds would block
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(
            [*SERVE, "--port", str(port), *flags],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
        try:
            while _status(f"{url}/health/ready") != 200:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited ({server.returncode}): {log.read()[-2000:]}")
                if time.monotonic() - started > limit_s:
                    raise TimeoutError(f"not ready after {limit_s:g} s")
                time.sleep(0.05)
            ready_s = time.monotonic() - started
            status = _status(
                f"{url}/v1/completions",
                {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
                timeout_s=limit_s,
            )
            if status != 200:
                raise RuntimeError(f"the first completion answered {status}")
            return {"ready_s": round(ready_s, 2), "first_completion_s": round(time.monotonic() - started, 2)}
        finally:
            server.terminate()
            server.wait(60)


def plot(result: dict, path: Path) -> None:
    modes = list(result["modes"])
    fig, ax = plots.new()
    for i, mode in enumerate(modes):
        runs = result["modes"][mode]["runs"]
        ax.scatter(
            [i - 0.1] * len(runs),
            [r["ready_s"] for r in runs],
            color="#3a7",
            label="/health/ready" if i == 0 else None,
        )
        ax.scatter(
            [i + 0.1] * len(runs),
            [r["first_completion_s"] for r in runs],
            color="#37a",
            marker="x",
            label="first completion" if i == 0 else None,
        )
    ax.axhline(
        result["target_s"], color="#a33", linestyle="--", linewidth=1, label=f"target {result['target_s']} s"
    )
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("seconds from process start")
    ax.set_title(
        f"cold start of `pagedserve serve`; load {result['loadavg_before'][0]:.2f} -> "
        f"{result['loadavg_after'][0]:.2f}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    plots.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="default,compile-empty,compile-cached")
    p.add_argument("--repeats", type=int, default=3, help="starts per mode")
    p.add_argument("--limit-s", type=float, default=600, help="give up on a start after this long")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    loadavg_before = os.getloadavg()
    modes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pagedserve-inductor-") as scratch:
        cache_dir = ""
        for mode in args.modes.split(","):
            runs = []
            for repeat in range(args.repeats):
                env = {**os.environ}
                flags = [] if mode == "default" else ["--compile"]
                if mode == "compile-empty":
                    cache_dir = tempfile.mkdtemp(dir=scratch)
                elif mode == "compile-cached" and not cache_dir:
                    raise SystemExit(
                        "compile-cached reuses the cache a compile-empty run filled: list it first"
                    )
                if mode != "default":
                    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
                runs.append(start_once(flags, env, args.limit_s))
                print(mode, repeat, runs[-1], flush=True)
            modes[mode] = {
                "runs": runs,
                "median_ready_s": statistics.median(r["ready_s"] for r in runs),
                "median_first_completion_s": statistics.median(r["first_completion_s"] for r in runs),
            }
    result = {
        "command": "pagedserve serve",
        "modes": modes,
        "target_s": 20,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    path = RESULTS.with_name(f"cold_start{'-' + args.tag if args.tag else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    print(
        "; ".join(
            f"{m}: ready {v['median_ready_s']} s, first completion {v['median_first_completion_s']} s"
            for m, v in modes.items()
        )
        + f"; load {loadavg_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}"
    )


if __name__ == "__main__":
    main()
