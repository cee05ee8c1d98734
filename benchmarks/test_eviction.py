"""Eviction of unchanged weights (digests checked, then re-pointing) against changed weights.

Each round loads the group (and, for "changed", gives every weight new values in place under
``no_grad``, as an optimizer step would), then times the transition to a one-tensor group.  The
judged figure is the eviction part of that transition, read from ``scheduler.transitions``; the floor
is a plain copy of the group's bytes, which is what writing every weight back costs at best.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples, synchronize
from benchmarks.goals import EVICT_CHECKED, EVICT_UNCHANGED
from benchmarks.models import Stack


@pytest.mark.parametrize("weights", ["unchanged", "changed"])
def test_eviction(benchmark, scheduler, scale, device, weights):
    """The per-tensor part of an eviction (re-pointing; ``detect_edits=False``, so no byte is
    read for an unchanged group), and the write-back of a changed one (detected by digests)."""
    changed = weights == "changed"
    _measure_eviction(benchmark, scheduler, scale, device, scale.evict_nbytes, scale.evict_tensors,
                      changed=changed, case=f"evict_{weights}",
                      goal=None if changed else EVICT_UNCHANGED, detect_edits=changed)


def test_eviction_of_an_unchanged_swap_sized_group(benchmark, scheduler, scale, device):
    """Issue 12's cost goal: finding that nothing changed in a 400 MiB group (digests of the device
    bytes against those taken at load) costs at most 0.6x copying the group."""
    _measure_eviction(benchmark, scheduler, scale, device, scale.swap_nbytes, scale.swap_tensors,
                      changed=False, case="evict_checked", goal=EVICT_CHECKED)


def _measure_eviction(benchmark, scheduler, scale, device, nbytes, tensors, *, changed, case, goal,
                      detect_edits=True):
    group = scheduler.add("weights", Stack(nbytes, tensors), detect_edits=detect_edits)
    scheduler.add("other", Stack(4096, 1))
    floor = FloorSamples(CopyFloor(group.nbytes, device))

    def load_group():
        floor.before_round()
        with scheduler.resident("weights"):
            if changed:
                with torch.no_grad():
                    for tensor in group.tensors:
                        tensor.neg_()  # new bytes in every chunk
        synchronize(device)

    def leave_group():
        with scheduler.resident("other"):
            pass
        synchronize(device)

    rounds = scale.rounds(group.nbytes)
    benchmark.pedantic(leave_group, setup=load_group, rounds=rounds, warmup_rounds=1)
    evictions = [r for r in scheduler.transitions if r.from_group == "weights"]
    evictions = evictions[-(1 if benchmark.disabled else rounds):]
    # Changed: every chunk is written back - the weights and the alignment padding between them.
    expected = group.host_master.nbytes if changed else 0
    assert all(r.written_back == expected for r in evictions), "write-back did not match the case"
    seconds = sorted(r.evict_seconds for r in evictions)
    record(benchmark, case=case, nbytes=group.nbytes, tensors=len(group.tensors),
           floor_s=floor.median(), measured_s=seconds[len(seconds) // 2], goal=goal,
           written_back=expected)
