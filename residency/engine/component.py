"""`Residency`: one component (a group of modules) and the state machine that moves its weights.

A component is offloaded or resident; ``_load`` and ``_evict`` are the only transitions.  They are
the scheduler's to call (calling them directly would bypass its bookkeeping): the scheduler decides
*when*; this file decides *how*, and guarantees that nothing is lost:

* ``_load`` copies the host master into device storage in bulk (one copy per chunk) and re-points
  every tensor to its device view.
* ``_evict`` re-points every tensor back to its host view.  Unchanged bytes cost no copy.  What
  changed while resident is written back first, whatever path the edit took: the digest windows
  whose bytes changed in place (see [Note: finding what changed]), and tensors given new storage with
  ``tensor.data = ...`` or ``module.to(...)`` (the data pointer moves).
* ``_adopt`` takes a new inventory and master after the modules changed shape (new or replaced
  parameters, a new dtype): the scheduler re-packs the group before its next load rather than
  refusing the change.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch
import torch.distributed as dist
from torch import nn

from residency.multirank.agreement import agree_write_back, digest_ranges
from residency.engine.digests import ChangeDetector
from residency.engine.enums import Policy, ResidencyState
from residency.engine.errors import DeviceMemoryError, PhaseError
from residency.engine.memory import DeviceStorage, HostMaster
from residency.multirank.sharded import ShardedLoad
from residency.engine.tensors import Inventory, data_ptrs, repoint, repoint_group, versions
from residency.engine.transport import Completion, Transport

__all__ = ["Policy", "Residency", "ResidencyState", "device_need", "slot_nbytes"]


@attrs.frozen
class _PendingLoad:
    """A load begun by `_begin_load` and not finished yet."""

    #: The device storage being copied into.
    storage: DeviceStorage
    #: The group's views of it, in inventory order, and their data pointers.
    views: list[torch.Tensor]
    pointers: list[int]
    #: The end of the copy.
    completion: Completion
    #: Version counters when the copy began (prefetch: edits after it are copied again), or None.
    watched_versions: list[int] | None
    #: Bytes this process copies host to device for the load.
    nbytes: int


class Residency:
    """One group: its modules, its host master, the device storage it was loaded into, its state.

    Created by `Scheduler.add`; model code does not build these.  ``_load`` and ``_evict`` are called
    by the scheduler's placement only; reading ``is_resident``, ``nbytes`` and ``state`` is always
    safe.  `state` and `device_storage` are this object's own facts, written only by its verbs.

        residency = scheduler.add("text_encoder", encoder)
        with scheduler.resident("text_encoder"):
            assert residency.is_resident
    """

    def __init__(
        self,
        name: str,
        modules: tuple[nn.Module, ...],
        policy: Policy,
        inventory: Inventory,
        host_master: HostMaster,
        transport: Transport,
        *,
        excluded: tuple[nn.Module, ...] = (),
        category: str | None = None,
        detect_edits: bool = True,
        sharded: ShardedLoad | None = None,
    ) -> None:
        self.name = name
        #: How the group loads when its ranks share its master and split the copy
        #: (``weight_transfer="allgather"``); None: this process copies every byte.
        self.sharded = sharded
        #: The config component it was made for ("dit", "text_encoder", "vae"), or None.
        self.category = category
        self.modules = modules
        #: Submodules of `modules` left out of the group (they belong to other groups or none).
        self.excluded = excluded
        self.policy = policy
        #: Whether the group is swapped by phases (policy EXCLUSIVE); read on the hot path.
        self.exclusive = policy is Policy.EXCLUSIVE
        self.inventory = inventory
        self.host_master = host_master
        #: The device storage the tensors view while RESIDENT (the last one loaded into; None
        #: before the first load).
        self.device_storage: DeviceStorage | None = None
        self._transport = transport
        self.state = ResidencyState.OFFLOADED
        #: Where each tensor sat in device storage at the last load (to notice ``.data = ...``).
        self._device_ptrs: list[int] = []
        self._host_ptrs = data_ptrs(host_master.views)
        #: Version counters as of the last registration or eviction.  Re-pointing keeps a tensor's
        #: counter, so a load need not read them again; an edit made on the host in between only
        #: costs a redundant write-back at the next eviction.
        self._loaded_versions = versions(inventory.tensors)
        self._marked_dirty = False
        #: Whether the last eviction left tensors that no longer fit their place (to re-pack).
        self.left_misfits = False
        #: Whether edits are found by digests of the bytes (False: the user promised not to edit).
        self.detect_edits = detect_edits
        #: Digests of the device bytes as loaded (see [Note: finding what changed]); None when the
        #: user promised not to edit (``detect_edits=False``) and the master is not shared: then
        #: only version counters and data pointers tell.
        self._detector: ChangeDetector | None = None
        self._detector = self._detector_for(host_master)
        #: While LOADING: the copy under way.
        self._pending: _PendingLoad | None = None
        #: Layer mode: the streamed blocks (`residency.engine.layers.BlockStream`), outside this
        #: Residency's own inventory; None in module mode.  Set once, by the scheduler's add.
        self.blocks = None

    def __repr__(self) -> str:
        """Counts of the whole group (streamed blocks included); in layer mode, then of the part
        outside the blocks.

            <Residency 'dit' exclusive offloaded: 1 module(s), 40 tensors, 0.3 MiB; outside its
             4 streamed blocks 8 tensors, 0.1 MiB>
        """
        tensors = sum(inventory.tensor_count for inventory in self.inventories)
        text = (f"<Residency {self.name!r} {self.policy.value} {self.state.value}: "
                f"{len(self.modules)} module(s), {tensors} tensors, {self.nbytes / 2**20:.1f} MiB")
        if self.blocks is not None:
            own = self.inventory
            text += (f"; outside its {len(self.blocks.blocks)} streamed blocks "
                     f"{own.tensor_count} tensors, {own.nbytes / 2**20:.1f} MiB")
        return text + ">"

    @property
    def is_resident(self) -> bool:
        """Whether the weights are on the device now."""
        return self.state is ResidencyState.RESIDENT

    @property
    def nbytes(self) -> int:
        """Bytes of the unique tensors (tied weights count once), streamed blocks included."""
        return sum(inventory.nbytes for inventory in self.inventories)

    @property
    def inventories(self) -> tuple[Inventory, ...]:
        """The group's own inventory, then each streamed block's (layer mode): everything it
        owns, for the ownership checks."""
        if self.blocks is None:
            return (self.inventory,)
        return (self.inventory, *(block.inventory for block in self.blocks.blocks))

    @property
    def device_need(self) -> int:
        """Device bytes the group needs while current (`device_need`)."""
        return device_need(self.inventory, self.inventories[1:], self.sharded)

    def layers(self) -> tuple[nn.Module, ...]:
        """The blocks of a layer-mode group, in the order the model runs them; calling one
        streams it (its forward loads it and prefetches the next).

            with scheduler.resident("transformer") as dit:
                for block in dit.layers():
                    hidden = block(hidden, temb)
        """
        if self.blocks is None:
            raise PhaseError(
                f"group {self.name!r} is in module mode: it has no streamed layers. Register it "
                f"with scheduler.add({self.name!r}, model, layers=True) (or an offload config "
                "with \"mode\": \"layer\") to stream its blocks"
            )
        return self.blocks.layers()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The unique tensors of the group (parameters and buffers), in registration order."""
        return self.inventory.tensors

    def mark_dirty(self) -> None:
        """Have every byte written back at the next eviction (only needed with
        ``detect_edits=False``, for edits the version counter cannot see); in layer mode, also
        every streamed block's at its next departure from a slot."""
        self._marked_dirty = True
        if self.blocks is not None:
            for block in self.blocks.blocks:
                block.mark_dirty()

    def _load(self, storage: DeviceStorage, *, replaced: list[int] | None = None) -> int:
        """Copy the host master into `storage` and re-point the tensors there; returns bytes copied.

        `replaced`: `replaced_on_host`'s answer, when the caller asked already (one pointer pass
        per load).  On any failure (including a ``KeyboardInterrupt``) the group is left cleanly
        offloaded.
        """
        try:
            self._begin_load(storage, replaced=replaced)
            return self._finish_load()
        except BaseException:  # see [Note: interrupts] in residency.engine.scheduler: undone
            if self.state is ResidencyState.LOADING:
                self._cancel_load()
            raise

    def _begin_load(self, storage: DeviceStorage, *, watch_edits: bool = False,
                    replaced: list[int] | None = None) -> int:
        """Issue the copy into device storage; the tensors keep reading the host master.
        Returns the bytes this process copies host to device.

        The group is LOADING until `_finish_load` (or `_cancel_load`).  Used directly for prefetch,
        with `watch_edits`: user code may run (and edit the weights on the host) before the
        load finishes, and `_finish_load` then copies what changed again.  `replaced`: as for
        `_load`.
        """
        self._require(ResidencyState.OFFLOADED, "load")
        # The placement adopted any change first (`pending_change` is None here): see `_adopt`.
        self._copy_in_replaced(replaced)
        try:
            self.state = ResidencyState.LOADING
            nbytes = self.inventory.layout.contiguous_nbytes
            sharded = self.sharded
            self._prepare_storage(storage, sharded.buffer_nbytes(nbytes) if sharded else nbytes)
            views, pointers = storage.views_and_pointers(self, self.inventory)
            copies = self.host_master.chunk_copies(storage.buffer, self.inventory)
            watched = versions(self.inventory.tensors) if watch_edits else None
            if sharded is None:
                completion, moved = self._transport.to_device(copies), self.inventory.layout.nbytes
            else:
                completion, moved = sharded.load(
                    self.name, self._transport, copies, storage.buffer, nbytes
                )
            self._pending = _PendingLoad(storage, views, pointers, completion, watched, moved)
            return moved
        except BaseException:  # see [Note: interrupts]: undone
            if self._pending is not None:
                self._cancel_load()
            self.state = ResidencyState.OFFLOADED
            raise

    def _finish_load(self, *, replaced: list[int] | None = None) -> int:
        """Order compute after the copy and re-point the tensors to device storage."""
        self._require(ResidencyState.LOADING, "finish loading")
        pending = self._pending
        try:
            if pending.watched_versions is not None:
                pending = self._recopy_edited(pending, replaced)
            completion = pending.completion
            completion.wait()
            if self._detector is not None:  # ordered after the copy by completion.wait()
                self._detector.remember(self._device_bytes(pending.storage))
            repoint_group(self.inventory, pending.views)
            # The commit: one line, so no interrupt lands between these stores.
            self._pending, self.device_storage, self._device_ptrs, self.state = (
                None, pending.storage, pending.pointers, ResidencyState.RESIDENT)
            return pending.nbytes
        except BaseException:  # undone unless committed (see [Note: interrupts])
            if self.state is ResidencyState.LOADING:
                self._cancel_load()
            raise

    def _cancel_load(self) -> None:
        """Abandon a load begun with `_begin_load`; the group ends offloaded, on host views.

        Storage the user gave a tensor meanwhile (``.data = ...``) is adopted into the master.
        Idempotent until its last line, so an interrupted cancel is completed by the next one.
        """
        self._require(ResidencyState.LOADING, "cancel loading")
        pending = self._pending
        if pending is not None:
            # The copy may still be reading the host master, whose memory may be released next
            # (remove, refresh, close): wait for it.  Prefetches are cancelled rarely.
            pending.completion.synchronize()
            if data_ptrs(self.inventory.tensors) == data_ptrs(pending.views):
                repoint_group(self.inventory, self.host_master.views)  # an interrupted finish
            pending.storage.retire()
        self._copy_in_replaced()
        self._pending, self.state = None, ResidencyState.OFFLOADED

    def _recopy_edited(self, pending: _PendingLoad,
                       replaced: list[int] | None = None) -> _PendingLoad:
        """After a prefetch: copy again every tensor edited on the host since the copy began.

        The second copy's end becomes the pending load's end, so a cancel waits for it too.
        """
        adopted = self._copy_in_replaced(replaced)
        now = versions(self.inventory.tensors)
        if now == pending.watched_versions and not adopted:
            return pending
        homes = self.host_master.views
        edited = sorted({i for i, (v, w) in enumerate(zip(now, pending.watched_versions))
                         if v != w} | adopted)
        pairs = [(pending.views[i], homes[i]) for i in edited]
        # [Note: the second copy's completion covers the first]
        # No wait for the first copy here: the copy stream runs the second after it, so the wait
        # for the second (in `_finish_load`) orders compute after both.  (The synchronisation
        # audit found the wait that stood here redundant: docs/design.md.)  One line: the copy's
        # completion is the pending load's before any interrupt can land.
        self._pending = attrs.evolve(pending, completion=self._transport.to_device(pairs))
        return self._pending

    def _evict(self) -> int:
        """Re-point the tensors to the host master, writing back what changed; returns bytes written.

        A tensor given new storage that no longer fits its place in the master (a new dtype or
        shape, a broken tie) is left as the user made it, moved to the host; `pending_change` then
        reports it, and the scheduler re-packs the group before its next load.
        """
        self._require(ResidencyState.RESIDENT, "evict")
        tensors = self.inventory.tensors
        now_versions, replaced = versions(tensors), self._moved_from(self._device_ptrs)
        left = {i for i, _ in self._misfits(replaced)}
        fitting = [i for i in replaced if i not in left]
        if self.host_master.shared_group is not None:
            written = self._write_back_agreed(fitting)
        else:  # edits in place first, then new storage: the later copy wins where both touch
            written = self._write_back_edits(now_versions, set(replaced))
            written += self._write_back_replaced(fitting)
        homes = list(self.host_master.views)
        for i in left:
            homes[i] = tensors[i].detach().to("cpu")
        try:
            repoint_group(self.inventory, homes)
            self._leave_device(now_versions, bool(left))
        except BaseException:  # re-pointed: rolled forward; else still resident, nothing lost
            if data_ptrs(tensors) == data_ptrs(homes):
                self._leave_device(now_versions, bool(left))
            raise
        return written

    def _leave_device(self, now_versions: list[int], left_misfits: bool) -> None:
        """The end of an eviction, the tensors on their homes already; repeatable until its
        last line (the commit)."""
        self.device_storage.retire()
        if self._detector is not None:
            self._detector.forget()
        self._loaded_versions, self._marked_dirty, self.left_misfits, self.state = (
            now_versions, False, left_misfits, ResidencyState.OFFLOADED)

    def replaced_on_host(self) -> list[int]:
        """Indices of the tensors given new storage while offloaded (``module.to(...)``,
        ``.data = ...``): one pass over the data pointers."""
        return self._moved_from(self._host_ptrs)

    def changes_on_host(self) -> tuple[str | None, list[int]]:
        """What changed while offloaded, from the one pointer pass a load makes: why the group
        must be re-packed first (`pending_change`, or None), and `replaced_on_host`."""
        replaced = self.replaced_on_host()
        return self.pending_change(replaced), replaced

    def pending_change(self, replaced: list[int] | None = None) -> str | None:
        """Why the group must be re-packed before it can load, or None (it is offloaded).

        Parameters, buffers or submodules added, replaced or removed since it was packed, or a
        tensor whose dtype, shape or strides no longer fit its place in the master.
        `replaced`: `replaced_on_host`'s answer, when the caller asked already.
        """
        change = self.inventory.changed_structure()
        if change is not None:
            return change
        return self.misfit_change(replaced)

    def misfit_change(self, replaced: list[int] | None = None) -> str | None:
        """The part of `pending_change` that data pointers tell (no module-structure walk): a
        tensor given storage of another dtype, shape or strides, or untied; None otherwise."""
        replaced = self.replaced_on_host() if replaced is None else replaced
        misfits = self._misfits(replaced)
        if not misfits:
            return None
        index, why = misfits[0]
        return f"the {self.inventory.slots[index][0].describe()}: {why}"

    def _adopt(self, inventory: Inventory, host_master: HostMaster) -> None:
        """Take over a new inventory and master (packed from the modules as they are now)."""
        self._require(ResidencyState.OFFLOADED, "re-pack")
        detector, host_ptrs = self._detector_for(host_master), data_ptrs(host_master.views)
        (self.inventory, self.host_master, self._detector, self._host_ptrs, self._loaded_versions,
         self._device_ptrs, self._marked_dirty, self.left_misfits) = (
            inventory, host_master, detector, host_ptrs, versions(inventory.tensors), [], False,
            False)  # one line: see [Note: interrupts]

    def _detector_for(self, host_master: HostMaster) -> ChangeDetector | None:
        """Keep digests when the user did not opt out, or when the master is shared (its ranks
        must agree on every write: `_write_back_agreed`)."""
        if self._detector is None and (self.detect_edits or host_master.shared_group is not None):
            return ChangeDetector()
        return self._detector

    def _write_back_replaced(self, indices: list[int]) -> int:
        """Write back tensors given new storage, unless their bytes equal those loaded.

        ``enable_layerwise_casting`` upcasts a module's weights before each forward and casts them
        back after, into new storage with the same bytes: comparing on the device costs a read,
        where writing back would cost a copy to the host on every swap.
        """
        if not indices:
            return 0
        views = self.device_storage.views_for(self, self.inventory)
        tensors = self.inventory.tensors
        same = _same_bytes([(tensors[i], views[i]) for i in indices])
        return self._write_back([i for i, unchanged in zip(indices, same) if not unchanged])

    def _write_back_edits(self, now_versions: list[int], replaced: set[int]) -> int:
        """Copy to the master what was edited in place while resident; returns the bytes copied.

        [Note: finding what changed]
        An edit through ``tensor.data`` (peft's LoRA merge), by a custom kernel or through an
        alias moves neither the version counter nor the data pointer.  Only the bytes tell, so the
        device bytes are digested at every load (after the copy: the bytes as loaded, not as
        packed - the master may have been edited while offloaded) and again here; the windows
        whose digests differ are written back, and nothing else (`residency.engine.digests` says what a
        digest detects).  With ``detect_edits=False`` the user promised not to edit, and tensors
        whose version counter moved are written back instead.
        """
        if self._marked_dirty:
            return self._write_ranges([(0, self.inventory.layout.contiguous_nbytes)])
        if self._detector is not None:
            return self._write_ranges(self._detector.changed_windows(self._device_bytes()))
        if now_versions == self._loaded_versions:
            return 0
        moved = [i for i, (v, w) in enumerate(zip(now_versions, self._loaded_versions)) if v != w]
        return self._write_back([i for i in moved if i not in replaced])

    def _write_back_agreed(self, fitting: list[int]) -> int:
        """A shared master: the ranks agree on what changed and one of them writes it.

        Tensors given new storage are first copied into their device bytes, so that one digest
        check sees every change; then `agree_write_back` (collective over the node's ranks)
        decides: nothing, one writer (the others wait at a barrier until the bytes are in the
        shared pages), or a `CollectiveError` on every rank before anything is written or
        re-pointed - the group stays resident, each rank keeping its device copy.
        """
        views = self.device_storage.views_for(self, self.inventory)
        for i in fitting:
            views[i].copy_(self.inventory.tensors[i].detach())
        device_bytes = self._device_bytes()
        if self._marked_dirty:
            ranges = [(0, self.inventory.layout.contiguous_nbytes)]
        else:
            ranges = self._detector.changed_windows(device_bytes)
        digest = digest_ranges(device_bytes, ranges) if ranges else None
        group = self.host_master.shared_group
        decision = agree_write_back(self.name, ranges, digest, group)
        written = self._write_ranges(list(decision.ranges)) if decision.writes else 0
        if decision.writer is not None:
            dist.barrier(group=group)
        return written

    def _write_ranges(self, ranges: list[tuple[int, int]]) -> int:
        """Copy device byte ranges (offsets into the group's device bytes) into the master."""
        if not ranges:
            return 0
        pairs = self.host_master.range_copies(self.device_storage.buffer, ranges, self.inventory)
        return self._copy_to_master(pairs)

    def _device_bytes(self, storage: DeviceStorage | None = None) -> torch.Tensor:
        """The group's bytes in `storage` (default: the one it is loaded in), chunks laid end to
        end, padding included."""
        storage = self.device_storage if storage is None else storage
        return storage.buffer[: self.inventory.layout.contiguous_nbytes]

    def _require(self, state: ResidencyState, action: str) -> None:
        if self.state is not state:
            raise PhaseError(
                f"cannot {action} group {self.name!r}: it is {self.state.value}, and {action} "
                f"needs it {state.value}"
            )

    def _prepare_storage(self, storage: DeviceStorage, nbytes: int) -> None:
        try:
            storage.prepare(nbytes)
        except (MemoryError, RuntimeError) as error:
            raise DeviceMemoryError(
                f"group {self.name!r} needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of device "
                f"memory on {self._transport.device} and the allocation failed ({error}). Free "
                "device memory, raise the scheduler's device_memory_limit, or split the group; "
                "the group stays offloaded"
            ) from error

    def _moved_from(self, pointers: list[int]) -> list[int]:
        """Indices of the tensors whose data pointer is no longer the one in `pointers` (given
        new storage: ``.data = ...``, ``module.to(...)``), in inventory order; one pointer pass."""
        now_ptrs = data_ptrs(self.inventory.tensors)
        if now_ptrs == pointers:
            return []
        return [i for i, p in enumerate(now_ptrs) if p != pointers[i]]

    def _misfits(self, replaced: list[int]) -> list[tuple[int, str]]:
        """(index, why) of tensors given new storage whose bytes cannot go back to their place in
        the master.

        A new dtype, shape or stride needs a new layout; new storage for one of several tensors
        that shared a storage broke the tie, and writing it back would change the others.
        """
        tensors, homes = self.inventory.tensors, self.host_master.views
        misfits = []
        for i in replaced:
            tensor, home = tensors[i], homes[i]
            if (tensor.dtype, tensor.shape, tensor.stride()) != (home.dtype, home.shape, home.stride()):
                misfits.append((i, f"it changed from {_kind(home)} to {_kind(tensor)}"))
            elif self.inventory.shares_region(i):
                misfits.append((i, "it was given new storage, untying it from the tensors it "
                                   "shared storage with"))
        return misfits

    def _write_back(self, indices: list[int]) -> int:
        """Copy tensors `indices` into their places in the master; returns the bytes copied."""
        if not indices:
            return 0
        tensors, homes = self.inventory.tensors, self.host_master.views
        return self._copy_to_master([(homes[i], tensors[i].detach()) for i in indices])

    def _copy_to_master(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy (master view, device bytes) pairs to the host; returns the bytes copied.

        The host may read the master right away, so this is the one place a write-back waits.
        """
        self._transport.to_host(pairs).synchronize()
        return sum(host.nbytes for host, _ in pairs)

    def _copy_in_replaced(self, replaced: list[int] | None = None) -> set[int]:
        """Copy into the master any tensor given new storage while offloaded (``module.to(...)``)
        that still fits its place; returns the indices adopted (misfits are left as they are:
        `pending_change` reports them).  `replaced`: as for `_load`."""
        replaced = self.replaced_on_host() if replaced is None else replaced
        if not replaced:
            return set()
        left = {i for i, _ in self._misfits(replaced)}
        adopted = [i for i in replaced if i not in left]
        self._write_back(adopted)
        homes, tensors = self.host_master.views, self.inventory.tensors
        repoint([tensors[i] for i in adopted], [homes[i] for i in adopted])
        return set(adopted)


def slot_nbytes(blocks: Iterable[Inventory], sharded: ShardedLoad | None) -> int:
    """Bytes a layer-mode slot must hold for `blocks`: the largest one's laid-out bytes (whole
    shards when the node's ranks all-gather each block); 0 without blocks."""
    largest = max((block.layout.contiguous_nbytes for block in blocks), default=0)
    return sharded.buffer_nbytes(largest) if sharded is not None and largest else largest


def device_need(own: Inventory, blocks: Iterable[Inventory], sharded: ShardedLoad | None) -> int:
    """Device bytes a group needs while current: its own part, plus two slots for its streamed
    `blocks` in layer mode.  The one rule for a registered group and a claim alike."""
    return own.layout.contiguous_nbytes + 2 * slot_nbytes(blocks, sharded)


def _kind(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {tuple(tensor.shape)} strides {tensor.stride()}"


def _same_bytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """Whether each (tensor, device view) pair holds the same bytes.

    Pairs on one accelerator compare there, with one host wait for all of them.  A tensor the
    user moved to the host (``module.to("cpu")`` while resident) compares on the host: no kernel
    reads a host and a device tensor together.
    """
    on_device = [a.device == b.device != _HOST for a, b in pairs]
    device_flags = iter(torch.stack([(_as_bytes(a) == _as_bytes(b)).all()
                                     for (a, b), there in zip(pairs, on_device) if there]).tolist()
                        if any(on_device) else ())
    return [next(device_flags) if there else torch.equal(_as_bytes(a).cpu(), _as_bytes(b).cpu())
            for (a, b), there in zip(pairs, on_device)]


_HOST = torch.device("cpu")


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element size (NaNs compare by their bits)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_WORDS.get(flat.element_size(), torch.uint8))
