"""The physical floor of a transition, measured in the same run as the case it judges.

    floor = CopyFloor(400 * MiB, device)        # buffers allocated and touched once
    samples = FloorSamples(floor)
    benchmark.pedantic(swap, setup=samples.before_round, rounds=20)
    ratio = benchmark.stats.stats.median / samples.median()

On a CPU the floor is ``dst.copy_(src)`` of the same bytes into a reused buffer; on an accelerator it
is a copy from a pinned host tensor into a reused device buffer, waited for.

[Note: why the floor is timed before every round]
The machine is shared; a floor measured a minute earlier may have run on a quieter machine.  Timing
one floor copy in the setup of each measured round interleaves the two, so both medians see the same
neighbours.  The setup is not part of pytest-benchmark's timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["CopyFloor", "FloorSamples", "median_call_seconds", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for every queued copy and kernel on `device` (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class CopyFloor:
    """One plain copy of `nbytes` into a reused buffer; calling it copies and waits."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        on_accelerator = device.type != "cpu"
        self._source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_accelerator).fill_(1)
        self._destination = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._non_blocking = on_accelerator
        self()  # touch the destination once, so every timed copy goes into a reused buffer

    def __call__(self) -> None:
        self._destination.copy_(self._source, non_blocking=self._non_blocking)
        synchronize(self.device)

    def seconds(self) -> float:
        """Time one copy (host wall clock, completion included)."""
        start = time.perf_counter()
        self()
        return time.perf_counter() - start

    def fresh_host_seconds(self) -> float:
        """Time one copy of the host source into a freshly allocated host buffer (pinned on an
        accelerator): the least a registration must do, first-touch page faults included."""
        start = time.perf_counter()
        fresh = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._non_blocking)
        fresh.copy_(self._source)
        seconds = time.perf_counter() - start
        del fresh
        return seconds


class FloorSamples:
    """Floor timings taken one per measured round (see [Note: why the floor is timed before every round])."""

    def __init__(self, floor: Callable[[], float] | CopyFloor, copies: int = 1) -> None:
        self._time_once = floor.seconds if isinstance(floor, CopyFloor) else floor
        #: Floor copies per sample (a pipeline cycle that loads two groups has a floor of two copies).
        self.copies = copies
        self.samples: list[float] = []

    def before_round(self) -> None:
        """Time one floor sample; pass this as (or call it from) ``benchmark.pedantic(setup=...)``."""
        self.samples.append(sum(self._time_once() for _ in range(self.copies)))

    def median(self) -> float:
        if not self.samples:
            self.before_round()
        return statistics.median(self.samples)


def median_call_seconds(function: Callable[[], object], iterations: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of one call, in a loop of `iterations` calls."""
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            function()
        means.append((time.perf_counter() - start) / iterations)
    return statistics.median(means)
