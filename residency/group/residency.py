"""`Residency`: one component (a group of modules) and the state machine that moves its weights.

A component is offloaded or resident; ``load`` and ``evict`` are the only transitions.  They are
the scheduler's to call (calling them directly would bypass its bookkeeping): the scheduler decides
*when*; this file decides *how*, and guarantees that nothing is lost:

* ``load`` copies the host master into device storage in bulk (one copy per chunk) and re-points
  every tensor to its device view.
* ``evict`` re-points every tensor back to its host view.  Unchanged bytes cost no copy.  What
  changed while resident is written back first (`WriteBack`, below), whatever path the edit
  took: the digest windows whose bytes changed in place, and tensors given new storage with
  ``tensor.data = ...`` or ``module.to(...)`` (the data pointer moves).
* ``adopt`` takes a new inventory and master after the modules changed shape (new or replaced
  parameters, a new dtype): the scheduler re-packs the group before its next load rather than
  refusing the change.

Write-back: what changed on a group's device bytes goes back into its host master, and nothing
else.

    written = WriteBack(name=group.name, inventory=inventory, master=master, storage=storage,
                        key=group, detector=detector, marked_dirty=False,
                        now_versions=now, loaded_versions=loaded, replaced=replaced,
                        fitting=fitting).write()
    copied = write_tensors(transport, inventory, master, [3, 7])   # tensors into their places

`Residency.evict` reads what it must of the tensors (version counters, data pointers), decides
which tensors still fit their places, and hands one `WriteBack` the rest, which decides which
bytes to copy and hands the copies to the storage in the one call that ends the residency
(`DeviceStorage.retire`: the copies, which the host waits for, since it may read a master right
after; then the buffer retired).

[Note: finding what changed]
An edit through ``tensor.data`` (peft's LoRA merge), by a custom kernel or through an alias moves
neither the version counter nor the data pointer.  Only the bytes tell, so the device bytes are
digested at every load (after the copy: the bytes as loaded, not as packed - the master may have
been edited while offloaded) and again at eviction; the windows whose digests differ are written
back, and nothing else (`residency.device.digests` says what a digest detects).  With
``detect_edits=False`` the user promised not to edit, and tensors whose version counter moved are
written back instead.  Tensors given new storage (``tensor.data = ...``, ``module.to(...)``) that
still fit their places are written back unless their bytes equal those loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist
from torch import nn

from residency.device.digests import ChangeDetector
from residency.core.enums import Policy, ResidencyState
from residency.core.errors import PhaseError
from residency.host.memory import HostMaster
from residency.group.plan import Plan
from residency.multirank.agreement import agree_write_back, digest_ranges
from residency.multirank.sharded import ShardedLoad
from residency.modules.tensors import (
    Inventory, data_ptrs, moved_from, repoint, repoint_group, versions,
)
from residency.device.transport import Completion, DeviceStorage, Transport

if TYPE_CHECKING:
    from residency.placement.layers import BlockStream

__all__ = ["Policy", "Residency", "ResidencyState", "WriteBack", "copy_in", "device_need",
           "slot_nbytes", "tensor_copies", "write_tensors"]


@attrs.frozen
class _PendingLoad:
    """A load begun by `begin_load` and not finished yet."""

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

    Created by `Scheduler.add`; model code does not build these.  Its transitions (``load``,
    ``evict`` and the steps of a prefetch) are called by the placements only: a group's own part
    by `residency.placement.placement`, a streamed part by `residency.placement.slots`.  Reading
    ``is_resident``, ``nbytes`` and ``state`` is always safe.  `state` and `device_storage` are
    this object's own facts, written only by its verbs.

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
        plan: Plan | None = None,
    ) -> None:
        self.name = name
        #: Where each of its parts is between and during phases (`residency.group.plan`);
        #: module mode's unless given.  Set at registration, and by an auto scheduler's
        #: placement when it re-plans (`Placement.replan`).
        self.plan = Plan.for_group(name, policy, ()) if plan is None else plan
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
        #: The device storage the tensors view while RESIDENT (the last one loaded into).
        self.device_storage: DeviceStorage | None = None
        self._transport = transport
        self.state = ResidencyState.OFFLOADED
        #: Where each tensor sat in device storage at the last load (to notice ``.data = ...``).
        self._device_ptrs: list[int] = []
        #: Version counters as of the last registration or eviction (re-pointing keeps them, so a
        #: load need not read them; a host edit in between costs a redundant write-back).
        self._loaded_versions = versions(inventory.tensors)
        self._marked_dirty = False
        #: Whether the last eviction left tensors that no longer fit their place (to re-pack).
        self.left_misfits = False
        #: Whether edits are found by digests of the bytes (False: the user promised not to edit).
        self.detect_edits = detect_edits
        #: Digests of the device bytes as loaded ([Note: finding what changed] above);
        #: None with ``detect_edits=False`` on a private master (versions and pointers tell).
        self._detector: ChangeDetector | None = _detector_for(None, detect_edits, host_master)
        #: While LOADING: the copy under way.
        self._pending: _PendingLoad | None = None
        #: The streams that carry out the plan's streamed parts (each part a small `Residency`
        #: outside this one's own inventory): one `residency.placement.layers.BlockStream` in layer
        #: mode, none in module mode.  Set by the scheduler's add (and `Placement.replan`).
        self.streams: tuple[BlockStream, ...] = ()
        #: The parts placed whole apart from this one (an auto plan's kept and swapped blocks,
        #: each a small `Residency`; `plan.where` says which).  Set as `streams` is.
        self.apart: tuple[Residency, ...] = ()

    def __repr__(self) -> str:
        """Counts of the whole group, then (layer mode) of its part outside the streamed blocks."""
        tensors = sum(inventory.tensor_count for inventory in self.inventories)
        text = (f"<Residency {self.name!r} {self.policy.value} {self.state.value}: "
                f"{len(self.modules)} module(s), {tensors} tensors, {self.nbytes / 2**20:.1f} MiB")
        outside = "".join(stream.describe_outside(self.inventory) for stream in self.streams)
        return text + outside + ">"

    @property
    def is_resident(self) -> bool:
        """Whether the own part's weights are on the device now (parts apart: `apart`)."""
        return self.state is ResidencyState.RESIDENT

    @property
    def device_target(self) -> DeviceStorage | None:
        """The device storage the tensors view (RESIDENT) or are being copied into (LOADING);
        None when offloaded."""
        if self.state is ResidencyState.RESIDENT:
            return self.device_storage
        return self._pending.storage if self._pending is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes of the unique tensors (tied weights count once), streamed blocks included."""
        return sum(inventory.nbytes for inventory in self.inventories)

    @property
    def inventories(self) -> tuple[Inventory, ...]:
        """The group's own inventory, then each streamed part's (layer mode): everything it
        owns, for the ownership checks."""
        return (self.inventory, *(part.inventory for part in self.parts))

    @property
    def parts(self) -> tuple[Residency, ...]:
        """Each part apart from the own one: placed whole (`apart`), then streamed."""
        return (*self.apart, *(part for stream in self.streams for part in stream.parts))

    @property
    def host_masters(self) -> tuple[HostMaster, ...]:
        """The own part's host master, then each part's apart from it."""
        return (self.host_master, *(part.host_master for part in self.parts))

    @property
    def device_need(self) -> int:
        """Device bytes the group needs while current (`device_need`)."""
        return device_need(self.inventory, (p.inventory for p in self.parts), self.sharded)

    def layers(self) -> tuple[nn.Module, ...]:
        """The blocks of a layer-mode group, in the order the model runs them; calling one
        streams it (its forward loads it and prefetches the next).

            with scheduler.resident("transformer") as dit:
                for block in dit.layers():
                    hidden = block(hidden, temb)
        """
        layers = tuple(layer for stream in self.streams for layer in stream.layers())
        if not layers:
            raise _no_layers(self.name)
        return layers

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The unique tensors of the group (parameters and buffers), in registration order."""
        return self.inventory.tensors

    def mark_dirty(self) -> None:
        """Have every byte written back at the next eviction (only needed with
        ``detect_edits=False``: edits no version counter sees); also each streamed part's."""
        self._marked_dirty = True
        for part in self.parts:
            part.mark_dirty()

    def load(self, storage: DeviceStorage, *, replaced: list[int] | None = None) -> int:
        """Copy the host master into `storage` and re-point the tensors there; returns bytes copied.

        `replaced`: `replaced_on_host`'s answer, when the caller asked already (one pointer pass
        per load).  On any failure (including a ``KeyboardInterrupt``) the group is left cleanly
        offloaded.
        """
        try:
            self.begin_load(storage, replaced=replaced)
            return self.finish_load()
        except BaseException:  # see [Note: interrupts] in residency.scheduler.scheduler: undone
            if self.state is ResidencyState.LOADING:
                self.cancel_load()
            raise

    def begin_load(self, storage: DeviceStorage, *, watch_edits: bool = False,
                    replaced: list[int] | None = None) -> int:
        """Issue the copy into device storage; the tensors keep reading the host master.
        Returns the bytes this process copies host to device.

        The group is LOADING until `finish_load` (or `cancel_load`).  Used directly for prefetch,
        with `watch_edits`: user code may run (and edit the weights on the host) before the
        load finishes, and `finish_load` then copies what changed again.  `replaced`: as for
        `load`.
        """
        self._require(ResidencyState.OFFLOADED, "load")
        try:
            self.state = ResidencyState.LOADING
            _entering(self.host_master)
            # The placement adopted any change first (`pending_change` is None here): `adopt`.
            self._copy_in_replaced(replaced)
            watched = versions(self.inventory.tensors) if watch_edits else None
            views, pointers, completion, moved = self._issue_copy(storage)
            self._pending = _PendingLoad(storage, views, pointers, completion, watched, moved)
            return moved
        except BaseException:  # see [Note: interrupts]: undone
            if self._pending is not None:
                self.cancel_load()
            self.state = ResidencyState.OFFLOADED
            raise

    def finish_load(self, *, replaced: list[int] | None = None) -> int:
        """Order compute after the copy and re-point the tensors to device storage."""
        self._require(ResidencyState.LOADING, "finish loading")
        pending = self._pending
        try:
            if pending.watched_versions is not None:
                pending = self._recopy_edited(pending, replaced)
            completion = pending.completion
            completion.wait()
            if self._detector is not None:  # ordered after the copy by completion.wait()
                self._detector.remember(
                    pending.storage.buffer[: self.inventory.layout.contiguous_nbytes])
            repoint_group(self.inventory, pending.views)
            # The commit: one line, so no interrupt lands between these stores.
            self._pending, self.device_storage, self._device_ptrs, self.state = (
                None, pending.storage, pending.pointers, ResidencyState.RESIDENT)
            return pending.nbytes
        except BaseException:  # undone unless committed (see [Note: interrupts])
            if self.state is ResidencyState.LOADING:
                self.cancel_load()
            raise

    def cancel_load(self) -> None:
        """Abandon a load begun with `begin_load`; the group ends offloaded, on host views.

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
        # for the second (in `finish_load`) orders compute after both.  (The synchronisation
        # audit found the wait that stood here redundant: docs/design.md.)  One line: the copy's
        # completion is the pending load's before any interrupt can land.
        self._pending = attrs.evolve(pending, completion=self._transport.to_device(pairs))
        return self._pending

    def evict(self) -> int:
        """Re-point the tensors to the host master, writing back what changed; returns bytes written.

        A tensor given new storage that no longer fits its place in the master (a new dtype or
        shape, a broken tie) is left as the user made it, moved to the host; `pending_change` then
        reports it, and the scheduler re-packs the group before its next load.
        """
        self._require(ResidencyState.RESIDENT, "evict")
        tensors = self.inventory.tensors
        now_versions, replaced, misfits = self.inventory.changes_while_resident(
            self._device_ptrs, self.host_master.views)
        left = {i for i, _ in misfits}
        written = WriteBack(
            name=self.name, inventory=self.inventory, master=self.host_master,
            storage=self.device_storage, key=self,
            detector=self._detector, marked_dirty=self._marked_dirty, now_versions=now_versions,
            loaded_versions=self._loaded_versions, replaced=replaced,
            fitting=[i for i in replaced if i not in left]).write()
        # The storage is retired (`WriteBack.write`): nothing below leaves compute reading it
        # (a misfit's copy to the host, below, is waited for).
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
        """The end of an eviction, the tensors on their homes already and the storage retired
        (by the write-back): its commit, one line."""
        self._loaded_versions, self._marked_dirty, self.left_misfits, self.state = (
            now_versions, False, left_misfits, ResidencyState.OFFLOADED)

    def replaced_on_host(self) -> list[int]:
        """Indices of the tensors given new storage while offloaded (one pointer pass)."""
        return moved_from(self.inventory.tensors, self.host_master.view_ptrs)

    def changes_on_host(self) -> tuple[str | None, list[int]]:
        """What changed while offloaded, from the one pointer pass a load makes: why the group
        must be re-packed first (parameters, buffers or submodules added, replaced or removed
        since it was packed, or a tensor whose dtype, shape or strides no longer fit its place in
        the master; None: it may load), and `replaced_on_host`."""
        master = self.host_master
        return self.inventory.changes_while_offloaded(master.view_ptrs, master.views)

    def pending_change(self) -> str | None:
        """Why the offloaded group must be re-packed before it can load (`changes_on_host`)."""
        return self.changes_on_host()[0]

    def misfit_change(self, replaced: list[int]) -> str | None:
        """The part of `pending_change` that data pointers tell (no module-structure walk), for
        the tensors `replaced` (`replaced_on_host`'s answer)."""
        return self.inventory.describe_misfit(self.inventory.misfits(self.host_master.views,
                                                                     replaced))

    def adopt(self, inventory: Inventory, host_master: HostMaster) -> None:
        """Take over a new inventory and master (packed from the modules as they are now)."""
        self._require(ResidencyState.OFFLOADED, "re-pack")
        # (an arriving master dropped here has had its reads stopped already)
        detector = _detector_for(self._detector, self.detect_edits, host_master)
        (self.inventory, self.host_master, self._detector, self._loaded_versions,
         self._device_ptrs, self._marked_dirty, self.left_misfits) = (
            inventory, host_master, detector, versions(inventory.tensors), [], False,
            False)  # one line: see [Note: interrupts]

    def _require(self, state: ResidencyState, action: str) -> None:
        if self.state is not state:
            raise PhaseError(f"cannot {action} group {self.name!r}: it is {self.state.value}, "
                             f"and {action} needs it {state.value}")

    def _issue_copy(self, storage: DeviceStorage):
        """The copy of the host master into `storage`, issued: the views, their pointers, the
        copy's `Completion` and the bytes this process copies.  One call to the storage
        (`DeviceStorage.begin_load`), or, when the node's ranks split the copy, the storage's
        layout and the ranks' all-gather (`ShardedLoad.load`)."""
        inventory, master, sharded = self.inventory, self.host_master, self.sharded
        nbytes = inventory.layout.contiguous_nbytes
        if sharded is None:
            return (*storage.begin_load(self, inventory, master, nbytes, name=self.name),
                    inventory.layout.nbytes)
        views, pointers, copies = storage.prepare_load(
            self, inventory, master, sharded.buffer_nbytes(nbytes), name=self.name)
        completion, moved = sharded.load(self.name, self._transport, copies, storage.buffer, nbytes)
        return views, pointers, completion, moved

    def _copy_in_replaced(self, replaced: list[int] | None = None) -> set[int]:
        """`copy_in` of the tensors given new storage while offloaded
        (`replaced`: as for `load`); returns the indices taken into the master."""
        replaced = self.replaced_on_host() if replaced is None else replaced
        return copy_in(self._transport, self.inventory, self.host_master, replaced) \
            if replaced else set()


def _entering(master: HostMaster) -> None:
    """Before a copy reads `master`: one still arriving from its weight files is completed
    (`residency.host.read_behind`: its group read first, the caller waits for it, the tensors
    re-pointed to it); a file-backed one's host tier is told (room is made for its pages, the
    file that followed it last time is read ahead).  A private master in memory: nothing."""
    if master.arrival is not None:
        master.arrival.complete(master)
    if master.spill is not None:
        master.spill.entering()


def slot_nbytes(blocks: Iterable[Inventory], sharded: ShardedLoad | None) -> int:
    """Bytes a layer-mode slot must hold for `blocks`: the largest one's laid-out bytes (whole
    shards when the node's ranks all-gather each block); 0 without blocks."""
    largest = max((block.layout.contiguous_nbytes for block in blocks), default=0)
    return sharded.buffer_nbytes(largest) if sharded is not None and largest else largest


def device_need(own: Inventory, blocks: Iterable[Inventory], sharded: ShardedLoad | None) -> int:
    """Device bytes a group needs while current: its own part, plus two slots for its streamed
    `blocks` in layer mode.  The one rule for a registered group and a claim alike."""
    return own.layout.contiguous_nbytes + 2 * slot_nbytes(blocks, sharded)


def _no_layers(name: str) -> PhaseError:
    return PhaseError(
        f"group {name!r} is in module mode: it has no streamed layers. Register it with "
        f"scheduler.add({name!r}, model, layers=True) (or an offload config with \"mode\": "
        "\"layer\") to stream its blocks"
    )


def _detector_for(detector: ChangeDetector | None, detect_edits: bool,
                  host_master: HostMaster) -> ChangeDetector | None:
    """A group's digests over `host_master`: kept (`detector`), or new when the user did not opt
    out or the master is shared (its ranks must agree on every write: `WriteBack`);
    None otherwise."""
    if detector is None and (detect_edits or host_master.shared_group is not None):
        return ChangeDetector()
    return detector


# -- write-back ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WriteBack:
    """One eviction's write-back from `storage` into `master` (see the module docstring)."""

    name: str
    inventory: Inventory
    master: HostMaster
    #: The device storage the group is loaded in, and the key its views there are cached under.
    storage: DeviceStorage
    key: object
    #: Digests of the bytes as loaded, or None (``detect_edits=False`` on a private master).
    detector: ChangeDetector | None
    #: Every byte is to be written (`Residency.mark_dirty`).
    marked_dirty: bool
    #: Version counters now, and as of the load.
    now_versions: list[int]
    loaded_versions: list[int]
    #: Tensors given new storage while resident, and those of them that fit their places.
    replaced: list[int]
    fitting: list[int]

    def write(self) -> int:
        """Copy what changed into the master, then retire the device buffer, in one call to the
        storage that ends the residency (`DeviceStorage.retire`); returns the bytes written.  A
        shared master's ranks agree first (`_write_back_agreed`: collective).

            written = write_back.write()     # the storage retired: no kernel reads it after
        """
        if self.master.shared_group is not None:
            return self._write_back_agreed()
        # edits in place first, then new storage: the later copy wins where both touch
        copies = self._edit_copies() + self._replaced_copies()
        self.storage.retire(copies)
        return _nbytes(copies)

    def _edit_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copies of what was edited in place while resident (see [Note: finding what
        changed])."""
        if self.marked_dirty:
            if self.detector is not None:  # its reference is of no more use (`take_changes`)
                self.detector.forget()
            return self._range_copies([(0, self.inventory.layout.contiguous_nbytes)])
        if self.detector is not None:
            return self._range_copies(self.detector.take_changes(self._device_bytes()))
        if self.now_versions == self.loaded_versions:
            return []
        replaced = set(self.replaced)
        moved = [i for i, (v, w) in enumerate(zip(self.now_versions, self.loaded_versions))
                 if v != w and i not in replaced]
        return tensor_copies(self.inventory, self.master, moved)

    def _replaced_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copies of the tensors given new storage, unless their bytes equal those loaded.

        ``enable_layerwise_casting`` upcasts a module's weights before each forward and casts them
        back after, into new storage with the same bytes: comparing on the device costs a read,
        where writing back would cost a copy to the host on every swap.
        """
        if not self.fitting:
            return []
        views = self.storage.views_for(self.key, self.inventory)
        tensors = self.inventory.tensors
        same = _same_bytes([(tensors[i], views[i]) for i in self.fitting])
        changed = [i for i, unchanged in zip(self.fitting, same) if not unchanged]
        return tensor_copies(self.inventory, self.master, changed)

    def _write_back_agreed(self) -> int:
        """A shared master: the ranks agree on what changed and one of them writes it.

        Tensors given new storage are first copied into their device bytes, so that one digest
        check sees every change; then `agree_write_back` (collective over the node's ranks)
        decides: nothing, one writer (the others wait at a barrier until the bytes are in the
        shared pages), or a `CollectiveError` on every rank before anything is written or
        re-pointed - the group stays resident, each rank keeping its device copy.
        """
        views = self.storage.views_for(self.key, self.inventory)
        for i in self.fitting:
            views[i].copy_(self.inventory.tensors[i].detach())
        device_bytes = self._device_bytes()
        if self.marked_dirty:
            ranges = [(0, self.inventory.layout.contiguous_nbytes)]
        else:
            ranges = self.detector.changed_windows(device_bytes)
        digest = digest_ranges(device_bytes, ranges) if ranges else None
        group = self.master.shared_group
        decision = agree_write_back(self.name, ranges, digest, group)
        copies = self._range_copies(list(decision.ranges)) if decision.writes else []
        self.storage.retire(copies)
        if decision.writer is not None:
            dist.barrier(group=group)
        if self.detector is not None:  # asked and answered: its reference is of no more use
            self.detector.forget()
        return _nbytes(copies)

    def _range_copies(self, ranges: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host slice, device slice) pairs that copy device byte `ranges` back into the
        master's chunks.

        `ranges` are ``(start, end)`` offsets into the group's device bytes (chunks laid end to
        end, chunk `i` from byte ``layout.chunk_base[i]``); alignment padding between chunks has
        no host counterpart and is skipped.
        """
        pairs, buffer = [], self.storage.buffer
        for base, chunk in zip(self.inventory.layout.chunk_base, self.master.chunks):
            for start, end in ranges:
                first, last = max(start, base), min(end, base + chunk.numel())
                if first < last:
                    pairs.append((chunk[first - base : last - base], buffer[first:last]))
        return pairs

    def _device_bytes(self) -> torch.Tensor:
        return self.storage.buffer[: self.inventory.layout.contiguous_nbytes]


def tensor_copies(inventory: Inventory, master: HostMaster,
                  indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (place in `master`, tensor) copies of tensors `indices` of `inventory`."""
    tensors, homes = inventory.tensors, master.views
    return [(homes[i], tensors[i].detach()) for i in indices]


def write_tensors(transport: Transport, inventory: Inventory, master: HostMaster,
                  indices: list[int]) -> int:
    """Copy tensors `indices` of `inventory` into their places in `master`, the host waiting
    for them; returns the bytes copied (a load that adopts tensors given new storage on the
    host: an eviction hands its copies to `DeviceStorage.retire`)."""
    if not indices:
        return 0
    copies = tensor_copies(inventory, master, indices)
    transport.to_host_synchronized(copies)  # the host may read the master right away
    return _nbytes(copies)


def copy_in(transport: Transport, inventory: Inventory, master: HostMaster,
            replaced: list[int]) -> set[int]:
    """Copy into `master` each of the tensors `replaced` (given new storage while offloaded:
    ``module.to(...)``) that still fits its place, and re-point it there; returns the indices
    taken (misfits are left as they are: `Residency.pending_change` reports them)."""
    left = {i for i, _ in inventory.misfits(master.views, replaced)}
    taken = [i for i in replaced if i not in left]
    write_tensors(transport, inventory, master, taken)
    homes, tensors = master.views, inventory.tensors
    repoint([tensors[i] for i in taken], [homes[i] for i in taken])
    return set(taken)


def _nbytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes the (host, device) copies `pairs` write to the host."""
    return sum(host.nbytes for host, _ in pairs)


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
