"""The calls between the package's files on one phase change, traced with ``sys.setprofile``.

    flow = trace(lambda: swap(scheduler))       # every call of a library function, in order
    flow.crossings                              # [("scheduler.py:_enter", "holds.py:try_join"), ...]
    flow.calls_up(imports)                      # the crossings against the import direction

A *crossing* is a call from a function of one of the package's files into a function of another
(a call inside one file is not one).  A crossing goes *up* when the caller's module does not import
the callee's, directly or through other modules of ours: a callback, or a call into an owner the
caller cannot name.  docs/design.md lists the flows this measures, and tests/test_phase_flow.py
keeps that list true.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
#: The package's source folders, and the dotted name each stands for.
_PACKAGES = {ROOT / "residency": "residency"}


def module_of(filename: str) -> str | None:
    """The dotted module a source file of ours is, or None (torch, the tests, the stdlib)."""
    path = Path(filename).resolve()
    for folder, package in _PACKAGES.items():
        if folder in path.parents:
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            return ".".join((package, *parts))
    return None


@attrs.frozen
class Flow:
    """The library functions one traced call ran, and the calls between files among them."""

    #: (module, function) of every call of a library function, in order.
    calls: tuple[tuple[str, str], ...]
    #: ((caller module, function), (callee module, function)) for each call between two files.
    crossings: tuple[tuple[tuple[str, str], tuple[str, str]], ...]

    @property
    def functions(self) -> set[tuple[str, str]]:
        return set(self.calls)

    @property
    def modules(self) -> set[str]:
        return {module for module, _ in self.calls}

    def calls_up(self, imports: Mapping[str, set[str]]) -> list:
        """The crossings whose caller does not import the callee's module (`imports`: each
        module's imports of ours, transitively closed)."""
        return [(a, b) for a, b in self.crossings if b[0] not in imports.get(a[0], set())]

    def listing(self) -> list[str]:
        """One line per crossing, as docs/design.md lists them: ``holds.try_join -> ...``."""
        return [f"{_short(a)} -> {_short(b)}" for a, b in self.crossings]


def _short(where: tuple[str, str]) -> str:
    module, function = where
    return f"{module.removeprefix('residency.')}.{function}"


#: Functions that only run a function they are handed, under a lock or a context
#: (residency.core.locks): a call through one is counted as a call from its caller.
_RUNNERS = {("residency.core.locks", "locked"), ("residency.core.locks", "in_context")}
#: Debugging aids the suite switches on (RESIDENCY_CHECK_LOCKS=1): not part of the path.
_CHECKS = {("residency.core.locks", "check_held")}


def _passes_through(frame) -> bool:
    module = module_of(frame.f_code.co_filename)
    return module is None or (module, frame.f_code.co_qualname) in _RUNNERS


def trace(action: Callable[[], object]) -> Flow:
    """Run `action` with a profile function that records the library's calls (this thread)."""
    calls, crossings = [], []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = module_of(frame.f_code.co_filename)
        if module is None or (module, frame.f_code.co_qualname) in _RUNNERS | _CHECKS:
            return
        callee = (module, frame.f_code.co_qualname)
        calls.append(callee)
        caller_frame = frame.f_back
        while caller_frame is not None and _passes_through(caller_frame):
            caller_frame = caller_frame.f_back  # through torch, or a runner of ours
        if caller_frame is None:
            return
        caller = (module_of(caller_frame.f_code.co_filename), caller_frame.f_code.co_qualname)
        if caller[0] != module:
            crossings.append((caller, callee))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(previous)
    return Flow(tuple(calls), tuple(crossings))


def import_closure(sources: Iterable[Path] | None = None) -> dict[str, set[str]]:
    """Each module of ours -> every module of ours it imports, directly or through others
    (imports inside functions counted; ``TYPE_CHECKING`` blocks not)."""
    files = sources if sources is not None else [
        p for folder in _PACKAGES for p in folder.rglob("*.py")]
    direct = {module_of(str(path)): _imports(path) for path in files}
    closed = {}
    for module in direct:
        seen, todo = set(), list(direct[module])
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(direct.get(name, ()))
        closed[module] = seen
    return closed


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(node) for block in ast.walk(tree) if _is_type_checking(block)
            for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("residency"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("residency"))
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
