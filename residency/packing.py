"""Packing: building a group's inventory and host master, for registration and for re-packing.

    packer = Packer(transport, device=torch.device("cpu"), chunk_nbytes=2**28, pin_memory=False)
    inventory = packer.inventory([model], excluded=())
    master = packer.pack("dit", inventory)          # re-points model's tensors to the master

One answer to "how is a host master built?": the inventory laid out for the device's alignment
(`residency.tensors.alignment_for`), the copy into fresh host memory chunk by chunk, pinned when it
can be, and the typed error when host memory runs out.

[Note: the pin fallback]
``pin_memory`` starts as the scheduler was told (or as the transport can); the first time pinning
fails (a locked-memory limit), `HostMaster.pack` warns and falls back to pageable memory, and the
packer turns ``pin_memory`` off so later groups do not try (and warn) again.  The flag is a single
attribute written by whichever thread packs; a racing reader sees either value, and both are safe.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from residency.errors import HostMemoryError
from residency.memory import HostMaster
from residency.tensors import Inventory, alignment_for, take_inventory
from residency.transport import Transport

__all__ = ["Packer"]

_log = logging.getLogger("residency")


class Packer:
    """Builds inventories and host masters for one scheduler (see the module docstring)."""

    def __init__(
        self, transport: Transport, *, device: torch.device, chunk_nbytes: int, pin_memory: bool
    ) -> None:
        self._transport = transport
        self._alignment = alignment_for(device)
        self.chunk_nbytes = chunk_nbytes
        #: Pin host masters; see [Note: the pin fallback].
        self.pin_memory = pin_memory

    def inventory(
        self, roots: tuple[nn.Module, ...], excluded: tuple[nn.Module, ...]
    ) -> Inventory:
        """The unique tensors of `roots` (less `excluded`), laid out for the device."""
        return take_inventory(
            roots, chunk_nbytes=self.chunk_nbytes, exclude=excluded, alignment=self._alignment
        )

    def pack(self, name: str, inventory: Inventory) -> HostMaster:
        """A new host master for group `name`; its tensors are re-pointed to it as it fills."""
        try:
            master = HostMaster.pack(inventory, self._transport, pin=self.pin_memory)
        except MemoryError as error:
            nbytes = inventory.layout.nbytes
            raise HostMemoryError(
                f"cannot add group {name!r}: its host master needs {nbytes} bytes "
                f"({nbytes / 2**20:.1f} MiB) of host memory and the allocation failed ({error}). "
                "Free host memory or register fewer modules at once; the weights keep their values"
            ) from error
        if self.pin_memory and not master.pinned:
            self.pin_memory = False
            _log.warning("pinning failed; later host masters of this scheduler are pageable")
        return master
