"""Sharded loads: the k ranks of a node each copy 1/k of a group host to device, then all-gather.

    load = ShardedLoad(group=node.group, local_rank=1, local_world=4, ledger=PhaseLedger(node.group))
    completion = load.load("dit", transport, copies, buffer, nbytes)

``weight_transfer="allgather"`` (vLLM-Omni's name): a group whose ranks share one host master loads by
parts - rank r copies bytes [r*s, (r+1)*s) of the group's device bytes from the shared master (its
own PCIe link), and one ``all_gather_into_tensor`` over the node group assembles the whole buffer on
every rank (NVLink on GPUs; gloo here).  Each rank moves 1/k of the bytes host to device.

[Note: every rank loads the same group at the same point]
An all-gather is a collective: every rank of the node must load the same group in the same order.
Before it, the ranks agree on (sequence, group) through the scheduler's `PhaseLedger`; a rank that
asked for another group, or none, makes every rank raise `CollectiveError` within the group's
timeout instead of gathering mixed weights or hanging.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from residency.multirank.agreement import PhaseLedger
from residency.device.transport import DONE, Completion, Transport

__all__ = ["ShardedLoad"]

#: A shard's size is a multiple of this (the widest alignment a device buffer needs).
_SHARD_ALIGNMENT = 512


@attrs.frozen(kw_only=True)
class ShardedLoad:
    """How a group shared by the `local_world` ranks of a node is loaded (see the module notes)."""

    group: object = attrs.field(eq=False)
    local_rank: int
    local_world: int
    ledger: PhaseLedger = attrs.field(eq=False)

    def shard_nbytes(self, nbytes: int) -> int:
        """Bytes each rank copies: `nbytes` split k ways, rounded up to the shard alignment."""
        per_rank = -(-nbytes // self.local_world)
        return -(-per_rank // _SHARD_ALIGNMENT) * _SHARD_ALIGNMENT

    def buffer_nbytes(self, nbytes: int) -> int:
        """Device bytes the gather writes (k whole shards: at least `nbytes`)."""
        return self.shard_nbytes(nbytes) * self.local_world

    def load(
        self,
        name: str,
        transport: Transport,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        buffer: torch.Tensor,
        nbytes: int,
    ) -> tuple[Completion, int]:
        """Copy this rank's shard of `copies` (device slice, host chunk pairs laid end to end in
        `buffer`), then all-gather; returns the completion and the bytes this rank copied."""
        shard = self.shard_nbytes(nbytes)
        start = self.local_rank * shard
        mine = _clip(copies, buffer, start, start + shard)
        transport.to_device(mine).wait()
        self.ledger.enter(name)  # every rank gathers the same group (see the note above)
        whole = buffer[: shard * self.local_world]
        dist.all_gather_into_tensor(whole, whole[start : start + shard].clone(), group=self.group)
        return DONE, sum(device.numel() for device, _ in mine)


def _clip(copies, buffer: torch.Tensor, start: int, end: int):
    """The parts of `copies` that land in buffer bytes [start, end)."""
    clipped = []
    base_pointer = buffer.data_ptr()
    for device, host in copies:
        first = device.data_ptr() - base_pointer
        lo, hi = max(start, first), min(end, first + device.numel())
        if lo < hi:
            clipped.append((device[lo - first : hi - first], host[lo - first : hi - first]))
    return clipped
