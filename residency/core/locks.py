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

[Note: a context on one line]
A ``with`` block whose body spans lines leaves it through a line of its own (the ``with`` line
again): an exception raised there - by a trace or profile callback; see [Note: interrupts] in
`residency.scheduler.scheduler` - skips ``__exit__``, and a lock stays held for ever (other threads wait),
an autograd mode stays switched, a profiler range stays open.  So the package enters every
context it must leave on one line, ``with context: return call(...)``, which has no line between
the call's end and ``__exit__``: `locked` for the lock, `in_context` for the rest.
"""

from __future__ import annotations

import os
import threading

__all__ = ["CHECKING", "check_held", "in_context", "locked", "new_lock"]

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


def locked(lock: threading.RLock, call, *args):
    """``call(*args)`` with `lock` held, released however it ends (see [Note: a context on one
    line]).

        return locked(self._lock, self._enter_locked, phase)
    """
    with lock: return call(*args)  # noqa: E701 - one line: see the note


def in_context(context, call, *args, **kwargs):
    """``call(*args, **kwargs)`` inside `context` (``torch.no_grad()``, ``record_function(...)``),
    left however it ends (see [Note: a context on one line])."""
    with context: return call(*args, **kwargs)  # noqa: E701 - one line: see the note
