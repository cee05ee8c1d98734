"""Under an auto plan the other guarantees hold (issue 22): a KeyboardInterrupt at any line of a
phase change, of a re-plan or of a registration loses and wedges nothing; every edit survives,
in kept, swapped and streamed parts; the ranks of a node share one master per part and choose
the same plan.  The sweeps are `tests/_interrupts.py`'s, on `World`s whose scheduler plans by a
budget that gives the DiT-shaped group kept, swapped or streamed blocks."""

from __future__ import annotations

import copy

import pytest
import torch

from residency import Scheduler
from residency.group.plan import Where

from _interrupts import assert_consistent, sweep
from test_interrupts import World, _entered

#: The strides of the sweeps (``pytest --sweep=full``: every point).  Each line's first and
#: last execution is not added in CI: 850-1800 more points a sweep at ~50 ms each.
STRIDES = {"phase-change": 7, "replan": 31, "registration": 29}


@pytest.fixture
def stride():
    return lambda operation: STRIDES[operation]


#: Budgets (bytes, no headroom) for the tiny models "a" (an MLP) and "t" (a DiT of 3 blocks):
#: with these, t's plan keeps its own part and some blocks and swaps or streams the rest.
STREAMING, PARTLY_KEPT, MOSTLY_KEPT = 1200, 1600, 2000


class AutoWorld(World):
    """`World` with an auto scheduler of `budget` bytes (its tiny models, twins and checks)."""

    def __init__(self, names=("a", "t"), *, budget: int = PARTLY_KEPT) -> None:
        super().__init__(names)
        self.scheduler.close()
        self.scheduler = Scheduler("cpu", wait_timeout=10.0,
                                   auto={"device_budget": budget, "headroom": 0})

    def add(self, *names: str) -> AutoWorld:
        for name in names:  # the group decides its blocks: no layers=
            self.scheduler.add(name, self.models[name])
        return self

    def call(self) -> None:
        """One call: "a", then "t" twice in one phase, then "a" begins the next."""
        with self.scheduler.resident("a"):
            self.run("a")
        with self.scheduler.resident("t"):
            self.run("t")
            self.run("t")


def _observed(budget: int):
    """A world after its first call was observed and planned for, t's blocks edited in place
    through ``.data`` while it ran (only the digests see it)."""
    def build():
        world = AutoWorld(budget=budget).add("a", "t")
        world.call()
        world.call()
        world.call()  # the plans after the first and the second call's observation are in force
        phase = _entered(world, "t")
        world.edit("t")
        phase.__exit__(None, None, None)
        return world
    return build


def _shape(budget: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    world = _observed(budget)()
    plan = world.scheduler["t"].plan
    world.scheduler.close()
    return plan.kept, plan.swapped, plan.streamed


@pytest.mark.fast
def test_the_budgets_give_the_shapes_the_sweeps_need():
    kept, swapped, streamed = _shape(PARTLY_KEPT)
    assert kept and swapped and not streamed
    kept, swapped, streamed = _shape(STREAMING)
    assert streamed


@pytest.mark.parametrize("budget", [PARTLY_KEPT, STREAMING], ids=["partly-kept", "streaming"])
@pytest.mark.beside
def test_a_phase_change_under_an_auto_plan(budget, stride):
    """Leave the edited, partly kept (or streaming) "t" for "a", run, come back: interrupted at
    every line (every 7th in CI), nothing is lost and the owners agree."""
    def change(world):
        with world.scheduler.resident("a"):
            world.run("a")
        with world.scheduler.resident("t"):
            world.run("t")

    assert sweep(_observed(budget), change, World.check, stride=stride("phase-change"),
                 every_line=False) > 100


def test_a_re_plan_for_a_new_budget(stride):  # in the parent: it balances the two cores
    """`set_device_budget` from a partly kept plan to a streaming one and back: every line
    (every 31st in CI)."""
    def replan(world):
        world.scheduler.set_device_budget(STREAMING)
        world.scheduler.set_device_budget(MOSTLY_KEPT)

    assert sweep(_observed(PARTLY_KEPT), replan, World.check, stride=stride("replan"),
                 every_line=False) > 100


@pytest.mark.beside
def test_a_registration_that_re_plans(stride):
    """Adding "t" to a scheduler that holds "a": the registration and the re-plan it makes."""
    def add(world):
        world.add("t")

    assert sweep(lambda: AutoWorld().add("a"), add, World.check,
                 stride=stride("registration"), every_line=False) > 100


@pytest.mark.fast
def test_edits_to_kept_swapped_and_streamed_parts_survive_calls_re_plans_and_close():
    for budget in (PARTLY_KEPT, STREAMING):
        world = _observed(budget)()
        scheduler = world.scheduler
        with scheduler.resident("a"):  # "t" leaves: kept blocks stay, the rest goes home
            world.run("a")
            world.edit("t", factor=0.5)  # while "t" is not current: kept parts on the device
        world.call()
        with scheduler.resident("t"):
            assert torch.equal(world.run("t"), world.expected("t"))
            world.edit("t", factor=3.0)
        scheduler.set_device_budget(MOSTLY_KEPT)  # parts move between kept, swapped, streamed
        world.call()
        with scheduler.resident("t"):
            assert torch.equal(world.run("t"), world.expected("t"))
        assert_consistent(scheduler)
        scheduler.close()
        world.check_closed()


@pytest.mark.fast
def test_kept_blocks_really_stay_on_the_device_storage_between_phases():
    world = _observed(PARTLY_KEPT)()
    scheduler = world.scheduler
    t = scheduler["t"]
    kept = [part for part in t.apart if t.plan.where[part.name] is Where.KEPT]
    before = {part.name: part.device_storage.buffer.data_ptr() for part in kept}
    moved = scheduler.transitions.nbytes
    with scheduler.resident("a"):
        world.run("a")
    with scheduler.resident("t"):
        world.run("t")
    assert {part.name: part.device_storage.buffer.data_ptr() for part in kept} == before
    loaded = scheduler.transitions.nbytes - moved
    swapped = [part for part in t.apart if t.plan.where[part.name] is Where.SWAPPED]
    assert t.plan.own.where is Where.KEPT and swapped
    assert loaded == scheduler["a"].inventory.layout.nbytes + sum(  # a, then t's swapped parts
        part.inventory.layout.nbytes for part in swapped)
    scheduler.close()


class _QuantizedDiT(torch.nn.Module):
    """test_subclasses' DiT-like blocks (torchao int8 weight-only) in a block list."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        from test_subclasses import _Block

        self.proj_in = torch.nn.Linear(32, 64)
        self.blocks = torch.nn.ModuleList(_Block(64) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return x


def _quantized(seed: int) -> torch.nn.Module:
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(seed)
    model = _QuantizedDiT().to(torch.bfloat16).eval()
    quantize_(model, Int8WeightOnlyConfig())
    return model


@pytest.mark.fast
@pytest.mark.parametrize("fraction", [0.45, 0.8], ids=["streaming", "partly-kept"])
def test_torchao_int8_blocks_under_an_auto_plan_are_bit_identical_and_move_the_int8_bytes(
        fraction):
    model, reference = _quantized(0), _quantized(0)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    other = torch.nn.Linear(8, 8)
    nbytes = sum(t.nbytes for t in model.state_dict().values())  # wrappers: their inner bytes
    scheduler = Scheduler("cpu", auto={"device_budget": int(nbytes * fraction), "headroom": 0})
    try:
        dit = scheduler.add("dit", model)
        scheduler.add("other", other)
        with torch.no_grad():
            for step in range(4):
                with scheduler.resident("dit"):
                    assert torch.equal(model(x + step), reference(x + step)), step
                with scheduler.resident("other"):
                    other(torch.ones(8))
        assert dit.plan.kept or dit.plan.streamed, dit.plan.describe()
        measured, predicted = scheduler.plan.measured[-1].nbytes, scheduler.plan.predicted.nbytes
        assert measured == predicted
        assert dit.nbytes < 0.6 * sum(p.numel() * 2 for p in reference.parameters())  # int8 bytes
    finally:
        scheduler.close()


def test_torch_compile_of_a_dit_under_an_auto_plan_is_bit_identical_without_recompiling():
    from test_layer_mode import run_wan, tiny_wan_expert, wan_inputs

    torch._dynamo.reset()
    model = tiny_wan_expert(num_layers=4)
    reference = copy.deepcopy(model)
    other = torch.nn.Linear(8, 8)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    scheduler = Scheduler("cpu", auto={"device_budget": int(nbytes * 0.85), "headroom": 0})
    try:
        scheduler.add("dit", model)
        scheduler.add("other", other)
        compiled = torch.compile(model, backend="eager")
        for seed in range(4):
            if seed == 2:  # the plan made after the first call is in force from here
                context = torch._dynamo.config.patch(error_on_recompile=True)
                context.__enter__()
            with scheduler.resident("dit"), torch.no_grad():
                ours = compiled(*wan_inputs(seed)[:3], return_dict=False)[0]
            assert torch.equal(ours, run_wan(reference, wan_inputs(seed))), seed
            with scheduler.resident("other"):
                pass
        context.__exit__(None, None, None)
        plan = scheduler["dit"].plan
        assert plan.kept and plan.streamed, plan.describe()  # kept blocks beside streamed ones
    finally:
        scheduler.close()
        torch._dynamo.reset()
