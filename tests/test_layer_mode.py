"""Layer mode (issue 14): a group's blocks stream through two reused device slots, bit-identically.

Every test runs on the CPU (``Scheduler("cpu")`` swaps into separate device buffers, so a block in a
slot really is a copy) with tiny models built from configs in code: real diffusers DiTs (Wan2.2's
two experts, Flux's double- and single-stream lists) and a small custom DiT whose blocks can fail,
edit themselves or call each other on demand.  The reference for every output is a deep copy of
the same model made before registration and never offloaded; outputs are compared with
`torch.equal`, call by call.

What a block's tensors may point at is checked by address, not by flag: a streamed block that is
not in a slot views its own host master; one in a slot views that slot's buffer; at most two
blocks, one per slot, are in the slots, and only the current group's.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys

import attrs
import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from residency import Scheduler  # noqa: E402
from residency.modules.blocks import model_blocks  # noqa: E402
from residency.core.enums import ResidencyState  # noqa: E402
from residency.core.errors import ConfigError, PhaseError, RegistrationError  # noqa: E402
from residency.placement.layers import _BlockForward  # noqa: E402

from _helpers import in_a_slot, same_state, swap_away  # noqa: E402
from conftest import CountingTransport  # noqa: E402
from _tiny_pipelines import (  # noqa: E402
    flux_call,
    lora_flow,
    tiny_flux_layered,
    tiny_flux_transformer,
    tiny_wan22,
    tiny_wan22_layered,
    tiny_wan_expert,
    wan22_call,
)

OFFLOADED, RESIDENT = ResidencyState.OFFLOADED, ResidencyState.RESIDENT


# -- models and inputs ----------------------------------------------------------------------------


class BlockFailure(RuntimeError):
    """Raised on purpose by a `ProbeBlock` whose ``fail`` is set."""


class ProbeBlock(nn.Module):
    """A residual block that can, on demand: raise, scale its own weight through ``.data`` once
    inside its forward, call other blocks first (nesting), and note where its weight is."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.fail = False
        #: A factor to multiply the weight by (through ``.data``) in the next forward, once.
        self.scale_in_forward: float | None = None
        #: Blocks this forward calls first: a plain list, so not submodules.
        self.calls: list[nn.Module] = []
        #: When a list: (data_ptr, copy) of the weight at each forward.
        self.seen: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for other in self.calls:
            x = other(x)
        if self.fail:
            raise BlockFailure("this block fails on purpose")
        if self.scale_in_forward is not None:
            self.linear.weight.data.mul_(self.scale_in_forward)
            self.scale_in_forward = None
        if self.seen is not None:
            weight = self.linear.weight
            self.seen.append((weight.data_ptr(), weight.detach().clone()))
        return x + torch.tanh(self.linear(self.norm(x)))


class ProbeDiT(nn.Module):
    """Embedding, a list of `ProbeBlock`s declared the vLLM-Omni way, a head."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, depth: int = 4, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(ProbeBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def probe_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 32, generator=torch.Generator().manual_seed(seed))


def wan_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, 2, 4, 4, generator=generator), torch.tensor([700 - 100 * seed]),
            torch.randn(1, 8, 16, generator=generator))


def run_wan(model: nn.Module, inputs) -> torch.Tensor:
    latents, timestep, context = inputs
    return model(latents, timestep, context, return_dict=False)[0]


def flux_inputs(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    image_ids = torch.zeros(4, 4, 3)
    image_ids[..., 1] = torch.arange(4)[:, None]
    image_ids[..., 2] = torch.arange(4)[None, :]
    return {
        "hidden_states": torch.randn(1, 16, 4, generator=generator),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=generator),
        "pooled_projections": torch.randn(1, 32, generator=generator),
        "timestep": torch.tensor([0.25 + 0.5 * seed]),
        "img_ids": image_ids.reshape(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }


def wan_block_inputs(reference: nn.Module, inputs) -> tuple[tuple, dict]:
    """The arguments the reference Wan model passes its first block (hidden states first)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs

    handle = reference.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    run_wan(reference, inputs)
    handle.remove()
    return captured["args"], captured["kwargs"]


def run_sequence(blocks, order, args, kwargs) -> torch.Tensor:
    hidden, rest = args[0], args[1:]
    for index in order:
        hidden = blocks[index](hidden, *rest, **kwargs)
    return hidden


# -- where tensors are -----------------------------------------------------------------------------


def ptrs(tensors) -> list[int]:
    return [t.data_ptr() for t in tensors]


def on_master(part) -> bool:
    """Every tensor of `part` (a group or one streamed block) views its host master."""
    return ptrs(part.tensors) == ptrs(part.host_master.views)


def within(tensors, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return all(start <= t.data_ptr() < start + buffer.numel() for t in tensors)


def check_stream(scheduler: Scheduler, name: str) -> None:
    """Between block forwards: every streamed block of `name` is offloaded on its master, or
    parked (resident) in a slot of its own, viewing that slot; at most two are in slots."""
    slots = scheduler._placement.slots.slots
    held = []
    for block in scheduler[name].streams[0].parts:
        if block.state is OFFLOADED:
            assert on_master(block), f"{block.name} is offloaded but not on its master"
            continue
        assert block.state is RESIDENT, f"{block.name} is {block.state.value}"
        storage = block.device_storage
        assert any(storage is slot for slot in slots), f"{block.name} is resident outside a slot"
        assert storage.buffer is not None and within(block.tensors, storage.buffer), block.name
        held.append(id(storage))
    assert len(held) == len(set(held)) <= 2, "two blocks in one slot, or more than two in slots"


def check_all_offloaded(scheduler: Scheduler, name: str) -> None:
    group = scheduler[name]
    assert not group.is_resident and on_master(group), name
    if group.plan.streams:
        for block in group.streams[0].parts:
            assert block.state is OFFLOADED and on_master(block), block.name


def wrapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _BlockForward)


def first_linear(block: nn.Module) -> tuple[str, nn.Linear]:
    return next((path, m) for path, m in block.named_modules() if isinstance(m, nn.Linear))


def watch_blocks(blocks, scheduler: Scheduler, seen: list) -> list:
    """A forward pre-hook on the first Linear inside each block: notes (block index, weight's
    data_ptr, a copy of the weight, whether it lies in a slot, `scheduler.device_nbytes`)."""
    handles = []
    for index, block in enumerate(blocks):
        _, linear = first_linear(block)

        def note(module, args, index=index):
            weight = module.weight
            seen.append((index, weight.data_ptr(), weight.detach().clone(),
                         in_a_slot(scheduler, weight), scheduler.device_nbytes))

        handles.append(linear.register_forward_pre_hook(note))
    return handles


def tensor_index(part, tensor: torch.Tensor) -> int:
    return next(i for i, t in enumerate(part.tensors) if t is tensor)


def part_holding(group, tensor: torch.Tensor):
    """The streamed block of `group` (or the group itself) whose inventory holds `tensor`."""
    for part in (group, *group.streams[0].parts):
        if any(t is tensor for t in part.tensors):
            return part
    raise AssertionError("no part of the group holds the tensor")


@pytest.fixture
def schedulers():
    """Make CPU schedulers; each is closed at the end of the test (if the test did not)."""
    made = []

    def make(**options) -> Scheduler:
        made.append(Scheduler("cpu", **options))
        return made[-1]

    yield make
    for scheduler in made:
        with contextlib.suppress(Exception):
            scheduler.close()


def layer_scheduler(schedulers, model: nn.Module, layers=True, name: str = "dit") -> Scheduler:
    """`model` as layer-mode group `name`, and a small group "other" to swap to."""
    scheduler = schedulers()
    scheduler.add(name, model, layers=layers)
    scheduler.add("other", nn.Linear(4, 4))
    return scheduler


# -- 1. real diffusers DiTs, bit-identical call by call --------------------------------------------


def test_wan22_experts_take_turns_with_a_text_encoder_bit_identically_one_expert_in_the_slots(
    schedulers,
):
    pipe = tiny_wan22_layered(num_layers=3)
    models = {"text_encoder": pipe.text_encoder, "transformer": pipe.transformer,
              "transformer_2": pipe.transformer_2}
    reference = copy.deepcopy(models)
    scheduler = schedulers()
    scheduler.add("text_encoder", models["text_encoder"])
    experts = ("transformer", "transformer_2")
    for name in experts:
        scheduler.add(name, models[name], layers=True)
    checked = []

    def check_exclusive(module, args, name, index):
        assert scheduler.current == name
        stream = scheduler[name].streams[0]
        block = stream.parts[index]
        assert block.state is RESIDENT and within(block.tensors, block.device_storage.buffer)
        assert in_a_slot(scheduler, module.weight)
        assert sum(b.state is not OFFLOADED for b in stream.parts) <= 2
        for other in (*experts, "text_encoder"):
            if other != name:
                check_all_offloaded(scheduler, other)
        checked.append((name, index))

    for name in experts:
        for index, block in enumerate(models[name].blocks):
            block.attn1.to_q.register_forward_pre_hook(
                lambda m, a, name=name, index=index: check_exclusive(m, a, name, index))

    ids = torch.tensor([[3, 4, 6, 7, 8, 1, 0, 0]])
    negative = torch.tensor([[10, 11, 1, 0, 0, 0, 0, 0]])

    def generate(models, seed, phase) -> list[torch.Tensor]:
        encoder = models["text_encoder"]
        with phase("text_encoder"):
            cond = encoder(ids, attention_mask=(ids > 0).long()).last_hidden_state
            uncond = encoder(negative, attention_mask=(negative > 0).long()).last_hidden_state
        latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(seed))
        outputs = [cond, uncond]
        for step, name in enumerate(("transformer", "transformer", "transformer_2",
                                     "transformer_2")):
            with phase(name):
                timestep = torch.tensor([900 - 200 * step])
                noise_cond = run_wan(models[name], (latents, timestep, cond))
                noise_uncond = run_wan(models[name], (latents, timestep, uncond))
            outputs += [noise_cond, noise_uncond]
            latents = latents - 0.2 * (noise_uncond + 3.0 * (noise_cond - noise_uncond))
        return outputs + [latents]

    for seed in (0, 1):
        ours = generate(models, seed, scheduler.resident)
        theirs = generate(reference, seed, lambda name: contextlib.nullcontext())
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a, b), f"call {seed}, output {index} differs from the reference"
    every_block = {(name, i) for name in experts for i in range(3)}
    assert set(checked) == every_block and len(checked) == 2 * 2 * 2 * 2 * 3
    groups = {record.group for record in scheduler.block_records}
    assert groups == set(experts)


@pytest.mark.fast
def test_flux_streams_its_double_then_single_blocks_in_order_bit_identically(schedulers):
    model = tiny_flux_transformer(num_layers=2, num_single_layers=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    stream = scheduler["dit"].streams[0]
    assert stream.model_blocks[0].lists == ("transformer_blocks", "single_transformer_blocks")
    order = (*model.transformer_blocks, *model.single_transformer_blocks)
    assert tuple(block.modules[0] for block in stream.parts) == order
    for seed in (0, 1, 0):
        scheduler.block_records.clear()
        with scheduler.resident("dit") as group:
            assert group.layers() == order
            ours = model(**flux_inputs(seed))[0]
        assert torch.equal(ours, reference(**flux_inputs(seed))[0])
        computed = [r.block for r in scheduler.block_records if r.kind == "compute"]
        assert computed == [f"dit.transformer_blocks.{i}" for i in range(2)] + [
            f"dit.single_transformer_blocks.{i}" for i in range(3)]
        check_stream(scheduler, "dit")
        swap_away(scheduler)
        check_all_offloaded(scheduler, "dit")


@pytest.mark.fast
def test_a_wan_transformer_refused_by_finding_streams_by_its_repeated_blocks_bit_identically(
    schedulers,
):
    """Two blocks under half the bytes (Wan's freq_dim 256): finding refuses the model, its
    class's diffusers ``_repeated_blocks`` names the list, and it streams."""
    model = tiny_wan_expert(num_layers=2, freq_dim=256)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    plan, = scheduler["dit"].streams[0].model_blocks
    assert (plan.source, plan.lists) == ("repeated_blocks", ("blocks",))
    for seed in (0, 1):
        scheduler.block_records.clear()
        with scheduler.resident("dit"):
            ours = run_wan(model, wan_inputs(seed))
        assert torch.equal(ours, run_wan(reference, wan_inputs(seed))), f"call {seed}"
        computed = [r.block for r in scheduler.block_records if r.kind == "compute"]
        assert computed == [f"dit.blocks.{i}" for i in range(2)]
        check_stream(scheduler, "dit")
        swap_away(scheduler)
        check_all_offloaded(scheduler, "dit")


@pytest.mark.fast
def test_a_layer_groups_repr_counts_the_whole_group_then_the_part_outside_its_blocks(schedulers):
    model = ProbeDiT(depth=4, width=256)
    scheduler = layer_scheduler(schedulers, model)

    def counted(tensors) -> str:
        tensors = list(tensors)
        return f"{len(tensors)} tensors, {sum(t.nbytes for t in tensors) / 2**20:.1f} MiB"

    outside = [*model.embed.parameters(), *model.head.parameters()]
    assert repr(scheduler["dit"]) == (
        f"<Residency 'dit' exclusive offloaded: 1 module(s), {counted(model.parameters())}; "
        f"outside its 4 streamed blocks {counted(outside)}>")
    assert repr(scheduler["other"]) == (
        "<Residency 'other' exclusive offloaded: 1 module(s), 2 tensors, 0.0 MiB>")


# -- 2 and 3. resident_layers, and the device bytes at every block ---------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("resident_layers", [0, 1, 5], ids=["none-kept", "one-kept", "all-kept"])
def test_resident_layers_keeps_the_leading_blocks_and_streams_the_rest(
    schedulers, resident_layers
):
    model = tiny_wan_expert(num_layers=5)
    reference = copy.deepcopy(model)
    plan = model_blocks(model, resident_layers=resident_layers)
    scheduler = layer_scheduler(schedulers, model, layers=plan)
    group = scheduler["dit"]
    kept = min(resident_layers, 5)
    assert [b.modules[0] for b in group.streams[0].parts] == list(model.blocks[kept:])
    assert [wrapped(b) for b in model.blocks] == [False] * kept + [True] * (5 - kept)
    seen = []
    watch_blocks(model.blocks, scheduler, seen)
    for seed in (0, 1):
        with scheduler.resident("dit") as active:
            assert active.layers() == tuple(model.blocks)
            assert torch.equal(run_wan(model, wan_inputs(seed)),
                               run_wan(reference, wan_inputs(seed)))
        swap_away(scheduler)
    for index, _, weight, slotted, _ in seen:
        assert torch.equal(weight, first_linear(reference.blocks[index])[1].weight)
        assert slotted == (index >= kept), f"block {index}: in a slot {slotted}"
    streamed = {r.index for r in scheduler.block_records}
    assert streamed == set(range(5 - kept))
    if kept == 5:
        assert not any(r.kind in ("prefetch", "load") for r in scheduler.block_records)
        assert scheduler.block_records.copies == 0


@pytest.mark.fast
@pytest.mark.parametrize("resident_layers", [0, 1, 5], ids=["none-kept", "one-kept", "all-kept"])
def test_device_bytes_at_every_block_stay_within_the_rest_plus_two_slots(
    schedulers, resident_layers
):
    """Sampled inside every block's forward: the outside part (kept blocks included) plus two
    slots of the largest streamed block - never the whole model (when anything streams)."""
    model = tiny_wan_expert(num_layers=5)
    plan = model_blocks(model, resident_layers=resident_layers)
    whole = schedulers().add("whole", copy.deepcopy(model)).inventory.layout.contiguous_nbytes
    transport = CountingTransport()
    scheduler = schedulers(transport=transport)
    group = scheduler.add("dit", model, layers=plan)
    seen = []
    watch_blocks(model.blocks, scheduler, seen)
    for seed in (0, 1):
        with scheduler.resident("dit"), torch.no_grad():
            run_wan(model, wan_inputs(seed))
    # the group's buffer once, and each slot once: no allocation per block or per forward
    assert transport.device_allocations == (1 if resident_layers == 5 else 3)
    samples = [sample for *_, sample in seen]
    assert len(samples) == 10
    stream = group.streams[0]
    exact = group.inventory.layout.contiguous_nbytes + 2 * stream.slot_nbytes
    assert max(samples) <= exact == group.device_need
    kept = min(resident_layers, 5)
    largest = max(block.nbytes for block in plan.blocks)
    regions = len(group.inventory.layout.region_nbytes) + 2 * max(
        (len(b.inventory.layout.region_nbytes) for b in stream.parts), default=0)
    bound = plan.outside_nbytes + (kept + min(2, 5 - kept)) * largest + 512 * regions
    assert max(samples) <= bound
    if kept < 5:
        assert max(samples) == exact  # both slots exist while streaming
    if kept <= 2:
        assert max(samples) < whole, "layer mode must hold less than the whole model"
    else:
        assert all(slot.buffer is None for slot in scheduler._placement.slots.slots)


def placement_storages(scheduler: Scheduler) -> list:
    """The placement's shared device storages: module mode's exclusive pair, layer mode's
    storage for a group's own part (when the placement has one), the two block slots."""
    return list(scheduler._placement._device_buffers.all)


def device_storages(scheduler: Scheduler) -> dict[int, int]:
    """Distinct storages (by address) behind every device buffer the placement holds, and their
    sizes from the storages themselves."""
    storages = [*placement_storages(scheduler)]
    storages += [scheduler[name].device_storage for name in scheduler]
    found = {}
    for storage in storages:
        if storage is not None and storage.buffer is not None:
            untyped = storage.buffer.untyped_storage()
            found[untyped.data_ptr()] = untyped.nbytes()
    return found


def check_device_bytes(scheduler: Scheduler) -> int:
    """device_nbytes equals the storages that exist, and every tensor that should be on the
    device lies in one of them."""
    found = device_storages(scheduler)
    assert scheduler.device_nbytes == sum(found.values())
    buffers = [s.buffer for s in placement_storages(scheduler) if s.buffer is not None]
    for name in scheduler:
        group = scheduler[name]
        parts = [group, *group.parts]
        for part in parts:
            if part.is_resident:
                assert any(within(part.tensors, b) for b in
                           [*buffers, part.device_storage.buffer]), part.name
    return scheduler.device_nbytes


@pytest.mark.fast
def test_device_nbytes_is_the_sum_of_the_device_storages_that_exist(schedulers):
    model, encoder = tiny_wan_expert(num_layers=4), nn.Sequential(nn.Linear(16, 64),
                                                                  nn.Linear(64, 16))
    scheduler = schedulers()
    scheduler.add("text_encoder", encoder)
    group = scheduler.add("dit", model, layers=True)
    scheduler.add("always", nn.Linear(8, 8), policy="resident")
    always = check_device_bytes(scheduler)
    assert always > 0  # only the resident-policy group's storage so far
    with scheduler.resident("text_encoder"):
        encoder_phase = check_device_bytes(scheduler)
    assert all(slot.buffer is None for slot in scheduler._placement.slots.slots)
    at_blocks = []
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda m, a: at_blocks.append(check_device_bytes(scheduler)))
    with scheduler.resident("dit"):
        run_wan(model, wan_inputs())
    assert len(at_blocks) == 4
    slots = [slot.nbytes for slot in scheduler._placement.slots.slots]
    assert slots == [group.streams[0].slot_nbytes] * 2
    # a layer phase holds its own part and two slots, no buffer sized for the encoder
    assert set(at_blocks[1:]) == {always + group.device_need}
    with scheduler.resident("text_encoder"):  # a module-mode phase releases the slots
        assert check_device_bytes(scheduler) == encoder_phase
    scheduler.offload_all()
    assert check_device_bytes(scheduler) == always


# -- 4. records: prefetch ahead, the ring ----------------------------------------------------------


@pytest.mark.fast
def test_each_streamed_block_has_a_profiler_range_and_the_trace_shows_block_records(
    schedulers, tmp_path
):
    from residency import chrome_trace

    model = ProbeDiT(depth=3)
    scheduler = layer_scheduler(schedulers, model)
    with torch.profiler.profile() as profile, scheduler.resident("dit"):
        model(probe_input())
    ranges = sorted(e.name for e in profile.events() if e.name.startswith("residency::block"))
    assert ranges == [f"residency::block dit.dit.blocks.{i}" for i in range(3)]
    trace = chrome_trace(scheduler.transitions, blocks=scheduler.block_records,
                         path=tmp_path / "trace.json")
    instants = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "block"]
    assert "prefetch dit.blocks.1" in instants and "compute dit.blocks.0" in instants
    assert (tmp_path / "trace.json").stat().st_size > 0


@pytest.mark.fast
def test_records_prefetch_each_next_block_before_this_ones_compute_and_the_last_the_first(
    schedulers,
):
    depth = 4
    model = tiny_wan_expert(num_layers=depth)
    scheduler = layer_scheduler(schedulers, model)
    log = scheduler.block_records
    forwards = []
    for seed in (0, 1, 2):
        log.clear()
        copies = log.copies
        with scheduler.resident("dit"):
            run_wan(model, wan_inputs(seed))
        forwards.append((list(log), log.copies - copies))
    for number, (records, copies) in enumerate(forwards):
        kinds = [(r.kind, r.index) for r in records]
        assert [r.time for r in records] == sorted(r.time for r in records)
        assert not any(kind == "load" for kind, _ in kinds), "every block was prefetched"
        position = {key: kinds.index(key) for key in kinds if key[0] != "prefetch"}
        computes = [i for kind, i in kinds if kind == "compute"]
        assert computes == list(range(depth))
        for i in range(depth - 1):
            prefetched = max(p for p, k in enumerate(kinds) if k == ("prefetch", i + 1)
                             and p < position[("compute", i + 1)])
            assert prefetched < position[("compute", i)], f"forward {number}, block {i}"
            assert position[("evict", i)] < position[("compute", i + 1)]
        last = position[("compute", depth - 1)]
        assert kinds[last - 1] == ("prefetch", 0), "the last block's entry prefetches the first"
        for i in range(depth):  # a block computes in the slot its copy went to
            compute = records[position[("compute", i)]]
            copy_record = [r for r in records[: position[("compute", i)]]
                           if r.index == i and r.kind == "prefetch"]
            if copy_record:
                assert compute.slot == copy_record[-1].slot
        slots = [records[position[("compute", i)]].slot for i in range(depth)]
        assert all(a != b for a, b in zip(slots, slots[1:])), "consecutive blocks share a slot"
        # the first forward also copies block 0 when the phase starts; later ones got it from
        # the ring
        assert copies == (depth + 1 if number == 0 else depth)
        check_stream(scheduler, "dit")


@pytest.mark.fast
def test_gradients_and_an_optimizer_step_through_layer_mode_match_the_reference(schedulers):
    """With autograd on, the graph keeps each block's slot bytes for the backward: the slot is
    not overwritten (a fresh buffer is taken), gradients are bit-identical, and an SGD step on
    every parameter (the parked first block's in its slot, the others' in their masters) is kept."""
    model = ProbeDiT(depth=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    for step in range(3):
        x = probe_input(step)
        with scheduler.resident("dit"):
            out = model(x)
        expected = reference(x)
        assert torch.equal(out, expected), step
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(ours.grad, theirs.grad), (step, name)
        for module in (model, reference):
            torch.optim.SGD(module.parameters(), lr=0.1).step()
            module.zero_grad()
        if step == 1:
            swap_away(scheduler)
    scheduler.close()
    assert same_state(model, reference)


# -- 5. out of order -------------------------------------------------------------------------------


@pytest.mark.fast
def test_blocks_run_out_of_order_are_bit_identical_and_run_on_their_own_weights(schedulers):
    model = tiny_wan_expert(num_layers=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    args, kwargs = wan_block_inputs(reference, wan_inputs())
    seen = []
    watch_blocks(model.blocks, scheduler, seen)
    orders = [[0, 2], [3, 2, 1, 0], [1, 1], [2, 0, 2], [0, 1, 3], [3], [0, 1, 2, 3]]
    with scheduler.resident("dit") as group:
        layers = group.layers()
        assert layers == tuple(model.blocks)
        for order in orders:
            ours = run_sequence(layers, order, args, kwargs)
            assert torch.equal(ours, run_sequence(reference.blocks, order, args, kwargs)), order
            check_stream(scheduler, "dit")
        assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
    assert len(seen) == sum(map(len, orders)) + 4
    for index, _, weight, slotted, _ in seen:
        assert slotted, f"block {index} ran outside the slots"
        assert torch.equal(weight, reference.blocks[index].attn1.to_q.weight), (
            f"block {index} ran with weights that are not its own")
    assert any(r.kind == "load" for r in scheduler.block_records), "out of order loads on demand"
    swap_away(scheduler)
    check_all_offloaded(scheduler, "dit")
    assert same_state(model, reference)


@pytest.mark.fast
def test_a_block_never_computes_with_another_blocks_weights_in_either_slot(schedulers):
    """Each ProbeBlock notes its weight inside its forward: its own bytes, in a slot, and the
    two blocks of a nested call sit in different slots."""
    model = ProbeDiT(depth=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    for block in model.blocks:
        block.seen = []
    model.blocks[3].calls = [model.blocks[0]]  # block 3 runs block 0 inside its forward
    reference.blocks[3].calls = [reference.blocks[0]]
    for seed in (0, 1):
        # inference: nothing keeps a slot's bytes alive, so each slot is allocated once
        with scheduler.resident("dit"), torch.no_grad():
            assert torch.equal(model(probe_input(seed)), reference(probe_input(seed)))
    buffers = [slot.buffer for slot in scheduler._placement.slots.slots]

    def slot_of(pointer: int) -> int:
        inside = [i for i, b in enumerate(buffers)
                  if b.data_ptr() <= pointer < b.data_ptr() + b.numel()]
        assert len(inside) == 1, "a block computed outside the slots"
        return inside[0]

    for index, block in enumerate(model.blocks):
        assert len(block.seen) == (4 if index == 0 else 2), index
        for pointer, weight in block.seen:
            assert torch.equal(weight, reference.blocks[index].linear.weight), index
            slot_of(pointer)
    # in each forward's nested call, block 0 (inner) and block 3 (outer) were in slots at once
    for forward in (0, 1):
        inner = model.blocks[0].seen[2 * forward + 1][0]
        outer = model.blocks[3].seen[forward][0]
        assert slot_of(inner) != slot_of(outer), "nested blocks share a slot"


@pytest.mark.fast
def test_three_blocks_nested_is_refused_and_leaves_the_stream_consistent(schedulers):
    model = ProbeDiT(depth=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    model.blocks[2].calls = [model.blocks[0]]
    model.blocks[0].calls = [model.blocks[3]]
    with pytest.raises(PhaseError, match=r"were running, nested in each other.s forwards or on other threads; layer mode streams through two slots, so at most two blocks run at once"):
        with scheduler.resident("dit"):
            model(probe_input())
    check_stream(scheduler, "dit")
    assert not scheduler["dit"].streams[0]._running
    model.blocks[2].calls, model.blocks[0].calls = [], []
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input()), reference(probe_input()))
    swap_away(scheduler)
    check_all_offloaded(scheduler, "dit")
    assert same_state(model, reference)


# -- 6. an exception inside a block ----------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("failing", [0, 1, 3], ids=["first", "middle", "last"])
def test_an_exception_inside_a_block_leaves_every_block_offloaded_or_parked(schedulers, failing):
    model = ProbeDiT(depth=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(0)), reference(probe_input(0)))
    model.blocks[failing].fail = True
    with pytest.raises(BlockFailure):
        with scheduler.resident("dit"):
            model(probe_input(1))
    group = scheduler["dit"]
    assert scheduler.current == "dit" and group.is_resident
    assert within(group.tensors, group.device_storage.buffer)
    check_stream(scheduler, "dit")
    assert not group.streams[0]._running
    # a second failure, outside any phase (the group stays current), changes nothing either
    with pytest.raises(BlockFailure):
        model(probe_input(1))
    check_stream(scheduler, "dit")
    model.blocks[failing].fail = False
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(1)), reference(probe_input(1)))
    swap_away(scheduler)
    check_all_offloaded(scheduler, "dit")
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(2)), reference(probe_input(2)))
    scheduler.close()
    assert not any(wrapped(block) or "forward" in block.__dict__ for block in model.blocks)
    assert torch.equal(model(probe_input(3)), reference(probe_input(3)))
    assert same_state(model, reference)


# -- 7. edits to blocks survive --------------------------------------------------------------------


def scale_in_place(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.mul_(2)


def scale_through_data(weight: torch.Tensor) -> None:
    weight.data.mul_(2)  # bytes only: no version counter moves


def scale_into_new_storage(weight: torch.Tensor) -> None:
    weight.data = weight.detach() * 2


EDITS = {"in-place": scale_in_place, "through-data": scale_through_data,
         "new-storage": scale_into_new_storage}


#: Where the edited block is between forwards: (resident_layers, block index).
TARGETS = {"kept-block": (1, 0), "parked-first-block": (0, 0), "offloaded-block": (0, 2)}


@pytest.mark.fast
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("where", list(TARGETS))
def test_an_edit_to_a_block_between_forwards_survives_swaps_and_close(schedulers, edit, where):
    resident_layers, target = TARGETS[where]
    model = tiny_wan_expert(num_layers=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(
        schedulers, model, layers=model_blocks(model, resident_layers=resident_layers))
    group = scheduler["dit"]
    with scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(0)), run_wan(reference, wan_inputs(0)))
    weight = model.blocks[target].attn1.to_q.weight
    block = part_holding(group, weight)
    if where == "kept-block":  # in the group's own part, on the device while it is current
        assert block is group and within([weight], group.device_storage.buffer)
    elif where == "parked-first-block":  # the ring parked it in a slot, where the edit lands
        assert block.state is RESIDENT and in_a_slot(scheduler, weight)
    else:
        assert block.state is OFFLOADED and on_master(block)
    version = weight._version
    EDITS[edit](weight)
    EDITS[edit](reference.blocks[target].attn1.to_q.weight)
    if edit == "through-data":
        assert weight._version == version
    with scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
    swap_away(scheduler)
    check_all_offloaded(scheduler, "dit")
    home = block.host_master.views[tensor_index(block, weight)]
    assert torch.equal(home, reference.blocks[target].attn1.to_q.weight), "not in the master"
    with scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))
    scheduler.close()
    assert torch.equal(run_wan(model, wan_inputs(3)), run_wan(reference, wan_inputs(3)))
    assert same_state(model, reference)


@pytest.mark.fast
@pytest.mark.parametrize("end", ["close", "remove", "swap"])
def test_a_data_edit_to_the_parked_first_block_survives_without_another_forward(schedulers, end):
    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        run_wan(model, wan_inputs())
    first = scheduler["dit"].streams[0].parts[0]
    assert first.state is RESIDENT
    for module in (model, reference):
        module.blocks[0].ffn.net[2].weight.data.add_(0.5)
        module.blocks[0].norm2.bias.data.sub_(0.25)
    {"close": scheduler.close, "remove": lambda: scheduler.remove("dit"),
     "swap": lambda: swap_away(scheduler)}[end]()
    assert same_state(model, reference)
    assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))


@pytest.mark.fast
def test_an_edit_between_explicit_block_calls_reaches_the_parked_next_block(schedulers):
    """Calling block 0 parks block 1 in its slot; a ``.data`` edit of block 1 made before
    calling it is what block 1 computes with, and is kept."""
    model = ProbeDiT(depth=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    x = probe_input()
    with scheduler.resident("dit") as group:
        layers = group.layers()
        hidden, expected = layers[0](x), reference.blocks[0](x)
        assert group.streams[0].parts[1].state is RESIDENT
        for blocks in (model.blocks, reference.blocks):
            blocks[1].linear.weight.data.mul_(-1)
        hidden, expected = layers[1](hidden), reference.blocks[1](expected)
        assert torch.equal(hidden, expected)
    swap_away(scheduler)
    assert same_state(model, reference)


@pytest.mark.fast
@pytest.mark.parametrize("target", [0, 2], ids=["first-block", "middle-block"])
def test_an_edit_a_block_makes_inside_its_own_forward_survives(schedulers, target):
    model = ProbeDiT(depth=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(0)), reference(probe_input(0)))
    model.blocks[target].scale_in_forward = reference.blocks[target].scale_in_forward = 1.5
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(1)), reference(probe_input(1)))
        assert torch.equal(model(probe_input(2)), reference(probe_input(2)))
    swap_away(scheduler)
    block = scheduler["dit"].streams[0].parts[target]
    weight = model.blocks[target].linear.weight
    assert torch.equal(block.host_master.views[tensor_index(block, weight)],
                       reference.blocks[target].linear.weight)
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(3)), reference(probe_input(3)))
    scheduler.close()
    assert same_state(model, reference)


@pytest.mark.fast
def test_without_edit_detection_a_version_counted_edit_to_the_parked_block_survives(schedulers):
    model = ProbeDiT(depth=3)
    reference = copy.deepcopy(model)
    scheduler = schedulers()
    scheduler.add("dit", model, layers=True, detect_edits=False)
    scheduler.add("other", nn.Linear(4, 4))
    with scheduler.resident("dit"):
        model(probe_input())
    assert scheduler["dit"].streams[0].parts[0].state is RESIDENT
    for module in (model, reference):
        scale_in_place(module.blocks[0].linear.weight)
    swap_away(scheduler)
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(1)), reference(probe_input(1)))
    scheduler.close()
    assert same_state(model, reference)


@pytest.mark.fast
def test_without_edit_detection_mark_dirty_keeps_a_data_edit_to_the_parked_block(schedulers):
    model = ProbeDiT(depth=3)
    reference = copy.deepcopy(model)
    scheduler = schedulers()
    group = scheduler.add("dit", model, layers=True, detect_edits=False)
    scheduler.add("other", nn.Linear(4, 4))
    with scheduler.resident("dit"):
        model(probe_input())
    assert group.streams[0].parts[0].state is RESIDENT
    for module in (model, reference):
        scale_through_data(module.blocks[0].linear.weight)
    group.mark_dirty()  # the documented opt-out's remedy for edits behind the version counter
    swap_away(scheduler)
    assert same_state(model, reference)


class CastingBlock(ProbeBlock):
    """A `ProbeBlock` that computes in its weight's dtype (so it can be re-typed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.linear.weight.dtype
        hidden = x.to(dtype)
        return (hidden + torch.tanh(self.linear(self.norm(hidden)))).to(x.dtype)


def casting_dit(depth: int = 4) -> ProbeDiT:
    model = ProbeDiT(depth=depth)
    for index in range(depth):
        block = CastingBlock(32)
        block.load_state_dict(model.blocks[index].state_dict())
        model.blocks[index] = block
    return model


@pytest.mark.fast
@pytest.mark.parametrize("target", [0, 2], ids=["parked-first-block", "offloaded-block"])
def test_a_block_retyped_between_forwards_is_repacked_and_bit_identical(schedulers, target):
    model = casting_dit()
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        model(probe_input())
    for module in (model, reference):
        module.blocks[target].to(torch.float64)
    for seed in (1, 2, 3):
        with scheduler.resident("dit"):
            assert torch.equal(model(probe_input(seed)), reference(probe_input(seed)))
    block = scheduler["dit"].streams[0].parts[target]
    assert {t.dtype for t in block.host_master.views} == {torch.float64}
    assert scheduler["dit"].streams[0].slot_nbytes >= block.inventory.layout.contiguous_nbytes
    swap_away(scheduler)
    check_all_offloaded(scheduler, "dit")
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input(4)), reference(probe_input(4)))
    scheduler.close()
    assert same_state(model, reference)


@pytest.mark.fast
def test_a_block_left_retyped_by_its_eviction_is_back_in_a_master_at_once(schedulers):
    model = casting_dit()
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        model(probe_input())
    model.blocks[0].to(torch.float64)  # parked in its slot: re-typed there
    with scheduler.resident("dit"):
        model(probe_input(1))
    check_stream(scheduler, "dit")


@pytest.mark.fast
def test_a_diffusers_cache_disabled_while_registered_leaves_the_blocks_streaming(schedulers):
    from diffusers.hooks import FirstBlockCacheConfig

    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    for module in (model, reference):
        module.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    scheduler = layer_scheduler(schedulers, model)
    with torch.no_grad(), scheduler.resident("dit"):
        with model.cache_context("cond"), reference.cache_context("cond"):
            assert torch.equal(run_wan(model, wan_inputs(0)), run_wan(reference, wan_inputs(0)))
    for module in (model, reference):
        module.disable_cache()
    scheduler.block_records.clear()
    with torch.no_grad(), scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
    computed = [r.index for r in scheduler.block_records if r.kind == "compute"]
    assert computed == [0, 1, 2], "the blocks no longer stream"


@pytest.mark.fast
def test_a_diffusers_cache_enabled_and_disabled_after_registration_keeps_streaming(schedulers):
    from diffusers.hooks import FirstBlockCacheConfig

    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    for module in (model, reference):
        module.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    for seed in (0, 1):
        with torch.no_grad(), scheduler.resident("dit"):
            with model.cache_context("cond"), reference.cache_context("cond"):
                assert torch.equal(run_wan(model, wan_inputs(seed)),
                                   run_wan(reference, wan_inputs(seed)))
    for module in (model, reference):
        module.disable_cache()
    assert all(wrapped(block) for block in model.blocks)
    scheduler.block_records.clear()
    with torch.no_grad(), scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))
    assert [r.index for r in scheduler.block_records if r.kind == "compute"] == [0, 1, 2]


@pytest.mark.fast
def test_outside_its_phase_with_another_group_current_a_layer_mode_model_streams_nothing(
    schedulers,
):
    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        run_wan(model, wan_inputs())
    swap_away(scheduler)
    scheduler.block_records.clear()
    with scheduler.resident("other"):  # the blocks call through, on their host masters
        assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
        check_all_offloaded(scheduler, "dit")
    assert len(scheduler.block_records) == 0
    assert all(slot.buffer is None for slot in scheduler._placement.slots.slots)


@pytest.mark.parametrize("target", [0, 2], ids=["parked-first-block", "offloaded-block"])
def test_peft_lora_injected_merged_and_unloaded_on_a_registered_block_is_bit_identical(
    schedulers, target
):
    """peft injects LoRA layers into a block after registration (its structure changes: it is
    re-packed when next loaded), merges them through ``.data``, then unloads them (structure
    again); every forward matches the reference treated the same way."""
    peft = pytest.importorskip("peft")
    model = tiny_wan_expert(num_layers=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    stream = scheduler["dit"].streams[0]
    with scheduler.resident("dit"):
        run_wan(model, wan_inputs(0))
    packed = stream.parts[target].inventory.tensor_count
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"],
                             init_lora_weights=False)
    adapters = []
    for module in (model, reference):
        torch.manual_seed(11)
        adapters.append(peft.get_peft_model(module.blocks[target], config))
    ours, theirs = adapters
    scheduler.block_records.clear()
    # the parked block computes once with the LoRA layers as they are; every block is re-packed
    # when it is next loaded (on demand: a changed block is not prefetched)
    for _ in range(2):
        with scheduler.resident("dit"):
            lora = run_wan(model, wan_inputs(1))
            assert torch.equal(lora, run_wan(reference, wan_inputs(1)))
    block = stream.parts[target]
    assert block.inventory.tensor_count == packed + 8, "the LoRA weights joined the block"
    assert any(r.index == target and r.kind == "load" for r in scheduler.block_records)
    check_stream(scheduler, "dit")
    ours.merge_adapter()  # base_layer.weight.data += delta: no version counter moves
    theirs.merge_adapter()
    with scheduler.resident("dit"):
        merged = run_wan(model, wan_inputs(1))
        assert torch.equal(merged, run_wan(reference, wan_inputs(1)))
    assert torch.allclose(merged, lora, atol=1e-5) and not torch.equal(merged, lora)
    swap_away(scheduler)
    with scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))
    ours.unmerge_adapter()
    theirs.unmerge_adapter()
    with scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))
    ours.merge_and_unload()  # merged again, and the LoRA layers removed: structure again
    theirs.merge_and_unload()
    for _ in range(2):
        with scheduler.resident("dit"):
            assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))
    assert stream.parts[target].inventory.tensor_count == packed
    swap_away(scheduler)
    check_all_offloaded(scheduler, "dit")
    scheduler.close()
    assert same_state(model, reference)
    assert not same_state(model, tiny_wan_expert(num_layers=4)), "the merge changed the weights"


# -- 8. torch.compile ------------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_torch_compile_of_a_layer_mode_dit_is_bit_identical_without_a_recompile_per_block(
    schedulers, fresh_dynamo
):
    model = tiny_wan_expert(num_layers=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    compiled = torch.compile(model, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            with scheduler.resident("dit"):
                ours = compiled(*wan_inputs(seed)[:3], return_dict=False)[0]
            assert torch.equal(ours, run_wan(reference, wan_inputs(seed)))
            graphs = fresh_dynamo["stats"]["unique_graphs"]
            if seed == 0:
                first = graphs
    assert graphs == first, "the second forward compiled again"
    assert graphs < 4 + 2, "a graph per block: the blocks were compiled one by one"
    computed = [r.index for r in scheduler.block_records if r.kind == "compute"]
    assert computed == [0, 1, 2, 3] * 2, "compiled, the blocks still stream"
    swap_away(scheduler)
    with scheduler.resident("dit"):
        assert torch.equal(compiled(*wan_inputs(2)[:3], return_dict=False)[0],
                           run_wan(reference, wan_inputs(2)))


def test_regional_compilation_of_each_block_is_bit_identical_and_compiles_once(
    schedulers, fresh_dynamo
):
    model = tiny_wan_expert(num_layers=4)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    for block in model.blocks:
        block.compile(backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            with scheduler.resident("dit"):
                assert torch.equal(run_wan(model, wan_inputs(seed)),
                                   run_wan(reference, wan_inputs(seed)))
    assert fresh_dynamo["stats"]["unique_graphs"] == 1, "one graph serves every block"
    computed = [r.index for r in scheduler.block_records if r.kind == "compute"]
    assert computed == [0, 1, 2, 3] * 2
    scheduler.close()
    assert not any(wrapped(block) for block in model.blocks)
    assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))


# -- 9. removal, refresh, deep copies --------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("how", ["remove", "close", "remove-while-current"])
def test_removing_the_group_takes_every_block_wrapper_off(schedulers, how):
    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    assert not any("forward" in block.__dict__ for block in model.blocks)
    scheduler = layer_scheduler(schedulers, model)
    assert all(wrapped(block) for block in model.blocks)
    with scheduler.resident("dit"):
        run_wan(model, wan_inputs())
    if how == "remove":
        swap_away(scheduler)
        scheduler.remove("dit")
    elif how == "remove-while-current":
        scheduler.remove("dit")
    else:
        scheduler.close()
    assert not any("forward" in block.__dict__ for block in model.blocks)
    assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
    assert same_state(model, reference)
    # the plain model can be registered again, in layer mode
    again = schedulers()
    again.add("dit", model, layers=True)
    with again.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(2)), run_wan(reference, wan_inputs(2)))


@pytest.mark.fast
def test_a_forward_set_on_a_block_before_or_after_registration_is_kept_on_removal(schedulers):
    model = ProbeDiT(depth=3)
    reference = copy.deepcopy(model)
    calls = []

    def user_forward(block):
        original = block.forward

        def forward(*args, **kwargs):
            calls.append(block)
            return original(*args, **kwargs)
        return forward

    before = user_forward(model.blocks[0])
    model.blocks[0].forward = before  # set by another library before registration
    scheduler = layer_scheduler(schedulers, model)
    after = user_forward(model.blocks[1])
    model.blocks[1].forward = after  # set over ours after registration
    with scheduler.resident("dit"):
        assert torch.equal(model(probe_input()), reference(probe_input()))
    assert calls == [model.blocks[0], model.blocks[1]]
    scheduler.remove("other")
    scheduler.remove("dit")
    assert model.blocks[0].__dict__["forward"] is before
    assert model.blocks[1].__dict__["forward"] is after  # ours, under it, only calls through
    assert "forward" not in model.blocks[2].__dict__
    assert torch.equal(model(probe_input(1)), reference(probe_input(1)))
    assert len(calls) == 4


@pytest.mark.fast
def test_refresh_of_a_layer_mode_group_does_not_stack_block_wrappers(schedulers):
    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit"):
        run_wan(model, wan_inputs())
    assert scheduler["dit"].streams[0].parts[0].state is RESIDENT
    for module in (model, reference):  # an edit in the parked block's slot, then the refresh
        scale_through_data(module.blocks[0].attn2.to_k.weight)
    scheduler.refresh("dit")
    check_all_offloaded(scheduler, "dit")
    for block in model.blocks:
        wrapper = block.__dict__["forward"]
        assert isinstance(wrapper, _BlockForward)
        assert not isinstance(wrapper.method, _BlockForward), "a wrapper over a wrapper"
    with scheduler.resident("dit"):
        assert torch.equal(run_wan(model, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
    computed = [r for r in scheduler.block_records if r.kind == "compute"]
    assert len(computed) == 6, "each block streamed once per forward"
    scheduler.close()
    assert not any("forward" in block.__dict__ for block in model.blocks)


def test_a_deep_copy_made_in_layer_mode_is_a_plain_model_with_its_own_weights(schedulers):
    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy(model)
    scheduler = layer_scheduler(schedulers, model)
    with scheduler.resident("dit") as group:
        run_wan(model, wan_inputs())
        assert group.streams[0].parts[0].state is RESIDENT  # one block in a slot, the rest offloaded
        duplicate = copy.deepcopy(model)
    for original, block in zip(model.blocks, duplicate.blocks, strict=True):
        forward = block.__dict__.get("forward")
        assert not isinstance(forward, _BlockForward)
        assert forward is None or forward.__self__ is block, "a forward bound to the original"
        assert block is not original
    host = [c for name in scheduler for part in
            [scheduler[name], *scheduler[name].parts]
            for c in part.host_master.chunks]
    buffers = host + [s.buffer for s in scheduler._placement.slots.slots if s.buffer is not None]
    for tensor in duplicate.state_dict().values():
        assert not any(within([tensor], b) for b in buffers), "the copy shares our bytes"
    assert torch.equal(run_wan(duplicate, wan_inputs(1)), run_wan(reference, wan_inputs(1)))
    assert len(scheduler.block_records) > 0
    before = len(scheduler.block_records)
    run_wan(duplicate, wan_inputs(1))
    assert len(scheduler.block_records) == before, "the copy streams nothing"
    other = schedulers()
    other.add("copy", duplicate, layers=True)  # the copy belongs to no scheduler
    with other.resident("copy"):
        assert torch.equal(run_wan(duplicate, wan_inputs(2)), run_wan(reference, wan_inputs(2)))
    other.close()
    assert not any(wrapped(block) for block in duplicate.blocks)


# -- 10. mixed modes -------------------------------------------------------------------------------


@pytest.mark.fast
def test_a_module_mode_encoder_phase_leaves_no_block_in_a_slot_and_releases_the_slots(schedulers):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=12, d_model=16, d_kv=4, d_ff=32,
                                          num_layers=1, num_heads=2,
                                          relative_attention_num_buckets=8)).eval()
    model = tiny_wan_expert(num_layers=3)
    reference = copy.deepcopy((encoder, model))
    scheduler = schedulers()
    scheduler.add("text_encoder", encoder)
    scheduler.add("dit", model, layers=True)
    assert not scheduler["text_encoder"].plan.streams
    ids = torch.tensor([[3, 4, 5, 1]])
    for _ in range(2):
        with scheduler.resident("text_encoder") as group:
            with pytest.raises(PhaseError, match=r"module mode"):
                group.layers()
            assert all(slot.buffer is None for slot in scheduler._placement.slots.slots)
            check_all_offloaded(scheduler, "dit")
            context = encoder(ids).last_hidden_state
            assert torch.equal(context, reference[0](ids).last_hidden_state)
        with scheduler.resident("dit"):
            assert torch.equal(run_wan(model, (wan_inputs()[0], wan_inputs()[1], context)),
                               run_wan(reference[1], (wan_inputs()[0], wan_inputs()[1], context)))
            assert all(slot.buffer is not None for slot in scheduler._placement.slots.slots)
            check_all_offloaded(scheduler, "text_encoder")
            check_stream(scheduler, "dit")


@pytest.mark.fast
def test_layer_mode_fits_a_device_memory_limit_that_refuses_module_mode(schedulers):
    model = tiny_wan_expert(num_layers=5)
    reference = copy.deepcopy(model)
    whole = schedulers().add("whole", copy.deepcopy(model)).inventory.layout.contiguous_nbytes
    scheduler = schedulers(device_memory_limit=whole - 1)
    with pytest.raises(RegistrationError, match=r"over device_memory_limit"):
        scheduler.add("dit", model)
    assert "dit" not in scheduler
    group = scheduler.add("dit", model, layers=True)  # the refused call changed nothing
    assert group.device_need < whole
    seen = []
    watch_blocks(model.blocks, scheduler, seen)
    for seed in (0, 1):
        with scheduler.resident("dit"), torch.no_grad():
            assert torch.equal(run_wan(model, wan_inputs(seed)),
                               run_wan(reference, wan_inputs(seed)))
    assert len(seen) == 10 and max(sample for *_, sample in seen) <= whole - 1


# -- 11. typed errors; a refused call changes nothing ----------------------------------------------


def check_untouched(scheduler: Scheduler, model: nn.Module, addresses: list[int]) -> None:
    assert len(scheduler) == 0
    assert ptrs(model.state_dict(keep_vars=True).values()) == addresses
    assert not any("forward" in m.__dict__ for m in model.modules())
    scheduler.add("dit", model, layers=True)  # and registering it properly still works
    with scheduler.resident("dit"):
        model(probe_input())


@pytest.mark.fast
def test_layers_with_the_resident_policy_is_refused(schedulers):
    model = ProbeDiT()
    addresses = ptrs(model.state_dict(keep_vars=True).values())
    scheduler = schedulers()
    with pytest.raises(RegistrationError, match=r"group 'dit': layers= streams the blocks of an "
                                                r"exclusive group, and this group's policy is "
                                                r"'resident'"):
        scheduler.add("dit", model, policy="resident", layers=True)
    check_untouched(scheduler, model, addresses)


@pytest.mark.fast
def test_a_block_plan_of_a_model_outside_the_group_is_refused(schedulers):
    model, stranger = ProbeDiT(), ProbeDiT(seed=1)
    addresses = ptrs(model.state_dict(keep_vars=True).values())
    scheduler = schedulers()
    with pytest.raises(RegistrationError, match=r"the ModelBlocks for 'ProbeDiT' is of a model "
                                                r"outside the group's modules"):
        scheduler.add("dit", model, layers=model_blocks(stranger))
    check_untouched(scheduler, model, addresses)
    assert not any("forward" in m.__dict__ for m in stranger.modules())


@pytest.mark.fast
@pytest.mark.parametrize("layers", [
    "yes",
    [object()],
    2,
], ids=["str", "list-of-object", "int"])
def test_layers_given_something_other_than_true_or_model_blocks_is_refused(schedulers, layers):
    model = ProbeDiT()
    addresses = ptrs(model.state_dict(keep_vars=True).values())
    scheduler = schedulers()
    with pytest.raises(RegistrationError, match=r"give True \(find each module's blocks\) or "
                                                r"ModelBlocks from"):
        scheduler.add("dit", model, layers=layers)
    check_untouched(scheduler, model, addresses)


@pytest.mark.fast
def test_layers_of_a_module_mode_group_is_a_phase_error(schedulers):
    scheduler = schedulers()
    group = scheduler.add("dit", ProbeDiT())
    with pytest.raises(PhaseError, match=r"group 'dit' is in module mode: it has no streamed "
                                         r"layers\. Register it with scheduler\.add\('dit', "
                                         r"model, layers=True\)"):
        group.layers()


@pytest.mark.fast
def test_a_model_without_repeated_blocks_is_refused_by_the_planner(schedulers):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    addresses = ptrs(model.state_dict(keep_vars=True).values())
    scheduler = schedulers()
    with pytest.raises(ConfigError, match=r"Sequential has no list of repeated blocks to stream"):
        scheduler.add("mlp", model, layers=True)
    assert len(scheduler) == 0
    assert ptrs(model.state_dict(keep_vars=True).values()) == addresses
    scheduler.add("mlp", model)  # module mode still takes it


class OnlyBlocks(nn.Module):
    """Every weight inside its repeated blocks: nothing outside them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(ProbeBlock(32) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.fast
def test_a_model_whose_weights_are_all_in_its_blocks_streams(schedulers):
    model = OnlyBlocks()
    reference = copy.deepcopy(model)
    scheduler = schedulers()
    scheduler.add("stack", model, layers=True)
    with scheduler.resident("stack"):
        assert torch.equal(model(probe_input()), reference(probe_input()))


# -- the configured entry points: from_pipeline, enable_offload, the main job ----------------------


def layered_synthetic_size():
    from residency.app.synthetic import SIZES

    return attrs.evolve(SIZES["tiny"], name="tiny-layered", layers=3, text_layers=2)


@pytest.mark.parametrize("components", [["dit"], ["dit", "text_encoder"]],
                         ids=["dit", "dit+text_encoder"])
def test_from_pipeline_runs_layer_mode_bit_identically(components):
    from residency.app.synthetic import SyntheticWan22

    size = layered_synthetic_size()
    plain, pipe = SyntheticWan22.build(size), SyntheticWan22.build(size)
    config = {"mode": "layer", "components": components,
              "layer_options": {"dit": {"resident_layers": 1}}}
    scheduler = Scheduler.from_pipeline(pipe, config, device="cpu")
    pipe.offload = scheduler
    try:
        for name in ("transformer", "transformer_2"):
            plan, = scheduler[name].streams[0].model_blocks
            assert (plan.kept_count, len(plan.streamed)) == (1, 2)
            assert [wrapped(b) for b in getattr(pipe, name).blocks] == [False, True, True]
        for seed in (0, 1):
            assert torch.equal(pipe("a red dog", steps=4, seed=seed),
                               plain("a red dog", steps=4, seed=seed))
        streamed = {record.group for record in scheduler.block_records}
        assert {"transformer", "transformer_2"} <= streamed
    finally:
        scheduler.close()
    assert not any("forward" in m.__dict__ for m in pipe.modules())


@pytest.mark.parametrize("build, call, output", [
    (lambda: tiny_wan22_layered(num_layers=3), wan22_call, "frames"),
    (lambda: tiny_flux_layered(num_layers=2, num_single_layers=2), flux_call, "images"),
], ids=["wan22", "flux"])
def test_enable_offload_in_layer_mode_is_bit_identical_call_by_call(build, call, output):
    from residency.adapters.diffusers import disable_offload, enable_offload

    plain, pipe = build(), build()
    config = {"mode": "layer", "components": ["dit", "text_encoder"],
              "layer_options": {"dit": {"resident_layers": 1}}}
    scheduler = enable_offload(pipe, config, device="cpu")
    dits = [name for name in scheduler if scheduler[name].plan.streams]
    assert dits == [n for n in ("transformer", "transformer_2") if getattr(pipe, n, None)]
    for seed in (0, 1):
        ours = getattr(pipe(**call(seed=seed)), output)
        assert torch.equal(ours, getattr(plain(**call(seed=seed)), output)), f"call {seed}"
    assert {record.group for record in scheduler.block_records} == set(dits)
    disable_offload(pipe)
    assert not any("forward" in block.__dict__ for name in dits
                   for block in getattr(pipe, name).modules())
    assert torch.equal(getattr(pipe(**call(seed=2)), output),
                       getattr(plain(**call(seed=2)), output))


def test_wan22_one_block_experts_stream_by_repeated_blocks_and_the_log_names_the_source(caplog):
    """The tiny Wan2.2's experts hold one block each: finding refuses them (nothing repeats);
    ``WanTransformer3DModel._repeated_blocks`` declares the list, and the log says so."""
    from residency.adapters.diffusers import disable_offload, enable_offload

    plain, pipe = tiny_wan22(), tiny_wan22()
    with caplog.at_level("INFO", logger="residency"):
        scheduler = enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")
    for name in ("transformer", "transformer_2"):
        assert (f"WanPipeline: {name} streams 1 block(s) in layer mode (repeated_blocks): "
                "WanTransformer3DModel declares _repeated_blocks ['WanTransformerBlock'] "
                "(diffusers); streaming the lists that hold them: blocks (1 x WanTransformerBlock)"
                ) in caplog.messages
    for seed in (0, 1):
        assert torch.equal(pipe(**wan22_call(seed=seed)).frames,
                           plain(**wan22_call(seed=seed)).frames), f"call {seed}"
    assert {r.group for r in scheduler.block_records if r.kind == "compute"} == {
        "transformer", "transformer_2"}
    disable_offload(pipe)


def test_the_diffusers_lora_flow_in_layer_mode_is_bit_identical_call_by_call():
    from residency.adapters.diffusers import disable_offload, enable_offload

    plain = lora_flow(tiny_flux_layered())
    pipe = tiny_flux_layered()
    config = {"mode": "layer", "components": ["dit", "text_encoder"],
              "layer_options": {"dit": {"resident_layers": 1}}}
    scheduler = enable_offload(pipe, config, device="cpu")
    offloaded = lora_flow(pipe)
    for index, (ours, theirs) in enumerate(zip(offloaded, plain, strict=True)):
        assert torch.equal(ours, theirs), f"call {index} differs from the pipeline never offloaded"
    assert not torch.equal(plain[2], plain[0]), "the LoRA must change the output"
    written = sum(r.nbytes for r in scheduler.block_records if r.kind == "evict")
    assert written > 0, "the fuse reached the streamed blocks' masters"
    disable_offload(pipe)


def test_the_main_job_runs_layer_mode_bit_identically():
    config = {"mode": "layer", "components": ["dit"],
              "layer_options": {"dit": {"resident_layers": 1}}}
    done = subprocess.run(
        [sys.executable, "-m", "residency", "--size", "small", "--steps", "2",
         "--diffusion-offload-config", json.dumps(config)],
        capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "layer mode:" in done.stdout
    assert "kept 1, streamed 3" in done.stdout
    assert "output: bit-identical to the run without offloading" in done.stdout


@pytest.mark.fast
def test_the_synthetic_tiny_pipeline_streams_its_one_block_experts_bit_identically():
    """The tiny size has one block per expert: each occupies one slot, and the outputs match."""
    from residency.app.synthetic import SyntheticWan22

    plain, pipe = SyntheticWan22.build("tiny"), SyntheticWan22.build("tiny")
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "layer", "components": ["dit"]},
                                        device="cpu")
    pipe.offload = scheduler
    try:
        for seed in (0, 1):
            assert torch.equal(pipe("a red dog", steps=4, seed=seed),
                               plain("a red dog", steps=4, seed=seed)), f"call {seed}"
        computed = [(r.group, r.index) for r in scheduler.block_records if r.kind == "compute"]
        assert set(computed) == {("transformer", 0), ("transformer_2", 0)}
    finally:
        scheduler.close()


@pytest.mark.fast
def test_layer_mode_of_the_vae_alone_warns_that_it_is_swapped_whole_as_module_mode_would(caplog):
    """{"mode": "layer", "components": ["vae"]}: nothing streams; one warning says what happens
    instead, and the call is bit-identical."""
    from residency.adapters.diffusers import disable_offload, enable_offload

    plain, pipe = tiny_wan22(), tiny_wan22()
    with caplog.at_level("INFO", logger="residency"):
        scheduler = enable_offload(pipe, {"mode": "layer", "components": ["vae"]}, device="cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        'WanPipeline: layer mode streams the blocks of DiTs and text encoders, and the config '
        'selects only the VAE: it is swapped whole, exactly as {"mode": "module", "components": '
        '["vae"]} does; add "dit" to stream the DiTs']
    assert scheduler["vae"].exclusive and not scheduler["vae"].streams
    assert torch.equal(pipe(**wan22_call(seed=0)).frames, plain(**wan22_call(seed=0)).frames)
    disable_offload(pipe)


@pytest.mark.fast
def test_layer_mode_with_the_vae_among_dits_notes_it_once(caplog):
    from residency.adapters.diffusers import disable_offload, enable_offload

    pipe = tiny_wan22()
    with caplog.at_level("INFO", logger="residency"):
        enable_offload(pipe, {"mode": "layer", "components": ["dit", "vae"]}, device="cpu")
    assert caplog.messages.count("WanPipeline: the VAE is swapped whole in layer mode (layer mode "
                                 "streams the blocks of DiTs and text encoders only)") == 1
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    disable_offload(pipe)


@pytest.mark.fast
def test_a_block_is_named_alike_in_layer_mode_and_under_an_auto_plan():
    """One name per block in every mode: the group's own name, then the block's path."""
    from residency.adapters.diffusers import disable_offload, enable_offload

    names = {}
    for mode, config in (("layer", {"mode": "layer", "components": ["dit"]}),
                         ("auto", {"mode": "auto", "components": ["dit"],
                                   "auto_options": {"device_budget": "1GiB"}})):
        pipe = tiny_wan22()
        scheduler = enable_offload(pipe, config, device="cpu")
        names[mode] = [part.name for part in scheduler["transformer_2"].plan.parts[1:]]
        disable_offload(pipe)
    assert names["layer"] == names["auto"] == ["transformer_2.blocks.0"]
    scheduler = Scheduler("cpu", auto={"device_budget": "1GiB"})
    scheduler.add("dit", tiny_wan_expert(num_layers=2))
    assert [part.name for part in scheduler["dit"].plan.parts[1:]] == ["dit.blocks.0",
                                                                       "dit.blocks.1"]
    scheduler.close()
