"""`NoOffload`: the scheduler to use when offloading is off.

Model code written with phases (``with scheduler.resident("generator"):``) runs unchanged against
it: every phase does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from residency.group.arguments import (
    as_excluded,
    as_modules,
    check_name,
    parse_policy,
    unknown_group_message,
)
from residency.core.enums import Policy
from residency.core.errors import UnknownGroupError
from residency.group.records import TransitionLog

__all__ = ["NoOffload"]


class NoOffload:
    """The scheduler to use when offloading is off: ``resident()`` moves nothing.

        scheduler = NoOffload()
        with scheduler.resident("generator"):   # no groups added: any name, no moves
            out = model.generator(x)

    Model code written with phases runs unchanged.  ``add`` moves modules to `device` (when given)
    and remembers their names (``alias`` its aliases) so that ``in`` and iteration behave like a
    `Scheduler`'s.  Once it knows its groups (``Scheduler.from_pipeline(pipe, None)`` adds them),
    ``resident`` refuses a name that is neither a group nor an alias with the `UnknownGroupError`
    a `Scheduler` raises, so a typo fails with offloading off too; a `NoOffload` with no groups
    accepts any name.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.transitions = TransitionLog(0)
        #: group name -> (its modules, its category).
        self._names: dict[str, tuple[tuple[nn.Module, ...], str | None]] = {}
        #: alias -> the group name it was given for (`remove` drops a group's aliases).
        self._aliases: dict[str, str] = {}

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
        check_name(name, [*self._names, *self._aliases])
        parse_policy(policy)
        roots = as_modules(name, modules)
        as_excluded(name, exclude, roots)
        if self.device is not None:
            for module in roots:
                module.to(self.device)
        self._names[name] = (roots, category)

    def alias(self, path: str, name: str) -> None:
        """Let `path` lead to group `name` as well (`Scheduler.alias`); `UnknownGroupError` when
        groups were added and `name` is not one of them."""
        if self._names and not (isinstance(name, str) and name in self._names):
            raise UnknownGroupError(self._unknown(name))
        self._aliases[path] = name

    def remove(self, name: str) -> None:
        """Forget group `name` and its aliases (its modules stay where they are)."""
        self._names.pop(name, None)
        self._aliases = {path: group for path, group in self._aliases.items() if group != name}

    def resident(self, name: str) -> _NullPhase:
        """A phase that does nothing; `UnknownGroupError` (as `Scheduler.resident`) for a name that
        is neither a group nor an alias, once groups were added."""
        if self._names and not (isinstance(name, str) and name in self):
            raise UnknownGroupError(self._unknown(name))
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
        return isinstance(name, str) and (name in self._names or name in self._aliases)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __repr__(self) -> str:
        return f"<NoOffload: {len(self._names)} group(s)>"

    def _unknown(self, name: object) -> str:
        categories = {group: category for group, (_, category) in self._names.items()}
        return unknown_group_message(name, categories, self._aliases)


class _NullPhase:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        return None


_NULL_PHASE = _NullPhase()


