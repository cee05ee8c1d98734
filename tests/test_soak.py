"""Soak: thousands of transitions leave memory flat and every weight intact (issue 7, part 4).

CI runs 2,000 transitions (the issue-2 must-show); ``pytest --soak`` runs 10,000 (`soak_scale`).
Memory is compared after a warm-up (the transition log is full by then, buffers are allocated):

* process RSS (``/proc/self/statm``) grows by less than `RSS_TOLERANCE`;
* Python objects tracked by the garbage collector do not pile up (a per-transition leak shows);
* host masters keep their chunks, addresses and sizes (no growth of pinned memory);
* device storage keeps its buffer and size; on an accelerator, allocated device memory is flat.

Device storage the scheduler lets go of must really be freed, not kept alive by stale views.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from residency import Scheduler

import simdevice
from _accelerator import is_simulated
from conftest import make_block, run_block, twin

#: Transitions in CI; ``--soak`` multiplies by `soak_scale` (5): 10,000.
TRANSITIONS = 2_000
WARM_UP = 400
#: Kept records are bounded; a small bound lets the warm-up fill the log.
RECORD_LIMIT = 100
#: RSS growth allowed after the warm-up: allocator noise; one group is ~0.5 MiB.
RSS_TOLERANCE = 8 * 2**20
#: Growth in gc-tracked objects allowed after the warm-up (a leak of one per transition is 2,000).
OBJECT_TOLERANCE = 200

_use_count = torch._C._storage_Use_Count  # the count the core's alias check reads


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Soak:
    """Three exclusive groups and a resident one, cycled so that every phase is a transition."""

    def __init__(self, scheduler: Scheduler, width: int = 256) -> None:
        self.scheduler = scheduler
        self.device = scheduler.device
        self.names = ["enc", "dit", "dec"]
        self.modules = {name: make_block(width, seed=i) for i, name in enumerate(self.names)}
        self.modules["vae"] = make_block(width, seed=9)
        self.plain = {name: twin(m).to(self.device) for name, m in self.modules.items()}
        for name in self.names:
            scheduler.add(name, self.modules[name])
        scheduler.add("vae", self.modules["vae"], policy="resident")
        self.x = torch.randn(2, width, device=self.device)
        self.step = 0

    def run(self, count: int) -> None:
        """`count` phases, each a transition, with edits, nesting, exceptions, checked forwards."""
        before = self.scheduler.transitions.count
        for _ in range(count):
            i, self.step = self.step, self.step + 1
            name = self.names[i % 3]
            try:
                with self.scheduler.resident(name):
                    self._body(i, name)
            except _Planned:
                pass
        assert self.scheduler.transitions.count - before == count

    def _body(self, i: int, name: str) -> None:
        module = self.modules[name]
        if i % 13 == 0:  # an in-place change: written back at eviction
            with torch.no_grad():
                module[0].bias.add_(1.0)
                self.plain[name][0].bias.add_(1.0)
        if i % 17 == 0:
            with self.scheduler.resident("vae"):
                pass
        if i % 97 == 0:
            self.check_outputs(name)
            self.check_outputs("vae")
        if i % 31 == 0:
            raise _Planned

    def check_outputs(self, name: str) -> None:
        with torch.no_grad():
            ours = run_block(self.modules[name], self.x)
            theirs = run_block(self.plain[name], self.x)
        assert torch.equal(ours, theirs), f"{name!r} drifted at step {self.step}"

    def host_masters(self) -> list[tuple[str, int, int, bool]]:
        return [
            (name, chunk.data_ptr(), chunk.numel(), self.scheduler[name].host_master.pinned)
            for name in self.scheduler
            for chunk in self.scheduler[name].host_master.chunks
        ]

    def device_buffers(self) -> set[tuple[int, int]]:
        storages = {id(self.scheduler[n].device_storage): self.scheduler[n].device_storage
                    for n in self.scheduler}
        return {(s.buffer.data_ptr(), s.nbytes) for s in storages.values() if s.buffer is not None}

    def check_weights(self) -> None:
        for name, module in self.modules.items():
            with self.scheduler.resident(name):
                for (key, ours), (_, theirs) in zip(
                    module.state_dict().items(), self.plain[name].state_dict().items()
                ):
                    assert torch.equal(ours, theirs), f"{name}.{key}"
                self.check_outputs(name)


class _Planned(Exception):
    """Raised inside a phase on purpose."""


@pytest.mark.soak
def test_transitions_keep_rss_objects_host_masters_and_device_storage_flat(soak_scale):
    scheduler = Scheduler("cpu", record_limit=RECORD_LIMIT)
    soak = Soak(scheduler)
    soak.run(WARM_UP)
    gc.collect()
    rss, objects = rss_bytes(), len(gc.get_objects())
    masters, buffers = soak.host_masters(), soak.device_buffers()

    soak.run(TRANSITIONS * soak_scale)

    gc.collect()
    assert soak.host_masters() == masters  # same chunks, same addresses, same sizes
    assert soak.device_buffers() == buffers  # the same buffers reused, none grown
    assert len(gc.get_objects()) - objects < OBJECT_TOLERANCE
    grown = rss_bytes() - rss
    assert grown < RSS_TOLERANCE, f"RSS grew {grown / 2**20:.1f} MiB over {soak.step} transitions"
    assert len(scheduler.transitions) == RECORD_LIMIT
    soak.check_weights()
    scheduler.close()


@pytest.mark.soak
@pytest.mark.gpu
def test_transitions_keep_device_and_pinned_memory_flat_on_an_accelerator(soak_scale):
    device = torch.accelerator.current_accelerator()
    scheduler = Scheduler(device, record_limit=RECORD_LIMIT)
    soak = Soak(scheduler)
    soak.run(WARM_UP)
    torch.accelerator.synchronize()
    allocated = _device_allocated(device)
    pinned = _pinned_bytes(device)
    masters = soak.host_masters()
    assert all(pinned for *_, pinned in masters)
    # the reading is real: the pinned allocator holds at least the masters' chunks
    assert pinned >= sum(nbytes for _, _, nbytes, _ in masters) > 0

    soak.run(TRANSITIONS * soak_scale)

    torch.accelerator.synchronize()
    assert _device_allocated(device) == allocated
    assert _pinned_bytes(device) == pinned
    assert soak.host_masters() == masters
    soak.check_weights()
    scheduler.close()


def _device_allocated(device: torch.device) -> int:
    return torch.accelerator.memory_allocated(device)


def _pinned_bytes(device: torch.device) -> int:
    """Bytes held by the pinned host allocator: CUDA's host memory stats, the simulated device's
    own reading; on another accelerator the test skips (nothing to read them from)."""
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        return stats.get("allocated_bytes.current", stats.get("allocated.current"))
    if is_simulated(device):
        return simdevice.pinned_bytes()
    pytest.skip(f"no reading of pinned host memory on {device.type}")


# -- device storage the scheduler lets go of is freed ------------------------------------------


def _users(storage: torch.UntypedStorage) -> int:
    """References to `storage` besides the handle passed in."""
    return _use_count(storage._cdata) - 1


@pytest.mark.fast
def test_offload_all_frees_the_shared_device_storage(scheduler):
    soak = Soak(scheduler, width=32)
    for name in soak.names:
        with scheduler.resident(name):
            pass
    storage = scheduler["enc"].device_storage.buffer.untyped_storage()
    scheduler.offload_all()
    assert scheduler.current is None
    users = _users(storage)
    assert users == 0, f"offload_all left the device buffer referenced {users} times (stale views)"
    soak.check_weights()


@pytest.mark.fast
def test_a_device_buffer_replaced_by_a_bigger_one_is_freed(scheduler):
    small, big = make_block(16, seed=1), make_block(64, seed=2)
    plain_small, plain_big = twin(small), twin(big)
    scheduler.add("small", small)
    with scheduler.resident("small"):
        pass
    old = scheduler["small"].device_storage.buffer.untyped_storage()
    scheduler.add("big", big)  # registered later: the shared buffer must grow
    x_small, x_big = torch.ones(1, 16), torch.ones(1, 64)
    with scheduler.resident("big"):
        assert torch.equal(run_block(big, x_big), run_block(plain_big, x_big))
        assert scheduler["big"].device_storage.buffer.untyped_storage().data_ptr() != old.data_ptr()
    users = _users(old)
    assert users == 0, (
        f"the outgrown device buffer is still referenced {users} times: two exclusive "
        "groups' worth of device memory held at once"
    )
    with scheduler.resident("small"):
        assert torch.equal(run_block(small, x_small), run_block(plain_small, x_small))


@pytest.mark.gpu
def test_offload_all_returns_device_memory_on_an_accelerator():
    device = torch.accelerator.current_accelerator()
    torch.accelerator.synchronize()
    baseline = _device_allocated(device)
    scheduler = Scheduler(device)
    soak = Soak(scheduler, width=512)
    resident_bytes = _device_allocated(device) - baseline  # the resident-policy group and inputs
    for name in soak.names:
        with scheduler.resident(name):
            pass
    scheduler.offload_all()
    torch.accelerator.synchronize()
    assert _device_allocated(device) - baseline == resident_bytes
    scheduler.close()
