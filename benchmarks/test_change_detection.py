"""Change detection by per-window digests (`residency.device.digests`): what the check costs.

"check" times ``ChangeDetector.changed_windows`` on an unchanged buffer of the headline size
(400 MiB; 1 MiB at the tiny scale): digesting every window on the device, comparing with the
digests taken at load, and reading the flags on the host.  That is the whole cost detection adds
to evicting an unchanged group, and it must stay well under the copy it saves.  "remember" times
the digest taken after every load.  The floor is a plain copy of the same bytes into a reused
buffer, timed before every round (`benchmarks/floor.py`).

`test_change_detection_per_window` times the same two steps the way the CPU once took them: one
pair of sums per window (`_per_window_digests`, kept here as the comparison; the library does so
only on a CPU with one intra-op thread, and sums all windows in one pair otherwise).  Both record
``reductions``, the sums one step runs (counted once, outside the timing), and ``threads``,
torch's intra-op threads.  Run quiet and with other processes on the cores, at
``--bench-threads 1`` and ``0`` (benchmarks/README.md, "Change detection"): the one pair must stay
near the copy when loaded, and cost at most a tenth more than per-window sums quiet.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples, synchronize
from benchmarks.goals import CHANGE_CHECK
from residency.device.digests import ChangeDetector, DigestLayout

#: 0x9E3779B97F4A7C15 as an int64: its consecutive multiples differ in (nearly) every byte.
_GOLDEN = -0x61C8864680B583EB


def _filled_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of varied bytes on `device`, made quickly (no random generator over 400 MiB)."""
    words = torch.arange(nbytes // 8, dtype=torch.int64, device=device).mul_(_GOLDEN)
    return words.view(torch.uint8)


class _SumCount(TorchDispatchMode):
    """Counts ``aten.sum`` calls run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _reductions(step: Callable[[], object]) -> int:
    with _SumCount() as counting:
        step()
    return counting.calls["sum"]


def _per_window_digests(buffer_bytes: torch.Tensor, layout: DigestLayout) -> torch.Tensor:
    """The digests as the CPU once took them: row and column sums, one pair of calls per window
    (whole windows only: the benchmark's buffer is a whole number of them)."""
    matrices = buffer_bytes.view(torch.int64).view(-1, layout.rows, layout.columns)
    out = torch.empty(matrices.shape[0], layout.digest_words, dtype=torch.int64,
                      device=buffer_bytes.device)
    for matrix, row_sums, column_sums in zip(matrices, out[:, : layout.rows],
                                             out[:, layout.rows :]):
        torch.sum(matrix, dim=1, out=row_sums)
        torch.sum(matrix, dim=0, out=column_sums)
    return out


def _measure(benchmark, scale, device, step: str, remember: Callable[[], None],
             check: Callable[[], list], layout: DigestLayout, nbytes: int, case: str,
             goal=None) -> None:
    floor = FloorSamples(CopyFloor(nbytes, device))
    found: list[list] = []

    def checked():
        found.append(check())  # reads the flags: waits for the device

    def remembered():
        remember()
        synchronize(device)

    measured = checked if step == "check" else remembered
    reductions = _reductions(measured)
    found.clear()
    benchmark.pedantic(measured, setup=floor.before_round, rounds=scale.rounds(nbytes),
                       warmup_rounds=1)
    assert all(not changed for changed in found), "an unchanged buffer was reported as changed"
    record(benchmark, case=case, nbytes=nbytes, floor_s=floor.median(), goal=goal,
           window_nbytes=layout.window_nbytes, reductions=reductions,
           threads=torch.get_num_threads(),
           digest_nbytes=layout.window_count(nbytes) * layout.digest_words * 8)


@pytest.mark.parametrize("step", ["check", "remember"])
def test_change_detection(benchmark, scale, device, step):
    buffer = _filled_buffer(scale.swap_nbytes, device)
    detector = ChangeDetector()
    detector.remember(buffer)
    _measure(benchmark, scale, device, step, lambda: detector.remember(buffer),
             lambda: detector.changed_windows(buffer), detector.layout, buffer.numel(),
             case=f"change_{step}", goal=CHANGE_CHECK if step == "check" else None)


@pytest.mark.parametrize("step", ["check", "remember"])
def test_change_detection_per_window(benchmark, scale, device, step):
    """The comparison: the same steps, one pair of sums per window (see the module docstring)."""
    buffer = _filled_buffer(scale.swap_nbytes, device)
    layout = DigestLayout.for_device(device)
    reference = _per_window_digests(buffer, layout)

    def remember():
        nonlocal reference
        reference = _per_window_digests(buffer, layout)

    def check():
        return torch.nonzero((_per_window_digests(buffer, layout) != reference).any(dim=1)).tolist()

    _measure(benchmark, scale, device, step, remember, check, layout, buffer.numel(),
             case=f"change_{step}_per_window")
