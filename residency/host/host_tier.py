"""The host tier for hosts smaller than the model: masters beyond ``memory_limit`` live in files.

    tier = HostTier.for_options(HostOptions(memory_limit="16GiB"), accelerator=False)
    if tier.file_backs("dit", inventory):                 # else: a private master, counted
        master = tier.pack("dit", inventory, transport)   # master.spill: its file
    master.spill.entering()   # a copy is about to read it: `Residency.begin_load`

One owner (`HostTier`, one per scheduler, held by its `Packer`) answers "which masters are
file-backed, and whose pages are in?".  A master is *file-backed* when it is a `SpillFile`: one
file of ours per master in ``spill_directory``, mapped shared and writable, that the master's
chunks are slices of; every other master is *private* memory of the process.

The rules (the limit counts the masters' bytes in host memory: private masters, and the pages of
file-backed masters that are in the page cache; not device storage, which on the CPU device is host
memory too, one group's bytes):

* **Which stay private.**  At ``add``, a master stays private while the private masters, with it,
  take at most half the limit and leave room for the largest file-backed master registered so far;
  every later master is file-backed.  The rest of the limit is the *paging room*: the pages of the
  group that loads and of the one read ahead.
* **Refused.**  A file-backed master larger than the limit less the private masters could not be
  paged in under the limit: `add` refuses it (`HostMemoryError`, nothing changed).  So a limit
  smaller than the largest group is refused, not silently exceeded.
* **Paged in, dropped.**  Before a copy reads a file-backed master (`entering`: a load, a
  prefetch, a streamed block), pages of other files are dropped until its pages fit the paging
  room: the most recently entered first.  Phase orders repeat (a pipeline's components call after
  call, layer mode's blocks step after step), so the file that entered just before (the group that
  just left, or is on the device: its bytes are in device storage, and only an eviction's
  write-back touches its master again, only the windows that changed) is needed again last, and
  the one that entered longest ago is needed next: for a repeating order this is the best drop
  order there is (it drops what is needed farthest ahead).
* **Read ahead.**  The file entered after it last time (the phase order repeats: module mode's
  groups step after step, layer mode's blocks) is read ahead at the same moment, when both fit
  the paging room: its pages come in while this group loads and its phase computes.  A group
  entering for the first time has nothing read ahead.

[Note: the tier's accounting is the kernel's]
Whose pages are in is asked of the kernel each time room is needed (``mincore`` of each mapping:
the pages in the page cache, ours, whether or not this process maps them now), never kept as
bookkeeping: pages a module pulls in by running on its host master outside a phase, or that an
eviction's write-back or a host edit touches, are counted like those a load reads.  What the tier
keeps is hints (the last time each file entered, which file followed which),
each a single store: an interrupt anywhere leaves at worst a stale hint, which changes only which
file is dropped first.  Correctness never depends on them: dropping pages of a shared file mapping
loses nothing (below), so a drop at any moment, even under a copy that reads them, only costs a
re-read.

[Note: edits go to our file]
The mapping is ``MAP_SHARED`` and writable: a write-back, a host edit (``.data.add_``), a tensor
copied in writes the page cache of our file, and dropping (``msync`` writes the dirty pages out,
``madvise(MADV_DONTNEED)`` unmaps them, ``posix_fadvise(POSIX_FADV_DONTNEED)`` lets the cache go)
keeps every byte: the next read comes from the file.  Private copy-on-write pages (a
``MAP_PRIVATE`` mapping of a weight file) would be discarded by the same drop; we never use them,
and the source files are never written (the master is a copy of ours).

[Note: nothing left behind]
The file is created without a name (``O_TMPFILE``) where the file system can; elsewhere it is
created under a random name and unlinked at once.  Its blocks are reserved (``posix_fallocate``)
before any page is written: a full disk is a `HostMemoryError` at ``add``, never a ``SIGBUS``
while packing.  The file lives as long as its mapping (the master's chunks and any view of them)
and its descriptor; when the process dies, however it dies, the kernel frees it: nothing remains
in ``spill_directory``.  A spill directory on tmpfs keeps the "file" in memory; the tier logs a
warning, since the limit is then not met.

[Note: file-backed masters are pageable]
On an accelerator a file-backed master is never page-locked: pinning would lock exactly the pages
the tier must drop.  Its host-to-device copies are pageable copies (the driver stages them); the
private masters stay pinned.  The log line of each file-backed master says so.

[Note: read-ahead maps nothing]
``madvise(MADV_WILLNEED)`` starts the kernel's reads of the range into the page cache and returns:
nothing is mapped, so the process's resident set grows only when the copy touches the pages (minor
faults, no disk wait when the read-ahead has finished).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import secrets
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from residency.options.budget import format_nbytes
from residency.core.errors import ConfigError, HostMemoryError
from residency.options.host_options import HostOptions
from residency.core.locks import locked
from residency.host.memory import HostMaster
from residency.modules.tensors import Inventory
from residency.device.transport import Transport

__all__ = ["HostTier", "SpillFile", "spill_directory_for"]

_log = logging.getLogger("residency")
_PAGE = mmap.PAGESIZE
#: The share of the limit private masters may take; the rest is the paging room.
PRIVATE_SHARE = 0.5
_TMPFS_TYPES = {"tmpfs", "ramfs"}
#: ``mincore`` (the C library's: Python has no binding), for `SpillFile.resident_nbytes`.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def spill_directory_for(options: HostOptions) -> tuple[Path, str]:
    """Where file-backed masters go, and which option said so: ``spill_directory``, else
    ``cache_directory``, else the system's temporary directory."""
    if options.spill_directory is not None:
        return options.spill_directory, "spill_directory"
    if options.cache_directory is not None:
        return options.cache_directory, "cache_directory"
    return Path(tempfile.gettempdir()), "the system's temporary directory"


class SpillFile:
    """One file-backed master's file: mapped shared and writable; `tensor` is its bytes.

    Made by `SpillFile.create`; its tier decides when its pages are dropped or read ahead.
    """

    def __init__(self, tier: HostTier, name: str, fd: int, mapping: mmap.mmap, nbytes: int):
        self._tier = tier
        #: The group (or streamed part) whose master it holds.
        self.name = name
        self.nbytes = nbytes
        self._fd = fd
        self._mapping = mapping
        #: uint8 over the mapping; its storage keeps the mapping alive (``torch.frombuffer``).
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        weakref.finalize(self, os.close, fd)

    @classmethod
    def create(cls, tier: HostTier, directory: Path, name: str, nbytes: int) -> SpillFile:
        """A new file of `nbytes` in `directory` with its blocks reserved (see [Note: nothing
        left behind]); OSError when the file system says no."""
        fd = _open_unnamed(directory)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(tier, name, fd, mapping, nbytes)

    def __repr__(self) -> str:
        return f"<SpillFile {self.name!r} {self.nbytes / 2**20:.1f} MiB>"

    def entering(self) -> None:
        """A copy is about to read this master (`HostTier.entering`)."""
        self._tier.entering(self)

    # -- its pages ---------------------------------------------------------------------------------

    def resident_nbytes(self) -> int:
        """Bytes of this file in the page cache now (``mincore``; see [Note: the tier's
        accounting is the kernel's])."""
        pages = -(-self.nbytes // _PAGE)
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(self.tensor.data_ptr()), ctypes.c_size_t(self.nbytes),
                         vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return min(self.nbytes, (pages - bytes(vector).count(0)) * _PAGE)

    def release_pages(self) -> None:
        """Write the dirty pages out, unmap them, let the page cache go (see [Note: edits go
        to our file]): nothing is lost, the next read comes from the file."""
        self._mapping.flush()
        self._mapping.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)

    def read_ahead_pages(self) -> None:
        """Start reading the file into the page cache ([Note: read-ahead maps nothing])."""
        self._mapping.madvise(mmap.MADV_WILLNEED)

    def start_write_out(self) -> None:
        """Start writing the freshly packed pages to the file in the background: the pages stay
        (mapped pages are not dropped), and a later drop waits for less."""
        os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)


class HostTier:
    """Which masters of one scheduler are file-backed, and whose pages are in (see the module
    docstring).  Thread-safe: packing runs outside the scheduler lock."""

    def __init__(self, limit: int, directory: Path, source: str, *, accelerator: bool) -> None:
        _check_directory(directory, source)
        #: The host bytes the masters may hold (``memory_limit``).
        self.limit = limit
        #: Where the files are made.
        self.directory = directory
        self._accelerator = accelerator
        self._lock = threading.Lock()
        self._private: weakref.WeakKeyDictionary[Inventory, int] = weakref.WeakKeyDictionary()
        #: Every live file-backed master's file -> its last use (a hint; larger: more recent).
        self._files: weakref.WeakKeyDictionary[SpillFile, int] = weakref.WeakKeyDictionary()
        #: file -> the file entered after it last time (read ahead when it enters).
        self._followed: weakref.WeakKeyDictionary[SpillFile, weakref.ref] = (
            weakref.WeakKeyDictionary())
        self._last_entered: weakref.ref | None = None
        self._clock = itertools.count(1)
        if _file_system_type(directory) in _TMPFS_TYPES:
            _log.warning("the host tier's files go to %s, a tmpfs: their pages are memory, so "
                         "memory_limit=%d is not met; give a spill_directory on a disk",
                         directory, limit)

    @classmethod
    def for_options(cls, options: HostOptions, *, accelerator: bool) -> HostTier | None:
        """The tier for `options`, or None without a ``memory_limit``; a spill directory that
        is missing or not writable is a `ConfigError` (nothing was made)."""
        if options.memory_limit is None:
            return None
        directory, source = spill_directory_for(options)
        return cls(options.memory_limit, directory, source, accelerator=accelerator)

    def __repr__(self) -> str:
        return (f"<HostTier limit {self.limit / 2**20:.1f} MiB in {self.directory}: "
                f"{self.private_nbytes / 2**20:.1f} MiB private, {len(self._files)} file(s), "
                f"{self.paged_nbytes() / 2**20:.1f} MiB paged in>")

    # -- queries ----------------------------------------------------------------------------------

    @property
    def private_nbytes(self) -> int:
        """Bytes of the private masters (counted against the limit)."""
        return sum(self._private.values())

    @property
    def paging_room(self) -> int:
        """Bytes the file-backed masters' pages may take: the limit less the private masters."""
        return self.limit - self.private_nbytes

    def files(self) -> list[SpillFile]:
        """Every live file-backed master's file."""
        return list(self._files)

    def paged_nbytes(self) -> int:
        """Bytes of the file-backed masters in the page cache now (asked of the kernel)."""
        return sum(spill.resident_nbytes() for spill in self.files())

    # -- registration -----------------------------------------------------------------------------

    def file_backs(self, name: str, inventory: Inventory) -> bool:
        """Whether `inventory`'s master is file-backed (see the rules); when it is not, it is
        counted as a private master from now on.  A master the limit cannot page in is refused
        (`HostMemoryError`): nothing changes."""
        return locked(self._lock, self._choose, name, inventory)

    def _choose(self, name: str, inventory: Inventory) -> bool:
        nbytes = inventory.layout.contiguous_nbytes
        private = self.private_nbytes
        largest = max((spill.nbytes for spill in self._files), default=0)
        if nbytes == 0 or (private + nbytes <= self.limit * PRIVATE_SHARE
                           and private + nbytes + largest <= self.limit):
            self._private[inventory] = nbytes
            return False
        if nbytes > self.limit - private:
            raise _too_large(name, nbytes, self.limit, private)
        return True

    def pack(self, name: str, inventory: Inventory, transport: Transport) -> HostMaster:
        """A file-backed master for `inventory` (its tensors are re-pointed to it as it fills),
        after room is made for its pages.  A file the disk refuses is a `HostMemoryError`."""
        nbytes = inventory.layout.contiguous_nbytes
        try:
            spill = SpillFile.create(self, self.directory, name, nbytes)
        except OSError as error:
            raise _no_file(name, nbytes, self.directory, error) from error
        self.entering(spill)
        master = HostMaster.pack(inventory, transport, pin=False, into=spill.tensor)
        master.spill = spill
        spill.start_write_out()
        _log.info("group %r: host master file-backed (%.1f MiB in %s; memory_limit %.1f MiB)%s",
                  name, nbytes / 2**20, self.directory, self.limit / 2**20,
                  "; pageable: page-locking would keep the pages the tier drops"
                  if self._accelerator else "")
        return master

    # -- phase changes -----------------------------------------------------------------------

    def entering(self, spill: SpillFile) -> None:
        """A copy is about to read `spill` (a load, a prefetch, a streamed block): drop other
        files' pages until its own fit, then read ahead the file that followed it last time,
        when both fit the paging room (see [Note: read-ahead maps nothing])."""
        locked(self._lock, self._enter, spill)  # one line: see [Note: a context on one line]

    def _enter(self, spill: SpillFile) -> None:
        last = self._last_entered() if self._last_entered is not None else None
        if last is not None and last is not spill:
            self._followed[last] = weakref.ref(spill)
        self._last_entered = weakref.ref(spill)
        self._files[spill] = next(self._clock)
        self._make_room(spill, keep=())
        follower = self._followed.get(spill)
        successor = follower() if follower is not None else None
        if successor is None or successor is spill:
            return
        self._files[successor] = next(self._clock)
        if self._make_room(successor, keep=(spill,)):
            _advise(successor.read_ahead_pages, "read ahead", successor)

    def _make_room(self, incoming: SpillFile, keep: tuple[SpillFile, ...]) -> bool:
        """Drop the pages of files other than `incoming` and `keep`, most recently entered first,
        until all of `incoming`'s and `keep`'s pages (counted whole: a copy is about to read
        them) fit the paging room with the others'; returns whether they fit."""
        room = self.paging_room
        files = self.files()
        if sum(spill.nbytes for spill in files) <= room:
            return True  # everything fits: nothing to ask the kernel
        spared = {id(incoming), *map(id, keep)}
        resident = {spill: spill.nbytes if id(spill) in spared else spill.resident_nbytes()
                    for spill in files}
        total = sum(resident.values()) + (0 if incoming in resident else incoming.nbytes)
        order = sorted((spill for spill in files if id(spill) not in spared and resident[spill]),
                       key=lambda spill: self._files.get(spill, 0), reverse=True)
        for spill in order:
            if total <= room:
                break
            if _advise(spill.release_pages, "drop the pages of", spill):
                total -= resident[spill]
        return total <= room


def _advise(step, what: str, spill: SpillFile) -> bool:
    """Run one page step (a drop, a read-ahead); one the kernel refuses (an I/O error writing
    the pages out) is logged and skipped: the pages stay, nothing is lost."""
    try:
        step()
        return True
    except OSError as error:
        _log.warning("host tier: could not %s %r (%s); its pages stay in memory", what, spill,
                     error)
        return False


def _open_unnamed(directory: Path) -> int:
    """A new empty file in `directory` that has no name (see [Note: nothing left behind])."""
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    tmpfile = getattr(os, "O_TMPFILE", None)
    if tmpfile is not None:
        try:
            return os.open(directory, flags | tmpfile, 0o600)
        except OSError:  # the file system has no unnamed files: a named one, unlinked at once
            pass
    path = directory / f".residency-spill-{secrets.token_hex(16)}"
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    return fd


def _check_directory(directory: Path, source: str) -> None:
    what = f"the host tier's directory {str(directory)!r} (from {source})"
    if not directory.exists():
        raise ConfigError(f"{what} does not exist; create it, or give host={{'spill_directory': "
                          "...} a directory on a disk with room for the masters beyond "
                          "memory_limit")
    if not directory.is_dir():
        raise ConfigError(f"{what} is not a directory; give spill_directory a directory")
    try:  # a real probe: permissions, a read-only or immutable directory, a full disk
        os.close(_open_unnamed(directory))
    except OSError as error:
        raise ConfigError(f"{what} is not writable by this process ({error.strerror}); fix "
                          "its permissions, or give spill_directory a directory this user may "
                          "write") from None


def _file_system_type(directory: Path) -> str | None:
    """The type of the file system `directory` is on (/proc/self/mounts), or None."""
    try:
        with open("/proc/self/mounts") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return None
    target = str(directory.resolve())
    best = None
    for fields in entries:
        point = fields[1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if len(fields) > 2 and inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2])
    return None if best is None else best[1]


def _too_large(name: str, nbytes: int, limit: int, private: int) -> HostMemoryError:
    return HostMemoryError(
        f"cannot add group {name!r}: its host master needs {nbytes} bytes "
        f"({format_nbytes(nbytes)}) paged in while it loads, and memory_limit={limit} "
        f"({format_nbytes(limit)}) leaves {limit - private} bytes "
        f"({format_nbytes(limit - private)}) for file-backed masters beside the private ones "
        f"({private} bytes, {format_nbytes(private)}). Raise memory_limit to at least "
        f"{private + nbytes} bytes ({format_nbytes(private + nbytes, digits=2)}, e.g. "
        f"\"memory_limit\": \"{_ceil_mib(private + nbytes)}MiB\"), or split the group; "
        "nothing was registered"
    )


def _ceil_mib(nbytes: int) -> int:
    """`nbytes` in whole MiB, rounded up: a limit that certainly holds it."""
    return -(-nbytes // 2**20)


def _no_file(name: str, nbytes: int, directory: Path, error: OSError) -> HostMemoryError:
    return HostMemoryError(
        f"cannot add group {name!r}: its file-backed host master needs {nbytes} bytes "
        f"({format_nbytes(nbytes)}) in {str(directory)!r} and making the file failed "
        f"({error}). Free disk space there or give another spill_directory; the weights keep "
        "their values"
    )

