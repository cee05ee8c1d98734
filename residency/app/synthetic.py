"""A built-in synthetic pipeline shaped like Wan2.2-T2V-A14B, for the main job and for benchmarks.

    pipe = SyntheticWan22.build("small")    # text encoder, two experts, VAE (plain modules)
    pipe.offload = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]})
    video = pipe("a cat on the moon", steps=8, seed=0)

The parts mirror Wan2.2 T2V A14B: a UMT5-style text encoder, a high-noise expert (`transformer`) and
a low-noise expert (`transformer_2`) that take the denoising steps above and below a boundary, and a
VAE decoder.  Each DiT block has Wan's parameter layout (self-attention, cross-attention, FFN:
8*dim^2 + 2*dim*ffn weights), so the ``"a14b"`` size has Wan2.2's 14 B parameters per expert.

Rules: weights come from a seeded generator, never from torch's global RNG, so two builds of a size
are bit-identical; the model code wraps each component's work in
``with self.offload.resident(path):`` (a `NoOffload` until a scheduler is attached), which is all
offloading needs.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from residency.pipelines.discovery import SupportsComponentDiscovery
from residency.group.no_offload import NoOffload

__all__ = ["SIZES", "SyntheticSize", "SyntheticWan22", "weight_nbytes"]


@attrs.frozen(kw_only=True)
class SyntheticSize:
    """The shape of one synthetic pipeline (see `SIZES`)."""

    name: str
    #: DiT hidden size, attention heads, blocks per expert, FFN width.
    dim: int
    heads: int
    layers: int
    ffn: int
    #: Text encoder hidden size, heads, layers, FFN width, vocabulary, tokens per prompt.
    text_dim: int
    text_heads: int
    text_layers: int
    text_ffn: int
    vocab: int
    text_tokens: int
    #: Latent video: channels, frames, height, width (height and width even: 1x2x2 patches).
    latent_channels: int
    latent_frames: int
    latent_height: int
    latent_width: int
    #: VAE decoder channels (it upsamples 8x in height and width, like Wan's VAE).
    vae_dim: int
    #: The dtype the weights are built in.
    dtype: torch.dtype = torch.float32


#: Named sizes.  "small" runs in seconds on a laptop CPU; "a14b" is Wan2.2-T2V-A14B's shape
#: (about 14 B parameters per expert, 5.7 B in the text encoder: ~68 GB of bf16 weights).
SIZES: dict[str, SyntheticSize] = {
    size.name: size
    for size in (
        SyntheticSize(name="tiny", dim=32, heads=2, layers=1, ffn=64, text_dim=16, text_heads=2,
                      text_layers=1, text_ffn=32, vocab=64, text_tokens=8, latent_channels=4,
                      latent_frames=2, latent_height=4, latent_width=4, vae_dim=8),
        SyntheticSize(name="small", dim=512, heads=8, layers=4, ffn=1536, text_dim=256,
                      text_heads=4, text_layers=2, text_ffn=640, vocab=4096, text_tokens=32,
                      latent_channels=16, latent_frames=3, latent_height=16, latent_width=16,
                      vae_dim=32),
        SyntheticSize(name="medium", dim=1024, heads=16, layers=8, ffn=3072, text_dim=1024,
                      text_heads=16, text_layers=4, text_ffn=2560, vocab=32768, text_tokens=64,
                      latent_channels=16, latent_frames=5, latent_height=30, latent_width=52,
                      vae_dim=64),
        SyntheticSize(name="large", dim=2048, heads=16, layers=16, ffn=5632, text_dim=2048,
                      text_heads=16, text_layers=8, text_ffn=5120, vocab=65536, text_tokens=128,
                      latent_channels=16, latent_frames=11, latent_height=30, latent_width=52,
                      vae_dim=96, dtype=torch.bfloat16),
        SyntheticSize(name="a14b", dim=5120, heads=40, layers=40, ffn=13824, text_dim=4096,
                      text_heads=64, text_layers=24, text_ffn=10240, vocab=256384,
                      text_tokens=512, latent_channels=16, latent_frames=21, latent_height=60,
                      latent_width=104, vae_dim=96, dtype=torch.bfloat16),
    )
}

#: Wan2.2 T2V: the high-noise expert takes the steps whose noise level is at least this.
BOUNDARY = 0.875
#: Flow-matching timestep shift.
SHIFT = 5.0
_FREQ_DIM = 256


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, context_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(context_dim or dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        k, v = self.kv(x if context is None else context).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (self.q(x), k, v))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class _TextBlock(nn.Module):
    """UMT5-style: self-attention and a gated FFN, pre-norm."""

    def __init__(self, size: SyntheticSize) -> None:
        super().__init__()
        d = size.text_dim
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = _Attention(d, size.text_heads)
        self.gate_up = nn.Linear(d, 2 * size.text_ffn, bias=False)
        self.down = nn.Linear(size.text_ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.gelu(gate, approximate="tanh") * up)


class TextEncoder(nn.Module):
    """Token ids (batch, tokens) -> embeddings (batch, tokens, text_dim)."""

    #: The block list layer mode streams (declared the vLLM-Omni way, so every size streams).
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, size: SyntheticSize) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.text_dim)
        self.blocks = nn.ModuleList(_TextBlock(size) for _ in range(size.text_layers))
        self.norm = nn.RMSNorm(size.text_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class _DiTBlock(nn.Module):
    """Wan's block: modulated self-attention, cross-attention to the text, modulated FFN."""

    def __init__(self, size: SyntheticSize) -> None:
        super().__init__()
        d = size.dim
        self.modulation = nn.Parameter(torch.empty(1, 6, d))
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.self_attn = _Attention(d, size.heads)
        self.norm2 = nn.LayerNorm(d)
        self.cross_attn = _Attention(d, size.heads)
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, size.ffn), nn.GELU(approximate="tanh"),
                                 nn.Linear(size.ffn, d))

    def forward(self, x: torch.Tensor, time: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + time).chunk(6, dim=1)
        x = x + gate1 * self.self_attn(self.norm1(x) * (1 + scale1) + shift1)
        x = x + self.cross_attn(self.norm2(x), context)
        return x + gate2 * self.ffn(self.norm3(x) * (1 + scale2) + shift2)


class DiT(nn.Module):
    """One Wan expert: latents (batch, channels, frames, h, w), timestep, text -> velocity."""

    #: The block list layer mode streams (declared the vLLM-Omni way, so every size streams).
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, size: SyntheticSize) -> None:
        super().__init__()
        d, patch = size.dim, size.latent_channels * 4
        self.patch_embed = nn.Linear(patch, d)
        self.text_embed = nn.Sequential(nn.Linear(size.text_dim, d), nn.GELU(approximate="tanh"),
                                        nn.Linear(d, d))
        self.time_embed = nn.Sequential(nn.Linear(_FREQ_DIM, d), nn.SiLU(), nn.Linear(d, d))
        self.time_project = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(_DiTBlock(size) for _ in range(size.layers))
        self.head_modulation = nn.Parameter(torch.empty(1, 2, d))
        self.head_norm = nn.LayerNorm(d, elementwise_affine=False)
        self.head = nn.Linear(d, patch)

    def forward(self, latents: torch.Tensor, sigma: float, context: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = latents.shape
        patches = latents.reshape(b, c, f, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
        x = self.patch_embed(patches.reshape(b, f * (h // 2) * (w // 2), c * 4))
        time = self.time_embed(_sinusoid(sigma * 1000.0, x))
        context = self.text_embed(context)
        modulation = self.time_project(time).unflatten(1, (6, -1))
        for block in self.blocks:
            x = block(x, modulation, context)
        shift, scale = (self.head_modulation + time.unsqueeze(1)).chunk(2, dim=1)
        out = self.head(self.head_norm(x) * (1 + scale) + shift)
        out = out.reshape(b, f, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
        return out.reshape(b, c, f, h, w)


class VAEDecoder(nn.Module):
    """Latents (batch, channels, frames, h, w) -> video (batch, frames, 3, 8h, 8w), per frame."""

    def __init__(self, size: SyntheticSize) -> None:
        super().__init__()
        c = size.vae_dim
        layers: list[nn.Module] = [nn.Conv2d(size.latent_channels, c, 3, padding=1)]
        for _ in range(3):
            layers += [nn.GroupNorm(1, c), nn.SiLU(), nn.Upsample(scale_factor=2.0),
                       nn.Conv2d(c, c, 3, padding=1)]
        layers += [nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1), nn.Tanh()]
        self.decoder = nn.Sequential(*layers)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = latents.shape
        frames = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        return self.decoder(frames).unflatten(0, (b, f))


def _sinusoid(t: float, like: torch.Tensor) -> torch.Tensor:
    half = _FREQ_DIM // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    angles = t * freqs  # on the host in float64: the same bits whichever device computes
    embedding = torch.cat([angles.cos(), angles.sin()]).unsqueeze(0)
    return embedding.to(device=like.device, dtype=like.dtype)


class SyntheticWan22(SupportsComponentDiscovery, nn.Module):
    """Text encoder, high-noise expert, low-noise expert, VAE: Wan2.2 T2V's parts and phases.

        pipe = SyntheticWan22.build("tiny")
        pipe.offload = Scheduler.from_pipeline(
            pipe, {"mode": "module", "components": ["dit", "text_encoder"]}
        )
        video = pipe("a red dog", steps=4, seed=0)

    Declares its components the vLLM-Omni way (`_dit_modules`, `_encoder_modules`, `_vae_modules`)
    and enters ``self.offload.resident(path)`` around each component's work.  Latents start on
    ``self.offload.device`` (the host for a `NoOffload` without a device).
    """

    _dit_modules: ClassVar[tuple[str, ...]] = ("transformer", "transformer_2")
    _encoder_modules: ClassVar[tuple[str, ...]] = ("text_encoder",)
    _vae_modules: ClassVar[tuple[str, ...]] = ("vae",)
    _resident_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, size: SyntheticSize) -> None:
        super().__init__()
        self.size = size
        self.text_encoder = TextEncoder(size)
        self.transformer = DiT(size)
        self.transformer_2 = DiT(size)
        self.vae = VAEDecoder(size)
        #: Where the components' phases run: a Scheduler, or NoOffload (offloading off).
        #: The phases' scheduler (named `offload`, not `scheduler`: in a diffusers pipeline that
        #: name is the noise scheduler).
        self.offload: object = NoOffload()

    @classmethod
    def build(cls, size: str | SyntheticSize = "small", *, seed: int = 0) -> SyntheticWan22:
        """Build a size on the host with deterministic weights (same size and seed, same bits)."""
        size = SIZES[size] if isinstance(size, str) else size
        with torch.device("meta"):
            pipe = cls(size).to(size.dtype)  # no memory yet: the weights are allocated once, below
        pipe.to_empty(device="cpu")
        _initialise(pipe, seed)
        return pipe

    @property
    def device(self) -> torch.device:
        """The compute device: the scheduler's, else where the first expert's weights are."""
        device = getattr(self.offload, "device", None)
        return device if device is not None else next(self.transformer.parameters()).device

    def tokenize(self, prompt: str) -> torch.Tensor:
        """Deterministic word ids (CRC32 of each word), padded with 0 to `text_tokens`."""
        words = prompt.split()[: self.size.text_tokens]
        ids = [1 + zlib.crc32(word.encode()) % (self.size.vocab - 1) for word in words]
        ids += [0] * (self.size.text_tokens - len(ids))
        return torch.tensor([ids])

    def timesteps(self, steps: int) -> list[tuple[str, float, float]]:
        """(expert path, sigma, next sigma) per step: shifted flow matching, Wan2.2's boundary."""
        sigmas = [1.0 - i / steps for i in range(steps + 1)]
        sigmas = [SHIFT * s / (1 + (SHIFT - 1) * s) for s in sigmas]
        return [
            ("transformer" if sigma >= BOUNDARY else "transformer_2", sigma, following)
            for sigma, following in zip(sigmas, sigmas[1:], strict=False)
        ]

    @torch.no_grad()
    def forward(
        self, prompt: str, *, steps: int = 8, seed: int = 0,
        progress: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """A video (batch, frames, 3, height, width) for `prompt`, in `steps` Euler steps.

        `progress`, when given, is called with a short line before each phase ("text_encoder",
        "step 3/8: transformer", "vae").
        """
        device, size = self.device, self.size
        report = progress or _silent
        report("text_encoder")
        with self.offload.resident("text_encoder"):
            context = self.text_encoder(self.tokenize(prompt).to(device))
        shape = (1, size.latent_channels, size.latent_frames, size.latent_height, size.latent_width)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        latents = noise.to(device=device, dtype=size.dtype)
        for step, (path, sigma, following) in enumerate(self.timesteps(steps), start=1):
            report(f"step {step}/{steps}: {path}")
            with self.offload.resident(path):
                velocity = getattr(self, path)(latents, sigma, context)
            latents = latents + (following - sigma) * velocity
        report("vae")
        with self.offload.resident("vae"):
            return self.vae(latents)


def weight_nbytes(size: SyntheticSize) -> dict[str, int]:
    """The bytes of each component's parameters and buffers at `size`, without building them
    (the modules are made on the meta device).

        weight_nbytes(SIZES["small"])   # {'text_encoder': ..., 'transformer': ..., ...}
    """
    with torch.device("meta"):
        pipe = SyntheticWan22(size).to(size.dtype)
    return {name: sum(t.numel() * t.element_size() for t in module.state_dict().values())
            for name, module in pipe.named_children()}


def _silent(line: str) -> None:
    """The default `progress`: report nothing."""


def _initialise(pipe: nn.Module, seed: int) -> None:
    """Fill every parameter from one seeded generator: normals scaled by 1/sqrt(fan-in), norms 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in pipe.named_parameters():
            if parameter.dim() == 1:
                is_scale = name.endswith("weight")  # norm scales; biases start at zero
                parameter.fill_(1.0 if is_scale else 0.0)
                continue
            fan_in = parameter[0].numel() if parameter.dim() > 1 else 1
            small = name.endswith("modulation") or name == "text_encoder.embed.weight"
            std = 0.02 if small else fan_in**-0.5
            parameter.normal_(0.0, std, generator=generator)
