"""A node-shared segment: one block of host memory mapped by every rank of one host.

    node = node_view()                                   # residency.multirank.node; collective
    segment = share_segment(nbytes, node.group)          # collective over the node's ranks
    segment.tensor                                       # uint8: the same pages on every rank
    segment.page_lock()                                  # per process, on accelerator hosts (DMA)

The node's leader (rank 0 of the node group) creates a POSIX shared-memory file in ``/dev/shm``,
owner-only (0o600), named unguessably (``residency-`` and 128 random bits agreed through the group),
and every rank maps it.  As soon as every rank has mapped it, the name is unlinked: the pages live
exactly as long as some process still maps them, and nothing is left in ``/dev/shm`` when the job
ends, however it ends.  Everything between the ranks goes through the node group's collectives
(gloo, bounded by its timeout); a failure on any rank makes every rank raise `RegistrationError`
with the same message, and the segment is removed.

[Note: the segment's lifetime]
``share_segment`` runs four steps, each closed by one ``all_gather_object`` in which every rank
reports success or what went wrong on it:
  1. agree: the size (every rank must ask for the same) and the name (the leader's random token);
  2. create: the leader creates the file with O_EXCL, mode 0o600, reserves its pages, maps it;
  3. attach: the others open it, refuse it unless it is a regular file of this user with mode 0o600
     and exactly the agreed size, and map it;
  4. unlink: every rank unlinks the name (the first one wins; the others find it gone).
The name is agreed *before* the file exists, so every survivor of a rank killed anywhere in the
window between creation and unlinking knows what to remove: a rank that sees a collective fail (a
peer died: gloo reports the closed connection at once; a peer hangs: the group's timeout) unlinks
the name and raises.  Every rank unlinks in step 4, so a leader killed right after the last
agreement leaks nothing either.  Only the death of *every* rank of the node inside that window (a
few milliseconds) can leave the file behind; a memfd passed through /proc would close that gap but
needs every rank in one PID namespace, which /dev/shm does not.

[Note: not multiprocessing.shared_memory]
On Python < 3.13 ``multiprocessing.shared_memory.SharedMemory`` registers every segment it creates
*or attaches* with the resource tracker of the process that touched it, which unlinks the segment
when that process exits (and warns of a "leak") even though other processes still use it, and
cannot be told not to (``track=False`` arrived in 3.13).  We therefore use ``os.open`` on the
shared-memory directory and ``mmap``, which no tracker sees; the early unlink makes a tracker
unnecessary.

[Note: reserving the pages]
A tmpfs file is sparse: ``ftruncate`` to a size larger than the free space succeeds, and the first
write to a page that cannot be backed kills the process with SIGBUS, in the middle of packing
weights.  Containers often have a small /dev/shm (Docker's default is 64 MiB).  So the leader checks
the free space and reserves every page with ``posix_fallocate`` at creation, and a short /dev/shm is
a clear error on every rank instead.

[Note: page-locking a shared mapping]
DMA from host memory needs it page-locked in the process that issues the copy; registration is per
process and per mapping, so each rank registers its own mapping (``cudaHostRegister``, exactly the
segment's bytes) and the registration is dropped when the mapping dies, with the last view of it,
as `residency.device.transport`'s exact-size pinned memory does.
"""

from __future__ import annotations

import enum
import mmap
import os
import secrets
import stat
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from residency.core.errors import RegistrationError
from residency.device.page_lock import RegisteredMapping

__all__ = ["SHM_DIRECTORY", "SegmentStage", "SharedSegment", "share_segment"]

#: Where POSIX shared memory lives on Linux.
SHM_DIRECTORY = "/dev/shm"
#: Every segment's name starts with this (followed by 32 random hex digits).
NAME_PREFIX = "residency-"
#: Owner read and write, nothing else.
MODE = 0o600


class SegmentStage(enum.Enum):
    """The points of `share_segment` every rank passes, in order (for tracing and tests)."""

    #: The name is agreed; the file does not exist yet.
    NAMED = "named"
    #: The leader has created the file (the others have not opened it yet).
    CREATED = "created"
    #: Every rank has mapped it; the name still exists.
    MAPPED = "mapped"
    #: The name is gone; the mappings stay.
    UNLINKED = "unlinked"


@attrs.frozen(kw_only=True)
class SharedSegment:
    """This process's mapping of one node-shared segment (made by `share_segment`).

    The pages are freed when every rank's last view of them is gone; the name is already gone.
    """

    #: The name the segment had in the shared-memory directory while it was being set up.
    name: str
    #: Its size in bytes (the same on every rank).
    nbytes: int
    #: This rank's rank within the node group; 0 created the segment.
    local_rank: int
    #: The mapped bytes: a uint8 tensor of `nbytes` over this process's mapping.
    tensor: torch.Tensor = attrs.field(eq=False, repr=False)
    _mapping: RegisteredMapping = attrs.field(eq=False, repr=False, alias="mapping")

    @property
    def pinned(self) -> bool:
        """Whether this process has page-locked its mapping (`page_lock`)."""
        return bool(self._mapping.registered)

    def page_lock(self) -> None:
        """Page-lock this process's mapping for DMA (CUDA); per process, not collective.

        Raises RuntimeError when the driver refuses (the caller decides whether to go on pageable,
        as `HostMaster` does).  See [Note: page-locking a shared mapping].
        """
        if self.pinned:
            return
        if not torch.cuda.is_available():
            raise RuntimeError(
                "page-locking a shared segment needs CUDA, and none is available here; host "
                "memory needs no page-locking for a CPU device: do not call page_lock"
            )
        self._mapping.register(self.tensor.data_ptr(), self.nbytes,
                               what=f"the {self.nbytes}-byte shared segment")


StageObserver = Callable[[SegmentStage, str], None]


def _at_stage(stage: SegmentStage, path: str) -> None:
    """The stage observer when none is given: does nothing.

    [Note: watching the stages from outside]
    `share_segment` is usually called deep inside ``Scheduler.add`` (`residency.host.packing`), where
    no `on_stage` can be passed.  Every stage still calls this function, so a test can watch the
    stages of any segment with a profiler on its own process (``sys.setprofile``: a "call" event
    whose code is ``_at_stage.__code__``, with `stage` and `path` among the frame's locals) and,
    for example, SIGKILL the rank there (tests/test_multirank_kill.py).  Nothing is patched and no
    state is kept; outside such a test it is one no-op call per stage.
    """


def share_segment(
    nbytes: int,
    group: dist.ProcessGroup,
    *,
    directory: str = SHM_DIRECTORY,
    on_stage: StageObserver | None = None,
) -> SharedSegment:
    """A segment of `nbytes` shared by the ranks of `group`; collective over `group`.

    `group` holds the ranks of one host, gloo (`residency.multirank.node.NodeView.group`); its rank 0 creates
    the segment.  Every rank must call this at the same point with the same `nbytes`.  Waits are
    bounded by the group's timeout.  `on_stage(stage, path)` is called on every rank at each
    `SegmentStage` (tracing; tests kill a rank there; see also [Note: watching the stages from
    outside]).  See [Note: the segment's lifetime].

        segment = share_segment(64 << 20, node.group)
        if node.is_leader:
            segment.tensor.copy_(packed_bytes)
        dist.barrier(group=node.group)              # the others read the same pages after this
    """
    _check_group(group)
    observe = on_stage or _at_stage  # see [Note: watching the stages from outside]
    try:
        path = os.path.join(directory, _agree(nbytes, group, directory))
    except RuntimeError as error:  # a collective failed: a rank died or timed out
        raise _peer_failure(error, "agreeing on the node-shared segment", "") from error
    try:
        return _set_up(nbytes, group, path, observe)
    except RuntimeError as error:
        raise _peer_failure(
            error, f"setting up the node-shared segment {path}", " The segment was removed."
        ) from error
    finally:
        _unlink(path)  # no-op after a normal setup (already unlinked); removes it after a failure


def _peer_failure(error: RuntimeError, what: str, cleanup: str) -> RegistrationError:
    return RegistrationError(
        f"rank {dist.get_rank()}: {what} failed because a rank of the node group died or did not "
        f"arrive within the group's timeout ({error}).{cleanup} Every rank of the node must call "
        "share_segment at the same point; look for the first error in the other ranks' logs"
    )


def _set_up(
    nbytes: int, group: dist.ProcessGroup, path: str, observe: StageObserver
) -> SharedSegment:
    observe(SegmentStage.NAMED, path)
    local_rank = dist.get_rank(group)
    mapping = problem = None
    if local_rank == 0:
        mapping, problem = _create(path, nbytes)
    _settle(group, problem, "creating", path)
    observe(SegmentStage.CREATED, path)
    if local_rank != 0:
        mapping, problem = _attach(path, nbytes)
    _settle(group, problem, "attaching", path)
    observe(SegmentStage.MAPPED, path)
    _unlink(path)
    observe(SegmentStage.UNLINKED, path)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    return SharedSegment(
        name=os.path.basename(path), nbytes=nbytes, local_rank=local_rank, tensor=tensor,
        mapping=mapping,
    )


def _check_group(group: dist.ProcessGroup) -> None:
    if not isinstance(group, dist.ProcessGroup) or dist.get_backend(group) != "gloo":
        raise RegistrationError(
            f"share_segment needs the node group, a gloo process group of one host's ranks; got "
            f"{group!r}. Pass residency.multirank.node.node_view().group"
        )


def _agree(nbytes: int, group: dist.ProcessGroup, directory: str) -> str:
    """The segment's file name; every rank raises the same error when the sizes differ."""
    token = secrets.token_hex(16) if dist.get_rank(group) == 0 else None
    problem = None if os.path.isdir(directory) else f"{directory} is not a directory"
    reports = _gather(group, (nbytes, token, problem))
    sizes = {rank: size for rank, (size, _, _) in enumerate(reports)}
    if len(set(sizes.values())) != 1 or not _valid_size(sizes[0]):
        raise RegistrationError(
            f"the ranks of the node asked for shared segments of different or invalid sizes "
            f"(node-group rank: bytes) {sizes}; every rank must register the same modules, in the "
            "same order, with the same dtypes, so that each asks for the same positive size"
        )
    problems = {rank: p for rank, (_, _, p) in enumerate(reports) if p}
    if problems:
        raise RegistrationError(
            f"no node-shared memory on some ranks: {problems}; node-shared host masters need a "
            f"shared-memory directory ({SHM_DIRECTORY} on Linux)"
        )
    return NAME_PREFIX + reports[0][1]


def _valid_size(nbytes: object) -> bool:
    return isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes > 0


def _gather(group: dist.ProcessGroup, report: object) -> list:
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    return reports


def _settle(group: dist.ProcessGroup, problem: str | None, step: str, path: str) -> None:
    """Every rank learns every rank's problem with `step`; all raise the same error if any."""
    problems = {rank: p for rank, p in enumerate(_gather(group, problem)) if p}
    if problems:
        raise RegistrationError(
            f"{step} the node-shared segment {path} failed on some ranks of the node group "
            f"(node-group rank: what went wrong) {problems}. The segment was removed"
        )


def _create(path: str, nbytes: int) -> tuple[RegisteredMapping | None, str | None]:
    """The leader's step: a new owner-only file of exactly `nbytes` reserved bytes, mapped."""
    directory = os.path.dirname(path)
    free = _free_bytes(directory)
    if free < nbytes:
        return None, _too_small(directory, free, nbytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, MODE)
    except OSError as error:
        return None, f"cannot create it ({error}); is {directory} writable by this user?"
    try:
        os.fchmod(fd, MODE)  # exactly 0o600 whatever the umask
        os.posix_fallocate(fd, 0, nbytes)  # see [Note: reserving the pages]
        return RegisteredMapping(fd, nbytes, flags=mmap.MAP_SHARED), None
    except OSError as error:
        return None, _too_small(directory, _free_bytes(directory), nbytes, error)
    finally:
        os.close(fd)


def _attach(path: str, nbytes: int) -> tuple[RegisteredMapping | None, str | None]:
    """A non-leader's step: map the leader's file after checking it is the one agreed on."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        return None, (
            f"cannot open it ({error}); if these ranks are on different hosts, give each host its "
            "own node key (RESIDENCY_NODE_KEY)"
        )
    try:
        problem = _refusal(os.fstat(fd), nbytes)
        if problem:
            return None, problem
        return RegisteredMapping(fd, nbytes, flags=mmap.MAP_SHARED), None
    finally:
        os.close(fd)


def _refusal(info: os.stat_result, nbytes: int) -> str | None:
    """Why an opened file is not the segment agreed on, or None."""
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        return f"it is not a regular file owned by user {os.geteuid()}; refusing to map it"
    if stat.S_IMODE(info.st_mode) != MODE:
        return f"its mode is {oct(stat.S_IMODE(info.st_mode))}, not {oct(MODE)}; refusing to map it"
    if info.st_size != nbytes:
        return (
            f"its size is {info.st_size} bytes, not the {nbytes} agreed on; refusing to map it "
            "(something else changed the file)"
        )
    return None


def _free_bytes(directory: str) -> int:
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def _too_small(directory: str, free: int, nbytes: int, error: OSError | None = None) -> str:
    cause = f" ({error})" if error else ""
    return (
        f"{directory} has {free} bytes free, the segment needs {nbytes}{cause}; enlarge it "
        "(docker run --shm-size, a memory-backed emptyDir on Kubernetes) or share fewer groups"
    )


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
