"""Many requests on one pipeline (issue 46): group order shares phase changes, nobody starves,
and a request that fails stalls no other.

Each request is a thread that runs the phases of a Wan2.2-shaped pipeline on `Scheduler("cpu")`:
the text encoder once, then 5 high-noise and 5 low-noise expert steps, 2 ms of host work between
steps (a sampler's).  Arrivals are exponential gaps of mean 12 ms from a seeded generator.  Every
wait is bounded (`BOUND`); no assertion depends on how fast this machine is: the counts compared
are of the same run, and the one time bound (a waiter's turn under ``max_wait`` 0.1 s within
1.5 s) has 14x slack.
"""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch
from torch import nn

from residency import ConfigError, Scheduler, TurnOrder

from _dist import run_world

#: Seconds any wait on another thread may take before the test fails.
BOUND = 60.0
#: (group, Linear(256, 256) layers): the encoder, then the two experts.
GROUPS = (("text_encoder", 6), ("high", 12), ("low", 12))
STEPS = 5
HOST_WORK = 0.002
MEAN_GAP = 0.012


def _pipeline(seed: int = 0) -> dict[str, nn.Sequential]:
    torch.manual_seed(seed)
    return {name: nn.Sequential(*(nn.Linear(256, 256) for _ in range(depth)))
            for name, depth in GROUPS}


def _steps() -> list[str]:
    return ["text_encoder"] + ["high"] * STEPS + ["low"] * STEPS


def _inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 256, generator=generator) for _ in range(count)]


def _alone(models: dict[str, nn.Sequential], x: torch.Tensor) -> torch.Tensor:
    """A request on the modules never offloaded."""
    with torch.no_grad():
        for name in _steps():
            x = models[name](x)
    return x


class Requests:
    """`count` requests on their own threads against `scheduler`, arriving with exponential
    gaps; each checks, inside every forward, that its group alone of the exclusive ones is on
    the device."""

    def __init__(self, scheduler: Scheduler, models, inputs, *, fail: int | None = None):
        self.scheduler, self.models, self.inputs, self.fail = scheduler, models, inputs, fail
        self.outputs: dict[int, object] = {}
        self.problems: list[str] = []

    def run(self, seed: int = 2) -> None:
        gaps = random.Random(seed)
        threads = []
        for index in range(len(self.inputs)):
            thread = threading.Thread(target=self._request, args=(index,), daemon=True)
            thread.start()
            threads.append(thread)
            time.sleep(gaps.expovariate(1 / MEAN_GAP))
        for thread in threads:
            thread.join(BOUND)
        assert not [t for t in threads if t.is_alive()], "a request never finished"

    def _request(self, index: int) -> None:
        try:
            x = self.inputs[index]
            for step, name in enumerate(_steps()):
                with self.scheduler.resident(name), torch.no_grad():
                    self._check_alone(name)
                    if index == self.fail and step == 3:
                        raise RuntimeError("this request fails mid-way")
                    x = self.models[name](x)
                time.sleep(HOST_WORK)
            self.outputs[index] = x
        except RuntimeError as error:
            self.outputs[index] = error

    def _check_alone(self, name: str) -> None:
        on_device = [group for group in self.scheduler.resident_groups() if group != name]
        if self.scheduler.current != name or on_device:
            self.problems.append(f"{name}: current {self.scheduler.current}, also {on_device}")


def _serve(order: str, count: int = 8, fail: int | None = None):
    models = _pipeline()
    plain = copy.deepcopy(models)
    inputs = _inputs(count)
    scheduler = Scheduler("cpu", order=order)
    for name, model in models.items():
        scheduler.add(name, model)
    requests = Requests(scheduler, models, inputs, fail=fail)
    requests.run()
    expected = [_alone(plain, x) for x in inputs]
    return scheduler, requests, expected


def test_group_order_makes_at_most_half_the_phase_changes_of_arrival_order():
    changes = {}
    for order in ("arrival", "group"):
        scheduler, requests, expected = _serve(order)
        assert requests.problems == []
        assert all(torch.equal(requests.outputs[i], expected[i]) for i in range(8)), order
        changes[order] = len(scheduler.transitions)
        waits = scheduler.waits
        assert waits["high"].entries == waits["low"].entries == 8 * STEPS
        scheduler.close()
    print(f"\nphase changes for 8 requests: {changes}")
    assert changes["group"] <= changes["arrival"] / 2, changes


@pytest.mark.parametrize("order", ["group", "arrival"])
def test_a_request_that_raises_stalls_no_other(order):
    scheduler, requests, expected = _serve(order, count=4, fail=1)
    assert isinstance(requests.outputs[1], RuntimeError)
    assert [i for i in (0, 2, 3) if not torch.equal(requests.outputs[i], expected[i])] == []
    assert requests.problems == []
    with scheduler.resident("high"):  # nobody holds anything any more
        pass
    scheduler.close()


def test_a_waiter_for_another_group_gets_its_turn_while_others_keep_re_entering():
    scheduler = Scheduler("cpu", order={"by": "group", "max_wait": 0.1})
    scheduler.add("a", nn.Linear(64, 64))
    scheduler.add("b", nn.Linear(64, 64))
    stop = threading.Event()
    loops = [0, 0, 0]

    def loop(index: int) -> None:
        while not stop.is_set():
            with scheduler.resident("a"):
                loops[index] += 1
                time.sleep(0.001)

    loopers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(3)]
    for thread in loopers:
        thread.start()
    deadline = time.monotonic() + BOUND
    while min(loops) < 3:
        assert time.monotonic() < deadline, "the loopers never looped"
        time.sleep(0.001)
    asked = time.monotonic()
    with scheduler.resident("b"):
        waited = time.monotonic() - asked
        still_looping = all(thread.is_alive() for thread in loopers)
    counted = list(loops)
    stop.set()
    for thread in loopers:
        thread.join(BOUND)
    assert still_looping and waited < 1.5, (waited, counted)
    last = scheduler.transitions[-2 if scheduler.current == "a" else -1]
    assert last.to_group == "b" or any(
        r.to_group == "b" and r.reason == "waited past max_wait" for r in scheduler.transitions)
    assert [r.reason for r in scheduler.transitions if r.to_group == "b"] == [
        "waited past max_wait"]
    scheduler.close()


def _refusal_worker(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    from residency import ConfigError, Scheduler

    try:
        Scheduler("cpu", process_group=dist.group.WORLD, order="group")
        refused = ""
    except ConfigError as error:
        refused = str(error)
    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    by = scheduler.order.by
    scheduler.close()
    return {"refused": refused, "default": by}


def test_ranks_that_must_agree_refuse_group_order_and_default_to_arrival(tmp_path):
    """Several ranks switch groups collectively, in the same order on every rank; group order
    decides from each rank's own threads' timing, so it is refused there (gloo, 2 ranks)."""
    results = run_world(_refusal_worker, 2, tmp_path, timeout=60)
    for result in results:
        assert result is not None and "raised" not in result, result
        assert result["default"] == "arrival"
        assert "order='group' with a process_group: the ranks must switch groups in the same " \
               "order" in result["refused"]
        assert "give order='arrival'" in result["refused"]


def test_the_order_reaches_the_scheduler_through_enable_offload_and_from_pipeline():
    from residency.adapters.diffusers import disable_offload, enable_offload
    from residency.app.synthetic import SyntheticWan22

    from _tiny_pipelines import tiny_flux

    pipe = tiny_flux()
    scheduler = enable_offload(pipe, {"mode": "module", "components": ["dit", "text_encoder"],
                                      "order": {"by": "group", "max_wait": 0.2}}, device="cpu")
    assert scheduler.order == TurnOrder(by="group", max_wait=0.2)
    disable_offload(pipe)
    with pytest.raises(ConfigError, match="offload config field 'order'"):
        enable_offload(pipe, {"mode": "module", "components": ["dit"], "order": "fifo"},
                       device="cpu")
    synthetic = SyntheticWan22.build("tiny")
    scheduler = Scheduler.from_pipeline(
        synthetic, '{"mode": "layer", "components": ["dit"], "order": "arrival"}', device="cpu")
    assert scheduler.order == TurnOrder(by="arrival")
    scheduler.close()
