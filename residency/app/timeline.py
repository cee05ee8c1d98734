"""The phase timeline: what each phase change of a run moved and cost, against a copy floor.

    recorder = PhaseRecorder(scheduler)             # a drop-in `scheduler` that times each phase
    pipe.offload = recorder
    pipe(prompt)
    records = list(scheduler.transitions)
    costs = measure_changes(scheduler, records)      # each change made again, beside its floor
    print(format_timeline(timeline_rows(records, recorder), device=scheduler.device))
    print(format_changes(costs))
    write_trace("trace.json", records, recorder.spans)

The *floor* of a load is a plain copy of as many bytes (of the group's host master chunks) into a
reused device buffer, measured in the same process right after the run; ``x floor`` is how many
times slower the phase change was.  Everything above 1.0 is overhead (see docs/design.md).

[Note: repeated, not once]
One phase change timed once says little on a shared machine: another process that takes a core
for a scheduler quantum, or torch's intra-op threads woken behind it, adds milliseconds to one
copy and not the next, and the run's single figures swing by whole multiples from run to run.  So
the ratios are not taken from the run: after it, `measure_changes` makes each distinct change of
the run again `repeats` times through the scheduler's own ``resident(...)`` (nothing computed in
between), then copies as many bytes of each group loaded `repeats` times for its floor (a
layer-mode or partly kept load moves part of a group), and reports medians with their spread
(min-max).  The count is fixed by the bytes a round moves, never by a clock, so the
ranks of a job that share masters make the same phase changes in the same order.  A change from
"-" (nothing on the device) follows ``offload_all``, which frees the shared device storage, so,
as in the run, it allocates that storage again.

[Note: when x floor means something]
A phase change also pays costs that do not grow with the bytes it copies, or not as they do:
edit detection's digests of the groups loaded and evicted, Python, the lock, re-pointing each
tensor, and on a busy CPU the wake-up of torch's threads.  For a group under a MiB these are
most of the time and the ratio says nothing about the copy; the same holds where the floor copy
takes only microseconds.  So ``x floor`` is shown only for a load of at least `MIN_FLOOR_BYTES`
whose floor's median is at least `MIN_FLOOR_SECONDS`; the legend gives what the other changes
took, measured in the same run, instead of a figure from elsewhere.

[Note: timing on accelerators]
A scheduler's `TransitionRecord` times cover *issuing* an accelerator copy, which runs on a side
stream.  To time the copy itself, `PhaseRecorder(synchronize=True)` waits for the device before a
phase is entered (so earlier compute is not counted) and again after (so the copy is); the rows then
carry those synchronised seconds.  `measure_changes` does the same around each change it makes on
an accelerator.  On the host the copy is done when the record is made, and no synchronisation is
needed.
"""

from __future__ import annotations

import collections
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import torch

from residency.options.budget import counted, format_nbytes
from residency.core.errors import PhaseError, ResidencyError
from residency.group.records import BlockRecord, TransitionRecord, chrome_trace

__all__ = [
    "ChangeCosts",
    "MachineLoad",
    "PhaseRecorder",
    "PhaseSpan",
    "RepeatedChange",
    "Row",
    "Samples",
    "format_changes",
    "format_device_bytes",
    "format_timeline",
    "load_average",
    "machine_load",
    "measure_changes",
    "measure_floor",
    "measure_floors",
    "timeline_rows",
    "usable_cores",
    "wait_for_reads",
    "write_trace",
]

#: A load must move at least this many bytes for ``x floor`` to be shown (see [Note: when x floor
#: means something]).
MIN_FLOOR_BYTES = 1 << 20
#: ...and its floor copy must take at least this long (median): well above the fixed costs.
MIN_FLOOR_SECONDS = 100e-6
#: What the ``x floor`` column prints for a change whose ratio is left out (the legend says why).
NOT_MEANINGFUL = "*"
#: Times each change is made again, and each floor copied (see [Note: repeated, not once]) ...
REPEATS = 7
#: ... or this many when one round of the changes moves more than `ROUND_NBYTES` (a14b sizes).
FEW_REPEATS = 3
ROUND_NBYTES = 4 << 30
#: `wait_for_reads`: how often it looks, how often it says how far the reads are, and how long
#: it waits for reads that make no progress before it measures anyway.
_POLL_S, _SAY_S, _STALL_S = 0.05, 2.0, 60.0


# -- the machine ----------------------------------------------------------------------------------


def load_average() -> float | None:
    """The host's load average over the last minute (``os.getloadavg``), or None where the
    platform has none.  The one place the main job reads it: tests replace it.

        load_average()      # 1.34
    """
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@attrs.frozen(kw_only=True)
class MachineLoad:
    """How busy the host was while a run was measured: torch's intra-op threads, the load
    average (runnable processes over the last minute) and the cores this process may use.

        MachineLoad(threads=2, load_average=3.5, cores=2).loaded   # True: timings swing
    """

    threads: int
    load_average: float | None
    cores: int

    @property
    def loaded(self) -> bool:
        """Whether more processes wanted to run than there are cores (the load above them)."""
        return self.load_average is not None and self.load_average > self.cores

    def describe(self) -> str:
        """``'2 intra-op threads; load average 1.34 on 2 cores'``."""
        threads = f"{self.threads} intra-op thread{'s' if self.threads != 1 else ''}"
        if self.load_average is None:
            return f"{threads}; {self.cores} cores, load average unknown"
        return f"{threads}; load average {self.load_average:.2f} on {self.cores} cores"

    def warning(self) -> str | None:
        """A line for the report when `loaded`, else None; with more than one intra-op thread it
        says what ``--threads 1`` does, and suggests it."""
        if not self.loaded:
            return None
        advice = ""
        if self.threads > 1:
            advice = (f"; each of torch's operations here waits for all {self.threads} of its "
                      "intra-op threads, and a thread behind another process stalls it: "
                      "--threads 1 runs each on one thread and steadies the figures")
        return (f"warning: the machine is loaded (load average {self.load_average:.2f} over the "
                f"last minute, on {self.cores} cores): other processes share the cores, so one "
                "run's seconds swing from run to run; read the medians of the repeated phase "
                f"changes below, and their spread{advice}")


def machine_load() -> MachineLoad:
    """The host's `MachineLoad` now (the load average read through `load_average`)."""
    return MachineLoad(threads=torch.get_num_threads(), load_average=load_average(),
                       cores=usable_cores())


def usable_cores() -> int:
    """The cores this process may run on (its affinity; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


# -- recording the run's phases -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PhaseSpan:
    """One ``resident(name)`` block: when it was entered and left, and what entering it cost."""

    name: str
    start: float
    end: float
    #: Seconds spent entering (the phase change, if one happened).
    enter_seconds: float
    #: Index (counting every transition) of the transition the entry made, or None.
    transition: int | None
    thread: str


class PhaseRecorder:
    """Wraps a scheduler's ``resident()`` to record each phase's span; use it as the `scheduler`.

        recorder = PhaseRecorder(scheduler)
        with recorder.resident("transformer"):      # enters scheduler.resident("transformer")
            out = pipe.transformer(x)
        recorder.spans[-1].name                      # 'transformer'

    It also samples `scheduler.device_nbytes` after each entry into `peak_device_bytes`.  With
    ``synchronize=True`` it waits for the device around each entry (see [Note: timing on
    accelerators]); only use that for measurement.
    """

    def __init__(self, scheduler, *, synchronize: bool = False) -> None:
        self.scheduler = scheduler
        self.synchronize = synchronize
        #: Completed phases, in the order they ended.
        self.spans: list[PhaseSpan] = []
        #: Most bytes the scheduler's device storages held at any sampled moment.
        self.peak_device_bytes = scheduler.device_nbytes

    @property
    def device(self) -> torch.device:
        return self.scheduler.device

    def resident(self, name: str) -> _RecordedPhase:
        return _RecordedPhase(self, name)

    def sync(self) -> None:
        """Wait for the device's queued work (when timing an accelerator), so that a phase's
        span starts and ends with its work."""
        if self.synchronize:
            torch.accelerator.synchronize()


class _RecordedPhase:
    __slots__ = ("_enter", "_name", "_phase", "_recorder", "_start", "_transition")

    def __init__(self, recorder: PhaseRecorder, name: str) -> None:
        self._recorder = recorder
        self._name = name
        self._phase = recorder.scheduler.resident(name)

    def __enter__(self):
        recorder = self._recorder
        count = recorder.scheduler.transitions.count
        recorder.sync()
        self._start = time.perf_counter()
        group = self._phase.__enter__()
        recorder.sync()
        self._enter = time.perf_counter() - self._start
        after = recorder.scheduler.transitions.count
        self._transition = after - 1 if after > count else None
        now = recorder.scheduler.device_nbytes
        recorder.peak_device_bytes = max(recorder.peak_device_bytes, now)
        return group

    def __exit__(self, *exc_info) -> None:
        self._phase.__exit__(*exc_info)
        self._recorder.spans.append(
            PhaseSpan(name=self._name, start=self._start, end=time.perf_counter(),
                      enter_seconds=self._enter, transition=self._transition,
                      thread=threading.current_thread().name)
        )


# -- repeated measurements ------------------------------------------------------------------------


def _some(_instance, _attribute, values: tuple) -> None:
    if not values:
        raise ResidencyError("Samples: no values; measure at least once")


@attrs.frozen
class Samples:
    """Repeated measurements of one figure (seconds, or ratios): its median and spread.

        Samples([0.3, 0.1, 0.2]).median          # 0.2
        Samples([0.3, 0.1, 0.2]).spread          # (0.1, 0.3): min-max
    """

    values: tuple[float, ...] = attrs.field(converter=tuple, validator=_some)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> tuple[float, float]:
        """(min, max) over the values."""
        return min(self.values), max(self.values)

    def over(self, by: float) -> Samples:
        """Each value divided by `by` (e.g. a change's seconds over its floor's median)."""
        return Samples([value / by for value in self.values])


@attrs.frozen(kw_only=True)
class RepeatedChange:
    """One distinct phase change of the run, made again after it, beside the floor of its load."""

    from_group: str | None
    to_group: str
    #: Bytes the change loaded when made again (the repeats' median; the run's record says the
    #: same, except under a plan that keeps part of a group).
    nbytes: int
    #: How many times the run made it.
    count_in_run: int
    #: Seconds of each repeat (synchronised on an accelerator: [Note: timing on accelerators]).
    seconds: Samples
    #: Seconds of each floor copy of as many bytes of `to_group`'s host master.
    floor: Samples

    @property
    def change(self) -> str:
        return f"{self.from_group or '-'} -> {self.to_group}"

    @property
    def times_floor(self) -> Samples:
        """Each repeat's seconds over the floor's median."""
        return self.seconds.over(self.floor.median)

    @property
    def comparable(self) -> bool:
        """Whether ``x floor`` measures the copy (see [Note: when x floor means something])."""
        return self.nbytes >= MIN_FLOOR_BYTES and self.floor.median >= MIN_FLOOR_SECONDS


@attrs.frozen(kw_only=True)
class ChangeCosts:
    """What `measure_changes` found: each change of the run made again, the changes it could not
    make again (and why), and the groups the run never loaded."""

    changes: tuple[RepeatedChange, ...]
    #: (change, why) of each change of the run not made again.
    not_repeated: tuple[tuple[str, str], ...] = ()
    #: Groups no transition of the run loaded (no floor was measured for them).
    never_loaded: tuple[str, ...] = ()
    #: Groups whose bytes were still being read from weight files while the floors were measured.
    still_reading: tuple[str, ...] = ()
    repeats: int = REPEATS

    @property
    def times_floor(self) -> float | None:
        """The run's comparable changes at their medians over their floors' medians, each as often
        as the run made it: what the run's loads cost against the floor.  None without any."""
        shown = [c for c in self.changes if c.comparable]
        if not shown:
            return None
        spent = sum(c.seconds.median * c.count_in_run for c in shown)
        return spent / sum(c.floor.median * c.count_in_run for c in shown)


def measure_floor(
    scheduler, names: Iterable[str] | None = None, *, repeats: int = 5
) -> dict[str, float]:
    """Median seconds of a plain copy of each group's host master into one reused device buffer.

        floor = measure_floor(scheduler)        # {"transformer": 0.0081, ...}

    `measure_floors` with medians only.  Refused (`PhaseError`) for a group whose master is still
    read behind the first phase: pass `names` without it.
    """
    floors = measure_floors(scheduler, names, repeats=repeats)
    return {name: samples.median for name, samples in floors.items()}


def measure_floors(
    scheduler, names: Iterable[str] | None = None, *, repeats: int = REPEATS
) -> dict[str, Samples]:
    """`repeats` timed plain copies of each group's host master into one reused device buffer.

        floors = measure_floors(scheduler, ["transformer"])   # {"transformer": Samples(...)}

    The buffer is allocated once (the largest group's size) and warmed by one copy before timing;
    a group of no bytes has no floor.  Call it between phases, after ``scheduler.offload_all()``
    when device memory is tight.  Refused (`PhaseError`, nothing measured) for a group whose
    master is still read behind the first phase (never loaded: it has no chunks yet).
    """
    groups = [scheduler[name] for name in (scheduler if names is None else names)]
    arriving = [group.name for group in groups if group.host_master.arrival is not None]
    if arriving:
        raise PhaseError(f"measure_floor: the host masters of {arriving} are still read behind "
                         "the first phase (never loaded yet); call it after each group's first "
                         "phase")
    wanted = {(group.name, group.host_master.nbytes) for group in groups}
    floors = _floors(scheduler, wanted, repeats)
    return {name: samples for (name, _), samples in floors.items()}


def _floors(scheduler, wanted: Iterable[tuple[str, int]], repeats: int
            ) -> dict[tuple[str, int], Samples]:
    """The floor of each (group, bytes) of `wanted`: timed copies of the first that many bytes
    of the group's host master (a layer-mode or partly kept load moves part of it), into one
    reused device buffer; none for no bytes."""
    wanted = sorted({(name, nbytes) for name, nbytes in wanted if nbytes})
    if not wanted:
        return {}
    buffer = torch.empty(max(nbytes for _, nbytes in wanted), dtype=torch.uint8,
                         device=scheduler.device)
    return {(name, nbytes): _time_copies(buffer, _first_bytes(scheduler[name].host_master.chunks,
                                                              nbytes), scheduler.device, repeats)
            for name, nbytes in wanted}


def _first_bytes(chunks: Sequence[torch.Tensor], nbytes: int) -> list[torch.Tensor]:
    """The chunks cut to their first `nbytes` bytes (views: nothing is copied)."""
    cut, left = [], nbytes
    for chunk in chunks:
        if left <= 0:
            break
        cut.append(chunk[:left])
        left -= chunk.numel()
    return cut


def _time_copies(buffer: torch.Tensor, chunks: Sequence[torch.Tensor], device: torch.device,
                 repeats: int) -> Samples:
    _copy_chunks(buffer, chunks)
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        _copy_chunks(buffer, chunks)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return Samples(seconds)


def _copy_chunks(buffer: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
    offset = 0
    for chunk in chunks:
        buffer[offset : offset + chunk.numel()].copy_(chunk, non_blocking=True)
        offset += chunk.numel()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def wait_for_reads(scheduler, say: Callable[[str], None], *, stall_seconds: float = _STALL_S,
                   poll_seconds: float = _POLL_S) -> tuple[str, ...]:
    """Wait until no group's host master is still read from its weight files (a group a call
    never loaded is read behind it all the same), saying how far the reads are every few seconds;
    returns the groups still reading when the reads made no progress for `stall_seconds`.

        wait_for_reads(scheduler, print)     # () once every read ended

    So the floors are measured with no reading thread taking a core and memory bandwidth.
    """
    last_change, last_read, last_said = time.perf_counter(), -1, 0.0
    while reading := [name for name in scheduler if scheduler[name].host_master.still_reading]:
        read, total = _read_progress(scheduler, reading)
        now = time.perf_counter()
        if read != last_read:
            last_change, last_read = now, read
        elif now - last_change > stall_seconds:
            return tuple(reading)
        if now - last_said >= _SAY_S:
            say(f"waiting for the reads of {', '.join(reading)} ({format_nbytes(read)} of "
                f"{format_nbytes(total)}) before measuring the floor")
            last_said = now
        time.sleep(poll_seconds)
    return ()


def _read_progress(scheduler, names: Sequence[str]) -> tuple[int, int]:
    """(bytes read, bytes in all) of the arriving masters of groups `names`."""
    arrivals = [scheduler[name].host_master.arrival for name in names]
    arrivals = [arrival for arrival in arrivals if arrival is not None]
    return sum(a.read_nbytes for a in arrivals), sum(a.nbytes for a in arrivals)


def measure_changes(scheduler, records: Sequence[TransitionRecord], *,
                    still_reading: Sequence[str] = ()) -> ChangeCosts:
    """Make each distinct phase change of `records` (the run's) again, several times, then time
    the floor of the bytes each one loaded (see [Note: repeated, not once]); every exclusive
    group is offloaded at the end.  Call it with no phase active.

        costs = measure_changes(scheduler, list(scheduler.transitions))
        costs.changes[0].times_floor.median       # 1.31

    A change that loads a resident-policy group (placed once, never evicted) is not made again.
    `still_reading`: the groups `wait_for_reads` gave up on (the report names them).
    """
    made = collections.Counter((r.from_group, r.to_group) for r in records if r.to_group)
    again = [pair for pair in made if _exclusive(scheduler, pair)]
    skipped = [(f"{source or '-'} -> {to}", "a resident-policy group: placed once, never "
                "evicted") for source, to in made if (source, to) not in again]
    repeats = _repeats(scheduler, again)
    scheduler.offload_all()
    timed = {pair: [_time_change(scheduler, *pair) for _ in range(repeats)] for pair in again}
    scheduler.offload_all()
    moved = {pair: statistics.median_low([n for _, n in times]) for pair, times in timed.items()}
    floors = _floors(scheduler, {(pair[1], moved[pair]) for pair in again}, repeats)
    changes = []
    for (source, to), times in timed.items():
        if not moved[(source, to)]:
            skipped.append((f"{source or '-'} -> {to}", "nothing moved when it was made again"))
            continue
        changes.append(RepeatedChange(
            from_group=source, to_group=to, nbytes=moved[(source, to)],
            count_in_run=made[(source, to)], seconds=Samples([seconds for seconds, _ in times]),
            floor=floors[(to, moved[(source, to)])]))
    return ChangeCosts(changes=tuple(changes), not_repeated=tuple(skipped),
                       never_loaded=tuple(name for name in scheduler if name not in
                                          {to for _, to in made}),
                       still_reading=tuple(still_reading), repeats=repeats)


def _exclusive(scheduler, pair: tuple[str | None, str]) -> bool:
    return all(name is None or scheduler[name].policy.value == "exclusive" for name in pair)


def _repeats(scheduler, pairs: Iterable[tuple[str | None, str]]) -> int:
    """`REPEATS`, or `FEW_REPEATS` when one round of `pairs` moves over `ROUND_NBYTES` (each
    change loads its source first).  Bytes only, never time: ranks must agree."""
    round_nbytes = sum(scheduler[to].nbytes + (scheduler[source].nbytes if source else 0)
                       for source, to in pairs)
    return REPEATS if round_nbytes <= ROUND_NBYTES else FEW_REPEATS


def _time_change(scheduler, source: str | None, to: str) -> tuple[float, int]:
    """Seconds and bytes of one change `source` -> `to` made now ((0.0, 0): nothing loaded
    `to`, e.g. a plan that keeps it)."""
    if source is None:
        scheduler.offload_all()
    else:
        with scheduler.resident(source):
            pass
    log, device = scheduler.transitions, scheduler.device
    count = log.count
    _synchronize(device)
    start = time.perf_counter()
    with scheduler.resident(to):
        _synchronize(device)
        seconds = time.perf_counter() - start
    made = [log[-1 - back] for back in range(min(log.count - count, len(log)))]
    record = next((r for r in made if r.to_group == to and r.nbytes), None)
    if record is None:
        return 0.0, 0
    return (seconds if device.type != "cpu" else record.seconds), record.nbytes


# -- the run's rows -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Row:
    """One transition of the run."""

    index: int
    #: Seconds since the first transition of the run.
    at: float
    from_group: str | None
    to_group: str | None
    nbytes: int
    written_back: int
    seconds: float

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.nbytes and self.seconds > 0 else None


def timeline_rows(
    records: Sequence[TransitionRecord],
    recorder: PhaseRecorder | None = None,
    *,
    first_index: int = 0,
) -> list[Row]:
    """One `Row` per record; seconds from the recorder's synchronised entries where it has them.

        rows = timeline_rows(list(scheduler.transitions), recorder)
        rows[0].index, rows[0].to_group           # (1, 'text_encoder')

    `first_index` is the overall index of ``records[0]`` (``log.count - len(log)`` for a log that
    dropped old records).
    """
    synced = {}
    if recorder is not None and recorder.synchronize:
        synced = {s.transition: s.enter_seconds for s in recorder.spans if s.transition is not None}
    origin = records[0].start if records else 0.0
    return [
        Row(index=first_index + offset + 1, at=record.start - origin,
            from_group=record.from_group, to_group=record.to_group, nbytes=record.nbytes,
            written_back=record.written_back,
            seconds=synced.get(first_index + offset, record.seconds))
        for offset, record in enumerate(records)
    ]


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ms(seconds: float) -> str:
    """Milliseconds with about three significant digits: 1240, 23.5, 1.24, 0.152."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else \
        f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}" if ms >= 0.001 else f"{ms:.1e}"


def _ratio(value: float) -> str:
    """A ratio with about three significant digits: 278, 27.0, 1.31."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def format_timeline(rows: Sequence[Row], *, device: torch.device) -> str:
    """The run's transitions as a text table, and their totals.

        print(format_timeline(timeline_rows(records), device=scheduler.device))

    The seconds are the run's own, once each: the ratios to the floor are `format_changes`'s.
    """
    lines = [
        f"phase timeline on {device}: {counted(len(rows), 'transition')} in the run with "
        "offloading, "
        "each timed once",
        f"{'#':>3} {'at ms':>9}  {'transition':<34} {'moved':>10} {'written':>10} {'ms':>9} "
        f"{'GB/s':>7}",
    ]
    for row in rows:
        change = f"{row.from_group or '-'} -> {row.to_group or '-'}"
        lines.append(
            f"{row.index:>3} {row.at * 1e3:>9.2f}  {change:<34} {format_nbytes(row.nbytes):>10} "
            f"{format_nbytes(row.written_back):>10} {row.seconds * 1e3:>9.3f} "
            f"{_number(row.gbps, '.2f'):>7}"
        )
    lines.append(
        f"total: {format_nbytes(sum(row.nbytes for row in rows))} moved in "
        f"{sum(row.seconds for row in rows) * 1e3:.2f} ms, "
        f"{format_nbytes(sum(row.written_back for row in rows))} written back"
    )
    return "\n".join(lines)


# -- the repeated changes -------------------------------------------------------------------------


def _figure(samples: Samples, render: Callable[[float], str]) -> str:
    low, high = samples.spread
    return f"{render(samples.median)} [{render(low)}-{render(high)}]"


def format_changes(costs: ChangeCosts) -> str:
    """The changes `measure_changes` made again, against their floors: medians [min-max], the
    run's loads against the floor, and a legend for every figure left out.

        print(format_changes(measure_changes(scheduler, records)))
    """
    lines = [
        f"phase changes against the floor: each change of the run made again {costs.repeats} "
        f"times after it (resident(...), nothing computed), the floor (a plain copy of as many "
        f"bytes into a reused buffer) copied {costs.repeats} times; medians [min-max]",
        f"    {'transition':<34} {'moved':>10} {'ms':>22} {'floor ms':>22} {'x floor':>20}",
    ]
    for change in costs.changes:
        ratio = _figure(change.times_floor, _ratio) if change.comparable else NOT_MEANINGFUL
        lines.append(f"    {change.change:<34} {format_nbytes(change.nbytes):>10} "
                     f"{_figure(change.seconds, _ms):>22} {_figure(change.floor, _ms):>22} "
                     f"{ratio:>20}")
    ratio = costs.times_floor
    if ratio is not None:
        lines.append(f"  the run's loads of {MIN_FLOOR_BYTES >> 20} MiB and more at these medians: "
                     f"x{ratio:.2f} the floor (each change as often as the run made it)")
    lines += _legend(costs)
    return "\n".join(lines)


def _legend(costs: ChangeCosts) -> list[str]:
    """Why figures are left out or differ, each line only where it applies."""
    lines = []
    noise = [change for change in costs.changes if not change.comparable]
    if noise:
        took = Samples([change.seconds.median for change in noise])
        floors = Samples([change.floor.median for change in noise])
        lines.append(
            f"  x floor left out ({NOT_MEANINGFUL}) for a load under {MIN_FLOOR_BYTES >> 20} MiB "
            f"or a floor under {MIN_FLOOR_SECONDS * 1e6:.0f} us: such a change took "
            f"{_ms(took.spread[0])}-{_ms(took.spread[1])} ms here (medians), its copy's floor "
            f"{_ms(floors.spread[0])}-{_ms(floors.spread[1])} ms, so its time is what a change "
            "costs besides the copy (edit detection's digests, torch's thread wake-ups, the lock, "
            "re-pointing each tensor), and the ratio would say nothing about the copy")
    if any(change.from_group is None for change in costs.changes):
        lines.append("  a change from - (nothing on the device) follows offload_all, which frees "
                     "the shared device storage: like the run's, it allocates that storage again")
    lines += [f"  not made again: {change} ({why})" for change, why in costs.not_repeated]
    if costs.never_loaded:
        them = "them" if len(costs.never_loaded) > 1 else "it"
        lines.append(f"  not loaded by this run: {', '.join(costs.never_loaded)} (no change of "
                     f"the run loaded {them}: no floor measured)")
    if costs.still_reading:
        lines.append(f"  the floors were measured while the reads of "
                     f"{', '.join(costs.still_reading)} from their weight files went on (they "
                     "made no progress for a minute): those reads took a core")
    return lines


def format_device_bytes(*, plain: int | None, storage_peak: int, allocator_peak: int | None,
                        device: torch.device) -> str:
    """The device bytes the runs held, without offloading and with it: one line.

        format_device_bytes(plain=2**30, storage_peak=2**29, allocator_peak=None, device=cpu)
        # 'device bytes: 1.0 GiB without offloading (the model's weights), 512.0 MiB with ...'

    `plain` is the model's bytes on the CPU, the allocator's peak on an accelerator (None: the
    run without offloading was skipped); `storage_peak` the most the scheduler's storages held.
    """
    storages = (f"{format_nbytes(storage_peak)} at most in the scheduler's storages (packed "
                "loads, with their padding)")
    if allocator_peak is None:  # the CPU: weights only, on both sides
        with_ = storages
        kind = "the model's weights"
    else:
        with_ = (f"{format_nbytes(allocator_peak)} (allocator peak: weights and activations; "
                 f"{storages})")
        kind = "allocator peak: weights and activations"
    if plain is None:
        return f"device bytes: with offloading {with_}; without: not measured (--no-check)"
    return (f"device bytes: {format_nbytes(plain)} without offloading ({kind}), "
            f"{with_} with offloading")


def write_trace(
    path: str | Path,
    records: Iterable[TransitionRecord],
    spans: Iterable[PhaseSpan] = (),
    blocks: Iterable[BlockRecord] = (),
) -> dict:
    """Write a Chrome/Perfetto trace of transfers, resident groups, the recorded phases and
    layer mode's block moves (``scheduler.block_records``)."""
    phases = [(span.name, span.start, span.end) for span in spans]
    return chrome_trace(records, phases, path, blocks)
