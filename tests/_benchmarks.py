"""Import modules of the `benchmarks` package, which is not installed, from the repository root."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def import_benchmarks(*names: str) -> tuple[ModuleType, ...]:
    """``benchmarks.<name>`` for each name, imported with the root on ``sys.path`` only meanwhile."""
    added = str(ROOT) not in sys.path
    if added:
        sys.path.insert(0, str(ROOT))
    try:
        return tuple(importlib.import_module(f"benchmarks.{name}") for name in names)
    finally:
        if added:
            sys.path.remove(str(ROOT))
