"""What users do daily to offloaded pipelines, end to end (issue 12, point 4).

Each flow runs twice on tiny real diffusers pipelines built from configs: once with offloading
enabled throughout, once on the same pipeline never offloaded; every call's output must be
bit-identical to the same call of the plain run (a pipeline carries state between calls, so call n
is compared with call n).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from residency.adapters.diffusers import disable_offload, enable_offload  # noqa: E402

from _tiny_pipelines import lora_flow, tiny_flux, tiny_sdxl, unet_call  # noqa: E402


def test_the_diffusers_lora_flow_with_offloading_is_bit_identical():
    plain = lora_flow(tiny_flux())
    pipe = tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    offloaded = lora_flow(pipe)
    for index, (ours, theirs) in enumerate(zip(offloaded, plain)):
        assert torch.equal(ours, theirs), f"call {index} differs from the pipeline never offloaded"
    base, with_lora, fused, unfused, mixed, unloaded = plain
    assert not torch.equal(fused, base), "the LoRA must change the output"
    assert torch.allclose(fused, with_lora, atol=1e-4)  # fusing keeps the function
    assert torch.allclose(unloaded, base, atol=1e-5)  # unfuse subtracts what fuse added (rounding)
    assert sum(r.written_back for r in scheduler.transitions) > 0, "the fuse reached the host"
    disable_offload(pipe)


def upcasting_sdxl():
    """SDXL with an fp16 VAE: each call casts the VAE to float32 to decode and back (force_upcast)."""
    pipe = tiny_sdxl()
    pipe.vae.to(torch.float16)
    assert pipe.vae.config.force_upcast
    return pipe


def test_the_fp16_vae_upcast_with_the_vae_selected_runs_bit_identical():
    plain_pipe = upcasting_sdxl()
    plain = [plain_pipe(**unet_call(seed=s)).images for s in (0, 1)]
    pipe = upcasting_sdxl()
    config = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}
    scheduler = enable_offload(pipe, config, device="cpu")
    offloaded = [pipe(**unet_call(seed=s)).images for s in (0, 1)]
    for ours, theirs in zip(offloaded, plain):
        assert torch.equal(ours, theirs)
    assert pipe.vae.dtype == torch.float16
    with scheduler.resident("unet"):  # the VAE left the device in the dtype the pipeline left it
        assert all(t.dtype == torch.float16 for t in scheduler["vae"].tensors
                   if t.is_floating_point())
    disable_offload(pipe)
