"""Co-tenants (issue 48): an auto plan gives way when another program takes device memory, and
grows back when it is returned ([Note: co-tenants] in residency/auto/room.py).

The arithmetic of the decision runs in the fast tier; the rest on the simulated device (its
``capacity`` control bounds what its allocator may reserve, and ``get_memory_info`` reports
capacity less reserved, as CUDA reports the device's free memory): a co-tenant is a tensor of
this process that the scheduler does not own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from residency import Scheduler
from residency.auto.room import GROW_BY, Room, resize

from _interrupts import assert_consistent, sweep

MiB = 2**20
WIDTH = 256  # a 256 KiB weight per block: the groups are a few MiB
#: Every how many line events the co-tenant sweep interrupts: each line at its first and last
#: execution (``--sweep=lines``: 1,135 points) takes about 70 s on the simulated device.
SWEEP_STRIDE = 50
#: The swept pipeline: as small as still makes the re-plan move parts of every kind.
SWEPT_DEPTHS = (("text_encoder", 1), ("high_noise", 2), ("low_noise", 2), ("vae", 1))


# -- the decision (fast) -----------------------------------------------------------------------


@pytest.mark.fast
def test_a_plan_that_still_fits_beside_the_headroom_stays():
    room = Room(free=10 * MiB, cached=0, held=20 * MiB)
    assert resize(room, peak=20 * MiB, budget=40 * MiB, configured=40 * MiB,
                  headroom=4 * MiB) is None


@pytest.mark.fast
def test_a_co_tenant_that_leaves_less_than_the_headroom_shrinks_the_budget_to_the_room():
    room = Room(free=1 * MiB, cached=1 * MiB, held=20 * MiB)  # the cache is ours to reuse
    budget, reason = resize(room, peak=20 * MiB, budget=40 * MiB, configured=40 * MiB,
                            headroom=4 * MiB)
    assert budget == 22 * MiB  # what is held and what is free: 4 MiB of it stays free
    assert reason == ("the device had 2.0 MiB free (its cache included) where the plan needed "
                      "0 B more and the headroom 4.0 MiB: planned within 22.0 MiB of the 40.0 "
                      "MiB budget, as a co-tenant holds the rest")


@pytest.mark.fast
def test_what_the_plan_still_has_to_allocate_counts():
    room = Room(free=10 * MiB, cached=0, held=5 * MiB)
    assert resize(room, peak=12 * MiB, budget=40 * MiB, configured=40 * MiB,
                  headroom=3 * MiB) is None  # 7 MiB more and 3 of headroom fit in 10
    budget, _ = resize(room, peak=12 * MiB, budget=40 * MiB, configured=40 * MiB,
                       headroom=3 * MiB + 1)
    assert budget == 15 * MiB


@pytest.mark.fast
def test_a_squeezed_plan_grows_back_only_by_more_than_noise_and_never_past_its_budget():
    held, configured = 20 * MiB, 100 * MiB
    grow = int(GROW_BY * configured)
    just_below = Room(free=24 * MiB + grow - 1, cached=0, held=held)
    assert resize(just_below, peak=held, budget=44 * MiB, configured=configured,
                  headroom=4 * MiB) is None
    enough = Room(free=24 * MiB + grow, cached=0, held=held)
    budget, reason = resize(enough, peak=held, budget=44 * MiB, configured=configured,
                            headroom=4 * MiB)
    assert budget == 44 * MiB + grow
    assert reason.startswith("device memory came back (29.0 MiB free, its cache included): "
                             "planned within 49.0 MiB of the 100.0 MiB budget")
    plenty = Room(free=500 * MiB, cached=0, held=held)
    assert resize(plenty, peak=held, budget=44 * MiB, configured=configured,
                  headroom=4 * MiB)[0] == configured
    assert resize(plenty, peak=held, budget=configured, configured=configured,
                  headroom=4 * MiB) is None  # at its budget: nothing to grow to


# -- on the simulated device -------------------------------------------------------------------


class _Probe:
    """Reads the device's free memory wherever the model calls it."""

    def __init__(self) -> None:
        self.free: list[int] = []

    def __call__(self) -> None:
        self.free.append(torch.accelerator.get_memory_info()[0])


class _Block(nn.Module):
    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self._probe = [probe]

    def forward(self, x):
        self._probe[0]()
        return torch.tanh(self.linear(x))


DEPTHS = (("text_encoder", 3), ("high_noise", 6), ("low_noise", 6), ("vae", 1))


def _models(probe: _Probe, depths=DEPTHS) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {name: nn.Sequential(*[_Block(probe) for _ in range(depth)])
            for name, depth in depths}


def _call(models, x, scheduler=None):
    phase = scheduler.resident if scheduler is not None else (lambda name: torch.no_grad())
    outputs = []
    with torch.no_grad():
        with phase("text_encoder"):
            h = models["text_encoder"](x)
        for step in range(4):
            expert = "high_noise" if step < 2 else "low_noise"
            with phase(expert):
                h = models[expert](h)
            outputs.append(h)
        with phase("vae"):
            outputs.append(models["vae"](h))
    return outputs


def _weights(models) -> int:
    return sum(p.nbytes for m in models.values() for p in m.parameters())


def _world(device, headroom: int, budget: int | None = None, depths=DEPTHS):
    """An auto scheduler whose budget holds everything with room to spare, the never-offloaded
    twin's outputs, and the capacity the device is given: what it holds now plus the budget."""
    probe = _Probe()
    models = _models(probe, depths)
    plain = {name: copy.deepcopy(m).to(device) for name, m in models.items()}
    x = torch.randn(4, WIDTH, device=device)
    expected = _call(plain, x)
    del plain
    budget = 2 * _weights(models) if budget is None else budget
    scheduler = Scheduler(device, auto={"device_budget": budget, "headroom": headroom})
    for name in ("text_encoder", "high_noise", "low_noise"):
        scheduler.add(name, models[name].to(device), detect_edits=False)
    scheduler.add("vae", models["vae"].to(device), policy="resident", detect_edits=False)
    return scheduler, models, probe, x, expected


def _same(outputs, expected) -> bool:
    return all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


@pytest.mark.gpu
def test_a_plan_gives_way_to_a_co_tenant_and_grows_back_when_it_leaves():
    device = torch.accelerator.current_accelerator()
    import simdevice

    if not simdevice.get_controls()["memory_info"]:
        pytest.skip("needs the simulated device's memory info")
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    headroom = 2 * MiB
    capacity = torch.accelerator.memory_reserved() + 64 * MiB
    with simdevice.controls(capacity=capacity):
        scheduler, models, probe, x, expected = _world(device, headroom)
        try:
            for _ in range(2):
                assert _same(_call(models, x, scheduler), expected)
            plan = scheduler.plan
            assert plan.predicted.nbytes == 0 and scheduler.calls[-1].nbytes == 0  # all kept
            torch.accelerator.synchronize()
            torch.accelerator.empty_cache()  # the scheduler's freed blocks: not room to give
            free = torch.accelerator.get_memory_info()[0]
            hog = torch.empty(free - headroom // 2, dtype=torch.uint8, device=device)
            assert torch.accelerator.get_memory_info()[0] < headroom  # the co-tenant's doing
            probe.free = []
            assert _same(_call(models, x, scheduler), expected)
            squeezed = scheduler.plan
            assert min(probe.free) >= headroom, (min(probe.free), headroom)
            assert squeezed.budget < plan.budget
            assert "a co-tenant holds the rest" in squeezed.reason
            assert squeezed.reason in squeezed.describe().splitlines()[0]
            assert squeezed.predicted.peak <= squeezed.budget - headroom
            for _ in range(2):  # the squeezed plan holds, the headroom free in every forward
                probe.free = []
                assert _same(_call(models, x, scheduler), expected)
                assert min(probe.free) >= headroom
            del hog
            torch.accelerator.empty_cache()  # the co-tenant leaves
            for _ in range(3):
                assert _same(_call(models, x, scheduler), expected)
            assert scheduler.plan.budget == plan.budget
            assert scheduler.plan.predicted.nbytes == 0 and scheduler.calls[-1].nbytes == 0
        finally:
            scheduler.close()


@pytest.mark.gpu
def test_an_interrupt_anywhere_in_a_re_plan_a_co_tenant_caused_loses_nothing():
    """The first phase after a co-tenant took the headroom re-plans and switches; interrupted
    at every `SWEEP_STRIDE`-th line event (``--sweep=full``: at each), the owners agree, and the
    next calls run bit-identical with the headroom free."""
    device = torch.accelerator.current_accelerator()
    import simdevice

    headroom = MiB  # the swept pipeline holds 1.5 MiB: the re-plan keeps 1 MiB of it
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    capacity = torch.accelerator.memory_reserved() + 64 * MiB
    hogs = []

    def build():
        hogs.clear()
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        world = _world(device, headroom, depths=SWEPT_DEPTHS)
        scheduler, models, _, x, expected = world
        assert _same(_call(models, x, scheduler), expected)
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        free = torch.accelerator.get_memory_info()[0]
        hogs.append(torch.empty(free - headroom // 2, dtype=torch.uint8, device=device))
        return world

    def operation(world):
        scheduler, models, _, x, _ = world
        with torch.no_grad(), scheduler.resident("text_encoder"):
            models["text_encoder"](x)

    def check(world):
        scheduler, models, probe, x, expected = world
        try:
            assert_consistent(scheduler)
            probe.free = []
            assert _same(_call(models, x, scheduler), expected)
            assert min(probe.free) >= headroom
        finally:
            scheduler.close()

    with simdevice.controls(capacity=capacity):
        assert sweep(build, operation, check, stride=SWEEP_STRIDE, every_line=False) > 100


@pytest.mark.gpu
def test_a_room_no_plan_fits_keeps_the_plan_and_says_so_once(caplog):
    """A co-tenant takes nearly everything: no plan fits what is left.  The plan in force stays
    (its groups all on the device, the phases still run: nothing has to be allocated), with one
    warning, not one per switch; once the co-tenant leaves, nothing more is said and the calls
    run bit-identical."""
    import logging

    device = torch.accelerator.current_accelerator()
    import simdevice

    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    headroom = 8 * MiB  # more than the weights: with the room theirs, nothing is left for them
    capacity = torch.accelerator.memory_reserved() + 64 * MiB
    with simdevice.controls(capacity=capacity):
        scheduler, models, _, x, expected = _world(device, headroom, budget=32 * MiB)
        try:
            for _ in range(2):
                assert _same(_call(models, x, scheduler), expected)
            plan = scheduler.plan
            torch.accelerator.synchronize()
            torch.accelerator.empty_cache()
            hog = torch.empty(torch.accelerator.get_memory_info()[0] - WIDTH * WIDTH,
                              dtype=torch.uint8, device=device)
            with caplog.at_level(logging.WARNING, logger="residency"):
                assert _same(_call(models, x, scheduler), expected)  # three switches
                kept = [r.getMessage() for r in caplog.records
                        if r.getMessage().startswith("auto plan kept: ")]
                assert len(kept) == 1, kept
                assert "planned within" in kept[0] and "no plan of the groups" in kept[0]
                assert scheduler.plan.plans == plan.plans  # kept (its prediction renewed)
                assert scheduler.plan.budget == plan.budget
                del hog
                torch.accelerator.synchronize()  # its block is free once the device is done
                torch.accelerator.empty_cache()
                for _ in range(2):
                    assert _same(_call(models, x, scheduler), expected)
            assert len([r for r in caplog.records
                        if r.getMessage().startswith("auto plan kept: ")]) == 1
        finally:
            scheduler.close()
