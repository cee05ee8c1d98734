"""Run a function on every rank of a small gloo world of real processes, with every wait bounded.

    results = run_world(_worker, 3, tmp_path, timeout=20, args={"nbytes": 4096})
    # results[rank] is what _worker(rank, world_size, args) returned, an Outcome for a raise,
    # or None for a rank that died (killed, crashed, or still running at the deadline).

Workers are module-level functions of a test module (they are pickled by name).  Processes come
from a forkserver that has imported torch once, so a world starts in well under a second instead
of each rank importing torch again; each rank initialises the default group from a file store in
`tmp_path` (no ports to find) and reports through a JSON file, then leaves with ``os._exit`` (no
teardown that could wait on a dead peer) once every peer has reported or died.

[Note: leaving together] A collective can end on one rank before it ends on another: gloo's
``new_group`` connects a full mesh, and a rank whose side of each pair is done returns while a
peer still reads its handshake.  A rank that left at once closed its sockets under that peer,
which then failed with "Connection closed by peer" (seen in CI on a loaded machine).  So a rank
leaves only when each peer has written its result (it is past its last collective) or is gone:
each rank holds an exclusive ``flock`` on its own file for its whole life, which the kernel drops
when it dies however it dies (SIGKILL included), so a peer whose lock can be taken is gone.  The
wait is bounded (`LEAVE_WAIT`).  The parent waits for each process until its deadline and kills
whatever is left, so a test never hangs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Every rank's default group gives up on a missing peer after this long.
GROUP_TIMEOUT = timedelta(seconds=15)

#: The longest a rank that has reported waits for its peers to report or die before it leaves.
LEAVE_WAIT = 30.0


#: What the forkserver imports once, for every rank: torch, and the third-party modules that
#: importing our modules (which each rank does, unpickling its worker's test module) loads -
#: torch._dynamo alone is ~2.5 s a rank (``@torch.compiler.disable`` in residency.placement.layers).
#: Never a module of ours: each rank imports those itself.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.profiler", "attrs"]


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def run_world(
    worker: Callable[[int, int, Any], Any],
    world_size: int,
    tmp_path: Path,
    *,
    timeout: float = 30.0,
    args: Any = None,
    env: Mapping[int, Mapping[str, str]] | None = None,
) -> list[Any]:
    """Each rank's JSON result (or {"raised": type, "message": ...}), None for a rank that died."""
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    store = tmp_path / "store"
    context = _context()
    processes = [
        context.Process(
            target=_rank_main,
            args=(worker, rank, world_size, str(store), str(results), args,
                  dict((env or {}).get(rank, {}))),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
    return [_read(results / f"{rank}.json") for rank in range(world_size)]


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _rank_main(worker, rank, world_size, store, results, args, env) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    started = time.monotonic()
    alive = _hold_alive_lock(Path(results), rank)
    try:
        try:
            dist.init_process_group(
                "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                timeout=GROUP_TIMEOUT,
            )
            started = time.monotonic()
            result = worker(rank, world_size, args)
        except Exception as error:  # reported to the test, which checks type and message
            result = {
                "raised": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - started,
                "traceback": traceback.format_exc()[-3000:],
            }
        _write(Path(results) / f"{rank}.json", result)
        _wait_for_peers(Path(results), rank, world_size)
    finally:
        alive.close()
        os._exit(0)


def _hold_alive_lock(results: Path, rank: int):
    """This rank's open, exclusively locked ``alive`` file; see [Note: leaving together]."""
    import fcntl

    path = results / f"{rank}.alive"
    alive = open(path.with_suffix(".locking"), "w")
    fcntl.flock(alive, fcntl.LOCK_EX)
    path.with_suffix(".locking").rename(path)  # visible only once locked
    return alive


def _wait_for_peers(results: Path, rank: int, world_size: int) -> None:
    """Return once every other rank has written its result or is gone, or after `LEAVE_WAIT`."""
    pending = set(range(world_size)) - {rank}
    deadline = time.monotonic() + LEAVE_WAIT
    while pending and time.monotonic() < deadline:
        pending = {peer for peer in pending if not _left(results, peer)}
        if pending:
            time.sleep(0.005)


def _left(results: Path, peer: int) -> bool:
    """Whether `peer` has reported, or started and died (its lock can be taken)."""
    import fcntl

    if (results / f"{peer}.json").exists():
        return True
    try:
        with open(results / f"{peer}.alive", "r") as alive:
            fcntl.flock(alive, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False  # not started yet
    except BlockingIOError:
        return False  # alive
    return True


def _write(path: Path, result: Any) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.rename(path)


def pss_kib() -> int:
    """This process's proportional set size, in KiB (shared pages count once over their users)."""
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")
