"""Misnested exits (issue 11; see [Note: misnested exits] in residency/scheduler/holds.py).

Leaving an outer phase while an inner one is open is refused with `PhaseError` and changes nothing;
the outer phase closes by itself once the inner ones are left; then the holds are empty - no
holder, no frame, no queue - and any other thread can enter any group, also one that needs a swap.
Every cross-thread step here is bounded (daemon threads, joins with a timeout): a wedged hold fails
the test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from residency import PhaseError, Scheduler
from residency.core.enums import PhaseStatus

from conftest import make_block, run_block, twin

# Every test here runs twice: with the default GIL switch interval and with 1 us (conftest.py).
pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("switch_interval")]

#: How long a step on another thread may take before the test fails (never reached when green).
JOIN_SECONDS = 20
GROUPS = ("a", "b", "c")


@pytest.fixture
def groups():
    """A CPU scheduler with exclusive groups a, b, c and a resident-policy group vae."""
    scheduler = Scheduler("cpu", wait_timeout=JOIN_SECONDS)
    modules = {name: make_block(8, seed=i) for i, name in enumerate([*GROUPS, "vae"])}
    plain = {name: twin(module) for name, module in modules.items()}
    for name in GROUPS:
        scheduler.add(name, modules[name])
    scheduler.add("vae", modules["vae"], policy="resident")
    yield scheduler, modules, plain
    scheduler.close()


def holds_state(scheduler: Scheduler) -> tuple:
    """Everything the holds know, through their public queries (for "changes nothing")."""
    holds = scheduler._holds
    return (
        [(entry.thread, [(p, p.status, n) for p, n in entry.frames], entry.held) for entry in holds],
        holds.has_holders(),
        holds.queue_is_empty(),
        {name: holds.involves(scheduler[name]) for name in [*GROUPS, "vae"]},
        scheduler.current,
        scheduler.resident_groups(),
        scheduler.transitions.count,
    )


def assert_holds_empty(scheduler: Scheduler) -> None:
    """No thread has a frame or a hold, nobody waits, no group is involved.  (An idle entry left
    in the table is a leak of its own: see the test of resident-policy phases below.)"""
    holds = scheduler._holds
    busy = [(e.thread.name, e.frames, e.held) for e in holds if e.frames or e.held is not None]
    assert busy == [], busy
    assert not holds.has_holders() and holds.holders() == []
    assert holds.queue_is_empty()
    for name in [*GROUPS, "vae"]:
        assert not holds.involves(scheduler[name]), f"the holds still involve {name!r}"


def on_another_thread(fn, name: str = "other"):
    """Run `fn` on a daemon thread; return its result or raise its error; fail if it hangs."""
    outcome: dict[str, object] = {}

    def target():
        try:
            outcome["result"] = fn()
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive(), f"thread {name!r} still running after {JOIN_SECONDS} s: wedged"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("result")


def enter_and_run(scheduler: Scheduler, modules, plain, name: str) -> str | None:
    """Enter `name`'s phase, check it is the current group and runs like the reference."""
    x = torch.randn(2, 8)
    with scheduler.resident(name), torch.no_grad():
        assert scheduler[name].is_resident
        assert torch.equal(run_block(modules[name], x), run_block(plain[name], x))
        return scheduler.current


def any_thread_can_enter_any_group(scheduler, modules, plain) -> None:
    """From another thread: every group, the current one and swaps to the others."""
    current = scheduler.current
    order = [n for n in GROUPS if n != current] + ([current] if current in GROUPS else [])
    for name in order:  # first a group other than the current one: a swap
        assert on_another_thread(lambda: enter_and_run(scheduler, modules, plain, name)) == name
    on_another_thread(lambda: enter_and_run(scheduler, modules, plain, "vae"))
    assert_holds_empty(scheduler)


# -- exits out of order ---------------------------------------------------------------------------


def test_leaving_the_outer_phase_first_is_refused_and_changes_nothing(groups):
    scheduler, modules, plain = groups
    outer, inner = scheduler.resident("a"), scheduler.resident("b")
    outer.__enter__()
    inner.__enter__()
    before = holds_state(scheduler)
    with pytest.raises(PhaseError, match="leave phases in the reverse order of entering them"):
        outer.__exit__(None, None, None)
    assert inner.status is PhaseStatus.ACTIVE
    assert outer.status is PhaseStatus.LEAVING  # its exit is pending, not done
    after = holds_state(scheduler)
    # only the outer phase's status says its exit is pending; frames, holds, placement unchanged
    assert after[1:] == before[1:]
    assert [(t, [(p, n) for p, _, n in frames], held) for t, frames, held in after[0]] == [
        (t, [(p, n) for p, _, n in frames], held) for t, frames, held in before[0]
    ]
    assert scheduler.current == "b" and scheduler._holds.holders() == [threading.current_thread()]
    # the inner phase still runs with its weights
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(run_block(modules["b"], x), run_block(plain["b"], x))
    inner.__exit__(None, None, None)


def test_once_the_inner_phase_is_left_the_outer_closes_and_the_holds_are_empty(groups):
    scheduler, modules, plain = groups
    outer, inner = scheduler.resident("a"), scheduler.resident("b")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(PhaseError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert inner.status is PhaseStatus.EXITED
    assert outer.status is PhaseStatus.EXITED_LATE
    assert_holds_empty(scheduler)
    assert scheduler.current == "b"  # no swap back to 'a': nobody needs it
    outer.__exit__(None, None, None)  # leaving it again does nothing
    assert outer.status is PhaseStatus.EXITED
    assert_holds_empty(scheduler)
    with pytest.raises(PhaseError, match="is exited, not active"):
        outer.__exit__(None, None, None)
    any_thread_can_enter_any_group(scheduler, modules, plain)


def test_three_deep_misnesting_closes_every_pending_phase(groups):
    scheduler, modules, plain = groups
    phases = [scheduler.resident(name) for name in ("a", "vae", "b", "c")]
    for phase in phases:
        phase.__enter__()
    for phase in phases[:2]:  # the two outermost: refused, pending
        with pytest.raises(PhaseError, match="reverse order"):
            phase.__exit__(None, None, None)
    assert scheduler.current == "c"
    phases[3].__exit__(None, None, None)  # c: back to b, which is still open
    assert scheduler.current == "b" and phases[2].status is PhaseStatus.ACTIVE
    assert scheduler._holds.has_holders()
    on_another_thread(lambda: enter_and_run(scheduler, modules, plain, "b"))  # joins b at once
    phases[2].__exit__(None, None, None)  # b: the pending vae and a close with it
    assert [p.status for p in phases[:2]] == [PhaseStatus.EXITED_LATE] * 2
    assert_holds_empty(scheduler)
    any_thread_can_enter_any_group(scheduler, modules, plain)


def test_a_misnested_thread_does_not_block_a_waiter_once_its_inner_phase_is_left(groups):
    """Another thread asks for a third group while the misnested phases are open: it waits,
    and gets it as soon as the inner phase is left (not when the outer's owner leaves it again)."""
    scheduler, modules, plain = groups
    outer, inner = scheduler.resident("a"), scheduler.resident("b")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(PhaseError, match="reverse order"):
        outer.__exit__(None, None, None)
    waiting, done = threading.Event(), threading.Event()
    results: list[object] = []

    def ask_for_c():
        waiting.set()
        try:
            results.append(enter_and_run(scheduler, modules, plain, "c"))
        except BaseException as error:
            results.append(error)
        done.set()

    thread = threading.Thread(target=ask_for_c, name="waiter", daemon=True)
    thread.start()
    assert waiting.wait(JOIN_SECONDS)
    assert not done.wait(0.05)  # b is held: the waiter cannot swap yet
    assert scheduler.current == "b"
    inner.__exit__(None, None, None)
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive(), "the waiter is still waiting after the misnested phases closed"
    assert results == ["c"], results
    assert_holds_empty(scheduler)


# -- the same misnesting, written with `with` ------------------------------------------------------


def test_a_generator_that_is_closed_while_a_phase_entered_after_it_is_open(groups):
    """A generator holds a ``with`` phase across a ``yield``; the caller enters a phase and closes
    the generator first: the generator's ``with`` exit is the misnested one."""
    scheduler, modules, plain = groups

    def steps():
        with scheduler.resident("a"):
            yield "a"
            yield "never"

    walker = steps()
    assert next(walker) == "a"
    inner = scheduler.resident("c")
    inner.__enter__()
    before = holds_state(scheduler)
    with pytest.raises(PhaseError, match="reverse order"):
        walker.close()  # GeneratorExit at the yield: the `with` leaves 'a' while 'c' is open
    assert holds_state(scheduler)[1:] == before[1:]
    assert scheduler.current == "c"
    inner.__exit__(None, None, None)
    assert_holds_empty(scheduler)
    any_thread_can_enter_any_group(scheduler, modules, plain)


def test_two_exit_stacks_closed_in_the_wrong_order(groups):
    """ExitStack misuse: the outer stack is closed while the inner one is still open."""
    scheduler, modules, plain = groups
    outer_stack, inner_stack = contextlib.ExitStack(), contextlib.ExitStack()
    outer_stack.enter_context(scheduler.resident("a"))
    inner_stack.enter_context(scheduler.resident("b"))
    inner_stack.enter_context(scheduler.resident("vae"))
    with pytest.raises(PhaseError, match="reverse order"):
        outer_stack.close()
    assert scheduler.current == "b" and scheduler._holds.has_holders()
    inner_stack.close()
    assert_holds_empty(scheduler)
    outer_stack.close()  # already emptied: nothing to do
    any_thread_can_enter_any_group(scheduler, modules, plain)


def test_an_exception_raised_out_of_misnested_with_blocks(groups):
    """A ``with`` body raises while a phase entered by hand inside it is open: the ``with``'s exit
    is refused (the PhaseError chains the body's error), and the holds still recover."""
    scheduler, modules, plain = groups
    inner = scheduler.resident("b")
    with pytest.raises(PhaseError, match="reverse order") as refused:
        with scheduler.resident("a"):
            inner.__enter__()
            raise KeyError("the body failed")
    assert isinstance(refused.value.__context__, KeyError)
    assert scheduler.current == "b" and inner.status is PhaseStatus.ACTIVE
    inner.__exit__(None, None, None)
    assert_holds_empty(scheduler)
    any_thread_can_enter_any_group(scheduler, modules, plain)


# -- exits on the wrong thread --------------------------------------------------------------------


def test_leaving_a_phase_on_another_thread_raises_and_changes_nothing(groups):
    scheduler, modules, plain = groups
    phase = scheduler.resident("a")
    phase.__enter__()
    before = holds_state(scheduler)
    with pytest.raises(PhaseError, match=r"left on thread 'intruder', which did not enter it"):
        on_another_thread(lambda: phase.__exit__(None, None, None), name="intruder")
    assert holds_state(scheduler) == before
    assert phase.status is PhaseStatus.ACTIVE
    assert scheduler._holds.holders() == [threading.current_thread()]
    phase.__exit__(None, None, None)  # the owner leaves it normally
    assert_holds_empty(scheduler)
    any_thread_can_enter_any_group(scheduler, modules, plain)


def test_leaving_on_another_thread_that_has_phases_of_its_own_changes_neither(groups):
    """A co-holder of the group (its own phase open) tries to leave my phase: refused, and
    neither thread's frames or holds change."""
    scheduler, modules, plain = groups
    mine = scheduler.resident("a")
    mine.__enter__()
    entered, release, outcome = threading.Event(), threading.Event(), {}

    def co_holder():
        with scheduler.resident("a") as group:  # joins a
            outcome["before"] = holds_state(scheduler)
            try:
                mine.__exit__(None, None, None)
            except PhaseError as error:
                outcome["error"] = error
            outcome["after"] = holds_state(scheduler)
            outcome["resident"] = group.is_resident
            entered.set()
            release.wait(JOIN_SECONDS)

    thread = threading.Thread(target=co_holder, name="co-holder", daemon=True)
    thread.start()
    try:
        assert entered.wait(JOIN_SECONDS)
        assert "left on thread 'co-holder', which did not enter it" in str(outcome.get("error"))
        assert outcome["after"] == outcome["before"] and outcome["resident"]
        assert mine.status is PhaseStatus.ACTIVE
        assert len(scheduler._holds.holders()) == 2
    finally:
        release.set()
        thread.join(JOIN_SECONDS)
    assert not thread.is_alive()
    mine.__exit__(None, None, None)
    assert_holds_empty(scheduler)
    any_thread_can_enter_any_group(scheduler, modules, plain)


# -- the table forgets idle threads ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["this thread", "another thread"])
def test_a_resident_policy_phase_outside_every_exclusive_one_leaves_no_entry(groups, where):
    """Threads that only ever enter the always-resident group (a VAE decode on a worker) must not
    pile up in the table: each would be kept alive, and every `involves` would walk them all."""
    scheduler, modules, plain = groups

    def decode():
        enter_and_run(scheduler, modules, plain, "vae")

    if where == "this thread":
        decode()
    else:
        for index in range(3):
            on_another_thread(decode, name=f"decoder-{index}")
    assert_holds_empty(scheduler)
    assert [e.thread.name for e in scheduler._holds] == []
