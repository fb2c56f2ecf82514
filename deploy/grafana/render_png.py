"""Draw deploy/grafana/pagedserve.json from a real run, without Grafana: a local Prometheus scrapes a running
pagedserve every second while a few clients send completions (optionally with the primary stalled for a
while, so breakers and failovers show), then Prometheus evaluates every panel's own queries (query_range)
and matplotlib draws them in the dashboard's order. Needs the `prometheus` binary (Debian: prometheus).

    pagedserve serve --port 8000 --api-key k --admin-key a --enable-fault-injection --idle-timeout 2 &
    python deploy/grafana/render_png.py --url http://127.0.0.1:8000 --api-key k --admin-key a --stall-primary 10
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "pagedserve.json"
PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def push(self, item):",
    "import os\n\ndef list_files(path):",
    "def quicksort(items):",
    "# read a CSV file and sum a column\n",
]
SHARED_PREFIX = "# utility functions for the billing service\nimport math\n\n"  # gives the prefix cache hits
RATE_WINDOW = "10s"  # for $__rate_interval: 10 scrapes at 1 s


def main() -> None:
    args = parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    with prometheus(args.url, args.prometheus) as prom:
        start = time.time()
        num_requests = run_load(args)
        time.sleep(3)  # the last scrapes
        end = time.time()
        panels = [
            (panel, [s for t in panel["targets"] for s in query(prom, t, start, end)])
            for panel in dashboard["panels"]
            if panel["type"] != "row"
        ]
    draw(dashboard["title"], panels, start, Path(args.out))
    drawn = sum(1 for _, series in panels if series)
    print(
        f"{args.out}: {drawn}/{len(panels)} panels with data, {num_requests} requests in {end - start:.0f} s"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running pagedserve")
    p.add_argument("--api-key")
    p.add_argument("--admin-key", help="with --stall-primary: the server's --admin-key")
    p.add_argument("--duration", type=float, default=60, help="seconds of load")
    p.add_argument("--users", type=int, default=4, help="concurrent clients")
    p.add_argument(
        "--stall-primary",
        type=float,
        default=0,
        help="seconds to stall the primary's engine loop, a third of the way in (needs a server "
        "with --enable-fault-injection): failovers, a breaker opening and closing",
    )
    p.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    p.add_argument("--out", default=str(HERE / "dashboard.png"))
    return p.parse_args()


# --- Prometheus: scrape and evaluate -------------------------------------------------------------------


@contextmanager
def prometheus(target_url: str, binary: str) -> Iterator[str]:
    """A throw-away Prometheus scraping `target_url` every second; yields its base URL."""
    port = _free_port()
    target = urllib.parse.urlparse(target_url).netloc
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [{"job_name": "pagedserve", "static_configs": [{"targets": [target]}]}],
                }
            )
        )
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 30)
            yield url
        finally:
            process.terminate()
            process.wait(10)


def promql(expr: str, rate_window: str = RATE_WINDOW) -> str:
    """The dashboard's query with its variables filled: every replica, every model."""
    return expr.replace("$__rate_interval", rate_window).replace("$instance", ".*").replace("$model", ".*")


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def query(prom: str, target: dict, start: float, end: float) -> list[tuple[str, list[float], list[float]]]:
    """[(legend, times, values)] of one panel target over the run, one per series."""
    params = urllib.parse.urlencode({"query": promql(target["expr"]), "start": start, "end": end, "step": 1})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{params}", timeout=30) as response:
        result = json.load(response)["data"]["result"]
    series = []
    for item in result:
        points = [(float(t), float(v)) for t, v in item["values"] if v not in ("NaN", "+Inf", "-Inf")]
        if points:
            times, values = zip(*points, strict=True)
            series.append((legend(target["legendFormat"], item["metric"]), list(times), list(values)))
    return series


# --- load ---------------------------------------------------------------------------------------------------


def run_load(args: argparse.Namespace) -> int:
    """`args.users` clients in closed loops for `args.duration` seconds; returns the requests sent."""
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    models = [m["id"] for m in _get_json(f"{args.url}/v1/models", headers)["data"]]
    deadline = time.monotonic() + args.duration
    counts = [0] * args.users

    def client(n: int) -> None:
        rng = random.Random(n)
        while time.monotonic() < deadline:
            prompt = (SHARED_PREFIX if rng.random() < 0.5 else "") + rng.choice(PROMPTS)
            body = {
                "model": models[0],
                "prompt": prompt,
                "max_tokens": rng.randint(8, 48),
                "temperature": 0.7,
                "stream": rng.random() < 0.5,
            }
            _post(f"{args.url}/v1/completions", body, headers)
            counts[n] += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(args.users)]
    for thread in threads:
        thread.start()
    if args.stall_primary:
        time.sleep(args.duration / 3)
        admin = {**headers, "Authorization": f"Bearer {args.admin_key}"}
        _post(
            f"{args.url}/admin/faults",
            {"model": models[0], "kind": "stall", "seconds": args.stall_primary},
            admin,
        )
    for thread in threads:
        thread.join()
    return sum(counts)


def _post(url: str, body: dict, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _get_json(url: str, headers: dict[str, str]) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        return json.load(response)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("prometheus did not become ready")
        time.sleep(0.3)


# --- drawing ----------------------------------------------------------------------------------------------


def draw(title: str, panels: list[tuple[dict, list]], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(16, 3.2 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels, strict=False):
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        step = panel["fieldConfig"]["defaults"].get("custom", {}).get("lineInterpolation") == "stepAfter"
        scale = 2**20 if unit == "bytes" else 1
        for label, times, values in series:
            xs, values = [t - start for t in times], [v / scale for v in values]
            (ax.step(xs, values, where="post", label=label) if step else ax.plot(xs, values, label=label))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_ylabel(UNITS.get(unit, ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if "max" in panel["fieldConfig"]["defaults"]:
            ax.set_ylim(
                panel["fieldConfig"]["defaults"].get("min", 0), panel["fieldConfig"]["defaults"]["max"] * 1.05
            )
        if series:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run", fontsize=8)
    fig.suptitle(
        f"{title}: every replica, every model (Prometheus query_range, 1 s scrapes, rate over {RATE_WINDOW})",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=80)


UNITS = {
    "tps": "tokens/s",
    "reqps": "requests/s",
    "s": "seconds",
    "percentunit": "share",
    "bytes": "MiB",
    "ops": "per second",
}


if __name__ == "__main__":
    main()
