"""Fixtures and options of the benchmark suite: the scale, the device, and skipped peers in the JSON.

    pytest benchmarks/ --bench-scale=tiny --benchmark-json=bench.json
    RESIDENCY_BENCH_SCALE=full pytest benchmarks/

The size ladders are parametrized here from the scale (`group_nbytes`, `tensor_count`, `cold_nbytes`).
A case skipped for a missing peer or a missing accelerator is written into the pytest-benchmark JSON
under ``"skipped"``, so the report can say so instead of leaving a silent gap.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from benchmarks import simulator
from benchmarks.machine import describe_machine
from benchmarks.scale import SCALE_NAMES, Scale
from residency import Scheduler
from residency.device.transport import default_device

SCALE_ENV = "RESIDENCY_BENCH_SCALE"
THREADS_ENV = "RESIDENCY_BENCH_THREADS"
DEVICE_ENV = "RESIDENCY_BENCH_DEVICE"
DEVICE_NAMES = ("default", "sim")


def pytest_addoption(parser):
    group = parser.getgroup("residency benchmarks")
    group.addoption(
        "--bench-scale", choices=SCALE_NAMES, default=None,
        help=f"case sizes: tiny (CI), default, full (the 2 GiB ladder; more on a GPU). "
             f"Defaults to ${SCALE_ENV} or 'default'.",
    )
    group.addoption(
        "--bench-device", choices=DEVICE_NAMES, default=None,
        help=f"default: the accelerator when there is one, else the CPU; sim: load the "
             f"simulated device (tests/simdevice) and run only the cases marked simulated "
             f"(elsewhere they are skipped). Defaults to ${DEVICE_ENV} or 'default'.",
    )
    group.addoption(
        "--bench-threads", type=int, default=None,
        help=f"torch intra-op threads for the run (default ${THREADS_ENV} or 1; 0 keeps torch's "
             "default). One thread keeps CPU medians stable on small shared VMs, where a parallel "
             "copy can wait milliseconds for a second vCPU; floor and case always use the same.",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "peer: a third-party offloader measured side by side")
    config.addinivalue_line("markers", "simulated: runs on the simulated device only "
                                       "(--bench-device=sim)")
    config.pluginmanager.register(SkipRecorder(), "residency-skip-recorder")
    if _device_name(config) == "sim":
        # Before collection: from here on the simulator is this process's accelerator, so
        # default_device() (the scale's ladders, the device fixture) is sim:0.
        try:
            simulator.load(asynchronous=True)
        except Exception as error:  # SimBuildError: the compiler's message
            raise pytest.UsageError(f"--bench-device=sim: {error}") from error
    threads = config.getoption("--bench-threads")
    if threads is None:
        threads = int(os.environ.get(THREADS_ENV, "1"))
    if threads > 0:
        torch.set_num_threads(threads)


def _device_name(config) -> str:
    name = config.getoption("--bench-device") or os.environ.get(DEVICE_ENV) or "default"
    if name not in DEVICE_NAMES:
        raise pytest.UsageError(f"${DEVICE_ENV}={name!r}; choose one of {', '.join(DEVICE_NAMES)}")
    return name


def pytest_collection_modifyitems(config, items):
    """On the simulator only the simulated cases run; elsewhere they are skipped, saying how to
    run them."""
    simulated = [item for item in items if "simulated" in item.keywords]
    if _device_name(config) == "sim":
        kept = {id(item) for item in simulated}
        dropped = [item for item in items if id(item) not in kept]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = simulated
        return
    for item in simulated:
        item.add_marker(pytest.mark.skip(
            reason="simulated accelerator cases run with --bench-device=sim (python -m "
                   "benchmarks.report --run --device sim)"))


def _scale_name(config) -> str:
    name = config.getoption("--bench-scale") or os.environ.get(SCALE_ENV) or "default"
    if name not in SCALE_NAMES:
        raise pytest.UsageError(f"${SCALE_ENV}={name!r}; choose one of {', '.join(SCALE_NAMES)}")
    return name


def pytest_generate_tests(metafunc):
    scale = Scale.named(_scale_name(metafunc.config), default_device())
    ladders = {"group_nbytes": scale.sizes, "tensor_count": scale.tensor_counts,
               "cold_nbytes": scale.cold_sizes}
    for argument, values in ladders.items():
        if argument in metafunc.fixturenames:
            ids = [_size_id(v) if argument != "tensor_count" else f"{v}tensors" for v in values]
            metafunc.parametrize(argument, values, ids=ids)


def _size_id(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The current accelerator when there is one, else the CPU."""
    return default_device()


@pytest.fixture(scope="session")
def scale(request, device) -> Scale:
    return Scale.named(_scale_name(request.config), device)


@pytest.fixture
def scheduler(device):
    """A scheduler on the benchmark device, closed (and its memory collected) after the case."""
    s = Scheduler(device)
    yield s
    s.close()
    gc.collect()


class SkipRecorder:
    """Collects skipped cases and writes them into the pytest-benchmark JSON (``"skipped"``)."""

    def __init__(self) -> None:
        self.skipped: list[dict] = []

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            self.skipped.append({"case": report.nodeid.split("::")[-1], "reason": reason})

    @pytest.hookimpl(optionalhook=True)
    def pytest_benchmark_update_json(self, config, benchmarks, output_json):
        output_json["skipped"] = list(self.skipped)
        device = default_device()
        output_json["residency"] = {"scale": _scale_name(config), "device": str(device)}
        if simulator.is_simulated(device):
            output_json["residency"]["simulated"] = simulator.LABEL

    @pytest.hookimpl(optionalhook=True)
    def pytest_benchmark_update_machine_info(self, config, machine_info):
        machine_info.update(describe_machine())
