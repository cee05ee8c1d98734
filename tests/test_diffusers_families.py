"""The diffusers adapter across pipeline families, each built tiny from configs in code.

SDXL (UNet, two text encoders), Stable Diffusion with a ControlNet, with an IP-Adapter, AnimateDiff
(video, a motion adapter) and Kandinsky 2.2 (a cascade: prior, then decoder).  Every output is
compared with the same pipeline never offloaded, call by call (a diffusers pipeline carries state
between calls).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from _tiny_pipelines import (
    kandinsky22_call,
    tiny_animatediff,
    tiny_kandinsky22,
    tiny_sd_controlnet,
    tiny_sd_ip_adapter,
    tiny_sdxl,
    unet_call,
)
from residency.adapters.diffusers import describe, disable_offload, enable_offload

from residency import ModuleChangedError

CONTROL = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(7))
FACE = torch.rand(1, 3, 14, 14, generator=torch.Generator().manual_seed(8))

#: builder, call arguments, the exclusive groups (with their members), the resident groups.
FAMILIES = {
    "sdxl": (tiny_sdxl, lambda s: unet_call(s),
             {"text_encoder": ["text_encoder", "text_encoder_2"], "unet": ["unet"]}, ["vae"]),
    "controlnet": (tiny_sd_controlnet, lambda s: unet_call(s, image=CONTROL),
                   {"text_encoder": ["text_encoder"], "unet": ["unet", "controlnet"]}, ["vae"]),
    "ip_adapter": (tiny_sd_ip_adapter, lambda s: unet_call(s, ip_adapter_image=FACE),
                   {"text_encoder": ["text_encoder", "image_encoder"], "unet": ["unet"]}, ["vae"]),
    "animatediff": (tiny_animatediff, lambda s: unet_call(s, num_frames=2),
                    {"text_encoder": ["text_encoder"], "unet": ["unet", "motion_adapter"]},
                    ["vae"]),
    "kandinsky22": (tiny_kandinsky22, kandinsky22_call,
                    {"text_encoder": ["prior_image_encoder", "prior_text_encoder"],
                     "prior_prior": ["prior_prior"], "unet": ["unet"]}, ["vae"]),
}


def output(pipe, arguments: dict) -> torch.Tensor:
    result = pipe(**arguments)
    return result.frames if hasattr(result, "frames") else result.images


def members(pipe, scheduler, group: str) -> list[str]:
    names = {id(module): name for name, module in pipe.components.items()}
    return [names[id(module)] for module in scheduler[group].modules]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_bit_identical_call_by_call(family):
    build, call, exclusive, resident = FAMILIES[family]
    plain, pipe = build(), build()
    scheduler = enable_offload(pipe, device="cpu")
    for seed in (0, 1):
        assert torch.equal(output(pipe, call(seed)), output(plain, call(seed))), seed
    assert {g: members(pipe, scheduler, g) for g in scheduler if scheduler[g].exclusive} == (
        exclusive)
    assert [g for g in scheduler if not scheduler[g].exclusive] == resident
    loads = {r.to_group for r in scheduler.transitions if r.to_group in exclusive}
    assert loads == set(exclusive), "every exclusive group took its turn"
    disable_offload(pipe)
    assert torch.equal(output(pipe, call(2)), output(plain, call(2)))


@pytest.mark.fast
def test_kandinsky_cascade_stages_take_turns_in_order():
    pipe = tiny_kandinsky22()
    scheduler = enable_offload(pipe, device="cpu")
    output(pipe, kandinsky22_call(0))
    output(pipe, kandinsky22_call(1))
    changes = [(r.from_group, r.to_group) for r in scheduler.transitions
               if scheduler[r.to_group].exclusive]
    one_call = [("text_encoder", "prior_prior"), ("prior_prior", "text_encoder"),
                ("text_encoder", "unet")]
    assert changes[1:4] == one_call and changes[5:] == one_call
    assert changes[4] == ("unet", "text_encoder")


@pytest.mark.fast
def test_sdxl_default_config_moves_the_unet_and_both_text_encoders():
    pipe = tiny_sdxl()
    scheduler = enable_offload(pipe, device="cpu")  # no config
    seen = []

    def where(group: str) -> tuple[bool, bool]:
        residency = scheduler[group]
        tensors, homes = residency.inventory.tensors, residency.host_master.views
        buffer = residency.device_storage.buffer if residency.device_storage else None
        start = None if buffer is None else buffer.data_ptr()
        on_host = all(t.data_ptr() == h.data_ptr() for t, h in zip(tensors, homes))
        on_device = start is not None and all(
            start <= t.data_ptr() < start + buffer.numel() for t in tensors)
        return on_host, on_device

    def probe(phase: str):
        def hook(module, args):
            seen.append((phase, where("unet"), where("text_encoder")))
        return hook

    handles = [pipe.unet.conv_in.register_forward_pre_hook(probe("unet")),
               pipe.text_encoder_2.text_model.register_forward_pre_hook(probe("text_encoder"))]
    output(pipe, unet_call(0))
    for handle in handles:
        handle.remove()
    assert {phase for phase, _, _ in seen} == {"unet", "text_encoder"}
    for phase, unet, encoders in seen:
        if phase == "unet":
            assert unet == (False, True) and encoders == (True, False)
        else:
            assert unet == (True, False) and encoders == (False, True)
    assert [len(scheduler["text_encoder"].modules), scheduler["unet"].exclusive] == [2, True]
    disable_offload(pipe)


@pytest.mark.fast
def test_describe_says_how_each_component_is_classified():
    assert describe(tiny_sd_controlnet()).splitlines() == [
        "StableDiffusionControlNetPipeline, components ['dit', 'text_encoder']:",
        "component     kind       group         policy     why",
        "vae           vae        vae           resident   named like a VAE",
        "text_encoder  encoder    text_encoder  exclusive  named like an encoder",
        "unet          dit        unet          exclusive  named like a denoiser",
        "controlnet    companion  unet          exclusive  named like a step companion",
    ]


# -- components replaced or added after enabling --------------------------------------------------


def test_a_replaced_controlnet_is_refused_at_the_next_phase_change_changing_nothing():
    plain, pipe = tiny_sd_controlnet(), tiny_sd_controlnet()
    scheduler = enable_offload(pipe, device="cpu")
    output(pipe, unet_call(0, image=CONTROL))
    current, count = scheduler.current, scheduler.transitions.count
    pipe.controlnet = tiny_sd_controlnet(seed=1).controlnet  # attribute assignment
    with pytest.raises(ModuleChangedError, match=r"StableDiffusionControlNetPipeline: component "
                       r"'controlnet' was replaced after enable_offload \(it is now a "
                       r"ControlNetModel\), so its weights are not offloaded.*"
                       r"disable_offload\(pipe\), then register_modules"):
        output(pipe, unet_call(1, image=CONTROL))
    assert (scheduler.current, scheduler.transitions.count) == (current, count)
    disable_offload(pipe)
    enable_offload(pipe, device="cpu")  # now the new controlnet is offloaded too
    plain.controlnet = tiny_sd_controlnet(seed=1).controlnet
    output(plain, unet_call(0, image=CONTROL))
    assert torch.equal(output(pipe, unet_call(1, image=CONTROL)),
                       output(plain, unet_call(1, image=CONTROL)))
    disable_offload(pipe)


@pytest.mark.fast
def test_a_component_registered_after_enabling_is_refused():
    pipe = tiny_sd_ip_adapter(load=False)
    encoder = pipe.image_encoder
    pipe.register_modules(image_encoder=None)
    enable_offload(pipe, device="cpu")
    pipe.register_modules(image_encoder=encoder)
    with pytest.raises(ModuleChangedError, match="component 'image_encoder' was added after "):
        output(pipe, unet_call(0))
    disable_offload(pipe)


def test_a_replaced_unet_is_refused_also_when_it_is_the_only_exclusive_group():
    pipe = tiny_sdxl()
    enable_offload(pipe, {"mode": "module", "components": ["dit"]}, device="cpu")
    pipe.register_modules(unet=tiny_sdxl(seed=1).unet)
    with pytest.raises(ModuleChangedError, match="component 'unet' was replaced"):
        output(pipe, unet_call(0))  # found by the text encoders' (resident policy) entries
    disable_offload(pipe)
