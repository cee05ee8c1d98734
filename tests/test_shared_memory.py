"""Node-shared segments (residency.multirank.shared_memory) with real processes and gloo on the CPU.

Each test runs a small world (tests/_dist.py): one segment per node, the same bytes on every rank,
owner-only and unguessably named, gone from /dev/shm once set up, refused when sizes differ, and no
segment left behind by a rank SIGKILLed at any stage, while the survivors raise within the timeout.
Also the point of it all: 4 ranks mapping a 256 MiB segment add about 1x its size to the node's
proportional set size (PSS), not 4x.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import stat
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from residency.core.errors import RegistrationError
from residency.multirank.node import node_view
from residency.multirank.shared_memory import SHM_DIRECTORY, SegmentStage, share_segment

from _accelerator import require_cuda
from _dist import pss_kib, run_world

#: The node groups' timeout in these tests: how long survivors may wait for a missing rank.
TIMEOUT = timedelta(seconds=8)


def _assert_no_segment_left(results) -> None:
    """The segments the ranks agreed on (reported, or named in their errors) are all gone.

    Checked by name, not by scanning /dev/shm: other test runs on the machine may own segments.
    """
    paths = set()
    for result in results:
        if result:
            paths.add(result.get("path"))
            paths.update(re.findall(rf"{SHM_DIRECTORY}/residency-[0-9a-f]{{32}}",
                                    result.get("message", "")))
    paths.discard(None)
    assert paths, results
    assert not [path for path in paths if os.path.exists(path)]


class _Stages:
    """An `on_stage` observer that records the stages and what the file looked like."""

    def __init__(self, action=None):
        self.seen, self.path, self.created, self.action = [], None, None, action

    def __call__(self, stage: SegmentStage, path: str) -> None:
        self.seen.append(stage.value)
        self.path = path
        if stage is SegmentStage.CREATED and os.path.exists(path):
            info = os.stat(path)
            self.created = {"mode": stat.S_IMODE(info.st_mode), "uid": info.st_uid,
                            "size": info.st_size}
        if self.action is not None:
            self.action(stage, path)


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(path in line for line in maps)


# -- sharing -------------------------------------------------------------------------------------


def _share_worker(rank: int, world_size: int, args) -> dict:
    view = node_view(node_key="ab"[rank // 2], timeout=TIMEOUT)
    stages = _Stages()
    segment = share_segment(args["nbytes"], view.group, on_stage=stages)
    exists_after = os.path.exists(stages.path)
    writer = view.local_world_size - 1  # not the leader: any rank's writes reach every rank
    pattern = torch.arange(args["nbytes"], dtype=torch.int64).remainder_(251).to(torch.uint8)
    pattern += 1 + view.node_index
    if view.local_rank == writer:
        segment.tensor.copy_(pattern)
    dist.barrier(group=view.group)
    same = bool(torch.equal(segment.tensor, pattern))
    second = share_segment(4096, view.group)
    pinned, pin_refusal = segment.pinned, None
    if not torch.cuda.is_available():  # the CPU path of the hook: refused, saying why
        try:
            segment.page_lock()
        except RuntimeError as error:
            pin_refusal = str(error)
    # The tensor keeps the mapping alive after the segment object is gone; its last view frees it.
    window = segment.tensor[10:20]
    del segment
    gc.collect()
    alive = _mapped(stages.path) and int(window.sum()) == int(pattern[10:20].sum())
    del window
    gc.collect()
    return {
        "path": stages.path, "stages": stages.seen, "created": stages.created,
        "exists_after": exists_after, "same": same, "second": second.name, "alive": alive,
        "unmapped": not _mapped(stages.path), "uid": os.geteuid(), "pinned": pinned,
        "pin_refusal": pin_refusal,
        "local_rank": view.local_rank, "node": view.node_index,
    }


def test_one_segment_per_node_every_rank_sees_the_same_bytes(tmp_path):
    """Two simulated nodes of two ranks: each node shares one segment, private to that node."""
    results = run_world(_share_worker, 4, tmp_path, args={"nbytes": 3 * 4096 + 5})
    assert all(r and "raised" not in r for r in results), results
    by_node = {node: {r["path"] for r in results if r["node"] == node} for node in (0, 1)}
    assert all(len(paths) == 1 for paths in by_node.values()), by_node  # one per node
    assert by_node[0] != by_node[1]
    for result in results:
        assert result["stages"] == ["named", "created", "mapped", "unlinked"]
        assert result["same"], result  # the writer's bytes, the node's own pattern
        assert not result["exists_after"], "the name must be gone once setup returns"
        assert result["alive"] and result["unmapped"], result
        assert not result["pinned"]
        if not torch.cuda.is_available():
            assert "needs CUDA" in result["pin_refusal"], result
            assert "do not call page_lock" in result["pin_refusal"]
    _assert_no_segment_left(results)
    leaders = [r for r in results if r["local_rank"] == 0]
    for leader in leaders:
        assert leader["created"] == {"mode": 0o600, "uid": leader["uid"], "size": 3 * 4096 + 5}


def test_names_are_unguessable_and_unique(tmp_path):
    results = run_world(_share_worker, 4, tmp_path, args={"nbytes": 4096})
    names = {os.path.basename(r["path"]) for r in results} | {r["second"] for r in results}
    assert len(names) == 4, names  # 2 nodes x 2 segments, each its own name
    assert all(re.fullmatch(r"residency-[0-9a-f]{32}", name) for name in names), names
    _assert_no_segment_left(results)


# -- refusals ------------------------------------------------------------------------------------


def _refusal_worker(rank: int, world_size: int, args) -> dict:
    view = node_view(timeout=TIMEOUT)
    stages = _Stages(action=_TAMPERS.get(args.get("tamper")))
    nbytes = args["nbytes"] + (rank if args.get("differ") else 0)
    share_segment(nbytes, view.group, on_stage=stages, directory=args.get("directory", "/dev/shm"))
    return {"path": stages.path}


def _tamper(change):
    def action(stage: SegmentStage, path: str) -> None:
        # On the rank about to attach, so that it certainly sees the change (another rank might
        # have attached already).
        if stage is SegmentStage.CREATED and dist.get_rank() == 1:
            change(path)
    return action


_TAMPERS = {
    "size": _tamper(lambda path: os.truncate(path, 8192)),
    "mode": _tamper(lambda path: os.chmod(path, 0o640)),
}


def _assert_all_refused(results, *phrases) -> None:
    for result in results:
        assert result and result.get("raised") == "RegistrationError", result
        for phrase in phrases:
            assert phrase in result["message"], result["message"]
        assert result["seconds"] < 5, result


def test_ranks_asking_for_different_sizes_are_refused_before_anything_is_created(tmp_path):
    results = run_world(_refusal_worker, 2, tmp_path, args={"nbytes": 4096, "differ": True})
    _assert_all_refused(results, "different or invalid sizes", "{0: 4096, 1: 4097}",
                        "register the same modules")


@pytest.mark.parametrize("tamper, why", [
    ("size", "{1: 'its size is 8192 bytes, not the 4096 agreed on; refusing to map it"),
    ("mode", "{1: 'its mode is 0o640, not 0o600; refusing to map it"),
], ids=["size", "mode"])
def test_a_segment_changed_before_attach_is_refused_and_removed(tmp_path, tamper, why):
    results = run_world(_refusal_worker, 2, tmp_path, args={"nbytes": 4096, "tamper": tamper})
    _assert_all_refused(results, "attaching the node-shared segment", why, "was removed")
    _assert_no_segment_left(results)


def test_a_segment_larger_than_the_free_shared_memory_is_refused(tmp_path):
    results = run_world(_refusal_worker, 2, tmp_path, args={"nbytes": 1 << 50})
    _assert_all_refused(results, "creating the node-shared segment", "bytes free",
                        "--shm-size")
    _assert_no_segment_left(results)


def test_a_missing_shared_memory_directory_is_refused_on_every_rank(tmp_path):
    results = run_world(_refusal_worker, 2, tmp_path,
                        args={"nbytes": 4096, "directory": str(tmp_path / "absent")})
    _assert_all_refused(results, "no node-shared memory on some ranks", "absent is not a directory",
                        "need a shared-memory directory (/dev/shm on Linux)")


@pytest.mark.fast
def test_share_segment_needs_a_gloo_node_group():
    with pytest.raises(RegistrationError, match=r"Pass residency\.multirank\.node\.node_view\(\)\.group"):
        share_segment(4096, None)


# -- ranks that die or hang ------------------------------------------------------------------------


def _kill_worker(rank: int, world_size: int, args) -> dict:
    view = node_view(timeout=TIMEOUT)

    def die(stage: SegmentStage, path: str) -> None:
        if rank == args["victim"] and stage.value == args["stage"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.get("sleeper") and stage.value == args["stage"]:
            time.sleep(args["sleep"])

    stages = _Stages(action=die)
    started = time.monotonic()
    try:
        share_segment(4096, view.group, on_stage=stages)
        dist.barrier(group=view.group)  # the next collective: where a rank lost after setup shows
    except (RegistrationError, RuntimeError) as error:
        return {"raised": type(error).__name__, "message": str(error), "path": stages.path,
                "seconds": time.monotonic() - started}
    return {"path": stages.path}


@pytest.mark.parametrize(
    "victim, stage",
    [
        (0, "named"),     # the leader, before it creates the file
        (0, "created"),   # the leader, between creation and anyone mapping it
        (2, "created"),   # another rank, before it maps it
        (1, "mapped"),    # another rank, after every rank mapped it, before the unlink
        (0, "mapped"),    # the leader, same
        (1, "unlinked"),  # after the unlink
    ],
)
def test_a_rank_killed_at_any_stage_leaves_no_segment_and_the_others_raise(
    tmp_path, victim, stage
):
    started = time.monotonic()
    results = run_world(_kill_worker, 3, tmp_path, timeout=30,
                        args={"victim": victim, "stage": stage})
    assert results[victim] is None  # killed: no report
    survivors = [r for rank, r in enumerate(results) if rank != victim]
    for result in survivors:
        assert result and "raised" in result, result
        if stage in ("named", "created"):  # share_segment itself fails
            assert result["raised"] == "RegistrationError", result
            assert "died or did not arrive within the group's timeout" in result["message"]
            assert "look for the first error in the other ranks' logs" in result["message"]
        assert result["seconds"] < TIMEOUT.total_seconds(), result
    _assert_no_segment_left(survivors)
    assert time.monotonic() - started < 60  # nobody hangs (run_world bounds each world: 30 s)


def test_a_rank_that_never_arrives_makes_the_others_raise_within_the_timeout(tmp_path):
    """No death, no closed connection: rank 1 sleeps past the group's timeout after creation."""
    args = {"sleeper": 1, "stage": "created", "sleep": 3.5, "timeout": 2}
    results = run_world(_hang_worker, 2, tmp_path, timeout=30, args=args)
    assert results[0]["raised"] == "RegistrationError", results[0]
    assert 1.5 < results[0]["seconds"] < 4 * args["timeout"], results[0]  # the timeout, no hang
    assert "did not arrive within the group's timeout" in results[0]["message"]
    _assert_no_segment_left(results)


def _hang_worker(rank: int, world_size: int, args) -> dict:
    view = node_view(timeout=timedelta(seconds=args["timeout"]))
    stages = _Stages(action=lambda stage, path: (
        time.sleep(args["sleep"]) if rank == args["sleeper"] and stage.value == args["stage"]
        else None))
    started = time.monotonic()
    try:
        share_segment(4096, view.group, on_stage=stages)
    except RegistrationError as error:
        return {"raised": "RegistrationError", "message": str(error), "path": stages.path,
                "seconds": time.monotonic() - started}
    return {"path": stages.path}


# -- memory ---------------------------------------------------------------------------------------

SEGMENT_BYTES = 256 << 20


def _pss_worker(rank: int, world_size: int, args) -> dict:
    view = node_view(timeout=timedelta(seconds=30))
    dist.barrier(group=view.group)
    before = pss_kib()
    segment = share_segment(SEGMENT_BYTES, view.group)
    if view.is_leader:
        segment.tensor.fill_(7)  # writes every page
    dist.barrier(group=view.group)
    touched = int(segment.tensor.view(-1, 4096)[:, 0].sum(dtype=torch.int64))  # maps every page
    dist.barrier(group=view.group)
    after = pss_kib()
    dist.barrier(group=view.group)
    return {"growth_kib": after - before, "touched": touched,
            "path": f"{SHM_DIRECTORY}/{segment.name}"}


def test_four_ranks_mapping_a_segment_cost_the_node_about_one_copy(tmp_path):
    results = run_world(_pss_worker, 4, tmp_path, timeout=40)
    assert all(r and "raised" not in r for r in results), results
    assert all(r["touched"] == 7 * SEGMENT_BYTES // 4096 for r in results)
    growth = sum(r["growth_kib"] for r in results) * 1024
    print(f"PSS growth per rank (KiB): {[r['growth_kib'] for r in results]}; "
          f"sum {growth / 2**20:.1f} MiB = {growth / SEGMENT_BYTES:.3f}x the segment")
    assert 0.9 * SEGMENT_BYTES < growth <= 1.15 * SEGMENT_BYTES
    _assert_no_segment_left(results)


# -- accelerators ---------------------------------------------------------------------------------


def _pin_worker(rank: int, world_size: int, args) -> dict:
    view = node_view(timeout=TIMEOUT)
    segment = share_segment(1 << 20, view.group)
    if view.is_leader:
        segment.tensor.fill_(3)
    dist.barrier(group=view.group)
    segment.page_lock()
    on_device = segment.tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return {"pinned": segment.pinned, "same": bool((on_device == 3).all()),
            "path": f"{SHM_DIRECTORY}/{segment.name}"}


@pytest.mark.gpu
def test_each_rank_page_locks_its_mapping(tmp_path):
    require_cuda("page-locks a node-shared segment with cudaHostRegister")
    results = run_world(_pin_worker, 2, tmp_path)
    assert [(r["pinned"], r["same"]) for r in results] == [(True, True)] * 2, results
    _assert_no_segment_left(results)
