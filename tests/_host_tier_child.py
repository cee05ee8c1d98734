"""A child process for tests/test_host_tier.py: a model built without weights, filled group by
group, run twice through every group's phase; reports outputs and its resident set.

    python tests/_host_tier_child.py tier OUT_DIR SPILL_DIR      # Scheduler(host=memory_limit)
    python tests/_host_tier_child.py reference OUT_DIR           # never offloaded

Writes OUT_DIR/outputs.pt (the outputs, in phase order) and OUT_DIR/report.json.  The resident
set is read from /proc/self/smaps_rollup (``Rss``): at a baseline taken once the model is built
on the meta device (no weights) and the scheduler exists, then by a sampling thread every
millisecond and at every step, to the peak.  The parent sets ``MALLOC_MMAP_THRESHOLD_`` so a
freed source storage goes back to the kernel at once (glibc's dynamic threshold would keep it on
its heap, and the resident set would count memory the process no longer uses).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch
from torch import nn

GROUPS = 8
WIDTH = 1024  # two Linear(1024, 1024) per group: 8 MiB of fp32 weights (and 8 KiB of biases)
MiB = 2**20


def rss() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Rss line in /proc/self/smaps_rollup")


class PeakSampler:
    """Samples the resident set every millisecond on a thread; `peak` is the largest seen."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


def build() -> list[nn.Module]:
    with torch.device("meta"):
        return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
                for _ in range(GROUPS)]


def fill(group: nn.Module, seed: int) -> None:
    """Materialise `group`'s weights on the CPU with values fixed by `seed`."""
    group.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in group.parameters():
            tensor.normal_(generator=generator)


def main(mode: str, out: Path, spill: str | None) -> None:
    torch.set_num_threads(1)
    groups = build()
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(99))
    weights = sum(2 * (WIDTH * WIDTH + WIDTH) * 4 for _ in groups)
    limit = weights // 2
    scheduler = None
    if mode == "tier":
        import residency

        scheduler = residency.Scheduler("cpu", host={"memory_limit": limit,
                                                     "spill_directory": spill})
    # Warm the code paths with a throwaway module (to_empty's first call costs ~35 MiB of the
    # interpreter's own, the first linear its kernels'): none of it is the weights' growth.
    fill(nn.Linear(4, 4, device="meta"), seed=0)
    with torch.no_grad():
        torch.nn.functional.linear(x, torch.zeros(WIDTH, WIDTH))
    baseline = rss()
    sampler = PeakSampler()
    for index, group in enumerate(groups):
        fill(group, seed=index)
        if scheduler is not None:
            scheduler.add(f"g{index}", group)
        sampler.sample()
    outputs = []
    with torch.no_grad():
        for _ in range(2):
            for index, group in enumerate(groups):
                if scheduler is None:
                    outputs.append(group(x))
                    continue
                with scheduler.resident(f"g{index}"):
                    outputs.append(group(x))
                    sampler.sample()
                sampler.sample()
    peak = sampler.stop()
    report = {"baseline": baseline, "peak": peak, "growth": peak - baseline, "weights": weights,
              "limit": limit}
    if scheduler is not None:
        tier = scheduler._packer.tier
        report.update(private=tier.private_nbytes, files=len(tier.files()),
                      paged=tier.paged_nbytes(), paging_room=tier.paging_room)
    torch.save(outputs, out / "outputs.pt")
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
