"""Adoption: an offloaded group whose modules changed is re-packed before its next load.

    adoption = Adoption(packer, registry, buffers, device_memory_limit=None)
    adoption.adopt(dit, change="the weight changed from float32 to bfloat16")

A change made to a group's modules (a new dtype, new or replaced parameters, a tensor untied) is
adopted, not refused: the modules' tensors as they are now are packed into a fresh host master and
the group takes it over (`Residency.adopt`).  Refused only when the new tensors break an ownership
rule or the device budget; then nothing changed.  Placement asks for it (before a load, after an
eviction that left re-typed tensors on the host), and so does a layer-mode group's stream (for one
block); neither is the facade, so this lives below them, with the registry and the packer it asks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from residency.group.residency import Residency
from residency.core.enums import Policy
from residency.core.errors import RegistrationError
from residency.host.packing import Packer
from residency.group.registry import Claim, Registry, owned_modules, repacked_claim
from residency.multirank.sharded import ShardedLoad

if TYPE_CHECKING:  # placement imports this module
    from residency.placement.placement import DeviceBuffers

__all__ = ["Adoption", "check_budget", "why_shared"]

_log = logging.getLogger("residency")


class Adoption:
    """Re-packs changed groups of one scheduler (see the module docstring); called with the
    scheduler lock held.  It holds no state of its own."""

    def __init__(self, packer: Packer, registry: Registry, buffers: DeviceBuffers,
                 *, device_memory_limit: int | None) -> None:
        self._packer = packer
        self._registry = registry
        self._device_buffers = buffers
        self.device_memory_limit = device_memory_limit

    def adopt(self, group: Residency, part: Residency | None = None,
              change: str | None = None) -> None:
        """Re-pack offloaded `group` (or `part`, one of its streamed parts) if its modules
        changed since it was packed; `change` is `pending_change`'s answer when the caller has
        asked already.  Logged once per change."""
        part = group if part is None else part
        change = part.pending_change() if change is None else change
        if change is None:
            return
        inventory = self._packer.inventory(part.modules, part.excluded,
                                           allow_empty=part is group
                                           and len(group.plan.parts) > 1)
        claim = Claim(group.name, group.policy, inventory)
        self._registry.check_claimable(claim, replacing=group)
        need = repacked_claim(group, part, inventory).device_need
        check_budget(self.device_memory_limit, group.name,
                     self._registry.needs(group.name, group.policy, need, ignore=group))
        master = self._packer.pack(part.name, inventory, require_shared=why_shared(part.sharded))
        self._device_buffers.forget(part)
        owned = owned_modules(group)
        try:
            part.adopt(inventory, master)
            self._registry.retake(group, owned)
        except BaseException:  # adopted: the ownership follows (see [Note: interrupts])
            if part.inventory is inventory:
                self._registry.retake(group, owned)
            raise
        _log.info("group %r changed (%s); re-packed %d tensors of %s (%.1f MiB)", group.name,
                  change, inventory.tensor_count, part.name, inventory.nbytes / 2**20)


def check_budget(limit: int | None, name: str, needs: Iterable[tuple[Policy, int]]) -> None:
    """Refuse a group whose device bytes, with those of `needs` (every group and claim, the new
    one last), would exceed `limit` (``device_memory_limit``; None: no limit)."""
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


def why_shared(sharded: ShardedLoad | None) -> str | None:
    """Why a group's master must be node-shared (its loads all-gather), or None."""
    return None if sharded is None else "weight_transfer='allgather'"
