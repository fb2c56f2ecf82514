"""Where a step's time goes: the hot-spot table (attention, KV write, GEMMs, elementwise, sampling,
host) of a batch on the real engine, under torch.profiler (engine/frontend/profiler.py does the work).

    python benchmarks/profile_step.py                                     # coder-small, 8 x (128 in, 32 out), fp32
    python benchmarks/profile_step.py --batch-size 16 --prompt-len 256 --output-len 64 --dtype bfloat16 --tag bf16

The same profile runs as `pagedserve bench --profile`. Writes benchmarks/results/profile{-TAG}.json
and .png (or under --out-dir) and prints the table and one summary line. Figures are the profiled
run's; `unprofiled_step_mean_seconds` says how much the profiler itself slowed the steps.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO_ROOT)  # run as a script: the repository root, where `engine` is, leads sys.path
from engine.config import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # as the server: libgomp's long spins are 10-30x slower on shared busy cores

from benchmarks import plots  # noqa: E402
from engine.frontend.profiler import CATEGORIES, format_table, profile_arguments, run_profile, settings_from  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "models" / "pagedserve-coder-small"


def plot(result: dict, path: Path) -> None:
    """Stacked bars of each category's share of the step time: all steps, prefill steps, decode steps."""
    import matplotlib

    rows = [("all steps", result)] + [
        (f"{kind} steps", figures) for kind, figures in result["by_step_kind"].items()
    ]
    fig, ax = plots.new(figsize=(10, 3.6))
    for color, name in zip(matplotlib.colormaps["tab10"].colors, CATEGORIES, strict=False):
        shares = [figures["categories"][name]["share"] for _, figures in rows]
        lefts = [
            sum(f["categories"][c]["share"] for c in CATEGORIES[: CATEGORIES.index(name)]) for _, f in rows
        ]
        bars = ax.barh(range(len(rows)), shares, left=lefts, color=color, label=name)
        ax.bar_label(
            bars, labels=[f"{v:.0%}" if v >= 0.04 else "" for v in shares], label_type="center", fontsize=8
        )
    ax.set_yticks(
        range(len(rows)),
        [
            f"{label} ({f['num_steps']}, {f['step_seconds'] / max(f['num_steps'], 1) * 1e3:.0f} ms)"
            for label, f in rows
        ],
    )
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of step wall time (profiled)")
    s = result["settings"]
    ax.set_title(
        f"{Path(result['model']).name}, {result['dtype']} on {result['device']}: batch {s['batch_size']}, "
        f"{s['prompt_len']} in / {s['output_len']} out, load {result['machine']['load_average_before'][0]:.1f}"
        f"-{result['machine']['load_average_after'][0]:.1f}",
        fontsize=9,
    )
    ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(CATEGORIES), fontsize=8, frameon=False
    )
    plots.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: %(default)s)")
    profile_arguments(p)
    p.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", help="suffix of the result files' names")
    args = p.parse_args()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result = run_profile(args.model, settings_from(args))
    result["uptime_before"] = uptime_before
    result["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "profile" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{stem}.png")
    print(format_table(result))
    top = max(CATEGORIES, key=lambda c: result["categories"][c]["share"])
    print(
        f"{result['num_steps']} steps, {result['step_mean_seconds'] * 1e3:.1f} ms/step profiled "
        f"({result['unprofiled_step_mean_seconds'] * 1e3:.1f} unprofiled); largest: {top} "
        f"{result['categories'][top]['share']:.1%}; wrote {out / stem}.json/.png"
    )


if __name__ == "__main__":
    main()
