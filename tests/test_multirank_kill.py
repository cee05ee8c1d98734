"""A rank SIGKILLed at any point of a group's registration leaves no segment, and the others raise.

``tests/test_shared_memory.py`` kills ranks inside `share_segment` called on its own.  Here the
segment is made where a job makes it, deep inside ``Scheduler.add`` (`residency.host.packing`): three
gloo ranks (tests/_dist.py) build ``Scheduler("cpu", process_group=...)`` and add the same model
with ``weight_transfer="allgather"`` (a node-shared master), and one rank kills itself with SIGKILL
at one point: while the ranks compare their weights (before any segment is named), at each
`SegmentStage` of the segment (its name agreed; created, not yet mapped by the others; mapped by
all, not yet unlinked; unlinked), or after registration, before its first all-gathered load.

The stages are watched with a profiler on the rank's own process (``sys.setprofile``), which sees
the calls of `residency.multirank.shared_memory._at_stage`, the no-op every stage calls ([Note: watching
the stages from outside] in residency/multirank/shared_memory.py); nothing is patched.

Checked: the victim reports nothing; every survivor raises within seconds (gloo reports the closed
connection at once; the node group's own timeout is minutes), and the segment whose name the ranks
agreed on is gone from /dev/shm; and every survivor's error is a typed `ResidencyError` that names
the group - also for a rank killed after the segment is set up (mapped by all, or unlinked), where
the others fail at the packer's barrier (``Packer._pack_shared``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from torch import nn

from residency.multirank import agreement, shared_memory

from _dist import run_world

RANKS = 3
#: How long a survivor may take to raise: far below the node group's timeout (5 minutes), so a
#: survivor that waited for the timeout instead of seeing the death fails the test.
PROMPTLY = 10.0


def _model(seed: int = 5) -> nn.Sequential:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Watch:
    """A profiler that records the segment stages this rank passes, and kills it at one point."""

    def __init__(self, kill_at: str | None) -> None:
        self.kill_at = kill_at
        self.stages: list[str] = []
        self.path: str | None = None

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        if frame.f_code is shared_memory._at_stage.__code__:
            stage = frame.f_locals["stage"].value
            self.stages.append(stage)
            self.path = frame.f_locals["path"]
            if stage == self.kill_at:
                _die()
        elif frame.f_code is agreement.compare_weights.__code__ and self.kill_at == "comparing":
            _die()


def _kill_worker(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    from residency import ResidencyError, Scheduler

    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    # Every rank has finished setting up the node group (gloo connects it pairwise) before any
    # rank registers: a victim that dies at "comparing" must die there, not under another
    # rank's connect.
    dist.barrier()
    model = _model()
    watch = _Watch(args["stage"] if rank == args["victim"] else None)
    started = time.monotonic()
    try:
        sys.setprofile(watch)
        try:
            scheduler.add("dit", model, weight_transfer="allgather")
        finally:
            sys.setprofile(None)
        if watch.kill_at == "registered":
            _die()
        with scheduler.resident("dit"):  # the next collective: the all-gathered load
            pass
    except Exception as error:  # reported to the test, which checks type and message
        return {"raised": type(error).__name__, "typed": isinstance(error, ResidencyError),
                "message": str(error), "seconds": time.monotonic() - started,
                "stages": watch.stages, "path": watch.path}
    return {"raised": None, "stages": watch.stages, "path": watch.path}


#: (victim, where it dies): every point of registration, and just after it.
POINTS = [
    (1, "comparing"),   # comparing the weights: no segment named yet
    (0, "named"),       # the leader, name agreed, before it creates the file
    (0, "created"),     # the leader, between creating the file and anyone mapping it
    (2, "created"),     # another rank, before it maps the file
    (1, "mapped"),      # another rank, after every rank mapped it, before the unlink
    (0, "mapped"),      # the leader, same
    (0, "unlinked"),    # the leader, name gone, before it copies the weights in
    (2, "registered"),  # after add returned, before the first all-gathered load
]
IDS = [f"rank{victim}-{stage}" for victim, stage in POINTS]
#: What a survivor raises, and a phrase of its message, for each point.
TYPED = {
    "comparing": ("RegistrationError", "comparing the weights of 'dit' failed: a rank of the "
                                       "process group died or did not arrive"),
    "named": ("RegistrationError", "setting up the node-shared segment"),
    "created": ("RegistrationError", "setting up the node-shared segment"),
    "mapped": ("RegistrationError", "'dit'"),
    "unlinked": ("RegistrationError", "'dit'"),
    "registered": ("CollectiveError", "phase #0: enter 'dit' failed: a rank of the process group "
                                      "died or did not arrive"),
}


@pytest.fixture(autouse=True)
def _needs_shm():
    if not os.path.isdir(shared_memory.SHM_DIRECTORY):
        pytest.skip("node-shared segments live in /dev/shm")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """`world(victim, stage)`: the ranks' results for that point, each world run once."""
    results = {}

    def run(victim: int, stage: str) -> list:
        if (victim, stage) not in results:
            results[victim, stage] = run_world(
                _kill_worker, RANKS, tmp_path_factory.mktemp(f"rank{victim}-{stage}"),
                timeout=40, args={"victim": victim, "stage": stage})
        return results[victim, stage]

    return run


def _survivors(results: list, victim: int) -> list[dict]:
    assert results[victim] is None, results[victim]  # killed: no report
    survivors = [result for rank, result in enumerate(results) if rank != victim]
    assert all(result is not None for result in survivors), results  # none hung or died
    return survivors


@pytest.mark.parametrize("victim, stage", POINTS, ids=IDS)
def test_a_rank_killed_during_registration_leaves_no_segment_and_the_others_raise_promptly(
    world, victim, stage
):
    survivors = _survivors(world(victim, stage), victim)
    for result in survivors:
        assert result["raised"], result
        assert result["seconds"] < PROMPTLY, result
    paths = {result["path"] for result in survivors}
    if stage == "comparing":
        assert paths == {None}, paths  # no segment was ever named
        assert all(result["stages"] == [] for result in survivors)
    else:
        (path,) = paths  # the name every rank agreed on
        assert path.startswith(f"{shared_memory.SHM_DIRECTORY}/{shared_memory.NAME_PREFIX}")
        assert not os.path.exists(path), f"{path} was left behind"


@pytest.mark.parametrize("victim, stage", POINTS, ids=IDS)
def test_the_survivors_of_a_killed_rank_raise_a_typed_error_naming_the_group(
    world, victim, stage
):
    raised, phrase = TYPED[stage]
    for result in _survivors(world(victim, stage), victim):
        assert result["raised"] == raised and result["typed"], result
        assert phrase in result["message"], result["message"]
