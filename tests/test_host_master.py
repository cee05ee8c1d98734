"""`HostMaster`: the packed host copy, built into fresh chunks or into one buffer laid out as the
device storage (a node-shared segment), and attached to by a process that did not pack it.

Checked on layouts of one chunk and of many: every tensor reads its own bytes after packing, and
where its storage really lives (the chunk it belongs to, at the offset the layout gives).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from residency.host.memory import HostMaster
from residency.modules.tensors import take_inventory
from residency.device.transport import CpuTransport

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


def _inventory(model, chunk_nbytes):
    return take_inventory([model], chunk_nbytes=chunk_nbytes)


@pytest.mark.parametrize("chunk_nbytes", [2**20, 4096], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("into_buffer", [False, True], ids=["own-chunks", "into-buffer"])
def test_packing_keeps_every_tensor_s_bytes(chunk_nbytes, into_buffer):
    model = _model()
    plain = copy.deepcopy(model)
    inventory = _inventory(model, chunk_nbytes)
    layout = inventory.layout
    assert (len(layout.chunk_nbytes) > 1) == (chunk_nbytes == 4096)
    buffer = torch.zeros(layout.contiguous_nbytes, dtype=torch.uint8) if into_buffer else None
    master = HostMaster.pack(inventory, CpuTransport(), pin=False, into=buffer)
    for (name, tensor), (_, expected) in zip(model.state_dict().items(),
                                             plain.state_dict().items()):
        assert torch.equal(tensor, expected), name
    for chunk_index, chunk in enumerate(master.chunks):
        first, end = chunk.data_ptr(), chunk.data_ptr() + chunk.numel()
        for i in inventory.tensors_in_regions(inventory.regions_in_chunk(chunk_index)):
            pointer = inventory.tensors[i].data_ptr()
            assert first <= pointer < end, (chunk_index, i)
    if into_buffer:
        assert all(c.untyped_storage().data_ptr() == buffer.data_ptr() for c in master.chunks)


def test_attaching_to_a_packed_buffer_reads_each_chunk_s_bytes():
    packed_model, attached_model = _model(), _model()
    plain = copy.deepcopy(packed_model)
    packed = _inventory(packed_model, 4096)
    buffer = torch.zeros(packed.layout.contiguous_nbytes, dtype=torch.uint8)
    HostMaster.pack(packed, CpuTransport(), pin=False, into=buffer)
    with torch.no_grad():  # the attaching process's own copy is dropped, not read
        for parameter in attached_model.parameters():
            parameter.zero_()
    attached = _inventory(attached_model, 4096)
    assert len(attached.layout.chunk_nbytes) > 1
    HostMaster.attach(attached, buffer, pinned=False)
    for (name, tensor), (_, expected) in zip(attached_model.state_dict().items(),
                                             plain.state_dict().items()):
        assert torch.equal(tensor, expected), name
        assert buffer.data_ptr() <= tensor.data_ptr() < buffer.data_ptr() + buffer.numel()
