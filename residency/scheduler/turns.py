"""The order of turns: which waiting thread may take its turn, first come or by group.

    order = turns_for(TurnOrder(by="group", max_wait=0.5))
    order.may_proceed(queue, ticket, current, held, time.monotonic())   # the holds ask, waiting

The holds (`residency.scheduler.holds`) keep the queue and wait; this module only answers "may
this ticket go now?" and "when could the answer change without anyone leaving?".  It moves no
bytes and calls nothing: the holds tell it when a thread leaves a group (`left`) or asks for one
(`asked`), under the scheduler's lock, and it learns from that.

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
single request is served exactly as first come.  Under arrival order the rules are today's:
nobody queued earlier for another group, and the group is current or the ticket is first and
nobody holds.

State (`GroupTurns`' ``_left``, ``_gaps``, ``_paces``, ``_last_left`` and ``_learned``) is
guarded by the scheduler's lock: the holds are its one caller, with the lock held.  The two maps
(``_left``, ``_gaps``) are weak in the thread, so a thread that ended takes its entries with it.
"""

from __future__ import annotations

import collections
import weakref

from residency.group.records import TurnChoice
from residency.options.order import AUTO_MAX_WAIT, AUTO_STEPS, TurnOrder

__all__ = ["ArrivalTurns", "GroupTurns", "turns_for"]

#: The return window of a thread not yet seen coming back (seconds; capped by ``max_wait``): a
#: few sampler steps' host work.
FIRST_WINDOW = 0.02
#: Slack added to twice a learned gap (seconds).
WINDOW_SLACK = 0.001
#: Intervals between departures from one group the learned ``max_wait`` takes its median of.
PACES = 31


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

    def left(self, thread, group, now: float) -> None:
        pass

    def asked(self, thread, group, now: float) -> None:
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
        #: group name -> its last `PACES` intervals between two departures from it (seconds).
        self._paces: dict[str, collections.deque] = {}  # guarded by the lock
        #: (group, when) of the last departure from any group; None before the first.
        self._last_left: tuple | None = None  # guarded by the lock
        #: group name -> its learned bound, until its next pace (a departure only records its
        #: pace: leaving a phase stays a few stores; `max_wait_now` takes the median).
        self._learned: dict[str, float] = {}  # guarded by the lock
        #: thread -> (the group it last gave up, when), until it asks for a group again.
        self._left: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # guarded by the lock
        #: thread -> {group name: its last gap before asking for that group again, or None when
        #: it went to another group instead}.
        self._gaps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # guarded by the lock

    def left(self, thread, group, now: float) -> None:
        """`thread` gave up its hold of `group` at `now`: learn the device's pace from it."""
        left = self._left[thread] = (group, now)
        last, self._last_left = self._last_left, left
        if last is not None and last[0] is group:
            paces = self._paces.get(group.name)
            if paces is None:
                paces = self._paces[group.name] = collections.deque(maxlen=PACES)
            paces.append(now - last[1])
            self._learned.pop(group.name, None)

    def max_wait_now(self, current) -> float:
        """The longest a waiter is passed over while `current` (a group or None) is on the
        device (seconds): `max_wait`, or learned from `current`'s median pace - its holders are
        what the waiter waits for - computed when a decision needs it, not at each departure."""
        if self.max_wait is not None:
            return self.max_wait
        if current is None:
            return AUTO_MAX_WAIT[0]
        learned = self._learned.get(current.name)
        if learned is None:
            paces = sorted(self._paces.get(current.name, ()))
            pace = paces[len(paces) // 2] if paces else 0.0
            learned = min(AUTO_MAX_WAIT[1], max(AUTO_MAX_WAIT[0], AUTO_STEPS * pace))
            self._learned[current.name] = learned
        return learned

    def asked(self, thread, group, now: float) -> None:
        """`thread` asks for `group` at `now`: learn its gap (or that it moved on), and stop
        expecting it back where it was."""
        last = self._left.pop(thread, None)
        if last is not None:
            gaps = self._gaps.setdefault(thread, {})
            gaps[last[0].name] = now - last[1] if last[0] is group else None

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

    def window(self, thread, group) -> float:
        """How long `thread` is waited for after leaving `group` (seconds)."""
        gaps = self._gaps.get(thread, {})
        if group.name not in gaps:
            return min(self.max_wait_now(group), FIRST_WINDOW)
        gap = gaps[group.name]
        return 0.0 if gap is None else min(self.max_wait_now(group), 2 * gap + WINDOW_SLACK)

    def _lingers(self, current, now: float) -> float:
        """Until when the current group waits for threads that just left it (0.0: nobody)."""
        if current is None:
            return 0.0
        until = 0.0
        for thread, (group, at) in list(self._left.items()):
            if group is current and thread.is_alive():
                until = max(until, at + self.window(thread, group))
        return until


def _most_waiting(queue):
    """The group with the most tickets in `queue`; ties go to the one queued earliest."""
    counts: dict = {}
    for ticket in queue:
        counts[ticket.group] = counts.get(ticket.group, 0) + 1
    return max(counts, key=counts.__getitem__)  # max keeps the first of equals: queue order


def turns_for(order: TurnOrder) -> ArrivalTurns | GroupTurns:
    """The turns an order's options describe."""
    return GroupTurns(order.max_wait) if order.by == "group" else ArrivalTurns()
