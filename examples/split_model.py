"""A split model (the Cosmos3 pattern): one transformer whose reasoner and generator take turns.

    python examples/split_model.py

The model names its parts in `_split_parts` and wraps each in
``with self.scheduler.resident(part):``.
`Scheduler.from_pipeline` makes each part an exclusive group and keeps the shared embedding and norm
on the device; a copy of the model that was never attached runs the same code with `NoOffload`.
"""

import copy

import torch
from torch import nn

from residency import Scheduler
from residency.discovery import SupportsComponentDiscovery
from residency.split import SplitModel

WIDTH = 64


def stack(depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth)))


class Cosmos3Like(SplitModel, nn.Module):
    _split_parts = {"reasoner": "reasoner", "generator": ("generator", "head")}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)  # shared by both parts: stays resident
        self.norm = nn.LayerNorm(WIDTH)
        self.reasoner, self.generator, self.head = stack(3), stack(3), nn.Linear(WIDTH, WIDTH)

    def reason(self, tokens: torch.Tensor) -> torch.Tensor:
        with self.scheduler.resident("reasoner"):
            return self.reasoner(self.norm(self.embed(tokens)))

    def denoise(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        with self.scheduler.resident("generator"):
            return self.head(self.norm(self.generator(latents + context.mean(0))))

    def forward(self, tokens: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return self.denoise(latents, self.reason(tokens))


class Cosmos3Pipeline(SupportsComponentDiscovery, nn.Module):
    _dit_modules = ("transformer",)
    _vae_modules = ("vae",)

    def __init__(self) -> None:
        super().__init__()
        self.transformer, self.vae = Cosmos3Like(), nn.Linear(WIDTH, WIDTH)


def main() -> None:
    torch.manual_seed(0)
    pipe = Cosmos3Pipeline().eval()
    plain = copy.deepcopy(pipe)  # never attached: its scheduler is a NoOffload
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]},
                                        device="cpu")  # "cpu" still performs the real swap
    model = pipe.transformer
    print("groups:", {name: scheduler[name].policy.value for name in scheduler})

    tokens, noise = torch.randint(0, 16, (5,)), torch.randn(5, WIDTH)
    latents, expected = noise, noise
    with torch.no_grad():
        for step in range(3):
            context = model.reason(tokens)
            assert scheduler.current == "reasoner" and not scheduler["generator"].is_resident
            latents = model.denoise(latents, context)
            assert scheduler.current == "generator" and not scheduler["reasoner"].is_resident
            print(f"step {step}: resident {scheduler.resident_groups()}")
            expected = plain.transformer(tokens, expected)  # the same forward, offloading off
        image, expected = pipe.vae(latents), plain.vae(expected)
    assert torch.equal(image, expected), "offloaded output differs from the plain model"
    print(f"{scheduler.transitions.count} transitions; one part on the device at a time")
    print("outputs bit-identical to the model never offloaded")
    scheduler.close()


if __name__ == "__main__":
    main()
