"""Injecting a KeyboardInterrupt at every line of the library's own code (issue 20).

    points = sweep(build_world, operation, check)   # count, then inject at each line it runs

`Interrupter` is a ``sys.settrace`` function that counts the line events of code in the package's
own files (``residency/``) and raises `KeyboardInterrupt` from the trace
callback at the k-th one - exactly what no SIGINT deferral could hold back.  CPython unsets a
trace function that raised, so each run is interrupted once.  `sweep` first counts the points of
an operation on a fresh world, then, for each point it chooses, repeats the operation on fresh
modules with the interrupt at that point, catches it, and runs the checks under a watchdog
(`bounded`): a later phase that waits forever is a failure, not a hung test.

Which points (`points_to_interrupt`), by the run's ``--sweep`` option: ``full`` takes every point;
``ci`` (the default) takes the first execution of each distinct (file, line) the operation
executes - so a regression on any one line (two statements of a state change split by a new
line, say) is caught without the full sweep - or, in a sweep that says ``every_line=False`` (too
costly for CI that way), every `stride`-th point the caller gives; ``lines`` takes the stride
and each line's first *and last* execution (a loop's line interrupted with the loop nearly done,
too) in every sweep.  The stride and the last executions are the later passes through loops:
they add about half again to a layer-mode step's CI points, and stay out of CI's ten minutes.
Each sweep prints how many points and distinct lines the operation has, how many it
interrupted, and how many lines it missed.

`consistent(scheduler)` reads the owners' own state (holds, registry, placement, each group and
its block stream) and lists every disagreement: the one checker every interrupt test uses.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable

import torch
from torch import nn

import residency
import residency.adapters
from residency.core.enums import ResidencyState
from residency.group.plan import Where
from residency.group.registry import owned_modules, owner_of

OFFLOADED, LOADING, RESIDENT = (
    ResidencyState.OFFLOADED, ResidencyState.LOADING, ResidencyState.RESIDENT,
)

#: The package's own source folders: their line events are the injection points.
PACKAGE_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (residency, residency.adapters)
)

#: Seconds the checks after one injection may take before they count as waiting forever.
WATCHDOG_S = 20.0
#: The values of ``pytest --sweep``.
SWEEPS = ("ci", "lines", "full")
#: The run's ``--sweep`` value, set once by conftest's `pytest_configure` (`configure`).
_sweep = "ci"


def configure(value: str) -> None:
    """Take the run's ``--sweep`` value (tests/conftest.py, before any test runs)."""
    global _sweep
    if value not in SWEEPS:
        raise ValueError(f"--sweep={value!r}: give one of {', '.join(SWEEPS)}")
    _sweep = value


def full_sweep() -> bool:
    """Whether this run sweeps every point (``pytest --sweep=full``)."""
    return _sweep == "full"


class Interrupter:
    """A trace function: counts line events in the package's files; raises at event `at`.

        counter = Interrupter()
        counter.run(lambda: scheduler.add("a", model))   # counter.count: the points
        Interrupter(at=17).run(...)                      # KeyboardInterrupt at the 17th
    """

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.count = 0
        #: (file name, line, function) where the interrupt was raised, or None.
        self.where: tuple[str, int, str] | None = None
        #: A counting run's (file, line) of each point, in order (point k at index k - 1).
        self.lines: list[tuple[str, int]] = []
        self._inside: dict[object, bool] = {}

    def _on_call(self, frame, event, arg):
        code = frame.f_code
        inside = self._inside.get(code)
        if inside is None:
            inside = self._inside[code] = code.co_filename.startswith(PACKAGE_DIRS)
        return self._on_line if inside else None

    def _on_line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.at is None:
                self.lines.append((frame.f_code.co_filename, frame.f_lineno))
            elif self.count == self.at:
                code = frame.f_code
                self.where = (os.path.basename(code.co_filename), frame.f_lineno, code.co_name)
                raise KeyboardInterrupt(f"injected at line event {self.at}")
        return self._on_line

    def run(self, operation: Callable[[], object]) -> None:
        sys.settrace(self._on_call)
        try:
            operation()
        finally:
            sys.settrace(None)


def bounded(check: Callable[[], None], timeout: float = WATCHDOG_S) -> None:
    """Run `check` on the checker thread; waiting longer than `timeout` is an AssertionError (the
    thread is left behind, stuck: that is the failure being reported, and the next check gets a
    new thread)."""
    global _checker
    if _checker is None or _checker.stuck:
        _checker = _Checker()
    _checker.run(check, timeout)


class _Checker:
    """One daemon thread that runs the checks of every injection point, one at a time.

    A new thread per check made each check about 6 ms slower (12 against 6 ms, measured on a
    refresh sweep's points): about 5% of a sweep's time."""

    def __init__(self) -> None:
        self.stuck = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="interrupt-check", daemon=True)
        self._thread.start()

    def run(self, check: Callable[[], None], timeout: float) -> None:
        self._jobs.put((check, torch.get_num_threads()))
        try:
            failure = self._done.get(timeout=timeout)
        except queue.Empty:
            self.stuck = True
            frame = sys._current_frames().get(self._thread.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)"
            raise AssertionError(f"the checks waited over {timeout} s (forever?):\n{stack}") \
                from None
        if failure is not None:
            raise failure

    def _serve(self) -> None:
        while True:
            check, threads = self._jobs.get()
            torch.set_num_threads(threads)  # per thread: OpenMP waits made tiny ops 100x slower
            try:
                check()
            except BaseException as error:  # handed to the caller
                self._done.put(error)
            else:
                self._done.put(None)
            del check


#: The thread `bounded` runs checks on (made at the first check, again after one got stuck).
_checker: _Checker | None = None


def sweep(
    build: Callable[[], object],
    operation: Callable[[object], object],
    check: Callable[[object], None],
    *,
    stride: int = 1,
    every_line: bool = True,
    limit: int = 5,
    after: Callable[[object], None] = lambda world: None,
) -> int:
    """Count `operation`'s points on `build()`, then interrupt it at each chosen point of a
    fresh `build()`, run `after(world)` on this thread (what the caller's own ``with`` would do
    next), then `check(world)` under the watchdog.  Returns the number of points;
    raises an AssertionError listing the first `limit` failing points.  Which points: in CI,
    with `every_line`, each line's first execution, else every `stride`-th (under
    ``--sweep=lines`` both, and each line's last; the module docstring, `points_to_interrupt`)."""
    world = build()
    counter = Interrupter()
    counter.run(lambda: operation(world))
    after(world)
    bounded(lambda: check(world))
    failures = []
    points = points_to_interrupt(counter, stride, every_line)
    for at in points:
        world = build()
        interrupter = Interrupter(at)
        try:
            interrupter.run(lambda: operation(world))
        except KeyboardInterrupt:
            pass
        try:
            after(world)
            bounded(lambda: check(world))
        except BaseException as error:  # noqa: BLE001 - every failure is reported
            failures.append(f"point {at} at {interrupter.where}: {error!r}"[:1500])
            if len(failures) >= limit:
                break
    covered = {counter.lines[at - 1] for at in points}
    lines = set(counter.lines)
    print(f"\ninterrupt sweep ({_sweep}): {counter.count} points on {len(lines)} lines, "
          f"{len(points)} interrupted on {len(covered)} lines ({len(lines) - len(covered)} "
          f"missed), {len(failures)} failing")
    assert not failures, (f"{len(failures)}{'+' if len(failures) >= limit else ''} of "
                          f"{counter.count} points fail:\n" + "\n".join(failures))
    return counter.count


def points_to_interrupt(counter: Interrupter, stride: int, every_line: bool = True) -> list[int]:
    """The points a sweep interrupts, after `counter` counted the operation: all of them under
    ``--sweep=full``; under ``--sweep=ci``, the first point of each distinct (file, line) in
    `counter.lines` with `every_line`, else every `stride`-th; under ``--sweep=lines``, in every
    sweep, every `stride`-th and each line's first and last point.

        points_to_interrupt(counter, 7, every_line=False)   # [1, 8, 15, ...]
    """
    if full_sweep():
        return list(range(1, counter.count + 1))
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for point, line in enumerate(counter.lines, start=1):
        first.setdefault(line, point)
        last[line] = point
    strided = set(range(1, counter.count + 1, stride))
    if _sweep == "lines":
        return sorted(strided | set(first.values()) | set(last.values()))
    return sorted(first.values()) if every_line else sorted(strided)


# -- the one consistency checker -------------------------------------------------------------------


def consistent(scheduler) -> list[str]:
    """Every disagreement between the owners' states (empty when they agree); no phase may be
    open and no thread waiting.  Reads holds, registry, placement, each group, each stream,
    after closing abandoned phases as any call does (an interrupt at the first line of a
    ``Phase.__exit__`` leaves one; see [Note: interrupts] in residency/scheduler/scheduler.py)."""
    problems: list[str] = []
    with scheduler._lock:
        registry, placement, holds = scheduler._registry, scheduler._placement, scheduler._holds
        collect = getattr(holds, "collect_abandoned", None)  # (absent before issue 20)
        if collect is not None:  # what the next call does first: see `Holds.collect_abandoned`
            collect()
        groups = list(registry)
        if {id(g) for g in groups} != {id(g) for g in placement._planned}:
            problems.append(f"registered {[g.name for g in groups]} but placed "
                            f"{[g.name for g in placement._planned]}")
        if registry._claims:
            problems.append(f"claims left behind: {list(registry._claims)}")
        problems += _holds_problems(holds, placement.current)
        current, prefetched = placement.current, placement.prefetched
        if current is not None and (not current.exclusive or current not in groups):
            problems.append(f"current is {current!r}")
        if prefetched is not None and prefetched.state is not LOADING:
            problems.append(f"prefetched {prefetched.name!r} is {prefetched.state.value}")
        for group in groups:
            problems += _group_problems(group, current, prefetched, registry)
    return problems


def _holds_problems(holds, current) -> list[str]:
    problems = []
    if holds._queue:
        problems.append(f"tickets left in the queue: {[t.group.name for t in holds._queue]}")
    if holds._threads:
        problems.append(f"open frames or holds: {[(t.name, e.frames, e.held) for t, e in holds._threads.items()]}")
    held = sum(entry.held is not None for entry in holds._threads.values())
    if holds._holder_count != held:
        problems.append(f"holder count {holds._holder_count}, holders {held}")
    return problems


def _group_problems(group, current, prefetched, registry) -> list[str]:
    problems = []
    if not group.exclusive or group is current:
        expected = RESIDENT
    else:
        expected = LOADING if group is prefetched else OFFLOADED
    if group.plan.own.where is Where.KEPT and group is not current and group.exclusive:
        # kept between phases; after an interrupted step possibly on its master until its phase
        expected = group.state if group.state in (RESIDENT, OFFLOADED) else RESIDENT
    problems += _apart_problems(group, group is current)
    if group.state is not expected:
        problems.append(f"{group.name!r} is {group.state.value}, expected {expected.value} "
                        f"(current={getattr(current, 'name', None)!r})")
    problems += _where_tensors_are(group)
    if group.state is not LOADING and group._pending is not None:
        problems.append(f"{group.name!r} keeps a pending load while {group.state.value}")
    for module in owned_modules(group):
        if owner_of(module) != (registry, group.name):
            problems.append(f"a module of {group.name!r} is owned by {owner_of(module)}")
            break
    if group.plan.streams:
        problems += _stream_problems(group, group is current)
    return problems


def _apart_problems(group, is_current: bool) -> list[str]:
    """An auto plan's parts apart: a swapped one is on the device exactly while its group is
    current; a kept one is on the device (or, after an interrupted step, on its master until the
    group's next phase; never while the group is current); none is mid-load."""
    problems = []
    for part in group.apart:
        where = group.plan.where[part.name]
        allowed = {RESIDENT} if is_current else {OFFLOADED}
        if where is Where.KEPT:
            allowed = {RESIDENT} if is_current else {RESIDENT, OFFLOADED}
        if part.state not in allowed:
            problems.append(f"part {part.name!r} of {group.name!r} ({where.value}) is "
                            f"{part.state.value}; current={is_current}")
        problems += _where_tensors_are(part)
    return problems


def _where_tensors_are(group) -> list[str]:
    """Each tensor views the device storage (RESIDENT) or its host master (otherwise)."""
    if group.state is RESIDENT:  # (its digests may be forgotten: an eviction cut short after
        # asking what changed; the next one writes every byte back: `ChangeDetector.take_changes`)
        buffer = group.device_storage.buffer
        spans = [(buffer.data_ptr(), buffer.data_ptr() + buffer.numel())]
    elif group.host_master.arrival is not None:  # read behind: each tensor on its storage of add
        if [t.data_ptr() for t in group.inventory.tensors] != group.host_master.view_ptrs:
            return [f"a tensor of {group.name!r}, whose master is still arriving, left its "
                    "storage of add"]
        return []
    else:
        spans = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in group.host_master.chunks]
    for tensor in group.inventory.tensors:
        if tensor.numel() and not any(a <= tensor.data_ptr() < b for a, b in spans):
            return [f"a tensor of {group.name!r} ({group.state.value}) views neither its "
                    "device storage nor its host master as it should"]
    return []


def _stream_problems(group, is_current: bool) -> list[str]:
    stream = group.streams[0]
    problems = []
    if stream.active != is_current:
        problems.append(f"{group.name!r}'s stream active={stream.active}, current={is_current}")
    if stream._running or stream._suspended:
        problems.append(f"{group.name!r} counts forwards in flight: {stream._running}, "
                        f"{stream._suspended}")
    for index, block in enumerate(stream.parts):
        in_slot = index in stream._occupant
        if (block.state is not OFFLOADED) != in_slot:
            problems.append(f"block {index} of {group.name!r} is {block.state.value}, "
                            f"in a slot: {in_slot}")
        if in_slot and not is_current:
            problems.append(f"block {index} of {group.name!r} is in a slot, group not current")
        if block.state is not LOADING:
            problems += _where_tensors_are(block)
        if not stream._wrappers[index].reachable():
            problems.append(f"block {index} of {group.name!r} lost its layer-mode forward")
    return problems


def assert_consistent(scheduler) -> None:
    problems = consistent(scheduler)
    assert not problems, "\n".join(problems)


# -- tiny models --------------------------------------------------------------------------------------


def tiny_mlp(seed: int, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width))
    model.register_buffer("scale", torch.rand(width))
    return model.eval()


class TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class TinyDiT(nn.Module):
    """A DiT-shaped model: its blocks hold most of its bytes, so layer mode streams them."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.proj_in = nn.Linear(width, width, bias=False)
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return x


def tiny_dit(seed: int, depth: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return TinyDiT(depth=depth).eval()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)


def assert_same_weights(module: nn.Module, reference: nn.Module, what: str) -> None:
    ours, theirs = module.state_dict(keep_vars=True), reference.state_dict(keep_vars=True)
    assert ours.keys() == theirs.keys(), what
    for name in ours:
        assert same_bits(ours[name], theirs[name]), f"{what}: {name} differs from the twin"


def assert_same_state(module: nn.Module, state: dict, what: str) -> None:
    """`module`'s parameters and buffers equal `state` (a twin's) bit for bit."""
    ours = module.state_dict(keep_vars=True)
    assert ours.keys() == state.keys(), what
    for name, tensor in ours.items():
        assert same_bits(tensor, state[name]), f"{what}: {name} differs from the twin"
