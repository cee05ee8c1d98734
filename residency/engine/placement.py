"""Placement: which groups' bytes are on the device, in which storage, and how a switch happens.

The one answer to "what is on the device?".  It carries out every group's plan
(`residency.engine.plan`) at every phase change: the swapped own part of the current exclusive
group is evicted and the next one's loaded into its mode's buffer, the streams of both are stopped
and started, a kept own part was loaded at registration; then the record is written.  Streamed
parts move through the block slots by the slots' placement (`residency.engine.slots`), which this
object owns and lends to every stream.  No branch here asks which mode a group is in: the plan's
answers (`Plan.mode`, `Plan.prefetchable`, `Plan.own`) and the group's streams (none when nothing
streams) carry every plan out the same way.

Fields (every one guarded by the scheduler lock; `Placement` is their one mutator):

* ``_planned``: every registered group, in registration order (the groups it may place).
  Invariant: each always-resident (policy RESIDENT) group in it is RESIDENT in a storage of its own.
* ``current``: the exclusive group on the device, or None.  Invariant: ``current.state`` is
  RESIDENT, its tensors view ``current.device_storage``, and no other exclusive group is RESIDENT.
* ``prefetched``: an exclusive group whose copy `prefetch` started, or None.  Invariant: it is
  LOADING into the exclusive buffer that ``current`` does not use.
* The reused buffers are `residency.engine.buffers.DeviceBuffers`'s (``_buffers``; set once).  Invariant:
  only the current group's stream has blocks in the block slots.

Calls go down from here: to the groups (their transitions), to their streams, to `Adoption` (a
changed group is re-packed), to the slots' placement and to the buffers; nothing here calls the
facade or the holds.

Which storage a group's tensors view is the group's own fact (`Residency.device_storage`, written
when a load finishes); placement reads it to choose a buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch
from torch.profiler import record_function

from residency.engine.adoption import Adoption, check_budget
from residency.engine.buffers import DeviceBuffers
from residency.engine.component import Residency
from residency.engine.enums import Policy, ResidencyState
from residency.engine.errors import DeviceMemoryError
from residency.engine.locks import CHECKING, check_held, in_context
from residency.engine.memory import DeviceStorage
from residency.engine.plan import Where
from residency.engine.records import TransitionLog, TransitionRecord
from residency.engine.slots import SlotPlacement
from residency.engine.transport import Transport

__all__ = ["Placement"]


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
        buffers: DeviceBuffers,
        adoption: Adoption,
        transitions: TransitionLog,
    ) -> None:
        self._lock = lock
        self._transport = transport
        self.device = device
        self._buffers = buffers
        self._adoption = adoption
        #: The scheduler's log: appended to here (under the lock); it has its own lock for readers.
        self._transitions = transitions
        #: The placement of streamed parts in the block slots (lent to every group's stream).
        self.slots = SlotPlacement(buffers.block_slots, adoption)
        self._planned: list[Residency] = []  # guarded by the lock
        self.current: Residency | None = None  # guarded by the lock
        self.prefetched: Residency | None = None  # guarded by the lock

    # -- queries --------------------------------------------------------------------------------

    @property
    def device_memory_limit(self) -> int | None:
        """The scheduler's device budget (`Adoption`'s, which checks it), or None."""
        return self._adoption.device_memory_limit

    @property
    def device_nbytes(self) -> int:
        """Bytes of every device storage that exists now (the shared buffers included)."""
        own = {id(g.device_storage): g.device_storage for g in self._planned
               if not g.exclusive and g.device_storage is not None}
        return self._buffers.nbytes + sum(storage.nbytes for storage in own.values())

    def resident_names(self) -> list[str]:
        """Names of the groups whose weights are on the device now, in registration order."""
        return [g.name for g in self._planned if not g.exclusive or g is self.current]

    def check_budget(self, name: str, needs: Iterable[tuple[Policy, int]]) -> None:
        """Refuse a group whose device bytes, with those of `needs` (every group and claim,
        the new one last), would exceed ``device_memory_limit``."""
        check_budget(self.device_memory_limit, name, needs)

    # -- admitting and withdrawing groups --------------------------------------------------------

    def admit(self, group: Residency) -> None:
        """Take a newly registered group's plan: a kept own part (policy 'resident') is loaded
        now, into a storage of its own; a swapped one waits for its phase.

        If that load fails the group is not admitted and the error propagates.
        """
        if CHECKING:
            check_held(self._lock)
        if group.plan.own.where is not Where.KEPT:
            self._planned.append(group)
            self._buffers.size_for(self._planned)
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
        except BaseException:  # see [Note: interrupts] in residency.engine.scheduler
            self.settle()
            raise

    def _withdraw(self, group: Residency, evict: bool) -> None:
        self.cancel_prefetch()
        if evict and group.is_resident:
            self._evict(group, repack=False)
        for stream in group.streams:
            stream.close()
        if self.current is group:
            self.current = None
        self._buffers.forget(group)
        if not group.exclusive and group.device_storage is not None:
            group.device_storage.release()
        if group in self._planned:
            self._planned.remove(group)
        self._buffers.size_for(self._planned)

    # -- phase changes ---------------------------------------------------------------------------

    def switch_to(self, group: Residency | None) -> None:
        """Evict the current exclusive group and load `group` (None: leave the device empty).

        A group whose modules changed (see `Residency.pending_change`) is re-packed before its
        load, and the evicted group right away when its eviction left re-typed tensors on the
        host (so every tensor of an offloaded group stays in its master): `residency.engine.adoption`.
        Other changes of the evicted group (tensors added while it was resident) are adopted at
        its next load: a phase change checks one group's structure, not two.  Called with no
        holders.  On failure, the device holds no exclusive group.
        """
        if CHECKING:
            check_held(self._lock)
        try:
            self._switch(group)
        except BaseException:  # see [Note: interrupts] in residency.engine.scheduler
            self.settle()
            raise

    def _switch(self, group: Residency | None) -> None:
        previous, start, written = self.current, time.perf_counter(), 0
        if previous is not None:
            written = in_context(record_function(f"residency::evict {previous.name}"),
                                 self._evict, previous)
            self.current = None
            if previous.left_misfits:
                self._adoption.adopt(previous)
        evicted, nbytes = time.perf_counter(), 0
        if group is not None:
            storage = self._make_room(group)
            replaced = self._adopt_before_load(group)
            nbytes = in_context(record_function(f"residency::load {group.name}"),
                                self._load_parts, group, storage, replaced)
            self.current = group
        self._record(previous, group, nbytes, written, start, evicted)

    def _adopt_before_load(self, group: Residency) -> list[int]:
        """Re-pack `group` if its modules changed (a prefetch of it is abandoned first);
        returns the tensors given new storage on the host that still fit their places, from
        the one pass over its data pointers this load makes."""
        change, replaced = group.changes_on_host()
        if change is None:
            return replaced
        if group is self.prefetched:
            self.cancel_prefetch()  # changed since its copy began: re-packed, then loaded
        self._adoption.adopt(group, change=change)
        return []  # packing re-pointed every tensor to the new master

    def settle(self) -> None:
        """Make ``current`` and ``prefetched`` agree with the groups' own states after a step
        that stopped half-way (see [Note: interrupts] in `residency.engine.scheduler`): a load that did
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
            for stream in group.streams:
                stream.settle(running=group is self.current)

    def prefetch(self, group: Residency) -> bool:
        """Start copying exclusive `group` beside the current one when there is room (see
        `Scheduler.prefetch`); returns whether a copy was started."""
        if CHECKING:
            check_held(self._lock)
        try:
            return self._prefetch(group)
        except BaseException:  # see [Note: interrupts] in residency.engine.scheduler
            self.settle()
            raise

    def _prefetch(self, group: Residency) -> bool:
        if not group.plan.prefetchable or group is self.current or group is self.prefetched:
            return False
        change, replaced = group.changes_on_host()
        if change is not None:  # re-packed at its phase, not beside another
            return False
        if group.sharded is not None:  # its load is collective: at the phase, on every rank
            return False
        if not self._room_for_prefetch(group):
            return False
        self.cancel_prefetch()
        try:
            group._begin_load(self._free_storage(group), watch_edits=True, replaced=replaced)
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

    def offload_all(self) -> None:
        """Evict the current exclusive group and free the shared buffers."""
        if CHECKING:
            check_held(self._lock)
        try:
            self._offload_all()
        except BaseException:  # see [Note: interrupts] in residency.engine.scheduler
            self.settle()
            raise

    def _offload_all(self) -> None:
        self.cancel_prefetch()
        if self.current is not None:
            self.switch_to(None)
        self.release_shared()

    def release_shared(self) -> None:
        if CHECKING:
            check_held(self._lock)
        self._buffers.free_all()

    # -- a group's parts --------------------------------------------------------------------------

    def _load_parts(self, group: Residency, storage: DeviceStorage, replaced: list[int]) -> int:
        """Load `group`'s own part (into `storage`, unless prefetched), then start its streams.
        If a stream cannot start (no device memory for a slot), the group is evicted again and
        the error propagates."""
        nbytes = self._load(group, storage, replaced)
        try:
            for stream in group.streams:
                stream.start()
            return nbytes
        except BaseException:
            if group.is_resident:
                self._evict(group)
            raise

    def _evict(self, group: Residency, *, repack: bool = True) -> int:
        """Evict a resident group: its stream's parts first (re-packing one re-typed in its slot,
        unless `repack` is False: the group is being withdrawn), then its own part; returns bytes
        written.  If the own part's eviction is refused (a write-back on a shared master), the
        group stays resident and the caller's `settle` starts its stream again."""
        written = sum(stream.stop(repack=repack) for stream in group.streams)
        return written + group._evict()

    def _make_room(self, group: Residency) -> DeviceStorage:
        """Free the buffers of the modes `group` is not in (see [Note: layer mode holds no buffer
        sized for another group] in `residency.engine.buffers`), cancelling a prefetch into them
        first; returns the buffer it loads into (called with no group current)."""
        prefetched = self.prefetched
        if prefetched is not None and prefetched.plan.mode != group.plan.mode:
            self.cancel_prefetch()
        return self._buffers.make_room(group)

    # -- helpers ---------------------------------------------------------------------------------

    def _load(self, group: Residency, storage: DeviceStorage, replaced: list[int]) -> int:
        if group is self.prefetched:
            self.prefetched = None
            return group._finish_load()
        self.cancel_prefetch()
        return group._load(storage, replaced=replaced)

    def _free_storage(self, group: Residency) -> DeviceStorage:
        """The shared buffer `group` should load into: its last one, unless the current group
        uses it."""
        return self._buffers.free_for(group, self.current)

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
