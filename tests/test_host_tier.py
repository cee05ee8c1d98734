"""The host tier for hosts smaller than the model (issue 23, `residency/host/host_tier.py`):
masters beyond ``memory_limit`` are file-backed, paged in as needed, read ahead, dropped when the
limit needs room; edits survive every drop; bad directories and limits are typed errors.

The memory test runs in child processes (`tests/_host_tier_child.py`): a model of 8 groups of
8 MiB built on the meta device, filled group by group, its weights (64 MiB) twice the limit; the
resident set's growth over the baseline (taken once the model is built without weights) stays
under the limit plus ``SLACK``, and the outputs equal a never-offloaded child's bit for bit.
The others run small groups in this process: where a master's bytes live (/proc/self/maps),
read-ahead and drops as the kernel reports them (``mincore``), edits across drops, layer mode,
the accelerator (pageable masters), each refusal's message, and an interrupt sweep
(``pytest --sweep=full`` interrupts every point; by default every third).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import residency
from residency import ConfigError, HostMemoryError
from residency.host.host_tier import SpillFile

from _accelerator import device as accelerator_device
from _interrupts import consistent, sweep
from conftest import twin

HERE = Path(__file__).resolve().parent
KiB, MiB = 2**10, 2**20
#: What the resident set may grow beyond the limit: the CPU device's storage (host memory, one
#: group: 8 MiB; the limit counts masters only) and 8 MiB for the interpreter, torch's kernels and
#: a group's source bytes while it packs.
SLACK = 16 * MiB


def _child(mode: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HERE / "_host_tier_child.py"), mode, str(out),
                           *extra], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_weights_twice_the_limit_run_bit_identical_within_the_limit(tmp_path):
    ours, reference, spill = tmp_path / "ours", tmp_path / "reference", tmp_path / "spill"
    for folder in (ours, reference, spill):
        folder.mkdir()
    report = _child("tier", ours, str(spill))
    _child("reference", reference)
    outputs = torch.load(ours / "outputs.pt")
    expected = torch.load(reference / "outputs.pt")
    assert len(outputs) == len(expected) == 16
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))
    assert report["weights"] == 2 * report["limit"]
    assert report["weights"] >= 4 * SLACK
    print(f"\nRSS growth {report['growth'] / MiB:.1f} MiB over the baseline; limit "
          f"{report['limit'] / MiB:.1f} MiB + slack {SLACK / MiB:.0f} MiB; weights "
          f"{report['weights'] / MiB:.1f} MiB; {report['files']} file-backed masters, "
          f"{report['private'] / MiB:.1f} MiB private, {report['paged'] / MiB:.1f} MiB paged in")
    assert report["growth"] <= report["limit"] + SLACK
    assert report["files"] == 6 and report["private"] + report["paged"] <= report["limit"]
    assert list(spill.iterdir()) == []  # nothing of ours has a name there


# -- a small world in this process -----------------------------------------------------------

WIDTH = 128  # one Linear(128, 128): 64 KiB + 512 B per group


def _groups(count: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(count)]


def _group_nbytes() -> int:
    return (WIDTH * WIDTH + WIDTH) * 4


def _scheduler(tmp_path: Path, groups, limit_groups: float = 2.5) -> residency.Scheduler:
    """A limit of `limit_groups` groups: the first group stays private (it fits half the limit),
    the rest are file-backed, and the paging room holds ``limit_groups - 1`` groups' pages."""
    scheduler = residency.Scheduler("cpu", host={
        "memory_limit": int(limit_groups * _group_nbytes()), "spill_directory": tmp_path})
    for index, group in enumerate(groups):
        scheduler.add(f"g{index}", group)
    return scheduler


def _spill(scheduler, name: str) -> SpillFile:
    return scheduler._registry.get(name).host_master.spill


def _mapping_of(pointer: int) -> str:
    """The /proc/self/maps line of the mapping that holds address `pointer`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            if start <= pointer < end:
                return line.rstrip("\n")
    raise AssertionError(f"no mapping holds {pointer:#x}")


def _run(scheduler, groups, x):
    with torch.no_grad():
        outputs = []
        for index, group in enumerate(groups):
            with scheduler.resident(f"g{index}"):
                outputs.append(group(x))
        return outputs


@pytest.mark.fast
def test_a_master_beyond_the_limit_is_a_shared_mapping_of_an_unnamed_file_of_ours(tmp_path):
    groups = _groups()
    scheduler = _scheduler(tmp_path, groups)
    private = _mapping_of(groups[0].weight.data_ptr())
    assert "(deleted)" not in private and str(tmp_path) not in private
    assert private.split()[1] == "rw-p"  # private memory of the process
    for group in groups[1:]:
        line = _mapping_of(group.weight.data_ptr())
        permissions, path = line.split()[1], line.split(maxsplit=5)[5]
        assert permissions == "rw-s", line  # shared and writable: edits go to the file
        assert path.startswith(str(tmp_path)) and path.endswith("(deleted)"), line
    assert list(tmp_path.iterdir()) == []
    tier = scheduler._packer.tier
    assert _spill(scheduler, "g0") is None
    assert tier.private_nbytes == scheduler._registry.get("g0").inventory.layout.contiguous_nbytes
    assert len(tier.files()) == 3
    scheduler.close()


@pytest.mark.fast
def test_the_limit_holds_while_phases_run_and_outputs_are_bit_identical(tmp_path):
    groups = _groups()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        expected = [group(x) for group in groups]
    scheduler = _scheduler(tmp_path, groups)
    tier = scheduler._packer.tier
    for _ in range(3):
        with torch.no_grad():
            for index, group in enumerate(groups):
                with scheduler.resident(f"g{index}"):
                    assert torch.equal(group(x), expected[index])
                    assert tier.paged_nbytes() <= tier.paging_room
    scheduler.close()


@pytest.mark.fast
def test_the_file_that_followed_last_time_is_read_ahead(tmp_path):
    groups = _groups(3)
    scheduler = _scheduler(tmp_path, groups, limit_groups=3.5)  # the room holds both files
    _run(scheduler, groups, torch.randn(1, WIDTH))  # g1, then g2: the order is learnt
    first, second = _spill(scheduler, "g1"), _spill(scheduler, "g2")
    for spill in (first, second):
        spill.release_pages()
    assert first.resident_nbytes() == second.resident_nbytes() == 0
    with scheduler.resident("g1"):  # g1's load reads g1's file; g2's is read ahead meanwhile
        deadline = time.monotonic() + 5
        while second.resident_nbytes() < second.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.resident_nbytes() == first.nbytes
        assert second.resident_nbytes() == second.nbytes
    scheduler.close()


@pytest.mark.fast
def test_edits_survive_dropping_the_pages(tmp_path):
    groups = _groups()
    x = torch.randn(2, WIDTH)
    scheduler = _scheduler(tmp_path, groups)
    tier = scheduler._packer.tier
    edited = groups[2]
    with torch.no_grad():
        with scheduler.resident("g2"):
            edited.weight.data.add_(1.0)  # in place on the device storage
            expected_weight = edited.weight.detach().clone()
        for spill in tier.files():
            spill.release_pages()
        assert all(spill.resident_nbytes() == 0 for spill in tier.files())
        with scheduler.resident("g2"):  # read back from the file
            assert torch.equal(edited.weight, expected_weight)
            expected = edited(x)
        edited.bias.data.mul_(2.0)  # on the host: into the file's page cache
        expected_bias = edited.bias.detach().clone()
        for spill in tier.files():
            spill.release_pages()
        with scheduler.resident("g2"):
            assert torch.equal(edited.bias, expected_bias)
            assert not torch.equal(edited(x), expected)
    scheduler.close()


class _BlockModel(nn.Module):
    """An embedding, six streamed blocks (declared the vLLM-Omni way), a head."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


@pytest.mark.fast
def test_a_layer_mode_group_streams_file_backed_blocks_within_the_limit(tmp_path):
    model = _BlockModel()
    reference = twin(model)
    x = torch.randn(2, WIDTH)
    scheduler = residency.Scheduler("cpu", host={"memory_limit": 6 * _group_nbytes(),
                                                 "spill_directory": tmp_path})
    scheduler.add("dit", model, layers=True)  # its own part and the first block stay private
    tier = scheduler._packer.tier
    assert len(tier.files()) == 5  # one file per streamed block beyond the limit
    with torch.no_grad():
        expected = reference(x)
        for _ in range(3):
            with scheduler.resident("dit"):
                assert torch.equal(model(x), expected)
                assert tier.paged_nbytes() <= tier.paging_room
    scheduler.close()


@pytest.mark.gpu
def test_on_an_accelerator_a_file_backed_master_is_pageable_and_exact(tmp_path, caplog):
    device = accelerator_device()
    groups = _groups(3)
    twins = [twin(group).to(device) for group in groups]
    scheduler = residency.Scheduler(device, host={"memory_limit": int(2.5 * _group_nbytes()),
                                                  "spill_directory": tmp_path})
    with caplog.at_level(logging.INFO, logger="residency"):
        for index, group in enumerate(groups):
            scheduler.add(f"g{index}", group)
    private, spilled = scheduler["g0"].host_master, scheduler["g1"].host_master
    assert private.spill is None and private.pinned
    assert spilled.spill is not None and not spilled.pinned
    assert not any(chunk.is_pinned() for chunk in spilled.chunks)
    assert "host master file-backed" in caplog.text
    assert "pageable: page-locking would keep the pages the tier drops" in caplog.text
    x = torch.randn(4, WIDTH, device=device)
    with torch.no_grad():
        for _ in range(2):
            for index, (group, reference) in enumerate(zip(groups, twins)):
                with scheduler.resident(f"g{index}"):
                    assert torch.equal(group(x), reference(x))
            for spill in scheduler._packer.tier.files():
                spill.release_pages()
    torch.accelerator.synchronize()
    scheduler.close()


# -- typed errors ---------------------------------------------------------------------------------


@pytest.mark.fast
def test_a_missing_spill_directory_is_refused(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as raised:
        residency.Scheduler("cpu", host={"memory_limit": MiB, "spill_directory": missing})
    assert str(raised.value) == (
        f"the host tier's directory {str(missing)!r} (from spill_directory) does not exist; "
        "create it, or give host={'spill_directory': ...} a directory on a disk with room for "
        "the masters beyond memory_limit")
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigError, match="is not a directory; give spill_directory a"):
        residency.Scheduler("cpu", host={"memory_limit": MiB, "spill_directory": file})


@pytest.mark.fast
def test_a_spill_directory_that_cannot_be_written_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: make it immutable instead
        if shutil.which("chattr") is None:
            pytest.skip("running as root without chattr: no directory root cannot write")
        if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode:
            pytest.skip("chattr +i is not permitted here")
    else:
        locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError) as raised:
            residency.Scheduler("cpu", host={"memory_limit": MiB, "spill_directory": locked})
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        else:
            locked.chmod(0o700)
    message = str(raised.value)
    assert message.startswith(f"the host tier's directory {str(locked)!r} (from "
                              "spill_directory) is not writable by this process (")
    assert message.endswith("); fix its permissions, or give spill_directory a directory this "
                            "user may write")


@pytest.mark.fast
def test_a_group_larger_than_the_paging_room_is_refused_and_nothing_changes(tmp_path):
    groups = _groups(2)
    scheduler = residency.Scheduler("cpu", host={"memory_limit": 150_000,
                                                 "spill_directory": tmp_path})
    scheduler.add("g0", groups[0])  # private: 66 KB, under half the 150 KB
    big = nn.Linear(WIDTH, 8 * WIDTH)  # 135 KB: more than the 84 KB left
    before = [t.detach().clone() for t in big.parameters()]
    pointers = [t.data_ptr() for t in big.parameters()]
    with pytest.raises(HostMemoryError) as raised:
        scheduler.add("big", big)
    nbytes = scheduler._packer.inventory((big,), ()).layout.contiguous_nbytes
    private = scheduler._packer.tier.private_nbytes
    needed = private + nbytes
    assert str(raised.value) == (
        f"cannot add group 'big': its host master needs {nbytes} bytes "
        f"({nbytes / KiB:.1f} KiB) paged in while it loads, and memory_limit=150000 "
        f"(146.5 KiB) leaves {150_000 - private} bytes ({(150_000 - private) / KiB:.1f} KiB) "
        f"for file-backed masters beside the private ones ({private} bytes, "
        f"{private / KiB:.1f} KiB). Raise memory_limit to at least {needed} bytes "
        f"({needed / KiB:.2f} KiB, e.g. \"memory_limit\": \"1MiB\"), or split the group; "
        "nothing was registered")
    assert residency.Scheduler("cpu", host={"memory_limit": "1MiB"}).host_options  # the hint parses
    assert "big" not in scheduler
    assert [t.data_ptr() for t in big.parameters()] == pointers
    assert all(torch.equal(a, b) for a, b in zip(big.parameters(), before))
    assert scheduler._packer.tier.files() == []
    scheduler.add("g1", groups[1])  # a group that fits is still taken, file-backed
    assert _spill(scheduler, "g1") is not None and private == _group_nbytes()
    scheduler.close()


@pytest.mark.fast
def test_a_file_the_disk_refuses_is_a_typed_error_at_add(tmp_path):
    groups = _groups(2)
    scheduler = _scheduler(tmp_path, groups[:1])
    weights = groups[1].weight.detach().clone()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # a disk with 4 KiB left
    try:
        with pytest.raises(HostMemoryError) as raised:
            scheduler.add("g1", groups[1])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(raised.value)
    assert message.startswith(f"cannot add group 'g1': its file-backed host master needs "
                              f"66048 bytes (64.5 KiB) in {str(tmp_path)!r} and making the file "
                              "failed ([Errno 27] File too large)")
    assert message.endswith("Free disk space there or give another spill_directory; the weights "
                            "keep their values")
    assert "g1" not in scheduler and torch.equal(groups[1].weight, weights)
    scheduler.add("g1", groups[1])  # with room again, the same add succeeds
    assert _spill(scheduler, "g1") is not None
    scheduler.close()


# -- interrupts -----------------------------------------------------------------------------------


@pytest.mark.beside
def test_an_interrupt_anywhere_in_a_phase_change_leaves_the_tier_and_weights_sound(tmp_path):
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        expected = [group(x) for group in _groups()]

    def build():
        groups = _groups()
        scheduler = _scheduler(tmp_path, groups, limit_groups=3.5)  # room: 2.5 groups' pages
        _run(scheduler, groups, x)  # the tier has its history: each load reads the next ahead
        return scheduler, groups

    def operation(world):
        scheduler, groups = world
        with scheduler.resident("g2"):
            pass
        with scheduler.resident("g3"):
            pass

    def check(world):
        scheduler, groups = world
        assert consistent(scheduler) == []
        tier = scheduler._packer.tier
        files = tier.files()
        assert {id(spill) for spill in files} == {
            id(group.host_master.spill) for group in scheduler._registry
            if group.host_master.spill is not None}
        assert len(files) == 3
        for _ in range(2):
            with torch.no_grad():
                for index, group in enumerate(groups):
                    with scheduler.resident(f"g{index}"):
                        assert torch.equal(group(x), expected[index])
                        assert tier.paged_nbytes() <= tier.paging_room
        scheduler.close()

    points = sweep(build, operation, check, stride=20)  # CI: each line at its first execution
    assert points > 50
