"""Transition records: what each phase change moved and what it cost, and ways to read them.

The scheduler appends one `TransitionRecord` per phase change to a bounded log (the newest
``record_limit`` are kept; the totals count every transition).  ``summarize`` turns records into
medians and GB/s; ``chrome_trace`` turns them into a trace that chrome://tracing and Perfetto open.
"""

from __future__ import annotations

import collections
import threading
import json
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

from residency.core.locks import locked

__all__ = [
    "BlockLog",
    "BlockRecord",
    "CallLog",
    "CallRecord",
    "TransitionLog",
    "TransitionRecord",
    "TurnChoice",
    "WaitStats",
    "chrome_trace",
    "summarize",
]


@attrs.frozen(kw_only=True)
class TurnChoice:
    """Why a waiting thread's group was made current: the `order` of turns ("group",
    "arrival"), the `reason` ("first come", "most waiting work", "waited past max_wait") and how
    many threads were `waiting` then, it included (`residency.scheduler.holds`)."""

    order: str
    reason: str
    waiting: int


@attrs.frozen(kw_only=True)
class TransitionRecord:
    """One phase change: the group that left, the group that came, bytes and seconds.

    Times are host wall-clock seconds from ``time.perf_counter``.  On an accelerator the copy is
    asynchronous, so ``load_seconds`` covers issuing it; the copy itself shows on the device timeline.
    """

    #: The exclusive group evicted, or None when nothing was resident.
    from_group: str | None
    #: The exclusive group loaded, or None for a plain eviction (``offload_all``).
    to_group: str | None
    #: Bytes copied host-to-device to load `to_group`.
    nbytes: int
    #: Bytes copied device-to-host because they changed while `from_group` was resident.
    written_back: int
    #: perf_counter() at the start of the transition.
    start: float
    evict_seconds: float
    load_seconds: float
    #: Name of the thread that made the change.
    thread: str
    #: The order of turns that chose this change ("group", "arrival"); None when no thread's
    #: turn did (``offload_all``, a re-plan, a group placed at ``add``).
    order: str | None = None
    #: Why the order chose it: "first come", "most waiting work", "waited past max_wait".
    reason: str | None = None
    #: Threads waiting for a turn when it was chosen (the one served included).
    waiting: int = 0

    @property
    def seconds(self) -> float:
        """Total time of the transition (eviction plus load)."""
        return self.evict_seconds + self.load_seconds

    @property
    def bandwidth(self) -> float:
        """Bytes loaded per second of load time (0.0 for an empty load)."""
        return self.nbytes / self.load_seconds if self.load_seconds > 0 else 0.0


class _KeptLog:
    """The newest `limit` entries, newest last, behind a small lock of the log's own.

    Appended to by the scheduler (under its lock) and read by anyone: the log's lock makes a
    reader's iteration a snapshot, so a loop over the records while another thread changes phases
    sees whole records, never a deque mutated under it.  Subclasses keep running totals over
    every entry ever appended, which `clear` leaves alone.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._records: collections.deque = collections.deque(maxlen=limit)

    def clear(self) -> None:
        """Forget the kept records (the totals stay)."""
        locked(self._lock, self._records.clear)

    def _snapshot(self) -> list:
        return locked(self._lock, list, self._records)

    def __len__(self) -> int:
        return len(self._records)


class TransitionLog(_KeptLog):
    """The newest `limit` transition records plus running totals over every transition made."""

    def __init__(self, limit: int = 10_000) -> None:
        super().__init__(limit)
        #: Transitions made since the scheduler was created (not bounded by `limit`).
        self.count = 0
        #: Bytes loaded over all transitions.
        self.nbytes = 0
        #: Bytes and load seconds of the transitions whose load moved bytes in a measured time
        #: (``load_seconds > 0``), over all of them: what an auto plan takes the copy bandwidth
        #: from (`residency.auto.auto`).
        self.timed_nbytes, self.timed_seconds = 0, 0.0

    def append(self, record: TransitionRecord) -> None:
        locked(self._lock, self._append, record)

    def _append(self, record: TransitionRecord) -> None:
        timed = record.nbytes > 0 and record.load_seconds > 0
        timed_nbytes, timed_seconds = (record.nbytes, record.load_seconds) if timed else (0, 0.0)
        self._records.append(record)
        self.count, self.nbytes, self.timed_nbytes, self.timed_seconds = (
            self.count + 1, self.nbytes + record.nbytes, self.timed_nbytes + timed_nbytes,
            self.timed_seconds + timed_seconds)  # one store: [Note: interrupts] in the facade

    def __iter__(self) -> Iterator[TransitionRecord]:
        return iter(self._snapshot())

    def __getitem__(self, index: int) -> TransitionRecord:
        return locked(self._lock, self._records.__getitem__, index)

    def __repr__(self) -> str:
        return f"<TransitionLog {len(self)} kept of {self.count}, {self.nbytes} bytes loaded>"


@attrs.frozen(slots=True, kw_only=True)
class BlockRecord:
    """One move of a layer-mode block, or the start of its compute (`residency.placement.layers`).

    ``kind``: "prefetch" (its copy issued ahead, into `slot`), "load" (copied on demand: it was
    not the next block), "compute" (its forward starts, the copy waited for), "evict" (it left
    its slot; `nbytes` written back).  `time` is ``time.perf_counter()`` when it was issued: on an
    accelerator the copy itself runs later, on the copy stream.
    """

    group: str
    #: The block's name: "<model>.<list>.<i>", e.g. "transformer.blocks.3".
    block: str
    #: Its position in the streaming order.
    index: int
    kind: str
    slot: int | None
    #: Bytes copied host to device ("prefetch", "load") or written back ("evict").
    nbytes: int
    time: float


#: `BlockRecord`'s fields in order: a `BlockLog` keeps each record as a tuple of them.
_BLOCK_FIELDS = tuple(field.name for field in attrs.fields(BlockRecord))


class BlockLog(_KeptLog):
    """The newest `limit` block records, with running totals (shared by a scheduler's groups).

    Kept as plain tuples of `BlockRecord`'s fields (a few per block per step: building a
    `BlockRecord` each time would cost microseconds on the hot path); iterating builds the records.
    """

    def __init__(self, limit: int = 10_000) -> None:
        super().__init__(limit)
        #: Block copies host to device since the scheduler was created, and their bytes.
        self.copies = 0
        self.nbytes = 0

    def add(self, group: str, block: str, index: int, kind: str, slot: int | None,
            nbytes: int) -> None:
        """Record one block event now (`BlockRecord`'s fields; the time is taken here)."""
        fields = (group, block, index, kind, slot, nbytes, time.perf_counter())
        locked(self._lock, self._add, fields)

    def _add(self, fields: tuple) -> None:
        self._records.append(fields)
        if fields[3] == "prefetch" or fields[3] == "load":
            self.copies, self.nbytes = self.copies + 1, self.nbytes + fields[5]

    def __iter__(self) -> Iterator[BlockRecord]:
        return iter([BlockRecord(**dict(zip(_BLOCK_FIELDS, fields)))
                     for fields in self._snapshot()])

    def __repr__(self) -> str:
        return f"<BlockLog {len(self)} kept, {self.copies} block copies, {self.nbytes} bytes>"


@attrs.frozen(kw_only=True)
class CallRecord:
    """One call (a ``pipe(...)``, or what `Scheduler.call` marks): its bytes and its span.

        record = scheduler.calls[-1]
        record.nbytes, record.seconds, record.ending    # 84934656, 1.93, "returned"

    `nbytes` are the host-to-device bytes the records show from the end of the call before (the
    first call: its beginning) to this call's end - transitions' and block copies' alike - so the
    calls' bytes sum to the records'.  `seconds` is the span from its beginning to its end.
    [Note: what a call is] in `residency.group.calls`.
    """

    #: Which call: 1 for the first begun, in the order calls began.
    number: int
    nbytes: int
    seconds: float
    #: "returned", "raised", "found" (seen ended afterwards: its seconds run to then), or
    #: "next call" (a call without an explicit end: it ends where the next one begins).
    ending: str
    #: Whether another call was open at some instant of this one (concurrent requests).
    overlapped: bool = False
    #: perf_counter() at its beginning.
    start: float = 0.0


class CallLog(_KeptLog):
    """The newest `limit` call records plus running totals over every call ended.

        scheduler.calls.count, scheduler.calls.nbytes, scheduler.calls.seconds
    """

    def __init__(self, limit: int = 10_000) -> None:
        super().__init__(limit)
        #: Calls ended since the scheduler was created, their bytes and their seconds.
        self.count, self.nbytes, self.seconds = 0, 0, 0.0
        #: The newest record counted, or None: the log's commit point.  A record the deque holds
        #: past it was appended by an `append` an interrupt cut short, and is dropped.
        self.newest: CallRecord | None = None

    def append(self, record: CallRecord) -> None:
        """Count `record`: it is in the totals and `newest` exactly when this returns."""
        locked(self._lock, self._append, record)

    def _append(self, record: CallRecord) -> None:
        self._forget_uncounted()
        self._records.append(record)
        self.count, self.nbytes, self.seconds, self.newest = (  # one store: [Note: interrupts]
            self.count + 1, self.nbytes + record.nbytes, self.seconds + record.seconds, record)

    def _forget_uncounted(self) -> None:
        if self._records and self._records[-1] is not self.newest:
            self._records.pop()

    def _snapshot(self) -> list:
        kept = locked(self._lock, list, self._records)
        return kept if not kept or kept[-1] is self.newest else kept[:-1]

    def __len__(self) -> int:
        kept = len(self._records)
        return kept - (kept > 0 and self._records[-1] is not self.newest)

    def __iter__(self) -> Iterator[CallRecord]:
        return iter(self._snapshot())

    def __getitem__(self, index: int | slice) -> CallRecord | list[CallRecord]:
        """A record by position among the kept ones (``[-1]``: the newest), or a list of them."""
        return self._snapshot()[index]

    def __repr__(self) -> str:
        return f"<CallLog {len(self)} kept of {self.count}, {self.nbytes} bytes moved>"


@attrs.frozen(kw_only=True)
class WaitStats:
    """One group's phase entries and how long they waited for their turn (`Scheduler.waits`).

        stats = scheduler.waits["high"]
        stats.entries, stats.waits, stats.p99    # 50 entries, 7 waited, the slowest 1% in seconds

    `waits` counts entries that waited behind another group's holders or turn; the seconds are
    over the newest ``record_limit`` of those waits (0.0 when none waited).
    """

    #: Phases of the group entered (re-entries of a held group included).
    entries: int
    #: Entries that had to wait for their turn.
    waits: int
    #: Median wait, in seconds.
    p50: float
    #: 99th percentile wait, in seconds (nearest rank).
    p99: float
    #: Longest wait kept, in seconds.
    max: float


def summarize(records: Iterable[TransitionRecord]) -> dict:
    """Per (from, to) pair: count, median seconds, median GB/s, bytes; and overall totals."""
    by_pair: dict[tuple, list[TransitionRecord]] = collections.defaultdict(list)
    for record in records:
        by_pair[(record.from_group, record.to_group)].append(record)
    pairs = []
    for (source, target), group in by_pair.items():
        loads = [r for r in group if r.nbytes]
        pairs.append(
            {
                "from": source,
                "to": target,
                "count": len(group),
                "nbytes": group[0].nbytes,
                "median_seconds": statistics.median(r.seconds for r in group),
                "median_gbps": statistics.median(r.bandwidth for r in loads) / 1e9 if loads else 0.0,
            }
        )
    everything = [r for group in by_pair.values() for r in group]
    return {
        "transitions": len(everything),
        "nbytes": sum(r.nbytes for r in everything),
        "written_back": sum(r.written_back for r in everything),
        "seconds": sum(r.seconds for r in everything),
        "pairs": pairs,
    }


def chrome_trace(
    records: Iterable[TransitionRecord],
    phases: Iterable[tuple[str, float, float]] = (),
    path: str | Path | None = None,
    blocks: Iterable[BlockRecord] = (),
) -> dict:
    """A Chrome/Perfetto trace of transfers, of when each group was resident, and of phases.

    One slice per eviction and load (on the thread that made it), a "resident <group>" slice from
    each load until that group's eviction, one slice per (name, start, end) phase given, and an
    instant per layer-mode block record (`blocks`, e.g. ``scheduler.block_records``).
    Thread ids are integers with names, as Perfetto's JSON importer wants.  Written to `path` as
    JSON when given; returned as a dict either way.
    """
    records = list(records)
    phases = list(phases)
    end = max([r.start + r.seconds for r in records] + [e for _, _, e in phases], default=0.0)
    events = []
    for record in records:
        if record.from_group is not None:
            events.append(_slice(f"evict {record.from_group}", "transfer", record.start,
                                 record.evict_seconds, record.thread,
                                 {"written_back": record.written_back}))
        if record.to_group is not None:
            events.append(_slice(f"load {record.to_group}", "transfer",
                                 record.start + record.evict_seconds, record.load_seconds,
                                 record.thread, {"nbytes": record.nbytes}))
    events += _resident_slices(records, end)
    for name, start, stop in phases:
        events.append(_slice(name, "phase", start, stop - start, "phases", {}))
    for block in blocks:
        events.append({"name": f"{block.kind} {block.block}", "cat": "block", "ph": "i",
                       "s": "t", "ts": block.time * 1e6, "pid": 0, "tid": f"blocks {block.group}",
                       "args": {"slot": block.slot, "nbytes": block.nbytes}})
    trace = {"traceEvents": _with_thread_ids(events), "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def _resident_slices(records: list[TransitionRecord], end: float) -> list[dict]:
    """A "resident <group>" slice per load: from its end until the group is evicted (or `end`)."""
    slices = []
    for position, record in enumerate(records):
        if record.to_group is None:
            continue
        start = record.start + record.seconds
        evicted = next((later.start for later in records[position + 1 :]
                        if later.from_group == record.to_group), end)
        slices.append(_slice(f"resident {record.to_group}", "residency", start,
                             max(evicted - start, 0.0), "resident groups",
                             {"nbytes": record.nbytes}))
    return slices


def _with_thread_ids(events: list[dict]) -> list[dict]:
    """Replace track names by integer thread ids and add the metadata that names them."""
    tids: dict[str, int] = {}
    for event in events:
        event["tid"] = tids.setdefault(str(event["tid"]), len(tids) + 1)
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
             for name, tid in tids.items()]
    process = {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "residency"}}
    return events + names + [process]


def _slice(name: str, category: str, start: float, seconds: float, track: str, args: dict) -> dict:
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": start * 1e6,
        "dur": seconds * 1e6,
        "pid": 0,
        "tid": track,
        "args": args,
    }
