"""Peers in the same run.

* Per-forward overhead with nothing to move, on a model of ~1,000 modules (runs on a CPU): ours (a
  phase around the forward, the group already resident) against accelerate's ``cpu_offload_with_hook``,
  given the execution device as a ``torch.device`` (its hook then skips the move) and as a string
  (the hook then calls ``module.to`` on every forward).  Floor: the same forward, never offloaded.
* A pipeline cycle (two groups, each loaded and run once, as one pipeline call does): ours against
  diffusers' ``enable_model_cpu_offload`` and group offloading, on an accelerator only.  Floor: the
  copy floor of both groups' bytes.

A peer that is not installed, or needs an accelerator that is not here, is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples, median_call_seconds, synchronize
from benchmarks.models import ManyModules, Stack
from benchmarks.peers import install, unavailable

FORWARD_OFFLOADERS = ("residency", "accelerate_hook_device", "accelerate_hook_str")


@pytest.mark.peer
@pytest.mark.parametrize("offloader", FORWARD_OFFLOADERS)
def test_per_forward_overhead(benchmark, scheduler, scale, device, offloader):
    model, plain = ManyModules(scale.model_modules), ManyModules(scale.model_modules).to(device)
    x = torch.ones(1, device=device)
    forward = _offloaded_forward(offloader, model, scheduler, device, x)
    forward()  # the first call places the weights; later ones have nothing to move

    def plain_forward():
        plain(x)

    rounds = scale.micro_rounds
    with torch.no_grad():
        iterations = _iterations_for(forward, ceiling=max(1, scale.reentry_iterations // 20))
        before = median_call_seconds(plain_forward, iterations, rounds)
        benchmark.pedantic(forward, rounds=rounds, iterations=iterations, warmup_rounds=1)
        after = median_call_seconds(plain_forward, iterations, rounds)
    synchronize(device)
    record(benchmark, case="per_forward", nbytes=0, floor_s=(before + after) / 2,
           offloader=offloader, model_nbytes=sum(p.nbytes for p in model.parameters()),
           modules=len(list(model.modules())), floor="the same forward, never offloaded")


def _iterations_for(function, *, ceiling: int, round_seconds: float = 0.01) -> int:
    """Calls per round so that a round lasts about `round_seconds` (at least 1, at most `ceiling`)."""
    start = time.perf_counter()
    function()
    once = time.perf_counter() - start
    return max(1, min(ceiling, int(round_seconds / max(once, 1e-9))))


def _offloaded_forward(offloader, model, scheduler, device, x):
    if offloader == "residency":
        scheduler.add("model", model)

        def forward():
            with scheduler.resident("model"):
                model(x)

        return forward
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (pip install -e '.[peers]')")
    from accelerate import cpu_offload_with_hook

    execution_device = device if offloader == "accelerate_hook_device" else str(device)
    cpu_offload_with_hook(model, execution_device=execution_device)
    return lambda: model(x)


@pytest.mark.peer
@pytest.mark.parametrize("offloader", ["residency", "diffusers_model_cpu_offload",
                                       "diffusers_group_offload"])
def test_pipeline_cycle(benchmark, scale, device, offloader):
    reason = unavailable(offloader, device)
    if reason is not None:
        pytest.skip(reason)
    components = {name: Stack(scale.swap_nbytes, scale.swap_tensors) for name in ("first", "second")}
    nbytes = sum(p.nbytes for module in components.values() for p in module.parameters())
    floor = FloorSamples(CopyFloor(nbytes // 2, device), copies=2)
    offload = install(offloader, components, device)
    x = torch.ones(1, device=device)

    def cycle():
        with torch.no_grad():
            for name, module in components.items():
                with offload.phase(name):
                    module(x)
        offload.finish()
        synchronize(device)

    cycle()
    try:
        benchmark.pedantic(cycle, setup=floor.before_round, rounds=scale.rounds(nbytes),
                           warmup_rounds=1)
    finally:
        offload.close()
    record(benchmark, case="pipeline_cycle", nbytes=nbytes, tensors=2 * scale.swap_tensors,
           floor_s=floor.median(), offloader=offloader)
