"""Layer mode: a DiT whose blocks stream through two reused device slots while its phase runs.

    python examples/layer_mode.py

The DiT is registered with ``layers=``: the part outside its blocks (and the first
`resident_layers` blocks) loads at the phase's start, as in module mode; each other block is
copied into one of two slots just before it runs (the next one's copy overlapping its compute) and
leaves its slot when it ends.  The model's own loop over its blocks does the streaming; the
explicit form, ``for block in dit.layers()``, streams the same way.
"""

import copy

import torch
from torch import nn

from residency import Scheduler, model_blocks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention = nn.Linear(width, width)
        self.feed_forward = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                          nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.feed_forward(x)


class DiT(nn.Module):
    #: The block lists, declared the vLLM-Omni way (without it, they are found).
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    encoder, dit = nn.Linear(256, 256), DiT()
    plain_encoder, plain_dit = copy.deepcopy(encoder), copy.deepcopy(dit)  # never offloaded

    scheduler = Scheduler("cpu")  # "cpu" still performs real copies into separate storage
    scheduler.add("text_encoder", encoder)
    plan = model_blocks(dit, path="transformer", resident_layers=1)
    print(plan.describe())
    scheduler.add("transformer", dit, layers=plan)

    x = torch.randn(4, 256)
    with scheduler.resident("text_encoder"):
        context = encoder(x)
    latents = x
    for _ in range(3):
        with scheduler.resident("transformer"):
            latents = dit(latents + context)
            bound = scheduler["transformer"].device_need
            assert scheduler.device_nbytes <= bound, (scheduler.device_nbytes, bound)
    with scheduler.resident("transformer") as group:  # the explicit form
        hidden = dit.embed(latents)
        for block in group.layers():
            hidden = block(hidden)
        explicit = dit.head(hidden)

    expected = plain_encoder(x)
    plain_latents = x
    for _ in range(3):
        plain_latents = plain_dit(plain_latents + expected)
    assert torch.equal(latents, plain_latents), "layer mode changed the output"
    assert torch.equal(explicit, plain_dit(plain_latents)), "the explicit form changed it"
    log = scheduler.block_records
    print(f"{log.copies} block copies ({log.nbytes} bytes) through 2 slots; device bytes at most "
          f"{scheduler['transformer'].device_need} of {scheduler['transformer'].nbytes}")
    first = [r for r in log if r.kind in ("prefetch", "compute")][:4]
    print("first moves: " + ", ".join(f"{r.kind} {r.block}" for r in first))
    scheduler.close()
    print("outputs bit-identical to the model never offloaded")


if __name__ == "__main__":
    main()
