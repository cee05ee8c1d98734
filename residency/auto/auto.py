"""The auto scheduler's owner: what a call does, the plan chosen for it, and the plan's record.

    scheduler = Scheduler("cuda", auto={"device_budget": "38GiB"})
    ...                                        # add the groups, run a call
    print(scheduler.plan.describe())           # per group: kept, swapped, streamed; per call:
                                               # predicted bytes and seconds beside the measured
    scheduler.set_device_budget("20GiB")       # re-plans now (between phases)

An auto scheduler places each group's parts by a plan the planner (`residency.auto.planner`)
computes from the device budget (`residency.options.budget`), the groups' parts, the phase order
and the measured compute and copy times; placement carries it out (`Placement.replan`).  This
object measures and decides when to plan again: when a group is added, when the budget changes
(`Scheduler.set_device_budget`), after the first call (the phase order it observed: the first
call runs on a plan made as if each group were entered once per call, within the budget), after
the second (its steady times), when a call's groups or parts changed size (a re-packed group),
when two calls in a row moved bytes off the prediction by more than ``drift``, and, on an
accelerator, when another program takes the device memory the plan needs or gives it back
([Note: co-tenants] in `residency.auto.room`).

[Note: the time model]
Calls are marked or found as [Note: what a call is] in `residency.group.calls` says; each ends
with its `CallRecord`, and `plan.measured` is that log: every call since the first, across
re-plans.  While a call runs the planner counts each group's entries (switches to it) and passes
(its phase entries, or its first streamed block's forwards where more), and each phase's seconds
and the bytes moved in it (a switch's load belongs to the group switched to).  A call that ran
alone and whole teaches the model, per group: entries, passes, and compute - its phases'
seconds less their bytes at the measured copy bandwidth (`TransitionLog.timed_nbytes` /
``timed_seconds``); and per call the host seconds outside every exclusive group's phase, less
the re-plans made inside it (the planner's search included).  Compute and host seconds are the
medians over the last three such calls under the plans in force (`_HISTORY`; a re-plan starts
afresh, and the first call under new plans counts only until another has run), and after each
such call with no plan due the plans in force are predicted again.  A plan predicts its bytes at
that bandwidth on top, so the seconds it predicts are the span the records measure.

The first call's compute includes its one-off costs (reads, wrappers, allocations): the plan
made after it takes the observed order, entries and passes; the plan after the second call is
chosen again from steady times.  Either time the plans in force stay, their prediction renewed,
unless the new choice moves fewer bytes or, on an accelerator, is predicted `BETTER_BY` faster
(a re-plan evicts the current group, and timing noise must not make plans flap): with
``passes`` declared, the plan made at ``add`` holds from the first call.

[Note: roll-back]
A plan chosen from measured calls on an accelerator (where the objective is predicted time, and a
wrong time model picks a wrong plan) is on trial: the first call under it carries the re-plan's
one-off costs (new buffers, the first forwards of moved parts), so its second call is compared
with the last call under the plan it replaced, each less the re-plans made inside it.  More than
`ROLLBACK_MARGIN` slower, and the plan it replaced is carried out again at the next call's
beginning; the reason says so (in `describe()` and in a warning of logger ``residency``), and the
plans rolled back from are not chosen again while the budget, the headroom and the groups' sizes
stay what they were (`_inputs`).  On the CPU, and with a process group, plans are chosen on bytes,
which are exact: nothing is on trial.

Fields (guarded by the scheduler lock; this object is their one mutator): ``options``, the
resolved ``budget`` and ``headroom``, the per-call counters (``_entries``, ``_passes``,
``_phases``, ``_one_off``), what the last call that taught the model did (``_observed``,
``_host``), the unmarked call it began (``_unmarked``), and ``plan`` (the `AutoPlan` in
force, with its measured calls) with the sizes each group was planned for (``_planned_sizes``,
stored on the same line; a call's beginning compares them with the groups' to see a re-pack).
Invariant: every registered group carries the plan in ``plan.plans`` (the planner's choice for
it), and the planned peak is within ``budget - headroom``.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Iterable, Mapping

import attrs
import torch

from residency.core.errors import DeviceMemoryError
from residency.options.budget import AutoOptions, counted, format_nbytes
from residency.group.residency import Residency
from residency.core.locks import locked
from residency.placement.placement import Placement
from residency.group.plan import Plan, Where
from residency.auto.planner import Cost, Workload, choose, predict
from residency.group.records import CallLog, CallRecord
from residency.group.calls import Calls
from residency.device.transport import (CpuTransport, Transport, device_total_memory,
                                       free_device_memory)
from residency.auto.room import resize, room_for

_log = logging.getLogger("residency")

__all__ = ["BETTER_BY", "ROLLBACK_MARGIN", "AutoPlan", "AutoPlanner"]

#: How much faster (a fraction of its seconds) a plan chosen from measured calls must be
#: predicted to run than the plans in force, moving no fewer bytes, to replace them.
BETTER_BY = 0.05
#: How much slower (a fraction of its seconds) the second call under a plan chosen from measured
#: calls may run than the last call under the plan it replaced before it is rolled back.
ROLLBACK_MARGIN = 0.10
#: Copy bandwidth assumed before any copy was measured (bytes per second).
_ASSUMED_BANDWIDTH = {True: 10e9, False: 5e9}
#: Bytes as a plan's description prints them: two decimals (a budget and its peak may differ
#: only in the second).
_size = functools.partial(format_nbytes, digits=2)


@attrs.frozen(kw_only=True)
class AutoPlan:
    """The plans an auto scheduler carries out, why, what they predict and what calls measured.

        plan = scheduler.plan
        plan.plans["transformer"].kept        # the expert's blocks kept on the device
        plan.predicted.nbytes, plan.measured  # bytes per call: the model's, then each call's
    """

    #: The device budget and the headroom left for activations, in bytes.
    budget: int
    headroom: int
    #: Each group's plan, by name.
    plans: Mapping[str, Plan]
    #: What one call costs by the cost model (bytes, seconds, peak device bytes of weights).
    predicted: Cost
    #: The group workloads the prediction is for (bytes of parts, entries and passes per call).
    workloads: tuple[Workload, ...]
    #: Why this plan was made ("group 'vae' added", "first call observed", ...).
    reason: str
    #: Every call since the first, across re-plans (the scheduler's `CallLog`: the newest
    #: ``record_limit`` records and running totals; [Note: what a call is] in
    #: `residency.group.calls`).
    measured: CallLog = attrs.field(eq=False, repr=False)

    def describe(self) -> str:
        """Per group what is kept, swapped and streamed (and their bytes), then the predicted
        bytes and seconds per call beside the measured ones."""
        lines = [f"auto plan ({self.reason}): budget {_size(self.budget)}, headroom "
                 f"{_size(self.headroom)}, peak {_size(self.predicted.peak)} of weights"]
        for w in self.workloads:
            lines.append("  " + _describe_group(w, self.plans[w.name]))
        lines.append(f"  predicted per call: {_size(self.predicted.nbytes)} moved, "
                     f"{self.predicted.seconds:.3f} s")
        calls = self.measured
        for call in calls[-3:]:  # the last three calls
            note = "" if call.ending in ("returned", "next call") else f" ({call.ending})"
            note += ", overlapped" if call.overlapped else ""
            lines.append(f"  measured call {call.number}: {_size(call.nbytes)} moved, "
                         f"{call.seconds:.3f} s{note}")
        if calls.count:
            lines.append(f"  all {counted(calls.count, 'call')}: {_size(calls.nbytes)} moved, "
                         f"{calls.seconds:.3f} s")
        return "\n".join(lines)


class AutoPlanner:
    """Plans, measures and re-plans an auto scheduler's groups (see the module docstring);
    called with the scheduler lock held."""

    def __init__(self, options: AutoOptions, *, placement: Placement, transport: Transport,
                 calls: Calls, collective: bool = False) -> None:
        self.options = options
        #: With a process group every rank must choose the same plan at the same call: the
        #: plan then rests on what every rank sees alike (bytes, entries, passes), never on its
        #: own clock, and drift (which a rank's timing could tip) does not re-plan.
        self._collective = collective
        self._placement = placement
        self._overlap = not isinstance(transport, CpuTransport)
        self._transitions, self._block_log, self._calls = calls.transitions, calls.block_log, calls
        self.budget, self.headroom = options.resolve(free_device_memory(placement.device),
                                                     device_total_memory(placement.device))
        #: The budget the options resolved to; `budget` is less while a co-tenant holds the rest
        #: ([Note: co-tenants] in `residency.auto.room`).
        self.configured = self.budget
        #: The room (a budget) no plan fitted at the last co-tenant re-plan, or None.
        self._unfit: int | None = None
        self.plan: AutoPlan | None = None
        #: The sizes each group was planned for, by name (`_sizes`; written with ``plan``).
        self._planned_sizes: dict[str, _Sizes] = {}
        self._first = options.phase_order[0] if options.phase_order else None
        #: What the declared phase order and passes say each group does per call: (entries,
        #: passes, 0), until a call is observed.
        self._declared = _declared(options.phase_order or (), dict(options.passes or ()))
        self._entries: dict[str, int] = {}
        self._passes: dict[str, int] = {}
        #: Per group this call: (seconds in its phases, bytes moved in them).
        self._phases: dict[str, tuple[float, int]] = {}
        #: Seconds of this call spent re-planning (one-off: no plan's cost).
        self._one_off = 0.0
        self._observed: dict[str, tuple[int, int, float]] | None = None
        #: Seconds per call outside every exclusive group's phases (learned with `_observed`).
        self._host = 0.0
        self._learned = 0  # plans made from observed calls: the first, then a steady one
        self._due: str | None = None  # why a plan is due at the next call's beginning
        self._unmarked: int | None = None  # the open call of `Calls` this planner began
        self._phase_start: tuple[str, float, int] | None = None
        self._drifted = 0
        #: What the last `_HISTORY` learned calls under the plans in force did: (observed,
        #: host seconds, whether it was the first under them) each; `_observed` and `_host` are
        #: their medians (`_medians`).
        self._history: tuple[tuple[dict, float, bool], ...] = ()
        #: The last learned call's seconds less its re-plans' ([Note: roll-back]).
        self._last_work: float | None = None
        #: A plan on trial: the plan it replaced, that plan's last call's seconds, and how many
        #: calls under the new plan are still to pass before the one that judges it.
        self._trial: tuple[AutoPlan, float, int] | None = None
        #: The plan to roll back to at the next call's beginning (`_due` says why).
        self._back_to: AutoPlan | None = None
        #: The plans rolled back from, and the inputs (`_inputs`) they were judged with.
        self._rejected: tuple[tuple, tuple] | None = None
        self._overlapping, self._said_overlapping = 0, False  # `_unlearned`'s count, and note

    # -- planning --------------------------------------------------------------------------------

    def replan(self, groups: Iterable[Residency], reason: str, keep_same: bool = False,
               plans: Mapping[str, Plan] | None = None, budget: int | None = None) -> None:
        """Choose every group's plan for the budget (or for `budget`, which then becomes it; or
        take `plans`: a roll-back) and carry it out (called with no holders); with `keep_same`
        (a plan due from measured calls) the plans in force may stay, their prediction renewed
        (`_keeps`), and a change is on trial ([Note: roll-back]).  Raises `DeviceMemoryError`
        when nothing fits, nothing changed."""
        groups = list(groups)
        budget = self.budget if budget is None else budget
        workloads = tuple(self._workload(group) for group in groups)
        bandwidth = _ASSUMED_BANDWIDTH[self._overlap] if self._collective else self._bandwidth()
        if plans is None:
            plans = choose(workloads, weights_budget=budget - self.headroom,
                           bandwidth=bandwidth, overlap=self._overlap and not self._collective)
        host = 0.0 if self._collective else self._host
        predicted = predict(workloads, plans, bandwidth=bandwidth, overlap=self._overlap,
                            host_seconds=host)
        if keep_same and self._keeps(groups, workloads, plans, chosen=predicted,
                                     bandwidth=bandwidth, host=host, reason=reason):
            return
        timed = self._overlap and not self._collective  # the choice rests on predicted time
        trial = (self.plan, self._last_work, 1) if keep_same and timed and \
            self._last_work is not None else None
        order = sorted(groups, key=lambda g: _kept_nbytes(plans[g.name], g)
                       - _kept_nbytes(g.plan, g))  # the ones keeping less first
        try:
            for group in order:
                self._placement.replan(group, plans[group.name])
        except BaseException:  # carried out again once (see [Note: interrupts])
            for group in order:
                self._placement.replan(group, plans[group.name])
            raise
        self._placement.budget = budget - self.headroom
        plan = AutoPlan(budget=budget, headroom=self.headroom, plans=plans,
                        predicted=predicted, workloads=workloads, reason=reason,
                        measured=self._calls.log)
        sizes = {w.name: (w.own, w.blocks) for w in workloads}
        self.plan, self._planned_sizes, self.budget = plan, sizes, budget  # one store
        self._drifted, self._trial, self._history = 0, trial, ()

    def _keeps(self, groups: list[Residency], workloads: tuple[Workload, ...],
               plans: Mapping[str, Plan], *, chosen: Cost, bandwidth: float, host: float,
               reason: str) -> bool:
        """Whether the plans in force stay, given `plans` chosen (costing `chosen`) for the same
        groups and budget from what calls measured: they do unless `plans` move fewer bytes or
        (on an accelerator, where the objective is time) are predicted `BETTER_BY` faster, and
        were not rolled back from with the same inputs; then their prediction is renewed (a
        re-plan evicts the current group, and timing noise must not make plans flap)."""
        if self.plan is None or {g.name for g in groups} != set(self.plan.plans) or any(
                g.plan != self.plan.plans[g.name] for g in groups):
            return False
        kept = predict(workloads, self.plan.plans, bandwidth=bandwidth, overlap=self._overlap,
                       host_seconds=host)
        faster = chosen.seconds < kept.seconds * (1 - BETTER_BY)
        timed = self._overlap and not self._collective  # a rank's clock never tips a choice
        better = chosen.nbytes < kept.nbytes or (timed and faster)
        rejected = self._rejected == (_plans_key(plans), self._inputs())
        if (better and not rejected) or kept.peak > self.budget - self.headroom:
            return False
        self.plan = attrs.evolve(self.plan, predicted=kept, workloads=workloads,
                                 reason=self.plan.reason if rejected else reason)
        return True

    def added(self, group: Residency, groups: Iterable[Residency], lock, remove) -> Residency:
        """Plan the groups again with `group` just registered (takes `lock`) and return it; if
        no plan fits (or the step is interrupted), `group` is removed again (``remove(group,
        "add")``) and the others keep a plan without it."""
        try:
            locked(lock, self.replan, groups, f"group {group.name!r} added")
            return group
        except BaseException:  # refused: nothing changed (see [Note: interrupts])
            locked(lock, remove, group, "add")
            if self.plan is None or any(g.plan != self.plan.plans.get(g.name) for g in groups):
                locked(lock, self.replan, groups, f"group {group.name!r} refused")
            raise

    def plan_again(self, groups: Iterable[Residency], reason: str, no_holders: bool) -> None:
        """Plan again now when no phase is active, else at the next call's beginning (a group
        was removed or refreshed while another group's phase ran: what it held is freed)."""
        if no_holders:
            self.replan(groups, reason)
        else:
            self._due = reason

    def set_budget(self, groups: Iterable[Residency], device_budget: object) -> None:
        """Take a new device budget (as `AutoOptions.device_budget` accepts) and re-plan; a
        budget nothing fits is refused with nothing changed."""
        options = attrs.evolve(self.options, device_budget=device_budget)
        device = self._placement.device
        budget, headroom = options.resolve(
            free_device_memory(device, held=self._placement.device_nbytes),
            device_total_memory(device))
        before = (self.options, self.budget, self.headroom, self.configured)
        self.options, self.budget, self.headroom, self.configured = (
            options, budget, headroom, budget)
        try:
            self.replan(groups, f"device budget set to {device_budget!r}")
        except BaseException:
            self.options, self.budget, self.headroom, self.configured = before
            raise

    def _inputs(self) -> tuple:
        """What a rolled-back choice was judged with: the budget, the headroom and the groups'
        sizes; when one of them changes, the choice may be made again."""
        return (self.budget, self.headroom, tuple(sorted(self._planned_sizes.items())))

    def _workload(self, group: Residency) -> Workload:
        entries, passes, compute = (self._observed or self._declared).get(group.name,
                                                                         (1, 1, 0.0))
        own, blocks = _sizes(group)
        return Workload(name=group.name, own=own, blocks=blocks, exclusive=group.exclusive,
                        entries=entries, passes=passes,
                        compute_seconds=0.0 if self._collective else compute)

    def _bandwidth(self) -> float:
        """The measured copy bandwidth: the timed loads' bytes over their seconds (the log's
        running totals), else the assumed one."""
        log = self._transitions
        if log.timed_seconds <= 0:
            return _ASSUMED_BANDWIDTH[self._overlap]
        return log.timed_nbytes / log.timed_seconds

    # -- observing calls --------------------------------------------------------------------------

    def entering(self, group: Residency, current: Residency | None,
                 groups: Iterable[Residency], no_holders: bool) -> None:
        """A phase of `group` begins (`current`: the exclusive group on the device before it).
        Counts it; where nobody marks calls, a beginning of the phase order's first group ends
        the call before and begins the next ([Note: what a call is] in
        `residency.group.calls`)."""
        if not group.exclusive:
            return
        switching = current is not group
        if switching and self._first is None:
            self._first = group.name
        if switching and group.name == self._first and not self._calls.marked:
            ended = None if self._unmarked is None else self._calls.end(self._unmarked,
                                                                          "next call")
            if ended is not None:
                self.call_ended(ended, groups)
            self._unmarked, found = self._calls.begin(marked=False)
            if found is not None:
                self.call_ended(found, groups)
            self.call_began(groups, no_holders)
        self._passes[group.name] = self._passes.get(group.name, 0) + 1
        if switching:
            self._entries[group.name] = self._entries.get(group.name, 0) + 1
            now = time.perf_counter()
            self._end_phase(now)
            self._phase_start = (group.name, now, self._calls.moved())
            if no_holders and self._overlap and not self._collective and self.plan is not None:
                self._fit_room(groups)

    def switched(self) -> None:
        """A switch is done: while the budget is below the configured one, the blocks it freed
        go back to the device for its co-tenants ([Note: co-tenants] in `residency.auto.room`)."""
        if self.budget < self.configured:
            torch.accelerator.empty_cache()

    def _fit_room(self, groups: Iterable[Residency]) -> None:
        """Plan again within the device's room when a co-tenant took or gave back memory
        ([Note: co-tenants] in `residency.auto.room`); a room no plan fits keeps the plan."""
        peak = self.plan.predicted.peak
        room = room_for(self._placement.device, self._placement.device_nbytes, peak,
                        self.headroom)
        change = None if room is None else resize(
            room, peak=peak, budget=self.budget, configured=self.configured,
            headroom=self.headroom)
        if change is None:
            return
        budget, reason = change
        if self._unfit is not None and budget <= self._unfit:
            return  # no plan fits it: said once, tried again when the room grows
        began = time.perf_counter()
        try:
            self.replan(groups, reason, budget=budget)
        except DeviceMemoryError as error:
            self._unfit = budget
            _log.warning("auto plan kept: %s, but %s", reason, error)
            return
        self._unfit = None
        self._one_off += time.perf_counter() - began  # no plan's cost
        torch.accelerator.empty_cache()  # what the plan no longer keeps, to the co-tenant
        _log.warning("auto plan %s", reason)

    def call_began(self, groups: Iterable[Residency], no_holders: bool) -> None:
        """A call began: its counts start at zero; a plan due is made now when no phase is
        active (else at the next call's beginning)."""
        self._entries, self._passes, self._phases, self._one_off = {}, {}, {}, 0.0
        self._phase_start = None
        if self._due is not None and no_holders:
            reason, self._due = self._due, None
            back, self._back_to = self._back_to, None
            began = time.perf_counter()  # the search and the moves: no plan's cost
            try:
                if back is not None:
                    self._rejected = (_plans_key(self.plan.plans), self._inputs())
                    self.replan(groups, reason, plans=back.plans)
                else:
                    self.replan(groups, reason, keep_same=reason.startswith(_MEASURED))
            finally:
                self._one_off += time.perf_counter() - began

    def call_ended(self, call: CallRecord, groups: Iterable[Residency]) -> None:
        """`call` ended: learn what it did when it ran alone and whole, and say whether a plan
        is due (made at the next call's beginning)."""
        self._end_phase(call.start + call.seconds)
        self._phase_start = None
        if self.plan is None or not self._entries:
            return
        if call.overlapped or call.ending not in ("returned", "next call"):
            self._unlearned(call)  # mixed with another call's phases, or its end not seen
            return
        forwards = self._block_forwards(since=call.start)
        bandwidth = self._bandwidth()
        observed = {
            name: (self._entries[name], max(self._passes.get(name, 0), forwards.get(name, 0)),
                   max(0.0, self._phases.get(name, (0.0, 0))[0]
                       - self._phases.get(name, (0.0, 0))[1] / bandwidth))
            for name in self._entries}
        inside = sum(seconds for seconds, _ in self._phases.values())
        host = max(0.0, call.seconds - inside - self._one_off)
        fresh = not self._history and self._learned > 0  # the first call under new plans
        self._history = (*self._history[-(_HISTORY - 1):], (observed, host, fresh))
        self._observed, self._host = _medians(self._history)
        work = call.seconds - self._one_off
        groups = list(groups)
        self._due = self._due or self._judged(call.number, work) or self._why_due(
            call.nbytes, groups)
        self._last_work = work
        if self._due is None:
            self._renew(groups)

    def _renew(self, groups: list[Residency]) -> None:
        """Predict the plans in force again from what the calls measured (no plan is due)."""
        if any(g.name not in self.plan.plans for g in groups):
            return
        workloads = tuple(self._workload(group) for group in groups)
        bandwidth = _ASSUMED_BANDWIDTH[self._overlap] if self._collective else self._bandwidth()
        predicted = predict(workloads, self.plan.plans, bandwidth=bandwidth,
                            overlap=self._overlap, host_seconds=0.0 if self._collective
                            else self._host)
        self.plan = attrs.evolve(self.plan, predicted=predicted, workloads=workloads)

    def _judged(self, number: int, work: float) -> str | None:
        """The roll-back due after call `number` ran in `work` seconds (`_judge`), or None."""
        self._trial, back_to, reason = _judge(self._trial, number, work, self.plan.reason)
        if reason is not None:
            self._back_to = back_to
            _log.warning("auto plan %s", reason)
        return reason

    def _unlearned(self, call: CallRecord) -> None:
        """A call that teaches nothing ended: after `_OVERLAPPING` overlapping ones and none
        alone, nothing declared, say once what to declare (`_OVERLAPPING_NOTE`)."""
        if not call.overlapped or self._learned or self._declared or self._said_overlapping:
            return
        self._overlapping += 1
        if self._overlapping >= _OVERLAPPING:
            self._said_overlapping = True
            _log.warning(_OVERLAPPING_NOTE, self._overlapping)

    def _end_phase(self, now: float) -> None:
        if self._phase_start is not None:
            name, began, moved = self._phase_start
            seconds, nbytes = self._phases.get(name, (0.0, 0))
            self._phases[name] = (seconds + now - began, nbytes + self._calls.moved() - moved)

    def _block_forwards(self, since: float) -> dict[str, int]:
        """Forwards of each streaming group's first streamed block since `since` (a phase may
        run its model more than once: the block records count each forward)."""
        counts: dict[str, int] = {}
        for record in self._block_log:
            if record.kind == "compute" and record.index == 0 and record.time >= since:
                counts[record.group] = counts.get(record.group, 0) + 1
        return counts

    def _why_due(self, nbytes: int, groups: list[Residency]) -> str | None:
        """Why a plan is due after a call that moved `nbytes`, or None."""
        if self._learned < 2:
            self._learned += 1
            return _FIRST if self._learned == 1 else _STEADY
        predicted = self.plan.predicted.nbytes
        off = abs(nbytes - predicted) > self.options.drift * max(predicted, 1)
        self._drifted = self._drifted + 1 if off and not self._collective else 0
        if self._drifted >= 2:
            return f"{_DRIFT} ({predicted} bytes) by more than {self.options.drift:.0%}"
        planned = self._planned_sizes
        if len(groups) != len(planned) or any(planned.get(g.name) != _sizes(g) for g in groups):
            return "the groups or their parts changed (added, removed or re-packed)"
        return None


#: Why a plan is made after the first call (its phase order, entries and passes), and after
#: the second (its compute times, past the first call's one-off costs).
_FIRST, _STEADY = "first call observed", "a steady call measured"
#: Why a plan is due when two calls in a row moved bytes off the prediction.
_DRIFT = "two calls off the prediction"
#: The reasons that come from measured calls: the plans in force may stay (`_keeps`), and a
#: change is on trial.  Any other reason (a group removed, refreshed or re-packed) re-plans.
_MEASURED = (_FIRST, _STEADY, _DRIFT)


#: How many learned calls under the plans in force the time model takes the median of.
_HISTORY = 3
#: Overlapping calls, none alone before them, after which the plan says what to declare.
_OVERLAPPING = 3
_OVERLAPPING_NOTE = (
    "auto plan: %d calls overlapped (concurrent requests) and none ran alone, so the plan "
    "learned no phase order, entries or passes (it plans each group entered once a call); "
    "declare them: auto_options {'passes': {group: forwards per call}, 'phase_order': [...]}")


def _judge(trial: tuple | None, number: int, work: float,
           reason: str) -> tuple[tuple | None, object, str | None]:
    """Judge the plan on `trial` (the plan it replaced, that plan's last call's seconds, the calls
    still to pass) by call `number`, which ran in `work` seconds: (the trial after it, the plan to
    roll back to, why), the last two None unless it ran more than `ROLLBACK_MARGIN` slower
    ([Note: roll-back]); `reason` is why the plan on trial was made."""
    if trial is not None and trial[2] > 0:  # its first call: the re-plan's one-off costs
        return (trial[0], trial[1], trial[2] - 1), None, None
    if trial is None or work <= trial[1] * (1 + ROLLBACK_MARGIN):
        return None, None, None
    replaced, before, _ = trial
    return None, replaced, (
        f"rolled back after call {number}: the plans chosen for {reason!r} ran it in "
        f"{work:.3f} s against {before:.3f} s for the plans before (more than "
        f"{ROLLBACK_MARGIN:.0%} slower); not chosen again until the budget or the groups change")


def _medians(history: tuple[tuple[dict, float, bool], ...]) -> tuple[dict, float]:
    """The last call's entries and passes per group, with each group's compute seconds and the
    host seconds as medians over the calls of `history` (one slow call - a busy host - does not
    move the prediction); the first call under new plans (`fresh`: their first forwards, their
    allocations) counts only while no other has run."""
    observed = history[-1][0]
    history = tuple(entry for entry in history if not entry[2]) or history
    compute = {name: statistics.median(seen[name][2] for seen, _, _ in history if name in seen)
               for name in observed}
    return ({name: (entries, passes, compute[name])
             for name, (entries, passes, _) in observed.items()},
            statistics.median(host for _, host, _ in history))


def _plans_key(plans: Mapping[str, Plan]) -> tuple:
    return tuple(sorted(plans.items(), key=lambda item: item[0]))


def _declared(order: tuple[str, ...],
              passes: Mapping[str, int]) -> dict[str, tuple[int, int, float]]:
    """Entries (switches to it, the order taken as a cycle) and passes (phases, or the declared
    `passes`) per call of each group of a declared phase order or of `passes`."""
    counts: dict[str, tuple[int, int, float]] = {}
    for index, name in enumerate(order):
        entries, count, _ = counts.get(name, (0, 0, 0.0))
        counts[name] = (entries + (order[index - 1] != name or len(order) == 1), count + 1, 0.0)
    for name, count in passes.items():
        counts[name] = (counts.get(name, (1, 0, 0.0))[0], count, 0.0)
    return counts


#: A group's sizes as a plan sees them: its own part's (bytes, bytes laid end to end), then each
#: other part's (name, bytes, bytes laid end to end).
_Sizes = tuple[tuple[int, int], tuple[tuple[str, int, int], ...]]


def _sizes(group: Residency) -> _Sizes:
    """What `group`'s plan depends on of its parts (`Workload.own` and `Workload.blocks`)."""
    layout = group.inventory.layout
    return ((layout.nbytes, layout.contiguous_nbytes),
            tuple((part.name, part.inventory.layout.nbytes, part.inventory.layout.contiguous_nbytes)
                  for part in group.parts))


def _kept_nbytes(plan: Plan, group: Residency) -> int:
    parts = {part.name: part for part in group.parts}
    kept = group.inventory.layout.contiguous_nbytes if plan.own.where is Where.KEPT else 0
    return kept + sum(parts[name].inventory.layout.contiguous_nbytes for name in plan.kept
                      if name in parts)


def _describe_group(w: Workload, plan: Plan) -> str:
    held = {name: h for name, _, h in w.blocks}
    sums = {where: sum(held[n] for n in held if plan.where[n] is where) for where in Where}
    own = plan.own.where.value
    text = f"{w.name}: own part {own} ({_size(w.own[1])})"
    for where, names in ((Where.KEPT, plan.kept), (Where.SWAPPED, plan.swapped),
                         (Where.STREAMED, plan.streamed)):
        if names:
            text += f"; {counted(len(names), 'block')} {where.value} ({_size(sums[where])})"
    return (text + f"; {counted(w.entries, 'entry', 'entries')}, "
            f"{counted(w.passes, 'pass', 'passes')} per call")
