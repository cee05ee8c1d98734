"""The part mover: every move of a part apart or a streamed part between its master and the device.

    mover = PartMover(adoption, buffers.all)
    nbytes = mover.move_in(dit, block, lambda part: slots[0])   # re-packed first if it changed
    written = mover.move_out(dit, block, repack=True)           # what changed written back

A part (`residency.group.plan`) is a small `Residency`: a block an auto plan keeps or swaps apart
from its group's own part (`residency.placement.apart`), or a streamed block passing through the
slots (`residency.placement.slots`).  Whatever the plan, a part comes in and goes out the same
way, and this file is that way, once:

* in: a part whose modules changed since it was packed is re-packed first (`Adoption.adopt`), then
  its storage is chosen (after the re-pack: its size may have changed) and it loads;
* out: a copy still under way is cancelled, resident bytes are evicted (changed windows written
  back), a storage of its own is released - never one of the scheduler's reused buffers, which
  outlive their occupants - and a part re-typed on the device is re-packed at once unless
  `repack` is False (its group is being removed, or a new plan moves it on).

Holds no state of its own (each part's state is its own); called with the scheduler lock held,
by the placements of `residency.placement` only.
"""

from __future__ import annotations

from collections.abc import Callable

from residency.core.enums import ResidencyState
from residency.group.residency import Residency
from residency.device.transport import DeviceStorage
from residency.placement.adoption import Adoption

__all__ = ["PartMover"]


class PartMover:
    """Moves parts onto the device and off it, one way for every plan (see the module
    docstring)."""

    def __init__(self, adoption: Adoption, shared: tuple[DeviceStorage, ...]) -> None:
        self._adoption = adoption
        #: The scheduler's reused buffers: a part in one of them never releases it.
        self._shared = shared

    def move_in(self, group: Residency, part: Residency,
                storage_for: Callable[[Residency], DeviceStorage]) -> int:
        """Load `part` of `group` into ``storage_for(part)``, re-packed first if its modules
        changed; returns the bytes copied.  A load that fails leaves it offloaded."""
        self._adoption.adopt(group, part)
        return part.load(storage_for(part))

    def move_out(self, group: Residency, part: Residency, *, repack: bool) -> int:
        """Take `part` of `group` off the device: its copy cancelled, its bytes evicted (changes
        written back), a storage of its own released, re-packed when re-typed there and
        `repack`; returns the bytes written back."""
        written = 0
        if part.state is ResidencyState.LOADING:
            part.cancel_load()
        if part.state is ResidencyState.RESIDENT:
            written = part.evict()
        if part.device_storage is not None and part.device_storage not in self._shared:
            part.device_storage.release()
        if part.left_misfits and repack:
            self._adoption.adopt(group, part)
        return written
