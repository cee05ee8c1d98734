"""``python -m benchmarks.report``: run the suite (or read its JSON), write a summary and a plot.

    python -m benchmarks.report --run --out benchmarks/results/            # the default scale
    python -m benchmarks.report --run --scale tiny --out /tmp/report/      # seconds, for a check
    python -m benchmarks.report --json bench.json --out benchmarks/results/

Writes, under ``--out``, with the device type as prefix (``cpu-``, ``cuda-``):
``summary.json`` (medians, floors, ratios, goals met or missed, peers, skips, machine and date),
``latency.png`` (needs matplotlib, the ``plot`` extra; skipped with a message otherwise),
``table.md`` (the headline table), and with ``--run`` the raw ``pytest-benchmark.json``.
Exits 0 when the report was written, whether or not the goals were met.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.plot import write_plot
from benchmarks.scale import SCALE_NAMES
from benchmarks.summary import markdown_table, summarize_run

__all__ = ["main", "write_report"]

_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run:
        source = out / "pytest-benchmark.json.tmp"
        code = run_suite(source, scale=args.scale, threads=args.threads, extra=args.pytest_args)
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


def run_suite(json_path: Path, *, scale: str | None, threads: int | None, extra: list[str]) -> int:
    """Run ``pytest benchmarks/`` writing pytest-benchmark JSON to `json_path`; its exit code."""
    command = [sys.executable, "-m", "pytest", str(_ROOT / "benchmarks"), "-q", "-p",
               "no:cacheprovider", f"--benchmark-json={json_path}"]
    if scale:
        command.append(f"--bench-scale={scale}")
    if threads is not None:
        command.append(f"--bench-threads={threads}")
    return subprocess.call(command + list(extra), cwd=_ROOT)


def write_report(run: dict, out: Path) -> dict[str, Path]:
    """Write summary JSON, table and plot for one pytest-benchmark run; returns their paths."""
    summary = summarize_run(run)
    prefix = str(summary["machine"].get("device") or "cpu").split(":")[0] + "-"
    paths = {"summary": out / f"{prefix}summary.json", "plot": out / f"{prefix}latency.png",
             "table": out / f"{prefix}table.md"}
    skipped = write_plot(summary, paths["plot"])
    summary["plot"] = {"skipped": skipped} if skipped else {"path": paths["plot"].name}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["table"].write_text(markdown_table(summary))
    _print(summary, paths, skipped)
    return paths


def _print(summary: dict, paths: dict[str, Path], plot_skipped: str | None) -> None:
    print(markdown_table(summary))
    for goal in summary["goals"]:
        verdict = {True: "met", False: "MISSED", None: "not judged"}[goal["met"]]
        print(f"  {verdict:>12}: {goal['goal']} [{goal['case']}]: {goal['value']}")
    for skip in summary["skipped"]:
        print(f"  skipped: {skip['case']}: {skip['reason']}")
    print(f"summary: {paths['summary']}")
    print(f"plot: {'skipped: ' + plot_skipped if plot_skipped else paths['plot']}")


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
    parser.add_argument("pytest_args", nargs="*", help="with --run: extra pytest arguments")
    return parser


if __name__ == "__main__":
    sys.exit(main())
