"""The two pictures of benchmarks/tail_latency.py, drawn from its report (the JSON it writes)."""

from pathlib import Path

from benchmarks import plots

COLORS = {"pagedserve": "tab:blue", "baseline": "tab:red"}
STYLES = ("-", "--", "-.", ":")  # one per FIFO fraction, in the order they ran


def cdf(values_ms: list[float]) -> tuple[list[float], list[float]]:
    """Seconds (sorted), and the fraction of requests at or below each."""
    ordered = sorted(values_ms)
    return [v / 1000 for v in ordered], [(i + 1) / len(ordered) for i in range(len(ordered))]


def plot_cdf(report: dict, path: Path) -> None:
    """TTFT and end-to-end CDFs, both sides, one line per rate (fractions of the FIFO capacity)."""
    fig, axes = plots.new(1, 2, figsize=(12, 4.6))
    for ax, metric, title in zip(
        axes, ("ttft", "e2e"), ("time to first token", "end-to-end latency"), strict=True
    ):
        for side, color in COLORS.items():
            runs = [r for r in report.get(side, {}).get("runs", []) if r["of"] == "FIFO"]
            for run, style in zip(runs, STYLES, strict=False):
                if not run[f"{metric}_ms_all"]:
                    continue
                xs, ys = cdf(run[f"{metric}_ms_all"])
                p99 = run[f"{metric}_ms"]["p99"]
                ax.step(
                    xs,
                    ys,
                    where="post",
                    color=color,
                    ls=style,
                    label=f"{side} {run['label']} (p99 {p99 / 1000:.2f} s)",
                )
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.set(
            xscale="log", xlabel="seconds (log)", ylabel="fraction of requests", title=title, ylim=(0, 1.01)
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right", fontsize=7)
    fig.suptitle(
        f"open loop, rates as fractions of the FIFO capacity ({report['fifo_capacity_rps']} req/s); "
        "unfinished requests at their age"
    )
    plots.save(fig, path)


def plot_vs_rate(report: dict, path: Path) -> None:
    """p50 (dashed) and p99 (solid) of TTFT, ITL and e2e, and the most requests in flight, against the rate."""
    fig, axes = plots.new(2, 2, figsize=(11, 8))
    panels = (("ttft_ms", "TTFT (s)"), ("itl_ms", "inter-token latency (s)"), ("e2e_ms", "end-to-end (s)"))
    for ax, (metric, title) in zip(axes.flat, panels, strict=False):
        for side, color in COLORS.items():
            runs = sorted(report.get(side, {}).get("runs", []), key=lambda r: r["rate"])
            for q, style in (("p99", "-"), ("p50", "--")):
                points = [(r["rate"], r[metric][q] / 1000) for r in runs if r[metric][q] is not None]
                if points:
                    ax.plot(
                        *zip(*points, strict=True), marker="o", color=color, ls=style, label=f"{side} {q}"
                    )
        ax.set(yscale="log", title=title, xlabel="arrivals (requests/s)")
    ax = axes.flat[3]
    for side, color in COLORS.items():
        runs = sorted(report.get(side, {}).get("runs", []), key=lambda r: r["rate"])
        if runs:
            ax.plot(
                [r["rate"] for r in runs],
                [r["in_flight"]["max"] for r in runs],
                marker="o",
                color=color,
                label=f"{side} max",
            )
            ax.plot(
                [r["rate"] for r in runs],
                [r["in_flight"]["mean"] for r in runs],
                marker="o",
                color=color,
                ls="--",
                label=f"{side} mean",
            )
    ax.set(title="requests in flight", xlabel="arrivals (requests/s)")
    for ax in axes.flat:
        ax.axvline(report["fifo_capacity_rps"], color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("open loop: latency against arrival rate (dotted: the FIFO capacity)")
    plots.save(fig, path)
