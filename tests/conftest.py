"""Shared fixtures: small models, a CPU scheduler, and the --soak switch."""

from __future__ import annotations

import os

# The debug check that every owner mutator runs under the scheduler lock (residency.core.locks) is read
# once, at import: set it before anything imports residency.
os.environ.setdefault("RESIDENCY_CHECK_LOCKS", "1")

import copy
import sys

import pytest
import torch
from torch import nn

import _accelerator
import _interrupts
from _interrupts import SWEEPS
from residency import Scheduler
from residency.device.transport import CpuTransport


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", help="run the full-length soak tests")
    parser.addoption("--sweep", choices=SWEEPS, default="ci",
                     help="how far the sweeps go: 'ci' (the default) interrupts each line at its "
                          "first execution (a few costly sweeps: every stride-th point "
                          "instead), and repeats each synchronisation-audit row 2 times; "
                          "'lines' interrupts every sweep at its stride and each line at its "
                          "first and last execution; 'full' interrupts every point and "
                          "repeats each audit row 20 times")
    _accelerator.add_options(parser)


# Where the tests marked gpu run: tests/_accelerator.py ([Note: one child for the accelerator tests]).
def pytest_configure(config):
    _interrupts.configure(config.getoption("--sweep"))
    _accelerator.configure(config)


def pytest_collection_modifyitems(config, items):
    _accelerator.modify_items(config, items)


def pytest_collection_finish(session):
    _accelerator.start_child(session)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    return True if _accelerator.run_delegated(pyfuncitem) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    duration = _accelerator.child_duration(item) if call.when == "call" else None
    if duration is not None:
        report.duration = duration
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _accelerator.summarize(terminalreporter, config)


def pytest_sessionfinish(session, exitstatus):
    _accelerator.stop_child(session)
    if _accelerator.too_few(session.config) and exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(scope="module")
def saved_wan22(tmp_path_factory):
    """A tiny Wan2.2 (UMT5 encoder, two experts, Wan VAE) saved with ``save_pretrained``, once
    per module that asks (a module's tests may edit or truncate files of their own copy)."""
    pytest.importorskip("diffusers")
    from _tiny_pipelines import tiny_wan22

    folder = tmp_path_factory.mktemp("saved") / "wan"
    tiny_wan22().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """Run the tests on one intra-op thread: on 2 shared cores, OpenMP waits made tiny ops 30x
    slower (a tiny Wan call: 1.86 s with two threads, 0.05 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[None, 1e-6], ids=["switch-default", "switch-1us"])
def switch_interval(request):
    """Run a test twice: with the default GIL switch interval, and handing the GIL between threads
    every microsecond (many more interleavings).  Restored afterwards.  Yields the interval set."""
    interval = sys.getswitchinterval()
    if request.param is not None:
        sys.setswitchinterval(request.param)
    try:
        yield sys.getswitchinterval()
    finally:
        sys.setswitchinterval(interval)


@pytest.fixture
def soak_scale(request) -> int:
    """1 in CI (a short soak), 5 with --soak (the full one)."""
    return 5 if request.config.getoption("--soak") else 1


def make_block(width: int = 32, seed: int = 0) -> nn.Module:
    """A small MLP with a buffer, deterministic for a seed."""
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(),
                          nn.Linear(width, width))
    block.register_buffer("scale", torch.rand(width))
    return block


def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x) * block.scale


def twin(module: nn.Module) -> nn.Module:
    """A deep copy that is never offloaded (the reference for bit-for-bit comparisons)."""
    return copy.deepcopy(module)


@pytest.fixture
def scheduler():
    s = Scheduler("cpu")
    yield s
    s.close()


class CountingTransport(CpuTransport):
    """A CPU transport that counts what it is asked to do (a spy, injected, never patched in)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.loads = 0
        self.to_device_pairs = 0
        self.to_host_pairs = 0
        self.device_allocations = 0

    def allocate_device(self, nbytes):
        self.device_allocations += 1
        return super().allocate_device(nbytes)

    def to_device(self, pairs):
        self.loads += 1
        self.to_device_pairs += len(pairs)
        return super().to_device(pairs)

    def to_host(self, pairs):
        self.to_host_pairs += len(pairs)
        return super().to_host(pairs)

