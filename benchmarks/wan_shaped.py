"""A synthetic pipeline shaped like Wan2.2 text-to-video: text encoder, two DiT experts, VAE.

    config = WanShaped.full()                       # ~5.3 GiB of bf16 weights
    state = make_state(config, device)              # seeded weights, kept on the host
    parts = build(config, state)                    # fresh host modules for one offloader
    video = run(parts, offload, config, ids)        # one pipeline call (offload: benchmarks.peers)

Only the shape matters: the parts are stacks of plain ``nn.Linear`` layers sized like the real ones
(a UMT5-like encoder, two experts of the same size, the high-noise one for the first steps and the
low-noise one for the rest, a small decoder), with enough compute per step to be a real workload.
No attention, no convolutions; the same weights and input give the same output with any offloader.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.models import Placed, drawing_device

__all__ = ["COMPONENTS", "WanShaped", "build", "make_state", "run"]

#: Component names in the order a call uses them (diffusers' Wan2.2 pipeline uses the same names).
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")


@attrs.frozen(kw_only=True)
class WanShaped:
    """Sizes of the synthetic pipeline."""

    dim: int
    text_dim: int
    vocab: int
    text_blocks: int
    dit_blocks: int
    vae_blocks: int
    tokens: int
    text_tokens: int
    steps: int
    #: Steps run by the high-noise expert (``transformer``); the rest by ``transformer_2``.
    boundary: int
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def full(cls) -> WanShaped:
        """About 1.1 GiB encoder, 2 x 2.0 GiB experts, 0.2 GiB VAE; ~4 TFLOP per step."""
        return cls(dim=3072, text_dim=4096, vocab=32_000, text_blocks=3, dit_blocks=8,
                   vae_blocks=12, tokens=2048, text_tokens=512, steps=20, boundary=10)

    @classmethod
    def tiny(cls) -> WanShaped:
        """Kilobytes, for a dry run on the CPU."""
        return cls(dim=32, text_dim=48, vocab=100, text_blocks=2, dit_blocks=2, vae_blocks=2,
                   tokens=8, text_tokens=4, steps=4, boundary=2, dtype=torch.float32)


class TextEncoder(Placed):
    def __init__(self, c: WanShaped) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.text_dim)
        self.blocks = nn.ModuleList(_TextBlock(c.text_dim) for _ in range(c.text_blocks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


class _TextBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn_in, self.ffn_out = nn.Linear(dim, dim * 5 // 2), nn.Linear(dim * 5 // 2, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(_norm(x)).chunk(3, dim=-1)
        x = x + self.out(q * torch.sigmoid(k) + v)
        return x + self.ffn_out(F.gelu(self.ffn_in(_norm(x))))


class DiT(Placed):
    """One expert: a text projection and `dit_blocks` blocks of self-mixing, cross-mixing and FFN."""

    def __init__(self, c: WanShaped) -> None:
        super().__init__()
        self.text_proj = nn.Linear(c.text_dim, c.dim)
        self.blocks = nn.ModuleList(_DiTBlock(c.dim) for _ in range(c.dit_blocks))

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        text = self.text_proj(context).mean(dim=-2, keepdim=True)
        x = latents
        for block in self.blocks:
            x = block(x, text)
        return latents - 0.1 * _norm(x)


class _DiTBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.cross_q, self.cross_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ffn_in, self.ffn_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(_norm(x)).chunk(3, dim=-1)
        x = x + self.out(q * torch.sigmoid(k) + v)
        x = x + self.cross_out(self.cross_q(_norm(x)) * text)
        return x + self.ffn_out(F.gelu(self.ffn_in(_norm(x))))


class VAE(Placed):
    def __init__(self, c: WanShaped) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(c.dim, c.dim) for _ in range(c.vae_blocks))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = latents
        for block in self.blocks:
            x = x + block(F.gelu(_norm(x)))
        return x


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:])


def _skeleton(c: WanShaped) -> dict[str, nn.Module]:
    with torch.device("meta"):
        return {"text_encoder": TextEncoder(c), "transformer": DiT(c), "transformer_2": DiT(c),
                "vae": VAE(c)}


def make_state(c: WanShaped, device: torch.device, seed: int = 0) -> dict[str, dict]:
    """Seeded weights (normal, std 0.02) drawn on `device` (fast on a GPU; on the CPU where the
    device has no generator), returned on the host."""
    device = drawing_device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, module in _skeleton(c).items():
        module.to_empty(device=device)
        with torch.no_grad():
            for tensor in module.parameters():
                tensor.normal_(0.0, 0.02, generator=generator)
        state[name] = {k: v.to(dtype=c.dtype, device="cpu") for k, v in module.state_dict().items()}
    return state


def build(c: WanShaped, state: dict[str, dict]) -> dict[str, nn.Module]:
    """Fresh host modules holding copies of `state` (every offloader gets its own)."""
    parts = _skeleton(c)
    for name, module in parts.items():
        module.load_state_dict({k: v.clone() for k, v in state[name].items()}, assign=True)
        module.requires_grad_(False)
    return parts


def nbytes(module: nn.Module) -> int:
    return sum(t.nbytes for t in module.state_dict().values())


def inputs(c: WanShaped, device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and initial latents, seeded."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, c.vocab, (1, c.text_tokens), generator=generator)
    latents = torch.randn(1, c.tokens, c.dim, generator=generator).to(c.dtype)
    return ids.to(device), latents.to(device)


def run(parts: dict[str, nn.Module], offload, c: WanShaped, ids: torch.Tensor,
        latents: torch.Tensor) -> torch.Tensor:
    """One pipeline call: encode, `steps` denoising steps over two experts, decode."""
    with torch.no_grad():
        with offload.phase("text_encoder"):
            context = parts["text_encoder"](ids)
        for step in range(c.steps):
            expert = "transformer" if step < c.boundary else "transformer_2"
            with offload.phase(expert):
                latents = parts[expert](latents, context)
        with offload.phase("vae"):
            video = parts["vae"](latents)
    offload.finish()
    return video
