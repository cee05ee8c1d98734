"""The phase timeline: what each phase change of a run moved and cost, against a copy floor.

    recorder = PhaseRecorder(scheduler)             # a drop-in `scheduler` that times each phase
    pipe.offload = recorder
    pipe(prompt)
    floor = measure_floor(scheduler)                 # same bytes, plain copies, this run
    print(format_timeline(timeline_rows(scheduler.transitions, floor, recorder), ...))
    write_trace("trace.json", scheduler.transitions, recorder.spans)

The *floor* of a transition is a plain copy of the same bytes (the group's host master chunks) into
a reused device buffer, measured in the same process right after the run; ``x floor`` is how many
times slower the real transition was.  Everything above 1.0 is overhead (see docs/design.md).

[Note: when x floor means something]
A phase change also pays fixed costs that do not grow with its bytes: Python, the lock, re-pointing
each tensor (~1 us apiece, see docs/design.md).  For a group of a few KiB the floor copy takes a
microsecond or two and those fixed costs alone make the ratio 100x or more (418x on 9 KiB), which
says nothing about how the copy performs.  So ``x floor`` is shown only for a load of at least
`MIN_FLOOR_BYTES` whose floor takes at least `MIN_FLOOR_SECONDS`; other rows print "—", and the
total ratio counts only the rows shown.

[Note: timing on accelerators]
A scheduler's `TransitionRecord` times cover *issuing* an accelerator copy, which runs on a side
stream.  To time the copy itself, `PhaseRecorder(synchronize=True)` waits for the device before a
phase is entered (so earlier compute is not counted) and again after (so the copy is); the rows then
carry those synchronised seconds.  On the host the copy is done when the record is made, and no
synchronisation is needed.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import torch

from residency.engine.budget import format_nbytes
from residency.engine.errors import PhaseError
from residency.engine.records import BlockRecord, TransitionRecord, chrome_trace

__all__ = [
    "PhaseRecorder",
    "PhaseSpan",
    "Row",
    "format_timeline",
    "measure_floor",
    "timeline_rows",
    "write_trace",
]

#: A load must move at least this many bytes for ``x floor`` to be shown (see [Note: when x floor
#: means something]).
MIN_FLOOR_BYTES = 1 << 20
#: ...and its floor copy must take at least this long: well above the fixed costs of a change.
MIN_FLOOR_SECONDS = 100e-6
#: What the ``x floor`` column prints for a row whose ratio would not mean anything.
NOT_MEANINGFUL = "—"


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

    def _sync(self) -> None:
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
        recorder._sync()
        self._start = time.perf_counter()
        group = self._phase.__enter__()
        recorder._sync()
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


def measure_floor(
    scheduler, names: Iterable[str] | None = None, *, repeats: int = 5
) -> dict[str, float]:
    """Median seconds of a plain copy of each group's host master into one reused device buffer.

        floor = measure_floor(scheduler)        # {"transformer": 0.0081, ...}

    The buffer is allocated once (the largest group's size) and warmed by one copy before timing.
    Call it between phases, after ``scheduler.offload_all()`` when device memory is tight.
    """
    groups = [scheduler[name] for name in (scheduler if names is None else names)]
    arriving = [group.name for group in groups if group.host_master.arrival is not None]
    if arriving:
        raise PhaseError(f"measure_floor: the host masters of {arriving} are still read behind "
                         "the first phase (never loaded yet); call it after each group's first "
                         "phase")
    sizes = [group.host_master.nbytes for group in groups]
    if not groups or max(sizes) == 0:
        return {}
    buffer = torch.empty(max(sizes), dtype=torch.uint8, device=scheduler.device)
    floor = {}
    for group in groups:
        _copy_chunks(buffer, group.host_master.chunks)
        seconds = []
        for _ in range(repeats):
            _synchronize(scheduler.device)
            start = time.perf_counter()
            _copy_chunks(buffer, group.host_master.chunks)
            _synchronize(scheduler.device)
            seconds.append(time.perf_counter() - start)
        floor[group.name] = statistics.median(seconds)
    return floor


def _copy_chunks(buffer: torch.Tensor, chunks: Sequence[torch.Tensor]) -> None:
    offset = 0
    for chunk in chunks:
        buffer[offset : offset + chunk.numel()].copy_(chunk, non_blocking=True)
        offset += chunk.numel()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


@attrs.frozen(kw_only=True)
class Row:
    """One transition of the timeline."""

    index: int
    #: Seconds since the first transition of the run.
    at: float
    from_group: str | None
    to_group: str | None
    nbytes: int
    written_back: int
    seconds: float
    #: Seconds of the floor copy of the same bytes (None when nothing was loaded).
    floor_seconds: float | None

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.nbytes and self.seconds > 0 else None

    @property
    def floor_gbps(self) -> float | None:
        if not self.nbytes or not self.floor_seconds:
            return None
        return self.nbytes / self.floor_seconds / 1e9

    @property
    def times_floor(self) -> float | None:
        return self.seconds / self.floor_seconds if self.nbytes and self.floor_seconds else None

    @property
    def floor_comparable(self) -> bool:
        """Whether the load is big enough for ``x floor`` to measure the copy, not fixed costs."""
        return (self.nbytes >= MIN_FLOOR_BYTES and self.floor_seconds is not None
                and self.floor_seconds >= MIN_FLOOR_SECONDS)


def timeline_rows(
    records: Sequence[TransitionRecord],
    floor: dict[str, float],
    recorder: PhaseRecorder | None = None,
    *,
    first_index: int = 0,
) -> list[Row]:
    """One `Row` per record; seconds from the recorder's synchronised entries where it has them.

    `first_index` is the overall index of ``records[0]`` (``log.count - len(log)`` for a log that
    dropped old records).
    """
    synced = {}
    if recorder is not None and recorder.synchronize:
        synced = {s.transition: s.enter_seconds for s in recorder.spans if s.transition is not None}
    origin = records[0].start if records else 0.0
    rows = []
    for offset, record in enumerate(records):
        index = first_index + offset
        rows.append(
            Row(index=index + 1, at=record.start - origin, from_group=record.from_group,
                to_group=record.to_group, nbytes=record.nbytes,
                written_back=record.written_back, seconds=synced.get(index, record.seconds),
                floor_seconds=floor.get(record.to_group) if record.to_group else None)
        )
    return rows


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _times_floor(row: Row) -> str:
    if row.times_floor is not None and not row.floor_comparable:
        return NOT_MEANINGFUL
    return _number(row.times_floor, ".2f")


def format_timeline(rows: Sequence[Row], *, peak_device_bytes: int, device: torch.device,
                    allocator_peak: int | None = None) -> str:
    """The timeline as a text table with totals, the floor ratio and peak device bytes."""
    lines = [
        f"phase timeline on {device}: {len(rows)} transition(s); floor = a plain copy of the same "
        "bytes into a reused buffer, this run",
        f"{'#':>3} {'at ms':>9}  {'transition':<34} {'moved':>10} {'written':>10} {'ms':>9} "
        f"{'GB/s':>7} {'floor GB/s':>10} {'x floor':>8}",
    ]
    for row in rows:
        change = f"{row.from_group or '-'} -> {row.to_group or '-'}"
        lines.append(
            f"{row.index:>3} {row.at * 1e3:>9.2f}  {change:<34} {format_nbytes(row.nbytes):>10} "
            f"{format_nbytes(row.written_back):>10} {row.seconds * 1e3:>9.3f} "
            f"{_number(row.gbps, '.2f'):>7} {_number(row.floor_gbps, '.2f'):>10} "
            f"{_times_floor(row):>8}"
        )
    loads = [row for row in rows if row.floor_comparable]
    moved = sum(row.nbytes for row in rows)
    seconds = sum(row.seconds for row in rows)
    ratio = (sum(r.seconds for r in loads) / sum(r.floor_seconds for r in loads)) if loads else None
    lines.append(
        f"total: {format_nbytes(moved)} moved in {seconds * 1e3:.2f} ms "
        f"(x{NOT_MEANINGFUL if ratio is None else format(ratio, '.2f')} the floor), "
        f"{format_nbytes(sum(row.written_back for row in rows))} written back"
    )
    peak = f"peak device bytes: {format_nbytes(peak_device_bytes)} in the scheduler's storages"
    if allocator_peak is not None:
        peak += f"; allocator peak {format_nbytes(allocator_peak)} (weights and activations)"
    lines.append(peak)
    if any(row.times_floor is not None and not row.floor_comparable for row in rows):
        lines.append(
            f"{NOT_MEANINGFUL} in x floor: a load under {MIN_FLOOR_BYTES >> 20} MiB or with a "
            f"floor under {MIN_FLOOR_SECONDS * 1e6:.0f} us, where the fixed cost of a phase change (tens "
            "of microseconds) swamps the copy and the ratio would say nothing about it"
        )
    return "\n".join(lines)


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
