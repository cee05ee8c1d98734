"""Packing: building a group's inventory and host master, for registration and for re-packing.

    packer = Packer(transport, device=torch.device("cpu"), chunk_nbytes=2**28, pin_memory=False)
    inventory = packer.inventory([model], excluded=())
    master = packer.pack("dit", inventory)          # re-points model's tensors to the master

One answer to "how is a host master built?": the inventory laid out for the device's alignment
(`residency.modules.tensors.alignment_for`), the copy into fresh host memory chunk by chunk, pinned when it
can be, and the typed error when host memory runs out.

[Note: the pin fallback]
``pin_memory`` starts as the scheduler was told (or as the transport can); the first time pinning
fails (a locked-memory limit), `HostMaster.pack` warns and falls back to pageable memory, and the
packer turns ``pin_memory`` off so later groups do not try (and warn) again.  The flag is a single
attribute written by whichever thread packs; a racing reader sees either value, and both are safe.

[Note: one host copy per node]
With a node view (``Scheduler(process_group=...)``, several ranks on one host), packing is
collective over the node's ranks, in the same order on every rank: the ranks first compare their
tensors (layout and a digest of the bytes, `residency.multirank.agreement.compare_weights`); if they hold the
same weights, the node's leader packs them into one node-shared segment
(`residency.multirank.shared_memory.share_segment`), and after a barrier every other rank re-points its
tensors to views of the same pages, dropping its own copy: host memory per node is the weights
once.  Weights that differ (tensor-parallel shards) are never shared: each rank keeps its own
master, and the log says why.

[Note: the warm-restart cache in packing]
With ``host.cache_directory`` set, a group whose tensors are (nearly all) untouched views of weight
files (`residency.host.file_reads`) has a cache key (`residency.host.master_cache.group_key`).
A cache file of that key is mapped copy-on-write instead of packing, and the tensors are
re-pointed into the mapping (`HostMaster.over_chunks`); on CUDA, with pinning on, the mapping is
page-locked for DMA.  On a miss the group is packed as usual and the master written to the cache
for the next start.  The directory is created at its first use, not checked at construction: a
cache is an optimisation, so a directory that cannot be created or written warns once and the
scheduler goes on without a cache (a typed error at construction would stop a run that can go on
perfectly well).  A node-shared master (several ranks of one host) is not cached yet: the ranks
would have to agree on the hit or the miss, collectively; it is left for later.  Regions read
from the cache directory itself (a group re-packed while mapped from a cache file) do not count
as weight files: a cache is never keyed by another cache.

[Note: reading behind the first phase]
With ``host.background_reads``, a group whose regions are (partly) still views of weight files
gets a master that arrives behind (`residency.host.read_behind`): `pack` returns at once, the
tensors untouched, and the packer's `ReadBehind` reads the files on its thread, groups in the
order they were added; the group's first load waits for its own bytes only.  Not read behind,
packed at `add` as before: a group another rank shares (the node's ranks pack collectively), a
file-backed master of the host tier (packed into its file), a group the warm-restart cache maps
or writes (a hit needs no read; a miss writes the master's final bytes, which only a commit
knows), a group of tensor subclasses (re-pointing a wrapper rebuilds it), and a group with no
region in a weight file (nothing to read: its copy from memory is the pack).
"""

from __future__ import annotations

import ctypes
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from residency.multirank.agreement import compare_weights, describe_tensors
from residency.core.errors import HostMemoryError, RegistrationError
from residency.host.file_reads import look_up_files
from residency.options.host_options import HostOptions
from residency.host.host_tier import HostTier
from residency.host.master_cache import (
    MappedMaster,
    cache_path,
    group_key,
    map_master,
    prepare_directory,
    write_master,
)
from residency.host.memory import HostMaster
from residency.host.read_behind import ReadBehind
from residency.multirank.node import NodeView
from residency.multirank.shared_memory import share_segment
from residency.modules.tensors import Inventory, alignment_for, take_inventory
from residency.device.host_memory import host_memory
from residency.device.transport import Transport
from residency.options.budget import format_nbytes

__all__ = ["Packer", "check_host_room", "host_room_error"]

_log = logging.getLogger("residency")


class Packer:
    """Builds inventories and host masters for one scheduler (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        *,
        device: torch.device,
        chunk_nbytes: int,
        pin_memory: bool,
        node: NodeView | None = None,
        host: HostOptions | None = None,
    ) -> None:
        self._transport = transport
        #: Where masters live beyond private memory: the cache and the host memory limit.
        self.host = host if host is not None else HostOptions()
        #: Which masters are file-backed beyond ``memory_limit``, and whose pages are in
        #: (`residency.host.host_tier`); None without a limit.
        self.tier = HostTier.for_options(self.host, accelerator=transport.can_pin())
        #: With ``spill_directory`` and no ``memory_limit``: the tier of the masters the process
        #: had no room for, made at the first (`_spill_past_room`); else None.
        self._spill_tier: HostTier | None = None
        #: The ranks of this host, when several share host masters (see [Note: one host copy per
        #: node]); None for a single process.
        self._node = node if node is not None and node.local_world_size > 1 else None
        self._alignment = alignment_for(device)
        self.chunk_nbytes = chunk_nbytes
        #: Pin host masters; see [Note: the pin fallback].
        self.pin_memory = pin_memory
        #: Whether the cache directory is usable: None until its first use, then True or False
        #: (see [Note: the warm-restart cache in packing]).
        self._cache_usable: bool | None = None
        #: The masters read behind the first phase, and the thread reading them (see [Note:
        #: reading behind the first phase]).
        self._reads = ReadBehind(part_nbytes=chunk_nbytes)

    def inventory(
        self,
        roots: tuple[nn.Module, ...],
        excluded: tuple[nn.Module, ...],
        *,
        allow_empty: bool = False,
    ) -> Inventory:
        """The unique tensors of `roots` (less `excluded`), laid out for the device (empty
        only with `allow_empty`)."""
        return take_inventory(roots, chunk_nbytes=self.chunk_nbytes, exclude=excluded,
                              alignment=self._alignment, allow_empty=allow_empty)

    @property
    def node(self) -> NodeView | None:
        """The ranks of this host sharing masters, or None (one process)."""
        return self._node

    def pack(self, name: str, inventory: Inventory, *, require_shared: str | None = None) -> HostMaster:
        """A new host master for group `name`; its tensors are re-pointed to it as it fills.

        Collective over the node's ranks when they share masters (see [Note: one host copy per
        node]).  `require_shared` names why the master must be shared (``"weight_transfer=
        'allgather'"``): weights that differ then raise `RegistrationError` on every rank.
        """
        if self._node is not None:
            shared = self._pack_shared(name, inventory, require_shared)
            if shared is not None:
                return shared
        tier = self.tier
        if tier is not None and tier.file_backs(name, inventory):  # host smaller than the model
            return tier.pack(name, inventory, self._transport)
        if tier is None and self.host.spill_directory is not None and self._node is None:
            spilled = self._spill_past_room(name, inventory)
            if spilled is not None:
                return spilled
        files = mapped = cached = None
        if self._caching(inventory):
            mapped, files = self._look_up_files(inventory)
            cached = self._cache_entry(name, inventory, files)
        if cached is not None:
            from_cache = self._map_cached(name, inventory, *cached)
            if from_cache is not None:
                return from_cache
        elif self.host.background_reads and inventory.wrappers is None:
            if files is None:  # one look at the mappings serves the cut-file check too
                mapped, files = look_up_files(inventory.source_regions,
                                              inventory.layout.region_nbytes)
            if any(files):  # see [Note: reading behind the first phase]
                check_host_room(name, inventory.layout.nbytes)
                return self._reads.master_for(name, inventory, files, self._transport,
                                              pin=self.pin_memory, mapped=mapped)
        master = self._pack_private(name, inventory, files, mapped)
        if cached is not None and write_master(cached[0], cached[1], inventory.layout,
                                               master.chunks):
            _log.info("group %r: host master written to the warm-restart cache %s", name,
                      cached[0])
        return master

    def _spill_past_room(self, name: str, inventory: Inventory) -> HostMaster | None:
        """With ``spill_directory`` and no ``memory_limit``: a master the process has no room
        for (`check_host_room`) is file-backed there instead of refused; None when it fits in
        memory.  The masters it spills share one tier, whose limit is the room the process had
        at the first, with that group's bytes (its tensors are freed once they point at the
        master, unless the caller keeps them): their pages are paged in and dropped within it,
        and beyond it the kernel reclaims them (clean file pages), never the OOM killer."""
        nbytes = inventory.layout.nbytes
        if host_room_error(name, nbytes) is None:
            return None
        if self._spill_tier is None:
            room, source = host_memory().room()
            self._spill_tier = HostTier((room or 0) + nbytes, self.host.spill_directory,
                                        "spill_directory", accelerator=self._transport.can_pin())
            _log.warning("host memory is short (%s leaves %s): host masters that do not fit "
                         "are file-backed in %s", source, format_nbytes(room or 0),
                         self.host.spill_directory)
        return self._spill_tier.pack(name, inventory, self._transport)

    def _pack_private(self, name: str, inventory: Inventory, files, mapped) -> HostMaster:
        """A master of this process's own memory, pinned when it can be; `files` and `mapped`:
        the regions' file sources and mappings when found already (else `HostMaster.pack` finds
        them)."""
        check_host_room(name, inventory.layout.nbytes)
        try:
            master = HostMaster.pack(inventory, self._transport, pin=self.pin_memory, files=files,
                                     mapped=mapped, room_checked=True)
        except MemoryError as error:
            nbytes = inventory.layout.nbytes
            raise HostMemoryError(
                f"cannot add group {name!r}: its host master needs {nbytes} bytes "
                f"({nbytes / 2**20:.1f} MiB) of host memory and the allocation failed ({error}). "
                "Free host memory or register fewer modules at once; the weights keep their values"
            ) from error
        if self.pin_memory and not master.pinned:
            self.pin_memory = False
            _log.warning("pinning failed; later host masters of this scheduler are pageable")
        return master

    def _caching(self, inventory: Inventory) -> bool:
        """Whether this group may use the cache (see [Note: the warm-restart cache in
        packing]): a directory is set and usable, one process, some bytes."""
        directory = self.host.cache_directory
        if directory is None or self._node is not None or inventory.layout.nbytes == 0:
            return False
        return self._cache_ready(directory)

    def _look_up_files(self, inventory: Inventory) -> tuple[list, list]:
        """Each region's mapping and weight file (`look_up_files`: one look at the mappings
        serves the cut-file check and the cache's key); regions read from the cache directory
        itself count as no file (a cache is never keyed by another cache)."""
        mapped, sources = look_up_files(inventory.source_regions, inventory.layout.region_nbytes)
        inside = os.path.realpath(self.host.cache_directory) + os.sep
        return mapped, [None if s is not None and os.path.realpath(s.path).startswith(inside)
                        else s for s in sources]

    def _cache_entry(self, name: str, inventory: Inventory, files: list
                     ) -> tuple[Path, str] | None:
        """(cache file, key) of group `name`, or None when it is not cached (logged why)."""
        key, why = group_key(inventory, self._alignment, files)
        if key is None:
            _log.info("group %r is not cached for a warm restart: %s", name, why)
            return None
        return cache_path(self.host.cache_directory, name, key), key

    def _cache_ready(self, directory: Path) -> bool:
        """Whether the cache directory is usable (created at the first use; warns once if not)."""
        if self._cache_usable is None:
            problem = prepare_directory(directory)
            if problem is not None:
                warnings.warn(
                    f"cache_directory {str(directory)!r} cannot be used: {problem}. This "
                    "scheduler goes on without a warm-restart cache; give a writable directory "
                    "to use one",
                    RuntimeWarning,
                    stacklevel=5,
                )
            self._cache_usable = problem is None
        return self._cache_usable

    def _map_cached(self, name: str, inventory: Inventory, path: Path, key: str
                    ) -> HostMaster | None:
        """The master of group `name` over its cache file mapped, or None on a miss."""
        mapped = map_master(path, key, inventory.layout)
        if mapped is None:
            return None
        pinned = self._page_lock(mapped)
        master = HostMaster.over_chunks(inventory, mapped.chunks, pinned=pinned)
        _log.info("group %r: host master mapped from the warm-restart cache %s", name, path)
        return master

    def _page_lock(self, mapped: MappedMaster) -> bool:
        """Page-lock a mapped master on CUDA when pinning is on; False where it stays pageable."""
        if not (self.pin_memory and self._transport.device.type == "cuda"):
            return False
        try:
            mapped.page_lock()
        except RuntimeError as error:
            _log.warning("the mapped host master %s stays pageable: %s", mapped.path, error)
            return False
        return True

    def _pack_shared(
        self, name: str, inventory: Inventory, require: str | None
    ) -> HostMaster | None:
        """The node-shared master of group `name`, or None when the ranks' weights differ."""
        group = self._node.group
        named = [(f"{i}: {slots[0].describe()}", tensor)
                 for i, (tensor, slots) in enumerate(zip(inventory.tensors, inventory.slots))]
        verdict = compare_weights(name, describe_tensors(named), inventory.tensors, group,
                                  require=require)
        if not verdict.identical:
            _log.info("group %r: %s; each rank keeps its own host master", name,
                      verdict.describe())
            return None
        segment = share_segment(inventory.layout.contiguous_nbytes, group)
        leader = segment.local_rank == 0
        if leader:
            master = HostMaster.pack(inventory, self._transport, pin=False, into=segment.tensor)
        _barrier(group, name)  # the leader's bytes are in the pages before the others map them
        if not leader:
            master = HostMaster.attach(inventory, segment.tensor, pinned=False)
        if self.pin_memory and self._transport.can_pin():
            segment.page_lock()
            master.pinned = True
        master.shared_group = group
        _return_freed_memory()
        return master


def _barrier(group: object, name: str) -> None:
    """Wait for every rank of the node; a rank that died (or timed out) is a typed error."""
    try:
        dist.barrier(group=group)
    except RuntimeError as error:  # gloo/NCCL report a closed connection or the timeout
        raise RegistrationError(
            f"rank {dist.get_rank()}: packing the node-shared host master of group {name!r} "
            f"failed: a rank of the node group died or did not arrive within the group's timeout "
            f"({error}). Every rank must add the same groups in the same order; look for the "
            "first error in the other ranks' logs (the weights keep their values on this rank)"
        ) from error


def _return_freed_memory() -> None:
    """Hand the pages of the copies just dropped back to the kernel (glibc keeps freed heap
    memory otherwise, and a rank would go on holding what the shared master replaced)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)


def check_host_room(name: str, nbytes: int) -> None:
    """Refuse, before anything is allocated, a host master of `nbytes` for group `name` that
    the process cannot take: more than MemAvailable or its memory cgroup's room ([Note: the limit
    that kills] in `residency.device.host_memory`), naming need, room and source."""
    error = host_room_error(name, nbytes)
    if error is not None:
        raise error


def host_room_error(name: str, nbytes: int) -> HostMemoryError | None:
    """The refusal `check_host_room` raises for a master of `nbytes`, or None when it fits."""
    memory = host_memory()
    room, source = memory.room()
    if room is None or nbytes <= room:
        return None
    return HostMemoryError(
        f"cannot add group {name!r}: its host master needs {format_nbytes(nbytes)} and "
        f"{source} leaves {format_nbytes(room)} ({memory.describe()}); nothing was allocated "
        "and the weights keep their values. Keep masters beyond a limit file-backed with the "
        "host tier (host={'memory_limit': ..., 'spill_directory': ...}, or only "
        "{'spill_directory': ...}: masters past the room spill there), raise the limit, or "
        "free host memory")
