"""Write-back: what changed on a group's device bytes goes back into its host master, and nothing
else.

    written = WriteBack(name=group.name, inventory=inventory, master=master, storage=storage,
                        key=group, transport=transport, detector=detector, marked_dirty=False,
                        now_versions=now, loaded_versions=loaded, replaced=replaced,
                        fitting=fitting).write()
    copied = write_tensors(transport, inventory, master, [3, 7])   # tensors into their places

`Residency.evict` reads what it must of the tensors (version counters, data pointers), decides
which tensors still fit their places, and hands one `WriteBack` the rest: this file decides which
bytes to copy and copies them.  The host may read a master right after, so `_copy_to_master` is
the one place a write-back waits.

[Note: finding what changed]
An edit through ``tensor.data`` (peft's LoRA merge), by a custom kernel or through an alias moves
neither the version counter nor the data pointer.  Only the bytes tell, so the device bytes are
digested at every load (after the copy: the bytes as loaded, not as packed - the master may have
been edited while offloaded) and again at eviction; the windows whose digests differ are written
back, and nothing else (`residency.device.digests` says what a digest detects).  With
``detect_edits=False`` the user promised not to edit, and tensors whose version counter moved are
written back instead.  Tensors given new storage (``tensor.data = ...``, ``module.to(...)``) that
still fit their places are written back unless their bytes equal those loaded.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from residency.device.digests import ChangeDetector
from residency.host.memory import DeviceStorage, HostMaster
from residency.modules.tensors import Inventory, repoint
from residency.device.transport import Transport
from residency.multirank.agreement import agree_write_back, digest_ranges

__all__ = ["WriteBack", "copy_in", "write_tensors"]


@attrs.frozen(kw_only=True)
class WriteBack:
    """One eviction's write-back from `storage` into `master` (see the module docstring)."""

    name: str
    inventory: Inventory
    master: HostMaster
    #: The device storage the group is loaded in, and the key its views there are cached under.
    storage: DeviceStorage
    key: object
    transport: Transport
    #: Digests of the bytes as loaded, or None (``detect_edits=False`` on a private master).
    detector: ChangeDetector | None
    #: Every byte is to be written (`Residency.mark_dirty`).
    marked_dirty: bool
    #: Version counters now, and as of the load.
    now_versions: list[int]
    loaded_versions: list[int]
    #: Tensors given new storage while resident, and those of them that fit their places.
    replaced: list[int]
    fitting: list[int]

    def write(self) -> int:
        """Copy what changed into the master; returns the bytes written.  A shared master's
        ranks agree first (`_write_back_agreed`: collective)."""
        if self.master.shared_group is not None:
            return self._write_back_agreed()
        # edits in place first, then new storage: the later copy wins where both touch
        return self._write_back_edits() + self._write_back_replaced()

    def _write_back_edits(self) -> int:
        """What was edited in place while resident (see [Note: finding what changed])."""
        if self.marked_dirty:
            return self._write_ranges([(0, self.inventory.layout.contiguous_nbytes)])
        if self.detector is not None:
            return self._write_ranges(self.detector.changed_windows(self._device_bytes()))
        if self.now_versions == self.loaded_versions:
            return 0
        replaced = set(self.replaced)
        moved = [i for i, (v, w) in enumerate(zip(self.now_versions, self.loaded_versions))
                 if v != w and i not in replaced]
        return write_tensors(self.transport, self.inventory, self.master, moved)

    def _write_back_replaced(self) -> int:
        """Tensors given new storage, unless their bytes equal those loaded.

        ``enable_layerwise_casting`` upcasts a module's weights before each forward and casts them
        back after, into new storage with the same bytes: comparing on the device costs a read,
        where writing back would cost a copy to the host on every swap.
        """
        if not self.fitting:
            return 0
        views = self.storage.views_for(self.key, self.inventory)
        tensors = self.inventory.tensors
        same = _same_bytes([(tensors[i], views[i]) for i in self.fitting])
        changed = [i for i, unchanged in zip(self.fitting, same) if not unchanged]
        return write_tensors(self.transport, self.inventory, self.master, changed)

    def _write_back_agreed(self) -> int:
        """A shared master: the ranks agree on what changed and one of them writes it.

        Tensors given new storage are first copied into their device bytes, so that one digest
        check sees every change; then `agree_write_back` (collective over the node's ranks)
        decides: nothing, one writer (the others wait at a barrier until the bytes are in the
        shared pages), or a `CollectiveError` on every rank before anything is written or
        re-pointed - the group stays resident, each rank keeping its device copy.
        """
        views = self.storage.views_for(self.key, self.inventory)
        for i in self.fitting:
            views[i].copy_(self.inventory.tensors[i].detach())
        device_bytes = self._device_bytes()
        if self.marked_dirty:
            ranges = [(0, self.inventory.layout.contiguous_nbytes)]
        else:
            ranges = self.detector.changed_windows(device_bytes)
        digest = digest_ranges(device_bytes, ranges) if ranges else None
        group = self.master.shared_group
        decision = agree_write_back(self.name, ranges, digest, group)
        written = self._write_ranges(list(decision.ranges)) if decision.writes else 0
        if decision.writer is not None:
            dist.barrier(group=group)
        return written

    def _write_ranges(self, ranges: list[tuple[int, int]]) -> int:
        """Copy device byte ranges (offsets into the group's device bytes) into the master."""
        if not ranges:
            return 0
        pairs = self.master.range_copies(self.storage.buffer, ranges, self.inventory)
        return _copy_to_master(self.transport, pairs)

    def _device_bytes(self) -> torch.Tensor:
        return self.storage.buffer[: self.inventory.layout.contiguous_nbytes]


def write_tensors(transport: Transport, inventory: Inventory, master: HostMaster,
                  indices: list[int]) -> int:
    """Copy tensors `indices` of `inventory` into their places in `master`; returns the bytes
    copied (used by eviction and by a load that adopts tensors given new storage on the host)."""
    if not indices:
        return 0
    tensors, homes = inventory.tensors, master.views
    return _copy_to_master(transport, [(homes[i], tensors[i].detach()) for i in indices])


def copy_in(transport: Transport, inventory: Inventory, master: HostMaster,
            replaced: list[int]) -> set[int]:
    """Copy into `master` each of the tensors `replaced` (given new storage while offloaded:
    ``module.to(...)``) that still fits its place, and re-point it there; returns the indices
    taken (misfits are left as they are: `Residency.pending_change` reports them)."""
    left = {i for i, _ in inventory.misfits(master.views, replaced)}
    taken = [i for i in replaced if i not in left]
    write_tensors(transport, inventory, master, taken)
    homes, tensors = master.views, inventory.tensors
    repoint([tensors[i] for i in taken], [homes[i] for i in taken])
    return set(taken)


def _copy_to_master(transport: Transport, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy (master view, device bytes) pairs to the host; returns the bytes copied.

    The host may read the master right away, so this is the one place a write-back waits.
    """
    transport.to_host(pairs).synchronize()
    return sum(host.nbytes for host, _ in pairs)


def _same_bytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """Whether each (tensor, device view) pair holds the same bytes.

    Pairs on one accelerator compare there, with one host wait for all of them.  A tensor the
    user moved to the host (``module.to("cpu")`` while resident) compares on the host: no kernel
    reads a host and a device tensor together.
    """
    on_device = [a.device == b.device != _HOST for a, b in pairs]
    device_flags = iter(torch.stack([(_as_bytes(a) == _as_bytes(b)).all()
                                     for (a, b), there in zip(pairs, on_device) if there]).tolist()
                        if any(on_device) else ())
    return [next(device_flags) if there else torch.equal(_as_bytes(a).cpu(), _as_bytes(b).cpu())
            for (a, b), there in zip(pairs, on_device)]


_HOST = torch.device("cpu")
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element size (NaNs compare by their bits)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_WORDS.get(flat.element_size(), torch.uint8))
