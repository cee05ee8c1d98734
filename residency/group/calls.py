"""Calls: where one use of the pipeline begins and ends, and what it moved.

    with scheduler.call():                     # one request: every phase it enters (a `Call`)
        with scheduler.resident("encoder"): ...
        with scheduler.resident("transformer"): ...
    scheduler.calls[-1].nbytes, scheduler.calls[-1].seconds

[Note: what a call is]
A call is one use of the whole pipeline: a diffusers ``pipe(...)`` (the adapter marks it:
`residency.adapters.pipeline_calls`), a ``with scheduler.call():`` block, or - on an auto
scheduler whose calls nobody marks - the span from one beginning of the phase order's first group
(after another group was current) to the next.  Once a call was marked, only marked calls count.

* Bytes: the host-to-device bytes the records show (`TransitionLog.nbytes` + `BlockLog.nbytes`,
  running totals) from the end of the call before to this call's end; the first call counts
  from its beginning.  A re-plan's loads, a prefetch between calls: all land in the next call, so
  the calls' bytes sum to the records' from the first call on.
* Seconds: from the call's beginning to its end, host time outside phases included.
* Overlap: calls of several threads (concurrent requests, under either order of turns) may be
  open at once.  Each keeps its own span; its bytes are still those since the previous end, of
  whichever call, so the sum holds; a call open while another was is marked ``overlapped``,
  and the auto plan learns nothing from it (its phases and bytes are mixed with the others').
* Ending: "returned" or "raised" where the end was seen when it happened; "found" where it was
  seen afterwards (a diffusers call that raised outside its boundary steps: its seconds run to
  when it was found, and the plan learns nothing from it); "next call" for the unmarked calls of
  an auto scheduler.

* One call per thread at a time: a call that begins on a thread where another is still open
  ends that one "found" first.  So a call left open by an interrupt (between its beginning and
  the line that would remember it) is closed by the thread's next call, and never marks every
  later call as overlapped.

[Note: one commit point]
An interrupt can land between any two lines (see [Note: interrupts] in
`residency.scheduler.scheduler`), so a call's end is counted by one store: the log's `append`
(`CallLog.newest` and its totals, in one line).  The open calls and the bytes at the last end
follow from it: `_settle`, run at the start of every `begin` and `end` and again after the
append, closes the call the log counted last.  An end cut short before the append counts
nothing (the call is still open: its next end, or its thread's next call, counts it once); one
cut short after it has counted the call exactly once.  A `begin` computes first and stores its
fields in one line.

Fields (guarded by the scheduler lock; `Calls` is their one mutator): ``log`` (its `CallLog`),
``_open`` (each open call's number: its beginning and thread), ``_overlapped`` (open calls that
overlapped another), ``_moved_at_end`` (the records' bytes at the last end, None before the
first call), ``_begun``, ``marked``.
"""

from __future__ import annotations

import threading
import time

from residency.core.errors import PhaseError
from residency.core.locks import locked
from residency.group.records import BlockLog, CallLog, CallRecord, TransitionLog

__all__ = ["Call", "Calls"]

#: How a call may end (`CallRecord.ending`).
ENDINGS = ("returned", "raised", "found", "next call")


class Calls:
    """The scheduler's calls: their beginnings and ends, and the `CallLog` (see the Note)."""

    def __init__(self, transitions: TransitionLog, block_log: BlockLog, limit: int) -> None:
        #: The records whose running totals give a call's bytes (read, never written, here).
        self.transitions, self.block_log = transitions, block_log
        #: Every ended call: the newest `limit` records and the totals.
        self.log = CallLog(limit)
        #: Whether a call was ever marked (`Call`): unmarked boundaries are then ignored.
        self.marked = False
        self._open: dict[int, float] = {}
        self._overlapped: set[int] = set()
        self._moved_at_end: int | None = None
        self._begun = 0

    @property
    def open(self) -> int:
        """How many calls are open now."""
        newest = self.log.newest
        return len(self._open) - (newest is not None and newest.number in self._open)

    def moved(self) -> int:
        """The records' host-to-device bytes so far (transitions' and block copies')."""
        return self.transitions.nbytes + self.block_log.nbytes

    def begin(self, *, marked: bool) -> tuple[int, CallRecord | None]:
        """Open a call now on this thread: its number, and the record of the call this thread
        still had open (ended "found": one call per thread at a time), if any."""
        self._settle()
        thread = threading.get_ident()
        left = next((n for n, (_, t) in self._open.items() if t == thread), None)
        found = None if left is None else self.end(left, "found")
        number = self._begun + 1
        moved_at_end = self.moved() if self._moved_at_end is None else self._moved_at_end
        overlapped = self._overlapped | ({*self._open, number} if self._open else set())
        opened = {**self._open, number: (time.perf_counter(), thread)}
        self._open, self._overlapped, self._moved_at_end, self._begun, self.marked = (  # one store
            opened, overlapped, moved_at_end, number, self.marked or marked)
        return number, found

    def end(self, number: int, ending: str) -> CallRecord | None:
        """Close call `number` now; its record (counted in the log), or None when it is not
        open (a later call on its thread found it ended).  The log's `append` is the one commit
        point (see [Note: one commit point])."""
        self._settle()
        if number not in self._open:
            newest = self.log.newest  # an end an interrupt cut short after its commit
            return newest if newest is not None and newest.number == number else None
        start = self._open[number][0]
        record = CallRecord(number=number, nbytes=self.moved() - self._moved_at_end,
                            seconds=time.perf_counter() - start, ending=ending,
                            overlapped=number in self._overlapped, start=start)
        self.log.append(record)
        self._settle()
        return record

    def _settle(self) -> None:
        """Make the open calls agree with the log: a call the log counted is no longer open."""
        newest = self.log.newest
        if newest is None or newest.number not in self._open:
            return
        still_open = {n: entry for n, entry in self._open.items() if n != newest.number}
        self._open, self._overlapped, self._moved_at_end = (  # one store
            still_open, self._overlapped - {newest.number}, self._moved_at_end + newest.nbytes)

    def __repr__(self) -> str:
        return f"<Calls {self._begun} begun, {len(self._open)} open>"


class Call:
    """One call marked by hand (`Scheduler.call`): ``with`` it, or `begin` and `end` it.

        with scheduler.call():
            image = pipeline(prompt)

    A call begins once and ends once: `end` of a call that never began or has ended, a second
    `begin`, or an unknown ending raises `PhaseError` with nothing recorded.  `gate` is the
    scheduler's `PhaseGate` (its ``begin_call`` and ``end_call`` run under its lock).
    """

    __slots__ = ("_gate", "number", "record")

    def __init__(self, gate) -> None:
        self._gate = gate
        #: Its number once begun (`CallRecord.number`), else None.
        self.number: int | None = None
        #: Its record once ended, else None.
        self.record: CallRecord | None = None

    def begin(self) -> Call:
        if self.number is not None:
            raise PhaseError(f"call {self.number} has already begun; make a new one with "
                             "scheduler.call() for the next request")
        self.number = locked(self._gate.lock, self._gate.begin_call)
        return self

    def end(self, ending: str = "returned") -> CallRecord:
        if ending not in ENDINGS[:3]:
            raise PhaseError(f"a call ends {' or '.join(map(repr, ENDINGS[:3]))}, not {ending!r}")
        if self.number is None or self.record is not None:
            state = "has not begun" if self.number is None else "has already ended"
            raise PhaseError(f"this call {state}: begin() a call once and end() it once")
        record = locked(self._gate.lock, self._gate.end_call, self.number, ending)
        if record is None:
            raise PhaseError(f"call {self.number} was already ended (\"found\") when a later "
                             "call began on its thread: one call per thread at a time")
        self.record = record
        return record

    def __enter__(self) -> Call:
        return self.begin()

    def __exit__(self, kind, error, trace) -> None:
        self.end("returned" if kind is None else "raised")

    def __repr__(self) -> str:
        state = ("not begun" if self.number is None else
                 f"call {self.number}, open" if self.record is None else f"{self.record}")
        return f"<Call {state}>"
