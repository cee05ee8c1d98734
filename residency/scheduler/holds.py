"""The turns layer: who may run and who goes next.  Every thread's open phases, who holds the
current group, the queue (`Holds`), and the order of turns that decides which waiter goes
(`GroupTurns`, `ArrivalTurns`: first come or by group).

    order = turns_for(TurnOrder(by="group", max_wait=0.5))
    holds = Holds(lock, placement, registry, wait_timeout=None, turns=order, waits=WaitLog())
    joined = holds.join(phase)    # its group, or a Turn: made current, then `grant`ed

The order of turns only answers "may this ticket go now?" and "when could the answer change
without anyone leaving?", and learns when threads leave a group (`left`) or ask for one
(`asked`), told by the holds under the scheduler's lock.  Nothing here moves bytes.

[Note: holds, nesting and threads]
A thread *holds* the group of its innermost open phase.  A group can only be evicted when nobody
holds it.  Entering a phase of another group first gives up the thread's own hold (a nested phase
suspends the outer one), then waits for its turn: until the current group has no holders; the gate
then has the placement swap.  Leaving the nested phase gives up its hold and takes the outer group
back, swapping again if needed.  Because a
waiting thread never holds anything, threads cannot deadlock on each other through the scheduler.
In which order waiters are served is the order of turns' answer ([Note: group order] below:
by group, or first come); a thread asking for the group already on the device while nobody waits
joins it at once.

What can still hang is a hold that is never released: a thread that ended inside a phase (a phase
must be left on the thread that entered it).  Waiters notice such holds and raise `DeadlockError`;
``wait_timeout`` turns any longer wait into a `DeadlockError` too.

[Note: misnested exits]
Leaving a phase while a phase inside it is still open (possible without ``with``: generators,
``ExitStack`` misuse) is refused with `PhaseError` and changes nothing now: the inner phases'
code may still be running and must keep its weights.  The phase is marked LEAVING and closes by
itself the moment the phases inside it have been left - so after a misnested ``with`` the thread
does not hold its group forever: once the inner phases exit, the holds are empty and other threads
can enter any group.  Leaving it again afterwards does nothing (a ``with`` statement never calls
``__exit__`` twice, so a caller that retries must not be punished).  Leaving a phase on a thread
that did not enter it raises and changes nothing: that thread's frames are not ours to touch.

A phase whose ``with`` statement ended without a completed exit (an interrupt at the first line
of ``Phase.__exit__``) is *abandoned*: nothing refers to it but its frame.  It is closed by the
next call that meets it (`collect_abandoned`; see [Note: interrupts] in the facade),
and its thread's hold goes with it.

Fields (every one guarded by the scheduler lock; `Holds` is their one mutator):

* ``_threads``: thread -> `ThreadHolds`, for each thread with an open phase or a hold.  Invariant:
  an entry with no frames and no hold is removed; a thread's frames are its open phases, innermost
  last, and each frame names the exclusive group the thread needs while the frame is innermost.
* a thread's ``held``: the group it holds, or None.  Invariant: every held group is the placement's
  current group (a hold is granted only after the placement made the group current).
* ``closed``: set by `close`; then no hold is granted and waiters raise.  The scheduler's one
  closed flag: the facade reads it to refuse its verbs.  ``reopen`` is what those refusals tell
  the user to do instead (set before ``closed``, by the same `close`).

* ``_queue``: tickets of threads waiting for a group, oldest first.  Invariant: a thread waits on
  at most one ticket and holds nothing while it waits.  The order of turns (``_turns``) reads it
  to decide and learns when threads leave and ask for groups; ``waits`` counts entries and waits.

[Note: group order]
Requests that run the same phases share phase changes when the waiters of one group go
together.  The rules, in the order they are checked for a ticket of `group`:

1. A waiter passed over for ``max_wait`` seconds is *aged* (unless given, ``max_wait`` is
   learned: `AUTO_STEPS` times the current group's *pace*, the median of the last `PACES`
   intervals between two departures from it, within `AUTO_MAX_WAIT`): the oldest waiter (the queue's
   first ticket) once aged decides.  While it is aged and of another group, no ticket joins the
   current group: its holders drain, then the aged ticket's group goes next.  So no waiter waits
   much more than ``max_wait`` plus the current holders' phases (starvation freedom).
2. Otherwise a ticket of the current group joins at once, held or not: "while threads hold or
   wait for the current group, new entries of it join".
3. While somebody holds the current group, nobody else goes.
4. When its holders are gone, the current group stays while threads that left it a moment ago
   are likely to come back: each such thread's *return window* is learned from its own gaps
   (the time between leaving a group and asking for it again: a sampler's host work between
   steps), twice the last gap and a millisecond, capped by ``max_wait``; a thread whose last
   departure from the group was to another group is not waited for.  A thread that asks for
   another group is no longer expected back.
5. Then the group with the most waiting threads goes next (ties: the one waiting longest).

One thread alone never lingers for itself (asking for another group ends its own window), so a
single request is served exactly as first come.  Under arrival order a ticket goes when nobody
queued earlier for another group, and its group is current or it is first and nobody holds.

State (`GroupTurns`' ``_leavers``, ``_paces``, ``_last_group`` and ``_last_at``, each group's
`Pace` and each thread entry's `Returns`) is guarded by the scheduler's lock: the holds are its one
caller, with the lock held.  A thread's own gaps live on its entry (``ThreadHolds.returns``), so
leaving and asking again - every denoising step - are a few stores, no lookup keyed by thread.

Calls go down from here, and the holds never move bytes: when a thread's turn comes they hand
back a `Turn`; the gate (`residency.scheduler.scheduler.PhaseGate`) has the placement make its
group current, then asks the holds to `grant` it (or to `refuse` it, after a failed switch).  They
read ``placement.current``, ask the registry whether a phase's group is still registered, and
call nothing above them.
"""

from __future__ import annotations

import collections
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator

from residency.group.residency import Residency
from residency.core.enums import PhaseStatus
from residency.core.errors import DeadlockError, PhaseError, SchedulerClosedError
from residency.core.locks import CHECKING, check_held, locked
from residency.placement.placement import Placement
from residency.group.registry import Registry
from residency.group.records import TurnChoice, WaitStats
from residency.options.order import AUTO_MAX_WAIT, AUTO_STEPS, TurnOrder

__all__ = ["ArrivalTurns", "GroupTurns", "Holds", "REOPEN", "ThreadHolds", "Ticket", "Turn",
           "WaitLog", "note_failed_return", "turns_for"]

#: What a closed scheduler's refusals advise by default (`Holds.close` takes another).
REOPEN = "Create a new Scheduler and add the modules again to keep offloading"

#: How often a waiting thread looks for holders whose threads have ended (seconds).
_DEAD_HOLDER_POLL = 0.05
_log = logging.getLogger("residency")
_current_thread = threading.current_thread
_monotonic = time.monotonic
_ACTIVE = PhaseStatus.ACTIVE


class ThreadHolds:
    """One thread's frames and hold."""

    __slots__ = ("thread", "frames", "held", "returns")

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        #: (phase, the exclusive group the thread needs while it is innermost), outermost first.
        #: A phase's ``status`` is written here only.
        self.frames: list[tuple[object, Residency | None]] = []
        self.held: Residency | None = None
        #: What group order learned of the thread's returns (`Returns`, written by `GroupTurns`
        #: only), or None.  On the entry, which lives as long as its thread: nothing to look up.
        self.returns: Returns | None = None

    def needs(self) -> Residency | None:
        """The exclusive group the innermost frame needs (None outside every phase)."""
        return self.frames[-1][1] if self.frames else None


class Ticket:
    """A thread's place in the queue for `group`, taken at `since` (monotonic seconds); its
    `choice` is set by the order of turns when its turn means a switch."""

    __slots__ = ("choice", "group", "since", "thread")

    def __init__(self, group: Residency, thread: threading.Thread, since: float) -> None:
        self.group, self.thread, self.since = group, thread, since
        self.choice: TurnChoice | None = None


class Turn:
    """A thread's turn to hold `group`, granted by the holds once the device layer has made the
    group current (`Holds.grant`); what follows the grant is `then`: open ``(phase, needs)`` as
    the thread's innermost frame, or None.  `previous`: the group the thread held before, taken
    back if the switch fails; `error`: raised once a turn that takes a group back is granted.

        turn = holds.join(phase)          # a Turn when a switch must come first
        placement.switch_to(turn.group)   # the device layer
        holds.grant(turn)                 # the hold, then the frame
    """

    __slots__ = ("choice", "entry", "error", "group", "previous", "then", "ticket")

    def __init__(self, entry: ThreadHolds, group: Residency, ticket: Ticket | None, *,
                 then: tuple | None = None, previous: Residency | None = None,
                 error: BaseException | None = None) -> None:
        self.entry, self.group, self.ticket = entry, group, ticket
        self.then, self.previous, self.error = then, previous, error
        #: Why the order of turns chose this turn, for the record (None: no ticket's choice).
        self.choice: TurnChoice | None = None if ticket is None else ticket.choice


class Holds:
    """The table of who may run (see the notes above); the gate calls it with the lock held.

        joined = holds.join(phase)    # its group, or a Turn: made current, then `grant`ed
    """

    def __init__(self, lock: threading.RLock, placement: Placement, registry: Registry, *,
                 wait_timeout: float | None, turns: ArrivalTurns | GroupTurns,
                 waits: WaitLog) -> None:
        self._lock = lock
        #: Read for its ``current`` group, the one a hold may join; never asked to move bytes.
        self._placement = placement
        #: Asked whether a phase's group is still registered (a phase may outlive its group).
        self._registry = registry
        #: Waiters sleep here; the same lock.
        self._wakeup = threading.Condition(lock)
        self.wait_timeout = wait_timeout
        #: The order of turns (told who left, who asked); `Scheduler.waits` (its own lock).
        self._turns, self.waits = turns, waits
        self._threads: dict[threading.Thread, ThreadHolds] = {}  # guarded by the lock
        #: Per thread, a shortcut to its entry (read by that thread only).
        self._local = threading.local()
        #: How many entries hold a group (kept with ``held``, read on every exit).
        self._holder_count = 0  # guarded by the lock
        self._queue: collections.deque[Ticket] = collections.deque()  # guarded by the lock
        #: Set by `close`: no more holds are granted, and waiters raise.
        self.closed = False  # guarded by the lock
        #: What a refusal after `close` advises (an adapter names its own verb).
        self.reopen = REOPEN  # guarded by the lock

    def _local_entry(self) -> ThreadHolds:
        """The calling thread's entry, made on its first phase.  The thread-local slot is only a
        shortcut to the entry: the table (``_threads``) says whether it is open or holds."""
        entry = self._local.entry = ThreadHolds(_current_thread())
        return entry

    def holders(self) -> list[threading.Thread]:
        return [t for t, e in self._threads.items() if e.held is not None]

    def __iter__(self) -> Iterator[ThreadHolds]:
        """Every thread's entry (a copy of the table: for inspection and tests)."""
        return iter(list(self._threads.values()))

    def has_holders(self) -> bool:
        return self._holder_count > 0

    def queue_is_empty(self) -> bool:
        return not self._queue

    def involves(self, group: Residency) -> bool:
        """Whether a thread holds `group`, waits for it or has a phase of it open (or suspended)."""
        return any(ticket.group is group for ticket in self._queue) or any(
            entry.held is group
            or any(phase.group is group or needs is group for phase, needs in entry.frames)
            for entry in self._threads.values()
        )

    def describe_holders(self, current: Residency | None) -> str:
        names = ", ".join(repr(t.name) for t in self.holders()) or "no thread"
        return f"group {current.name if current else None!r} is held by {names}"

    def push(self, entry: ThreadHolds, phase, needs: Residency | None) -> Residency:
        """Open `phase` as `entry`'s innermost frame; returns its group."""
        if CHECKING:
            check_held(self._lock)
        entry.frames.append((phase, needs))
        phase.status = PhaseStatus.ACTIVE
        self._threads[entry.thread] = entry
        return phase.group

    def join(self, phase) -> Residency | Turn:
        """Open `phase` and return its group at once on re-entry of the held group or joining
        the current one while nobody is queued (a denoising step: no tensor work).  Else (the
        group still registered) the thread waits for its turn at what the phase needs and gets
        the `Turn` back, to be made current and `grant`ed (`refuse`d: nothing is opened)."""
        if CHECKING:
            check_held(self._lock)
        entry = getattr(self._local, "entry", None) or self._local_entry()
        group, held = phase.group, entry.held
        self.waits.entered(group.name)
        if held is None and self._turns.learns and group.exclusive:
            self._turns.asked(entry, group, _monotonic())
        if held is group or (held is None and not self._queue and group.exclusive
                             and group is self._placement.current):  # (a held group is exclusive)
            if held is None:
                self._holder_count += 1
                entry.held = group
                self._threads[entry.thread] = entry
            entry.frames.append((phase, group))
            phase.status = _ACTIVE
            return group
        if self._registry.groups.get(group.name) is not group:  # removed or refreshed meanwhile
            raise self._registry.unregistered(group)
        self.collect_abandoned()
        needs = group if group.exclusive else entry.needs()
        if needs is not entry.held:
            turn = self.move(entry, needs, then=(phase, needs), restore_on_failure=True)
            if turn is not None:
                return turn
        return self.push(entry, phase, needs)

    def leave(self, phase) -> Turn | None:
        """Close `phase` (`pop`: it may raise `PhaseError`), then give up the hold, or move it to
        what the new innermost frame needs (a `Turn`, when that group must be made current)."""
        if CHECKING:
            check_held(self._lock)
        entry = getattr(self._local, "entry", None) or self._local_entry()
        frames = entry.frames
        if frames and frames[-1][0] is phase and len(frames) == 1 and entry.held is not None:
            # The common exit: the thread's only phase; give up the hold, forget the entry.
            frames.pop()
            phase.status = PhaseStatus.EXITED
            self._release_hold(entry)
            return None
        needs = self.pop(entry, phase)
        if frames and _close_abandoned(entry):
            needs = entry.needs()
        if needs is entry.held:
            self.forget_if_idle(entry)
            return None
        if needs is None:
            self.release_thread(entry)
            return None
        turn = self.move(entry, needs, restore_on_failure=False)
        self.forget_if_idle(entry)
        return turn

    def pop(self, entry: ThreadHolds, phase) -> Residency | None:
        """Close `phase`, the innermost frame, and the LEAVING frames it uncovers; return what the
        next frame needs.  `PhaseError` if it is not innermost ([Note: misnested exits])."""
        if CHECKING:
            check_held(self._lock)
        frames = entry.frames
        if not frames or frames[-1][0] is not phase:  # unless phases inside were abandoned
            if not (_close_abandoned(entry) and frames and frames[-1][0] is phase):
                _refuse_exit(entry, phase)
        frames.pop()
        phase.status = PhaseStatus.EXITED
        while frames and frames[-1][0].status is PhaseStatus.LEAVING:
            frames.pop()[0].status = PhaseStatus.EXITED_LATE
        return frames[-1][1] if frames else None

    def collect_abandoned(self) -> None:
        """Close every phase whose ``with`` ended without a completed exit ([Note: interrupts] in
        the facade); a thread left with no frame gives up its hold (not the caller's own)."""
        if CHECKING:
            check_held(self._lock)
        for entry in list(self._threads.values()):
            if not entry.thread.is_alive():  # a thread that ended inside: `DeadlockError`
                continue
            if _close_abandoned(entry) and not entry.frames and entry.held is not None:
                self._release_hold(entry)

    def settle(self, phase) -> Turn | None:
        """After an entry or exit of `phase` stopped half-way ([Note: interrupts], facade): close
        it, drop the thread's tickets, recount holders; a `Turn` to what its next frame needs."""
        if CHECKING:
            check_held(self._lock)
        if self.closed:
            return None
        entry = getattr(self._local, "entry", None) or self._local_entry()
        frames = entry.frames
        if frames and frames[-1][0] is phase:
            frames.pop()
        _close_abandoned(entry)
        if phase.status is _ACTIVE or phase.status is PhaseStatus.NEW:
            phase.status = PhaseStatus.EXITED
        while frames and frames[-1][0].status is PhaseStatus.LEAVING:
            frames.pop()[0].status = PhaseStatus.EXITED_LATE
        if entry.held is not None and entry.held is not self._placement.current:
            entry.held = None
        self._queue = collections.deque(t for t in self._queue if t.thread is not entry.thread)
        if frames or entry.held is not None:
            self._threads[entry.thread] = entry
        else:
            self._threads.pop(entry.thread, None)
        self._holder_count = sum(e.held is not None for e in self._threads.values())
        self._wakeup.notify_all()
        turn = None
        if entry.needs() is not entry.held:
            turn = self.move(entry, entry.needs(), restore_on_failure=False)
        self.forget_if_idle(entry)
        return turn

    def forget_if_idle(self, entry: ThreadHolds) -> None:
        """Drop `entry` from the table once it has no frame and no hold."""
        if CHECKING:
            check_held(self._lock)
        if not entry.frames and entry.held is None:
            self._threads.pop(entry.thread, None)

    def take(self, entry: ThreadHolds, group: Residency) -> None:
        """Record that `entry`'s thread holds `group` (the placement's current group)."""
        if CHECKING:
            check_held(self._lock)
        if entry.held is None:
            self._holder_count += 1
        entry.held = group
        self._threads[entry.thread] = entry

    def release_thread(self, entry: ThreadHolds) -> None:
        """`entry`'s thread holds nothing any more (no frame left: dropped); wake waiters."""
        if CHECKING:
            check_held(self._lock)
        if entry.held is not None:
            self._release_hold(entry)
        elif not entry.frames:
            self._threads.pop(entry.thread, None)

    def _release_hold(self, entry: ThreadHolds) -> None:
        if self._turns.learns:
            self._turns.left(entry, entry.held, _monotonic())
        self._holder_count -= 1
        entry.held = None
        if not entry.frames:
            del self._threads[entry.thread]
        if self._queue and not self._holder_count:
            self._wakeup.notify_all()

    def enqueue(self, ticket: Ticket) -> None:
        if CHECKING:
            check_held(self._lock)
        self._queue.append(ticket)

    def dequeue(self, ticket: Ticket) -> None:
        if CHECKING:
            check_held(self._lock)
        self._queue.remove(ticket)
        self._wakeup.notify_all()

    def move(self, entry: ThreadHolds, needs: Residency | None, *, then: tuple | None = None,
             restore_on_failure: bool) -> Turn | None:
        """Give up `entry`'s hold and take `needs`: at once when it is current and nobody waits,
        else return the thread's `Turn` (waited for; `then`: what its grant does next).  A wait
        that fails returns, if `restore_on_failure`, the turn back to the previous group."""
        if CHECKING:
            check_held(self._lock)
        previous = entry.held
        if previous is not None:
            self.release_thread(entry)
        if needs is None:
            return None
        if previous is not None and self._turns.learns:
            self._turns.asked(entry, needs, _monotonic())
        if needs is self._placement.current and not self._queue:  # at once: nobody waits
            self.take(entry, needs)
            return None
        back = previous if restore_on_failure else None
        try:
            return Turn(entry, needs, self._wait_for_turn(entry, needs), then=then, previous=back)
        except BaseException as error:
            turn = None if back is None else self._turn_back(entry, back, error)
            if turn is None:
                raise
            return turn

    def grant(self, turn: Turn) -> Residency | None:
        """The turn's group is current: take the hold, leave the queue, open the frame `then`
        names (returning its group) - or raise `error`, for a turn that gave a group back."""
        if CHECKING:
            check_held(self._lock)
        entry = turn.entry
        self.take(entry, turn.group)
        if turn.ticket is not None:
            self.dequeue(turn.ticket)
        if turn.error is not None:
            raise turn.error
        if turn.then is None:
            self.forget_if_idle(entry)
            return None
        phase, needs = turn.then
        return self.push(entry, phase, needs)

    def refuse(self, turn: Turn, error: BaseException) -> Turn | None:
        """The turn's group could not be made current (`error`): leave the queue; return the
        turn that gives the thread its previous group back (raising `error` once granted)."""
        if CHECKING:
            check_held(self._lock)
        if turn.ticket is not None and turn.ticket in self._queue:
            self.dequeue(turn.ticket)
        if turn.previous is None or turn.error is not None:
            return None
        return self._turn_back(turn.entry, turn.previous, error)

    def close(self, reopen: str = "") -> None:
        """Grant no more holds; waiters wake to `SchedulerClosedError` saying `reopen` (`REOPEN`)."""
        if CHECKING:
            check_held(self._lock)
        self.reopen = reopen or REOPEN
        self.closed = True
        self._wakeup.notify_all()

    def _turn_back(self, entry: ThreadHolds, previous: Residency,
                   error: BaseException) -> Turn | None:
        """The turn that gives the thread `previous` back after `error`; None (the failure
        noted on `error`) when it cannot be waited for."""
        try:
            return Turn(entry, previous, self._wait_for_turn(entry, previous), error=error)
        except BaseException as restore_error:  # the first error is the one to report
            note_failed_return(error, previous, restore_error)
            return None

    def _wait_for_turn(self, entry: ThreadHolds, group: Residency) -> Ticket:
        """Queue `entry`'s thread for `group` and sleep until the order of turns lets it go; the
        ticket stays queued until granted or refused, and leaves the queue if the wait fails."""
        ticket = Ticket(group, entry.thread, _monotonic())
        deadline = None if self.wait_timeout is None else ticket.since + self.wait_timeout
        try:  # no `finally`: its first line would be a place an interrupt skips it
            self.enqueue(ticket)
            if self._may_go(ticket):
                return ticket
            while not self._may_go(ticket):
                self._check_waiting(ticket, deadline)
                self._wakeup.wait(min(_DEAD_HOLDER_POLL, self._turns.look_again(
                    self._queue, self._placement.current, _monotonic())))
            self.waits.waited(group.name, _monotonic() - ticket.since)
            return ticket
        except BaseException:
            if ticket in self._queue:
                self.dequeue(ticket)
            raise

    def _may_go(self, ticket: Ticket) -> bool:
        return self._turns.may_proceed(self._queue, ticket, self._placement.current,
                                       self._holder_count > 0, _monotonic())

    def _check_waiting(self, ticket: Ticket, deadline: float | None) -> None:
        """Raise for a wait that must end: the scheduler closed, every holder dead, too long."""
        if self.closed:
            raise _closed_while_waiting(self.reopen)
        self.collect_abandoned()
        self._release_dead_holders(ticket.group, self._placement.current)
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlockError(
                f"waited {self.wait_timeout} s for group {ticket.group.name!r}: "
                f"{self.describe_holders(self._placement.current)}. Leave phases promptly, or "
                "raise wait_timeout")

    def _release_dead_holders(self, wanted: Residency, current: Residency | None) -> None:
        """When every holder's thread has ended inside a phase, drop their entries and raise."""
        if CHECKING:
            check_held(self._lock)
        holders = self.holders()
        dead = [thread for thread in holders if not thread.is_alive()]
        if not dead or len(dead) < len(holders):
            return
        for thread in dead:
            del self._threads[thread]
        self._holder_count -= len(dead)
        raise _dead_holders(wanted, current, dead)


def _closed_while_waiting(reopen: str) -> SchedulerClosedError:
    return SchedulerClosedError(
        f"the scheduler was closed while this phase waited for its group. {reopen}"
    )


def _dead_holders(wanted: Residency, current: Residency | None, dead) -> DeadlockError:
    names = ", ".join(repr(t.name) for t in dead)
    return DeadlockError(
        f"group {wanted.name!r} waited on group {current.name if current else None!r}, held "
        f"by phases of thread(s) {names} that ended without leaving them; those holds are now "
        "released. Leave every phase on the thread that entered it (use `with`)"
    )


def _refuse_exit(entry: ThreadHolds, phase) -> None:
    """Refuse leaving `phase` (see [Note: misnested exits]): it is not open on this thread, or
    phases inside it are still open (then it is marked LEAVING)."""
    depth = _depth_of(entry, phase)
    if depth != len(entry.frames) - 1:
        phase.status = PhaseStatus.LEAVING
        inner = ", ".join(repr(p.group.name) for p, _ in entry.frames[depth + 1 :])
        raise PhaseError(
            f"the phase of {phase.group.name!r} was left while phases inside it are still "
            f"active ({inner}); it will close when they are left. Use `with`, and leave "
            "phases in the reverse order of entering them"
        )


def _close_abandoned(entry: ThreadHolds) -> bool:
    """Close `entry`'s abandoned frames (see `Holds.collect_abandoned`); whether there were any."""
    dropped = {id(frame): frame for frame in entry.frames if _abandoned(frame)}
    if not dropped:
        return False
    entry.frames[:] = [frame for frame in entry.frames if id(frame) not in dropped]
    for frame in dropped.values():
        frame[0].status = PhaseStatus.EXITED
        _log.info("closed an abandoned phase of %r on thread %r (its `with` ended without "
                  "a completed exit: interrupted)", frame[0].group.name, entry.thread.name)
    return True


def note_failed_return(error: BaseException, previous: Residency,
                       failure: BaseException) -> None:
    """Say on `error` that the thread's `previous` group could not be made resident again
    (`failure`): the enclosing phase runs without it."""
    note = (f"residency: group {previous.name!r} could not be made resident again "
            f"({failure!r}); the enclosing phase runs without it")
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)
    else:
        _log.error(note)


def _abandoned(frame: tuple) -> bool:
    """Whether nothing refers to the frame's phase but the frame: the ``with`` statement (or
    whoever entered it) let go of it without a completed exit."""
    phase = frame[0]
    # The references: the frame's tuple, `phase` here, and getrefcount's own argument.
    return sys.getrefcount(phase) <= 3


def _depth_of(entry: ThreadHolds, phase) -> int:
    for depth in range(len(entry.frames) - 1, -1, -1):
        if entry.frames[depth][0] is phase:
            return depth
    raise PhaseError(
        f"the phase of {phase.group.name!r} was left on thread "
        f"{threading.current_thread().name!r}, which did not enter it; leave a phase on the "
        "thread that entered it"
    )


# -- the wait log ----------------------------------------------------------------------------------


class WaitLog:
    """Per group, phase entries counted and the newest `limit` waits for a turn, in seconds.

    Written by the holds alone, under the scheduler's lock, and read by anyone: its own small
    lock makes a reader's `summary` a snapshot of the waits.  The entries, counted on every
    phase entry (a denoising step's re-entry too), take no lock of their own: their one writer
    holds the scheduler's, and a reader copies the map in one C-level call (`dict.copy`, atomic
    under the GIL) after reading the waits, so it never sees more waits than entries.
    """

    def __init__(self, limit: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._entries: dict[str, int] = {}  # written under the scheduler's lock
        self._waits: dict[str, collections.deque] = {}  # guarded by self._lock
        self._counts: dict[str, int] = {}  # waits ever made, per group; guarded by self._lock

    def entered(self, name: str) -> None:
        """A phase of group `name` was entered (the scheduler's lock held)."""
        self._entries[name] = self._entries.get(name, 0) + 1

    def waited(self, name: str, seconds: float) -> None:
        """An entry of group `name` waited `seconds` for its turn."""
        locked(self._lock, self._add_wait, name, seconds)

    def _add_wait(self, name: str, seconds: float) -> None:
        kept = self._waits.get(name)
        if kept is None:
            kept = self._waits[name] = collections.deque(maxlen=self._limit)
        kept.append(seconds)
        self._counts[name] = self._counts.get(name, 0) + 1

    def summary(self) -> dict[str, WaitStats]:
        """Each group's `WaitStats`, groups in the order they were first entered."""
        return locked(self._lock, self._summary)

    def _summary(self) -> dict[str, WaitStats]:
        waits = {name: sorted(kept) for name, kept in self._waits.items()}
        counts = dict(self._counts)
        stats = {}
        for name, entries in self._entries.copy().items():  # after the waits: see the docstring
            kept = waits.get(name, [])
            stats[name] = WaitStats(
                entries=entries, waits=counts.get(name, 0),
                p50=_rank(kept, 0.5), p99=_rank(kept, 0.99), max=kept[-1] if kept else 0.0)
        return stats


def _rank(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted `ordered` (0.0 when empty)."""
    if not ordered:
        return 0.0
    index = math.ceil(len(ordered) * fraction) - 1
    return ordered[min(max(index, 0), len(ordered) - 1)]


# -- the order of turns ([Note: group order]) ------------------------------------------------------


#: The return window of a thread not yet seen coming back (seconds; capped by ``max_wait``): a
#: few sampler steps' host work.
FIRST_WINDOW = 0.02
#: Slack added to twice a learned gap (seconds).
WINDOW_SLACK = 0.001
#: Intervals between departures from one group the learned ``max_wait`` takes its median of.
PACES = 31
#: How many leavers group order keeps before it first drops those whose thread ended.
_SWEEP_LEAVERS = 64


class Pace:
    """One group's pace on the device (group order's own): its last `PACES` intervals between
    two departures from it, and the bound learned from them until the next one (a departure
    only records its interval: `GroupTurns.max_wait_now` takes the median when asked)."""

    __slots__ = ("bound", "intervals")

    def __init__(self) -> None:
        self.intervals: collections.deque = collections.deque(maxlen=PACES)
        self.bound: float | None = None


class Returns:
    """What group order learned of one thread: the group it last gave up and when (`left`:
    None once it asked for a group again), and per group name its last gap before asking for
    that group again (None: it went to another group instead)."""

    __slots__ = ("at", "gaps", "left")

    def __init__(self) -> None:
        self.left = None
        self.at = 0.0
        self.gaps: dict[str, float | None] = {}


class ArrivalTurns:
    """First come, first served: a ticket goes when nobody queued before it for another group,
    and its group is current, or nobody holds and it is first."""

    name = "arrival"
    #: Whether the holds report each thread's departures and requests (no: nothing to learn).
    learns = False

    def may_proceed(self, queue, ticket, current, held: bool, now: float) -> bool:
        for earlier in queue:
            if earlier is ticket:
                break
            if earlier.group is not ticket.group:
                return False
        if current is ticket.group:
            return True
        if held or queue[0] is not ticket:
            return False
        ticket.choice = TurnChoice(order="arrival", reason="first come", waiting=len(queue))
        return True

    def look_again(self, queue, current, now: float) -> float:
        """Seconds until an answer may change with nobody leaving or asking: never."""
        return float("inf")

    def left(self, entry: ThreadHolds, group, now: float) -> None:
        pass

    def asked(self, entry: ThreadHolds, group, now: float) -> None:
        pass


class GroupTurns:
    """Group order ([Note: group order]): the current group's waiters join, its leavers are
    waited for a moment, then the group with the most waiting work goes; nobody is passed over
    for more than ``max_wait``."""

    name = "group"
    learns = True

    def __init__(self, max_wait: float | None) -> None:
        #: The bound given, or None: learned (`max_wait_now`).
        self.max_wait = max_wait
        #: group name -> its `Pace`: the intervals between two departures from it.
        self._paces: dict[str, Pace] = {}  # guarded by the lock
        #: The group of the last departure from any group (None before the first), and when.
        self._last_group, self._last_at = None, 0.0  # guarded by the lock
        #: The entries (`ThreadHolds`) of every thread that ever gave up a group (a dict used
        #: as an ordered set, an entry added once, when its `Returns` is made); a decision reads
        #: which of them left the current group.  Those of ended threads are dropped when a
        #: decision meets them (`_lingers`) or when the set has doubled since the last sweep.
        self._leavers: dict[ThreadHolds, None] = {}  # guarded by the lock
        self._sweep_at = _SWEEP_LEAVERS  # guarded by the lock

    def left(self, entry: ThreadHolds, group, now: float) -> None:
        """`entry`'s thread gave up its hold of `group` at `now`: expect it back for a moment,
        and learn the device's pace from it."""
        returns = entry.returns
        if returns is None:
            returns = entry.returns = Returns()
            self._leavers[entry] = None
            if len(self._leavers) >= self._sweep_at:
                self._drop_ended()
        returns.left, returns.at = group, now
        if self._last_group is group:
            pace = self._paces.get(group.name)
            if pace is None:
                pace = self._paces[group.name] = Pace()
            pace.intervals.append(now - self._last_at)
            pace.bound = None
        self._last_group, self._last_at = group, now

    def max_wait_now(self, current) -> float:
        """The longest a waiter is passed over while `current` (a group or None) is on the
        device (seconds): `max_wait`, or learned from `current`'s median pace - its holders are
        what the waiter waits for - computed when a decision needs it, not at each departure."""
        if self.max_wait is not None:
            return self.max_wait
        if current is None:
            return AUTO_MAX_WAIT[0]
        pace = self._paces.get(current.name)
        if pace is None:
            return AUTO_MAX_WAIT[0]
        if pace.bound is None:
            intervals = sorted(pace.intervals)
            median = intervals[len(intervals) // 2]
            pace.bound = min(AUTO_MAX_WAIT[1], max(AUTO_MAX_WAIT[0], AUTO_STEPS * median))
        return pace.bound

    def asked(self, entry: ThreadHolds, group, now: float) -> None:
        """`entry`'s thread asks for `group` at `now`: learn its gap (or that it moved on), and
        stop expecting it back where it was."""
        returns = entry.returns
        if returns is None or returns.left is None:
            return
        returns.gaps[returns.left.name] = now - returns.at if returns.left is group else None
        returns.left = None

    def may_proceed(self, queue, ticket, current, held: bool, now: float) -> bool:
        oldest = queue[0]
        aged = now - oldest.since >= self.max_wait_now(current)
        if ticket.group is current:
            return not aged or oldest.group is current
        if held:
            return False
        if aged:
            chosen, reason = oldest.group, "waited past max_wait"
        elif self._lingers(current, now) > now:
            return False
        else:
            chosen, reason = _most_waiting(queue), "most waiting work"
        if ticket.group is not chosen:
            return False
        ticket.choice = TurnChoice(order="group", reason=reason, waiting=len(queue))
        return True

    def look_again(self, queue, current, now: float) -> float:
        """Seconds until an answer may change with nobody leaving or asking: the current group's
        return windows closing, or the oldest waiter ageing."""
        moments = [self._lingers(current, now)]
        if queue:
            moments.append(queue[0].since + self.max_wait_now(current))
        later = [moment - now for moment in moments if moment > now]
        return min(later, default=float("inf"))

    def window(self, entry: ThreadHolds, group) -> float:
        """How long `entry`'s thread is waited for after leaving `group` (seconds)."""
        gaps = entry.returns.gaps if entry.returns is not None else {}
        if group.name not in gaps:
            return min(self.max_wait_now(group), FIRST_WINDOW)
        gap = gaps[group.name]
        return 0.0 if gap is None else min(self.max_wait_now(group), 2 * gap + WINDOW_SLACK)

    def _lingers(self, current, now: float) -> float:
        """Until when the current group waits for threads that just left it (0.0: nobody)."""
        if current is None:
            return 0.0
        until = 0.0
        for entry in list(self._leavers):
            if entry.returns.left is not current:
                continue
            if not entry.thread.is_alive():
                del self._leavers[entry]
            else:
                until = max(until, entry.returns.at + self.window(entry, current))
        return until

    def _drop_ended(self) -> None:
        """Forget the leavers whose thread ended (a server's finished request threads), so the
        set stays the size of the live threads that left a group."""
        for entry in [e for e in self._leavers if not e.thread.is_alive()]:
            del self._leavers[entry]
        self._sweep_at = max(_SWEEP_LEAVERS, 2 * len(self._leavers))


def _most_waiting(queue):
    """The group with the most tickets in `queue`; ties go to the one queued earliest."""
    counts: dict = {}
    for ticket in queue:
        counts[ticket.group] = counts.get(ticket.group, 0) + 1
    return max(counts, key=counts.__getitem__)  # max keeps the first of equals: queue order


def turns_for(order: TurnOrder) -> ArrivalTurns | GroupTurns:
    """The turns an order's options describe."""
    return GroupTurns(order.max_wait) if order.by == "group" else ArrivalTurns()
