"""Threads: the one-exclusive-group invariant under concurrent phases, and waits that cannot hang.

Every test here is bounded: worker threads are daemons joined with a timeout, and a test fails
(naming the threads still alive) rather than hanging on a deadlock.  `faulthandler` dumps every
thread's stack if a test overstays its watchdog, which shows where a hang sits.
"""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
import time

import pytest
import torch

from residency import DeadlockError, Scheduler

from conftest import make_block, run_block, twin

# Every test here runs twice: with the default GIL switch interval and with 1 us (conftest.py).
pytestmark = pytest.mark.usefixtures("switch_interval")

#: A test that has not finished after this many seconds dumps every thread's stack.
WATCHDOG_SECONDS = 60
#: How long a test waits for its threads before failing.
JOIN_SECONDS = 120


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=False, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(params=["group", "arrival"])
def scheduler(request):
    """A CPU scheduler under each order of turns: the guarantees here hold under both."""
    s = Scheduler("cpu", order=request.param)
    yield s
    s.close()


@pytest.fixture
def frequent_switches(switch_interval):
    """Hand the GIL between threads every 10 us (or more often, in the 1 us run) instead of 5 ms:
    many more interleavings."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 1e-5))
    yield
    sys.setswitchinterval(interval)


@pytest.mark.fast
def test_the_switch_interval_is_the_one_asked_for(switch_interval):
    """The two runs of this module really differ (the 1 us run is not the default again)."""
    assert sys.getswitchinterval() == switch_interval
    assert switch_interval == pytest.approx(1e-6) or switch_interval >= 1e-3


def run_threads(targets: dict[str, object], timeout: float = JOIN_SECONDS) -> None:
    """Start one daemon thread per named target, join them all, fail if any is still running."""
    threads = [threading.Thread(target=fn, name=name, daemon=True) for name, fn in targets.items()]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running after {timeout} s (deadlock?): {hung}"


def call_bounded(fn, timeout: float = JOIN_SECONDS):
    """Run `fn` on a daemon thread; return its result or raise its error; fail if it hangs."""
    outcome: dict[str, object] = {}

    def target():
        try:
            outcome["result"] = fn()
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error

    run_threads({"bounded-call": target}, timeout)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("result")


class Groups:
    """Exclusive groups g0..g{n-1} and a resident-policy group 'vae', with expected outputs."""

    def __init__(self, scheduler: Scheduler, count: int, width: int = 16) -> None:
        self.scheduler = scheduler
        self.names = [f"g{i}" for i in range(count)]
        self.modules = {name: make_block(width, seed=i) for i, name in enumerate(self.names)}
        self.modules["vae"] = make_block(width, seed=100)
        self.x = torch.randn(4, width)
        with torch.no_grad():
            self.expected = {n: run_block(twin(m), self.x) for n, m in self.modules.items()}
        for name in self.names:
            scheduler.add(name, self.modules[name])
        scheduler.add("vae", self.modules["vae"], policy="resident")

    def exclusive_resident(self) -> list[str]:
        return [n for n in self.names if self.scheduler[n].is_resident]

    def check_inside(self, name: str, problems: list[str]) -> None:
        """Inside a phase of `name`: it is the one exclusive group resident; outputs match."""
        resident = self.exclusive_resident()
        if resident != [name]:
            problems.append(f"inside {name!r}: resident exclusive groups are {resident}")
        if self.scheduler.current != name:
            problems.append(f"inside {name!r}: scheduler.current is {self.scheduler.current!r}")
        with torch.no_grad():
            for group in (name, "vae"):
                if not torch.equal(run_block(self.modules[group], self.x), self.expected[group]):
                    problems.append(f"inside {name!r}: the output of {group!r} differs")


def observe(groups: Groups, stop: threading.Event, problems: list[str], seen: list[int]):
    """Holding no phase, read the public view until `stop`: never two exclusive groups."""

    def target():
        exclusive = set(groups.names)
        while not stop.is_set():
            resident = groups.scheduler.resident_groups()
            seen[0] += 1
            if len(exclusive.intersection(resident)) > 1 or "vae" not in resident:
                problems.append(f"observer saw {resident}")
                return

    return target


def test_four_threads_in_different_groups_keep_the_invariant_and_outputs(
    scheduler, frequent_switches
):
    groups = Groups(scheduler, count=4)
    problems: list[str] = []
    stop, seen, start = threading.Event(), [0], threading.Barrier(5)

    def worker(index: int):
        name = groups.names[index]
        other = groups.names[(index + 1) % 4]

        def target():
            start.wait(JOIN_SECONDS)
            try:
                for step in range(60):
                    with scheduler.resident(name):
                        groups.check_inside(name, problems)
                        if step % 5 == 0:  # a nested phase, then our group must be back
                            with scheduler.resident(other):
                                groups.check_inside(other, problems)
                            groups.check_inside(name, problems)
                        if step % 7 == 0:
                            with scheduler.resident("vae"):
                                groups.check_inside(name, problems)
            except BaseException as error:
                problems.append(f"{name}: {error!r}")

        return target

    def observer():
        start.wait(JOIN_SECONDS)
        observe(groups, stop, problems, seen)()

    observer_thread = threading.Thread(target=observer, name="observer", daemon=True)
    observer_thread.start()
    try:
        run_threads({f"worker-{i}": worker(i) for i in range(4)})
    finally:
        stop.set()
        observer_thread.join(JOIN_SECONDS)
    assert not observer_thread.is_alive()
    assert not problems, problems[:5]
    assert seen[0] > 0
    assert scheduler.transitions.count > 4  # the threads really did take turns


def test_four_threads_hammering_three_groups_never_see_two_exclusive_groups(
    scheduler, frequent_switches
):
    groups = Groups(scheduler, count=3)
    problems: list[str] = []
    stop, seen = threading.Event(), [0]

    def hammer(seed: int):
        rng = random.Random(seed)

        def target():
            try:
                for _ in range(150):
                    name = rng.choice(groups.names)
                    with scheduler.resident(name):
                        groups.check_inside(name, problems)
                        if rng.random() < 0.2:
                            inner = rng.choice(groups.names)
                            with scheduler.resident(inner):
                                groups.check_inside(inner, problems)
                            groups.check_inside(name, problems)
                        if rng.random() < 0.1:
                            raise _Expected
            except _Expected:
                pass
            except BaseException as error:
                problems.append(f"hammer {seed}: {error!r}")

        def repeat():
            for _ in range(3):
                target()

        return repeat

    observer = threading.Thread(target=observe(groups, stop, problems, seen), daemon=True)
    observer.start()
    try:
        run_threads({f"hammer-{i}": hammer(i) for i in range(4)})
    finally:
        stop.set()
        observer.join(JOIN_SECONDS)
    assert not problems, problems[:5]
    assert len(groups.exclusive_resident()) <= 1
    for name in groups.names + ["vae"]:
        with scheduler.resident(name), torch.no_grad():
            assert torch.equal(run_block(groups.modules[name], groups.x), groups.expected[name])


class _Expected(Exception):
    """Raised inside phases on purpose."""


@pytest.mark.fast
def test_a_thread_that_ended_inside_a_phase_raises_deadlock_error_instead_of_hanging(scheduler):
    groups = Groups(scheduler, count=2)

    def enter_and_end():
        scheduler.resident("g0").__enter__()  # never left: the thread ends holding g0

    run_threads({"forgetful": enter_and_end})
    assert scheduler.current == "g0"

    def ask_for_g1():
        with scheduler.resident("g1"):
            pass

    with pytest.raises(
        DeadlockError,
        match=r"group 'g1' waited on group 'g0', held by phases of thread\(s\) 'forgetful' that "
        r"ended without leaving them; those holds are now released",
    ):
        call_bounded(ask_for_g1)
    # the scheduler is usable afterwards, from this thread and from others
    problems: list[str] = []
    with scheduler.resident("g1"):
        groups.check_inside("g1", problems)

    def use_g0():
        with scheduler.resident("g0"):
            groups.check_inside("g0", problems)

    call_bounded(use_g0)
    assert not problems, problems
    assert len(groups.exclusive_resident()) == 1


@pytest.mark.fast
def test_the_same_group_joins_a_dead_holder_but_another_group_is_not_wedged(scheduler):
    groups = Groups(scheduler, count=2)
    run_threads({"forgetful": lambda: scheduler.resident("g0").__enter__()})
    problems: list[str] = []
    with scheduler.resident("g0"):  # joining the resident group needs no wait
        groups.check_inside("g0", problems)
    with pytest.raises(DeadlockError, match="ended without leaving them"):
        call_bounded(lambda: scheduler.resident("g1").__enter__())
    with scheduler.resident("g1"):
        groups.check_inside("g1", problems)
    assert not problems


def hold_in_a_thread(scheduler: Scheduler, group: str, thread_name: str):
    """Start a thread that holds `group` until the returned event is set."""
    entered, release = threading.Event(), threading.Event()

    def holder():
        with scheduler.resident(group):
            entered.set()
            release.wait(JOIN_SECONDS)

    thread = threading.Thread(target=holder, name=thread_name, daemon=True)
    thread.start()
    assert entered.wait(JOIN_SECONDS)
    return thread, release


@pytest.mark.parametrize("order", ["group", "arrival"])
def test_wait_timeout_turns_a_long_wait_into_deadlock_error(order):
    scheduler = Scheduler("cpu", wait_timeout=0.2, order=order)
    groups = Groups(scheduler, count=2)
    thread, release = hold_in_a_thread(scheduler, "g0", "slow-holder")

    def ask_for_g1():
        with scheduler.resident("g1"):
            pass

    started = time.monotonic()
    with pytest.raises(
        DeadlockError,
        match=r"waited 0\.2 s for group 'g1': group 'g0' is held by 'slow-holder'\. "
        r"Leave phases promptly, or raise wait_timeout",
    ):
        call_bounded(ask_for_g1)
    assert time.monotonic() - started < JOIN_SECONDS
    assert thread.is_alive() and scheduler.current == "g0"  # the holder was not disturbed
    release.set()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive()
    problems: list[str] = []

    def use_g1():
        with scheduler.resident("g1"):
            groups.check_inside("g1", problems)

    call_bounded(use_g1)
    assert not problems, problems
    scheduler.close()


@pytest.mark.parametrize("order", ["group", "arrival"])
def test_a_timed_out_nested_phase_gives_the_outer_group_back(order):
    scheduler = Scheduler("cpu", wait_timeout=0.2, order=order)
    groups = Groups(scheduler, count=2)
    thread, release = hold_in_a_thread(scheduler, "g0", "co-holder")
    problems: list[str] = []

    def nested():
        with scheduler.resident("g0"):
            with pytest.raises(DeadlockError, match="waited 0.2 s for group 'g1'"):
                with scheduler.resident("g1"):
                    pass
            groups.check_inside("g0", problems)

    call_bounded(nested)
    release.set()
    thread.join(JOIN_SECONDS)
    assert not problems, problems
    scheduler.close()


def test_waiting_threads_are_served_and_none_starves(scheduler):
    """Many threads queue for two groups held in turn: every request completes in bounded time."""
    groups = Groups(scheduler, count=2)
    done = [0]
    lock = threading.Lock()
    problems: list[str] = []

    def worker(name: str):
        def target():
            for _ in range(40):
                with scheduler.resident(name):
                    groups.check_inside(name, problems)
                with lock:
                    done[0] += 1

        return target

    run_threads({f"w{i}": worker(groups.names[i % 2]) for i in range(6)})
    assert done[0] == 6 * 40
    assert not problems, problems[:5]


def test_reading_the_transition_log_while_another_thread_changes_phases(scheduler, switch_interval):
    """A monitor thread reads ``scheduler.transitions`` (and summarizes it) while phases change."""
    from residency import summarize

    groups = Groups(scheduler, count=2)
    stop = threading.Event()
    problems: list[str] = []

    def swapper():
        try:
            while not stop.is_set():
                for name in groups.names:
                    with scheduler.resident(name):
                        pass
        except BaseException as error:
            problems.append(f"swapper: {error!r}")

    thread = threading.Thread(target=swapper, name="swapper", daemon=True)
    thread.start()
    deadline = time.monotonic() + JOIN_SECONDS
    try:  # each read walks the whole log, which grows as phases change
        reads = 0
        while reads < 1000 or scheduler.transitions.count <= 2:  # the swapper may start late
            assert time.monotonic() < deadline, "the swapper changed no phase"
            for record in scheduler.transitions:
                assert record.to_group in (*groups.names, "vae", None)
            summarize(scheduler.transitions)
            reads += 1
    finally:
        stop.set()
        thread.join(JOIN_SECONDS)
    assert not thread.is_alive()
    assert not problems, problems
    assert scheduler.transitions.count > 2
