"""Layer mode (issue 14): per-block overhead over the copy floor, whole steps against no offload and
module mode, and the side-by-side with diffusers' group offloading.  Models: `benchmarks.layers`.

* ``test_layer_block_overhead[size-detection]``: one step of a Wan-shaped DiT whose blocks all
  stream; the floor of each round is the same step on an unoffloaded twin plus a copy of every
  block's bytes (`StepFloor`), so ``per_tensor_overhead_s`` = (layer step - unoffloaded step -
  copies) / streamed tensors, the median over rounds of that difference taken within each round
  (the judged time ``measured_s`` is the floor plus it; the unpaired median is
  ``median_unpaired_s``).
  ``shrunk``: hidden 256, 8 blocks of 2.6 MiB, 4 tokens; ``shrunk_hollow``: the same blocks with a
  forward that reads no weight (the machinery alone, with no compute whose cache behaviour the copy
  changes: a block just copied into its slot is warm in the cache, the unoffloaded one is not);
  ``wan1.3b``: Wan2.1-1.3B's blocks, 3 of 88.5 MiB.  ``no_detection`` (``detect_edits=False``)
  carries the goal for the shrunk sizes (CPU); ``detection`` adds the digests of each block at load
  and at eviction, a cost that follows the bytes (the report gives it per block against the copy).
* ``test_layer_step[mode]``: whole steps of a 6-block DiT (hidden 512, 256 tokens) under each mode,
  the floor being the unoffloaded step in the same round (``ratio``: the median of the per-round
  ratios); ``floor_ratio`` is the floor of a streamed step on a CPU, (step + copy of the block
  bytes) / step.
* ``test_layers_vs_group_offload[mode]``: a real diffusers ``WanTransformer3DModel`` (4 blocks,
  hidden 256), identical copies under no offload, ours (layers, module) and diffusers'
  ``apply_group_offloading`` (block level, one block per group, a stream on an accelerator).

At ``--bench-scale=tiny`` every model is a few kilobytes (the code paths only).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from benchmarks import layers
from benchmarks.figures import record
from benchmarks.goals import LAYER_BLOCK
from benchmarks.layers import DiTShape, StepFloor, install
from benchmarks.peers import unavailable

SIZES = ("shrunk", "shrunk_hollow", "wan1.3b")
DETECTION = ("no_detection", "detection")
STEP_MODES = ("none", "layers", "layers_no_detection", "module", "module_swapped")
PEER_MODES = ("none", "layers", "layers_no_detection", "module", "diffusers_group_offload")


@attrs.frozen(kw_only=True)
class LayerSizes:
    """The models of the layer cases at one benchmark scale, and their rounds."""

    overhead: dict = attrs.field(converter=dict)
    overhead_rounds: dict = attrs.field(converter=dict)
    stepping: DiTShape
    step_rounds: int
    peer: DiTShape
    peer_rounds: int

    @classmethod
    def named(cls, scale: str) -> LayerSizes:
        if scale == "tiny":
            tiny = DiTShape.tiny()
            return cls(overhead={"shrunk": tiny, "shrunk_hollow": tiny.hollowed(), "wan1.3b": tiny},
                       overhead_rounds={"shrunk": 3, "shrunk_hollow": 3, "wan1.3b": 2},
                       stepping=tiny, step_rounds=2, peer=tiny, peer_rounds=2)
        shrunk = DiTShape.shrunk()
        return cls(overhead={"shrunk": shrunk, "shrunk_hollow": shrunk.hollowed(),
                             "wan1.3b": DiTShape.wan_1_3b()},
                   overhead_rounds={"shrunk": 150, "shrunk_hollow": 300, "wan1.3b": 15},
                   stepping=DiTShape.stepping(), step_rounds=20,
                   peer=DiTShape.shrunk(blocks=4, tokens=64), peer_rounds=30)


@pytest.fixture(scope="module")
def sizes(scale) -> LayerSizes:
    return LayerSizes.named(scale.name)


@pytest.fixture(scope="module")
def commit() -> str | None:
    return layers.source_commit()


@pytest.mark.parametrize("detection", DETECTION)
@pytest.mark.parametrize("size", SIZES)
def test_layer_block_overhead(benchmark, sizes, device, commit, size, detection):
    """A step in layer mode, every block streamed, against (unoffloaded step + block copies)."""
    shape = sizes.overhead[size]
    state = layers.make_state(shape, device)
    args = layers.inputs(shape, device)
    plain = install("none", layers.build(shape, state), device)
    mode = "layers" if detection == "detection" else "layers_no_detection"
    run = install(mode, layers.build(shape, state), device)
    try:
        expected = plain.step(*args)
        assert torch.equal(run.step(*args), expected), "layer mode changed the output"
        floor = StepFloor(lambda: plain.step(*args), run.block_nbytes, device)
        copies_before = run.scheduler.block_records.copies
        rounds = sizes.overhead_rounds[size]
        benchmark.pedantic(lambda: run.step(*args), setup=floor.before_round, rounds=rounds,
                           warmup_rounds=1)
        copies = run.scheduler.block_records.copies - copies_before
        calls = 1 if benchmark.disabled else rounds + 1
        assert copies == calls * shape.blocks, "a measured step did not stream every block"
        tensors = sum(run.block_tensors)
        goal = LAYER_BLOCK if detection == "no_detection" and size.startswith("shrunk") \
            and device.type == "cpu" else None
        floor_s, rounds_s = floor.floor_s(), _round_seconds(benchmark)
        paired = {} if rounds_s is None else {
            "measured_s": floor_s + floor.paired_overhead_s(rounds_s),
            "median_unpaired_s": benchmark.stats.stats.median}
        record(benchmark, case="layer_block_overhead", nbytes=floor.nbytes, tensors=tensors,
               floor_s=floor_s, goal=goal, size=size, detect_edits=detection == "detection",
               hollow=shape.hollow, **paired,
               blocks=shape.blocks, tensors_per_block=run.block_tensors[0],
               block_nbytes=run.block_nbytes[0], none_s=floor.none_s(), copy_s=floor.copy_s(),
               device_nbytes=run.device_nbytes, dim=shape.dim, tokens=shape.tokens,
               dtype=str(shape.dtype).removeprefix("torch."),
               commit=commit, floor="unoffloaded step + copy of every streamed block's bytes")
    finally:
        run.close()


@pytest.mark.parametrize("mode", STEP_MODES)
def test_layer_step(benchmark, sizes, device, commit, mode):
    """One denoising step under `mode`; the floor is the unoffloaded step, timed in each round."""
    shape = sizes.stepping
    state = layers.make_state(shape, device)
    args = layers.inputs(shape, device)
    plain = install("none", layers.build(shape, state), device)
    run = install(mode, layers.build(shape, state), device)
    try:
        expected = plain.step(*args)
        bit_identical = bool(torch.equal(run.step(*args), expected))
        moved = layers.bytes_moved_per_step(run, run.model.blocks[0].attn1.to_q, *args)
        block_nbytes = [shape.block_nbytes()] * shape.blocks
        floor = StepFloor(lambda: plain.step(*args), block_nbytes, device)
        benchmark.pedantic(lambda: run.step(*args), setup=floor.before_round,
                           rounds=sizes.step_rounds, warmup_rounds=1)
        none_s, copy_s = floor.none_s(), floor.copy_s()
        record(benchmark, case="layer_step", nbytes=floor.nbytes, floor_s=none_s, mode=mode,
               **_paired_ratio(benchmark, floor, none_s),
               offloader=mode, copy_s=copy_s, floor_ratio=floor.floor_s() / none_s,
               bit_identical=bit_identical, moved_per_step_nbytes=moved,
               device_nbytes=run.device_nbytes, model_nbytes=plain.device_nbytes,
               blocks=shape.blocks, dim=shape.dim, tokens=shape.tokens, commit=commit,
               floor="the unoffloaded step")
    finally:
        run.close()
    assert bit_identical, f"{mode} changed the output"


@pytest.mark.peer
@pytest.mark.parametrize("mode", PEER_MODES)
def test_layers_vs_group_offload(benchmark, sizes, device, commit, mode):
    """A real diffusers WanTransformer3DModel under `mode`, beside an unoffloaded twin."""
    peer = "diffusers_group_offload"
    reason = unavailable(peer, device, allow_cpu=True)
    if reason is not None:
        pytest.skip(reason)
    shape = sizes.peer
    plain_model, kwargs = layers.diffusers_wan(shape)
    model, _ = layers.diffusers_wan(shape)
    model.load_state_dict(plain_model.state_dict())
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    plain = install("none", plain_model, device)
    run = install(mode, model, device)
    try:
        expected = plain.step(**kwargs)
        bit_identical = bool(torch.equal(run.step(**kwargs), expected))
        moved = layers.bytes_moved_per_step(run, model.blocks[0].attn1.to_q, **kwargs)
        block_nbytes = [sum(t.nbytes for t in block.state_dict().values())
                        for block in model.blocks]
        floor = StepFloor(lambda: plain.step(**kwargs), block_nbytes, device)
        benchmark.pedantic(lambda: run.step(**kwargs), setup=floor.before_round,
                           rounds=sizes.peer_rounds, warmup_rounds=1)
        none_s = floor.none_s()
        note = None
        if mode == "diffusers_group_offload" and moved == 0:
            note = ("moves no bytes: onload and offload device are both the CPU, and tensor.to() "
                    "to the device a tensor is on returns it unchanged; the time is hooks alone")
        record(benchmark, case="layers_vs_group_offload", nbytes=floor.nbytes, floor_s=none_s,
               mode=mode, **_paired_ratio(benchmark, floor, none_s), offloader=mode,
               copy_s=floor.copy_s(), floor_ratio=floor.floor_s() / none_s,
               bit_identical=bit_identical, moved_per_step_nbytes=moved, note=note,
               device_nbytes=run.device_nbytes, blocks=shape.blocks, dim=shape.dim,
               model=type(model).__name__, commit=commit, floor="the unoffloaded step")
    finally:
        run.close()
    assert bit_identical, f"{mode} changed the output"


def _round_seconds(benchmark) -> list[float] | None:
    """The measured rounds' seconds (None with --benchmark-disable)."""
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else list(stats.stats.data)


def _paired_ratio(benchmark, floor: StepFloor, none_s: float) -> dict:
    """``measured_s`` such that the derived ratio is the median of the per-round ratios."""
    rounds_s = _round_seconds(benchmark)
    if rounds_s is None:
        return {}
    return {"measured_s": none_s * floor.paired_ratio(rounds_s),
            "median_unpaired_s": benchmark.stats.stats.median}
