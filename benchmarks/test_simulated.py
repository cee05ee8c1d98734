"""Accelerator-shaped, SIMULATED (issue 19): the real code path on the simulated asynchronous
device.

    pytest benchmarks/ --bench-device=sim --benchmark-json=sim.json   # only these cases, simulated
    python -m benchmarks.report --run --device sim --out benchmarks/results/

Every case runs in a process that loaded ``tests/simdevice`` (``--bench-device=sim``; elsewhere
they are skipped, with the reason) in timing mode (`benchmarks.simulator.timing`): a copy takes
its bytes / a set bandwidth, every queued op a set compute delay, each on the stream it was queued
on, while the host runs ahead as it does on a GPU.  The bandwidth of each case is chosen from a
block's (or the encoder's) compute measured on the device in the same run, so that the copy
takes a stated fraction of the compute it should hide under.  The figures are a simulation's:
they say whether the library's streams and events let copies overlap compute and how often the
host waits, not what a GPU achieves.

* ``test_simulated_layer_step[mode-bound]``: a layer-mode denoising step (`benchmarks.layers`,
  every block streamed, ``layers=model_blocks(...)``) against max(total compute, total copy) of the
  same round: the unoffloaded step on an identical model, and a copy of every streamed block's
  bytes at the set bandwidth.  ``compute_bound``: a block's copy takes half its compute (the goal:
  <= 1.05x); ``copy_bound``: twice its compute (reported).  Bit identity with no offload, and the
  step's host synchronisations beyond the unoffloaded step's.
* ``test_simulated_transition[prefetch|no_prefetch]``: the encoder -> DiT transition of a
  Wan-shaped pipeline (`benchmarks.wan_shaped`, module mode, ``detect_edits=False``): encode, then
  one DiT call, against the same work unoffloaded; the DiT's copy takes half the encoder's compute,
  so ``scheduler.prefetch("transformer")`` issued as the encoder's phase begins can hide all of it.
* ``test_simulated_host_syncs[mode]``: host synchronisations per steady-state layer-mode step (no
  timing controls: counting needs asynchrony, not delays): none with ``detect_edits=False``, one
  per block eviction with it (the changed-chunk flags read, residency/device/digests.py).
"""

from __future__ import annotations

import statistics
import time

import attrs
import pytest
import torch

from benchmarks import layers, simulator, wan_shaped
from benchmarks.figures import record
from benchmarks.floor import CopyFloor, synchronize
from benchmarks.goals import (
    SIM_HOST_SYNCS_PER_EVICTION,
    SIM_HOST_SYNCS_STEADY,
    SIM_LAYER_STEP,
    SIM_PREFETCH,
)
from benchmarks.layers import DiTShape, StepFloor, install
from residency import Scheduler

pytestmark = pytest.mark.simulated

#: A block's copy against its compute, per case.
BOUNDS = {"compute_bound": 0.5, "copy_bound": 2.0}
#: The DiT's copy against the encoder's compute in the transition cases.
TRANSITION_COPY_OVER_COMPUTE = 0.5


@attrs.frozen(kw_only=True)
class SimSizes:
    """Models, the compute delay per op and the rounds, at one benchmark scale.

    The delay is what makes the device, not the host, the bottleneck: the host spends ~0.3-0.6 ms
    per op here (torch's meta kernels compute each output's shape in Python), so ops must take
    several times that on the device for the host to run ahead as it does on a GPU.
    """

    dit: DiTShape
    pipeline: wan_shaped.WanShaped
    compute_delay: float
    rounds: int

    @classmethod
    def named(cls, scale: str) -> SimSizes:
        if scale == "tiny":
            return cls(dit=DiTShape.tiny(blocks=2), pipeline=wan_shaped.WanShaped.tiny(),
                       compute_delay=2e-4, rounds=1)
        return cls(dit=DiTShape.tiny(blocks=4), pipeline=wan_shaped.WanShaped.tiny(),
                   compute_delay=3e-3, rounds=7)


@pytest.fixture(scope="module")
def sizes(scale) -> SimSizes:
    return SimSizes.named(scale.name)


def _seconds(work, device: torch.device, repeats: int = 3) -> float:
    """Median wall time of `work` with the device waited for (after one warm-up call)."""
    work()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _block_compute_s(shape: DiTShape, state: dict, device: torch.device) -> float:
    """One Wan block's forward on the device, under the current timing controls."""
    block = layers.WanBlock(shape.dim, shape.ffn_dim, shape.heads).to(shape.dtype)
    prefix = "blocks.0."
    block.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    block.requires_grad_(False).to(device)
    block_args = tuple(torch.randn(1, n, shape.dim, dtype=shape.dtype).to(device)
                       for n in (shape.tokens, shape.text_tokens, 6))
    with torch.no_grad():
        return _seconds(lambda: block(*block_args), device)


def _extra_syncs(run, plain, args) -> int:
    """Host synchronisations of one step of `run` beyond one unoffloaded step (the harness's own
    wait at the end of each step counts in both)."""
    before = simulator.host_syncs()
    plain.step(*args)
    harness = simulator.host_syncs() - before
    before = simulator.host_syncs()
    run.step(*args)
    return simulator.host_syncs() - before - harness


def _controls(copy_bandwidth: float, compute_delay: float) -> dict:
    return {"copy_bandwidth_bps": copy_bandwidth, "compute_delay_s": compute_delay,
            "label": simulator.LABEL}


@pytest.mark.parametrize("bound", list(BOUNDS))
@pytest.mark.parametrize("mode", ["layers_no_detection", "layers"])
def test_simulated_layer_step(benchmark, device, sizes, mode, bound):
    shape = sizes.dit
    state = layers.make_state(shape, device)
    args = layers.inputs(shape, device)
    with simulator.timing(copy_bandwidth=0.0, compute_delay=sizes.compute_delay):
        block_s = _block_compute_s(shape, state, device)
    bandwidth = shape.block_nbytes() / (BOUNDS[bound] * block_s)
    with simulator.timing(copy_bandwidth=bandwidth, compute_delay=sizes.compute_delay):
        plain = install("none", layers.build(shape, state), device)
        run = install(mode, layers.build(shape, state), device)
        try:
            reference = plain.step(*args).to("cpu")
            run.step(*args)  # warm-up: the slots allocated, block 0 prefetched for the next step
            output = run.step(*args).to("cpu")
            extra_syncs = _extra_syncs(run, plain, args)
            floor = StepFloor(lambda: plain.step(*args), run.block_nbytes, device)
            benchmark.pedantic(lambda: run.step(*args), setup=floor.before_round,
                               rounds=sizes.rounds, warmup_rounds=1)
            bound_s = [max(n, c) for n, c in zip(floor.none_samples, floor.copy_samples)]
            record(benchmark, case="sim_layer_step", nbytes=sum(run.block_nbytes),
                   floor_s=statistics.median(bound_s),
                   goal=SIM_LAYER_STEP if bound == "compute_bound" else None,
                   mode=mode, bound=bound, copy_over_compute=BOUNDS[bound],
                   blocks=len(run.block_nbytes), block_nbytes=shape.block_nbytes(),
                   block_compute_s=block_s, compute_s=floor.none_s(), copy_s=floor.copy_s(),
                   bit_identical=bool(torch.equal(output, reference)),
                   host_syncs_per_step=extra_syncs, **_controls(bandwidth, sizes.compute_delay))
        finally:
            run.close()
    assert torch.equal(output, reference), "a streamed step differs from the unoffloaded one"


@pytest.mark.parametrize("prefetch", ["no_prefetch", "prefetch"])
def test_simulated_transition(benchmark, device, sizes, prefetch):
    config = sizes.pipeline
    state = wan_shaped.make_state(config, device)
    ids, latents = wan_shaped.inputs(config, device)
    plain = {name: part.to(device) for name, part in wan_shaped.build(config, state).items()
             if name in ("text_encoder", "transformer")}
    offloaded = wan_shaped.build(config, state)
    encoder, dit = offloaded["text_encoder"], offloaded["transformer"]
    dit_nbytes = wan_shaped.nbytes(dit)

    def unoffloaded():
        with torch.no_grad():
            return plain["transformer"](latents, plain["text_encoder"](ids))

    with simulator.timing(copy_bandwidth=0.0, compute_delay=sizes.compute_delay):
        encoder_s = _seconds(lambda: plain["text_encoder"](ids), device)
    bandwidth = dit_nbytes / (TRANSITION_COPY_OVER_COMPUTE * encoder_s)
    scheduler = Scheduler(device)
    with simulator.timing(copy_bandwidth=bandwidth, compute_delay=sizes.compute_delay):
        try:
            scheduler.add("text_encoder", encoder, detect_edits=False)
            scheduler.add("transformer", dit, detect_edits=False)
            prefetched = []

            def encoder_resident():  # the round starts in the encoder's phase, the DiT offloaded
                with scheduler.resident("text_encoder"):
                    pass
                synchronize(device)

            def encode_then_denoise():
                with torch.no_grad():
                    with scheduler.resident("text_encoder"):
                        if prefetch == "prefetch":
                            prefetched.append(scheduler.prefetch("transformer"))
                        context = encoder(ids)
                    with scheduler.resident("transformer"):
                        out = dit(latents, context)
                synchronize(device)
                return out

            encoder_resident()
            output = encode_then_denoise().to("cpu")
            reference = unoffloaded().to("cpu")
            before = simulator.host_syncs()
            encode_then_denoise()
            syncs = simulator.host_syncs() - before - 1  # the cycle's own final wait
            encoder_resident()
            floor_samples: list[float] = []

            def setup():
                floor_samples.append(_seconds(unoffloaded, device, repeats=1))
                encoder_resident()

            benchmark.pedantic(encode_then_denoise, setup=setup, rounds=sizes.rounds,
                               warmup_rounds=1)
            copy_s = statistics.median(CopyFloor(dit_nbytes, device).seconds() for _ in range(3))
            floor_s = statistics.median(floor_samples)
            record(benchmark, case="sim_transition", nbytes=dit_nbytes, floor_s=floor_s,
                   goal=SIM_PREFETCH if prefetch == "prefetch" else None, prefetch=prefetch,
                   prefetch_started=all(prefetched) if prefetched else None,
                   encoder_compute_s=encoder_s, dit_copy_s=copy_s,
                   copy_over_compute=TRANSITION_COPY_OVER_COMPUTE,
                   bit_identical=bool(torch.equal(output, reference)),
                   host_syncs_per_cycle=syncs, **_controls(bandwidth, sizes.compute_delay))
        finally:
            scheduler.close()
    assert torch.equal(output, reference), "the offloaded pipeline differs from the unoffloaded one"
    assert prefetch != "prefetch" or all(prefetched), "a prefetch did not start"


@pytest.mark.parametrize("mode", ["layers_no_detection", "layers"])
def test_simulated_host_syncs(benchmark, device, sizes, mode):
    shape = sizes.dit
    state = layers.make_state(shape, device)
    args = layers.inputs(shape, device)
    with simulator.controls(asynchronous=True, copy_bandwidth=0.0, compute_delay=0.0):
        plain = install("none", layers.build(shape, state), device)
        run = install(mode, layers.build(shape, state), device)
        try:
            for _ in range(2):  # warm-up: slots allocated, the ring primed
                run.step(*args)
            steps = max(2, sizes.rounds)
            counts, evictions = [], []
            for _ in range(steps):
                start = time.perf_counter()
                counts.append(_extra_syncs(run, plain, args))
                evictions.append(sum(1 for r in run.scheduler.block_records
                                     if r.kind == "evict" and r.time >= start))
            benchmark.pedantic(lambda: run.step(*args), rounds=sizes.rounds, warmup_rounds=0)
            per_step = statistics.median(counts)
            per_eviction = sum(counts) / sum(evictions) if sum(evictions) else None
            record(benchmark, case="sim_host_syncs", nbytes=sum(run.block_nbytes), floor_s=None,
                   goal=SIM_HOST_SYNCS_STEADY if mode == "layers_no_detection"
                   else SIM_HOST_SYNCS_PER_EVICTION, mode=mode, blocks=len(run.block_nbytes),
                   host_syncs_per_step=per_step, host_syncs_by_step=counts,
                   evictions_per_step=statistics.median(evictions),
                   host_syncs_per_eviction=per_eviction, label=simulator.LABEL)
        finally:
            run.close()
