"""tests/_dist.py: a rank that has reported stays until its peers have reported or died, so it
never closes its sockets under a peer still inside a collective ([Note: leaving together])."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from _dist import run_world


def _state(pid: int) -> str:
    """The process state letter of `pid` ("Z" for a zombie), or "gone"."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return "gone"
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


def _late_peer_worker(rank: int, world_size: int, args) -> dict:
    if rank == 0:
        return {"pid": os.getpid()}
    first = Path(args) / "0.json"
    deadline = time.monotonic() + 20
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # rank 0 has reported; had it left, it would be gone or a zombie by now
    return {"rank 0 then": _state(json.loads(first.read_text())["pid"])}


def test_a_rank_that_has_reported_waits_for_a_late_peer(tmp_path):
    results = run_world(_late_peer_worker, 2, tmp_path, timeout=60, args=str(tmp_path / "results"))
    assert results[1]["rank 0 then"] not in ("gone", "Z", "X"), results


def _dying_peer_worker(rank: int, world_size: int, args) -> dict:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return {}


def test_a_rank_does_not_wait_for_a_dead_peer(tmp_path):
    results = run_world(_dying_peer_worker, 2, tmp_path, timeout=60)
    assert results[1] is None and results[0] is not None
    # the survivor left when it saw the peer's lock free, not after _dist.LEAVE_WAIT (30 s)
    assert time.time() - (tmp_path / "results" / "0.json").stat().st_mtime < 20
