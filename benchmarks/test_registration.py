"""Cold start: ``Scheduler.add`` (inventory, host master, pinning on an accelerator) against bytes.

Each round builds a fresh module of the size (its weights touched, so only registration is timed)
and a fresh scheduler, and times ``add``.  The floor is a plain copy of the same bytes into a reused
buffer: registration has to copy every byte into the master once, and the goal is to cost little more.
A second reference, a copy into a freshly allocated host buffer (``fresh_copy_s``), shows what the
first touch of new memory costs on the machine: the master is new memory by nature.
"""

from __future__ import annotations

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples
from benchmarks.goals import REGISTRATION
from benchmarks.models import Stack
from benchmarks.scale import tensors_for
from residency import Scheduler


def test_cold_start(benchmark, scale, device, cold_nbytes):
    tensors = tensors_for(cold_nbytes)
    copy_floor = CopyFloor(cold_nbytes, device)
    floor = FloorSamples(copy_floor)
    fresh_copy = FloorSamples(copy_floor.fresh_host_seconds)
    registered = []

    def fresh():
        floor.before_round()
        fresh_copy.before_round()
        return (Scheduler(device), Stack(cold_nbytes, tensors)), {}

    def register(scheduler, module):
        registered[:] = [scheduler.add("cold", module)]  # keep one master alive, not all

    def close(scheduler, module):
        scheduler.close()

    benchmark.pedantic(register, setup=fresh, teardown=close, rounds=scale.rounds(cold_nbytes),
                       warmup_rounds=1)
    group = registered[-1]
    assert group.host_master.nbytes >= group.nbytes
    record(benchmark, case="cold_start", nbytes=group.nbytes, tensors=tensors,
           floor_s=floor.median(), goal=REGISTRATION, fresh_copy_s=fresh_copy.median(),
           pinned=group.host_master.pinned,
           master_nbytes=group.host_master.nbytes)
