"""The diffusers adapter's per-call overhead on a tiny SDXL with nothing to move.

One UNet call, the UNet already on the device: ours (`enable_offload`, the UNet group resident, so
its `PhaseEntry` re-enters the phase) against diffusers' ``enable_model_cpu_offload`` (its hook on
the UNet, after the first call put the UNet on the device).  Floor: the same call on the same
pipeline never offloaded.  diffusers' model offload runs on the CPU when given ``device="cpu"``,
so both run here; on an accelerator the same cases run on it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from benchmarks.figures import record
from benchmarks.floor import median_call_seconds, synchronize

OFFLOADERS = ("residency", "diffusers_model_cpu_offload")


def _tiny_sdxl():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from _tiny_pipelines import tiny_sdxl

    return tiny_sdxl()


def _unet_inputs(pipe, device: torch.device) -> tuple[tuple, dict]:
    sample = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    context = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(device)
    added = {"text_embeds": torch.zeros(2, 16, device=device),
             "time_ids": torch.zeros(2, 6, device=device)}
    return (sample, torch.tensor(10, device=device)), {
        "encoder_hidden_states": context, "added_cond_kwargs": added, "return_dict": False}


def _offload(offloader: str, pipe, device: torch.device) -> None:
    if offloader == "residency":
        from residency.adapters.diffusers import enable_offload

        enable_offload(pipe, device=device)
    else:
        pipe.enable_model_cpu_offload(device=device)


@pytest.mark.peer
@pytest.mark.parametrize("offloader", OFFLOADERS)
def test_sdxl_unet_call_overhead_with_nothing_to_move(benchmark, scale, device, offloader):
    if offloader != "residency" and importlib_missing("accelerate"):
        pytest.skip("accelerate is not installed (diffusers' model offload needs it)")
    plain, pipe = _tiny_sdxl().to(device), _tiny_sdxl()
    _offload(offloader, pipe, device)
    args, kwargs = _unet_inputs(pipe, device)

    def call():
        pipe.unet(*args, **kwargs)

    def plain_call():
        plain.unet(*args, **kwargs)

    with torch.no_grad():
        call()  # the first call puts the UNet on the device; later ones move nothing
        rounds = scale.micro_rounds
        before = median_call_seconds(plain_call, 20, rounds)
        benchmark.pedantic(call, rounds=rounds, iterations=20, warmup_rounds=1)
        after = median_call_seconds(plain_call, 20, rounds)
    synchronize(device)
    record(benchmark, case="diffusers_unet_call", nbytes=0, floor_s=(before + after) / 2,
           offloader=offloader, floor="the same UNet call, never offloaded")


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None
