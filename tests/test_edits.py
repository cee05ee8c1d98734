"""No edit is lost, whatever path it takes (issue 12, point 1).

The version counter sees edits made through a tensor; it does not see edits through ``.data``
(peft's LoRA merge: ``base_layer.weight.data += delta``), through another view of the storage, or by
a kernel that writes memory directly.  Eviction therefore compares digests of the device bytes with
those taken when they were loaded and writes back exactly the chunks that differ.  Each test edits
while the group is resident, swaps it out, and checks the host master - and a twin never offloaded.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from residency import Scheduler

from conftest import twin

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


def make_model(seed: int = 0, width: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))


@pytest.fixture
def swapping():
    """A CPU scheduler with the model under test ("model") and another group to swap to."""
    model, other = make_model(), make_model(seed=1)
    scheduler = Scheduler("cpu")
    scheduler.add("model", model)
    scheduler.add("other", other)
    yield scheduler, model
    scheduler.close()


def swap_out(scheduler: Scheduler) -> int:
    """Make "other" resident (evicting "model"); returns the bytes the eviction wrote back."""
    with scheduler.resident("other"):
        pass
    return scheduler.transitions[-1].written_back


def host_copy(scheduler: Scheduler, index: int) -> torch.Tensor:
    return scheduler["model"].host_master.views[index].clone()


def test_an_edit_through_data_while_resident_survives_eviction(swapping):
    scheduler, model = swapping
    plain = twin(model)
    with scheduler.resident("model"):
        version = model[0].weight._version
        model[0].weight.data.mul_(2)  # moves no version counter
        assert model[0].weight._version == version
    plain[0].weight.data.mul_(2)
    assert swap_out(scheduler) > 0
    assert torch.equal(host_copy(scheduler, 0), plain[0].weight)
    x = torch.randn(3, 64)
    with scheduler.resident("model"):
        assert torch.equal(model(x), plain(x))


def test_an_edit_through_another_view_of_the_storage_survives(swapping):
    scheduler, model = swapping
    with scheduler.resident("model"):
        alias = torch.empty(0).set_(model[2].bias.untyped_storage(),
                                    model[2].bias.storage_offset(), model[2].bias.shape)
        alias.fill_(3.0)
        expected = model[2].bias.detach().clone()
    swap_out(scheduler)
    assert torch.equal(scheduler["model"].host_master.views[3], expected)


@pytest.mark.parametrize("edit", ["bit_flip", "swap_two_elements"])
def test_a_kernel_writing_memory_directly_is_seen(swapping, edit):
    """Bytes changed behind torch's back (a custom kernel: here memmove on the raw address)."""
    scheduler, model = swapping
    with scheduler.resident("model"):
        weight = model[0].weight
        expected = weight.detach().clone()
        address, size = weight.data_ptr(), weight.element_size()
        if edit == "bit_flip":
            byte = ctypes.c_uint8.from_address(address + 5 * size + 1)
            byte.value ^= 0x10
            expected.view(-1).view(torch.uint8)[5 * size + 1] ^= 0x10
        else:  # two different elements, 17 apart, exchanged
            first, second = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
            ctypes.memmove(first, address, size)
            ctypes.memmove(second, address + 17 * size, size)
            ctypes.memmove(address, second, size)
            ctypes.memmove(address + 17 * size, first, size)
            flat = expected.view(-1)
            flat[0], flat[17] = flat[17].clone(), flat[0].clone()
        assert not torch.equal(expected, scheduler["model"].host_master.views[0])
    assert swap_out(scheduler) > 0
    assert torch.equal(host_copy(scheduler, 0), expected)


def test_unchanged_weights_are_not_written_back(swapping):
    scheduler, model = swapping
    with scheduler.resident("model"):
        model(torch.randn(2, 64))
        with torch.no_grad():
            model[0].weight.mul_(1.0)  # the version counter moves; the bytes do not
    assert swap_out(scheduler) == 0


def test_the_last_edit_wins_when_the_device_is_edited_back_to_the_packed_bytes(swapping):
    """Master edited while offloaded, then, after the next load, the device edited back to the
    packed bytes: the reference is the bytes as loaded, so the edit back is seen."""
    scheduler, model = swapping
    packed = host_copy(scheduler, 0)
    model[0].weight.data.add_(1.0)  # offloaded: the tensor views the master
    edited = host_copy(scheduler, 0)
    assert not torch.equal(edited, packed)
    with scheduler.resident("model"):
        assert torch.equal(model[0].weight, edited)
        model[0].weight.data.copy_(packed)  # back to the bytes registration packed
    swap_out(scheduler)
    assert torch.equal(host_copy(scheduler, 0), packed)


def test_peft_lora_merge_while_resident_is_kept():
    """The case measured in issue 12: peft's merge edits base_layer.weight.data in place."""
    peft = pytest.importorskip("peft")
    model, plain = make_model(seed=3), make_model(seed=3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    plain = peft.get_peft_model(plain, config)
    plain.load_state_dict(model.state_dict())  # the same random (non-zero) LoRA weights
    scheduler = Scheduler("cpu")
    scheduler.add("model", model)
    scheduler.add("other", make_model(seed=4))
    x = torch.randn(3, 64)
    with scheduler.resident("model"):
        base = model.base_model.model(x)  # LoRA active, unmerged
        model.merge_adapter()
    plain.merge_adapter()
    swap_out(scheduler)
    with scheduler.resident("model"):
        merged = model(x)
        assert torch.equal(merged, plain(x))
        with model.disable_adapter():
            fused_base = model(x)
    with plain.disable_adapter():
        assert torch.equal(fused_base, plain(x))
    assert torch.allclose(merged, base, atol=1e-5)
    layer = plain.base_model.model[0]
    assert not torch.equal(layer.base_layer.weight, make_model(seed=3)[0].weight), (
        "the merge must have changed the base weight, or a lost merge would go unnoticed"
    )
    scheduler.close()


def test_layerwise_casting_costs_no_write_back(swapping):
    """Upcast before a forward, cast back after (diffusers' layerwise casting): new storage, same
    bytes - compared on the device, not written back."""
    scheduler, model = swapping
    plain = twin(model)
    with scheduler.resident("model"):
        for parameter in model.parameters():
            parameter.data = parameter.data.to(torch.float64)
        model(torch.randn(2, 64, dtype=torch.float64))
        for parameter in model.parameters():
            parameter.data = parameter.data.to(torch.float32)
    assert swap_out(scheduler) == 0
    x = torch.randn(3, 64)
    with scheduler.resident("model"):
        assert torch.equal(model(x), plain(x))


def test_without_edit_detection_version_counted_edits_still_survive():
    """The opt-out (``detect_edits=False``): eviction reads no bytes; edits made through the tensor
    (the version counter moves) are still written back, and `mark_dirty` covers the rest."""
    model, plain = make_model(), make_model()
    scheduler = Scheduler("cpu")
    scheduler.add("model", model, detect_edits=False)
    scheduler.add("other", make_model(seed=1))
    with scheduler.resident("model"):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        model[2].weight.data.mul_(2)  # invisible without detection...
        scheduler["model"].mark_dirty()  # ...unless the user says so
    with torch.no_grad():
        plain[0].weight.add_(1.0)
        plain[2].weight.mul_(2)
    assert swap_out(scheduler) > 0
    views = scheduler["model"].host_master.views
    assert torch.equal(views[0], plain[0].weight) and torch.equal(views[2], plain[2].weight)
    scheduler.close()


def test_detect_edits_takes_a_bool():
    from residency import RegistrationError

    scheduler = Scheduler("cpu")
    with pytest.raises(RegistrationError, match=r"detect_edits='no'; give True or False"):
        scheduler.add("model", make_model(), detect_edits="no")
    assert "model" not in scheduler
