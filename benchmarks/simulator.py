"""The simulated accelerator of ``tests/simdevice``, for the benchmarks that run on it.

    device = simulator.load(asynchronous=True)       # torch.device("sim:0"); builds it once
    with simulator.timing(copy_bandwidth=50e6, compute_delay=1e-3):
        ...                                           # copies take bytes / 50 MB/s, each op +1 ms
    simulator.host_syncs()                            # host waits on the device so far

Loading it renames PrivateUse1 to ``sim`` and makes it the process's accelerator, so only a process
that runs nothing else loads it: ``python -m benchmarks.gpu_check --device sim`` and
``pytest benchmarks/ --bench-device=sim`` (see benchmarks/README.md).  Its figures are a
SIMULATION - sleeps standing in for a copy engine and kernels, beside the host's real work - and
are labelled so wherever they are shown, never as GPU figures.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["LABEL", "busy", "controls", "host_syncs", "is_simulated", "load", "timing"]

_TESTS = Path(__file__).resolve().parent.parent / "tests"
#: What every simulated figure is quoted with.
LABEL = ("SIMULATED accelerator (tests/simdevice: per-stream worker threads; a copy sleeps bytes / "
         "copy_bandwidth, each queued op sleeps compute_delay, beside the host's real work): "
         "not GPU figures")


def _simdevice():
    """The `simdevice` package, imported as the tests import it (one module, one extension)."""
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    import simdevice

    return simdevice


def load(**initial_controls) -> torch.device:
    """Build (cached under tests/simdevice/build/) and load the simulator; returns
    ``torch.device("sim:0")``.

    Raises ``simdevice.SimBuildError`` with the compiler's message when it does not build.
    """
    return _simdevice().load(**initial_controls)


def is_simulated(device: torch.device) -> bool:
    """Whether `device` is the simulated one (it is only ever called ``sim``)."""
    return device.type == "sim"


def controls(**values) -> contextlib.AbstractContextManager:
    """The simulator's controls for the block (``simdevice.controls``), restored after it."""
    return _simdevice().controls(**values)


@contextlib.contextmanager
def timing(*, copy_bandwidth: float, compute_delay: float) -> Iterator[None]:
    """Timing mode for the block: every copy between host and device takes ``nbytes /
    copy_bandwidth`` seconds, one within the device 40x less (`DEVICE_COPY_RATIO`), plus the real
    memcpy (microseconds at these sizes), and every queued op ``compute_delay`` seconds (plus
    its real CPU kernel), on the stream it was queued on; the host returns at once (asynchronous).

        with simulator.timing(copy_bandwidth=50e6, compute_delay=1e-3):
            step()
    """
    with controls(asynchronous=True, copy_bandwidth=copy_bandwidth,
                  device_copy_bandwidth=DEVICE_COPY_RATIO * copy_bandwidth, copy_delay=0.0,
                  compute_delay=compute_delay):
        yield


#: How much faster a copy within the device runs than one over the host link: an H200's HBM3e
#: (4.8 TB/s, a copy reads and writes: ~2.4 TB/s) against PCIe Gen5 x16 (~55 GB/s pinned) is ~40x.
DEVICE_COPY_RATIO = 40


def busy(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for `seconds` (``simdevice.busy``, as
    ``torch.cuda._sleep`` spins for cycles): a model step's compute in one launch."""
    _simdevice().busy(seconds)


def host_syncs() -> int:
    """Host synchronisations so far in this process: every host wait on the simulated device
    (stream, event and device synchronize, ``.item()``, copies that are not asynchronous)."""
    return _simdevice().host_syncs()
