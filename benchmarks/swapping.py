"""Two groups of one size on one scheduler, and a call that swaps to the other one each time.

    swap = Alternation(scheduler, nbytes=400 * MiB, tensors=400)
    swap()          # evicts "a", loads "b" and waits for the copy
    swap()          # evicts "b", loads "a"

Every call is a real transition (the group asked for is never the one resident), which a benchmark
needs: re-entering the resident group would cost a counter and flatter the median.
"""

from __future__ import annotations

import torch

from benchmarks.floor import synchronize
from benchmarks.models import Stack
from residency import Scheduler

__all__ = ["Alternation"]


class Alternation:
    """Registers two `Stack` groups of `nbytes` and `tensors` each; ``__call__`` swaps between them."""

    def __init__(self, scheduler: Scheduler, nbytes: int, tensors: int, *,
                 dtype: torch.dtype = torch.float32, names: tuple[str, str] = ("a", "b"),
                 detect_edits: bool = True) -> None:
        self.scheduler = scheduler
        self.names = names
        self.nbytes = 0
        for name in names:
            stack = Stack(nbytes, tensors, dtype=dtype)
            self.nbytes = scheduler.add(name, stack, detect_edits=detect_edits).nbytes
        self.tensors = tensors
        self._next = 0
        self()  # the first load allocates the shared device storage
        self()

    def __call__(self) -> None:
        name = self.names[self._next]
        self._next ^= 1
        with self.scheduler.resident(name):
            pass
        synchronize(self.scheduler.device)

    @property
    def transitions(self) -> int:
        """Transitions the scheduler has made so far (each call adds exactly one)."""
        return self.scheduler.transitions.count
