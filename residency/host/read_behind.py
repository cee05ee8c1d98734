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
at a time.  A group's first load (`Residency.begin_load`, every path that copies a master to the
device) calls `Arrival.complete`: its group goes to the front of the queue (after the part in
flight of the group being read), the caller waits for its reads alone, and then the master is
committed.  So the first phase starts once its own group is in, and the other groups are read in
first-use order behind it, as long as groups are added in the order their phases come
(`residency.pipelines.discovery.register_groups` adds a pipeline's encoders, then its denoisers,
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
an interrupt) is cancelled: `cancel` is called by the group's removal, and by a finaliser when
the master is collected, so an undone registration stops its reads too; the worker finishes the
part in flight and drops the arrival.  A read that fails (an I/O error, host memory) is kept
and raised by every `complete`, as a `WeightFileError` or `HostMemoryError`: the group's tensors
are still the file views, with their values, and the group stays offloaded.  A file cut short
under them is the next note's.

[Note: a weight file cut short under an arriving master]
Until its commit a group's tensors are views of its files' mappings, and a file truncated under
them takes the pages past its new end (see [Note: a mapping whose file was cut short] in
file_reads.py): a tensor there kills the process (SIGBUS) when anything reads it.  So the files
are checked (`find_mapped_regions`: a stat per file, no tensor byte read) where the group's
bytes are next needed: at its first load, before the wait for its reads and again before the
commit copies anything, and when its group leaves (`remove`, `close`, and so `disable_offload`),
before the tensors are handed back.  A file found cut short is a loss, found once and kept
(`_Loss`):

- every tensor of the group that still views a file cut short is moved off the mapping: a
  tensor wholly before the file's end now is copied into plain host memory through
  /proc/self/mem (`copy_mapped`: a page cut meanwhile ends the copy, not the process); a tensor
  past it becomes a tensor of the meta device, same shape, stride and dtype; the master's views
  follow (`HostMaster.rehome`), so every owner still sees the group as packed;
- every load raises the loss as a `WeightFileError` that names the group, the file and its
  sizes, and the tensors lost (how many, their bytes, the first names); a group that leaves
  with a loss no load reported warns it once.  Nothing can bring the values back: the message
  says to load the pipeline again once the file is restored.

Why the meta device for a lost tensor, not zeros: zeros are values, and a pipeline run on them
gives a wrong image without a word; a meta tensor keeps the module's shape and state_dict keys
while every read of its data (a forward, ``.cpu()``, ``torch.equal``) raises torch's error, and a
re-pack refuses it (`take_inventory`: "on the meta device and holds no data"); the modules can
be rebuilt with ``to_empty`` and a state_dict from a restored file.  Moving such a module
(``.to(device)``) raises too.  The rescue is on the caller's thread under the scheduler lock,
like the commit (the worker never touches a tensor); it re-points the tensors still on their
storage of `add` and then the master's views, each on one line; an interrupt in between is
rolled forward.  A file replaced at its path keeps its mapping whole: that is no loss (its
regions are copied from the mapping at the commit, as before).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from collections.abc import Sequence

import attrs
import torch

from residency.core.errors import HostMemoryError, WeightFileError
from residency.host.file_reads import (
    FileReader,
    FileSource,
    copy_mapped,
    find_file_sources,
    find_loss,
    find_mapped_regions,
    replaced,
    tensor_end,
)
from residency.core.locks import in_context, locked
from residency.host.memory import (
    HostMaster,
    Progress,
    allocate_chunk,
    copy_region_into,
    refuse_cut_files,
    views_into_chunk,
)
from residency.modules.tensors import Inventory, data_ptrs, make_views, repoint
from residency.device.transport import Transport

__all__ = ["Arrival", "ReadBehind"]

_log = logging.getLogger("residency")

#: Seconds between redraws of the progress bar while a caller waits for a group's reads.
_REDRAW_S = 0.25


class Arrival:
    """One master's bytes on their way from the weight files (see the module docstring).

    The worker writes `chunks`, `pinned`, `read_nbytes` and, once, `failure` then `done`; the
    caller's thread reads them only after `done` is set.  `cancelled` is written by `cancel`.
    """

    def __init__(self, reads: ReadBehind, name: str, inventory: Inventory, sources: list,
                 files: Sequence, *, transport: Transport, pin: bool) -> None:
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
        #: What a weight file cut short took from the group, once found (the caller's: see
        #: [Note: a weight file cut short under an arriving master]); every load raises it.
        self._loss: _Loss | None = None
        self.done = threading.Event()
        self.cancelled = False
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
        if not self.cancelled:  # else the chunk goes with this frame
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
        self._refuse_if_cut_short(master)
        self._reads.hurry(self)
        self._wait()
        self._refuse_if_cut_short(master)
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

    def cancel(self, master: HostMaster | None = None) -> None:
        """Stop reading this master: nobody will load it (idempotent).  With `master` (its
        group leaves the scheduler), tensors on a weight file cut short are moved off its
        mapping first, with a warning unless a load raised the loss already (see [Note: a
        weight file cut short under an arriving master])."""
        if master is not None and master.arrival is self:
            loss = self._loss or self._find_loss()
            if loss is not None:
                if self._loss is None:
                    warnings.warn(loss.warning, RuntimeWarning, stacklevel=2)
                    self._loss = loss
                loss.rescue(self._inventory, master, self._pointers_at_add)
        self._reads.cancel(self)

    def _refuse_if_cut_short(self, master: HostMaster) -> None:
        """Raise the loss of a weight file cut short under the group (found now or before),
        its tensors moved off the file's mapping first; nothing while every file is whole."""
        if self._loss is None:
            loss = self._find_loss()
            if loss is None:
                return
            self._loss = loss
        self._reads.cancel(self)  # its reads are of no use now
        self._loss.rescue(self._inventory, master, self._pointers_at_add)
        raise self._loss.error

    def _find_loss(self) -> _Loss | None:
        return _Loss.find(self.name, self._inventory, self._sources, self._files, self.failure)

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


class _Loss:
    """What a weight file cut short took from the group of an arriving master, and where the
    group's tensors on that file live from now on (see [Note: a weight file cut short under an
    arriving master]).  Found once (`find`, on the caller's thread), then read only."""

    def __init__(self, error: WeightFileError, warning: str,
                 homes: dict[int, torch.Tensor]) -> None:
        #: What every load of the group raises from now on.
        self.error = error
        #: What the group's removal warns when no load raised `error`.
        self.warning = warning
        #: The new home of each tensor (inventory index) on a file cut short: a view of plain
        #: host memory holding its bytes; for a lost one a meta tensor (or, for one that cannot
        #: change device, zeros).
        self.homes = homes

    @classmethod
    def find(cls, name: str, inventory: Inventory, sources: list, files: Sequence,
             failure: BaseException | None) -> _Loss | None:
        """The loss of group `name` (its regions `sources` as at `add`, `files` their sources
        then, `failure` the reads' own), its survivors copied out; None: no file is cut short."""
        sizes = inventory.layout.region_nbytes
        found = find_mapped_regions(sources, sizes)
        if find_loss(inventory, found) is None:
            return None
        cut = {m.path for r, m in enumerate(found) if m is not None and m.readable < sizes[r]}
        moved = [r for r, m in enumerate(found) if m is not None and m.path in cut]
        homes, copied = _copied_out(name, inventory, sources, moved, found)
        loss = find_loss(inventory, found, readable=copied, known=files)
        zeros = sum(not homes[i].is_meta for i in loss.lost)
        lost = (f"{loss.tensors} lie past where it ends now: their values are lost (neither "
                "the file nor memory holds them). Those tensors are on the meta device now, so "
                f"reading one raises an error{_zeros_instead(zeros)}; the group's other "
                "tensors were copied into host memory. Load the pipeline again "
                "(from_pretrained) once the file is restored (download it again)")
        error = WeightFileError(f"cannot load group {name!r}: {loss.files} before the "
                                f"group's first load, so {lost}; until then every load of group "
                                f"{name!r} raises this error")
        error.__cause__ = failure
        warning = f"group {name!r} left the scheduler after {loss.files}: {lost}"
        return cls(error, warning, homes)

    def rescue(self, inventory: Inventory, master: HostMaster, pointers_at_add: list[int]
               ) -> None:
        """Move each tensor of `homes` still on its storage of `add` to its home (re-pointed,
        or swapped for a meta tensor), then make the homes the master's views; repeatable (an
        interrupted one is rolled forward)."""
        try:
            self._rescue(inventory, master, pointers_at_add)
        except BaseException:  # see [Note: a weight file cut short under an arriving master]
            self._rescue(inventory, master, pointers_at_add)
            raise

    def _rescue(self, inventory: Inventory, master: HostMaster, pointers_at_add: list[int]
                ) -> None:
        tensors, now = inventory.tensors, data_ptrs(inventory.tensors)
        still = [i for i in self.homes if now[i] == pointers_at_add[i]]
        views = [self.homes.get(i, view) for i, view in enumerate(master.views)]
        kept = [i for i in still if not self.homes[i].is_meta]
        repoint([tensors[i] for i in kept], [self.homes[i] for i in kept])
        for i in still:
            if self.homes[i].is_meta:  # one call each: a swapped tensor is no longer `still`
                torch.utils.swap_tensors(tensors[i], _meta_twin(tensors[i]))
        master.rehome(views)


def _copied_out(name: str, inventory: Inventory, sources: list, regions: list[int],
                found: list) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """The new homes of the tensors of `regions` (views of host memory holding the bytes the
    region's mapping still gives; past them, meta tensors, or zeros for a tensor that cannot
    be swapped), and the bytes copied of each region."""
    homes: dict[int, torch.Tensor] = {}
    copied: dict[int, int] = {}
    for region in regions:
        nbytes = inventory.layout.region_nbytes[region]
        buffer = _host_zeros(name, nbytes)
        copied[region] = copy_mapped(sources[region], found[region].readable, buffer)
        members = inventory.tensors_in_regions([region])
        views = make_views([inventory.places[i] for i in members], buffer.untyped_storage(),
                           {region: 0}, buffer.device)
        for i, view in zip(members, views):
            past = tensor_end(inventory.places[i]) > copied[region]
            homes[i] = _meta_like(view) if past and _can_swap(inventory.tensors[i]) else view
    return homes, copied


def _host_zeros(name: str, nbytes: int) -> torch.Tensor:
    """Plain host memory for a region copied off a file cut short (a typed error if none)."""
    try:
        return in_context(torch.inference_mode(False), torch.zeros, nbytes, dtype=torch.uint8)
    except (MemoryError, RuntimeError) as error:
        raise HostMemoryError(
            f"cannot copy the tensors of group {name!r} off its weight file cut short: {nbytes} "
            f"bytes of host memory could not be allocated ({error}). Free host memory and try "
            "again; until then its tensors view the file, and reading one past its end kills "
            "the process (SIGBUS)") from error


def _can_swap(tensor: torch.Tensor) -> bool:
    """Whether `torch.utils.swap_tensors` can give `tensor` (the object the modules hold) a
    meta twin's contents: a plain tensor or Parameter that nothing else references (no weak
    reference, no other owner of its implementation, such as an autograd graph)."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and not weakref.getweakrefs(tensor) and tensor._use_count() == 1)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `tensor`'s shape, strides and dtype: a lost tensor's home."""
    return in_context(torch.inference_mode(False), torch.empty_strided, tensor.shape,
                      tensor.stride(), dtype=tensor.dtype, device="meta")


def _meta_twin(tensor: torch.Tensor) -> torch.Tensor:
    """What `tensor` is swapped with: a meta tensor of its class, shape, strides, dtype and
    ``requires_grad``."""
    meta = _meta_like(tensor)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta.requires_grad_(tensor.requires_grad)


def _zeros_instead(count: int) -> str:
    if not count:
        return ""
    return (f" ({count} of them, referenced elsewhere too, could not change device and hold "
            "zeros instead)")


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
                   transport: Transport, *, pin: bool, mapped: list | None = None) -> HostMaster:
        """A master of group `name` whose bytes arrive behind (`files`: each region's source,
        found by the caller; `mapped`: their mappings, when found in the same look); returns at
        once, the tensors left as they are."""
        sources = inventory.source_regions
        assert sources is not None, "an inventory is packed once"
        refuse_cut_files(inventory, mapped)
        arrival = Arrival(self, name, inventory, sources, files, transport=transport, pin=pin)
        master = HostMaster.arriving(inventory, arrival)
        # An undone add stops its reads; a weak reference: a committed arrival is dropped.
        finalizer = weakref.finalize(master, self._cancel_if_alive, weakref.ref(arrival))
        finalizer.atexit = False
        locked(self._lock, self._enqueue, arrival)
        inventory.source_regions = None
        _log.info("group %r: reading its host master (%.1f MiB) from its weight files behind "
                  "the first phase", name, arrival.nbytes / 2**20)
        return master

    def hurry(self, arrival: Arrival) -> None:
        """Read `arrival` next (after the chunk in flight), a worker running to do it."""
        locked(self._lock, self._to_front, arrival)

    def cancel(self, arrival: Arrival) -> None:
        """Stop reading `arrival` (nobody will load its master); idempotent."""
        locked(self._lock, self._cancel_locked, arrival)

    def _cancel_if_alive(self, arrival: weakref.ref) -> None:
        arrival = arrival()
        if arrival is not None:
            self.cancel(arrival)

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

    def _cancel_locked(self, arrival: Arrival) -> None:
        arrival.cancelled = True  # first: the worker skips it from now on
        self._queue = [a for a in self._queue if a is not arrival]
        arrival.chunks = []  # the memory goes with the last reference (the chunk in flight)
        arrival.done.set()

    def _next(self) -> Arrival | None:
        """The arrival to read a chunk of, or None: this worker ends."""
        if self._worker is not threading.current_thread():
            return None  # replaced by another worker
        self._queue = [a for a in self._queue if not a.cancelled]
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
                if finished or arrival.cancelled:
                    locked(self._lock, self._finished, arrival)
