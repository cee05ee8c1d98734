"""``python -m benchmarks.wan_h100``: a MODEL, not a measurement, of Wan2.2-T2V-A14B on one H100
80 GB under each mode at 80, 48 and 24 GB of device budget, beside vLLM-Omni's measured seconds,
and the same schedule run through the library on the simulated device to check the model.

    python -m benchmarks.wan_h100                 # the model's table -> results/wan-h100.json
    python -m benchmarks.wan_h100 --sim           # ... and the check on the simulated device
    python -m benchmarks.wan_h100 --sim --calls 2 --out /tmp/wan.json   # shorter

No GPU runs here.  The model is arithmetic on the assumptions in `assumptions` (each with its
value, kind and source, written into the JSON); the simulated run is a SIMULATION (sleeps
standing in for a copy engine and kernels).  Neither is a GPU figure.

[Note: the schedule]
One call: the text encoder once; 40 denoising steps, the high-noise expert for the first 18
and the low-noise one for the rest; two forwards per step (classifier-free guidance, run one
after the other); the VAE decodes.  The VAE is resident (policy "resident") in every mode.
Compute is what vLLM-Omni measured without offloading (74.6 s), split between the phases as
`assumptions` says.  Bytes move host to device at one rate, r; nothing moves back (unchanged
weights are not copied back).  Per mode, the seconds of a steady call are that compute plus the
copy time no compute hides:

* none: everything on the device; nothing moves.
* module: the encoder and each expert are loaded whole when their phase begins: all exposed.
* module + prefetch: ``scheduler.prefetch`` of the next group at the start of each phase (the
  first expert during the encoder, the second during the first expert's steps, the next call's
  encoder during the VAE), where the budget holds both: a load is exposed only for the part of
  its copy longer than the phase it overlaps.
* layer: the encoder swapped whole; each expert's own part and its first k blocks loaded at
  entry (exposed), the other blocks streamed at every forward - block i+1 copied while block i
  computes, so each block exposes only max(0, copy - compute), and the first streamed block's
  copy is exposed once per entry.  k: the most blocks that fit (`resident_layers`, the best
  fixed layer mode).
* auto: the auto planner's own choice (`residency.auto.planner.choose`, fed the same sizes,
  passes and compute) at the budget less the headroom, timed by the same rules: swapped bytes
  exposed at entry, streamed blocks as in layer mode, kept bytes never.

Not modelled: the planner's and the phase changes' host seconds (microseconds to milliseconds),
edit detection's digests (a read of the weights at device memory speed, ~0.3 ms per 0.7 GB
block on an H100's 3.35 TB/s), contention of a prefetch's copy with compute, and the first call
(its reads and warm-up).

[Note: the check on the simulated device]
The same schedule runs through the library (`Scheduler`, `scheduler.prefetch`, `model_blocks`,
an auto plan) on the simulated device, with the H100's bytes divided by `BYTE_SCALE` and each
part's compute made of queued ops (`OP_DELAY_S` each) in the H100's proportions.  The model is
then fed what the simulated device measured - the encoder's and the VAE's seconds, a forward's
seconds from the call without offloading - and a copy rate chosen so that a block's copy keeps
its H100 ratio to a block's compute; each mode's steady seconds must be within `GOAL` of what
the model predicts from those.  The check runs with ``detect_edits=False``: a digest is a few
small ops, and on the simulated device every op costs `OP_DELAY_S` whatever its size, so the
digests of 40 streamed blocks per forward (and a host wait for each: [Note: keeping every edit
in layer mode] in residency/placement/layers.py) weigh there far more than on an H100, where
they read 0.7 GB at device memory speed beside 22 ms of compute.  The runs with detection on are
reported beside the check (`DETECTING`), not in it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch
from torch import nn

from benchmarks import simulator
from benchmarks.machine import describe_machine
from benchmarks.transition_model import (PUBLISHED_H2D_GBPS, PUBLISHED_H2D_SOURCE, Assumption,
                                         measured_h2d)
from residency import DeviceMemoryError, Scheduler, model_blocks
from residency.auto.planner import Workload, choose
from residency.group.plan import Where

__all__ = ["MODES", "Pipeline", "assumptions", "model", "pipeline", "simulate"]

GB = 1e9
RESULTS = Path(__file__).resolve().parent / "results"
LABEL = ("MODEL, not a measurement: arithmetic on the assumptions listed with their sources "
         "(benchmarks/wan_h100.py); no GPU ran")
MODES = ("none", "module", "module + prefetch", "layer", "auto")
#: Device budgets of the table, in GB.
BUDGETS_GB = (80, 48, 24)
#: vLLM-Omni's measured end-to-end seconds on an H100 80 GB (PR #1223), by mode.
VLLM_OMNI_S = {"none": 74.63497, "module": 121.61155, "layer": 77.30384}
VLLM_OMNI_SOURCE = (
    "measured by vLLM-Omni: PR #1223 (github.com/vllm-project/vllm-omni/pull/1223), 'Tested on "
    "NVIDIA H100 80GB HBM3', offline text-to-video example: 74634.97 ms non-offloading, "
    "121611.55 ms sequential (--enable-cpu-offload), 77303.84 ms layerwise")
#: The check: the simulated run's steady seconds within this fraction of the model's.
GOAL = 0.10
#: Simulated runs with edit detection on, beside the check (which runs with it off: the model
#: leaves digests out, see [Note: the schedule]): (budget GB, mode, detect_edits).
DETECTING = ((48, "module", True), (48, "auto", True), (24, "layer", True), (24, "auto", True))


def assumptions(h2d_gbps: float | None = None) -> dict[str, Assumption]:
    """Every input of the model with its source; `h2d_gbps` None: measured by a GPU check in
    benchmarks/results where one ran, else the published rate."""
    if h2d_gbps is not None:
        h2d = Assumption(value=h2d_gbps, unit="GB/s", kind="chosen", source="--h2d-gbps")
    else:
        h2d = measured_h2d(RESULTS) or Assumption(
            value=PUBLISHED_H2D_GBPS, unit="GB/s", kind="published", source=PUBLISHED_H2D_SOURCE)
    config = ("Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json: 40 layers, 40 heads x "
              "128 = 5120 wide, ffn_dim 13824")
    return {
        "h2d_gbps": h2d,
        "no_offload_s": Assumption(value=74.63497, unit="s", kind="published",
                                   source=VLLM_OMNI_SOURCE),
        "text_encoder_gb": Assumption(value=11.4, unit="GB", kind="published", source=(
            "Wan2.2-T2V-A14B's UMT5-XXL encoder in bf16: models_t5_umt5-xxl-enc-bf16.pth, "
            "11.4 GB (huggingface.co/Wan-AI/Wan2.2-T2V-A14B)")),
        "expert_blocks": Assumption(value=40, unit="blocks", kind="published", source=config),
        "expert_block_gb": Assumption(value=0.704, unit="GB", kind="derived", source=(
            config + ": per block 4 x 5120^2 self-attention + 4 x 5120^2 cross-attention + "
            "2 x 5120 x 13824 feed-forward = 351.9M parameters (norms and modulation aside), "
            "x 2 bytes (bf16)")),
        "expert_own_gb": Assumption(value=0.4, unit="GB", kind="derived", source=(
            config + ": patch, text and time embeddings and the head outside the blocks, "
            "~0.2B parameters in bf16; the expert totals 28.6 GB, as the issue's ~28 GB")),
        "vae_gb": Assumption(value=0.5, unit="GB", kind="published", source=(
            "Wan2.1_VAE.pth, 508 MB (huggingface.co/Wan-AI/Wan2.2-T2V-A14B), kept resident")),
        "steps": Assumption(value=40, unit="steps", kind="published", source=(
            "vLLM-Omni's text-to-video example, its Wan preset (examples/offline_inference/"
            "text_to_video/text_to_video.py: 40 steps, guidance 4.0); PR #1223 ran that example "
            "but does not print its settings")),
        "high_noise_steps": Assumption(value=18, unit="steps", kind="published", source=(
            "vLLM-Omni PR #3224: with boundary_ratio 0.875 'we expect transformer switch at "
            "step 18' of 40")),
        "forwards_per_step": Assumption(value=2, unit="forwards", kind="derived", source=(
            "guidance 4.0 > 1: a conditional and an unconditional forward per step, one after "
            "the other (vLLM-Omni's default cfg_parallel_size=1)")),
        "text_encoder_s": Assumption(value=0.5, unit="s", kind="chosen", source=(
            "the encoder's share of the 74.6 s (not published): one forward of a 5.7B model "
            "over 512 tokens")),
        "vae_s": Assumption(value=4.0, unit="s", kind="chosen", source=(
            "the VAE decode's share of the 74.6 s (not published); the rest is the 80 DiT "
            "forwards, spread evenly over the 40 blocks")),
        "headroom_gb": Assumption(value=6.0, unit="GB", kind="chosen", source=(
            "device memory kept free for activations: the no-offload run held 69.1 GB of "
            "weights on 80 GB, leaving at most 10.9 GB for them")),
    }


@attrs.frozen(kw_only=True)
class Pipeline:
    """What the model needs of a pipeline and its device (bytes, seconds, bytes per second)."""

    encoder: float
    own: float  # an expert's bytes outside its blocks
    block: float  # one expert block's bytes
    blocks: int
    vae: float
    #: Forwards of the high-noise expert and of the low-noise one per call.
    passes: tuple[int, int]
    encoder_s: float
    #: One expert forward's compute, all of it in the blocks.
    forward_s: float
    vae_s: float
    #: Host seconds per call outside the phases.
    host_s: float
    rate: float
    headroom: float

    @property
    def expert(self) -> float:
        return self.own + self.blocks * self.block

    @property
    def block_s(self) -> float:
        return self.forward_s / self.blocks

    @property
    def compute_s(self) -> float:
        return self.encoder_s + sum(self.passes) * self.forward_s + self.vae_s + self.host_s


def pipeline(given: dict[str, Assumption]) -> Pipeline:
    """The H100 pipeline of `assumptions`."""
    value = {name: a.value for name, a in given.items()}
    steps, high = value["steps"], value["high_noise_steps"]
    passes = (high * value["forwards_per_step"], (steps - high) * value["forwards_per_step"])
    forwards = value["no_offload_s"] - value["text_encoder_s"] - value["vae_s"]
    return Pipeline(encoder=value["text_encoder_gb"] * GB, own=value["expert_own_gb"] * GB,
                    block=value["expert_block_gb"] * GB, blocks=value["expert_blocks"],
                    vae=value["vae_gb"] * GB, passes=passes, encoder_s=value["text_encoder_s"],
                    forward_s=forwards / sum(passes), vae_s=value["vae_s"], host_s=0.0,
                    rate=value["h2d_gbps"] * GB, headroom=value["headroom_gb"] * GB)


# -- the model ---------------------------------------------------------------------------------


def model(p: Pipeline, mode: str, budget: float) -> dict:
    """A steady call of `mode` within `budget` device bytes: whether it fits, the bytes it
    moves, the copy seconds no compute hides and the seconds (see [Note: the schedule])."""
    weights = budget - p.headroom
    if mode == "none":
        fits = p.encoder + 2 * p.expert + p.vae <= weights
        return _row(p, fits, 0.0, 0.0, "everything kept")
    if mode in ("module", "module + prefetch"):
        return _module(p, weights, prefetch=mode != "module")
    if mode == "layer":
        return _layer(p, weights)
    if mode == "auto":
        return _auto(p, weights)
    raise ValueError(f"mode {mode!r}: give one of {MODES}")


def _row(p: Pipeline, fits: bool, nbytes: float, exposed: float, how: str) -> dict:
    return {"fits": fits, "nbytes": nbytes if fits else None, "exposed_s": exposed if fits else
            None, "seconds": p.compute_s + exposed if fits else None, "how": how}


def _module(p: Pipeline, weights: float, *, prefetch: bool) -> dict:
    fits = max(p.encoder, p.expert) + p.vae <= weights
    loads = [(p.encoder, p.vae_s, p.encoder + p.expert + p.vae <= weights),  # beside the 2nd
             (p.expert, p.encoder_s, p.encoder + p.expert + p.vae <= weights),
             (p.expert, p.passes[0] * p.forward_s, 2 * p.expert + p.vae <= weights)]
    exposed, how = 0.0, []
    for nbytes, beside, room in loads:
        hidden = beside if prefetch and room else 0.0
        exposed += max(0.0, nbytes / p.rate - hidden)
        how.append("prefetched" if prefetch and room else "loaded")
    return _row(p, fits, p.encoder + 2 * p.expert, exposed,
                "encoder, expert 1, expert 2: " + ", ".join(how))


def _layer(p: Pipeline, weights: float) -> dict:
    """The resident blocks k that fit with the least seconds, then the fewest bytes: the best
    fixed layer mode."""
    best = None
    for kept in range(p.blocks):
        if max(p.encoder, p.own + kept * p.block + 2 * p.block) + p.vae > weights:
            break
        streamed = p.blocks - kept
        ring = p.block if streamed > 1 else 0.0
        nbytes = p.encoder + sum(p.own + kept * p.block + n * streamed * p.block + ring
                                 for n in p.passes)
        exposed = p.encoder / p.rate + sum(
            _streaming_s(p, p.own + kept * p.block, streamed, n) for n in p.passes)
        if best is None or (exposed, nbytes) < best[:2]:
            best = (exposed, nbytes, kept)
    if best is None:
        return _row(p, False, 0.0, 0.0, "no resident_layers fits")
    return _row(p, True, best[1], best[0], f"resident_layers={best[2]}")


def _streaming_s(p: Pipeline, entry: float, streamed: int, passes: int) -> float:
    """Exposed copy seconds of one entry of an expert: `entry` bytes loaded at once, then
    `streamed` blocks streamed at each of `passes` forwards (see [Note: the schedule])."""
    copy = p.block / p.rate
    if streamed <= 1:  # a single streamed block has no block before it to hide its copy
        return entry / p.rate + passes * streamed * copy
    return entry / p.rate + copy + passes * streamed * max(0.0, copy - p.block_s)


def workloads(p: Pipeline, *, scale: float = 1.0) -> list[Workload]:
    """The planner's view of `p` (bytes divided by `scale`, as whole numbers)."""
    def size(nbytes: float) -> tuple[int, int]:
        return (round(nbytes / scale),) * 2

    groups = [Workload(name="text_encoder", own=size(p.encoder), compute_seconds=p.encoder_s)]
    for name, passes in zip(("transformer", "transformer_2"), p.passes):
        blocks = tuple((f"{name}.blocks.{i}", *size(p.block)) for i in range(p.blocks))
        groups.append(Workload(name=name, own=size(p.own), blocks=blocks, passes=passes,
                               compute_seconds=passes * p.forward_s))
    groups.append(Workload(name="vae", own=size(p.vae), exclusive=False,
                           compute_seconds=p.vae_s))
    return groups


def _auto(p: Pipeline, weights: float) -> dict:
    scale = 1e3 if p.block > 1e6 else 1.0  # whole numbers for the planner: kB at GB sizes
    try:
        plans = choose(workloads(p, scale=scale), weights_budget=int(weights / scale),
                       bandwidth=p.rate / scale, overlap=True)
    except DeviceMemoryError as error:  # nothing fits
        return _row(p, False, 0.0, 0.0, str(error)[:80])
    nbytes = exposed = 0.0
    how = []
    for name, passes, kept_own in (("text_encoder", 1, p.encoder),
                                   ("transformer", p.passes[0], p.own),
                                   ("transformer_2", p.passes[1], p.own)):
        where = plans[name].where
        blocks = [where[part] for part in where if part != name]
        swapped = (0.0 if where[name] is Where.KEPT else kept_own) + p.block * sum(
            w is Where.SWAPPED for w in blocks)
        streamed = sum(w is Where.STREAMED for w in blocks)
        ring = p.block if streamed > 1 else 0.0
        nbytes += swapped + ring + passes * streamed * p.block
        exposed += _streaming_s(p, swapped, streamed, passes) if streamed else swapped / p.rate
        kept = sum(w is Where.KEPT for w in blocks)
        how.append(f"{name}: own {where[name].value}"
                   + (f", {kept} kept, {streamed} streamed" if blocks else ""))
    return _row(p, True, nbytes, exposed, "; ".join(how))


def table_rows(p: Pipeline) -> list[dict]:
    """Every mode at every budget of `BUDGETS_GB`, beside vLLM-Omni's measured seconds."""
    rows = []
    for budget in BUDGETS_GB:
        for mode in MODES:
            row = model(p, mode, budget * GB)
            rows.append({"budget_gb": budget, "mode": mode, **row,
                         "vllm_omni_s": VLLM_OMNI_S.get(mode) if budget == 80 else None})
    return rows


# -- the simulated run -------------------------------------------------------------------------

#: Bytes on the simulated device are the H100's divided by this.
BYTE_SCALE = 4000
#: Each queued op sleeps this long on the simulated device; a block is `BLOCK_OPS` ops.
OP_DELAY_S = 1e-4
BLOCK_OPS = 5
WIDTH = 64
#: Calls an auto plan takes to settle before its steady calls (as benchmarks/plans.py).
SETTLE = 3


class _Block(nn.Module):
    """One weight of `nbytes` and `ops` queued ops per forward (a matmul, then elementwise)."""

    def __init__(self, nbytes: float, ops: int = BLOCK_OPS) -> None:
        super().__init__()
        rows = max(1, round(nbytes / (4 * WIDTH)))
        self.weight = nn.Parameter(torch.randn(rows, WIDTH) * 0.02, requires_grad=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + (x @ self.weight[:WIDTH].T) * 0.01
        for _ in range(self.ops - 3):
            y = y * 0.999
        return y


class _Stack(nn.Module):
    """Blocks run in order, `repeats` times (a VAE decoding frame by frame)."""

    def __init__(self, own: float, block: float, blocks: int, ops: int = BLOCK_OPS,
                 repeats: int = 1) -> None:
        super().__init__()
        self.proj = _Block(own, ops=3)
        self.blocks = nn.ModuleList(_Block(block, ops) for _ in range(blocks))
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for _ in range(self.repeats):
            for block in self.blocks:
                x = block(x)
        return x


def _sim_parts(p: Pipeline) -> dict[str, nn.Module]:
    """The H100 pipeline at 1/`BYTE_SCALE` of its bytes, its compute in ratio: the encoder and
    the VAE get as many ops as their seconds are worth in expert blocks."""
    torch.manual_seed(0)
    per_op = p.block_s / BLOCK_OPS
    encoder_blocks = max(1, round(p.encoder_s / per_op / BLOCK_OPS))
    vae_blocks, vae_repeats = 2, max(1, round(p.vae_s / per_op / BLOCK_OPS / 2))
    return {"text_encoder": _Stack(p.encoder / BYTE_SCALE / 2,
                                   p.encoder / BYTE_SCALE / 2 / encoder_blocks, encoder_blocks),
            "transformer": _Stack(p.own / BYTE_SCALE, p.block / BYTE_SCALE, p.blocks),
            "transformer_2": _Stack(p.own / BYTE_SCALE, p.block / BYTE_SCALE, p.blocks),
            "vae": _Stack(p.vae / BYTE_SCALE / 2, p.vae / BYTE_SCALE / 2 / vae_blocks,
                          vae_blocks, repeats=vae_repeats)}


def _call(parts, scheduler, x: torch.Tensor, p: Pipeline, *, prefetch: bool) -> torch.Tensor:
    """One call of the schedule ([Note: the schedule]); `scheduler` None: nothing offloaded."""
    phase = (lambda name: scheduler.resident(name)) if scheduler is not None else _Nothing
    ahead = (lambda name: scheduler.prefetch(name)) if prefetch else (lambda name: False)
    with torch.no_grad(), (scheduler.call() if scheduler is not None else _Nothing(None)):
        with phase("text_encoder"):
            ahead("transformer")
            context = parts["text_encoder"](x)
        h = x + context
        for expert, passes in zip(("transformer", "transformer_2"), p.passes):
            for n in range(passes):
                with phase(expert):
                    if n == 0 and expert == "transformer":
                        ahead("transformer_2")
                    h = parts[expert](h)
        with phase("vae"):
            ahead("text_encoder")
            return parts["vae"](h).cpu()  # a pipeline hands back host pixels: the call waits


class _Nothing:
    def __init__(self, name) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _steady(device, parts, p: Pipeline, make, calls: int, prefetch: bool = False) -> dict:
    """Seconds and bytes of `calls` steady calls after the warm-up: one call, or `SETTLE` under
    an auto plan (its plans are made after the first and second calls)."""
    scheduler = make()
    x = torch.randn(4, WIDTH, device=device)
    try:
        auto = scheduler is not None and scheduler.plan is not None
        for _ in range(SETTLE if auto else 1):
            _call(parts, scheduler, x, p, prefetch=prefetch)
        seconds, nbytes = [], []
        for _ in range(calls):
            torch.accelerator.synchronize()
            start = time.perf_counter()
            _call(parts, scheduler, x, p, prefetch=prefetch)
            torch.accelerator.synchronize()
            seconds.append(time.perf_counter() - start)
            if scheduler is not None:
                nbytes.append(scheduler.calls[-1].nbytes)
        return {"seconds": seconds, "median_s": statistics.median(seconds),
                "nbytes": nbytes[-1] if nbytes else 0,
                "plan_predicted_s": scheduler.plan.predicted.seconds if auto else None,
                "plan": scheduler.plan.describe() if scheduler is not None and
                scheduler.plan is not None else None}
    finally:
        if scheduler is not None:
            scheduler.close()


def _phase_seconds(device, parts, x, name: str, repeat: int = 3) -> float:
    """The least of `repeat` timed forwards of `name`, everything on the device."""
    times = []
    with torch.no_grad():
        for _ in range(repeat):
            torch.accelerator.synchronize()
            start = time.perf_counter()
            parts[name](x)
            torch.accelerator.synchronize()
            times.append(time.perf_counter() - start)
    return min(times)


def simulate(p: Pipeline, *, calls: int = 3) -> dict:
    """The schedule through the library on the simulated device, bytes at 1/`BYTE_SCALE`, the
    copy rate set so that a block's copy keeps its ratio to the block's measured compute; the
    model fed the simulated device's own measured compute, checked against each run."""
    device = simulator.load(asynchronous=True)
    parts_host = _sim_parts(p)
    with simulator.timing(copy_bandwidth=1e9, compute_delay=OP_DELAY_S):
        plain = {name: module.to(device) for name, module in _sim_parts(p).items()}
        x = torch.randn(4, WIDTH, device=device)
        measured = {name: _phase_seconds(device, plain, x, name) for name in plain}
        none = _steady(device, plain, p, lambda: None, calls)
    # The simulated pipeline: the H100's, its bytes and seconds scaled (see `_sim_parts`).  A
    # forward's compute is what the call without offloading leaves after the encoder and the VAE
    # (timed alone, a forward also pays a host wait the call does not).
    forward_s = (none["median_s"] - measured["text_encoder"] - measured["vae"]) / sum(p.passes)
    time_scale = p.forward_s / forward_s
    sized = {name: sum(t.nbytes for t in m.state_dict().values()) for name, m in parts_host.items()}
    sim = attrs.evolve(
        p, encoder=sized["text_encoder"], own=parts_host["transformer"].proj.weight.nbytes,
        block=parts_host["transformer"].blocks[0].weight.nbytes, vae=sized["vae"],
        encoder_s=measured["text_encoder"], forward_s=forward_s, vae_s=measured["vae"],
        host_s=0.0, rate=p.rate / BYTE_SCALE * time_scale, headroom=p.headroom / BYTE_SCALE)
    rows = []
    with simulator.timing(copy_bandwidth=sim.rate, compute_delay=OP_DELAY_S):
        for budget_gb, mode, detect in [*((b, m, False) for b in BUDGETS_GB for m in MODES),
                                        *DETECTING]:
            budget = budget_gb * GB / BYTE_SCALE
            predicted = model(sim, mode, budget)
            if not predicted["fits"]:
                rows.append({"budget_gb": budget_gb, "mode": mode, "fits": False})
                continue
            run = none if mode == "none" else _run_mode(
                device, p, mode, (budget, sim.headroom), calls, predicted, detect_edits=detect)
            ratio = run["median_s"] / predicted["seconds"]
            rows.append({"budget_gb": budget_gb, "mode": mode, "detect_edits": detect,
                         "fits": True, "predicted_s": predicted["seconds"],
                         "predicted_nbytes": predicted["nbytes"], **run, "ratio": ratio,
                         "within_goal": abs(ratio - 1) <= GOAL,
                         "h100_equivalent_s": run["median_s"] * time_scale})
    return {"label": simulator.LABEL, "byte_scale": BYTE_SCALE, "time_scale": time_scale,
            "op_delay_s": OP_DELAY_S, "copy_bandwidth": sim.rate,
            "measured_phase_s": measured, "pipeline": attrs.asdict(sim), "rows": rows}


def _run_mode(device, p: Pipeline, mode: str, budget: tuple[float, float], calls: int,
              predicted: dict, *, detect_edits: bool) -> dict:
    """`calls` steady calls of `mode` through the library; `budget` is (device bytes, headroom)."""
    parts = {name: module.to("cpu") for name, module in _sim_parts(p).items()}
    total, headroom = budget

    def make() -> Scheduler:
        if mode == "auto":
            scheduler = Scheduler(device, auto={"device_budget": int(total),
                                                "headroom": int(headroom)})
        else:
            scheduler = Scheduler(device, device_memory_limit=int(total - headroom))
        scheduler.add("text_encoder", parts["text_encoder"], detect_edits=detect_edits)
        for name in ("transformer", "transformer_2"):
            layers = False
            if mode == "layer":
                kept = int(predicted["how"].split("=")[1])
                layers = model_blocks(parts[name], path="", resident_layers=kept)
            scheduler.add(name, parts[name], layers=layers, detect_edits=detect_edits)
        scheduler.add("vae", parts["vae"], policy="resident", detect_edits=detect_edits)
        return scheduler

    return _steady(device, parts, p, make, calls, prefetch=mode == "module + prefetch")


# -- output ------------------------------------------------------------------------------------


def _table(rows: list[dict], simulated: dict | None) -> str:
    sim = {(r["budget_gb"], r["mode"]): r for r in simulated["rows"]
           if not r.get("detect_edits")} if simulated else {}
    lines = ["| budget | mode | model s | moved GB/call | vLLM-Omni measured s | simulated / "
             "model | how |", "|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        key = (row["budget_gb"], row["mode"])
        seconds = f"{row['seconds']:.1f}" if row["fits"] else "does not fit"
        moved = f"{row['nbytes'] / GB:.1f}" if row["fits"] else ""
        theirs = f"{row['vllm_omni_s']:.1f}" if row.get("vllm_omni_s") else ""
        check = f"{sim[key]['ratio']:.3f}" if sim.get(key, {}).get("fits") else ""
        lines.append(f"| {row['budget_gb']} GB | {row['mode']} | {seconds} | {moved} | {theirs}"
                     f" | {check} | {row['how'] if row['fits'] else ''} |")
    for row in (simulated or {}).get("rows", []):
        if row.get("detect_edits") and row["fits"]:
            lines.append(f"| {row['budget_gb']} GB | {row['mode']}, edits detected (simulated "
                         f"only) | | | | {row['ratio']:.3f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan_h100",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true",
                        help="also run the schedule on the simulated device and check the model")
    parser.add_argument("--calls", type=int, default=3,
                        help="steady calls per simulated configuration (default 3)")
    parser.add_argument("--h2d-gbps", type=float, default=None,
                        help="host-to-device GB/s (default: a GPU check's, else the published)")
    parser.add_argument("--out", type=Path, default=RESULTS / "wan-h100.json")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    if args.h2d_gbps is not None and not args.h2d_gbps > 0:
        parser.error("--h2d-gbps must be positive")
    torch.set_num_threads(1)
    given = assumptions(args.h2d_gbps)
    p = pipeline(given)
    rows = table_rows(p)
    load_before = os.getloadavg()
    simulated = simulate(p, calls=args.calls) if args.sim else None
    result = {"label": LABEL, "assumptions": {k: attrs.asdict(a) for k, a in given.items()},
              "pipeline": attrs.asdict(p), "rows": rows, "simulated": simulated,
              "goal": f"simulated steady seconds within {GOAL:.0%} of the model's, per mode",
              "machine": describe_machine(),
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(LABEL)
    print(_table(rows, simulated))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
