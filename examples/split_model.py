"""A split model (the Cosmos3 pattern): one transformer whose reasoner and generator take turns.

    python examples/split_model.py

The model names its parts in `_split_parts` and wraps each in
``with self.scheduler.resident(part):``.
`Scheduler.from_pipeline` makes each part an exclusive group and the model minus its parts one
resident group, so what the parts share stays on the device: the embedding, the norm, and the
tensors the model holds directly (`pos_embed`, `scale_shift_table`, as many DiTs do).  A copy of
the model that was never attached runs the same code with `NoOffload`.
"""

import copy

import torch
from torch import nn

from residency import Scheduler, SupportsComponentDiscovery, SplitModel

WIDTH = 64


def stack(depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth)))


class Cosmos3Like(SplitModel, nn.Module):
    _split_parts = {"reasoner": "reasoner", "generator": ("generator", "head")}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)  # shared by both parts: stays resident
        self.norm = nn.LayerNorm(WIDTH)
        self.pos_embed = nn.Parameter(torch.randn(WIDTH) / 10)  # held directly: resident too
        self.register_buffer("scale_shift_table", torch.randn(2, WIDTH) / 10)
        self.reasoner, self.generator, self.head = stack(3), stack(3), nn.Linear(WIDTH, WIDTH)

    def reason(self, tokens: torch.Tensor) -> torch.Tensor:
        with self.scheduler.resident("reasoner"):
            return self.reasoner(self.norm(self.embed(tokens) + self.pos_embed))

    def denoise(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift, scale = self.scale_shift_table
        with self.scheduler.resident("generator"):
            hidden = self.norm(self.generator(latents + context.mean(0))) * (1 + scale) + shift
            return self.head(hidden)

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
    shared = scheduler["transformer"]  # the model minus its parts
    held = {id(tensor) for tensor in shared.tensors}
    print("resident group 'transformer' holds:",
          [name for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) in held])
    buffer = shared.device_storage.buffer  # pos_embed reads the device copy from now on
    assert model.pos_embed.data_ptr() - buffer.data_ptr() in range(buffer.numel())

    tokens, noise = torch.randint(0, 16, (5,)), torch.randn(5, WIDTH)
    latents, expected = noise, noise
    with torch.no_grad():
        for step in range(3):
            context = model.reason(tokens)
            assert scheduler.current == "reasoner" and not scheduler["generator"].is_resident
            latents = model.denoise(latents, context)
            assert scheduler.current == "generator" and not scheduler["reasoner"].is_resident
            assert model.pos_embed.data_ptr() - buffer.data_ptr() in range(buffer.numel())  # stayed
            print(f"step {step}: resident {scheduler.resident_groups()}")
            expected = plain.transformer(tokens, expected)  # the same forward, offloading off
        image, expected = pipe.vae(latents), plain.vae(expected)
    assert torch.equal(image, expected), "offloaded output differs from the plain model"
    print(f"{scheduler.transitions.count} transitions; one part on the device at a time")
    print("outputs bit-identical to the model never offloaded")
    scheduler.close()


if __name__ == "__main__":
    main()
