"""Reading host masters behind the first phase: a group's bytes arrive from its weight files in the
background, and its first load waits for its own bytes only.

    reads = ReadBehind(part_nbytes=2**28)                  # one per scheduler (its packer's)
    master = reads.master_for("transformer_2", inventory, files, transport, pin=True)
    ...                                                    # add returns at once; reads go on
    master.arrival.complete(master)                        # its first load: wait, then re-point

With ``HostOptions(background_reads=True)`` (`residency.adapters.diffusers.from_pretrained` turns
it on), a group whose tensors are still views of their weight files gets a master whose bytes
are *arriving*: `master_for` returns at once, the group's tensors stay the file views they were,
and one thread of the scheduler's ("residency-arrive") reads the groups' file regions into their
chunks, one group after another in the order they were added, a part (``chunk_nbytes`` of reads)
at a time.  A group's first load (`Residency._begin_load`, every path that copies a master to the
device) calls `Arrival.complete`: its group goes to the front of the queue (after the part in
flight of the group being read), the caller waits for its reads alone, and then the master is
committed.  So the first phase starts once its own group is in, and the other groups are read in
first-use order behind it, as long as groups are added in the order their phases come
(`residency.vllm_omni.discovery.register_groups` adds a pipeline's encoders, then its denoisers,
then its VAE).

[Note: what a commit checks]
Until its commit, an arriving master's views are the tensors' own storages (the file mappings):
every owner that compares a tensor with its home (`Residency.changes_on_host`, the misfit check)
sees a group as packed, and an edit made meanwhile lands where the tensor is.  The commit, on the
caller's thread under the scheduler lock, is where the read bytes become the weights:

- a region read from its file is kept only if its pages were still never written
  (`find_file_sources` asked again, now): an edit made after `add`, by any path, left
  copy-on-write pages, and the region is copied from memory instead, edit included;
- every region that was not read from a file (memory, an edit before `add`, a file replaced
  since) is copied from memory then, on the caller's thread: no thread reads a tensor's memory
  while model code may write it;
- a tensor given new storage meanwhile (``.data = ...``) is not re-pointed: its pointer no longer
  matches its home's, so the load that follows copies its bytes in (`copy_in`), as for any
  tensor replaced while offloaded.

[Note: the worker's lifetime]
The worker thread is started by the first `master_for` that finds none running, and it ends when
the queue is empty (under the queue's lock, so a new master either finds it running or starts
another).  A caller waiting for a master makes sure one runs (a worker never started because an
interrupt landed between the queue and the start, or one that died, is replaced; a replaced
worker ends at its next turn: only the registered one reads).  It never touches a module or a
tensor of the model: it allocates chunks and reads files into them through `FileReader`.  A
master nobody will load (its group removed, re-packed after a change, a registration undone by
an interrupt) is abandoned: `abandon` is called by the group's removal, and by a finaliser when
the master is collected, so an undone registration stops its reads too; the worker finishes the
part in flight and drops the arrival.  A read that fails
(a truncated file, an I/O error, host memory) is kept and raised by every `complete`, as a
`WeightFileError` or `HostMemoryError`: the group's tensors are still the file views, with their
values, and the group stays offloaded.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence

import attrs
import torch

from residency.engine.errors import HostMemoryError, WeightFileError
from residency.engine.file_reads import FileReader, FileSource, find_file_sources, replaced
from residency.engine.locks import locked
from residency.engine.memory import (
    HostMaster,
    Progress,
    allocate_chunk,
    copy_region_into,
    views_into_chunk,
)
from residency.engine.tensors import Inventory, data_ptrs, repoint
from residency.engine.transport import Transport

__all__ = ["Arrival", "ReadBehind"]

_log = logging.getLogger("residency")

#: Seconds between redraws of the progress bar while a caller waits for a group's reads.
_REDRAW_S = 0.25


class Arrival:
    """One master's bytes on their way from the weight files (see the module docstring).

    The worker writes `chunks`, `pinned`, `read_nbytes` and, once, `failure` then `done`; the
    caller's thread reads them only after `done` is set.  `abandoned` is written by `abandon`.
    """

    def __init__(self, reads: ReadBehind, name: str, inventory: Inventory, sources: list,
                 files: Sequence, transport: Transport, pin: bool) -> None:
        #: The queue this master is read by.
        self._reads = reads
        self.name = name
        self._inventory = inventory
        #: Each region's (storage, first byte) as the tensors had them at `add`: kept until the
        #: commit (what a memory copy reads; what holds the file mappings open).
        self._sources = sources
        #: Each region's `FileSource` found at `add`, or None (copied from memory at the commit).
        self._files = list(files)
        self._transport = transport
        #: The tensors' data pointers at `add`: a tensor still there is re-pointed at the commit.
        self._pointers_at_add = data_ptrs(inventory.tensors)
        #: Chunks filled so far, in layout order (the worker's).
        self.chunks: list[torch.Tensor] = []
        #: The chunk being filled, and its reads still to do ((region, first byte, bytes) each).
        self._chunk: torch.Tensor | None = None
        self._left: list[tuple[int, int, int]] = []
        #: Whether the chunks are page-locked (asked for `pin`; False after pinning failed).
        self.pinned = pin
        self.read_nbytes = 0
        self.failure: BaseException | None = None
        self.done = threading.Event()
        self.abandoned = False
        self._started = time.perf_counter()

    @property
    def nbytes(self) -> int:
        return self._inventory.layout.nbytes

    # -- the worker's side -----------------------------------------------------------------------

    def read_next_part(self, reader: FileReader, most: int) -> bool:
        """Read the next part of this master: at most `most` bytes of its file reads, into the
        chunk being filled (allocated first); True once every chunk is in.  Parts, not chunks:
        a chunk holds whole regions, and one region can be a whole weight file of many GiB,
        so a group asked for next waits for one part of another at most."""
        layout = self._inventory.layout
        if self._chunk is None:
            index = len(self.chunks)
            self._chunk, self.pinned = allocate_chunk(self._transport, layout.chunk_nbytes[index],
                                                      self.pinned)
            self._left = _pieces(self._inventory.regions_in_chunk(index), self._files, layout)
        part, left = _take(self._left, most)
        try:
            reader.start(self._chunk, self._reads_of(part))
        except WeightFileError:  # a file replaced since `add`: its regions come from memory
            self._files = [None if f is not None and replaced(f) else f for f in self._files]
            part, left = [p for p in part if self._files[p[0]]], [
                p for p in left if self._files[p[0]]]
            reader.start(self._chunk, self._reads_of(part))
        reader.finish()
        self._left = left
        self.read_nbytes += sum(nbytes for _, _, nbytes in part)
        if self._left:
            return False
        chunk, self._chunk = self._chunk, None
        if not self.abandoned:  # else the chunk goes with this frame
            self.chunks.append(chunk)
        self.read_nbytes = sum(c.numel() for c in self.chunks)
        return len(self.chunks) == len(layout.chunk_nbytes)

    def _reads_of(self, part: list[tuple[int, int, int]]) -> list[tuple[FileSource, int, int]]:
        """`FileReader.start`'s reads of `part` ((region, first byte in it, bytes) each)."""
        offsets = self._inventory.layout.region_offset
        return [(attrs.evolve(self._files[r], offset=self._files[r].offset + first),
                 offsets[r] + first, nbytes) for r, first, nbytes in part]

    def fail(self, error: BaseException) -> None:
        """Keep the worker's failure for `complete` to raise (as a typed error)."""
        if isinstance(error, WeightFileError):
            self.failure = error
        elif isinstance(error, MemoryError):
            self.failure = HostMemoryError(
                f"cannot read the host master of group {self.name!r}: its {self.nbytes} bytes "
                f"({self.nbytes / 2**20:.1f} MiB) of host memory could not be allocated "
                f"({error}). Free host memory or offload fewer components; the group stays "
                "offloaded on its weight files, with its values")
        else:
            self.failure = WeightFileError(
                f"reading the host master of group {self.name!r} from its weight files failed "
                f"({type(error).__name__}: {error}). Load the pipeline again; the group stays "
                "offloaded on its weight files, with its values")
            self.failure.__cause__ = error

    # -- the caller's side -----------------------------------------------------------------------

    def complete(self, master: HostMaster) -> None:
        """Wait for this master's reads (its group read next), then commit them into `master`:
        see [Note: what a commit checks].  Raises the read's failure, changing nothing.
        Repeatable: an interrupted commit is completed by the next call (or rolled forward)."""
        if master.arrival is not self:
            return
        self._reads.hurry(self)
        self._wait()
        if self.failure is not None:
            raise self.failure
        views = self._fill_from_memory()
        try:
            self._repoint(views)
            master.arrived(self.chunks, views, self.pinned)  # the commit: one line
        except BaseException:  # re-pointing began: rolled forward (see [Note: interrupts])
            if master.arrival is self:
                self._repoint(views)
                master.arrived(self.chunks, views, self.pinned)
            raise
        _log.info("group %r: its host master arrived from its weight files (%.1f MiB, %.2f s "
                  "after add)", self.name, self.nbytes / 2**20,
                  time.perf_counter() - self._started)

    def abandon(self) -> None:
        """Stop reading this master: nobody will load it (idempotent)."""
        self._reads.abandon(self)

    def _wait(self) -> None:
        """Wait for the worker to finish this master, showing how far it is (over a GiB: a bar on
        a terminal, log lines otherwise; `Progress`).  An interrupt leaves the reads going on."""
        if self.done.is_set():
            return
        progress = Progress(self.nbytes, verb=f"waiting for group {self.name!r}: reading its "
                            "host master")
        shown = 0
        while not self.done.wait(_REDRAW_S):
            self._reads.hurry(self)  # a worker that died is replaced: no wait for ever
            progress.advance(self.read_nbytes - shown)
            shown = self.read_nbytes
        progress.advance(self.nbytes - shown)
        progress.close()

    def _fill_from_memory(self) -> list[torch.Tensor]:
        """Copy into the chunks every region whose read bytes are not the weights now (not read,
        or written since `add`); the chunk views, in inventory order.  Repeatable."""
        inventory, layout = self._inventory, self._inventory.layout
        now = find_file_sources(self._sources, layout.region_nbytes)
        for region, (found, still) in enumerate(zip(self._files, now)):
            if found is None or still is None:
                copy_region_into(self.chunks[layout.region_chunk[region]],
                                 layout.region_offset[region], self._sources[region],
                                 layout.region_nbytes[region])
        views: list[torch.Tensor | None] = [None] * inventory.tensor_count
        for index, chunk in enumerate(self.chunks):
            members = inventory.tensors_in_regions(inventory.regions_in_chunk(index))
            for i, view in zip(members, views_into_chunk(inventory, members, chunk)):
                views[i] = view
        return views  # type: ignore[return-value]

    def _repoint(self, views: list[torch.Tensor]) -> None:
        """Re-point the tensors still on their storage of `add` to `views` (a tensor the user
        gave new storage keeps it: its load copies it in)."""
        tensors, now = self._inventory.tensors, data_ptrs(self._inventory.tensors)
        still = [i for i, (p, q) in enumerate(zip(now, self._pointers_at_add)) if p == q]
        repoint([tensors[i] for i in still], [views[i] for i in still])


def _pieces(regions, files: list, layout) -> list[tuple[int, int, int]]:
    """(region, 0, its bytes) of each of `regions` with a file source, in file order."""
    found = [r for r in regions if files[r] is not None and layout.region_nbytes[r]]
    found.sort(key=lambda r: (files[r].path, files[r].offset))
    return [(r, 0, layout.region_nbytes[r]) for r in found]


def _take(pieces: list[tuple[int, int, int]], most: int):
    """The first `most` bytes of `pieces` (a piece cut where the bound falls), and the rest."""
    taken = []
    for index, (region, first, nbytes) in enumerate(pieces):
        if most <= 0:
            return taken, pieces[index:]
        if nbytes > most:
            rest = (region, first + most, nbytes - most)
            return [*taken, (region, first, most)], [rest, *pieces[index + 1:]]
        taken.append((region, first, nbytes))
        most -= nbytes
    return taken, []


class ReadBehind:
    """The queue of arriving masters of one scheduler and the thread that reads them (see the
    module docstring and [Note: the worker's lifetime]).

    Owns `_queue` (arrivals not yet read whole, the next first) and `_worker` (the thread that
    reads, or None), both guarded by `_lock`.  The queue is replaced, never edited in place, on
    the callers' threads: an interrupt leaves it as it was or as it is meant to be.  Re-entrant:
    a master collected while the lock is held abandons its arrival through its finaliser.
    """

    def __init__(self, part_nbytes: int) -> None:
        #: The most file bytes one part reads before the next arrival is chosen again.
        self._part_nbytes = part_nbytes
        self._lock = threading.RLock()
        self._queue: list[Arrival] = []
        self._worker: threading.Thread | None = None

    def master_for(self, name: str, inventory: Inventory, files: Sequence[FileSource | None],
                   transport: Transport, *, pin: bool) -> HostMaster:
        """A master of group `name` whose bytes arrive behind (`files`: each region's source,
        found by the caller); returns at once, the tensors left as they are."""
        sources = inventory.source_regions
        assert sources is not None, "an inventory is packed once"
        arrival = Arrival(self, name, inventory, sources, files, transport, pin)
        master = HostMaster.arriving(inventory, arrival)
        # An undone add stops its reads; a weak reference: a committed arrival is dropped.
        finalizer = weakref.finalize(master, self._abandon_if_alive, weakref.ref(arrival))
        finalizer.atexit = False
        locked(self._lock, self._enqueue, arrival)
        inventory.source_regions = None
        _log.info("group %r: reading its host master (%.1f MiB) from its weight files behind "
                  "the first phase", name, arrival.nbytes / 2**20)
        return master

    def hurry(self, arrival: Arrival) -> None:
        """Read `arrival` next (after the chunk in flight), a worker running to do it."""
        locked(self._lock, self._to_front, arrival)

    def abandon(self, arrival: Arrival) -> None:
        """Stop reading `arrival` (nobody will load its master); idempotent."""
        locked(self._lock, self._drop, arrival)

    def _abandon_if_alive(self, arrival: weakref.ref) -> None:
        arrival = arrival()
        if arrival is not None:
            self.abandon(arrival)

    # -- under the lock ------------------------------------------------------------------------

    def _enqueue(self, arrival: Arrival) -> None:
        self._queue = [*self._queue, arrival]
        self._ensure_worker()

    def _to_front(self, arrival: Arrival) -> None:
        if arrival in self._queue:
            self._queue = [arrival, *[a for a in self._queue if a is not arrival]]
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        """Start a worker unless one runs (one that was never started, or died, is replaced:
        the old one, if any, ends at its next `_next`)."""
        if self._queue and (self._worker is None or not self._worker.is_alive()):
            worker = threading.Thread(target=self._run, name="residency-arrive", daemon=True)
            self._worker = worker
            worker.start()

    def _drop(self, arrival: Arrival) -> None:
        arrival.abandoned = True  # first: the worker skips it from now on
        self._queue = [a for a in self._queue if a is not arrival]
        arrival.chunks = []  # the memory goes with the last reference (the chunk in flight)
        arrival.done.set()

    def _next(self) -> Arrival | None:
        """The arrival to read a chunk of, or None: this worker ends."""
        if self._worker is not threading.current_thread():
            return None  # replaced by another worker
        self._queue = [a for a in self._queue if not a.abandoned]
        if not self._queue:
            self._worker = None
            return None
        return self._queue[0]

    def _finished(self, arrival: Arrival) -> None:
        self._queue = [a for a in self._queue if a is not arrival]
        arrival.done.set()

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        with FileReader() as reader:
            while (arrival := locked(self._lock, self._next)) is not None:
                try:
                    finished = arrival.read_next_part(reader, self._part_nbytes)
                except BaseException as error:  # kept for `complete`: a typed error there
                    arrival.fail(error)
                    finished = True
                if finished or arrival.abandoned:
                    locked(self._lock, self._finished, arrival)
