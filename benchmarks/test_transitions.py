"""Phase transitions against the copy floor: re-entry, size ladder, tensor count, the 400 MiB swap.

Each case times one floor copy of the same bytes before every measured round (`FloorSamples`) and
stores the floor, the ratio and the overhead in ``benchmark.extra_info``.
"""

from __future__ import annotations

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples, median_call_seconds
from benchmarks.goals import PER_TENSOR, REENTRY, SWAP
from benchmarks.models import ManyModules
from benchmarks.scale import tensors_for
from benchmarks.swapping import Alternation
from residency import NoOffload


def test_reentry(benchmark, scheduler, scale):
    """Entering the group already resident: no tensor work, a counter.  Floor: a `NoOffload` phase."""
    model = ManyModules(scale.model_modules)
    group = scheduler.add("model", model)
    with scheduler.resident("model"):
        pass
    transitions = scheduler.transitions.count

    def reenter():
        with scheduler.resident("model"):
            pass

    no_offload = NoOffload()
    floor_s = median_call_seconds(lambda: _enter(no_offload), scale.reentry_iterations,
                                  scale.micro_rounds)
    benchmark.pedantic(reenter, rounds=scale.micro_rounds, iterations=scale.reentry_iterations,
                       warmup_rounds=1)
    assert scheduler.transitions.count == transitions, "a re-entry moved weights"
    record(benchmark, case="reentry", nbytes=0, floor_s=floor_s, goal=REENTRY,
           model_nbytes=group.nbytes, modules=len(list(model.modules())), floor="NoOffload phase")


def test_transition_vs_size(benchmark, scheduler, scale, device, group_nbytes):
    """A swap between two groups of `group_nbytes` (one tensor per MiB, 1 to 400 tensors)."""
    _measure_swap(benchmark, scheduler, scale, device, group_nbytes, tensors_for(group_nbytes),
                  case="transition_vs_size")


def test_transition_vs_tensor_count(benchmark, scheduler, scale, device, tensor_count):
    """A swap at fixed bytes split into `tensor_count` tensors; the excess over the floor per tensor
    (``detect_edits=False``: the digests' cost follows the bytes, not the tensors)."""
    goal = PER_TENSOR if tensor_count == max(scale.tensor_counts) else None
    _measure_swap(benchmark, scheduler, scale, device, scale.count_nbytes, tensor_count,
                  case="transition_vs_tensor_count", goal=goal, detect_edits=False)


def test_swap_400mib(benchmark, scheduler, scale, device):
    """The headline: two 400 MiB groups of 400 tensors each (scaled down in tiny runs), with every
    edit detected (device digests at load and at eviction; see residency/device/digests.py)."""
    _measure_swap(benchmark, scheduler, scale, device, scale.swap_nbytes, scale.swap_tensors,
                  case="swap")


def test_swap_400mib_weights_not_edited(benchmark, scheduler, scale, device):
    """The same swap with ``detect_edits=False`` (the user promises not to edit): the transfer
    alone, which the 1.10x goal judges."""
    _measure_swap(benchmark, scheduler, scale, device, scale.swap_nbytes, scale.swap_tensors,
                  case="swap_no_detection", goal=SWAP, detect_edits=False)


def _measure_swap(benchmark, scheduler, scale, device, nbytes, tensors, *, case, goal=None,
                  detect_edits=True):
    swap = Alternation(scheduler, nbytes, tensors, detect_edits=detect_edits)
    floor = FloorSamples(CopyFloor(swap.nbytes, device))
    rounds = scale.rounds(nbytes)
    before = swap.transitions
    benchmark.pedantic(swap, setup=floor.before_round, rounds=rounds, warmup_rounds=1)
    calls = 1 if benchmark.disabled else rounds + 1
    assert swap.transitions - before == calls, "a measured call was not a real swap"
    loads = [r.load_seconds for r in list(scheduler.transitions)[-calls:]]
    evictions = [r.evict_seconds for r in list(scheduler.transitions)[-calls:]]
    record(benchmark, case=case, nbytes=swap.nbytes, tensors=tensors, floor_s=floor.median(),
           goal=goal, load_median_s=_median(loads), evict_median_s=_median(evictions))


def _enter(scheduler) -> None:
    with scheduler.resident("model"):
        pass


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
