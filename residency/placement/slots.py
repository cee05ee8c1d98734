"""The block slots: the placement of streamed parts, asked by each layer-mode group's stream.

    slots = SlotPlacement(buffers.block_slots, mover)
    nbytes = slots.prefetch(block, 0)      # the block's copy issued into slot 0
    slots.park(block)                      # its tensors view slot 0 (False: copy abandoned)
    written = slots.evict(group, block)    # back on its master, what changed written back

A plan's streamed parts (`residency.group.plan`) pass through two reused device buffers, the
*slots* (`residency.placement.placement.DeviceBuffers.block_slots`).  Which block goes into which slot
and when is the stream's decision (`residency.placement.layers.BlockStream`, around each block's
forward); carrying the move out is this file's: every transition of a streamed part's `Residency`
happens here, as every transition of a group's own part happens in `residency.placement.placement`.
A whole load and an eviction go through the `PartMover` every part uses
(`residency.placement.mover`: a part whose modules changed is re-packed first, as a group is).

Holds no state of its own (the slots are the buffers' and each part's state is its own), and is
called with the scheduler lock held.
"""

from __future__ import annotations

from residency.group.residency import Residency
from residency.core.enums import ResidencyState
from residency.device.transport import DeviceStorage
from residency.placement.mover import PartMover

__all__ = ["SlotPlacement"]


class SlotPlacement:
    """Moves streamed parts into the two block slots and out of them (see the module
    docstring)."""

    def __init__(self, slots: tuple[DeviceStorage, DeviceStorage], mover: PartMover) -> None:
        #: The two slots, in the order the streams number them (0 and 1).
        self.slots = slots
        self._mover = mover

    def slot_of(self, block: Residency) -> int | None:
        """The slot `block` is in or being copied into; None when it is offloaded."""
        storage = block.device_target
        return None if storage is None else self.slots.index(storage)

    def may_prefetch(self, block: Residency) -> bool:
        """Whether `block` may be copied into a slot ahead of its forward: it is offloaded and
        its modules kept their structure (a changed block is re-packed at its entry)."""
        return (block.state is ResidencyState.OFFLOADED
                and block.inventory.changed_structure() is None)

    def prefetch(self, block: Residency, slot: int) -> int:
        """Issue `block`'s copy into `slot`; returns the bytes copied.

        Edits made to the block's master before it is parked are copied again then
        (``watch_edits``).  The pointer pass is parking's, not this: parking sees every tensor
        given new storage since the block's last eviction, before or after this copy (one pass
        per load).
        """
        return block.begin_load(self.slots[slot], watch_edits=True, replaced=[])

    def park(self, block: Residency) -> bool:
        """Finish `block`'s copy: its tensors view its slot.  A block given another dtype or
        shape while its copy was under way is not parked: the copy is abandoned (False), and the
        block is re-packed and loaded when it is entered."""
        replaced = block.replaced_on_host()
        if block.misfit_change(replaced) is not None:
            block.cancel_load()
            return False
        block.finish_load(replaced=replaced)
        return True

    def cancel(self, block: Residency) -> None:
        """Abandon `block`'s copy: it stays on its master."""
        block.cancel_load()

    def load(self, group: Residency, block: Residency, slot: int) -> int:
        """Load `block` (one of `group`'s streamed parts) into `slot` now, re-packed first if
        its modules changed; returns the bytes copied."""
        return self._mover.move_in(group, block, lambda _: self.slots[slot])

    def evict(self, group: Residency, block: Residency, *, repack: bool = True) -> int:
        """Evict `block` from its slot, writing back what changed; returns the bytes written.
        A block re-typed in its slot is re-packed at once (so it views its master), unless
        `repack` is False (its group is being removed)."""
        return self._mover.move_out(group, block, repack=repack)

    def forget(self, blocks: list[Residency]) -> None:
        """Drop the slots' cached views of `blocks` (their group is gone)."""
        for slot in self.slots:
            for block in blocks:
                slot.forget(block)
