"""Change detection by per-chunk digests (`residency.engine.digests`): what the eviction-time check costs.

"check" times ``ChangeDetector.changed_windows`` on an unchanged buffer of the headline size
(400 MiB; 1 MiB at the tiny scale): digesting every chunk on the device, comparing with the
digests taken at load, and reading the flags on the host.  That is the whole cost detection adds
to evicting an unchanged group, and it must stay well under the copy it saves.  "remember" times
the digest taken after every load.  The floor is a plain copy of the same bytes into a reused
buffer, timed before every round (`benchmarks/floor.py`).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples, synchronize
from benchmarks.goals import CHANGE_CHECK
from residency.engine.digests import ChangeDetector

#: 0x9E3779B97F4A7C15 as an int64: its consecutive multiples differ in (nearly) every byte.
_GOLDEN = -0x61C8864680B583EB


def _filled_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of varied bytes on `device`, made quickly (no random generator over 400 MiB)."""
    words = torch.arange(nbytes // 8, dtype=torch.int64, device=device).mul_(_GOLDEN)
    return words.view(torch.uint8)


@pytest.mark.parametrize("step", ["check", "remember"])
def test_change_detection(benchmark, scale, device, step):
    buffer = _filled_buffer(scale.swap_nbytes, device)
    detector = ChangeDetector()
    detector.remember(buffer)
    floor = FloorSamples(CopyFloor(buffer.numel(), device))
    found: list[list[tuple[int, int]]] = []

    def check():
        found.append(detector.changed_windows(buffer))  # reads the flags: waits for the device

    def remember():
        detector.remember(buffer)
        synchronize(device)

    measured = check if step == "check" else remember
    rounds = scale.rounds(buffer.numel())
    benchmark.pedantic(measured, setup=floor.before_round, rounds=rounds, warmup_rounds=1)
    assert all(ranges == [] for ranges in found), "an unchanged buffer was reported as changed"
    layout = detector.layout
    record(benchmark, case=f"change_{step}", nbytes=buffer.numel(), floor_s=floor.median(),
           goal=CHANGE_CHECK if step == "check" else None, window_nbytes=layout.window_nbytes,
           digest_nbytes=layout.window_count(buffer.numel()) * layout.digest_words * 8)
