"""Turn pytest-benchmark JSON into the summary the report writes: cases, goals, peers, skips, machine.

    summary = summarize_run(json.loads(Path("bench.json").read_text()))
    summary["goals"]     # [{"goal": "re-entry ... <= 3 us", "value": 2.4e-06, "met": True, ...}, ...]

Figures are derived by `benchmarks.figures.derive`, the same function the suite uses, from each
case's median (pytest-benchmark's) and its ``extra_info``.
"""

from __future__ import annotations

from benchmarks.figures import derive
from benchmarks.goals import Goal

__all__ = ["markdown_table", "summarize_run"]

_FACTS = ("case", "nbytes", "tensors", "offloader", "model_nbytes", "modules", "written_back",
          "load_median_s", "evict_median_s", "pinned", "master_nbytes", "floor", "fresh_copy_s",
          "host_syncs_per_step", "host_syncs_per_eviction")


def summarize_run(run: dict) -> dict:
    """The summary of one pytest-benchmark run (its parsed JSON)."""
    machine = _machine(run)
    judged = machine.get("scale") != "tiny"
    cases = [_case(bench, judged) for bench in run.get("benchmarks", [])]
    goals = [dict(case["goal"], case=case["name"]) for case in cases if "goal" in case]
    return {
        "machine": machine,
        "cases": cases,
        "goals": goals,
        "goals_met": sum(1 for g in goals if g["met"]),
        "goals_missed": [g["goal"] + f" ({g['case']})" for g in goals if g["met"] is False],
        "peers": _peers(cases),
        "skipped": run.get("skipped", []),
    }


def _case(bench: dict, judged: bool) -> dict:
    """One case's facts and figures; its goal is judged unless the run was at the tiny scale."""
    info = bench.get("extra_info", {})
    stats = bench.get("stats") or {}
    case = {"name": bench["name"], "rounds": stats.get("rounds")}
    case.update({key: info[key] for key in _FACTS if key in info})
    case.update(derive(stats.get("median"), info))
    if "goal" in info:
        case["goal"] = Goal.from_dict(info["goal"]).judge(case)
        if not judged:
            case["goal"].update(met=None, note="tiny scale: sizes too small to judge the goal")
    return case


def _machine(run: dict) -> dict:
    info = run.get("machine_info", {})
    keys = ("cpu_model", "cores", "torch", "torch_threads", "python", "accelerator",
            "accelerator_name")
    machine = {key: info.get(key) for key in keys}
    machine["date"] = run.get("datetime", info.get("date"))
    machine.update(run.get("residency", {}))
    return machine


def _peers(cases: list[dict]) -> dict:
    """Per-forward overhead and pipeline-cycle time of every offloader measured, side by side."""
    peers: dict = {"per_forward_overhead_s": {}, "pipeline_cycle": {}}
    for case in cases:
        if case.get("case") == "per_forward":
            peers["per_forward_overhead_s"][case["offloader"]] = case.get("overhead_s")
        elif case.get("case") == "pipeline_cycle":
            peers["pipeline_cycle"][case["offloader"]] = {
                "median_s": case.get("median_s"), "ratio": case.get("ratio")}
    reentry = next((c for c in cases if c.get("case") == "reentry"), None)
    if reentry is not None:
        peers["residency_reentry_s"] = reentry.get("median_s")
    return peers


def markdown_table(summary: dict) -> str:
    """A short markdown table of the headline figures, with the machine and date under it."""
    rows = ["| case | median | floor | ratio | goal |", "|---|---:|---:|---:|---|"]
    for case in summary["cases"]:
        goal = case.get("goal")
        verdict = "" if goal is None else f"{goal['goal']}: {_VERDICTS[goal['met']]}"
        ratio = case.get("ratio")
        rows.append(f"| {case['name']} | {_time(case.get('median_s'))} | {_time(case.get('floor_s'))}"
                    f" | {'' if ratio is None else f'{ratio:.2f}x'} | {verdict} |")
    machine = summary["machine"]
    rows.append("")
    rows.append(f"Machine: {machine.get('cpu_model')}, {machine.get('cores')} cores, torch "
                f"{machine.get('torch')} ({machine.get('torch_threads')} thread(s)), device "
                f"{machine.get('device')}, scale {machine.get('scale')}; date {machine.get('date')}.")
    return "\n".join(rows) + "\n"


_VERDICTS = {True: "met", False: "missed", None: "not judged"}


def _time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"
