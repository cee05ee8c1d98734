"""What a case records in ``benchmark.extra_info``, and the figures derived from its median.

    benchmark.pedantic(swap, setup=floor.before_round, rounds=20)
    record(benchmark, case="swap", nbytes=400 * MiB, tensors=400, floor_s=floor.median(), goal=SWAP)

`derive` is the one place that turns a median and its extra info into ratios; the suite (live) and the
report (from pytest-benchmark JSON) both call it, so they cannot disagree.
"""

from __future__ import annotations

from benchmarks.goals import Goal

__all__ = ["derive", "record"]


def record(benchmark, *, case: str, nbytes: int, floor_s: float | None, tensors: int | None = None,
           goal: Goal | None = None, **extra) -> dict:
    """Store the case's facts in ``benchmark.extra_info`` and return its derived figures.

    ``measured_s`` in `extra` replaces the benchmark's median as the judged time (an eviction timed
    inside a transition).  With ``--benchmark-disable`` there is no median; the facts are still stored.
    """
    info = benchmark.extra_info
    info.update(case=case, nbytes=int(nbytes), floor_s=floor_s, **extra)
    if tensors is not None:
        info["tensors"] = int(tensors)
    if goal is not None:
        info["goal"] = goal.as_dict()
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats else None
    figures = derive(median, info)
    info.update({k: v for k, v in figures.items() if k not in ("median_s",)})
    return figures


def derive(median_s: float | None, info: dict) -> dict:
    """Median, floor, ratio, overhead above the floor, per tensor and per 1,000 tensors."""
    measured = info.get("measured_s", median_s)
    figures: dict = {"median_s": measured, "floor_s": info.get("floor_s")}
    floor, tensors = info.get("floor_s"), info.get("tensors")
    if measured is None:
        return figures
    if floor:
        figures["ratio"] = measured / floor
        figures["overhead_s"] = measured - floor
        if tensors:
            figures["per_tensor_overhead_s"] = (measured - floor) / tensors
    if info.get("fresh_copy_s"):
        figures["ratio_vs_fresh_copy"] = measured / info["fresh_copy_s"]
    if tensors:
        figures["per_1000_tensors_s"] = measured / tensors * 1_000
    if info.get("nbytes") and measured > 0:
        figures["gbps"] = info["nbytes"] / measured / 1e9
    return figures
