"""The room an auto plan has on a device it shares: what is free, what it holds, and when the
plan must shrink or may grow.

    room = room_for(device, held, peak, headroom)   # the cache handed back first when short
    change = resize(room, peak=peak, budget=budget, configured=configured,
                    headroom=headroom)               # (new budget, why), or None

[Note: co-tenants]
Other programs share an accelerator: another model, a desktop, a second worker. An auto plan keeps
``headroom`` free for the model's activations, so at each phase change that switches groups (never
at a re-entry of the current group: that moves nothing) the auto scheduler reads the room
(`read_room`): the device's free memory, what this process's caching allocator keeps of freed
blocks, and what the scheduler holds. When what the plan still has to allocate (its peak less what
is held) plus the headroom is more than the free memory (`short`), the cache is handed back first
(``empty_cache``: the free memory is what a co-tenant, and the device's own report, see); if that
is not enough, the plan is made again within the room - at most the configured budget - before the
switch loads anything: kept parts and slots it no longer keeps are released, instead of a load
failing or the activations getting less than the headroom. While the budget is below the configured
one, each switch hands the blocks it freed back to the device (``empty_cache``: a co-tenant cannot
use our allocator's cache; on CUDA this costs a device synchronisation per switch, paid only while
squeezed). When the room comes back - at least `GROW_BY` of the configured budget more than the
budget in force, or all of it - the plan is made again, up to the configured budget. Each change is
logged (logger ``residency``) and is the plan's reason (`AutoPlan.describe`); a room no plan
fits keeps the plan in force, said once until the room grows (a load may then fail with
`DeviceMemoryError`, changing nothing). Not on the CPU (host
memory is the host options' to judge), and not with a process group (every rank must choose the
same plan at the same call, and each sees its own device).
"""

from __future__ import annotations

import attrs
import torch

from residency.options.budget import format_nbytes
from residency.device.transport import free_device_memory

__all__ = ["GROW_BY", "Room", "read_room", "resize", "room_for", "short"]

#: How much more room than the budget in force (a fraction of the configured budget) brings a
#: squeezed plan back up; less is noise (activations come and go).
GROW_BY = 0.05


@attrs.frozen(kw_only=True)
class Room:
    """Device bytes: free (as the device reports them), cached by this process's allocator for
    freed blocks, and held by the scheduler (`Placement.device_nbytes`)."""

    free: int
    cached: int
    held: int

    @property
    def available(self) -> int:
        """What the scheduler could still allocate: the free bytes and the cache."""
        return self.free + self.cached


def read_room(device: torch.device, held: int) -> Room | None:
    """The room on accelerator `device` where the scheduler holds `held` bytes, or None where
    the device does not report its free memory."""
    free = free_device_memory(device)
    if free is None:
        return None
    try:
        cached = (torch.accelerator.memory_reserved(device.index)
                  - torch.accelerator.memory_allocated(device.index))
    except (RuntimeError, NotImplementedError, AttributeError):
        cached = 0
    return Room(free=free, cached=max(0, cached), held=held)


def room_for(device: torch.device, held: int, peak: int, headroom: int) -> Room | None:
    """The room on `device` for a plan of `peak` device bytes of weights where the scheduler
    holds `held`, this process's allocator cache handed back first when the free memory is
    `short` of the plan and the headroom (see [Note: co-tenants]); None where the device does
    not report its free memory."""
    room = read_room(device, held)
    if room is not None and room.cached and short(room, peak, headroom):
        torch.accelerator.empty_cache()
        room = read_room(device, held)
    return room


def short(room: Room, peak: int, headroom: int) -> bool:
    """Whether what a plan of `peak` device bytes of weights still has to allocate, plus the
    headroom, is more than the device's free memory (the cache aside: see [Note: co-tenants])."""
    return max(0, peak - room.held) + headroom > room.free


def resize(room: Room, *, peak: int, budget: int, configured: int,
           headroom: int) -> tuple[int, str] | None:
    """The budget to plan within now, and why - or None when the plan in force stays (see
    [Note: co-tenants]): `peak` is the plan's most device bytes of weights, `budget` the one it
    was made for, `configured` the one the options gave."""
    usable = min(configured, room.held + room.available)
    size = format_nbytes
    if short(room, peak, headroom):
        return usable, (f"the device had {size(room.available)} free (its cache included) where "
                        f"the plan needed {size(max(0, peak - room.held))} more and the headroom "
                        f"{size(headroom)}: planned within {size(usable)} of the "
                        f"{size(configured)} budget, as a co-tenant holds the rest")
    if budget < configured and usable >= min(configured, budget + GROW_BY * configured):
        return usable, (f"device memory came back ({size(room.available)} free, its cache "
                        f"included): planned within {size(usable)} of the {size(configured)} "
                        "budget")
    return None
