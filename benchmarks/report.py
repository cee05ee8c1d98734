"""``python -m benchmarks.report``: run the suite (or read its JSON), write a summary and a plot.

    python -m benchmarks.report --run --out benchmarks/results/            # the default scale
    python -m benchmarks.report --run --scale tiny --out /tmp/report/      # seconds, for a check
    python -m benchmarks.report --json bench.json --out benchmarks/results/
    python -m benchmarks.report --run --device sim --out benchmarks/results/  # SIMULATED accelerator

Writes, under ``--out``, with the device type as prefix (``cpu-``, ``cuda-``, ``sim-``):
``summary.json`` (medians, floors, ratios, goals met or missed, peers, skips, machine and date;
under ``"layers"`` the layer-mode figures of ``benchmarks/test_layers.py``, see `layer_summary`;
under ``"simulated"`` the accelerator-shaped cases of ``benchmarks/test_simulated.py``, see
`simulated_summary`), ``latency.png`` (needs matplotlib, the ``plot`` extra; skipped with a
message otherwise, and for a simulated run), ``table.md`` (the headline table), and with ``--run``
the raw ``pytest-benchmark.json``.  Exits 0 when the report was written, whether or not the goals
were met.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.figures import derive
from benchmarks.plot import write_plot
from benchmarks.scale import SCALE_NAMES
from benchmarks.summary import markdown_table, summarize_run

__all__ = ["layer_markdown", "layer_summary", "main", "simulated_markdown", "simulated_summary",
           "write_report"]

_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run:
        source = out / "pytest-benchmark.json.tmp"
        code = run_suite(source, scale=args.scale, threads=args.threads, device=args.device,
                         extra=args.pytest_args)
        if not source.exists():
            print(f"the benchmark suite wrote no JSON (pytest exit code {code})", file=sys.stderr)
            return code or 1
    else:
        source = Path(args.json)
    run = json.loads(source.read_text())
    paths = write_report(run, out)
    if args.run:
        source.replace(paths["summary"].with_name(paths["summary"].name.replace(
            "summary.json", "pytest-benchmark.json")))
    return 0


def run_suite(json_path: Path, *, scale: str | None, threads: int | None, extra: list[str],
              device: str | None = None) -> int:
    """Run ``pytest benchmarks/`` writing pytest-benchmark JSON to `json_path`; its exit code."""
    command = [sys.executable, "-m", "pytest", str(_ROOT / "benchmarks"), "-q", "-p",
               "no:cacheprovider", f"--benchmark-json={json_path}"]
    if device:
        command.append(f"--bench-device={device}")
    if scale:
        command.append(f"--bench-scale={scale}")
    if threads is not None:
        command.append(f"--bench-threads={threads}")
    return subprocess.call(command + list(extra), cwd=_ROOT)


def write_report(run: dict, out: Path) -> dict[str, Path]:
    """Write summary JSON, table and plot for one pytest-benchmark run; returns their paths."""
    summary = summarize_run(run)
    summary["layers"] = layer_summary(run, summary)
    summary["simulated"] = simulated_summary(run, summary)
    prefix = str(summary["machine"].get("device") or "cpu").split(":")[0] + "-"
    paths = {"summary": out / f"{prefix}summary.json", "plot": out / f"{prefix}latency.png",
             "table": out / f"{prefix}table.md"}
    if summary["machine"].get("simulated"):
        skipped = "a simulated run: its figures are not drawn beside measured ones"
    else:
        skipped = write_plot(summary, paths["plot"])
    summary["plot"] = {"skipped": skipped} if skipped else {"path": paths["plot"].name}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["table"].write_text(_tables(summary))
    _print(summary, paths, skipped)
    return paths


def _tables(summary: dict) -> str:
    label = summary["machine"].get("simulated")
    head = f"**{label}**\n\n" if label else ""
    return (head + markdown_table(summary) + layer_markdown(summary["layers"])
            + simulated_markdown(summary["simulated"]))


def _print(summary: dict, paths: dict[str, Path], plot_skipped: str | None) -> None:
    print(_tables(summary))
    for goal in summary["goals"]:
        verdict = {True: "met", False: "MISSED", None: "not judged"}[goal["met"]]
        print(f"  {verdict:>12}: {goal['goal']} [{goal['case']}]: {goal['value']}")
    for skip in summary["skipped"]:
        print(f"  skipped: {skip['case']}: {skip['reason']}")
    print(f"summary: {paths['summary']}")
    print(f"plot: {'skipped: ' + plot_skipped if plot_skipped else paths['plot']}")


# -- layer mode (issue 14) -------------------------------------------------------------------------

_LAYER_CASES = ("layer_block_overhead", "layer_step", "layers_vs_group_offload")


def layer_summary(run: dict, summary: dict | None = None) -> dict | None:
    """The layer-mode cases of a run, side by side (None when the run has none).

    * ``block_overhead``: per size and edit detection, the overhead of a streamed block beyond
      the unoffloaded forward and the copy of its bytes, per block and per tensor, and the goal;
    * ``digests``: per size, what edit detection adds per block, and that against the block's copy
      (the digests at load and at eviction follow the bytes);
    * ``steps`` and ``vs_group_offload``: per mode, the step against the unoffloaded step (the
      median of per-round ratios), the floor ratio of a streamed step (step + copy of the block
      bytes) / step, device bytes, bytes moved per step, bit identity; skipped modes with reasons.
    """
    verdicts = {c["name"]: c.get("goal") for c in (summary or summarize_run(run))["cases"]}
    cases: dict[str, list[dict]] = {case: [] for case in _LAYER_CASES}
    commits = set()
    for bench in run.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if info.get("case") not in cases:
            continue
        figures = derive((bench.get("stats") or {}).get("median"), info)
        cases[info["case"]].append((bench["name"], info, figures))
        commits.add(info.get("commit"))
    if not any(cases.values()):
        return None
    overhead = [_overhead_row(name, info, figures, verdicts.get(name))
                for name, info, figures in cases["layer_block_overhead"]]
    skipped = {s["case"]: s["reason"] for s in run.get("skipped", [])
               if s["case"].startswith(("test_layer_step", "test_layers_vs_group_offload"))}
    return {
        "commit": ", ".join(sorted(str(c) for c in commits)),
        "block_overhead": overhead,
        "digests": _digest_rows(overhead),
        "steps": {info["mode"]: _step_row(info, figures)
                  for _, info, figures in cases["layer_step"]},
        "vs_group_offload": {info["mode"]: _step_row(info, figures)
                             for _, info, figures in cases["layers_vs_group_offload"]},
        "skipped": skipped,
    }


def _overhead_row(name: str, info: dict, figures: dict, goal: dict | None) -> dict:
    blocks = info.get("blocks") or 1
    overhead = figures.get("overhead_s")
    row = {"case": name, "size": info.get("size"), "detect_edits": info.get("detect_edits"),
           "hollow": info.get("hollow"), "dim": info.get("dim"), "dtype": info.get("dtype"),
           "tokens": info.get("tokens"), "blocks": blocks,
           "tensors_per_block": info.get("tensors_per_block"),
           "block_nbytes": info.get("block_nbytes"),
           "step_s": figures.get("median_s"), "unoffloaded_step_s": info.get("none_s"),
           "copy_per_block_s": info["copy_s"] / blocks if info.get("copy_s") else None,
           "overhead_per_block_s": None if overhead is None else overhead / blocks,
           "overhead_per_tensor_s": figures.get("per_tensor_overhead_s"),
           "device_nbytes": info.get("device_nbytes")}
    if goal is not None:
        row["goal"] = goal
    return row


def _digest_rows(overhead: list[dict]) -> list[dict]:
    """Detection on minus detection off, per size (both cases must have run)."""
    rows = []
    for on in (r for r in overhead if r["detect_edits"]):
        off = next((r for r in overhead if r["size"] == on["size"] and not r["detect_edits"]), None)
        if off is None or None in (on["overhead_per_block_s"], off["overhead_per_block_s"]):
            continue
        per_block = on["overhead_per_block_s"] - off["overhead_per_block_s"]
        copy = on["copy_per_block_s"]
        rows.append({"size": on["size"], "block_nbytes": on["block_nbytes"],
                     "digests_per_block_s": per_block,
                     "digests_over_block_copy": per_block / copy if copy else None})
    return rows


def _step_row(info: dict, figures: dict) -> dict:
    keys = ("floor_ratio", "copy_s", "device_nbytes", "model_nbytes", "moved_per_step_nbytes",
            "bit_identical", "note", "model", "blocks", "dim", "tokens")
    row = {"step_s": figures.get("median_s"), "unoffloaded_step_s": figures.get("floor_s"),
           "ratio_to_none": figures.get("ratio")}
    row.update({key: info[key] for key in keys if info.get(key) is not None})
    return row


def layer_markdown(layers: dict | None) -> str:
    """The layer-mode section of the table (empty when the run had no layer cases)."""
    if not layers:
        return ""
    lines = ["", "## Layer mode (issue 14)", "",
             f"Library commit: {layers['commit'] or 'unknown'}.", "",
             ("| blocks | detect_edits | step | unoffloaded | copy / block | overhead / block "
              "| overhead / tensor | goal |"), "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in layers["block_overhead"]:
        goal = row.get("goal")
        verdict = "" if goal is None else f"<= 1 us/tensor: {_VERDICTS[goal['met']]}"
        lines.append(
            f"| {row['size']} ({row['blocks']} x {_mib(row['block_nbytes'])}, "
            f"{row['tensors_per_block']} tensors) | {row['detect_edits']} | {_us(row['step_s'])} "
            f"| {_us(row['unoffloaded_step_s'])} | {_us(row['copy_per_block_s'])} "
            f"| {_us(row['overhead_per_block_s'])} | {_us(row['overhead_per_tensor_s'])} "
            f"| {verdict} |")
    if layers["digests"]:
        lines += ["", ("| edit detection (digests at load and eviction) | per block "
                       "| x the block's copy |"), "|---|---:|---:|"]
        for row in layers["digests"]:
            ratio = row["digests_over_block_copy"]
            lines.append(f"| {row['size']} ({_mib(row['block_nbytes'])}) "
                         f"| {_us(row['digests_per_block_s'])} "
                         f"| {'' if ratio is None else f'{ratio:.2f}x'} |")
    for title, rows in (("a denoising step", layers["steps"]),
                        ("diffusers' WanTransformer3DModel", layers["vs_group_offload"])):
        if not rows:
            continue
        lines += ["", (f"| {title}: mode | step | x no offload | floor (step + block copies) "
                       "| device bytes | moved / step | bit-identical |"),
                  "|---|---:|---:|---:|---:|---:|---|"]
        notes = []
        for mode, row in rows.items():
            ratio, floor = row.get("ratio_to_none"), row.get("floor_ratio")
            note = ""
            if row.get("note"):
                notes.append(row["note"])
                note = f" [{len(notes)}]"
            lines.append(f"| {mode}{note} | {_us(row['step_s'])} "
                         f"| {'' if ratio is None else f'{ratio:.3f}x'} "
                         f"| {'' if floor is None else f'{floor:.3f}x'} "
                         f"| {_mib(row.get('device_nbytes'))} "
                         f"| {_mib(row.get('moved_per_step_nbytes'))} "
                         f"| {row.get('bit_identical', '')} |")
        lines += [""] + [f"[{i}] {note}" for i, note in enumerate(notes, 1)] if notes else []
    for case, reason in layers["skipped"].items():
        lines.append(f"\nSkipped {case}: {reason}")
    return "\n".join(lines) + "\n"


_VERDICTS = {True: "met", False: "missed", None: "not judged"}


def _us(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def _mib(nbytes: int | None) -> str:
    if nbytes is None:
        return ""
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


# -- accelerator-shaped, simulated (issue 19) -----------------------------------------------------

_SIM_CASES = ("sim_layer_step", "sim_transition", "sim_host_syncs")


def simulated_summary(run: dict, summary: dict | None = None) -> dict | None:
    """The cases of ``benchmarks/test_simulated.py`` (None when the run has none) under the
    simulation's label, each row with the controls it ran under.

    * ``layer_steps``: per mode and bound, the step, the unoffloaded step (total compute), the
      copy of every streamed block (total copy), the step / max of the two, bit identity, host
      syncs per step beyond the unoffloaded step's, and the goal;
    * ``transitions``: encoder -> DiT with and without prefetch against the unoffloaded pair, the
      DiT's copy, how much of it stayed exposed;
    * ``host_syncs``: per mode, host synchronisations per steady-state step and per eviction.
    """
    verdicts = {c["name"]: c.get("goal") for c in (summary or summarize_run(run))["cases"]}
    rows: dict[str, list[dict]] = {case: [] for case in _SIM_CASES}
    for bench in run.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if info.get("case") not in rows:
            continue
        figures = derive((bench.get("stats") or {}).get("median"), info)
        facts = {k: v for k, v in info.items() if k not in ("goal", "label")}
        row = {"case": bench["name"], **facts, **figures}
        if verdicts.get(bench["name"]) is not None:
            row["goal"] = verdicts[bench["name"]]
        rows[info["case"]].append(row)
    if not any(rows.values()):
        return None
    for row in rows["sim_transition"]:
        if row.get("overhead_s") is not None and row.get("dit_copy_s"):
            row["exposed_over_copy"] = row["overhead_s"] / row["dit_copy_s"]
    label = (run.get("residency") or {}).get("simulated") or "SIMULATED accelerator"
    return {"label": label, "layer_steps": rows["sim_layer_step"],
            "transitions": rows["sim_transition"], "host_syncs": rows["sim_host_syncs"]}


def simulated_markdown(sim: dict | None) -> str:
    """The "Accelerator-shaped (simulated)" section of the table (empty without such cases)."""
    if not sim:
        return ""
    lines = ["", "## Accelerator-shaped (simulated)", "", f"**{sim['label']}.**", ""]
    if sim["layer_steps"]:
        lines += [("| layer-mode step: mode, bound (block copy / compute) | step | total compute "
                   "| total copy | x max(compute, copy) | host syncs / step | bit-identical "
                   "| goal |"), "|---|---:|---:|---:|---:|---:|---|---|"]
        for row in sim["layer_steps"]:
            lines.append(f"| {row['mode']}, {row['bound']} ({row['copy_over_compute']}) "
                         f"| {_us(row.get('median_s'))} | {_us(row.get('compute_s'))} "
                         f"| {_us(row.get('copy_s'))} | {_ratio(row.get('ratio'))} "
                         f"| {row.get('host_syncs_per_step')} | {row.get('bit_identical')} "
                         f"| {_goal(row)} |")
    if sim["transitions"]:
        lines += ["", ("| encoder -> DiT | cycle | unoffloaded | x unoffloaded | DiT copy "
                       "| exposed / copy | host syncs | goal |"),
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for row in sim["transitions"]:
            exposed = row.get("exposed_over_copy")
            lines.append(f"| {row['prefetch']} | {_us(row.get('median_s'))} "
                         f"| {_us(row.get('floor_s'))} | {_ratio(row.get('ratio'))} "
                         f"| {_us(row.get('dit_copy_s'))} "
                         f"| {'' if exposed is None else f'{exposed:.2f}'} "
                         f"| {row.get('host_syncs_per_cycle')} | {_goal(row)} |")
    if sim["host_syncs"]:
        lines += ["", "| host syncs, steady-state layer step | per step | evictions / step "
                      "| per eviction | goal |", "|---|---:|---:|---:|---|"]
        for row in sim["host_syncs"]:
            per_eviction = row.get("host_syncs_per_eviction")
            lines.append(f"| {row['mode']} ({row['blocks']} blocks) "
                         f"| {row.get('host_syncs_per_step')} | {row.get('evictions_per_step')} "
                         f"| {'' if per_eviction is None else f'{per_eviction:.2f}'} "
                         f"| {_goal(row)} |")
    controls = sorted({(r.get("compute_delay_s"), r.get("copy_bandwidth_bps"))
                       for r in sim["layer_steps"] + sim["transitions"]})
    if controls:
        lines += ["", "Controls: " + "; ".join(
            f"compute delay {_us(delay)} per op, copy bandwidth {bandwidth / 1e6:.3g} MB/s"
            for delay, bandwidth in controls) + "."]
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}x"


def _goal(row: dict) -> str:
    goal = row.get("goal")
    return "" if goal is None else f"<= {goal['limit']:g}: {_VERDICTS[goal['met']]}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--json", help="a pytest-benchmark JSON file to summarize")
    source.add_argument("--run", action="store_true", help="run the benchmark suite first")
    parser.add_argument("--out", default=str(_ROOT / "benchmarks" / "results"),
                        help="directory for the summary, the plot and the table")
    parser.add_argument("--scale", choices=SCALE_NAMES, default=None,
                        help="with --run: case sizes (default: the suite's default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="with --run: torch intra-op threads (default: the suite's, 1)")
    parser.add_argument("--device", choices=("default", "sim"), default=None,
                        help="with --run: sim runs the accelerator-shaped cases on the SIMULATED "
                             "device (benchmarks/test_simulated.py); default: the suite's device")
    parser.add_argument("pytest_args", nargs="*", help="with --run: extra pytest arguments")
    return parser


if __name__ == "__main__":
    sys.exit(main())
