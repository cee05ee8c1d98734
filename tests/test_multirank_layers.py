"""Layer mode with several ranks on one host (issues 14 and 15 together).

Real processes and gloo on the CPU (`tests/_dist.py`).  Each rank builds the same model, registers
it with ``layers=True`` on ``Scheduler("cpu", process_group=...)``: every streamed block's host
master is shared by the node's ranks; with ``weight_transfer="allgather"`` each block load is split
among them (each copies ~1/k of the block host to device, one all-gather assembles it).  Checked on
every rank: outputs bit-identical to the model never offloaded, the bytes each rank moved, and that
ranks running different blocks raise `CollectiveError` on every rank instead of mixing weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import run_world

WIDTH = 128


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, seed: int, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(depth))

    def forward(self, x: torch.Tensor, order=None) -> torch.Tensor:
        x = self.embed(x)
        for index in range(len(self.blocks)) if order is None else order:
            x = self.blocks[index](x)
        return x


def _worker(rank: int, world_size: int, args) -> dict:
    import copy

    import torch.distributed as dist

    from residency import CollectiveError, Scheduler

    model = _Stack(seed=5)
    plain = copy.deepcopy(model)
    other = nn.Linear(WIDTH, WIDTH)
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    scheduler.add("other", other)
    group = scheduler.add("stack", model, layers=True, weight_transfer=args["transfer"])
    shared = [b.host_master.shared_group is not None for b in group.streams[0].parts]
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(7))
    same = []
    try:
        for phase in ["stack", "other", "stack", "stack"]:
            with scheduler.resident(phase):
                if phase == "stack":
                    order = [2, 0] if args.get("diverge") and rank == 1 else None
                    same.append(torch.equal(model(x, order), plain(x, order)))
    except CollectiveError as error:
        return {"raised": "CollectiveError", "message": str(error)}
    copies = [(r.block, r.nbytes) for r in scheduler.block_records if r.kind in ("prefetch", "load")]
    block_nbytes = group.streams[0].parts[0].inventory.layout.nbytes
    scheduler.close()
    return {"same": same, "shared": shared, "copies": copies, "block_nbytes": block_nbytes}


@pytest.mark.parametrize("transfer", ["rank-local", "allgather"])
def test_layer_mode_on_two_ranks_shares_block_masters_and_stays_bit_identical(tmp_path, transfer):
    results = run_world(_worker, 2, tmp_path, timeout=90, args={"transfer": transfer})
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert all(result["same"]) and len(result["same"]) == 3, result
        assert all(result["shared"]), result
        assert result["copies"], result
        limit = result["block_nbytes"] / (2 if transfer == "allgather" else 1) + 512
        assert all(nbytes <= limit for _, nbytes in result["copies"]), (limit, result["copies"])
    if transfer == "allgather":  # the two halves cover the block
        first = [nbytes for _, nbytes in (r["copies"][0] for r in results)]
        assert sum(first) >= results[0]["block_nbytes"]


def test_ranks_running_different_blocks_raise_on_every_rank(tmp_path):
    results = run_world(_worker, 2, tmp_path, timeout=90,
                        args={"transfer": "allgather", "diverge": True})
    for rank, result in enumerate(results):
        assert result is not None and result.get("raised") == "CollectiveError", (rank, result)
