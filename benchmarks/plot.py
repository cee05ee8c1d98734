"""The report's picture: transition latency against bytes with the floor and the peers, and the
per-tensor overhead against tensor count.

    reason = write_plot(summary, Path("benchmarks/results/cpu-latency.png"))
    # None when written; else why not (matplotlib missing: ``pip install -e '.[plot]'``)
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_plot"]


def write_plot(summary: dict, path: Path) -> str | None:
    """Draw the summary into `path` (PNG).  Returns None, or the reason the plot was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[plot]'); the plot was skipped"
    figure, (latency, per_tensor) = pyplot.subplots(1, 2, figsize=(13, 7.2),
                                                    gridspec_kw={"width_ratios": [3, 2]})
    _draw_latency(latency, summary["cases"])
    _draw_per_tensor(per_tensor, summary["cases"])
    machine = summary["machine"]
    figure.suptitle(f"residency on {machine.get('device')} — {machine.get('cpu_model')}, "
                    f"{machine.get('cores')} cores, torch {machine.get('torch')}, "
                    f"{str(machine.get('date'))[:10]} (medians)", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return None


def _series(cases, kind, x="nbytes", y="median_s", **match):
    points = sorted(
        (c[x], c[y]) for c in cases
        if c.get("case") == kind and c.get(y) is not None and all(c.get(k) == v for k, v in match.items())
    )
    return [p[0] for p in points], [p[1] for p in points]


def _draw_latency(axes, cases) -> None:
    sizes, ours = _series(cases, "transition_vs_size")
    _, floor = _series(cases, "transition_vs_size", y="floor_s")
    axes.plot(sizes, ours, "o-", color="C0", label="ours: swap between two groups")
    axes.plot(sizes, floor, "k--", label="floor: one copy of the bytes (same run)")
    cold_x, cold_y = _series(cases, "cold_start")
    axes.plot(cold_x, cold_y, "s-", color="C2", label="ours: cold start (Scheduler.add)")
    fresh_x, fresh_y = _series(cases, "cold_start", y="fresh_copy_s")
    axes.plot(fresh_x, fresh_y, "g:", label="a copy into freshly allocated host memory")
    for kind, marker, color, label in (
        ("swap", "*", "C3", "ours: 400 MiB / 400 tensors swap"),
        ("evict_changed", "v", "C4", "ours: eviction, all weights changed"),
        ("evict_unchanged", "^", "C5", "ours: eviction, unchanged (re-point only)"),
    ):
        x, y = _series(cases, kind)
        if x:
            axes.plot(x, y, marker, color=color, markersize=11, label=label, linestyle="none")
    for offloader in sorted({c.get("offloader") for c in cases if c.get("case") == "pipeline_cycle"}):
        x, y = _series(cases, "pipeline_cycle", offloader=offloader)
        axes.plot(x, y, "D", markersize=8, linestyle="none", label=f"pipeline cycle: {offloader}")
    for case in cases:
        if case.get("case") == "reentry" and case.get("median_s"):
            axes.axhline(case["median_s"], color="C0", linestyle=":", linewidth=1.2,
                         label="ours: re-entry of the resident group (nothing moved)")
        if (case.get("case") == "per_forward" and case.get("offloader", "").startswith("accelerate")
                and case.get("overhead_s")):
            style = ":" if case["offloader"].endswith("device") else "-."
            axes.axhline(max(case["overhead_s"], 1e-8), color="C1", linestyle=style, linewidth=1.2,
                         label=f"accelerate hook per forward, nothing moved ({case['offloader']})")
    if not axes.lines or not any(len(line.get_xdata()) for line in axes.lines):
        axes.text(0.5, 0.5, "no transition cases in this run", ha="center",
                  transform=axes.transAxes)
    else:
        axes.set_xscale("log")
        axes.set_yscale("log")
    axes.set_xlabel("bytes moved per transition")
    axes.set_ylabel("latency (s)")
    axes.set_title("Transition latency against bytes")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)


def _draw_per_tensor(axes, cases) -> None:
    counts, overhead = _series(cases, "transition_vs_tensor_count", x="tensors",
                               y="per_tensor_overhead_s")
    axes.plot(counts, [v * 1e6 for v in overhead], "o-", color="C0",
              label="ours: (swap - floor) / tensors")
    axes.axhline(0.5, color="C3", linestyle="--", label="goal: 0.5 us")
    if not counts:
        axes.text(0.5, 0.5, "no tensor-count cases in this run", ha="center",
                  transform=axes.transAxes)
    else:
        axes.set_xscale("log")
        if min(overhead) > 0:  # noise can make a small count's overhead negative: keep it visible
            axes.set_yscale("log")
    axes.set_xlabel("tensors per group (fixed bytes)")
    axes.set_ylabel("overhead per tensor (us)")
    axes.set_title("Per-tensor overhead of a transition\n(at few tensors the floor's noise dominates)",
                   fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
