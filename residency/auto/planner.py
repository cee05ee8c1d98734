"""The auto planner: the plans of every group that cost least per call within a device budget.

    groups = [Workload(name="encoder", own=(8, 8), blocks=(), entries=1, passes=1), ...]
    plans = choose(groups, weights_budget=38 * 2**30, bandwidth=25e9, overlap=True)
    cost = predict(groups, plans, bandwidth=25e9, overlap=True)    # bytes, seconds, peak per call

Pure arithmetic over the groups' parts and what one call does (no scheduler state: the auto
scheduler, `residency.auto.auto`, measures the inputs and carries out the answer).

[Note: the cost model]
A call is one pass through the phase order (`Workload.entries`: how many times a call switches
to the group; `Workload.passes`: how many forwards of its model a call runs).  For each group the
plan says of its own part and of each block: kept, swapped or streamed (`residency.group.plan`).

* Bytes moved host to device per call: a swapped byte moves at each entry; a streamed block at
  each pass, and the first streamed block once more per entry (the ring prefetch that the last
  block of the last pass issues before the group leaves: `residency.placement.layers`), unless a
  single block streams (it has no other block to prefetch it); a kept byte never.  These are the
  bytes the records show (`Scheduler.transitions`, `Scheduler.block_records`).
* Device bytes while group g runs: every kept byte of every group, plus g's swapped bytes (each
  part in a storage of its own), plus two block slots when g streams, each the size of the
  largest streamed block of any group (the slots are shared).  A phase change evicts before it
  loads, so the peak of a call is the largest of these; it must be at most the weights budget
  (the device budget less the headroom).
* Seconds per call: the host's seconds outside the groups' phases, the groups' compute (both
  measured: [Note: the time model] in `residency.auto.auto`), plus every byte moved at the
  measured copy bandwidth.  A streamed block's copy is issued while the block before it
  computes, but no overlap is credited: on the simulated accelerator, plans chosen for the copy
  time compute would hide ran slower than plans moving fewer bytes - a block's wait, its digests
  and the ring's extra copy cost more than the model saw (benchmarks/README.md, "Auto plans").  So the predicted time grows with the bytes,
  and crediting overlap waits for a per-block measure of it.
* The objective: with `overlap` (an accelerator), least seconds, then fewest bytes; without (the
  CPU, where a copy is the time), fewest bytes, then least seconds.

The search is exact for this model: blocks of the same size are interchangeable, so each group's
choices are counted per size class (how many kept, how many streamed); for each size of the slots
and each bound on what a phase adds to the kept bytes, each group's best choices for every amount
it keeps form a Pareto front, and the fronts are merged under the budget.  tests/test_planner.py
checks it against a brute force over every placement of every part.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import attrs

from residency.core.errors import DeviceMemoryError
from residency.group.plan import Part, Plan, Where

__all__ = ["Cost", "Workload", "choose", "predict"]


@attrs.frozen(kw_only=True)
class Workload:
    """One group as the planner sees it: its parts' bytes and what one call does with it."""

    name: str
    #: The own part: (bytes copied at a load, bytes its device storage holds).
    own: tuple[int, int]
    #: Each block planned apart: (name, bytes copied, bytes held), in the model's order.
    blocks: tuple[tuple[str, int, int], ...] = ()
    #: Whether phases swap the group (policy 'exclusive'); a 'resident' group is kept whole.
    exclusive: bool = True
    #: How many times one call switches to the group from another.
    entries: int = 1
    #: How many forwards of the group's model one call runs (its blocks' passes).
    passes: int = 1
    #: Seconds of compute one call spends in the group's phases.
    compute_seconds: float = 0.0


@attrs.frozen(order=True)
class Cost:
    """What a set of plans costs per call, by the cost model (see [Note: the cost model])."""

    nbytes: int
    seconds: float
    #: The most device bytes of weights at any instant of the call.
    peak: int


def predict(groups: Sequence[Workload], plans: Mapping[str, Plan], *, bandwidth: float,
            overlap: bool, host_seconds: float = 0.0) -> Cost:
    """The cost of `plans` (one per group, by name) for `groups`; `host_seconds` per call
    outside the groups' phases are added to the seconds."""
    slot = max((held for w in groups for name, _, held in w.blocks
                if plans[w.name].where[name] is Where.STREAMED), default=0)
    kept, locals_, nbytes, seconds = 0, [0], 0, host_seconds
    for w in groups:
        option = _Option.of(w, plans[w.name], bandwidth, overlap)
        kept += option.kept
        locals_.append(option.local(slot))
        nbytes += option.nbytes
        seconds += option.seconds
    return Cost(nbytes, seconds, kept + max(locals_))


def choose(groups: Sequence[Workload], *, weights_budget: int, bandwidth: float,
           overlap: bool) -> dict[str, Plan]:
    """The plans of least cost whose peak is within `weights_budget` (see the module
    docstring); raises `DeviceMemoryError` when no plan fits, saying how much would."""
    if not groups:
        return {}
    options = {w.name: list(_options(w, bandwidth, overlap)) for w in groups}
    slots = sorted({o.slot for opts in options.values() for o in opts})
    best: tuple | None = None
    for slot in slots:
        fitting = {name: [o for o in opts if o.slot <= slot] for name, opts in options.items()}
        bounds = sorted({o.local(slot) for opts in fitting.values() for o in opts})
        for bound in bounds:
            room = weights_budget - bound
            if room < 0:
                break
            found = _best_within(fitting, slot, bound, room, overlap)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
            if best is not None and _moves_nothing(best[1]):
                break  # nothing moved: no plan costs less (seconds grow with bytes), stop here
        if best is not None and _moves_nothing(best[1]):
            break
    if best is None:
        raise DeviceMemoryError(_nothing_fits(groups, options, weights_budget))
    return {option.group: option.plan for option in best[1]}


@attrs.frozen(kw_only=True)
class _Option:
    """One way to place one group: its plan and what it costs (see [Note: the cost model])."""

    group: str
    plan: Plan
    #: Device bytes it keeps while other groups run.
    kept: int
    #: Device bytes its phase adds to the kept ones, slots aside.
    swapped: int
    #: Whether blocks stream (its phase needs the two slots).
    streams: bool
    #: The largest streamed block's held bytes (0: none streams).
    slot: int
    nbytes: int
    seconds: float

    def local(self, slot: int) -> int:
        return self.swapped + (2 * slot if self.streams else 0)

    def key(self, overlap: bool) -> tuple:
        return (self.seconds, self.nbytes) if overlap else (self.nbytes, self.seconds)

    @classmethod
    def of(cls, w: Workload, plan: Plan, bandwidth: float, overlap: bool) -> _Option:
        where = plan.where
        own_copied, own_held = w.own
        kept = own_held if where[w.name] is Where.KEPT else 0
        swapped_held = own_held - kept
        swapped_copied = 0 if kept else own_copied
        streamed = [(c, h) for name, c, h in w.blocks if where[name] is Where.STREAMED]
        for name, copied, held in w.blocks:
            if where[name] is Where.KEPT:
                kept += held
            elif where[name] is Where.SWAPPED:
                swapped_held, swapped_copied = swapped_held + held, swapped_copied + copied
        streamed_copied = sum(c for c, _ in streamed)
        ring = streamed[0][0] if len(streamed) > 1 else 0
        nbytes = w.entries * (swapped_copied + ring) + w.passes * streamed_copied
        seconds = w.compute_seconds + nbytes / bandwidth  # no overlap credited: see the Note
        return cls(group=w.name, plan=plan, kept=kept, swapped=swapped_held,
                   streams=bool(streamed), slot=max((h for _, h in streamed), default=0),
                   nbytes=nbytes, seconds=seconds)


def _options(w: Workload, bandwidth: float, overlap: bool) -> Iterable[_Option]:
    """Every distinct way to place `w`: the own part kept or swapped; in each size class of
    its blocks, how many are kept (the first ones) and how many streamed (the last ones)."""
    if not w.exclusive:  # kept whole
        names = (w.name, *(name for name, _, _ in w.blocks))
        kept = Plan(w.name, [Part(name, Where.KEPT) for name in names], exclusive=False,
                    reuses_buffers=False)
        yield _Option.of(w, kept, bandwidth, overlap)
        return
    base = Plan(w.name, [Part(w.name, Where.SWAPPED)]
                + [Part(name, Where.SWAPPED) for name, _, _ in w.blocks], reuses_buffers=False)
    classes: dict[tuple[int, int], list[str]] = {}
    for name, copied, held in w.blocks:
        classes.setdefault((copied, held), []).append(name)
    splits = [[(k, s) for k in range(len(names) + 1) for s in range(len(names) - k + 1)]
              for names in classes.values()]
    for own in (Where.SWAPPED, Where.KEPT):
        for choice in itertools.product(*splits):
            where = {w.name: own}
            for names, (k, s) in zip(classes.values(), choice):
                where.update({name: Where.KEPT for name in names[:k]})
                where.update({name: Where.STREAMED for name in names[len(names) - s:]})
            yield _Option.of(w, base.replace(where), bandwidth, overlap)


def _best_within(fitting: Mapping[str, list[_Option]], slot: int, bound: int, room: int,
                 overlap: bool) -> tuple | None:
    """The least-cost choice of one option per group with every phase within `bound` over the
    kept bytes and the kept bytes within `room`: ((key, peak), options), or None."""
    fronts = []
    for opts in fitting.values():
        usable = [o for o in opts if o.local(slot) <= bound and o.kept <= room]
        if not usable:
            return None
        fronts.append(_front([((o.kept,), o.key(overlap), (o,)) for o in usable]))
    merged = fronts[0]
    for front in fronts[1:]:
        merged = _front([((a[0][0] + b[0][0],), _add(a[1], b[1]), a[2] + b[2])
                         for a in merged for b in front if a[0][0] + b[0][0] <= room])
        if not merged:
            return None
    kept, key, chosen = min(merged, key=lambda entry: entry[1])
    peak = kept[0] + max(o.local(slot) for o in chosen)
    return (key, peak), chosen


def _moves_nothing(options: tuple[_Option, ...]) -> bool:
    return all(option.nbytes == 0 for option in options)


def _front(entries: list[tuple]) -> list[tuple]:
    """The entries no other beats in both kept bytes and cost (ties: the first)."""
    entries.sort(key=lambda entry: (entry[0][0], entry[1]))
    front, best = [], None
    for entry in entries:
        if best is None or entry[1] < best:
            front.append(entry)
            best = entry[1]
    return front


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))


def _nothing_fits(groups: Sequence[Workload], options: Mapping[str, list[_Option]],
                  budget: int) -> str:
    least = max(min(o.kept + o.local(o.slot) for o in options[w.name]) for w in groups)
    return (f"no plan of the groups {[w.name for w in groups]} fits a weights budget of "
            f"{budget} bytes: the least any plan needs is about {least} bytes (streaming "
            "every block it can). Raise device_budget, lower headroom, or split the largest "
            "block")
