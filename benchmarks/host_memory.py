"""``python -m benchmarks.host_memory``: host bytes per node against the number of ranks (issue 15).

    python -m benchmarks.host_memory                          # 1, 2 and 4 ranks, a 256 MiB group
    python -m benchmarks.host_memory --ranks 2 --nbytes-mib 16 --out /tmp/hm/

For each rank count k, a job of k ranks on this host (torchrun, gloo) builds the same group and
registers it twice over: with ``Scheduler(process_group=...)`` (one host master per node, shared) and
without (one master per rank, as before).  Each rank reads its proportional set size
(``/proc/self/smaps_rollup``) before building the weights and after registering them; the sum over
the ranks is the host memory the job holds for the weights.  Writes ``cpu-host-memory.json`` under
``--out`` and prints a table; a measurement, on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.machine import proc_number

__all__ = ["main", "measure"]

MiB = 2**20


def measure(ranks: int, nbytes: int, *, shared: bool) -> dict:
    """Run one job of `ranks` ranks; the sum of their PSS growth and each rank's figure."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={ranks}", "-m", "benchmarks.host_memory", "--rank-worker",
                   "--nbytes-mib", str(nbytes // MiB), "--out", folder]
        if not shared:
            command.append("--private")
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the {ranks}-rank job failed:\n{done.stderr[-3000:]}")
        grown = [json.loads((Path(folder) / f"{rank}.json").read_text())["grown_bytes"]
                 for rank in range(ranks)]
    return {"ranks": ranks, "shared": shared, "weights_bytes": nbytes,
            "per_rank_bytes": grown, "node_bytes": sum(grown),
            "node_over_weights": sum(grown) / nbytes}


def _rank_worker(nbytes: int, out: Path, *, shared: bool) -> None:
    import gc

    import torch.distributed as dist

    from benchmarks.models import Stack
    from residency import Scheduler

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    gc.collect()
    before = _pss_bytes()
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD if shared else None)
    scheduler.add("weights", Stack(nbytes, max(1, nbytes // (16 * MiB))))
    _trim()
    gc.collect()
    dist.barrier()
    grown = _pss_bytes() - before
    dist.barrier()  # every rank still maps the shared pages while the others read their PSS
    (out / f"{dist.get_rank()}.json").write_text(json.dumps({"grown_bytes": grown}))
    scheduler.close()
    dist.destroy_process_group()


def _pss_bytes() -> int:
    return proc_number("/proc/self/smaps_rollup", "Pss") * 1024


def _trim() -> None:
    """Return freed heap pages in the private case too, so both cases are measured alike."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _table(rows: list[dict]) -> str:
    lines = ["| ranks | master | host bytes per node | x the weights |", "|---:|---|---:|---:|"]
    for row in rows:
        kind = "shared per node" if row["shared"] else "one per rank"
        lines.append(f"| {row['ranks']} | {kind} | {row['node_bytes'] / MiB:.1f} MiB | "
                     f"{row['node_over_weights']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                        help="rank counts to measure (default: 1 2 4)")
    parser.add_argument("--nbytes-mib", type=int, default=256,
                        help="the group's size in MiB (default: 256)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for cpu-host-memory.json (default: benchmarks/results)")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--private", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nbytes_mib < 1 or any(r < 1 for r in args.ranks):
        parser.error("--ranks and --nbytes-mib take positive whole numbers")
    nbytes = args.nbytes_mib * MiB
    if args.rank_worker:
        _rank_worker(nbytes, args.out, shared=not args.private)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(ranks, nbytes, shared=shared)
            for ranks in args.ranks for shared in (True, False)]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "torch": torch.__version__, "cpus": os.cpu_count(), "rows": rows}
    (args.out / "cpu-host-memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
