"""Quick start: three groups, phases, and a check that offloading changed nothing.

    python examples/quickstart.py
"""

import copy

import torch
from torch import nn

from residency import Scheduler


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))


def main() -> None:
    torch.manual_seed(0)
    encoder, dit, vae = block(256), block(256), block(256)
    plain = copy.deepcopy([encoder, dit, vae])  # the same model, never offloaded

    scheduler = Scheduler("cpu")  # "cpu" still performs the real swap into separate storage
    scheduler.add("text_encoder", encoder)
    scheduler.add("dit", dit)
    scheduler.add("vae", vae, policy="resident")

    x = torch.randn(8, 256)
    with scheduler.resident("text_encoder"):
        context = encoder(x)
    latents = x
    for _ in range(4):
        with scheduler.resident("dit"):  # swaps once, then costs a counter
            latents = dit(latents + context)
    image = vae(latents)

    expected = plain[2](_denoise(plain[1], x, plain[0](x)))
    assert torch.equal(image, expected), "offloaded output differs from the plain model"
    for record in scheduler.transitions:
        print(f"{record.from_group} -> {record.to_group}: {record.nbytes} bytes "
              f"in {record.seconds * 1e3:.3f} ms")
    print("outputs bit-identical to the model never offloaded")


def _denoise(dit: nn.Module, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    latents = x
    for _ in range(4):
        latents = dit(latents + context)
    return latents


if __name__ == "__main__":
    main()
