"""Placement: which groups' bytes are on the device, in which storage, and how a switch happens.

The one answer to "what is on the device?".  It carries out every group's plan
(`residency.group.plan`) at every phase change: what the current exclusive group swaps is evicted
(its swapped own part, its parts swapped apart) and what the next one swaps is loaded (the own part
into its mode's buffer, or under an auto plan into a storage of its own), the streams of both are
stopped and started, and what a plan keeps stays; then the record is written.  Streamed parts move
through the block slots by the slots' placement (`residency.placement.slots`), parts placed whole
apart from the own part by `residency.placement.apart`; this object owns both and lends the slots to
every stream.  An auto plan is carried out by `replan`.  No branch here asks which mode a group is
in: the plan's answers (`Plan.mode`, `Plan.prefetchable`, `Plan.own`, `Plan.reuses_buffers`), the
group's parts apart and its streams (none when nothing streams) carry every plan out the same way.

Fields (every one guarded by the scheduler lock; `Placement` is their one mutator, but for
``budget``, which the auto owner writes when it plans):

* ``_planned``: every registered group, in registration order (the groups it may place).
  Invariant: what each group's plan keeps is RESIDENT in storages of their own (after an
  interrupted step a kept part may be on its master until the group's next phase loads it).
* ``current``: the exclusive group whose phase holds the device, or None.  Invariant:
  ``current.state`` is RESIDENT, its tensors view ``current.device_storage``, its parts apart are
  RESIDENT, and no other exclusive group whose own part is swapped is RESIDENT (under an auto plan
  other groups' kept parts stay: the budget bounds the device bytes, invariant 11).
* ``prefetched``: an exclusive group whose copy `prefetch` started, or None.  Invariant: it is
  LOADING into the exclusive buffer that ``current`` does not use.
* ``budget``: an auto plan's weights budget, which a prefetch may not exceed; None: fixed plans.
* The reused buffers are `DeviceBuffers`' (``_device_buffers``; set once; below).  Invariant:
  only the current group's stream has blocks in the block slots.

Calls go down from here: to the groups (their transitions), to their streams, to `Adoption` (a
changed group is re-packed), to the slots' and the parts' placements; nothing here calls the
facade or the holds.

`DeviceBuffers`: the device buffers a scheduler reuses across phases, and which one a group loads
into.

    buffers = DeviceBuffers(transport)
    storage = buffers.buffer_for(dit, current=encoder)    # the exclusive buffer the encoder is not in
    storage = buffers.make_room(dit)                    # a module-mode group frees layer mode's

Its fields (set once; their contents are `DeviceStorage`s, each the owner of its own bytes; used
with the scheduler lock held, by `Placement` and `residency.placement.adoption` only):

* ``exclusive``: the two buffers module-mode exclusive groups share.  The first is always used; the
  second only once a prefetch needs room beside the current group.
* ``block_slots``: the two buffers layer-mode groups stream their blocks through (lent to each
  group's `residency.placement.layers.BlockStream`).
* ``layer``: the buffer a layer-mode group's own part (outside its streamed blocks) loads into.

[Note: layer mode holds no buffer sized for another group]
The exclusive buffers are sized for the largest module-mode group (a text encoder of 11 GB for
Wan2.2) and reused across its phases; layer mode exists to keep a phase's device bytes at the
group's part + two slots.  So a layer-mode group becoming current releases the exclusive buffers
(the caching allocator hands their memory to the slots and to activations), and a module-mode group
becoming current releases the layer buffer and the slots.  Phases of one mode reuse that mode's
buffers (Wan2.2's two experts take turns in the same layer buffer and slots); a switch between
modes costs a free and an allocation, never a copy more.

Which storage a group's tensors view is the group's own fact (`Residency.device_storage`, written
when a load finishes); placement reads it to choose a buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import attrs
import torch
from torch.profiler import record_function

from residency.placement.adoption import Adoption, check_budget
from residency.placement.apart import PartsApart
from residency.placement.mover import PartMover
from residency.group.residency import Residency
from residency.core.enums import Policy, ResidencyState
from residency.core.errors import DeviceMemoryError
from residency.core.locks import CHECKING, check_held, in_context
from residency.placement.layers import take_plan
from residency.group.plan import Plan, Where
from residency.group.records import BlockLog, TransitionLog, TransitionRecord, TurnChoice
from residency.placement.slots import SlotPlacement
from residency.device.transport import DeviceStorage, Transport, free_device_memory

__all__ = ["DeviceBuffers", "Placement"]


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
        block_log: BlockLog,
    ) -> None:
        self._lock = lock
        self._transport = transport
        self.device = device
        self._device_buffers = buffers
        self._adoption = adoption
        #: The scheduler's log: appended to here (under the lock); it has its own lock for readers.
        self._transitions = transitions
        #: The placement of streamed parts in the block slots (lent to every group's stream).
        mover = PartMover(adoption, buffers.all)
        self.slots = SlotPlacement(buffers.block_slots, mover)
        #: The placement of parts placed whole apart from their own part (an auto plan's).
        self.apart = PartsApart(mover, transport, buffers.all)
        self._block_log = block_log
        self._planned: list[Residency] = []  # guarded by the lock
        self.current: Residency | None = None  # guarded by the lock
        self.prefetched: Residency | None = None  # guarded by the lock
        #: An auto plan's weights budget, written by `residency.auto.auto` when it plans: what a
        #: prefetch may not exceed when no ``device_memory_limit`` is set; None: the fixed plans.
        self.budget: int | None = None  # guarded by the lock

    # -- queries --------------------------------------------------------------------------------

    @property
    def device_memory_limit(self) -> int | None:
        """The scheduler's device budget (`Adoption`'s, which checks it), or None."""
        return self._adoption.device_memory_limit

    @property
    def device_nbytes(self) -> int:
        """Bytes of every device storage that exists now (the shared buffers included)."""
        own = {id(g.device_storage): g.device_storage for g in self._planned
               if g.device_storage is not None and g.device_storage not in self._device_buffers.all}
        own.update((id(s), s) for g in self._planned for s in self.apart.held(g))
        return self._device_buffers.nbytes + sum(storage.nbytes for storage in own.values())

    def resident_names(self) -> list[str]:
        """Names of the groups whose weights are on the device now, in registration order: the
        current group and those whose plan keeps every byte (a partly kept group is not one)."""
        return [g.name for g in self._planned if g.plan.wholly_kept or g is self.current]

    def check_budget(self, name: str, needs: Iterable[tuple[Policy, int]]) -> None:
        """`adoption.check_budget` against ``device_memory_limit``."""
        check_budget(self.device_memory_limit, name, needs)

    # -- admitting and withdrawing groups --------------------------------------------------------

    def admit(self, group: Residency) -> None:
        """Take a newly registered group's plan: what it keeps (a 'resident' group) is loaded
        now, into storages of its own.  If that load fails, the group is not admitted."""
        if CHECKING:
            check_held(self._lock)
        start = time.perf_counter()
        nbytes = in_context(record_function(f"residency::load {group.name}"),
                            self.apart.load_kept, group)
        self._planned.append(group)
        self._device_buffers.size_for(self._planned)
        if nbytes:
            self._record(None, group, nbytes, 0, start, start)

    def remove(self, group: Residency, *, evict: bool) -> None:
        """Forget `group` and drop its views and storage.  With `evict`, what is on the device is
        evicted first (changes written back; tensors that no longer fit their place are kept as
        the user made them, on the host); without, its tensors keep viewing the device bytes."""
        if CHECKING:
            check_held(self._lock)
        self._settled(self._remove, group, evict)

    def _remove(self, group: Residency, evict: bool) -> None:
        self.cancel_prefetch()
        if evict:
            self._evict(group, repack=False)
        for stream in group.streams:
            stream.close()
        if self.current is group:
            self.current = None
        self._device_buffers.forget(group)
        if group.device_storage is not None and group.device_storage not in self._device_buffers.all:
            group.device_storage.release()
        if group in self._planned:
            self._planned.remove(group)
        self._device_buffers.size_for(self._planned)

    # -- phase changes ---------------------------------------------------------------------------

    def switch_to(self, group: Residency | None, chosen: TurnChoice | None = None) -> None:
        """Evict the current exclusive group and load `group` (None: leave the device empty);
        `chosen`: why the order of turns chose it, for the record.

        A group whose modules changed (`Residency.pending_change`) is re-packed before its load,
        and the evicted group at once when its eviction left re-typed tensors on the host
        (`residency.placement.adoption`); its other changes are adopted at its next load: a phase
        change checks one group's structure.  No holders.  On failure, no group is current."""
        if CHECKING:
            check_held(self._lock)
        self._settled(self._switch, group, chosen)

    def _switch(self, group: Residency | None, chosen: TurnChoice | None) -> None:
        previous, start, written = self.current, time.perf_counter(), 0
        if previous is not None:
            written = in_context(record_function(f"residency::evict {previous.name}"),
                                 self._leave, previous)
            self.current = None
            if previous.left_misfits:
                self._adoption.adopt(previous)
        evicted, nbytes = time.perf_counter(), 0
        if group is not None:
            storage = self._make_room(group)
            replaced = self._adopt_before_load(group) if _moves_own(group) else []
            nbytes = in_context(record_function(f"residency::load {group.name}"),
                                self._load_parts, group, storage, replaced)
            self.current = group
        self._record(previous, group, nbytes, written, start, evicted, chosen=chosen)

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
        that stopped half-way (see [Note: interrupts] in `residency.scheduler.scheduler`): a load that did
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
                group.cancel_load()
        moved = [g for g in candidates if g.is_resident and _moves_own(g)]
        kept = self.current if self.current in candidates and self.current.is_resident else None
        current = moved[0] if moved else kept
        if current is not None and not self.apart.all_placed(current):
            self._leave(current)  # a part of it did not arrive: its next phase loads it all
            current = None
        self.current = current
        for group in candidates:
            if group is not current:
                self.apart.evict(group, Where.SWAPPED)
            for stream in group.streams:
                stream.settle(running=group is current)

    def prefetch(self, group: Residency) -> bool:
        """Start copying exclusive `group` beside the current one when there is room (see
        `Scheduler.prefetch`); returns whether a copy was started."""
        if CHECKING:
            check_held(self._lock)
        return self._settled(self._prefetch, group)

    def _prefetch(self, group: Residency) -> bool:
        if not group.plan.prefetchable or group is self.current or group is self.prefetched:
            return False
        change, replaced = group.changes_on_host()
        if change is not None:  # re-packed at its phase, not beside another
            return False
        if group.sharded is not None or group.host_master.still_reading:
            return False  # a collective load (every rank, at the phase), or one read behind
        if not self._room_for_prefetch(group):
            return False
        self.cancel_prefetch()
        try:
            group.begin_load(self._buffer_for(group), watch_edits=True, replaced=replaced)
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
            prefetched.cancel_load()

    def offload_all(self) -> None:
        """Evict the current exclusive group and free the shared buffers."""
        if CHECKING:
            check_held(self._lock)
        self._settled(self._offload_all)

    def _offload_all(self) -> None:
        self.cancel_prefetch()
        if self.current is not None:
            self.switch_to(None)
        self.release_shared()

    def release_shared(self) -> None:
        if CHECKING:
            check_held(self._lock)
        self._device_buffers.release_all()

    def replan(self, group: Residency, plan: Plan) -> None:
        """Carry out a new `plan` for `group` (an auto scheduler's; no holders): the current
        group leaves, what the plan no longer keeps is evicted, a stream takes the streamed
        parts (`take_plan`), then what it keeps is loaded: the device never holds more than the
        larger of the two plans.  Loads are recorded as a transition into the group.  Each step
        reads where the last one ended: after an interrupt `settle` makes the owners agree, and
        the same call carries the plan out."""
        if CHECKING:
            check_held(self._lock)
        self._settled(self._replan, group, plan)

    def _replan(self, group: Residency, plan: Plan) -> None:
        self.cancel_prefetch()
        if self.current is not None:
            self.switch_to(None)
        start, written = time.perf_counter(), self.apart.evict_unkept(group, plan)
        if group.plan != plan:
            take_plan(group, plan, slots=self.slots, lock=self._lock, log=self._block_log)
        nbytes = self.apart.load_kept(group)
        self._device_buffers.size_for(self._planned)
        if nbytes or written:
            self._record(None, group, nbytes, written, start, start)

    # -- a group's parts --------------------------------------------------------------------------

    def _load_parts(self, group: Residency, storage: DeviceStorage, replaced: list[int]) -> int:
        """Load `group`'s swapped own part (into `storage`, unless prefetched), what it keeps and
        is not on the device (after an interrupted step), its parts swapped apart; start its
        streams.  On failure (no device memory) the group leaves again and the error propagates."""
        nbytes = self._load(group, storage, replaced) if _moves_own(group) else 0
        try:
            nbytes += self.apart.load_for_phase(group) if group.apart else 0  # none: no call
            for stream in group.streams:
                stream.start()
            return nbytes
        except BaseException:
            if group.is_resident:
                self._leave(group)
            raise

    def _leave(self, group: Residency) -> int:
        """`group` leaves for another group's phase: its streams stop, what it swaps is evicted,
        what it keeps stays; returns the bytes written back (see `_evict`)."""
        written = sum(stream.stop() for stream in group.streams)
        written += self.apart.evict(group, Where.SWAPPED) if group.apart else 0  # none: no call
        if _moves_own(group) and group.state is ResidencyState.RESIDENT:
            written += group.evict()
            if not group.plan.reuses_buffers:
                group.device_storage.release()
        return written

    def _evict(self, group: Residency, *, repack: bool = True) -> int:
        """Evict every byte of `group`: its streams' parts (re-packing one re-typed in its slot
        unless `repack` is False: it is being withdrawn), its parts apart, its own part; returns
        bytes written.  An own part's eviction refused (a write-back on a shared master) leaves
        it resident; the caller's `settle` starts its stream again."""
        written = sum(stream.stop(repack=repack) for stream in group.streams)
        written += self.apart.evict(group, None, repack=repack)
        return written + (group.evict() if group.is_resident else 0)

    def _make_room(self, group: Residency) -> DeviceStorage:
        """Free the buffers of the modes `group` is not in (see [Note: layer mode holds no buffer
        sized for another group] above), cancelling a prefetch into them
        first; returns the buffer it loads into (called with no group current)."""
        prefetched = self.prefetched
        if prefetched is not None and prefetched.plan.mode != group.plan.mode:
            self.cancel_prefetch()
        shared = self._device_buffers.make_room(group)
        return shared if group.plan.reuses_buffers else self.apart.storage_of_its_own(group)

    # -- helpers ---------------------------------------------------------------------------------

    def _settled(self, step, *args):
        """Carry out `step` (the body of one of this object's verbs, the lock held): the device
        layer's one undo path.  A step that stops half-way (an interrupt, an allocation that
        failed) leaves the owners agreeing (`settle`), then its error propagates (see [Note:
        interrupts] in `residency.scheduler.scheduler`).

            self._settled(self._switch, group, chosen)
        """
        try:
            return step(*args)
        except BaseException:
            self.settle()
            raise

    def _load(self, group: Residency, storage: DeviceStorage, replaced: list[int]) -> int:
        if group is self.prefetched:
            self.prefetched = None
            return group.finish_load()
        self.cancel_prefetch()
        return group.load(storage, replaced=replaced)

    def _buffer_for(self, group: Residency) -> DeviceStorage:
        """The shared buffer `group` should load into: its last one, unless the current group
        uses it."""
        return self._device_buffers.buffer_for(group, self.current)

    def _room_for_prefetch(self, group: Residency) -> bool:
        """Whether the buffer `group` would be copied into fits beside everything already held
        (see `_room_beside`)."""
        limit = self.device_memory_limit if self.device_memory_limit is not None else self.budget
        return _room_beside(self._buffer_for(group), group, self.device_nbytes, limit,
                            self.device)

    def _record(self, previous: Residency | None, group: Residency | None, nbytes: int,
                written: int, start: float, evicted: float, *,
                chosen: TurnChoice | None = None) -> None:
        chose = {} if chosen is None else attrs.asdict(chosen)
        self._transitions.append(TransitionRecord(
            from_group=getattr(previous, "name", None), to_group=getattr(group, "name", None),
            nbytes=nbytes, written_back=written, start=start, evict_seconds=evicted - start,
            load_seconds=time.perf_counter() - evicted, thread=threading.current_thread().name,
            **chose))


def _moves_own(group: Residency) -> bool:
    """Whether `group`'s own part moves at its phase changes (swapped, not kept)."""
    return group.plan.own.where is Where.SWAPPED


def _room_beside(storage: DeviceStorage, group: Residency, held: int, limit: int | None,
                 device: torch.device) -> bool:
    """Whether `group` fits into `storage` beside the `held` device bytes: within `limit` when
    there is one, else within an accelerator's free memory; on the CPU, and where the backend
    cannot tell it, the answer is yes, and `prefetch` takes the allocator's out-of-memory as no."""
    needed = max(group.inventory.layout.contiguous_nbytes, storage.size_hint)
    growth = 0 if storage.nbytes >= needed and not storage.is_aliased() else needed
    if limit is not None:
        return held - (storage.nbytes if growth else 0) + growth <= limit
    free = None if device.type == "cpu" else free_device_memory(device)
    return free is None or growth <= free


class DeviceBuffers:
    """The reused device buffers of one scheduler (see the module docstring).  Which of them a
    group uses is its plan's `Plan.mode`: a phase holds its mode's buffers only."""

    def __init__(self, transport: Transport) -> None:
        self.exclusive = (DeviceStorage(transport), DeviceStorage(transport))
        self.block_slots = (DeviceStorage(transport), DeviceStorage(transport))
        self.layer = DeviceStorage(transport)
        #: Every buffer above, for the walks over all of them.
        self.all = (*self.exclusive, self.layer, *self.block_slots)
        #: Each plan mode's buffers: the ones its own part loads into (a second for a prefetch
        #: beside the current group; layer mode prefetches no group), then the rest it uses.
        self._own = {"module": self.exclusive, "layer": (self.layer,)}
        self._of_mode = {"module": self.exclusive, "layer": (self.layer, *self.block_slots)}

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        return sum(storage.nbytes for storage in self.all)

    def buffer_for(self, group: Residency, current: Residency | None) -> DeviceStorage:
        """The buffer `group`'s own part should load into: the last of its mode's buffers it
        loaded into, unless `current` uses that one."""
        own = self._own[group.plan.mode]
        occupied = current.device_storage if current is not None else None
        last = group.device_storage if group.device_storage in own else own[0]
        if last is not occupied:
            return last
        return next(storage for storage in own if storage is not occupied)

    def make_room(self, group: Residency) -> DeviceStorage:
        """Free the buffers of the modes `group` is not in (see [Note: layer mode holds no buffer
        sized for another group]); returns the buffer it loads into while no group is current
        (`buffer_for`)."""
        for mode, storages in self._of_mode.items():
            if mode != group.plan.mode:
                for storage in storages:
                    if storage.buffer is not None:
                        storage.release()
        return self.buffer_for(group, None)

    def forget(self, group: Residency) -> None:
        """Drop every buffer's cached views of `group` (its layout changed, or it is gone)."""
        for storage in {*self.all, group.device_storage} - {None}:
            storage.forget(group)

    def release_all(self) -> None:
        """Free every buffer (``offload_all``, ``close``)."""
        for storage in self.all:
            storage.release()

    def size_for(self, groups: Iterable[Residency]) -> None:
        """Size each mode's buffers for the largest own part of the exclusive groups of that
        mode, and the slots for the largest streamed part, so that each is allocated once."""
        groups = [g for g in groups if g.exclusive]
        for mode, own in self._own.items():
            largest = max((g.inventory.layout.contiguous_nbytes for g in groups
                           if g.plan.mode == mode), default=0)
            for storage in own:
                storage.size_hint = largest
        for slot in self.block_slots:
            slot.size_hint = max((s.slot_nbytes for g in groups for s in g.streams), default=0)
