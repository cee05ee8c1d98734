"""Checks the test files share: where a tensor's storage really lives (by address, not by flag),
and the one step the layer-mode tests repeat.

    assert in_buffer(weight, group.device_storage.buffer)    # the weight views the device bytes
    assert on_host_master(group) and not on_device(group)    # an offloaded group
    swap_away(scheduler)                                     # enter "other": the group leaves
    assert_same_tensors(pipe.vae, plain.vae, "vae")          # every parameter and buffer, bytes
"""

from __future__ import annotations

import torch
from torch import nn


def in_buffer(tensor: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """Whether `tensor`'s data starts inside `buffer` (None: there is no buffer)."""
    if buffer is None:
        return False
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.nbytes


def on_device(group) -> bool:
    """Whether every tensor of `group` views its device buffer (False before its first load)."""
    storage = group.device_storage  # None while offloaded (or the shared buffer, unfilled)
    buffer = None if storage is None else storage.buffer
    return buffer is not None and all(in_buffer(t, buffer) for t in group.tensors)


def on_host_master(group) -> bool:
    """Whether every tensor of `group` is its host master's view, in order."""
    return [t.data_ptr() for t in group.tensors] == [v.data_ptr() for v in group.host_master.views]


def in_a_slot(scheduler, tensor: torch.Tensor) -> bool:
    """Whether `tensor` views one of the scheduler's layer-mode block slots."""
    return any(in_buffer(tensor, slot.buffer) for slot in scheduler._placement.slots.slots)


def same_state(model: nn.Module, reference: nn.Module) -> bool:
    """Whether the two modules have the same state-dict keys and bit-identical values."""
    ours, theirs = model.state_dict(), reference.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def swap_away(scheduler, name: str = "other") -> None:
    """Enter and leave group `name`'s phase, so the current exclusive group is evicted."""
    with scheduler.resident(name):
        pass


def every_tensor(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (non-persistent included), tied ones under each name."""
    return dict(module.named_parameters(remove_duplicate=False)) | dict(
        module.named_buffers(remove_duplicate=False))


def assert_same_tensors(module: nn.Module, reference: nn.Module, what: str) -> None:
    """Every parameter and buffer of `module` is `reference`'s: names, dtype, device, shape and
    bytes."""
    ours, theirs = every_tensor(module), every_tensor(reference)
    assert ours.keys() == theirs.keys(), what
    for name, tensor in ours.items():
        expected = theirs[name]
        assert (tensor.dtype, tensor.device, tensor.shape) == (
            expected.dtype, expected.device, expected.shape), f"{what}: {name}"
        assert torch.equal(tensor.detach().view(torch.uint8), expected.detach().view(torch.uint8)
                           ) if tensor.numel() else True, f"{what}: {name} differs"
