"""The library never touches device bytes from the host: its accelerator path on the simulated
device with device memory protected (PROT_NONE outside the device's workers), asynchronous compute
and delays.  Each scenario runs in a process of its own (tests/_protected_run.py): a host access is
a SIGSEGV that ends it, and loading the simulator renames PrivateUse1 for the whole process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent / "_protected_run.py"


def _run(scenario: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN), scenario], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONFAULTHANDLER": "1"})


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["module", "layer"])
def test_offloading_on_protected_device_memory_is_exact_and_never_reads_it_from_the_host(scenario):
    import _accelerator

    if not _accelerator.is_simulated(_accelerator.device()):
        pytest.skip("device memory protection is the simulated device's")
    finished = _run(scenario)
    crashed = finished.returncode == -signal.SIGSEGV
    assert not crashed, f"the host touched device memory:\n{finished.stderr[-4000:]}"
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-4000:]
    assert f"ok {scenario}" in finished.stdout
