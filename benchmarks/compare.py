"""Old against new in the same run: chosen benchmarks of two checkouts, in interleaved rounds.

    python -m benchmarks.compare /work/wt/old . -k "test_reentry or test_swap_400mib" --rounds 4

Each round runs the selection once in each checkout (the order alternates between rounds), each
checkout with its own library and its own benchmarks on ``PYTHONPATH``.  Per benchmark it reports
the median of each run, new against old (the median of the new runs over the median of the old),
and the noise: the spread of the old runs among themselves (largest over smallest, minus one).  A
benchmark is *worse* when new/old - 1 exceeds 5% plus that noise.  A redesign is judged this way:
a timed assertion in tests/ could not tell a slow machine from a slow change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: How much slower than old, beyond the old runs' own spread, counts as worse.
MARGIN = 0.05


def run_once(checkout: Path, selection: str, extra: list[str]) -> dict[str, float]:
    """Median seconds per benchmark of one pytest-benchmark run in `checkout`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        command = [sys.executable, "-m", "pytest", "benchmarks", "-q", "-p", "no:cacheprovider",
                   "-k", selection, f"--benchmark-json={out}", *extra]
        done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"benchmarks failed in {checkout}:\n{done.stdout[-3000:]}")
        data = json.loads(out.read_text())
    return {b["name"]: b["stats"]["median"] for b in data["benchmarks"]}


def compare(old: Path, new: Path, selection: str, rounds: int, extra: list[str]) -> list[dict]:
    runs: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for index in range(rounds):
        order = [("old", old), ("new", new)] if index % 2 == 0 else [("new", new), ("old", old)]
        for side, checkout in order:
            for name, median in run_once(checkout, selection, extra).items():
                runs[side].setdefault(name, []).append(median)
            print(f"round {index + 1}/{rounds}: {side} done", file=sys.stderr)
    rows = []
    for name in sorted(runs["old"]):
        before, after = runs["old"][name], runs["new"].get(name, [])
        if not after:
            continue
        ratio = statistics.median(after) / statistics.median(before)
        noise = max(before) / min(before) - 1
        rows.append({"benchmark": name, "old_s": before, "new_s": after, "new_over_old": ratio,
                     "old_noise": noise, "worse": ratio - 1 > MARGIN + noise})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| benchmark | old median | new median | new/old | old-vs-old noise | verdict |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        verdict = "worse" if row["worse"] else "within 5% + noise"
        lines.append(f"| `{row['benchmark']}` | {_us(statistics.median(row['old_s']))} | "
                     f"{_us(statistics.median(row['new_s']))} | {row['new_over_old']:.3f} | "
                     f"{row['old_noise']:.1%} | {verdict} |")
    return "\n".join(lines)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="checkout of the old commit")
    parser.add_argument("new", type=Path, help="checkout of the new commit")
    parser.add_argument("-k", dest="selection", required=True, help="pytest -k selection")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args, extra = parser.parse_known_args(argv)
    for checkout in (args.old, args.new):
        if not (checkout / "benchmarks").is_dir() or not (checkout / "residency").is_dir():
            parser.error(f"{checkout} is not a checkout of this project (no benchmarks/ and "
                         "residency/ there)")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the old runs' spread is the noise figure")
    rows = compare(args.old.resolve(), args.new.resolve(), args.selection, args.rounds, extra)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
