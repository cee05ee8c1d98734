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
  and the ring's extra copy cost more than the model saw (benchmarks/README.md, "Auto plans").
  So the predicted time grows with the bytes, and crediting overlap waits for a per-block
  measure of it.
* The objective: with `overlap` (an accelerator), least seconds, then fewest bytes; without (the
  CPU, where a copy is the time), fewest bytes, then least seconds.

[Note: the search]
Blocks of the same size are interchangeable, so each group's choices are counted per size class
(how many kept, how many streamed), each option's cost in a few sums. For one size of the slots
(each size of streamed block, smallest first), the peak of a choice is its kept bytes plus the
largest phase (`_Option.local`). So for each bound on the largest phase (each distinct phase size,
in increasing order), the best choice has every phase within the bound and its kept bytes within
the budget less the bound (the room). Per group, only the options no other beats in phase size,
kept bytes and cost at once can be chosen; at each bound the usable ones form a front in (kept
bytes, cost), and the fronts are merged group by group, dropping any partial choice that can no
longer fit the room or beat the best found so far (each later group adds at least its own least
kept bytes and least cost). A larger bound leaves less room, so a bound where no front changed is
skipped, and so is one whose least possible cost (each group's cheapest option within the room)
does not beat the best found. When those cheapest options fit the room together they are the
bound's answer, with no merge. The search is exact for this model: tests/test_planner.py compares
the choice with a brute force over every placement of every part. What a search costs, against
merging every front at every bound: benchmarks/README.md ("Plans that hold").
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

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
    docstring and [Note: the search]); raises `DeviceMemoryError` when no plan fits, saying how
    much would."""
    if not groups:
        return {}
    options = {w.name: list(_options(w, bandwidth, overlap)) for w in groups}
    best: tuple | None = None
    for slot in sorted({o.slot for opts in options.values() for o in opts}):
        fitting = [[o for o in opts if o.slot <= slot] for opts in options.values()]
        best = _best_with_slot(fitting, slot, weights_budget, best)
        if best is not None and _moves_nothing(best[1]):
            break  # nothing moved: no plan costs less (seconds grow with bytes), stop here
    if best is None:
        raise DeviceMemoryError(_nothing_fits(groups, options, weights_budget))
    return {option.group: option.plan() for option in best[1]}


@attrs.frozen(kw_only=True)
class _Option:
    """One way to place one group: its plan and what it costs (see [Note: the cost model])."""

    group: str
    #: The plan, made when asked for (the search weighs thousands of options, keeps one each).
    plan: Callable[[], Plan] = attrs.field(repr=False)
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
    #: (seconds, bytes) with `overlap`, else (bytes, seconds): what the search minimises.
    cost: tuple = attrs.field(eq=False)

    def local(self, slot: int) -> int:
        return self.swapped + (2 * slot if self.streams else 0)

    @classmethod
    def of(cls, w: Workload, plan: Plan, bandwidth: float, overlap: bool) -> _Option:
        """The option `plan` is for `w`."""
        where = plan.where
        own_copied, own_held = w.own
        kept = own_held if where[w.name] is Where.KEPT else 0
        swapped_held, swapped_copied = own_held - kept, 0 if kept else own_copied
        streamed = [(c, h) for name, c, h in w.blocks if where[name] is Where.STREAMED]
        for name, copied, held in w.blocks:
            if where[name] is Where.KEPT:
                kept += held
            elif where[name] is Where.SWAPPED:
                swapped_held, swapped_copied = swapped_held + held, swapped_copied + copied
        ring = streamed[0][0] if len(streamed) > 1 else 0
        return cls.made(w, lambda: plan, (bandwidth, overlap), kept=kept, swapped=swapped_held,
                        moved=swapped_copied + ring, streamed=sum(c for c, _ in streamed),
                        slot=max((h for _, h in streamed), default=0), streams=bool(streamed))

    @classmethod
    def made(cls, w: Workload, plan: Callable[[], Plan], rate: tuple[float, bool], *,
             kept: int, swapped: int, moved: int, streamed: int, slot: int,
             streams: bool) -> _Option:
        """The option of `w` that keeps `kept` bytes, holds `swapped` more in its phase, copies
        `moved` bytes at each entry and `streamed` at each pass; `rate` is (bandwidth,
        overlap)."""
        bandwidth, overlap = rate
        nbytes = w.entries * moved + w.passes * streamed
        seconds = w.compute_seconds + nbytes / bandwidth  # no overlap credited: see the Note
        return cls(group=w.name, plan=plan, kept=kept, swapped=swapped, streams=streams,
                   slot=slot, nbytes=nbytes, seconds=seconds,
                   cost=(seconds, nbytes) if overlap else (nbytes, seconds))


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
    order = {name: i for i, (name, _, _) in enumerate(w.blocks)}
    classes: dict[tuple[int, int], list[str]] = {}
    for name, copied, held in w.blocks:
        classes.setdefault((copied, held), []).append(name)
    splits = [[(k, s) for k in range(len(names) + 1) for s in range(len(names) - k + 1)]
              for names in classes.values()]
    own_copied, own_held = w.own
    for own in (Where.SWAPPED, Where.KEPT):
        for choice in itertools.product(*splits):
            kept = own_held if own is Where.KEPT else 0
            swapped, moved = own_held - kept, 0 if kept else own_copied
            streamed = slot = count = 0
            first = (len(order), 0)  # (position, copied bytes) of the first streamed block
            for ((copied, held), names), (k, s) in zip(classes.items(), choice):
                rest = len(names) - k - s
                kept, swapped, moved = kept + k * held, swapped + rest * held, moved + rest * copied
                if s:
                    streamed, slot, count = streamed + s * copied, max(slot, held), count + s
                    first = min(first, (order[names[len(names) - s]], copied))
            yield _Option.made(w, functools.partial(_plan_of, base, own, classes, choice),
                               (bandwidth, overlap), kept=kept, swapped=swapped,
                               moved=moved + (first[1] if count > 1 else 0), streamed=streamed,
                               slot=slot, streams=bool(count))


def _plan_of(base: Plan, own: Where, classes: Mapping[tuple[int, int], list[str]],
             choice: tuple[tuple[int, int], ...]) -> Plan:
    """`base` with its own part at `own` and, in each size class, the first k blocks kept and
    the last s streamed (`choice`: a (k, s) per class)."""
    where = {base.group: own}
    for names, (k, s) in zip(classes.values(), choice):
        where.update({name: Where.KEPT for name in names[:k]})
        where.update({name: Where.STREAMED for name in names[len(names) - s:]})
    return base.replace(where)


def _best_with_slot(fitting: list[list[_Option]], slot: int, budget: int,
                    best: tuple | None) -> tuple | None:
    """The best of `best` and every choice of `fitting` (one option per group) whose streamed
    blocks fit slots of `slot` bytes, within `budget`: ((key, peak), options), or None."""
    fitting = [_undominated(opts, slot) for opts in fitting]  # each by phase size
    usable = [0] * len(fitting)  # per group: how many of its options have a phase this small
    fronts: list[list[_Option]] = [[] for _ in fitting]
    for bound in sorted({o.local(slot) for opts in fitting for o in opts}):
        room = budget - bound
        if room < 0:
            break
        changed = False
        for i, opts in enumerate(fitting):
            count = bisect.bisect_right(opts, bound, key=lambda o: o.local(slot))
            if count != usable[i]:
                usable[i], fronts[i], changed = count, _front(opts[:count]), True
        if not changed or not all(fronts):
            continue  # nothing new (less room: no better), or some group has no phase this small
        found = _best_within(fronts, slot, room, best)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


def _undominated(options: list[_Option], slot: int) -> list[_Option]:
    """The options no other beats in phase size, kept bytes and cost at once (ties: the first)."""
    chosen = []
    kepts: list[int] = []  # the staircase of the options chosen: kept bytes rising, ...
    costs: list[tuple] = []  # ... their costs falling
    for option in sorted(options, key=lambda o: (o.local(slot), o.kept, o.cost)):
        at = bisect.bisect_right(kepts, option.kept)
        if at and costs[at - 1] <= option.cost:
            continue  # one with a phase no larger keeps no more and costs no more
        chosen.append(option)
        end = at
        while end < len(costs) and costs[end] >= option.cost:
            end += 1
        kepts[at:end], costs[at:end] = [option.kept], [option.cost]
    return chosen


def _front(options: list[_Option]) -> list[_Option]:
    """The options no other beats in both kept bytes and cost (ties: the first), by kept bytes."""
    options = sorted(options, key=lambda o: (o.kept, o.cost))
    front, least = [], None
    for option in options:
        key = option.cost
        if least is None or key < least:
            front.append(option)
            least = key
    return front


def _best_within(fronts: list[list[_Option]], slot: int, room: int,
                 best: tuple | None) -> tuple | None:
    """The least-cost choice of one option per front with the kept bytes within `room`, if it
    may beat `best`: ((key, peak), options), or None (see [Note: the search])."""
    cheapest = []
    for front in fronts:
        within = [o for o in front if o.kept <= room]
        if not within:
            return None
        cheapest.append(within[-1])  # a front by kept bytes: its cost falls as they grow
    lowest = functools.reduce(_add, (o.cost for o in cheapest))
    if best is not None and best[0][0] < lowest:
        return None
    if sum(o.kept for o in cheapest) <= room:
        return _scored(tuple(cheapest), slot)
    # After group i: the least kept bytes and the least cost the groups after it still add.
    kept_after = list(itertools.accumulate((f[0].kept for f in reversed(fronts[1:])),
                                           initial=0))[::-1]
    cost_after = list(itertools.accumulate((o.cost for o in reversed(cheapest[1:])),
                                           _add, initial=(0, 0)))[::-1]
    merged = [(o.kept, o.cost, (o,)) for o in fronts[0]]
    for i, front in enumerate(fronts[1:], start=1):
        ceiling = None if best is None else best[0][0]
        merged = _merge_fronts(merged, front, room - kept_after[i], ceiling, cost_after[i])
        if not merged:
            return None
    return _scored(min(merged, key=lambda entry: entry[1])[2], slot)


def _merge_fronts(merged: list[tuple], front: list[_Option], room: int, ceiling: tuple | None,
                  after: tuple) -> list[tuple]:
    """Every (kept, key, options) of `merged` with one option of `front` added, within `room`
    and able to beat `ceiling` with `after` still to add; the undominated ones, by kept bytes."""
    entries = []
    for kept, key, chosen in merged:
        for option in front:
            total = kept + option.kept
            if total > room:
                break  # the front is by kept bytes
            cost = _add(key, option.cost)
            if ceiling is None or not ceiling < _add(cost, after):
                entries.append((total, cost, chosen + (option,)))
    entries.sort(key=lambda entry: (entry[0], entry[1]))
    undominated, least = [], None
    for entry in entries:
        if least is None or entry[1] < least:
            undominated.append(entry)
            least = entry[1]
    return undominated


def _scored(chosen: tuple[_Option, ...], slot: int) -> tuple:
    key = functools.reduce(_add, (o.cost for o in chosen))
    peak = sum(o.kept for o in chosen) + max(o.local(slot) for o in chosen)
    return (key, peak), chosen


def _moves_nothing(options: tuple[_Option, ...]) -> bool:
    return all(option.nbytes == 0 for option in options)


def _add(a: tuple, b: tuple) -> tuple:
    return (a[0] + b[0], a[1] + b[1])


def _nothing_fits(groups: Sequence[Workload], options: Mapping[str, list[_Option]],
                  budget: int) -> str:
    least = max(min(o.kept + o.local(o.slot) for o in options[w.name]) for w in groups)
    return (f"no plan of the groups {[w.name for w in groups]} fits a weights budget of "
            f"{budget} bytes: the least any plan needs is about {least} bytes (streaming "
            "every block it can). Raise device_budget, lower headroom, or split the largest "
            "block")
