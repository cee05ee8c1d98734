"""Parts placed whole apart from their group's own part: an auto plan's kept and swapped blocks.

    kept = PartsApart(mover, transport, buffers.all)
    nbytes = kept.load(dit, Where.SWAPPED)     # each swapped block into a storage of its own
    written = kept.evict(dit, Where.SWAPPED)   # back on their masters, what changed written back

An auto plan (`residency.auto.planner`) places each block of a group by itself
(`residency.group.plan`): *kept* blocks stay on the device while other groups run (partial
residency: the group's next load moves only the rest), *swapped* ones move with the group's own
part.  Each is a small `Residency` with its own host master (`Residency.apart`), as a streamed
block is, so a new plan moves a block between kept, swapped and streamed without packing it
again.  Each loads into a device storage of its own, released when the part is evicted; it moves
in and out through the `PartMover` every part uses (`residency.placement.mover`: re-packed first
when its modules changed, as a group is).

[Note: a kept part outside its group's phase]
A kept block's tensors view the device while its group is not current, as a resident-policy
group's do: the model's forward outside a phase would mix host and device tensors, so model code
runs a group inside its phase (as on an accelerator it must anyway).  Edits made to a kept block
at any time land in its device bytes and are written back when it leaves the device (a new plan,
`remove`, `close`): the guarantee of a resident group.

Holds no state of its own (each part's state is its own); called with the scheduler lock held, by
`residency.placement.placement` only.
"""

from __future__ import annotations

from residency.group.residency import Residency
from residency.core.enums import ResidencyState
from residency.group.plan import Plan, Where
from residency.device.transport import DeviceStorage, Transport
from residency.placement.mover import PartMover

__all__ = ["PartsApart"]


class PartsApart:
    """Loads and evicts the parts a group's plan places whole apart from its own part (see the
    module docstring)."""

    def __init__(self, mover: PartMover, transport: Transport,
                 shared: tuple[DeviceStorage, ...]) -> None:
        self._mover = mover
        self._transport = transport
        #: The scheduler's reused buffers (a part streamed before may still name a slot).
        self._shared = shared

    def load_kept(self, group: Residency) -> int:
        """Load what `group`'s plan keeps and is not on the device: a kept own part into a
        storage of its own, then its kept parts apart; returns the bytes copied."""
        nbytes = 0
        if group.plan.own.where is Where.KEPT and group.state is ResidencyState.OFFLOADED:
            nbytes = group.load(self.storage_of_its_own(group))
        return nbytes + self.load(group, Where.KEPT)

    def load_for_phase(self, group: Residency) -> int:
        """Load what `group`'s phase needs of its parts apart and is not on the device: what it
        keeps (`load_kept`: after an interrupted step), then what it swaps; bytes copied."""
        return self.load_kept(group) + self.load(group, Where.SWAPPED)

    def load(self, group: Residency, where: Where) -> int:
        """Load every part of `group` planned `where` that is not on the device yet (re-packed
        first if its modules changed); returns the bytes copied.  A part whose load fails is
        left offloaded (`Residency.load`), and the error propagates."""
        nbytes = 0
        for part in _planned(group, where):
            if part.state is ResidencyState.OFFLOADED:
                nbytes += self._mover.move_in(group, part, self.storage_of_its_own)
        return nbytes

    def evict(self, group: Residency, where: Where | None, *, repack: bool = True) -> int:
        """Evict every part of `group` planned `where` (None: every part apart) that is on the
        device, writing back what changed, and free its storage; returns the bytes written.  A
        part re-typed on the device is re-packed at once unless `repack` is False (its group is
        being removed)."""
        parts = group.apart if where is None else _planned(group, where)
        return sum(self._mover.move_out(group, part, repack=repack) for part in parts)

    def evict_unkept(self, group: Residency, plan: Plan) -> int:
        """Evict what of `group` (not current) the new `plan` does not keep: its parts apart and
        a kept own part that the plan moves or streams; returns the bytes written back."""
        written = 0
        for part in group.apart:  # a kept part's storage is its own: released
            if part.is_resident and plan.where.get(part.name) is not Where.KEPT:
                written += self._mover.move_out(group, part, repack=False)
        if group.is_resident and plan.own.where is not Where.KEPT:  # kept: its own storage
            written += self._mover.move_out(group, group, repack=False)
        return written

    def storage_of_its_own(self, part: Residency) -> DeviceStorage:
        """The storage `part` (a part apart, or an own part that reuses no shared buffer: kept,
        or an auto plan's) loads into: its last one, unless that is a shared buffer, else a new
        one."""
        storage = part.device_storage
        if storage is None or storage in self._shared:
            storage = DeviceStorage(self._transport)
        return storage

    def held(self, group: Residency) -> list[DeviceStorage]:
        """The storages of `group`'s parts apart that hold bytes now."""
        return [part.device_storage for part in group.apart
                if part.device_storage is not None and part.device_storage.nbytes
                and part.device_storage not in self._shared]

    @staticmethod
    def all_placed(group: Residency) -> bool:
        """Whether every kept and swapped part of `group` is on the device."""
        return all(part.is_resident for part in group.apart)


def _planned(group: Residency, where: Where) -> list[Residency]:
    return [part for part in group.apart if group.plan.where[part.name] is where]
