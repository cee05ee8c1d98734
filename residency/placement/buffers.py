"""The device buffers a scheduler reuses across phases, and which one a group loads into.

    buffers = DeviceBuffers(transport)
    storage = buffers.buffer_for(dit, current=encoder)    # the exclusive buffer the encoder is not in
    storage = buffers.make_room(dit)                    # a module-mode group frees layer mode's

Fields (set once; their contents are `DeviceStorage`s, each the owner of its own bytes; used with the
scheduler lock held, by `residency.placement.placement` and `residency.placement.adoption` only):

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
"""

from __future__ import annotations

from collections.abc import Iterable

from residency.group.residency import Residency
from residency.host.memory import DeviceStorage
from residency.device.transport import Transport

__all__ = ["DeviceBuffers"]


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
