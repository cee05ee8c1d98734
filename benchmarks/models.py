"""Synthetic models for the benchmarks: weights of an exact size and tensor count, nothing else.

    group = Stack(nbytes=400 * MiB, count=400)      # 400 leaves of 1 MiB, an nn.ModuleList of blocks
    y = group(torch.ones(1))                         # runs every leaf (hooks and phases fire)
    wide = ManyModules(modules=1_000)                # ~1,000 submodules, a forward that touches one

Weights are filled with a constant (every page touched, so no copy reads the zero page); the values do
not matter to a copy.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Leaf", "ManyModules", "Placed", "Stack", "drawing_device", "split_evenly"]


def drawing_device(device: torch.device) -> torch.device:
    """Where seeded weights for `device` are drawn: on it when it has a random generator of its own
    (fast on a GPU), else on the CPU (the simulated device has none; its ops use the CPU's).

        generator = torch.Generator(device=drawing_device(device)).manual_seed(0)
    """
    try:
        torch.Generator(device=device)
    except (NotImplementedError, RuntimeError):
        return torch.device("cpu")
    return device


class Placed(nn.Module):
    """A module that reports the ``dtype`` and ``device`` of its first weight, as diffusers' models do.

    diffusers' pipeline methods (``to``, ``enable_model_cpu_offload``) read these on every component.
    """

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


class Leaf(nn.Module):
    """One weight vector; ``forward(x)`` adds its first element to `x` (one small kernel)."""

    def __init__(self, numel: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel, dtype=dtype, device=device).fill_(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[:1]


class Stack(Placed):
    """`count` leaves holding `nbytes` between them, as an ``nn.ModuleList`` named ``blocks``.

    ``blocks`` is what diffusers' block-level group offloading splits on.
    """

    def __init__(self, nbytes: int, count: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        numels = split_evenly(max(nbytes // dtype.itemsize, count), count)
        self.blocks = nn.ModuleList(Leaf(n, dtype=dtype, device=device) for n in numels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class ManyModules(Stack):
    """About `modules` submodules of 64 weights each, and a forward that reads only the first.

    An offloader that walks every module on each forward (or does nothing) shows its own cost here
    instead of hiding it under compute.
    """

    def __init__(self, modules: int, *, device: torch.device | str = "cpu") -> None:
        super().__init__(nbytes=modules * 64 * 4, count=modules, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def split_evenly(total: int, parts: int) -> list[int]:
    """`parts` positive integers summing to `total` (the first ones one larger when it does not divide)."""
    if parts <= 0 or total < parts:
        raise ValueError(f"cannot split {total} into {parts} positive parts")
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)
