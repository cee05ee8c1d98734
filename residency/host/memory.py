"""Where a component's bytes live on the host: the host master (persistent).

`HostMaster` — the packed host copy of a component's unique tensors, built once at registration
and kept for the session: about 1x the weights (alignment padding aside), pinned when an
accelerator is present.  Offloaded tensors are views of it.

[Note: building the master without 2x host memory]
The master is allocated and filled one chunk at a time, and the tensors of each chunk are re-pointed
to it as soon as it is full, which drops the last reference to their original storages.  At any
moment the process holds the weights once plus at most one chunk.

[Note: reading regions from their files]
A region still untouched in a private mapping of its safetensors file (``from_pretrained``'s
parameters) is read from the file into its chunk by `FileReader`'s threads, while this thread
copies the chunk's other regions; copying from the mapping instead would fault in every page on
one thread, each mapped into the process (and counted in its memory) until the re-point.  The
chunk's tensors are re-pointed only after its reads finished (`FileReader.finish`), so the rule
above holds: a failed or interrupted read leaves them views of the file, with their values.  An
edited region is never read (see [Note: which mapped bytes are still the file's] in
residency/host/file_reads.py).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import warnings
from collections.abc import Sequence

import attrs
import torch

from residency.core.errors import WeightFileError
from residency.host.file_reads import (
    FileReader, FileSource, find_loss, find_mapped_regions, look_up_files,
)
from residency.modules.tensors import Inventory, data_ptrs, make_views, repoint
from residency.device.host_memory import host_memory
from residency.device.transport import Transport
from residency.options.budget import format_nbytes

__all__ = [
    "HostMaster", "HostUsage", "PROGRESS_THRESHOLD", "Progress",
    "allocate_chunk", "copy_region_into", "refuse_cut_files", "views_into_chunk",
]

#: Building a host master larger than this shows progress (registration of many GiB takes seconds).
PROGRESS_THRESHOLD = 2**30

_log = logging.getLogger("residency")
_size = functools.partial(format_nbytes, digits=1)


@attrs.frozen(kw_only=True)
class HostUsage:
    """The host bytes a scheduler's masters hold (`Scheduler.host_usage`).

        usage = scheduler.host_usage
        usage.requested, usage.pinned      # every master's bytes; of those, page-locked
        print(usage.describe())            # "host masters: 1.2 GiB requested, 1.2 GiB pinned"

    `requested` is every master's chunks as allocated (each chunk once): on CUDA a pinned
    master is page-locked at exactly that size ([Note: exact-size pinned memory] in
    `residency.device.transport`), where PyTorch's pinned allocator would round each request
    up to a power of two.  `pinned` is the page-locked part, `file_backed` the part in files of
    the host tier (paged in as loads need it), `shared` the part in node-shared segments (one
    copy per host, counted by each rank).
    """

    requested: int
    pinned: int
    file_backed: int
    shared: int

    @classmethod
    def of(cls, masters) -> HostUsage:
        """The usage of `masters` (`HostMaster` objects, each chunk counted once)."""
        seen: set[tuple[int, int]] = set()
        totals = dict.fromkeys(("requested", "pinned", "file_backed", "shared"), 0)
        for master in masters:
            for chunk in master.chunks:
                if (chunk.data_ptr(), chunk.nbytes) in seen:
                    continue
                seen.add((chunk.data_ptr(), chunk.nbytes))
                nbytes = chunk.nbytes
                totals["requested"] += nbytes
                totals["pinned"] += nbytes if master.pinned else 0
                totals["file_backed"] += nbytes if master.spill is not None else 0
                totals["shared"] += nbytes if master.shared_group is not None else 0
        return cls(**totals)

    def describe(self) -> str:
        """One line: requested and pinned, and what is file-backed or shared when any is."""
        from_files = (f", {_size(self.file_backed)} file-backed" if self.file_backed else "")
        shared = f", {_size(self.shared)} node-shared" if self.shared else ""
        return (f"host masters: {_size(self.requested)} requested, {_size(self.pinned)} "
                f"pinned{from_files}{shared}")


class HostMaster:
    """The packed, persistent host copy of one component: a few chunks, one view per unique tensor.

    Build it with `HostMaster.pack(inventory, ...)`, which also re-points the tensors to it.
    """

    def __init__(self, chunks: list[torch.Tensor], views: list[torch.Tensor], pinned: bool):
        #: uint8 host tensors, one per chunk of the layout (none yet while arriving).
        self.chunks = chunks
        #: One view per unique tensor of the inventory, in inventory order: each tensor's home
        #: while offloaded (while arriving: the tensor's own storage of `add`).
        self.views = views
        #: The views' data pointers (a tensor whose pointer differs was given new storage).
        self.view_ptrs = data_ptrs(views)
        #: Whether every chunk is page-locked.
        self.pinned = pinned
        #: The node group whose ranks share these bytes (a node-shared segment), or None for a
        #: master of this process alone.  Writes to a shared master are agreed by its ranks.
        self.shared_group = None
        #: The file of ours this master's chunks are slices of (`residency.host.host_tier`:
        #: a host smaller than the model), or None: private memory or a node-shared segment.
        self.spill = None
        #: The reads still filling the chunks from weight files (`residency.host.read_behind`:
        #: a master read behind the first phase), or None: the bytes are in.  The group's first
        #: load completes it (`Arrival.complete`), which then calls `arrived`.
        self.arrival = None

    @classmethod
    def arriving(cls, inventory: Inventory, arrival) -> HostMaster:
        """A master whose bytes are still being read (`arrival`); until they are in, each
        tensor's home is its own storage, so nothing is re-pointed here."""
        master = cls([], [tensor.detach() for tensor in inventory.tensors], pinned=False)
        master.arrival = arrival
        return master

    @property
    def still_reading(self) -> bool:
        """Whether its bytes are still being read from weight files (an arriving master whose
        reads have not ended); a load of it would wait for them."""
        return self.arrival is not None and not self.arrival.done.is_set()

    def cancel_reads(self) -> None:
        """Stop the reads of an arriving master nobody will load (its group left the scheduler,
        or was re-packed): its tensors stay where they were, with their values - unless a
        weight file was cut short under them, when they are moved off its mapping first
        (`residency.host.read_behind`, [Note: a weight file cut short under an arriving
        master])."""
        if self.arrival is not None:
            self.arrival.cancel(self)

    def rehome(self, views: list[torch.Tensor]) -> None:
        """While arriving: the tensors' homes are `views` now (a weight file was cut short
        under them, and `residency.host.read_behind` moved them off its mapping); one line."""
        self.views, self.view_ptrs = views, data_ptrs(views)

    def arrived(self, chunks: list[torch.Tensor], views: list[torch.Tensor], pinned: bool) -> None:
        """Take the chunks an arrival filled and the views the tensors now read (the commit of
        `Arrival.complete`: one line)."""
        self.chunks, self.views, self.view_ptrs, self.pinned, self.arrival = (
            chunks, views, data_ptrs(views), pinned, None)

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)

    @classmethod
    def pack(
        cls,
        inventory: Inventory,
        transport: Transport,
        *,
        pin: bool,
        into: torch.Tensor | None = None,
        files: Sequence[FileSource | None] | None = None,
        mapped: list | None = None,
        room_checked: bool = False,
    ) -> HostMaster:
        """Copy the inventory's tensors into a new master, chunk by chunk, re-pointing as it goes.

        A region whose bytes are still a weight file's (`find_file_sources`) is read from the
        file (see [Note: reading regions from their files]); the others are copied from memory.

        `into` (a uint8 host buffer of ``layout.contiguous_nbytes``: a node-shared segment) holds
        the chunks, laid out as in device storage, instead of memory allocated per chunk.
        `files`: each region's `FileSource` or None, when the caller has found them already
        (`find_file_sources` of the inventory's sources: found here when not given, from the
        same look at the mappings as the check for cut files); `mapped`: their
        `find_mapped_regions`, when the caller found them with the files.  `room_checked`: the
        caller has just checked the process's room for the whole master (`check_host_room`), so
        the first chunk's allocation does not read it again.
        """
        layout = inventory.layout
        sources = inventory.source_regions
        assert sources is not None, "an inventory is packed once"
        if files is None:
            mapped, files = look_up_files(sources, layout.region_nbytes)
        refuse_cut_files(inventory, mapped)
        chunks: list[torch.Tensor] = []
        views: list[torch.Tensor | None] = [None] * inventory.tensor_count
        verb = "reading" if any(files) else "pinning" if pin else "packing"
        progress = Progress(layout.nbytes, verb=f"{verb} host master")
        with FileReader() as reader:
            for chunk_index, nbytes in enumerate(layout.chunk_nbytes):
                if into is None:
                    chunk, pin = allocate_chunk(transport, nbytes, pin,
                                                room_checked=room_checked and not chunks)
                else:
                    base = layout.chunk_base[chunk_index]
                    chunk = into[base : base + nbytes]
                chunks.append(chunk)
                regions = inventory.regions_in_chunk(chunk_index)
                _fill_chunk(chunk, regions, layout, sources, files, reader)
                _repoint_chunk(inventory, regions, chunk, views)
                progress.advance(nbytes)
        progress.close()
        inventory.source_regions = None
        if inventory.wrappers is not None:  # a wrapper registered on an accelerator gets a host twin
            inventory.wrappers.follow(chunks[0].device)
        return cls(chunks, views, pinned=pin)  # type: ignore[arg-type]

    @classmethod
    def attach(cls, inventory: Inventory, shared: torch.Tensor, *, pinned: bool) -> HostMaster:
        """A master over bytes another process packed into `shared` (a node-shared segment laid
        out as `pack(..., into=shared)` lays it); re-points the inventory's tensors to it, which
        drops their own storages.  The bytes must equal the tensors' (the ranks checked)."""
        layout = inventory.layout
        chunks = [shared[base : base + n] for base, n in zip(layout.chunk_base, layout.chunk_nbytes)]
        views: list[torch.Tensor | None] = [None] * inventory.tensor_count
        for chunk_index, chunk in enumerate(chunks):
            _repoint_chunk(inventory, inventory.regions_in_chunk(chunk_index), chunk, views)
        inventory.source_regions = None
        if inventory.wrappers is not None:
            inventory.wrappers.follow(shared.device)
        return cls(chunks, views, pinned=pinned)  # type: ignore[arg-type]

    @classmethod
    def over_chunks(cls, inventory: Inventory, chunks: list[torch.Tensor], *, pinned: bool):
        """A master over `chunks` that already hold the inventory's bytes in its layout (a
        warm-restart cache file, mapped: `residency.host.master_cache`); re-points the
        tensors to them, as `attach` does."""
        views: list[torch.Tensor | None] = [None] * inventory.tensor_count
        for chunk_index, chunk in enumerate(chunks):
            _repoint_chunk(inventory, inventory.regions_in_chunk(chunk_index), chunk, views)
        inventory.source_regions = None
        if inventory.wrappers is not None:
            inventory.wrappers.follow(chunks[0].device)
        return cls(chunks, views, pinned=pinned)  # type: ignore[arg-type]


class Progress:
    """Shows progress of building a master over `PROGRESS_THRESHOLD` bytes.

    On a terminal: a one-line bar on stderr, redrawn in place.  Otherwise: a log line per 10%.
    Smaller masters build silently.

        progress = Progress(nbytes, verb="reading host master")
    """

    def __init__(self, total: int, *, verb: str) -> None:
        self.total, self.done, self.logged_tenth = total, 0, 0
        self.enabled = total > PROGRESS_THRESHOLD
        self.verb = verb
        self.bar = self.enabled and sys.stderr.isatty()
        self.started = time.perf_counter()

    def advance(self, nbytes: int) -> None:
        if not self.enabled:
            return
        self.done += nbytes
        if self.bar:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(
                f"\rresidency: {self.verb} [{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done / 2**30:.1f}/{self.total / 2**30:.1f} GiB"
            )
            sys.stderr.flush()
            return
        tenth = int(10 * self.done / self.total)
        if tenth > self.logged_tenth:
            self.logged_tenth = tenth
            _log.info("%s: %d%% of %.1f GiB", self.verb, tenth * 10, self.total / 2**30)

    def close(self) -> None:
        if self.bar:
            seconds = time.perf_counter() - self.started
            sys.stderr.write(f" done in {seconds:.1f} s\n")


def refuse_cut_files(inventory: Inventory, mapped: list | None = None) -> None:
    """Refuse to pack `inventory` when a weight file its tensors view was cut short under them
    (see [Note: a mapping whose file was cut short] in residency/host/file_reads.py): a
    `WeightFileError` naming the file and the tensors lost, before any byte is read; nothing
    changes.  `mapped`: its regions' `find_mapped_regions`, when the caller looked already.

        refuse_cut_files(inventory)    # HostMaster.pack, ReadBehind.master_for
    """
    sources = inventory.source_regions
    if mapped is None:
        mapped = find_mapped_regions(sources, inventory.layout.region_nbytes)
    loss = find_loss(inventory, mapped)
    if loss is not None:
        raise WeightFileError(
            f"{loss.files} since the tensors were loaded from it: {loss.tensors} lie past "
            "where it ends now, so their values are lost, and reading one would kill the "
            "process (SIGBUS). Load the pipeline (or the model) again once the file is "
            "restored (download it again); nothing was offloaded"
        )


@torch.inference_mode(False)
def allocate_chunk(transport: Transport, nbytes: int, pin: bool, *,
                   room_checked: bool = False) -> tuple[torch.Tensor, bool]:
    """A host chunk; falls back to pageable memory with one warning when pinning fails.

    Always a normal tensor, even when registration runs under ``torch.inference_mode()``: the
    master is written again (write-back) long after that mode has ended.  A chunk that would pass
    the process's memory cgroup limit is refused with `MemoryError` before it is allocated
    ([Note: the limit that kills] in `residency.device.host_memory`), unless `room_checked`: the
    caller has just checked the room for at least `nbytes` (`check_host_room`).
    """
    memory = None if room_checked else host_memory()
    room = None if memory is None else memory.cgroup_room
    if room is not None and nbytes > room:
        raise MemoryError(
            f"a chunk of {nbytes / 2**20:.1f} MiB would pass this process's memory cgroup limit "
            f"(room for {memory.describe()}); raise the container's memory limit, or let the "
            "masters be file-backed (host={'memory_limit': ...})")
    if not pin:
        return transport.allocate_host(nbytes, pin=False), False
    try:
        return transport.allocate_host(nbytes, pin=True), True
    except RuntimeError as error:
        warnings.warn(
            f"pinning {nbytes} bytes of host memory failed ({error}); using pageable memory "
            "instead, so transfers will be slower. Raise the locked-memory limit (ulimit -l) or "
            "pass pin_memory=False to choose pageable memory and silence this warning.",
            RuntimeWarning,
            stacklevel=4,
        )
        return transport.allocate_host(nbytes, pin=False), False


def _fill_chunk(
    chunk: torch.Tensor,
    regions: Sequence[int],
    layout,
    sources: list,
    files: list[FileSource | None],
    reader: FileReader,
) -> None:
    """Fill `chunk` with `regions`: those with a file source read from it on the reader's threads
    while the others are copied here; returns once every byte is in (drops the sources)."""
    offsets, sizes = layout.region_offset, layout.region_nbytes
    reader.start(chunk, [(files[r], offsets[r], sizes[r]) for r in regions if files[r] is not None])
    for region in regions:
        if files[region] is None:
            copy_region_into(chunk, offsets[region], sources[region], sizes[region])
    reader.finish()
    for region in regions:
        sources[region] = None


def copy_region_into(chunk: torch.Tensor, offset: int, source, nbytes: int) -> None:
    """Copy `nbytes` of region `source` (its storage and first byte) to `chunk[offset:]`."""
    storage, first = source
    if nbytes == 0:
        return
    source_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device)
    source_bytes.set_(storage, first, (nbytes,))
    chunk[offset : offset + nbytes].copy_(source_bytes)


def _repoint_chunk(inventory: Inventory, regions, chunk: torch.Tensor, views: list) -> None:
    """Re-point the tensors of `regions` (all in `chunk`) to views of it; record the views."""
    members = inventory.tensors_in_regions(regions)
    chunk_views = views_into_chunk(inventory, members, chunk)
    repoint([inventory.tensors[i] for i in members], chunk_views)
    for i, view in zip(members, chunk_views):
        views[i] = view


def views_into_chunk(
    inventory: Inventory, members: Sequence[int], chunk: torch.Tensor
) -> list[torch.Tensor]:
    """Views of `chunk` for the tensors `members`.  A chunk may be a slice of a larger buffer (a
    node-shared segment holds every chunk end to end), so the offsets start at its own."""
    places = [inventory.places[i] for i in members]
    first = chunk.storage_offset()
    region_base = [first + offset for offset in inventory.layout.region_offset]
    return make_views(places, chunk.untyped_storage(), region_base, chunk.device)
