"""Calls (residency/group/calls.py): each call's bytes and span, counted from the first call
on - marked by hand, by the diffusers adapter, or found from the phase order - across re-plans,
under concurrent calls, and what an auto plan learns from them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from residency import PhaseError, Scheduler, SchedulerClosedError

pytestmark = pytest.mark.fast

WIDTH = 32
#: An auto plan's options: a budget of the six layers' weight matrices (their biases aside).
AUTO = {"device_budget": 6 * WIDTH * WIDTH * 4, "headroom": 0}
#: How long a test thread waits for another before the test fails (never reached when it passes).
BOUND_S = 30.0


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"encoder": nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)),
            "dit": nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])}


def _scheduler(models, **options) -> Scheduler:
    scheduler = Scheduler("cpu", **options)
    for name, model in models.items():
        scheduler.add(name, model)
    return scheduler


def _run(scheduler, models, x, *, marked=True, outside=None):
    """One use of the pipeline: the encoder once, the dit twice."""
    with scheduler.call() if marked else _nothing():
        with scheduler.resident("encoder"):
            h = models["encoder"](x)
        if outside is not None:
            outside()
        for _ in range(2):
            with scheduler.resident("dit"):
                h = models["dit"](h)
    return h


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _moved(scheduler) -> int:
    return scheduler.transitions.nbytes + scheduler.block_records.nbytes


def test_each_marked_call_is_counted_when_it_ends_and_the_bytes_sum_to_the_records():
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models, auto=AUTO)
        before = _moved(scheduler)  # the loads of registration: before the first call
        numbers = []
        for call in range(3):
            _run(scheduler, models, x)
            plan = scheduler.plan
            numbers.append([record.number for record in plan.measured])
            assert sum(r.nbytes for r in plan.measured) == _moved(scheduler) - before, call
            assert plan.measured.count == call + 1 and plan.measured.nbytes == sum(
                r.nbytes for r in plan.measured)
            assert all(r.ending == "returned" and not r.overlapped and r.seconds > 0
                       for r in plan.measured)
            assert f"measured call {call + 1}: " in plan.describe()
        scheduler.close()
    assert numbers == [[1], [1, 2], [1, 2, 3]]
    assert plan.measured is scheduler.calls  # one log across the re-plans
    assert plan.reason in ("first call observed", "a steady call measured")


def test_a_re_plans_loads_land_in_the_next_call():
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models, auto=AUTO)
        _run(scheduler, models, x)
        transitions = len(scheduler.transitions)
        _run(scheduler, models, x)  # begins with the plan "first call observed"
        second = scheduler.calls[-1]
        loads = [r.nbytes for r in list(scheduler.transitions)[transitions:]]
        scheduler.close()
    assert second.nbytes == sum(loads) + 0  # transitions only: nothing streams at this budget
    assert scheduler.plan.reason in ("first call observed", "a steady call measured")


def test_a_fixed_scheduler_counts_marked_calls_too():
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models)
        before = scheduler.transitions.nbytes
        for _ in range(2):
            _run(scheduler, models, x)
        _run(scheduler, models, x, marked=False)  # not marked: not counted
        calls = list(scheduler.calls)
        scheduler.close()
    assert [c.number for c in calls] == [1, 2]
    encoder = sum(t.nbytes for t in models["encoder"].state_dict().values())
    dit = sum(t.nbytes for t in models["dit"].state_dict().values())
    # call 1 moves the dit (the encoder was placed at add); call 2 both
    assert [c.nbytes for c in calls] == [dit + (encoder if before == 0 else 0), encoder + dit]


def test_unmarked_calls_of_an_auto_scheduler_end_where_the_next_begins():
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models, auto={"device_budget": AUTO["device_budget"]})
        before = _moved(scheduler)
        for _ in range(3):
            _run(scheduler, models, x, marked=False)
        calls = list(scheduler.calls)
        moved = _moved(scheduler)
        with scheduler.resident("encoder"):  # the fourth begins: the third ends
            pass
        after = list(scheduler.calls)
        scheduler.close()
    assert [(c.number, c.ending) for c in calls] == [(1, "next call"), (2, "next call")]
    assert len(after) == 3 and sum(c.nbytes for c in after) == moved - before


def _overlapping_pair(scheduler, models, x) -> None:
    """Two calls, one per thread, open at once: both end overlapped."""
    inside, release = threading.Event(), threading.Event()
    errors = []

    def other():
        try:
            with scheduler.call():
                inside.set()
                assert release.wait(BOUND_S)
                with scheduler.resident("dit"):
                    models["dit"](x)
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    assert inside.wait(BOUND_S)
    with scheduler.call():
        with scheduler.resident("encoder"):
            models["encoder"](x)
        release.set()
    thread.join(BOUND_S)
    assert not thread.is_alive() and not errors, errors


@pytest.mark.parametrize("order", ["arrival", "group"])
def test_overlapping_calls_are_marked_and_teach_the_plan_nothing(order):
    """Under either order of turns (issue 46): the bytes still sum, and the plan holds."""
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models, auto={"device_budget": AUTO["device_budget"]},
                               order=order)
        before, plan = _moved(scheduler), scheduler.plan
        _overlapping_pair(scheduler, models, x)
        calls = list(scheduler.calls)
        moved = _moved(scheduler)
        after = scheduler.plan
        scheduler.close()
    assert sorted(c.number for c in calls) == [1, 2] and all(c.overlapped for c in calls)
    assert sum(c.nbytes for c in calls) == moved - before
    assert after is plan  # nothing learned, nothing re-planned
    assert "overlapped" in after.describe()


def test_host_time_outside_the_phases_is_in_the_prediction():
    """The span a call measures includes the host's time outside phases, so the plan predicts
    at least that (a lower bound: a sleep lasts at least its length)."""
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models, auto={"device_budget": AUTO["device_budget"]})
        for _ in range(3):
            _run(scheduler, models, x, outside=lambda: time.sleep(0.05))
        plan = scheduler.plan
        scheduler.close()
    assert plan.predicted.seconds >= 0.05
    assert all(c.seconds >= 0.05 for c in plan.measured)


def test_a_call_left_open_on_a_thread_is_ended_found_by_its_next_call():
    models = _models()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        scheduler = _scheduler(models)
        left = scheduler.call().begin()  # as if an interrupt lost the handle
        _run(scheduler, models, x)
        calls = list(scheduler.calls)
        with pytest.raises(PhaseError, match=r"call 1 was already ended \(\"found\"\) when a "
                           r"later call began on its thread: one call per thread at a time"):
            left.end()
        scheduler.close()
    assert [(c.number, c.ending, c.overlapped) for c in calls] == [
        (1, "found", False), (2, "returned", False)]


def test_a_call_is_begun_once_and_ended_once():
    models = _models()
    with torch.no_grad():
        scheduler = _scheduler(models)
        call = scheduler.call()
        with pytest.raises(PhaseError, match=r"this call has not begun: begin\(\) a call once "
                           r"and end\(\) it once"):
            call.end()
        call.begin()
        with pytest.raises(PhaseError, match=r"call 1 has already begun; make a new one with "
                           r"scheduler.call\(\) for the next request"):
            call.begin()
        with pytest.raises(PhaseError, match=r"a call ends 'returned' or 'raised' or 'found', "
                           r"not 'done'"):
            call.end("done")
        assert len(scheduler.calls) == 0
        record = call.end()
        with pytest.raises(PhaseError, match=r"this call has already ended"):
            call.end()
        assert list(scheduler.calls) == [record]
        scheduler.close()
        with pytest.raises(SchedulerClosedError, match=r"this scheduler was closed"):
            scheduler.call().begin()
    assert len(scheduler.calls) == 1


def test_a_call_that_raises_ends_raised():
    models = _models()
    with torch.no_grad():
        scheduler = _scheduler(models)
        with pytest.raises(ValueError, match="bad input"):
            with scheduler.call():
                raise ValueError("bad input")
        scheduler.close()
    assert [c.ending for c in scheduler.calls] == ["raised"]


def test_an_interrupt_anywhere_in_a_calls_end_counts_it_once():
    """[Note: one commit point] in residency/group/calls.py: an end cut short at any line
    counts the call once - by its retry, or by the thread's next call - never twice."""
    from tests._interrupts import sweep

    x = torch.randn(2, WIDTH)

    def build():
        models = _models()
        scheduler = _scheduler(models)
        call = scheduler.call().begin()
        _run(scheduler, models, x, marked=False)
        return scheduler, models, call

    def operation(world):
        world[2].end()

    def after(world):
        scheduler, models, call = world
        if call.record is None:
            try:
                call.end()  # the user's retry
            except PhaseError:
                pass
        _run(scheduler, models, x)

    def check(world):
        scheduler = world[0]
        calls = list(scheduler.calls)
        assert [c.number for c in calls] == [1, 2], calls
        assert scheduler.calls.count == 2 and not any(c.overlapped for c in calls)
        assert [c.ending for c in calls] == ["returned", "returned"]
        assert scheduler.calls.nbytes == sum(c.nbytes for c in calls) == _moved(scheduler)
        scheduler.close()

    with torch.no_grad():
        assert sweep(build, operation, check, after=after) > 10


@pytest.mark.parametrize("declared", [False, True], ids=["nothing declared", "passes declared"])
def test_calls_that_keep_overlapping_say_once_what_to_declare(caplog, declared):
    """Under concurrent requests from the start no call runs alone, so the plan learns nothing:
    after three such calls it says so once, naming what to declare; not when it was declared."""
    import logging

    models = _models()
    x = torch.randn(2, WIDTH)
    auto = {**AUTO, **({"passes": {"dit": 2}} if declared else {})}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="residency"):
        scheduler = _scheduler(models, auto=auto)
        for _ in range(3):
            _overlapping_pair(scheduler, models, x)
        calls = list(scheduler.calls)
        scheduler.close()
    assert len(calls) == 6 and all(c.overlapped for c in calls)
    said = [r.getMessage() for r in caplog.records if "calls overlapped" in r.getMessage()]
    assert said == ([] if declared else [
        "auto plan: 3 calls overlapped (concurrent requests) and none ran alone, so the plan "
        "learned no phase order, entries or passes (it plans each group entered once a call); "
        "declare them: auto_options {'passes': {group: forwards per call}, 'phase_order': "
        "[...]}"]), said
