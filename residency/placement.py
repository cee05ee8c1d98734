"""Placement: which groups' bytes are on the device, in which storage, and how a switch happens.

The one answer to "what is on the device?".  It owns the device storages and carries out every
phase change (evict the current exclusive group, load the next, write the record), so the next
placement policies (layer mode's block slots, multi-rank's sharded copies) plug in here.

Fields (every one guarded by the scheduler lock; `Placement` is their one mutator):

* ``_exclusive_storages``: the two device buffers exclusive groups share.  The first is always used;
  the second only once `prefetch` needs room beside the current group.
* ``_planned``: every registered group, in registration order (the groups it may place).
  Invariant: each always-resident (policy RESIDENT) group in it is RESIDENT in a storage of its own.
* ``current``: the exclusive group on the device, or None.  Invariant: ``current.state`` is
  RESIDENT, its tensors view ``current.device_storage``, and no other exclusive group is RESIDENT.
* ``prefetched``: an exclusive group whose copy `prefetch` started, or None.  Invariant: it is
  LOADING into the exclusive storage that ``current`` does not use.
* ``block_slots``: the two device buffers layer-mode groups stream their blocks through (lent to
  each group's `residency.layers.BlockStream`), and ``_layer_storage``, the buffer a layer-mode
  group's own part (outside its streamed blocks) loads into.  Invariant: only the current group's
  stream has blocks in the slots.

[Note: layer mode holds no buffer sized for another group]
The exclusive buffers are sized for the largest module-mode group (a text encoder of 11 GB for
Wan2.2) and reused across its phases; layer mode exists to keep a phase's device bytes at the
group's part + two slots.  So a layer-mode group becoming current releases the exclusive buffers
(the caching allocator hands their memory to the slots and to activations), and a module-mode group
becoming current releases the layer storage and the slots.  Phases of one mode reuse that mode's
buffers (Wan2.2's two experts take turns in the same layer storage and slots); a switch between
modes costs a free and an allocation, never a copy more.

Which storage a group's tensors view is the group's own fact (`Residency.device_storage`, written
when a load finishes); placement reads it to choose a buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch
from torch.profiler import record_function

from residency.component import Residency
from residency.enums import Policy, ResidencyState
from residency.errors import DeviceMemoryError, RegistrationError
from residency.locks import CHECKING, check_held, in_context
from residency.memory import DeviceStorage
from residency.records import TransitionLog, TransitionRecord
from residency.transport import Transport

__all__ = ["Placement"]


def _adopt_nothing(group: Residency) -> None:
    """The default for `Placement.switch_to`: groups are taken as they are."""


class Placement:
    """The device side of a scheduler (see the module docstring); called with the lock held.

        placement.switch_to(dit)         # evict the current exclusive group, load `dit`, record it
        placement.current is dit         # True
    """

    def __init__(
        self,
        lock: threading.RLock,
        transport: Transport,
        *,
        device: torch.device,
        device_memory_limit: int | None,
        transitions: TransitionLog,
    ) -> None:
        self._lock = lock
        self._transport = transport
        self.device = device
        self.device_memory_limit = device_memory_limit
        #: The scheduler's log: appended to here (under the lock); it has its own lock for readers.
        self._transitions = transitions
        self._exclusive_storages = (DeviceStorage(transport), DeviceStorage(transport))
        #: Layer mode's buffers (see the module docstring); guarded by the lock.
        self.block_slots = (DeviceStorage(transport), DeviceStorage(transport))
        self._layer_storage = DeviceStorage(transport)  # guarded by the lock
        self._planned: list[Residency] = []  # guarded by the lock
        self.current: Residency | None = None  # guarded by the lock
        self.prefetched: Residency | None = None  # guarded by the lock

    # -- queries --------------------------------------------------------------------------------

    @property
    def device_nbytes(self) -> int:
        """Bytes of every device storage that exists now (the shared buffers included)."""
        storages = {id(s): s for s in self._mode_storages()}
        for group in self._planned:
            if not group.exclusive and group.device_storage is not None:
                storages[id(group.device_storage)] = group.device_storage
        return sum(storage.nbytes for storage in storages.values())

    def resident_names(self) -> list[str]:
        """Names of the groups whose weights are on the device now, in registration order."""
        return [g.name for g in self._planned if not g.exclusive or g is self.current]

    def spans(self) -> list[tuple[int, int, Residency]]:
        """[start, end) host and device addresses of every planned group's bytes."""
        spans = []
        for group in self._planned:
            parts = [group] if group.blocks is None else [group, *group.blocks.blocks]
            for chunk in (chunk for part in parts for chunk in part.host_master.chunks):
                spans.append((chunk.data_ptr(), chunk.data_ptr() + chunk.numel(), group))
            for part in parts:  # the group's device storage, and its blocks' slots
                storage = part.device_storage
                if part.is_resident and storage is not None and storage.buffer is not None:
                    start = storage.buffer.data_ptr()
                    spans.append((start, start + storage.buffer.numel(), group))
        return spans

    def check_budget(self, name: str, needs: Iterable[tuple[Policy, int]]) -> None:
        """Refuse a group whose device bytes, with those of `needs` (every group and claim,
        the new one last), would exceed ``device_memory_limit``."""
        limit = self.device_memory_limit
        if limit is None:
            return
        needs = list(needs)
        exclusive = max((n for p, n in needs if p is Policy.EXCLUSIVE), default=0)
        planned = exclusive + sum(n for p, n in needs if p is Policy.RESIDENT)
        if planned > limit:
            raise RegistrationError(
                f"cannot add group {name!r}: it needs {needs[-1][1]} bytes of device memory, "
                f"and with the groups already registered the device would need {planned} bytes, "
                f"over device_memory_limit={limit}. Raise the limit or split the group"
            )

    # -- admitting and withdrawing groups --------------------------------------------------------

    def admit(self, group: Residency) -> None:
        """Plan a place for a newly registered group; an always-resident group is loaded now.

        If that load fails the group is not admitted and the error propagates.
        """
        if CHECKING:
            check_held(self._lock)
        if group.exclusive:
            self._planned.append(group)
            self._update_size_hints()
            return
        start = time.perf_counter()
        nbytes = in_context(record_function(f"residency::load {group.name}"), group._load,
                            DeviceStorage(self._transport))
        self._planned.append(group)
        self._record(None, group, nbytes, 0, start, start)

    def withdraw(self, group: Residency, *, evict: bool) -> None:
        """Forget `group` and drop its views and storage.

        With `evict`, a resident group is evicted first (changes written back; tensors that no
        longer fit their place are kept as the user made them, on the host).  Without, its
        tensors keep viewing the device bytes (`refresh` re-packs them from there).
        """
        if CHECKING:
            check_held(self._lock)
        try:
            self._withdraw(group, evict)
        except BaseException:  # see [Note: interrupts] in residency.scheduler
            self.settle()
            raise

    def _withdraw(self, group: Residency, evict: bool) -> None:
        self.cancel_prefetch()
        if evict and group.is_resident:
            self._evict(group, repack=False)
        if group.blocks is not None:
            group.blocks.close()
        if self.current is group:
            self.current = None
        for storage in {*self._mode_storages(), group.device_storage} - {None}:
            storage.forget(group)
        if not group.exclusive and group.device_storage is not None:
            group.device_storage.release()
        if group in self._planned:
            self._planned.remove(group)
        self._update_size_hints()

    # -- phase changes ---------------------------------------------------------------------------

    def switch_to(
        self, group: Residency | None, adopt: Callable[[Residency], None] = _adopt_nothing
    ) -> None:
        """Evict the current exclusive group and load `group` (None: leave the device empty).

        `adopt(g)` re-packs a group whose modules changed (see `Residency.pending_change`) before
        its load, and the evicted group right away when its eviction left re-typed tensors on the
        host (so every tensor of an offloaded group stays in its master).  Other changes of the
        evicted group (tensors added while it was resident) are adopted at its next load: a phase
        change checks one group's structure, not two.  Called with no holders.  On failure, the
        device holds no exclusive group.
        """
        if CHECKING:
            check_held(self._lock)
        try:
            self._switch(group, adopt)
        except BaseException:  # see [Note: interrupts] in residency.scheduler
            self.settle()
            raise

    def _switch(self, group: Residency | None, adopt: Callable[[Residency], None]) -> None:
        previous, start, written = self.current, time.perf_counter(), 0
        if previous is not None:
            written = in_context(record_function(f"residency::evict {previous.name}"),
                                 self._evict, previous)
            self.current = None
            if previous.left_misfits:
                adopt(previous)
        self._release_other_mode(group)
        evicted, nbytes = time.perf_counter(), 0
        if group is not None:
            if group is self.prefetched and group.pending_change() is not None:
                self.cancel_prefetch()  # changed since its copy began: re-packed, then loaded
            adopt(group)
            nbytes = in_context(record_function(f"residency::load {group.name}"),
                                self._load_and_stream, group)
            self.current = group
        self._record(previous, group, nbytes, written, start, evicted)

    def settle(self) -> None:
        """Make ``current`` and ``prefetched`` agree with the groups' own states after a step
        that stopped half-way (see [Note: interrupts] in `residency.scheduler`): a load that did
        not commit is cancelled; a load or eviction that did is taken as done; each stream is
        running exactly when its group is current."""
        if CHECKING:
            check_held(self._lock)
        candidates = [g for g in {*self._planned, self.current, self.prefetched} - {None}
                      if g.exclusive]
        if self.prefetched is not None and self.prefetched.state is not ResidencyState.LOADING:
            self.prefetched = None
        for group in candidates:
            if group.state is ResidencyState.LOADING and group is not self.prefetched:
                group._cancel_load()
        resident = [g for g in candidates if g.is_resident]
        self.current = resident[0] if resident else None
        for group in candidates:
            if group.blocks is not None:
                group.blocks.settle(running=group is self.current)

    def forget_views(self, group: Residency) -> None:
        """Drop every storage's cached views of `group` (its layout is about to change)."""
        if CHECKING:
            check_held(self._lock)
        for storage in {*self._mode_storages(), group.device_storage} - {None}:
            storage.forget(group)

    def prefetch(self, group: Residency) -> bool:
        """Start copying exclusive `group` beside the current one when there is room (see
        `Scheduler.prefetch`); returns whether a copy was started."""
        if CHECKING:
            check_held(self._lock)
        try:
            return self._prefetch(group)
        except BaseException:  # see [Note: interrupts] in residency.scheduler
            self.settle()
            raise

    def _prefetch(self, group: Residency) -> bool:
        if not group.exclusive or group is self.current or group is self.prefetched:
            return False
        if group.pending_change() is not None:  # re-packed at its phase, not beside another
            return False
        if group.sharded is not None:  # its load is collective: at the phase, on every rank
            return False
        if group.blocks is not None:  # see [Note: layer mode holds no buffer sized for another]
            return False
        if not self._room_for_prefetch(group):
            return False
        self.cancel_prefetch()
        try:
            group._begin_load(self._free_storage(group), watch_edits=True)
        except DeviceMemoryError:  # no memory info to ask first: the allocator said no
            return False
        self.prefetched = group  # an interrupt before this line: `settle` cancels the copy
        return True

    def cancel_prefetch(self) -> None:
        if CHECKING:
            check_held(self._lock)
        prefetched = self.prefetched
        if prefetched is not None:
            self.prefetched = None  # first: `settle` completes an interrupted cancel
            prefetched._cancel_load()

    def offload_all(self, adopt: Callable[[Residency], None] = _adopt_nothing) -> None:
        """Evict the current exclusive group and free the shared buffers (`adopt`: as in
        `switch_to`)."""
        if CHECKING:
            check_held(self._lock)
        try:
            self._offload_all(adopt)
        except BaseException:  # see [Note: interrupts] in residency.scheduler
            self.settle()
            raise

    def _offload_all(self, adopt: Callable[[Residency], None]) -> None:
        self.cancel_prefetch()
        if self.current is not None:
            self.switch_to(None, adopt)
        self.release_shared()

    def release_shared(self) -> None:
        if CHECKING:
            check_held(self._lock)
        for storage in self._mode_storages():
            storage.release()

    # -- layer mode ------------------------------------------------------------------------------

    def _load_and_stream(self, group: Residency) -> int:
        """Load `group`; a layer-mode group's blocks then start streaming.  If that fails (no
        device memory for a slot), the group is evicted again and the error propagates."""
        nbytes = self._load(group)
        if group.blocks is None:
            return nbytes
        try:
            group.blocks.start()
            return nbytes
        except BaseException:
            if group.is_resident:
                self._evict(group)
            raise

    def _evict(self, group: Residency, *, repack: bool = True) -> int:
        """Evict a resident group, its streamed blocks first (re-packing one re-typed in its
        slot, unless `repack` is False: the group is being withdrawn); returns bytes written."""
        written = group.blocks.stop(repack=repack) if group.blocks is not None else 0
        try:
            return written + group._evict()
        except BaseException:  # the group stays resident (a refused write-back): so do its blocks
            if group.blocks is not None:
                group.blocks.start()
            raise

    def _release_other_mode(self, group: Residency | None) -> None:
        """Free the buffers of the mode `group` is not in (see [Note: layer mode holds no buffer
        sized for another group]); None frees nothing (an eviction keeps buffers for reuse)."""
        if group is None:
            return
        if group.blocks is None:
            others = (self._layer_storage, *self.block_slots)
        else:
            if self.prefetched is not group:
                self.cancel_prefetch()  # a module-mode copy may be under way into them
            others = self._exclusive_storages
        for storage in others:
            storage.release()

    def _mode_storages(self) -> tuple[DeviceStorage, ...]:
        return (*self._exclusive_storages, self._layer_storage, *self.block_slots)

    # -- helpers ---------------------------------------------------------------------------------

    def _load(self, group: Residency) -> int:
        if group is self.prefetched:
            self.prefetched = None
            return group._finish_load()
        self.cancel_prefetch()
        return group._load(self._free_storage(group))

    def _free_storage(self, group: Residency) -> DeviceStorage:
        """The shared buffer `group` should load into: its last one, unless the current group
        uses it."""
        if group.blocks is not None:
            return self._layer_storage
        occupied = self.current.device_storage if self.current is not None else None
        first, second = self._exclusive_storages
        last = group.device_storage if group.device_storage in self._exclusive_storages else first
        if last is not occupied:
            return last
        return second if occupied is first else first

    def _room_for_prefetch(self, group: Residency) -> bool:
        """Whether the buffer `group` would be copied into fits beside everything already held.

        Without `device_memory_limit`, the device's free memory decides; where the backend cannot
        tell it, the answer is yes, and `prefetch` takes the allocator's out-of-memory as no.
        """
        storage = self._free_storage(group)
        needed = max(group.inventory.layout.contiguous_nbytes, storage.size_hint)
        growth = 0 if storage.nbytes >= needed and not storage.is_aliased() else needed
        if self.device_memory_limit is not None:
            held = self.device_nbytes - (storage.nbytes if growth else 0)
            return held + growth <= self.device_memory_limit
        free = _free_device_memory(self.device)
        return free is None or growth <= free

    def _update_size_hints(self) -> None:
        """Size the shared buffers for the largest exclusive group, so each is allocated once."""
        modules = [g for g in self._planned if g.exclusive and g.blocks is None]
        layers = [g for g in self._planned if g.blocks is not None]
        for storage in self._exclusive_storages:
            storage.size_hint = max((g.inventory.layout.contiguous_nbytes for g in modules),
                                    default=0)
        self._layer_storage.size_hint = max(
            (g.inventory.layout.contiguous_nbytes for g in layers), default=0)
        for slot in self.block_slots:
            slot.size_hint = max((g.blocks.slot_nbytes for g in layers), default=0)

    def _record(
        self,
        previous: Residency | None,
        group: Residency | None,
        nbytes: int,
        written: int,
        start: float,
        evicted: float,
    ) -> None:
        self._transitions.append(
            TransitionRecord(
                from_group=previous.name if previous is not None else None,
                to_group=group.name if group is not None else None,
                nbytes=nbytes,
                written_back=written,
                start=start,
                evict_seconds=evicted - start,
                load_seconds=time.perf_counter() - evicted,
                thread=threading.current_thread().name,
            )
        )


def _free_device_memory(device: torch.device) -> int | None:
    """Free bytes on `device` by the device-generic API; None on the CPU or where the backend
    has no memory information (a PrivateUse1 allocator may not implement it)."""
    if device.type == "cpu":
        return None
    try:
        free, _ = torch.accelerator.get_memory_info(device.index)
    except (RuntimeError, NotImplementedError):
        return None
    return free
