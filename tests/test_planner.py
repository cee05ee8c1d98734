"""The auto planner (residency/auto/planner.py): its choice equals a brute force over every
placement of every part, under the same cost model, and never exceeds the budget."""

from __future__ import annotations

import itertools
import random

import pytest

from residency.core.errors import DeviceMemoryError
from residency.group.plan import Part, Plan, Where
from residency.auto.planner import Workload, choose, predict

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


def _workloads(rng: random.Random, groups: int) -> list[Workload]:
    made = []
    for g in range(groups):
        name = f"g{g}"
        block = rng.choice([3, 5, 8])
        depth = rng.randint(0, 3)
        own = rng.choice([1, 2, 4])
        made.append(Workload(
            name=name, own=(own, own),
            blocks=tuple((f"{name}.b{i}", block, block) for i in range(depth)),
            exclusive=rng.random() > 0.15, entries=rng.randint(1, 2), passes=rng.randint(1, 4),
            compute_seconds=rng.random()))
    return made


def _every_plan(w: Workload):
    owns = (Where.SWAPPED, Where.KEPT) if w.exclusive else (Where.KEPT,)
    blocks = (Where.KEPT, Where.SWAPPED, Where.STREAMED) if w.exclusive else (Where.KEPT,)
    for own in owns:
        for wheres in itertools.product(blocks, repeat=len(w.blocks)):
            parts = [Part(w.name, own)] + [Part(b[0], where) for b, where in zip(w.blocks, wheres)]
            yield Plan(w.name, parts, exclusive=w.exclusive, reuses_buffers=False)


def _brute_force(groups, budget, overlap):
    best = None
    for combination in itertools.product(*(list(_every_plan(w)) for w in groups)):
        plans = {plan.group: plan for plan in combination}
        cost = predict(groups, plans, bandwidth=10.0, overlap=overlap)
        if cost.peak > budget:
            continue
        key = (cost.seconds, cost.nbytes) if overlap else (cost.nbytes, cost.seconds)
        if best is None or key < best:
            best = key
    return best


@pytest.mark.parametrize("overlap", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("seed", range(12))
def test_the_chosen_plan_costs_what_the_brute_force_optimum_costs(seed, overlap):
    rng = random.Random(seed)
    groups = _workloads(rng, rng.randint(2, 3))
    total = sum(w.own[1] + sum(b[2] for b in w.blocks) for w in groups)
    budget = rng.randint(max(1, total // 5), total + 4)
    optimum = _brute_force(groups, budget, overlap)
    if optimum is None:
        with pytest.raises(DeviceMemoryError, match=r"no plan of the groups .* fits a weights "
                                                     r"budget of \d+ bytes"):
            choose(groups, weights_budget=budget, bandwidth=10.0, overlap=overlap)
        return
    plans = choose(groups, weights_budget=budget, bandwidth=10.0, overlap=overlap)
    cost = predict(groups, plans, bandwidth=10.0, overlap=overlap)
    assert cost.peak <= budget
    key = (cost.seconds, cost.nbytes) if overlap else (cost.nbytes, cost.seconds)
    assert key == pytest.approx(optimum)


def test_everything_is_kept_when_it_fits_and_nothing_moves():
    groups = [Workload(name="enc", own=(2, 2), blocks=(("enc.b0", 4, 4),)),
              Workload(name="dit", own=(2, 2),
                       blocks=tuple((f"dit.b{i}", 8, 8) for i in range(3)), passes=10)]
    plans = choose(groups, weights_budget=40, bandwidth=1.0, overlap=False)
    assert all(plan.wholly_kept for plan in plans.values())
    assert predict(groups, plans, bandwidth=1.0, overlap=False).nbytes == 0


def test_a_tight_budget_keeps_what_saves_most_and_streams_only_where_it_must():
    # the DiT runs 10 passes per call: streaming its blocks costs 10x swapping them
    groups = [Workload(name="enc", own=(1, 1), blocks=(("enc.b0", 8, 8),)),
              Workload(name="dit", own=(1, 1),
                       blocks=tuple((f"dit.b{i}", 8, 8) for i in range(4)), passes=10)]
    plans = choose(groups, weights_budget=34, bandwidth=1.0, overlap=False)
    assert plans["dit"].streamed == ()  # swapping fits, so nothing streams
    cost = predict(groups, plans, bandwidth=1.0, overlap=False)
    assert cost.peak <= 34
    # a budget that cannot hold the DiT's blocks together makes them stream
    plans = choose(groups, weights_budget=20, bandwidth=1.0, overlap=False)
    assert plans["dit"].streamed


def test_no_plan_fits_a_budget_below_the_least_any_plan_needs():
    groups = [Workload(name="dit", own=(4, 4), blocks=(("dit.b0", 8, 8), ("dit.b1", 8, 8)))]
    with pytest.raises(DeviceMemoryError, match=r"no plan of the groups \['dit'\] fits a weights "
                                                 r"budget of 10 bytes: the least any plan needs "
                                                 r"is about 20 bytes \(streaming every block it "
                                                 r"can\)\. Raise device_budget, lower headroom, "
                                                 r"or split the largest block"):
        choose(groups, weights_budget=10, bandwidth=1.0, overlap=False)


def _options_by_counts(w: Workload, bandwidth: float, overlap: bool) -> list[tuple]:
    """Every distinct placement of `w` as the cost model counts it, written out here apart from
    the planner: (kept, swapped held, streamed slot, key, whether any streams) per choice of the own part and, per
    size class of blocks, how many are kept (the first) and streamed (the last)."""
    if not w.exclusive:
        kept = w.own[1] + sum(held for _, _, held in w.blocks)
        seconds = w.compute_seconds
        return [(kept, 0, 0, (seconds, 0) if overlap else (0, seconds), False)]
    classes: dict[tuple[int, int], list[int]] = {}
    for index, (_, copied, held) in enumerate(w.blocks):
        classes.setdefault((copied, held), []).append(index)
    choices = [[(k, s) for k in range(len(ix) + 1) for s in range(len(ix) - k + 1)]
               for ix in classes.values()]
    made = []
    for own_kept in (False, True):
        for choice in itertools.product(*choices):
            kept = w.own[1] if own_kept else 0
            swapped, moved = (0, 0) if own_kept else (w.own[1], w.own[0])
            streamed_copied = slot = count = 0
            first = None
            for ((copied, held), ix), (k, s) in zip(classes.items(), choice):
                kept += k * held
                swapped += (len(ix) - k - s) * held
                moved += (len(ix) - k - s) * copied
                if s:
                    streamed_copied += s * copied
                    slot, count = max(slot, held), count + s
                    first = min(first or (ix[len(ix) - s], copied), (ix[len(ix) - s], copied))
            ring = first[1] if count > 1 else 0
            nbytes = w.entries * (moved + ring) + w.passes * streamed_copied
            seconds = w.compute_seconds + nbytes / bandwidth
            made.append((kept, swapped, slot, (seconds, nbytes) if overlap else (nbytes, seconds),
                         count > 0))
    return made


@pytest.mark.parametrize("overlap", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("seed", range(6))
def test_the_pruned_search_finds_the_optimum_of_larger_workloads(seed, overlap):
    """Up to six blocks of two sizes per group, where the search prunes most: its choice costs
    what every combination of every group's options, counted here by the model's own rules,
    costs at best."""
    rng = random.Random(100 + seed)
    groups = []
    for g in range(3):
        sizes = rng.sample([3, 5, 8, 13], k=rng.randint(1, 2))
        groups.append(Workload(
            name=f"g{g}", own=(rng.choice([1, 4]),) * 2,
            blocks=tuple((f"g{g}.b{i}", *(rng.choice(sizes),) * 2)
                         for i in range(rng.randint(2, 6))),
            exclusive=g < 2 or rng.random() > 0.5, entries=rng.randint(1, 2),
            passes=rng.randint(1, 6), compute_seconds=rng.random()))
    total = sum(w.own[1] + sum(b[2] for b in w.blocks) for w in groups)
    budget = rng.randint(total // 3, total)
    best = None
    for combination in itertools.product(*(_options_by_counts(w, 10.0, overlap)
                                           for w in groups)):
        slot = max(option[2] for option in combination)
        peak = sum(o[0] for o in combination) + max(
            o[1] + (2 * slot if o[4] else 0) for o in combination)
        if peak <= budget:
            key = tuple(map(sum, zip(*(o[3] for o in combination))))
            best = key if best is None or key < best else best
    if best is None:
        with pytest.raises(DeviceMemoryError):
            choose(groups, weights_budget=budget, bandwidth=10.0, overlap=overlap)
        return
    cost = predict(groups, choose(groups, weights_budget=budget, bandwidth=10.0,
                                  overlap=overlap), bandwidth=10.0, overlap=overlap)
    assert cost.peak <= budget
    key = (cost.seconds, cost.nbytes) if overlap else (cost.nbytes, cost.seconds)
    assert key == pytest.approx(best)
