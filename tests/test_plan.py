"""A group's plan (residency.group.plan): where each part is, carried out the same way for every
plan, and no layer-mode branch outside the plan and stream files (issue 21)."""

from __future__ import annotations

import ast
import copy
import pathlib

import pytest
import torch
from torch import nn

from residency import Policy, Scheduler, model_blocks
from residency.core.errors import PhaseError, RegistrationError
from residency.group.plan import Part, Plan, Where

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The files that may ask whether a group streams: the plan, the stream, the slots' placement,
#: which blocks a model streams, and the auto planner's cost of each plan.
PLAN_AND_STREAM_FILES = {
    "residency/group/plan.py",
    "residency/auto/planner.py",
    "residency/placement/layers.py",
    "residency/placement/slots.py",
    "residency/modules/blocks.py",
}
#: Attributes that, tested in a branch, ask whether a group is in layer mode.
LAYER_MODE_WORDS = {"blocks", "stream", "streams", "parts", "model_blocks", "streamed"}


class Stack(nn.Module):
    def __init__(self, depth: int = 4, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


# -- the plan as data --------------------------------------------------------------------------


@pytest.mark.fast
def test_module_mode_plans_keep_or_swap_the_own_part():
    swapped = Plan.for_group("dit", Policy.EXCLUSIVE, ())
    kept = Plan.for_group("vae", Policy.RESIDENT, ())
    assert swapped.parts == (Part("dit", Where.SWAPPED),)
    assert kept.own == Part("vae", Where.KEPT)
    assert (swapped.mode, swapped.streams, swapped.prefetchable) == ("module", False, True)
    assert (kept.mode, kept.prefetchable) == ("module", False)
    assert kept.describe() == "vae: own part kept"


@pytest.mark.fast
def test_a_layer_mode_plan_streams_every_block_but_the_kept_ones():
    model = Stack(depth=4)
    blocks = model_blocks(model, path="dit", resident_layers=1)
    plan = Plan.for_group("dit", Policy.EXCLUSIVE, (blocks,))
    assert plan.own == Part("dit", Where.SWAPPED)
    assert plan.streamed == ("dit.blocks.1", "dit.blocks.2", "dit.blocks.3")
    assert (plan.mode, plan.streams, plan.prefetchable) == ("layer", True, False)
    assert plan.describe() == "dit: own part swapped; 3 parts streamed through the block slots"


@pytest.mark.fast
@pytest.mark.parametrize("parts, message", [
    ((), r"a plan for group 'g' begins with the group's own part, named 'g'; it begins with "
         r"'nothing'"),
    ((Part("h", Where.SWAPPED),), r"begins with the group's own part, named 'g'; it begins with 'h'"),
    ((Part("g", Where.STREAMED),), r"group 'g': its own part \(everything outside its blocks\) is "
                                   r"kept or swapped; only blocks stream through the slots"),
    ((Part("g", Where.KEPT), Part("g.b.0", Where.STREAMED)),
     r"group 'g' is kept on the device \(policy 'resident'\), so nothing of it streams or "
     r"swaps; drop its streamed blocks \(layers=\) or use policy='exclusive'"),
    ((Part("g", Where.SWAPPED), Part("g.b.0", Where.STREAMED), Part("g.b.0", Where.STREAMED)),
     r"a plan for group 'g' names a part twice: \['g', 'g.b.0', 'g.b.0'\]"),
], ids=["empty", "other-name", "own-streamed", "resident-streams", "twice"])
def test_a_plan_no_owner_can_carry_out_is_refused_with_what_to_do(parts, message):
    exclusive = parts[:1] != (Part("g", Where.KEPT),)
    with pytest.raises(RegistrationError, match=message):
        Plan("g", parts, exclusive=exclusive)


@pytest.mark.fast
def test_an_auto_plan_places_blocks_apart_kept_swapped_or_streamed():
    blocks = model_blocks(Stack(depth=4), path="dit")
    first = Plan.for_group("dit", Policy.EXCLUSIVE, (blocks,), apart=True)
    assert first.swapped == ("dit.blocks.0", "dit.blocks.1", "dit.blocks.2", "dit.blocks.3")
    assert (first.mode, first.prefetchable, first.wholly_kept) == ("module", False, False)
    plan = first.replace({"dit.blocks.0": Where.KEPT, "dit.blocks.1": Where.KEPT,
                          "dit.blocks.3": Where.STREAMED})
    assert (plan.kept, plan.swapped, plan.streamed) == (
        ("dit.blocks.0", "dit.blocks.1"), ("dit.blocks.2",), ("dit.blocks.3",))
    assert plan.mode == "layer" and plan.where["dit.blocks.2"] is Where.SWAPPED
    assert plan.describe() == ("dit: own part swapped; 2 parts kept apart; 1 parts swapped apart; "
                               "1 parts streamed through the block slots")
    whole = first.replace({name: Where.KEPT for name in first.where})
    assert whole.wholly_kept and not whole.prefetchable
    with pytest.raises(RegistrationError, match=r"group 'dit' has no parts \['dit.blocks.9'\]"):
        first.replace({"dit.blocks.9": Where.KEPT})


# -- carried out -------------------------------------------------------------------------------


@pytest.mark.fast
def test_each_group_carries_its_plan_and_its_streams_hold_the_plans_streamed_parts():
    encoder, dit, vae = Stack(2), Stack(4), Stack(1)
    expected = {name: m(torch.ones(2, 8)) for name, m in
                (("encoder", encoder), ("dit", dit), ("vae", vae))}
    scheduler = Scheduler(device="cpu")
    try:
        scheduler.add("encoder", encoder)
        scheduler.add("dit", dit, layers=model_blocks(dit, path="dit", resident_layers=1))
        scheduler.add("vae", vae, policy="resident")
        plans = {name: scheduler[name].plan for name in scheduler}
        assert plans["encoder"] == Plan.for_group("encoder", Policy.EXCLUSIVE, ())
        assert plans["vae"].own.where is Where.KEPT and scheduler["vae"].is_resident
        assert [p.name for p in scheduler["dit"].parts] == list(plans["dit"].streamed)
        assert scheduler["encoder"].streams == () and scheduler["encoder"].parts == ()
        with pytest.raises(PhaseError, match=r"group 'encoder' is in module mode: it has no "
                                             r"streamed layers\. Register it with "
                                             r"scheduler\.add\('encoder', model, layers=True\)"):
            scheduler["encoder"].layers()
        for name, module in (("encoder", encoder), ("dit", dit)):
            with scheduler.resident(name):
                assert torch.equal(module(torch.ones(2, 8)), expected[name])
        assert torch.equal(vae(torch.ones(2, 8)), expected["vae"])
        # the layer plan's own part loaded into the layer buffer, its parts through the slots
        buffers = scheduler._placement._device_buffers
        assert scheduler["dit"].device_storage is buffers.layer
        assert scheduler["encoder"].device_storage is buffers.exclusive[0]
        kinds = {record.kind for record in scheduler.block_records}
        assert {"prefetch", "evict"} <= kinds
    finally:
        scheduler.close()


def _inside(tensor: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    if buffer is None:
        return False
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()


@pytest.mark.gpu
def test_every_plan_is_carried_out_on_an_accelerator_bit_identically():
    """Module mode (swapped), layer mode (swapped own part, streamed blocks) and a kept group
    on a device with real asynchrony: each output equals the never-offloaded models' on the
    device, and each part's bytes are where its plan says, by data pointer."""
    device = torch.accelerator.current_accelerator()
    torch.manual_seed(0)
    models = {"encoder": Stack(2, 32), "dit": Stack(5, 32), "vae": Stack(1, 32)}
    plain = {name: copy.deepcopy(m).to(device) for name, m in models.items()}
    x = torch.randn(4, 32, device=device)
    scheduler = Scheduler(device)
    try:
        scheduler.add("encoder", models["encoder"].to(device))
        scheduler.add("dit", models["dit"].to(device),
                      layers=model_blocks(models["dit"], path="dit", resident_layers=2))
        scheduler.add("vae", models["vae"].to(device), policy="resident")
        buffers, slots = scheduler._placement._device_buffers, scheduler._placement.slots.slots
        vae = scheduler["vae"]
        for step in range(2):
            with scheduler.resident("encoder"), torch.no_grad():
                assert torch.equal(models["encoder"](x), plain["encoder"](x)), step
                assert _inside(models["encoder"].proj.weight, buffers.exclusive[0].buffer)
            with scheduler.resident("dit") as dit, torch.no_grad():
                assert torch.equal(models["dit"](x), plain["dit"](x)), step
                kept = models["dit"].blocks[1].weight   # a kept block: in the own part
                assert _inside(kept, buffers.layer.buffer)
                assert buffers.exclusive[0].buffer is None  # the other mode's buffers freed
                parked = dit.parts[0].tensors[0]           # the first streamed block, parked
                assert any(_inside(parked, slot.buffer) for slot in slots)
            with torch.no_grad():
                assert torch.equal(models["vae"](x), plain["vae"](x)), step
            assert _inside(models["vae"].proj.weight, vae.device_storage.buffer)
        scheduler.offload_all()  # "dit" stays current after its phase, its first block parked
        for part in (scheduler["encoder"], scheduler["dit"], *scheduler["dit"].parts):
            assert all(any(_inside(t, chunk) for chunk in part.host_master.chunks)
                       for t in part.tensors), f"{part.name} is not on its host master"
    finally:
        scheduler.close()


# -- no layer-mode branch outside the plan and stream files -------------------------------------


def _branch_tests(tree: ast.AST):
    """Every expression a branch tests: if, elif, while, conditional expressions, and the
    conditions of comprehensions."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def layer_mode_branches(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each branch that asks about a group's streaming: a test naming a
    `LAYER_MODE_WORDS` attribute, or an isinstance check against a stream class."""
    found = []
    for test in _branch_tests(ast.parse(source)):
        for node in ast.walk(test):
            streams = isinstance(node, ast.Attribute) and node.attr in LAYER_MODE_WORDS
            kind = (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                    and "Stream" in ast.unparse(node))
            if streams or kind:
                found.append((test.lineno, ast.unparse(test)))
                break
    return found


def test_no_layer_mode_branch_outside_the_plan_and_stream_files():
    """Issue 21: owners carry out plans; none of them asks whether a group streams."""
    offenders = []
    for path in sorted((ROOT / "residency").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in PLAN_AND_STREAM_FILES:
            continue
        offenders += [f"{relative}:{line}: {text}"
                      for line, text in layer_mode_branches(path.read_text())]
    assert not offenders, "branches on layer mode outside the plan and stream files:\n" + \
        "\n".join(offenders)


@pytest.mark.fast
@pytest.mark.parametrize("source", [
    "if group.blocks is not None:\n    pass\n",
    "x = 1 if group.stream.parts else 2\n",
    "while self.plan.streams:\n    break\n",
    "y = [g for g in groups if g.model_blocks]\n",
    "if isinstance(group.stream, BlockStream):\n    pass\n",
])
def test_the_branch_reader_finds_each_kind_of_layer_mode_branch(source):
    assert layer_mode_branches(source), source


@pytest.mark.fast
def test_the_branch_reader_leaves_plan_reads_that_are_not_branches():
    source = ("inventory = packer.inventory(roots, allow_empty=plan.streams)\n"
              "if prefetched.plan.mode != group.plan.mode:\n    pass\n")
    assert layer_mode_branches(source) == []


@pytest.mark.fast
def test_the_plan_and_stream_files_exist():
    assert all((ROOT / path).is_file() for path in PLAN_AND_STREAM_FILES)
