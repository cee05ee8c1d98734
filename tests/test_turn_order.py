"""The order of turns (issue 46): its options, its decisions, and what it records.

The decisions are tested on `GroupTurns` / `ArrivalTurns` directly with explicit times (no clock,
no threads); the records and `Scheduler.waits` on a real scheduler, with threads driven by
events, every wait bounded.  Many requests under load: tests/test_serving.py.
"""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from residency import ConfigError, OffloadConfig, Scheduler, TurnOrder, WaitStats
from residency.options.order import AUTO_MAX_WAIT, AUTO_STEPS, as_turn_order
from residency.scheduler.holds import (
    FIRST_WINDOW, ArrivalTurns, GroupTurns, ThreadHolds, Ticket, turns_for,
)

pytestmark = pytest.mark.fast

#: Every wait for another thread in this file gives up after this long.
BOUND = 30.0


# -- the options -----------------------------------------------------------------------------


def test_the_accepted_forms_of_order():
    assert as_turn_order(None) == TurnOrder(by="group", max_wait=None)  # learned
    assert as_turn_order("arrival") == TurnOrder(by="arrival")
    assert as_turn_order("group").by == "group"
    assert as_turn_order({"by": "group", "max_wait": 0.25}) == TurnOrder(by="group", max_wait=0.25)
    assert as_turn_order({"by": "arrival"}).by == "arrival"
    given = TurnOrder(by="group", max_wait=0)
    assert as_turn_order(given) is given
    assert TurnOrder.from_dict(given.to_dict()) == given
    assert TurnOrder.from_dict({"by": "group", "max_wait": None}) == TurnOrder()
    assert all(math.isfinite(bound) and bound > 0 for bound in AUTO_MAX_WAIT)


@pytest.mark.parametrize("value, says", [
    ("fifo", "order='fifo'; accepted forms are \"group\", \"arrival\""),
    (3, "order=3; accepted forms are"),
    (["group"], "order=['group']; accepted forms are"),
    (True, "order=True; accepted forms are"),
    ({"by": "lifo"}, "order 'by' is 'lifo'; accepted forms of order are"),
    ({"by": 1}, "order 'by' is 1;"),
    ({"max_wait": 1.0}, "order {'max_wait': 1.0} has no 'by'; accepted forms are"),
    ({"by": "group", "wait": 1},
     "order has unknown key 'wait'; accepted keys are 'by' and 'max_wait'"),
    ({"by": "group", "max_wait": -1},
     "order 'max_wait' is -1; give a finite number of seconds >= 0"),
    ({"by": "group", "max_wait": float("nan")}, "order 'max_wait' is nan;"),
    ({"by": "group", "max_wait": float("inf")}, "order 'max_wait' is inf;"),
    ({"by": "group", "max_wait": True}, "order 'max_wait' is True;"),
    ({"by": "group", "max_wait": "1s"}, "order 'max_wait' is '1s';"),
])
def test_each_bad_order_is_refused_naming_what_is_accepted(value, says):
    with pytest.raises(ConfigError) as raised:
        as_turn_order(value)
    assert says in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        Scheduler("cpu", order=value)
    assert says in str(raised.value)


def test_a_refused_order_builds_nothing():
    """The modules a refused scheduler would have taken are free for the next one."""
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError):
        Scheduler("cpu", order="fifo")
    scheduler = Scheduler("cpu", order="arrival")
    scheduler.add("model", model)
    assert scheduler.order == TurnOrder(by="arrival")
    scheduler.close()


def test_the_offload_config_takes_order_in_every_mode():
    for mode in ("module", "layer", "auto"):
        config = OffloadConfig.from_dict({"mode": mode, "components": ["dit"], "order": "arrival"})
        assert config.order == TurnOrder(by="arrival")
        assert OffloadConfig.from_dict(config.to_dict()) == config
    json_config = OffloadConfig.from_json(
        '{"mode": "module", "components": ["dit"], "order": {"by": "group", "max_wait": 0.1}}')
    assert json_config.order == TurnOrder(by="group", max_wait=0.1)
    assert OffloadConfig.from_dict({"mode": "module", "components": ["dit"]}).order is None
    with pytest.raises(ConfigError, match="offload config field 'order': order='x'; accepted"):
        OffloadConfig.from_dict({"mode": "module", "components": ["dit"], "order": "x"})


# -- the decisions ---------------------------------------------------------------------------


class Group:
    def __init__(self, name: str) -> None:
        self.name = name


A, B, C = Group("a"), Group("b"), Group("c")
ME = ThreadHolds(threading.current_thread())  # this thread's entry, as the holds keep it


def ticket(group, since=0.0, thread=ME.thread):
    return Ticket(group, thread, since)


def other_thread():
    """The entry of a live thread other than this one (parked on an event until the test
    ends), and the event that ends it."""
    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(BOUND,), daemon=True)
    thread.start()
    return ThreadHolds(thread), done


def test_arrival_order_is_first_come_first_served():
    turns = ArrivalTurns()
    first, second, third = ticket(B), ticket(A), ticket(B)
    queue = [first, second, third]
    assert not turns.may_proceed(queue, second, A, True, 0.0)  # b queued before it
    assert not turns.may_proceed(queue, first, A, True, 0.0)   # a is held
    assert turns.may_proceed(queue, first, A, False, 0.0)
    assert first.choice.order == "arrival" and first.choice.reason == "first come"
    assert first.choice.waiting == 3
    assert not turns.may_proceed(queue, third, A, False, 0.0)  # not first
    assert not turns.may_proceed(queue, third, B, True, 0.0)   # a queued between: it waits
    assert turns.may_proceed(queue, first, B, True, 0.0)       # joins the held b at once
    assert turns.look_again(queue, A, 0.0) == math.inf


def test_group_order_lets_the_current_groups_waiters_join_while_others_wait():
    turns = GroupTurns(max_wait=1.0)
    other, joiner = ticket(B, since=0.0), ticket(A, since=0.1)
    queue = [other, joiner]
    assert turns.may_proceed(queue, joiner, A, True, 0.2)      # joins a, though b came first
    assert not turns.may_proceed(queue, other, A, True, 0.2)   # a is held


def test_group_order_waits_for_a_thread_that_just_left_then_serves_the_most_waiting_work():
    turns = GroupTurns(max_wait=1.0)
    leaver, done = other_thread()
    try:
        turns.left(leaver, A, 0.0)
        b1, c1, c2 = ticket(C, 0.001), ticket(B, 0.002), ticket(B, 0.003)
        queue = [b1, c1, c2]
        assert turns.window(leaver, A) == FIRST_WINDOW  # not seen coming back yet
        assert not turns.may_proceed(queue, c1, A, False, FIRST_WINDOW / 2)
        assert turns.look_again(queue, A, FIRST_WINDOW / 2) == pytest.approx(FIRST_WINDOW / 2)
        later = FIRST_WINDOW + 0.001
        assert not turns.may_proceed(queue, b1, A, False, later)  # c has more waiting
        assert turns.may_proceed(queue, c1, A, False, later)
        assert (c1.choice.order, c1.choice.reason, c1.choice.waiting) == (
            "group", "most waiting work", 3)
    finally:
        done.set()


def test_each_threads_return_window_is_learned_from_its_own_gaps():
    turns = GroupTurns(max_wait=0.05)
    returner, done = other_thread()
    try:
        turns.left(returner, A, 1.0)
        turns.asked(returner, A, 1.004)            # came back after 4 ms
        assert turns.window(returner, A) == pytest.approx(2 * 0.004 + 0.001)
        turns.left(returner, A, 2.0)
        turns.asked(returner, B, 2.001)            # went elsewhere instead
        assert turns.window(returner, A) == 0.0     # not waited for at a
        turns.left(returner, B, 3.0)
        turns.asked(returner, B, 3.5)               # a long gap: capped by max_wait
        assert turns.window(returner, B) == 0.05
    finally:
        done.set()


def test_a_thread_alone_never_waits_for_itself():
    """Asking for another group ends the thread's own return window: one request is served as
    first come."""
    turns = GroupTurns(max_wait=1.0)
    turns.left(ME, A, 0.0)
    turns.asked(ME, B, 0.0001)
    mine = ticket(B, 0.0001)
    assert turns.may_proceed([mine], mine, A, False, 0.0002)
    assert mine.choice.reason == "most waiting work"


def test_a_thread_that_ended_is_not_waited_for():
    turns = GroupTurns(max_wait=1.0)
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join(BOUND)
    turns.left(ThreadHolds(ended), A, 0.0)
    waiting = ticket(B, 0.0)
    assert turns.may_proceed([waiting], waiting, A, False, 0.001)


def test_group_order_keeps_no_thread_that_ended_alive():
    """A server's request threads end; what group order learned of them goes with them, even
    when no decision ever looks at them (nobody waits): its memory stays the live threads'."""
    turns = GroupTurns(max_wait=1.0)
    gone = []
    for step in range(300):  # more than a few sweeps' worth
        ended = threading.Thread(target=lambda: None)
        ended.start()
        ended.join(BOUND)
        gone.append(weakref.ref(ended))
        turns.left(ThreadHolds(ended), A, float(step))
        del ended
    gc.collect()
    kept = [ref for ref in gone if ref() is not None]
    assert len(kept) <= 64, f"{len(kept)} of 300 ended threads are still referenced"


def test_a_waiter_passed_over_for_max_wait_goes_next():
    turns = GroupTurns(max_wait=0.1)
    old = ticket(B, since=0.0)
    joiner, crowd = ticket(A, since=0.05), [ticket(C, 0.01) for _ in range(3)]
    queue = [old, *crowd, joiner]
    assert turns.may_proceed(queue, joiner, A, True, 0.05)      # not aged yet: joins a
    assert turns.look_again(queue, A, 0.05) == pytest.approx(0.05)
    assert not turns.may_proceed(queue, joiner, A, True, 0.2)   # aged b: a takes nobody new
    assert not turns.may_proceed(queue, old, A, True, 0.2)      # until a's holders are gone
    assert not turns.may_proceed(queue, crowd[0], A, False, 0.2)  # c has more, but b aged
    assert turns.may_proceed(queue, old, A, False, 0.2)
    assert old.choice.reason == "waited past max_wait"


def test_the_default_max_wait_is_learned_from_the_current_groups_pace():
    """Unless given, the bound is `AUTO_STEPS` times the median interval between two departures
    from the group on the device (its holders are what a waiter waits for), within
    `AUTO_MAX_WAIT`; an interval across a change of group is no pace."""
    turns = GroupTurns(max_wait=None)
    assert turns.max_wait_now(A) == turns.max_wait_now(None) == AUTO_MAX_WAIT[0]  # unmeasured
    for when in (0.0, 0.1, 0.2, 0.3):
        turns.left(ME, A, when)
    turns.left(ME, B, 5.0)                                      # another group: no pace
    for when in range(10):                                      # b's steps are short
        turns.left(ME, B, 5.1 + 0.001 * when)
    bound = turns.max_wait_now(A)
    assert bound == pytest.approx(AUTO_STEPS * 0.1)
    assert turns.max_wait_now(B) == AUTO_MAX_WAIT[0]            # b's own pace: floored
    old, joiner = ticket(B, since=6.0), ticket(A, since=6.1)
    assert turns.may_proceed([old, joiner], joiner, A, True, 6.0 + bound - 0.01)  # b not aged
    assert not turns.may_proceed([old, joiner], joiner, A, True, 6.0 + bound + 1e-6)
    for when in range(40):                                      # slow steps: capped
        turns.left(ME, A, 10.0 + 10 * when)
    assert turns.max_wait_now(A) == AUTO_MAX_WAIT[1]
    for when in range(40):                                      # sub-millisecond steps: floored
        turns.left(ME, A, 500.0 + 1e-4 * when)
    assert turns.max_wait_now(A) == AUTO_MAX_WAIT[0]
    given = GroupTurns(max_wait=0.2)
    for when in (0.0, 0.1, 0.2):
        given.left(ME, A, when)
    assert given.max_wait_now(A) == 0.2                         # a given bound is kept


def test_turns_for_builds_the_order_asked_for():
    assert isinstance(turns_for(TurnOrder(by="arrival")), ArrivalTurns)
    group = turns_for(TurnOrder(by="group", max_wait=0.3))
    assert isinstance(group, GroupTurns) and group.max_wait == 0.3


# -- records and waits, on a real scheduler ----------------------------------------------------


def _two_groups(order):
    torch.manual_seed(0)
    scheduler = Scheduler("cpu", order=order)
    scheduler.add("a", nn.Linear(8, 8))
    scheduler.add("b", nn.Linear(8, 8))
    return scheduler


@pytest.mark.parametrize("order, reason", [("group", "most waiting work"),
                                           ("arrival", "first come")])
def test_a_transition_says_which_order_chose_it_and_why(order, reason):
    # A long max_wait: the waiter must not age while a loaded machine delays the holder's exit.
    scheduler = _two_groups({"by": "group", "max_wait": 60.0} if order == "group" else order)
    inside, release = threading.Event(), threading.Event()

    def hold_a():
        with scheduler.resident("a"):
            inside.set()
            release.wait(BOUND)

    holder = threading.Thread(target=hold_a, daemon=True)
    holder.start()
    assert inside.wait(BOUND)

    def enter_b():
        with scheduler.resident("b"):
            pass

    waiter = threading.Thread(target=enter_b, daemon=True)
    waiter.start()
    deadline = time.monotonic() + BOUND
    while scheduler.waits.get("b") is None:  # it has asked
        assert time.monotonic() < deadline, "the waiter never asked for b"
        threading.Event().wait(0.001)
    release.set()
    holder.join(BOUND)
    waiter.join(BOUND)
    assert not holder.is_alive() and not waiter.is_alive()
    first, second = list(scheduler.transitions)
    assert (first.to_group, first.order, first.reason, first.waiting) == ("a", order, reason, 1)
    assert (second.from_group, second.to_group) == ("a", "b")
    assert (second.order, second.reason, second.waiting) == (order, reason, 1)
    waits = scheduler.waits
    assert set(waits) == {"a", "b"}
    assert isinstance(waits["b"], WaitStats)
    assert (waits["a"].entries, waits["a"].waits) == (1, 0)
    assert (waits["b"].entries, waits["b"].waits) == (1, 1)
    assert 0.0 < waits["b"].p50 == waits["b"].p99 == waits["b"].max
    scheduler.close()


def test_re_entry_is_counted_and_waits_for_nothing():
    scheduler = _two_groups("group")
    for _ in range(5):
        with scheduler.resident("a"):
            pass
    assert scheduler.waits["a"] == WaitStats(entries=5, waits=0, p50=0.0, p99=0.0, max=0.0)
    assert len(scheduler.transitions) == 1
    scheduler.close()
