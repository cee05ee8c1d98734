"""Every tensor sits where a plain run would have it (issue 10): the mechanism behind bit identity.

Matrix kernels pick their code path by operand address (see [Note: alignment decides the bits] in
residency/modules/tensors.py), so an offloaded run is only bit-identical to a plain one when each weight is
where the plain run has it: on a CPU device at the ``data_ptr() % 64`` the user loaded it with, on an
accelerator at a 512-byte boundary like a fresh ``.to(device)``.  These tests check the addresses
directly, so they fail on any machine, not only where MKL happens to pick another kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from residency import Scheduler
from residency.modules.tensors import (
    ACCELERATOR_ALIGNMENT,
    CPU_ALIGNMENT,
    Alignment,
    alignment_for,
    take_inventory,
)

from conftest import twin


def misaligned_linear(offset_bytes: int, width: int = 24) -> nn.Linear:
    """A Linear whose weight and bias sit `offset_bytes` past a 64-byte boundary (as safetensors
    leaves weights: 8-byte aligned) - each in a storage of its own, like a loaded checkpoint."""
    torch.manual_seed(offset_bytes)
    linear = nn.Linear(width, width)
    for name in ("weight", "bias"):
        values = getattr(linear, name).detach()
        padding = offset_bytes // values.element_size()
        backing = torch.empty(padding + values.numel(), dtype=values.dtype)
        view = backing[padding:].view_as(values)
        view.copy_(values)
        setattr(linear, name, nn.Parameter(view))
    return linear


def residues(module: nn.Module, boundary: int = 64) -> dict[str, int]:
    return {name: t.data_ptr() % boundary for name, t in module.state_dict(keep_vars=True).items()}


@pytest.mark.fast
@pytest.mark.parametrize("offset", [8, 24, 40, 56])
def test_on_a_cpu_device_each_tensor_keeps_its_address_modulo_64(offset: int):
    model = nn.Sequential(misaligned_linear(offset), nn.GELU(), misaligned_linear(offset + 16))
    loaded = residues(model)
    assert any(r != 0 for r in loaded.values()), "the test needs weights off the 64-byte grid"
    other = nn.Linear(24, 24)  # a second group, so phases really swap
    scheduler = Scheduler("cpu")
    scheduler.add("model", model)
    scheduler.add("other", other)
    for name in ["model", "other", "model"]:
        with scheduler.resident(name):
            assert residues(model) == loaded
            assert residues(other) == {k: 0 for k in residues(other)}
    # Offloaded, the tensors view the host master - placed the same way.
    assert residues(model) == loaded


@pytest.mark.fast
def test_a_cpu_device_run_is_bit_identical_whatever_the_alignment():
    model = nn.Sequential(misaligned_linear(8), nn.GELU(), misaligned_linear(40))
    plain = twin(model)
    plain_loaded = [misaligned_linear(8), nn.GELU(), misaligned_linear(40)]
    scheduler = Scheduler("cpu")
    scheduler.add("model", model)
    scheduler.add("other", nn.Linear(4, 4))
    x = torch.randn(3, 24)
    reference = nn.Sequential(*plain_loaded)(x)
    for name in ["model", "other", "model"]:
        with scheduler.resident(name):
            if name == "model":
                assert torch.equal(model(x), reference)
                assert torch.equal(model(x), plain(x))


@pytest.mark.fast
def test_accelerator_alignment_puts_every_region_on_a_512_byte_boundary():
    model = nn.Sequential(misaligned_linear(8), misaligned_linear(24), nn.LayerNorm(24))
    inventory = take_inventory([model], alignment=ACCELERATOR_ALIGNMENT, chunk_nbytes=4096)
    layout = inventory.layout
    assert len(layout.chunk_nbytes) > 1, "the test needs several chunks laid end to end"
    bases = layout.chunk_base
    starts = [bases[c] + o for c, o in zip(layout.region_chunk, layout.region_offset)]
    assert all(start % 512 == 0 for start in starts)
    assert all(base % 512 == 0 for base in bases)


@pytest.mark.fast
def test_cpu_alignment_keeps_each_regions_address_modulo_64_in_the_layout():
    model = nn.Sequential(misaligned_linear(8), misaligned_linear(56))
    wanted = [t.data_ptr() % 64 for t in model.state_dict(keep_vars=True).values()]
    inventory = take_inventory([model], alignment=CPU_ALIGNMENT, chunk_nbytes=4096)
    layout = inventory.layout
    bases = layout.chunk_base
    starts = [bases[c] + o for c, o in zip(layout.region_chunk, layout.region_offset)]
    assert [s % 64 for s in starts] == wanted
    assert all(base % 64 == 0 for base in bases)


@pytest.mark.fast
def test_the_alignment_follows_the_device():
    assert alignment_for(torch.device("cpu")) == CPU_ALIGNMENT
    assert alignment_for(torch.device("cuda", 0)) == ACCELERATOR_ALIGNMENT
    with pytest.raises(ValueError, match="a positive power of two, not 48"):
        Alignment(boundary=48, keep_source_offset=False)


def test_a_pipeline_reloaded_from_disk_keeps_every_weights_placement(tmp_path):
    """The case a newcomer hit: safetensors leaves weights 8-byte aligned; inside every phase each
    tensor must sit at the address modulo 64 it was loaded with."""
    pytest.importorskip("diffusers")
    from diffusers import WanPipeline

    from _tiny_pipelines import tiny_wan22

    tiny_wan22().save_pretrained(tmp_path / "wan")
    pipe = WanPipeline.from_pretrained(tmp_path / "wan")
    names = ["text_encoder", "transformer", "transformer_2", "vae"]
    loaded = {name: residues(getattr(pipe, name)) for name in names}
    assert any(r != 0 for group in loaded.values() for r in group.values()), (
        "the test needs weights that safetensors left off the 64-byte grid"
    )
    scheduler = Scheduler("cpu")
    for name in names:
        scheduler.add(name, getattr(pipe, name))
    for name in [*names, *reversed(names)]:
        with scheduler.resident(name):
            assert residues(getattr(pipe, name)) == loaded[name], name


# -- on an accelerator (marked gpu) ------------------------------------------------------------


def _offloaded_on_device(module: nn.Module) -> tuple[Scheduler, nn.Module]:
    device = torch.accelerator.current_accelerator()
    scheduler = Scheduler(device)
    scheduler.add("module", module)
    scheduler.add("other", nn.Linear(8, 8))
    return scheduler, module


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make, shape, simulated_shape",
    [
        (lambda: nn.Linear(3072, 3072), (2, 77, 3072), (2, 77, 3072)),
        (lambda: nn.Conv2d(320, 320, 3, padding=1), (1, 320, 64, 64), (1, 320, 16, 16)),
    ],
    ids=["linear", "conv"],
)
def test_on_an_accelerator_bf16_kernels_are_bit_identical_and_512_aligned(make, shape,
                                                                          simulated_shape):
    """A real accelerator runs the model's own input shape; the simulated device the same
    weights on a smaller image (the simulator computes on the CPU, where one bf16 convolution of
    a 64x64 image took ~30 s; the weights, their placement and the comparison are the same)."""
    device = torch.accelerator.current_accelerator()
    if device.type == "sim":
        shape = simulated_shape
    torch.manual_seed(0)
    module = make().to(torch.bfloat16)
    plain = twin(module).to(device)
    x = torch.randn(shape, dtype=torch.bfloat16, device=device)
    scheduler, module = _offloaded_on_device(module)
    for name in ["module", "other", "module"]:
        with scheduler.resident(name):
            if name == "module":
                assert all(p.data_ptr() % 512 == 0 for p in module.parameters())
                assert torch.equal(module(x), plain(x))
    scheduler.close()


@pytest.mark.gpu
def test_on_an_accelerator_attention_projections_are_bit_identical():
    device = torch.accelerator.current_accelerator()
    torch.manual_seed(0)
    qkv = nn.Linear(1536, 3 * 1536).to(torch.bfloat16)
    plain = twin(qkv).to(device)
    x = torch.randn(2, 256, 1536, dtype=torch.bfloat16, device=device)

    def attend(projection: nn.Module) -> torch.Tensor:
        q, k, v = projection(x).view(2, 256, 3, 12, 128).unbind(2)
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))

    scheduler, qkv = _offloaded_on_device(qkv)
    with scheduler.resident("module"):
        assert all(p.data_ptr() % 512 == 0 for p in qkv.parameters())
        assert torch.equal(attend(qkv), attend(plain))
    scheduler.close()
