"""Layer mode (issue 14) under measurement: a Wan-shaped DiT whose blocks stream through two slots.

    shape = DiTShape.shrunk()                        # Wan blocks at hidden 256, bf16
    state = make_state(shape, torch.device("cpu"))   # seeded weights, kept on the host
    run = install("layers", build(shape, state), device)          # one of MODES
    out = run.step(*inputs(shape, device))                         # one denoising step
    floor = StepFloor(install("none", build(shape, state), device), run.block_nbytes, device)

The model mirrors diffusers' ``WanTransformer3DModel`` where the bytes and the tensor count
matter: each block holds the 27 tensors of a ``WanTransformerBlock`` (a modulation table, self-
and cross-attention with q/k norms, a norm, a GELU feed-forward) with the same shapes, and the rest
of the model (patch embedding, text and time embedders, output head) is the resident part.  No
rotary embedding, no 3D patching: the same weights and inputs give the same output under every
mode, which is what a bit-identity check needs.  `diffusers_wan` builds the real diffusers model
at a given size, for the side-by-side with diffusers' own group offloading.

Modes (`install`): ``none`` (everything on the device), ``layers`` / ``layers_no_detection``
(ours, ``layers=model_blocks(model, resident_layers=N)``, edit detection on / off), ``module``
(ours, module mode: the DiT stays resident between steps, the whole model on the device),
``module_swapped`` (ours, module mode, another group entered between steps: the DiT is copied in
every step) and ``diffusers_group_offload`` (``apply_group_offloading`` block level, one block per
group, a stream on an accelerator).

[Note: the floor of a layer-mode step on a CPU]
On a CPU the "device" is host memory and every copy completes before the call returns: nothing
overlaps.  A streamed step therefore costs at least the unoffloaded step plus one copy of every
streamed block's bytes; what is left over is the layer machinery (re-pointing, edit checks, records,
the per-block forward wrapper), and with ``detect_edits`` the digests of each block at load and at
eviction.  `StepFloor` times both parts once per measured round (see [Note: why the floor is timed
before every round] in `benchmarks.floor`): the unoffloaded step on an identical model, and a copy
of each streamed block's bytes from its own host buffer into one of two reused buffers (the layout
of the two slots: the sources are as cold in the cache as the masters are).  On an accelerator the
copy of block i+1 runs beside block i's compute, and the floor is the step itself when compute >=
copy; `benchmarks.gpu_check` measures that.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.floor import synchronize
from benchmarks.models import drawing_device
from residency import Scheduler
from residency.modules.blocks import model_blocks

__all__ = [
    "MODES",
    "DiTShape",
    "Offloaded",
    "StepFloor",
    "WanBlock",
    "WanDiT",
    "build",
    "bytes_moved_per_step",
    "diffusers_wan",
    "inputs",
    "install",
    "make_state",
    "prefetch_order",
    "source_commit",
]

#: Every way `install` runs the DiT.
MODES = ("none", "layers", "layers_no_detection", "module", "module_swapped",
         "diffusers_group_offload")
#: Tensors of one diffusers ``WanTransformerBlock`` (and of one `WanBlock`).
WAN_BLOCK_TENSORS = 27


@attrs.frozen(kw_only=True)
class DiTShape:
    """Sizes of the Wan-shaped DiT.  ``dim`` is heads x head dim; ``tokens`` the latent tokens."""

    dim: int
    ffn_dim: int
    heads: int
    blocks: int
    tokens: int
    text_tokens: int = 16
    text_dim: int = 256
    in_dim: int = 64
    freq_dim: int = 256
    dtype: torch.dtype = torch.bfloat16
    #: Blocks whose forward returns its input untouched (no weight read): what a step costs
    #: beyond its compute, which no cache effect on that compute can flatter.
    hollow: bool = False

    @classmethod
    def tiny(cls, blocks: int = 3) -> DiTShape:
        """Kilobytes, float32: the code paths in seconds (CI, dry runs)."""
        return cls(dim=32, ffn_dim=64, heads=2, blocks=blocks, tokens=4, text_tokens=4, text_dim=16,
                   in_dim=8, freq_dim=16, dtype=torch.float32)

    @classmethod
    def shrunk(cls, blocks: int = 8, tokens: int = 4) -> DiTShape:
        """Wan2.1-1.3B blocks shrunk to hidden 256 (ffn 1,493: the 1.3B model's ratio), bf16:
        2.6 MiB per block, so the copy does not drown the per-tensor overhead in noise."""
        return cls(dim=256, ffn_dim=1493, heads=2, blocks=blocks, tokens=tokens)

    @classmethod
    def wan_1_3b(cls, blocks: int = 3, tokens: int = 4) -> DiTShape:
        """The blocks of Wan2.1-T2V-1.3B (hidden 1,536, ffn 8,960, 12 heads), bf16: 88.5 MiB
        each."""
        return cls(dim=1536, ffn_dim=8960, heads=12, blocks=blocks, tokens=tokens, text_dim=4096)

    @classmethod
    def stepping(cls, blocks: int = 6, tokens: int = 256) -> DiTShape:
        """A small Wan-shaped DiT for whole denoising steps on a CPU: hidden 512, 6 blocks of
        10.1 MiB, 256 latent tokens (the step is real compute, not call overhead)."""
        return cls(dim=512, ffn_dim=2987, heads=4, blocks=blocks, tokens=tokens)

    @classmethod
    def wan_14b(cls, blocks: int = 8, tokens: int = 8192) -> DiTShape:
        """The blocks of Wan2.1/2.2-14B (hidden 5,120, ffn 13,824, 40 heads), bf16: 672 MiB each."""
        return cls(dim=5120, ffn_dim=13824, heads=40, blocks=blocks, tokens=tokens,
                   text_tokens=512, text_dim=4096)

    def with_tokens(self, tokens: int) -> DiTShape:
        return attrs.evolve(self, tokens=tokens)

    def hollowed(self) -> DiTShape:
        """The same weights, blocks that compute nothing."""
        return attrs.evolve(self, hollow=True)

    def block_nbytes(self) -> int:
        """Bytes of one block's 27 tensors."""
        d, f, itemsize = self.dim, self.ffn_dim, self.dtype.itemsize
        attention = 4 * (d * d + d) + 2 * d
        return itemsize * (6 * d + 2 * attention + 2 * d + (d * f + f) + (f * d + d))


# -- the model -------------------------------------------------------------------------------------


class _Attention(nn.Module):
    """diffusers' WanAttention's tensors: to_q/k/v, to_out.0 (weights and biases), norm_q/k."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        q = self.norm_q(self.to_q(x))
        k = self.norm_k(self.to_k(context))
        v = self.to_v(context)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.to_out[0](out)


class _GeluProjection(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class _FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(_GeluProjection(dim, ffn_dim), nn.Identity(),
                                 nn.Linear(ffn_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WanBlock(nn.Module):
    """The 27 tensors of diffusers' ``WanTransformerBlock``, with its modulated forward."""

    def __init__(self, dim: int, ffn_dim: int, heads: int, *, hollow: bool = False) -> None:
        super().__init__()
        self.hollow = hollow
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.attn1 = _Attention(dim, heads)
        self.attn2 = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ffn = _FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                modulation: torch.Tensor) -> torch.Tensor:
        if self.hollow:
            return x
        table = self.scale_shift_table + modulation
        shift, scale, gate, c_shift, c_scale, c_gate = table.chunk(6, 1)
        h = _norm(x) * (1 + scale) + shift
        x = x + self.attn1(h, h) * gate
        x = x + self.attn2(self.norm2(x), context)
        h = _norm(x) * (1 + c_scale) + c_shift
        return x + self.ffn(h) * c_gate


class WanDiT(nn.Module):
    """Patch embedding, text and time embedders, `shape.blocks` Wan blocks, an output head."""

    #: vLLM-Omni's declaration, read by model_blocks.
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, shape: DiTShape) -> None:
        super().__init__()
        d = shape.dim
        self.patch_embedding = nn.Linear(shape.in_dim, d)
        self.text_embedder = _Embedder(shape.text_dim, d)
        self.time_embedder = _Embedder(shape.freq_dim, d)
        self.time_proj = nn.Linear(d, 6 * d)
        self.blocks = nn.ModuleList(WanBlock(d, shape.ffn_dim, shape.heads, hollow=shape.hollow)
                                    for _ in range(shape.blocks))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.proj_out = nn.Linear(d, shape.in_dim)

    @property
    def dtype(self) -> torch.dtype:  # diffusers' hooks and pipelines read these
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def forward(self, latents: torch.Tensor, context: torch.Tensor,
                time_features: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(latents)
        context = self.text_embedder(context)
        temb = self.time_embedder(time_features)
        modulation = self.time_proj(F.silu(temb)).unflatten(1, (6, -1))
        for block in self.blocks:
            x = block(x, context, modulation)
        shift, scale = (self.scale_shift_table + temb[:, None]).chunk(2, dim=1)
        return self.proj_out(_norm(x) * (1 + scale) + shift)


class _Embedder(nn.Module):
    def __init__(self, dim_in: int, dim: int) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(dim_in, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def make_state(shape: DiTShape, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights (normal, std 0.02; drawn on `device`, fast on a GPU, or on the CPU where the
    device has no generator), returned on the host."""
    device = drawing_device(device)
    with torch.device("meta"):
        skeleton = WanDiT(shape)
    skeleton.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for tensor in skeleton.parameters():
            tensor.normal_(0.0, 0.02, generator=generator)
    return {k: v.to(dtype=shape.dtype, device="cpu") for k, v in skeleton.state_dict().items()}


def build(shape: DiTShape, state: dict[str, torch.Tensor]) -> WanDiT:
    """A fresh host model holding copies of `state` (every mode gets its own)."""
    with torch.device("meta"):
        model = WanDiT(shape)
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    return model.requires_grad_(False).eval()


def inputs(shape: DiTShape, device: torch.device, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Latent tokens, text context and time features of one step, seeded."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    latents = torch.randn(1, shape.tokens, shape.in_dim, generator=generator)
    context = torch.randn(1, shape.text_tokens, shape.text_dim, generator=generator)
    time_features = torch.randn(1, shape.freq_dim, generator=generator)
    return tuple(t.to(device=device, dtype=shape.dtype) for t in (latents, context, time_features))


def diffusers_wan(shape: DiTShape, seed: int = 0):
    """A real diffusers ``WanTransformer3DModel`` with `shape`'s hidden size, heads, ffn and block
    count (head dim = dim / heads), seeded, in `shape.dtype`, and the inputs of one step
    (``hidden_states`` of ``shape.tokens`` patches, ``timestep``, ``encoder_hidden_states``).

    Raises ImportError when diffusers is not installed.
    """
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=shape.heads,
        attention_head_dim=shape.dim // shape.heads, in_channels=16, out_channels=16,
        text_dim=shape.text_dim, freq_dim=shape.freq_dim, ffn_dim=shape.ffn_dim,
        num_layers=shape.blocks, rope_max_seq_len=1024,
    ).to(shape.dtype).requires_grad_(False).eval()
    side = max(2, round((shape.tokens * 4) ** 0.5) // 2 * 2)  # (side/2)^2 ~ tokens patches
    generator = torch.Generator(device="cpu").manual_seed(seed + 1)
    hidden = torch.randn(1, 16, 1, side, side, generator=generator).to(shape.dtype)
    context = torch.randn(1, shape.text_tokens, shape.text_dim, generator=generator).to(shape.dtype)
    return model, {"hidden_states": hidden, "timestep": torch.tensor([500]),
                   "encoder_hidden_states": context, "return_dict": False}


# -- the modes -------------------------------------------------------------------------------------


class Offloaded:
    """One model under one mode.  ``step(*args, **kwargs)`` runs one denoising step and waits for
    it; ``close()`` undoes what `install` did as far as the mode allows."""

    def __init__(self, mode: str, model: nn.Module, device: torch.device) -> None:
        self.mode = mode
        self.model = model
        self.device = device
        self.scheduler: Scheduler | None = None
        #: Bytes of each streamed block (layer mode), in streaming order; () otherwise.
        self.block_nbytes: tuple[int, ...] = ()
        #: Tensors of each streamed block (layer mode).
        self.block_tensors: tuple[int, ...] = ()
        self._before: Callable[[], None] | None = None
        self._phase: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def step(self, *args, **kwargs):
        with torch.no_grad():
            if self._before is not None:
                self._before()
            with self._phase():
                out = self.model(*args, **kwargs)
        synchronize(self.device)
        return out[0] if isinstance(out, tuple) else out

    @property
    def device_nbytes(self) -> int | None:
        """Device bytes of weights this mode holds while a step runs (None: not known, for
        diffusers' group offloading)."""
        if self.scheduler is not None:
            return self.scheduler.device_nbytes
        if self.mode != "none":
            return None
        return sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()


def install(mode: str, model: nn.Module, device: torch.device, *, resident_layers: int = 0,
            blocks: str = "blocks") -> Offloaded:
    """Run `model` (on the host) under `mode`, one of `MODES`."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    run = Offloaded(mode, model, device)
    if mode == "none":
        model.to(device)
    elif mode in ("layers", "layers_no_detection"):
        plan = model_blocks(model, declared=[blocks], resident_layers=resident_layers)
        run.scheduler = Scheduler(device)
        run.scheduler.add("dit", model, layers=plan, detect_edits=mode == "layers")
        run.block_nbytes = tuple(b.nbytes for b in plan.streamed)
        run.block_tensors = tuple(_tensor_count(b.module) for b in plan.streamed)
        run._phase = lambda: run.scheduler.resident("dit")
    elif mode in ("module", "module_swapped"):
        run.scheduler = Scheduler(device)
        run.scheduler.add("dit", model)
        run._phase = lambda: run.scheduler.resident("dit")
        if mode == "module_swapped":
            run.scheduler.add("other", nn.Linear(8, 8))
            run._before = lambda: _enter(run.scheduler, "other")
    else:
        from diffusers.hooks import apply_group_offloading

        # The settings diffusers documents for speed: block level, one block per group, a stream.
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1,
                               use_stream=device.type != "cpu")
    return run


def _enter(scheduler: Scheduler, name: str) -> None:
    with scheduler.resident(name):
        pass


def _tensor_count(module: nn.Module) -> int:
    return len({id(t) for t in (*module.parameters(), *module.buffers())})


def bytes_moved_per_step(run: Offloaded, probe: nn.Module, *args, **kwargs) -> int | None:
    """Bytes copied host to device during one step of `run`: ours from its records (block copies
    and phase loads); for a peer, 0 when `probe`'s weight is read during the step from the very
    tensor it was offloaded to (diffusers' onload to the CPU is ``tensor.to("cpu")``, which returns
    the tensor itself: no byte moves, and the step times its hooks alone), else None (not known)."""
    scheduler = run.scheduler
    if scheduler is not None:
        before = scheduler.block_records.nbytes + scheduler.transitions.nbytes
        run.step(*args, **kwargs)
        return scheduler.block_records.nbytes + scheduler.transitions.nbytes - before
    if run.mode == "none":
        run.step(*args, **kwargs)
        return 0
    offloaded = probe.weight.data_ptr()
    seen: list[int] = []
    handle = probe.register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
    try:
        run.step(*args, **kwargs)
    finally:
        handle.remove()
    return 0 if seen and seen[0] == offloaded else None


# -- the floor -------------------------------------------------------------------------------------


class StepFloor:
    """Per measured round: one unoffloaded step, and one copy of every streamed block's bytes
    (see [Note: the floor of a layer-mode step on a CPU]).

        floor = StepFloor(lambda: plain.step(*args), block_nbytes, device)
        benchmark.pedantic(layer_step, setup=floor.before_round, rounds=40)
        floor.none_s(), floor.copy_s(), floor.floor_s()
    """

    def __init__(self, plain_step: Callable[[], object], block_nbytes: Sequence[int],
                 device: torch.device) -> None:
        self._plain_step = plain_step
        self.device = device
        pinned = device.type != "cpu"
        self._sources = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned).fill_(1)
                         for n in block_nbytes]
        largest = max(block_nbytes, default=0)
        self._targets = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
        self._non_blocking = pinned
        self.none_samples: list[float] = []
        self.copy_samples: list[float] = []
        self.copies()  # touch the targets once: every timed copy goes into a reused buffer

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._sources)

    def copies(self) -> None:
        """Copy each block's bytes from its own source into one of two reused buffers, and wait."""
        for i, source in enumerate(self._sources):
            self._targets[i % 2][: source.numel()].copy_(source, non_blocking=self._non_blocking)
        synchronize(self.device)

    def before_round(self) -> None:
        """Time one unoffloaded step and one round of copies (pass as ``pedantic(setup=...)``)."""
        self.none_samples.append(_seconds(self._plain_step))
        self.copy_samples.append(_seconds(self.copies))

    def none_s(self) -> float:
        return statistics.median(self._samples(self.none_samples))

    def copy_s(self) -> float:
        return statistics.median(self._samples(self.copy_samples))

    def floor_s(self) -> float:
        """The median of (unoffloaded step + copies), paired per round."""
        self._samples(self.none_samples)
        return statistics.median(map(sum, zip(self.none_samples, self.copy_samples)))

    def _samples(self, samples: list[float]) -> list[float]:
        if not samples:
            self.before_round()
        return samples

    def paired(self, step_seconds: Sequence[float]) -> list[tuple[float, float, float]]:
        """(step, unoffloaded step, copies) per measured round: `step_seconds` are the measured
        rounds (``benchmark.stats.stats.data``), each paired with the floor timed in its own
        setup (warm-up rounds come first and have no measured partner)."""
        count = len(step_seconds)
        return list(zip(step_seconds, self.none_samples[-count:], self.copy_samples[-count:]))

    def paired_overhead_s(self, step_seconds: Sequence[float]) -> float:
        """Median over rounds of (step - unoffloaded step - copies), each from the same round:
        the machine's drift between rounds cancels."""
        return statistics.median(s - n - c for s, n, c in self.paired(step_seconds))

    def paired_ratio(self, step_seconds: Sequence[float]) -> float:
        """Median over rounds of step / unoffloaded step, each from the same round."""
        return statistics.median(s / n for s, n, _ in self.paired(step_seconds))


def _seconds(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


# -- block records ---------------------------------------------------------------------------------


def prefetch_order(records: Sequence, blocks: int) -> dict:
    """Whether, in one step's block records (``scheduler.block_records``), the copy of block i+1
    was issued before block i's compute began, for every streamed block.

        prefetch_order(list(scheduler.block_records)[-3 * n:], n)
        # {"blocks": 8, "computes": 8, "prefetched_ahead": 8, "loads_on_demand": 0, "ok": True, ...}

    The ring: the last block's compute is preceded by the prefetch of block 0 (the next step's
    first).  A "load" record is a block copied on demand (it was not prefetched).
    """
    computes = [r for r in records if r.kind == "compute"]
    ahead, lines = 0, []
    for position, record in enumerate(records):
        if record.kind != "compute":
            continue
        following = (record.index + 1) % blocks
        window = records[_previous_compute(records, position) + 1 : position]
        issued = [r for r in window if r.kind == "prefetch" and r.index == following]
        if blocks == 1 or issued:
            ahead += 1
        lines.append({"block": record.index, "compute_t": record.time,
                      "next_copy_issued_t": issued[-1].time if issued else None,
                      "slot": record.slot})
    loads = sum(1 for r in records if r.kind == "load")
    return {"blocks": blocks, "computes": len(computes), "prefetched_ahead": ahead,
            "loads_on_demand": loads, "ok": bool(computes) and ahead == len(computes) and not loads,
            "order": lines}


def _previous_compute(records: Sequence, position: int) -> int:
    for earlier in range(position - 1, -1, -1):
        if records[earlier].kind == "compute":
            return earlier
    return -1


def source_commit() -> str | None:
    """The library's commit (``git rev-parse --short HEAD``, "+dirty" when residency/ has
    uncommitted changes), or None outside a git checkout: layer mode is young, and its figures
    are only comparable at a known commit."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "residency"], cwd=root,
                               text=True, capture_output=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")
