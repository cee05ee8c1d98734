"""Make a pytest process a sim process: ``python -m pytest -p tests.simdevice.pytest_plugin -m gpu``.

The simulator is loaded before collection, so ``torch.accelerator.is_available()`` is true when the
suite's conftest decides what to skip. When it does not build, the process stays a CPU process (the
accelerator tests skip) and a warning carries the compiler's message; with
RESIDENCY_REQUIRE_SIMDEVICE=1 (CI) the session fails instead.
"""

from __future__ import annotations

import os
import warnings

from tests import simdevice


def pytest_configure(config) -> None:
    try:
        simdevice.load()
    except simdevice.SimBuildError as error:
        if os.environ.get("RESIDENCY_REQUIRE_SIMDEVICE") == "1":
            raise
        warnings.warn(f"accelerator tests will skip: {error}", stacklevel=1)
