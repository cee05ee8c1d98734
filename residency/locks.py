"""The scheduler's one lock, and the debug check that a mutator runs under it.

[Note: one lock, checked where state changes]
Every field of the scheduler's owners (holds, registry, placement) is guarded by one lock, created
by the facade and handed to each owner.  Each owner changes its fields only in its own methods,
and each such method starts with ``check_held(lock)``.  Callers write
``if CHECKING: check_held(lock)``, so the check costs one global read unless
``RESIDENCY_CHECK_LOCKS=1`` is in the environment when residency is imported (the test suite sets
it); then a mutator called without the lock raises at once, on any interpreter - this is what stands
in for the GIL on free-threaded CPython, where an unlocked update would not be atomic.

The lock is re-entrant only so that the check can ask it who owns it (``_is_owned``); no code path
takes it twice.
"""

from __future__ import annotations

import os
import threading

__all__ = ["CHECKING", "check_held", "new_lock"]

#: Whether mutators check that the scheduler lock is held (read once, at import).
CHECKING = os.environ.get("RESIDENCY_CHECK_LOCKS") == "1"


def new_lock() -> threading.RLock:
    """The lock one scheduler's owners share."""
    return threading.RLock()


def check_held(lock: threading.RLock) -> None:
    """Raise when the calling thread does not hold `lock`."""
    if not lock._is_owned():  # type: ignore[attr-defined]
        raise RuntimeError(
            "residency internal error: scheduler state changed without the scheduler lock"
        )
