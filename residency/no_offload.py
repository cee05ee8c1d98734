"""`NoOffload`: the scheduler to use when offloading is off.

Model code written with phases (``with scheduler.resident("generator"):``) runs unchanged against
it: every phase does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from residency.arguments import as_excluded, as_modules, check_name, parse_policy
from residency.enums import Policy
from residency.records import TransitionLog

__all__ = ["NoOffload"]


class NoOffload:
    """The scheduler to use when offloading is off: ``resident()`` does nothing.

        scheduler = NoOffload()
        with scheduler.resident("generator"):   # no checks, no moves
            out = model.generator(x)

    Model code written with phases runs unchanged.  ``add`` moves modules to `device` (when given)
    and remembers their names so that ``in`` and iteration behave like a `Scheduler`'s.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.transitions = TransitionLog(0)
        self._names: dict[str, tuple[nn.Module, ...]] = {}

    def add(
        self,
        name: str,
        modules: nn.Module | Iterable[nn.Module],
        *,
        policy: str | Policy = "exclusive",
        exclude: nn.Module | Iterable[nn.Module] = (),
        category: str | None = None,
        detect_edits: bool = True,
    ) -> None:
        """Check the arguments as `Scheduler.add` does; move the modules to `device` when given."""
        check_name(name, self._names)
        parse_policy(policy)
        roots = as_modules(name, modules)
        as_excluded(name, exclude, roots)
        if self.device is not None:
            for module in roots:
                module.to(self.device)
        self._names[name] = roots

    def alias(self, path: str, name: str) -> None:
        """Accepted for symmetry with `Scheduler.alias`; every phase does nothing anyway."""

    def remove(self, name: str) -> None:
        """Forget group `name` (its modules stay where they are)."""
        self._names.pop(name, None)

    def resident(self, name: str) -> _NullPhase:
        return _NULL_PHASE

    def offload_all(self) -> None:
        """Nothing is offloaded, so nothing to do."""

    @property
    def current(self) -> None:
        return None

    @property
    def device_nbytes(self) -> int:
        """No device storage of its own: 0."""
        return 0

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __repr__(self) -> str:
        return f"<NoOffload: {len(self._names)} group(s)>"


class _NullPhase:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        return None


_NULL_PHASE = _NullPhase()


