"""The synchronisation audit (issues 19 and 33): every ordering call site of the library, and a test
that fails when that one call is removed.

docs/design.md, "Synchronisation audit", is the table: each ordering call site in residency/ (file,
enclosing function, call, and its place among that function's calls of that name) -> the removal
tried, the test below that catches it, or why none can.  `test_every_ordering_call_has_a_row` reads
the package's source and keeps the table whole; `test_each_row_names_the_test_that_removes_it`
keeps each row's test honest: the test it names removes that very call.

[Note: how a call is removed]
As a reviewer would remove it, in the source: `removed_at` parses the call's module, finds the
function and the call at its place (the k-th call of that name in that function, in source order),
replaces that one node (checked: exactly one), compiles the module and gives the live function the
rewritten code (`__code__`, for the block only; every caller sees it, as with an edited file).
What a removal is, by call (`Site.removal`):

* a wait, a record, a retire, a release (`wait_event`, `wait_stream`, `record_event`,
  `record_stream`, `record`, `synchronize`, `wait`, `retire`, `release`): the call is deleted; where
  its value was used (an event), the value is None (nothing to wait for);
* an implicit host wait that reads device values (`tolist`, `item`, `cpu`): a read that does not
  wait - the values are copied into pinned host memory with ``non_blocking=True`` on the current
  stream, and read at once (`unwaited_read`).  What the host then sees is whatever that memory held;
  the row names the content (`Site.stale`): the earlier answer that hides the change;
* a blocking copy (`copy_`, `to` without ``non_blocking=True``): ``non_blocking=True`` is added.

[Note: how a race is made certain]
A run with the call removed must give wrong bits (an output differing from the never-offloaded
model's, an edit missing from the host master, a host read of bytes not written yet, memory still
held); a run with it kept must give the right ones.  The race is not left to timing: the simulated
device's worker hold stops the stream that would otherwise win (`simdevice.hold`), and the other
stream is let run first as far as it can (`drain`).  Where the host itself must wait for the held
stream, `held_until_host_waits` releases the hold only once the main thread is blocked in a host
wait on the device (`simdevice.waiting_threads`) with the function that holds the wait on its stack.
A removed run makes no such wait there, so the hold lasts the whole block: its host reads, and the
decisions it takes on what it read, come before the held work ran, every time.  (Releasing the hold
when the thread merely entered that function left a removal inside the same function to timing.)

`drain` cannot tell a stream that waits on held work (the kept run) from a slow one, so it gives
up after `DRAIN_S`; that bound only costs kept runs time: a removed run's stream has nothing to
wait for.

Each test runs its scenario `REPEATS` times kept and `REPEATS` times removed (2 by default);
``pytest --sweep=full`` runs the acceptance check (20 of 20 failures removed, 20 of 20 passes
kept).  A removal the simulated device shows harmless is run by an experiment marked
``harmless_removal`` (right bits kept and removed): it fails the day the call becomes needed, and
it is not counted toward ``RESIDENCY_MIN_ACCELERATOR_TESTS`` (tests/_accelerator.py).  The
scenarios need the worker hold, so they run on the simulated device only.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import importlib
import inspect
import itertools
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from residency import Scheduler
from residency.group.plan import Where
from residency.device.transport import AcceleratorTransport, DeviceStorage
from residency.multirank.agreement import digest_ranges

import simdevice
from _accelerator import device as accelerator_device, is_simulated
from _interrupts import full_sweep

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 20 if full_sweep() else 2
#: How long `drain` lets a stream run before it takes it for blocked (see the module note).
DRAIN_S = 0.25
#: A host wait on a held stream fails after this (a harness bug, never a result).
WAIT_TIMEOUT_S = 30.0
WIDTH = 64


# -- the sites: every ordering call, by file, function and place -----------------------------------

#: Calls that order work between streams or between the host and the device; the last five are the
#: implicit host waits (`copy_` and `to` only when not asked to be non-blocking).
ORDERING_CALLS = frozenset({
    "wait_event", "wait_stream", "record_event", "record_stream", "record", "synchronize", "wait",
    "retire", "release", "tolist", "item", "cpu", "equal", "copy_", "to",
})
_READS = frozenset({"tolist", "item", "cpu"})
_COPIES = frozenset({"copy_", "to"})
#: The name a read's removal calls in the rewritten module (`unwaited_read`, set for the block).
_UNWAITED = "_residency_audit_unwaited_read"


@dataclasses.dataclass(frozen=True)
class Site:
    """One ordering call site: the `place`-th call named `call` (1 = the first) in `function` (its
    classes and enclosing functions, dotted) of `file`.

        Site("residency/placement/placement.py", "DeviceBuffers.make_room", "release", 2)
    """

    file: str
    function: str
    call: str
    place: int = 1
    #: For a read: what the host memory the unwaited copy lands in holds (see the module note).
    stale: bool | int | float | None = dataclasses.field(default=None, compare=False)

    @property
    def key(self) -> tuple[str, str, str, int]:
        return self.file, self.function, self.call, self.place

    @property
    def removal(self) -> str:
        """What removing the call means (the table's "removal" column)."""
        if self.call in _READS:
            return f"read without a wait (the host memory holds {self.stale!r})"
        if self.call in _COPIES:
            return "`non_blocking=True` added"
        return "call deleted"

    def __str__(self) -> str:
        return f"{self.file}:{self.function} `{self.call}` #{self.place}"


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _is_ordering(call: ast.Call) -> bool:
    name = _call_name(call)
    if name not in ORDERING_CALLS:
        return False
    if name in _COPIES:
        return not any(k.arg == "non_blocking" and isinstance(k.value, ast.Constant)
                       and k.value.value is True for k in call.keywords)
    return True


def call_sites(tree: ast.Module, file: str) -> dict[tuple, tuple[ast.Call, list[ast.AST]]]:
    """Site key -> (its call node, the scopes around it), for every ordering call in `tree`.  A
    place counts the calls of that name in that scope in source order (outer call first); a nested
    function or class is a scope of its own."""
    found: dict[tuple, tuple[ast.Call, list[ast.AST]]] = {}
    _visit(tree, file, [], found)
    return found


def _visit(node: ast.AST, file: str, scopes: list[ast.AST], found: dict) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _visit(child, file, [*scopes, child], found)
            continue
        if isinstance(child, ast.Call) and _is_ordering(child):
            function = ".".join(scope.name for scope in scopes) or "<module>"
            name = _call_name(child)
            place = 1 + sum(1 for key in found if key[:3] == (file, function, name))
            found[(file, function, name, place)] = (child, scopes)
        _visit(child, file, scopes, found)


def ordering_calls() -> dict[tuple[str, str, str, int], int]:
    """(file, Class.function, call, place) -> line, for every ordering call in residency/."""
    lines = {}
    for path in sorted(ROOT.glob("residency/**/*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for key, (call, _) in call_sites(ast.parse(path.read_text(), relative), relative).items():
            lines[key] = call.lineno
    return lines


# -- removing one call in the source ---------------------------------------------------------------


class _ReplaceOne(ast.NodeTransformer):
    """Replaces the one node `target` (by identity) with `replacement`; counts replacements."""

    def __init__(self, target: ast.AST, replacement: ast.AST) -> None:
        self.target, self.replacement, self.replaced = target, replacement, 0

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            self.replaced += 1
            return ast.copy_location(self.replacement, node)
        return super().visit(node)


def _replacement(site: Site, call: ast.Call) -> ast.AST:
    """The node that stands where `call` stood once `site` is removed (see the module note)."""
    if site.call in _READS:
        return ast.Call(func=ast.Name(_UNWAITED, ast.Load()),
                        args=[call.func.value, ast.Constant(site.call), ast.Constant(site.stale)],
                        keywords=[])
    if site.call in _COPIES:
        return ast.Call(func=call.func, args=call.args,
                        keywords=[*call.keywords, ast.keyword("non_blocking", ast.Constant(True))])
    return ast.Constant(None)


def _code_named(code: types.CodeType, qualname: str) -> types.CodeType:
    """The code object `qualname` compiled within module code `code`."""
    pending = [code]
    while pending:
        current = pending.pop()
        if current.co_qualname == qualname:
            return current
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    raise LookupError(f"no code named {qualname} in {code.co_filename}")


def bytecode(code: types.CodeType) -> tuple[bytes, ...]:
    """The instructions of `code` and of every code object compiled within it (comprehensions,
    lambdas, nested functions), in order."""
    nested = (bytecode(const) for const in code.co_consts if isinstance(const, types.CodeType))
    return (code.co_code, *(part for parts in nested for part in parts))


def _live_function(module: types.ModuleType, qualname: str) -> types.FunctionType:
    """The function object of `module` whose code is `qualname` (a method, a property's getter,
    a decorated function: unwrapped)."""
    owner: object = module
    names = qualname.split(".")
    for name in names[:-1]:
        owner = vars(owner)[name]
    value = vars(owner)[names[-1]]
    if isinstance(value, property):
        candidates = [value.fget, value.fset, value.fdel]
    else:
        candidates = [inspect.unwrap(getattr(value, "__func__", value))]
    for candidate in candidates:
        if getattr(candidate, "__code__", None) is not None \
                and candidate.__code__.co_qualname == qualname:
            return candidate
    raise LookupError(f"{module.__name__}.{qualname} is not a function this audit can rewrite")


def _patched_function(scopes: list[ast.AST]) -> str:
    """The qualified name of the outermost function around a site (the one whose code is
    replaced: a nested function is made anew from its code each time it runs)."""
    names = []
    for scope in scopes:
        names.append(scope.name)
        if not isinstance(scope, ast.ClassDef):
            return ".".join(names)
    raise LookupError("an ordering call at class or module level: no function to rewrite")


def removed_code(site: Site) -> tuple[types.FunctionType, types.CodeType]:
    """The live function around `site` and its code with that one call removed (see the note)."""
    path = ROOT / site.file
    tree = ast.parse(path.read_text(), str(path))
    found = call_sites(tree, site.file)
    if site.key not in found:
        raise LookupError(f"{site}: no such call in the source (the table names a call that is "
                          "gone: update the row and its test)")
    call, scopes = found[site.key]
    qualname = _patched_function(scopes)
    module = importlib.import_module(site.file.removesuffix(".py").replace("/", "."))
    live = _live_function(module, qualname)
    if bytecode(_code_named(compile(tree, str(path), "exec", dont_inherit=True), qualname)) \
            != bytecode(live.__code__):
        raise RuntimeError(f"{site.file} changed on disk since it was imported: run again")
    rewrite = _ReplaceOne(call, _replacement(site, call))
    rewritten = ast.fix_missing_locations(rewrite.visit(tree))
    assert rewrite.replaced == 1, f"{site}: {rewrite.replaced} nodes replaced, not one"
    return live, _code_named(compile(rewritten, str(path), "exec", dont_inherit=True), qualname)


def remove_at(patch: pytest.MonkeyPatch, site: Site) -> None:
    """Remove `site`'s call (see [Note: how a call is removed]) until `patch` is undone."""
    live, code = removed_code(site)
    patch.setattr(live, "__code__", code)
    if site.call in _READS:
        patch.setitem(live.__globals__, _UNWAITED, unwaited_read)


def unwaited_read(value, kind: str, stale):
    """``value.<kind>()`` without its host wait: a device tensor's values are copied into pinned
    host memory filled with `stale`, with ``non_blocking=True`` on the current stream, and read at
    once (what the host sees before the copy ran).  A host tensor's read waits for nothing: as is.

        unwaited_read(flags, "tolist", False)   # [False, ...] while the stream is held
    """
    if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
        return getattr(value, kind)()
    on_host = torch.full(value.shape, stale, dtype=value.dtype, pin_memory=True)
    on_host.copy_(value, non_blocking=True)
    return on_host if kind == "cpu" else getattr(on_host, kind)()


# -- the harness --------------------------------------------------------------------------------


class WrongBits(AssertionError):
    """A scenario saw bytes that differ from the never-offloaded model's (the race happened), or,
    for a release, memory still held that should have been handed back."""


def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise WrongBits unless `actual` (once the device has finished everything queued) holds
    exactly `expected`'s bits."""
    torch.accelerator.synchronize()
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if not torch.equal(actual, expected):
        differing = (actual != expected).sum().item()
        raise WrongBits(f"{what}: {differing} of {expected.numel()} elements differ")


def drain(stream: torch.Stream, within: float = DRAIN_S) -> bool:
    """Let `stream` run what it can (at most `within` seconds); True when it has nothing left."""
    deadline = time.monotonic() + within
    while not stream.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def _blocked_in(thread: int, function: str) -> bool:
    """Whether `thread` is blocked in a host wait on the device with `function` (a qualified
    name) on its stack."""
    if thread not in simdevice.waiting_threads():
        return False
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code.co_qualname == function:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def held_until_host_waits(stream: torch.Stream, function: str, drained=()) -> Iterator[None]:
    """Hold `stream` until the main thread is blocked in a host wait on the device inside
    `function` (a qualified name: "Transport.to_host_synchronized", "ChangeDetector.changed_windows"), then let
    each of `drained` run what it can and release the hold.  Without such a wait the hold lasts the
    whole block (see [Note: how a race is made certain])."""
    main = threading.get_ident()
    finished = threading.Event()
    holding = contextlib.ExitStack()
    holding.enter_context(simdevice.hold(stream))

    def watch() -> None:
        while not finished.is_set():
            if _blocked_in(main, function):
                for other in drained:
                    drain(other)
                holding.close()
                return
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, name="audit-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join(timeout=WAIT_TIMEOUT_S)
        holding.close()


def _runs(scenario: Callable, site: Site) -> dict[str, list[str]]:
    """`scenario(point)` REPEATS times with `site` kept and REPEATS times with it removed; the
    wrong bits each way saw."""
    wrong = {"kept": [], "removed": []}
    for way in ("kept", "removed"):
        for _ in range(REPEATS):
            try:
                scenario(_point(site if way == "removed" else None))
            except WrongBits as failure:
                wrong[way].append(str(failure))
            finally:
                torch.accelerator.synchronize()
    return wrong


def audit(scenario: Callable, site: Site) -> None:
    """Run `scenario(point)` REPEATS times with `site` kept and REPEATS times with it removed: the
    scenario does its racy step inside ``with point():``, where a removed run has the call taken out
    of the source (`remove_at`; set-up and checks run on the source as it is).  Every kept run must
    pass, every removed run must see wrong bits."""
    wrong = _runs(scenario, site)
    assert not wrong["kept"], f"with {site} kept, {len(wrong['kept'])} of {REPEATS} runs " \
                              f"saw wrong bits: {wrong['kept'][0]}"
    assert len(wrong["removed"]) == REPEATS, (
        f"with {site} removed ({site.removal}), only {len(wrong['removed'])} of {REPEATS} runs saw "
        "wrong bits: the test does not catch its removal")


def audit_harmless(scenario: Callable, site: Site) -> None:
    """The experiment for a removal the simulated device shows harmless: `scenario(point)` gives
    the right bits in every run, `site` kept or removed (the removal is still made: a call that is
    gone fails here).  Fails the day the call becomes needed there (then it needs an `audit`)."""
    wrong = _runs(scenario, site)
    for way, failures in wrong.items():
        assert not failures, f"with {site} {way}, {len(failures)} of {REPEATS} runs saw wrong " \
                             f"bits: {failures[0]} (a removal no longer harmless: audit it)"


def _point(site: Site | None):
    @contextlib.contextmanager
    def point():
        with pytest.MonkeyPatch.context() as patch:
            if site is not None:
                remove_at(patch, site)
            yield
    return point


@pytest.fixture
def device():
    """The simulated device, asynchronous, with no delays (the holds make the races)."""
    if not torch.accelerator.is_available():
        # This process has no accelerator: the test is reported from the simulator's process
        # (tests/_accelerator.py), and its body does not run here.
        yield None
        return
    target = accelerator_device()
    if not is_simulated(target):
        pytest.skip("the audit makes races certain with the simulated device's worker hold")
    with simdevice.controls(asynchronous=True, compute_delay=0.0, copy_delay=0.0,
                            copy_bandwidth=0.0, wait_timeout=WAIT_TIMEOUT_S):
        yield target
    torch.accelerator.synchronize()


def compute_stream() -> torch.Stream:
    return torch.accelerator.current_stream()

# -- the models ---------------------------------------------------------------------------------


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Tower(nn.Module):
    """A head and four blocks, declared the vLLM-Omni way (layer mode streams the blocks)."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return x


class Groups:
    """A scheduler on the device with groups "a" and "b", their never-offloaded twins' outputs,
    and an input."""

    def __init__(self, device: torch.device, *, detect_edits: bool = True, layers: bool = False):
        make = Tower if layers else mlp
        self.models = {"a": make(1), "b": make(2)}
        self.host_copies = {name: copy.deepcopy(m) for name, m in self.models.items()}
        torch.manual_seed(3)
        self.x = torch.randn(8, WIDTH, device=device)
        self.expected = {name: copy.deepcopy(m).to(device)(self.x).cpu()
                         for name, m in self.models.items()}
        self.scheduler = Scheduler(device)
        for name, model in self.models.items():
            self.scheduler.add(name, model, detect_edits=detect_edits, layers=layers)
        self.transport: AcceleratorTransport = self.scheduler._transport

    @property
    def copy_stream(self) -> torch.Stream:
        return self.transport.copy_stream

    def run(self, name: str) -> torch.Tensor:
        """`name`'s output in its phase (no autograd graph: one would keep the buffer alive)."""
        with self.scheduler.resident(name), torch.no_grad():
            return self.models[name](self.x)

    def close(self) -> None:
        torch.accelerator.synchronize()
        self.scheduler.close()


@contextlib.contextmanager
def groups(device, **options):
    made = Groups(device, **options)
    try:
        yield made
    finally:
        made.close()


# -- the sites the tests below remove ------------------------------------------------------------

_TRANSPORT, _COMPONENT = "residency/device/transport.py", "residency/group/residency.py"
_MOVER = "residency/placement/mover.py"
_PLACEMENT = "residency/placement/placement.py"

LOAD_EVENT_WAIT = Site(_TRANSPORT, "Completion.wait", "wait_event")
COPY_EVENT_SYNCHRONIZE = Site(_TRANSPORT, "Completion.synchronize", "synchronize")
COPY_END_RECORD = Site(_TRANSPORT, "AcceleratorTransport._copy_on_stream", "record_event")
WRITE_BACK_AFTER_COMPUTE = Site(_TRANSPORT, "AcceleratorTransport.to_host", "wait_stream")
RETIRE_RECORD = Site(_TRANSPORT, "AcceleratorTransport.retire", "record_event")
ALLOCATION_RECORD = Site(_TRANSPORT, "AcceleratorTransport.allocate_device", "record_event")
RETIRED_WAIT = Site(_TRANSPORT, "AcceleratorTransport._wait_retired", "wait_event")
RELEASE_AFTER_COPIES = Site(_TRANSPORT, "AcceleratorTransport.release", "wait_stream")
STORAGE_RELEASE = Site(_TRANSPORT, "DeviceStorage.release", "release")
FRESH_BUFFER_RELEASE = Site(_TRANSPORT, "DeviceStorage.prepare", "release")
FINISH_LOAD_WAIT = Site(_COMPONENT, "Residency.finish_load", "wait")
EVICTION_RETIRE = Site(_COMPONENT, "WriteBack.write", "retire")
STORAGE_RETIRE = Site(_TRANSPORT, "DeviceStorage.retire", "retire")
MISFIT_TO_HOST = Site(_COMPONENT, "Residency.evict", "to")
CANCEL_SYNCHRONIZE = Site(_COMPONENT, "Residency.cancel_load", "synchronize")
CANCEL_RETIRE = Site(_COMPONENT, "Residency.cancel_load", "retire")
WRITE_BACK_SYNCHRONIZE = Site(_TRANSPORT, "Transport.to_host_synchronized", "synchronize")
SAME_BYTES_FLAGS = Site(_COMPONENT, "_same_bytes", "tolist", stale=True)
#: 0: the bytes of the user's new tensor (zeros, whatever words they are read as).
SAME_BYTES_ON_HOST = Site(_COMPONENT, "_same_bytes", "cpu", 2, stale=0)
CHANGED_FLAGS = Site("residency/device/digests.py", "ChangeDetector.changed_windows", "tolist",
                     stale=False)
FINGERPRINT_DIGESTS = Site("residency/multirank/agreement.py", "_fingerprints", "cpu", stale=0)
REMOVE_RELEASE = Site(_PLACEMENT, "Placement._remove", "release")
FREE_ALL_RELEASE = Site(_PLACEMENT, "DeviceBuffers.release_all", "release")
MAKE_ROOM_RELEASE = Site(_PLACEMENT, "DeviceBuffers.make_room", "release")
#: One release for every part that leaves the device, whatever moved it out (a group leaving,
#: a re-plan of a kept block or of a kept own part): each test below removes it.
MOVE_OUT_RELEASE = Site(_MOVER, "PartMover.move_out", "release")
OWN_STORAGE_RELEASE = Site(_PLACEMENT, "Placement._leave", "release")


# -- loads: compute waits for the copy ------------------------------------------------------------


def load_then_compute(device, point, *, layers: bool = False) -> None:
    """A phase's kernels are queued while its load's copy is held: they must read the loaded
    bytes, not what the buffer held before (the other group's)."""
    # Layer mode: detection off, or a block's departure would make the host wait for compute,
    # which waits for the held copy.
    with groups(device, layers=layers, detect_edits=not layers) as g:
        g.run("a")
        g.run("b")  # the buffers now hold b's bytes
        torch.accelerator.synchronize()
        with simdevice.hold(g.copy_stream), point():
            output = g.run("a")
            drain(compute_stream())
        same(output, g.expected["a"], "a's output")


@pytest.mark.gpu
def test_a_phase_waits_for_its_load(device):
    """group/residency.py:Residency.finish_load -> Completion.wait()."""
    audit(lambda point: load_then_compute(device, point), FINISH_LOAD_WAIT)


@pytest.mark.gpu
def test_the_compute_stream_waits_on_the_load_event(device):
    """transport.py:Completion.wait -> wait_event (every caller)."""
    audit(lambda point: load_then_compute(device, point), LOAD_EVENT_WAIT)


@pytest.mark.gpu
def test_a_load_records_its_end_on_the_copy_stream(device):
    """transport.py:AcceleratorTransport._copy_on_stream -> copy_stream.record_event(), seen by
    a load (the event compute waits on)."""
    audit(lambda point: load_then_compute(device, point), COPY_END_RECORD)


@pytest.mark.gpu
def test_a_streamed_block_waits_for_its_copy(device):
    """Layer mode: BlockStream._park -> Residency.finish_load -> Completion.wait()."""
    audit(lambda point: load_then_compute(device, point, layers=True), FINISH_LOAD_WAIT)


# -- evictions: the next copy into a buffer waits for the compute that read it ---------------------


def evict_then_overwrite(device, point, *, layers: bool = False) -> None:
    """a's kernels are queued on a held compute stream, then b is loaded into the buffer they
    read (layer mode: a's later blocks into the slots its earlier blocks read).  The copy stream
    runs what it may first; a's output must still come from a's bytes.  Detection is off, so the
    evictions make no host wait on the held compute stream."""
    with groups(device, detect_edits=False, layers=layers) as g:
        g.run("b")
        g.run("a")  # a current: its bytes in the buffer
        torch.accelerator.synchronize()
        with simdevice.hold(compute_stream()), point():
            output = g.run("a")  # layer mode: a's blocks take turns in the two slots
            if not layers:
                g.run("b")  # into the buffer a's kernels read
            drain(g.copy_stream)
        same(output, g.expected["a"], "a's output")
        same(g.run("b"), g.expected["b"], "b's output")


@pytest.mark.gpu
def test_an_eviction_retires_its_buffer(device):
    """group/residency.py:WriteBack.write -> storage.retire(copies)."""
    audit(lambda point: evict_then_overwrite(device, point), EVICTION_RETIRE)


@pytest.mark.gpu
def test_device_storage_retire_forwards_to_the_transport(device):
    """transport.py:DeviceStorage.retire -> transport.retire(buffer)."""
    audit(lambda point: evict_then_overwrite(device, point), STORAGE_RETIRE)


@pytest.mark.gpu
def test_retire_records_on_the_compute_stream(device):
    """transport.py:AcceleratorTransport.retire -> current_stream().record_event()."""
    audit(lambda point: evict_then_overwrite(device, point), RETIRE_RECORD)


@pytest.mark.gpu
def test_a_copy_into_a_retired_buffer_waits(device):
    """transport.py:AcceleratorTransport._wait_retired -> copy_stream.wait_event(retired)."""
    audit(lambda point: evict_then_overwrite(device, point), RETIRED_WAIT)


@pytest.mark.gpu
def test_a_slot_is_not_overwritten_under_the_block_that_read_it(device):
    """Layer mode: BlockStream._evict -> SlotPlacement.evict -> Residency.evict ->
    WriteBack.write -> storage.retire(copies) (the slot's buffer)."""
    audit(lambda point: evict_then_overwrite(device, point, layers=True), EVICTION_RETIRE)


# -- a fresh buffer: its first copy waits for compute queued before its allocation ----------------


def allocate_over_freed_memory(device, point) -> None:
    """A device tensor is read by a kernel queued on the held compute stream and freed; the
    group's buffer, allocated next, reuses its memory (the caching allocator's same-stream reuse).
    The load's copy must not overwrite it before that kernel ran."""
    with groups(device) as g:
        nbytes = _exclusive_buffer_nbytes(g)
        freed = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
        torch.accelerator.synchronize()
        with simdevice.hold(compute_stream()), point():
            read = freed.clone()  # queued: reads the memory about to be reused
            del freed
            output = g.run("a")
            drain(g.copy_stream)
        same(read, torch.full((nbytes,), 7, dtype=torch.uint8), "the freed tensor as read")
        same(output, g.expected["a"], "a's output")


def _exclusive_buffer_nbytes(g: Groups) -> int:
    placement = g.scheduler._placement
    return max(storage.size_hint for storage in placement._device_buffers.exclusive)


@pytest.mark.gpu
def test_a_new_buffer_waits_for_compute_queued_before_it(device):
    """transport.py:AcceleratorTransport.allocate_device -> current_stream().record_event()."""
    audit(lambda point: allocate_over_freed_memory(device, point), ALLOCATION_RECORD)


# -- write-backs: the host reads the master only after the copy ------------------------------------


def edit_then_read_master(device, point, *, detect_edits: bool, hold: str) -> None:
    """a's weight is edited on the device while resident; a is evicted (its change written back)
    and the host reads a's master right away: it must hold the edit.

    hold="copy": the write-back's copy is held until the host waits for it (a removed wait reads
    first).  hold="compute": the edit's kernel is held until the host waits for the write-back,
    and the copy stream runs first (a copy that did not wait for the edit reads the old bytes)."""
    with groups(device, detect_edits=detect_edits) as g:
        g.run("b")
        g.run("a")
        torch.accelerator.synchronize()
        weight = g.models["a"][0].weight
        expected = g.host_copies["a"][0].weight.detach() + 1
        held = g.copy_stream if hold == "copy" else compute_stream()
        drained = () if hold == "copy" else (g.copy_stream,)
        with held_until_host_waits(held, "Transport.to_host_synchronized", drained), point():
            with g.scheduler.resident("a"), torch.no_grad():
                if detect_edits:
                    weight.data.add_(1)  # bytes only: the digests tell
                else:
                    weight.add_(1)  # the version counter tells
            g.scheduler.offload_all()
            assert weight.device.type == "cpu"
            on_host = weight.detach().clone()  # what the host reads right after the eviction
        same(on_host, expected, "a's edited weight in its host master")


@pytest.mark.gpu
def test_the_host_waits_for_written_back_chunks(device):
    """transport.py:DeviceStorage.retire -> Transport.to_host_synchronized, for chunks."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=True, hold="copy"),
          WRITE_BACK_SYNCHRONIZE)


@pytest.mark.gpu
def test_the_host_waits_for_written_back_tensors(device):
    """transport.py:DeviceStorage.retire -> Transport.to_host_synchronized, for tensors."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=False, hold="copy"),
          WRITE_BACK_SYNCHRONIZE)


@pytest.mark.gpu
def test_completion_synchronize_waits_for_the_copy_event(device):
    """transport.py:Completion.synchronize -> event.synchronize() (every caller)."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=False, hold="copy"),
          COPY_EVENT_SYNCHRONIZE)


@pytest.mark.gpu
def test_a_write_back_records_its_end_on_the_copy_stream(device):
    """transport.py:AcceleratorTransport._copy_on_stream -> copy_stream.record_event(), seen by
    a write-back (the event the host waits on)."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=True, hold="copy"),
          COPY_END_RECORD)


@pytest.mark.gpu
def test_a_write_back_waits_for_the_compute_that_edited(device):
    """transport.py:AcceleratorTransport.to_host -> copy_stream.wait_stream(compute).

    With detection off: with it on, reading the digest flags already made the host wait for the
    edit (`test_the_eviction_reads_the_flags_after_the_edit`)."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=False, hold="compute"),
          WRITE_BACK_AFTER_COMPUTE)


# -- the digest flags: read after the kernels that may edit ---------------------------------------


@pytest.mark.gpu
def test_the_eviction_reads_the_flags_after_the_edit(device):
    """digests.py:ChangeDetector.changed_windows -> .tolist() (an implicit host wait)."""
    def scenario(point):
        with groups(device) as g:
            g.run("b")
            g.run("a")
            torch.accelerator.synchronize()
            weight = g.models["a"][0].weight
            expected = g.host_copies["a"][0].weight.detach() + 1
            with held_until_host_waits(compute_stream(), "ChangeDetector.changed_windows"), \
                    point():
                with g.scheduler.resident("a"), torch.no_grad():
                    weight.data.add_(1)
                g.scheduler.offload_all()
            same(weight.detach(), expected, "a's edited weight in its host master")

    audit(scenario, CHANGED_FLAGS)


# -- release: compute in reused memory comes after the copies into it ------------------------------


def copy_in_flight_then_release(device, point) -> None:
    """A copy into a storage's buffer is held (a copy nothing waited on: an abandoned load); the
    storage is released and the compute stream writes a new tensor in the same memory.  The
    copy, landing later, must not overwrite that tensor."""
    transport = AcceleratorTransport(device)
    storage = DeviceStorage(transport)
    nbytes = 64 * 1024
    storage.prepare(nbytes)
    source = torch.full((nbytes,), 5, dtype=torch.uint8, pin_memory=True)
    torch.accelerator.synchronize()
    with simdevice.hold(transport.copy_stream), point():
        transport.to_device([(storage.buffer, source)])
        storage.release()
        reused = torch.empty(nbytes, dtype=torch.uint8, device=device)
        reused.fill_(7)
        drain(compute_stream())
    same(reused, torch.full((nbytes,), 7, dtype=torch.uint8), "the tensor in the released memory")


@pytest.mark.gpu
def test_release_orders_reuse_after_copies_in_flight(device):
    """transport.py:AcceleratorTransport.release -> current_stream().wait_stream(copy_stream)."""
    audit(lambda point: copy_in_flight_then_release(device, point), RELEASE_AFTER_COPIES)


@pytest.mark.gpu
def test_device_storage_release_forwards_to_the_transport(device):
    """transport.py:DeviceStorage.release -> transport.release(buffer)."""
    audit(lambda point: copy_in_flight_then_release(device, point), STORAGE_RELEASE)


# -- a replaced tensor: its comparison is read after the kernel that made it -----------------------

@pytest.mark.gpu
def test_a_replaced_tensor_is_compared_after_it_was_made(device):
    """residency.py:_same_bytes -> .tolist() (an implicit host wait)."""
    def scenario(point):
        with groups(device, detect_edits=False) as g:
            g.run("b")
            g.run("a")
            torch.accelerator.synchronize()
            weight = g.models["a"][0].weight
            expected = g.host_copies["a"][0].weight.detach() * 2
            with held_until_host_waits(compute_stream(), "_same_bytes"), point():
                with g.scheduler.resident("a"), torch.no_grad():
                    weight.data = weight.data * 2  # new storage, new bytes (queued: not made yet)
                g.scheduler.offload_all()
            same(weight.detach(), expected, "a's replaced weight in its host master")

    audit(scenario, SAME_BYTES_FLAGS)


# -- prefetch: a cancelled copy, an edit during the copy -------------------------------------------


def prefetch_then(device, point, *, then: str) -> None:
    """b's copy is started beside a (prefetch) while the copy stream is held, b is edited on the
    host meanwhile, and then either b's phase begins (then="b": the edit is copied again) or
    another group's does (then="c": b's copy is cancelled, and b loads later).  b's output must
    show the edit."""
    models = {"a": mlp(1), "b": mlp(2), "c": mlp(4)}
    edited_b = copy.deepcopy(models["b"])
    with torch.no_grad():
        edited_b[0].weight.add_(1)
    torch.manual_seed(3)
    x = torch.randn(8, WIDTH, device=device)
    expected = {"b": edited_b.to(device)(x).cpu(),
                "c": copy.deepcopy(models["c"]).to(device)(x).cpu()}
    scheduler = Scheduler(device, device_memory_limit=2**30)
    for name, model in models.items():
        scheduler.add(name, model)
    copy_stream = scheduler._transport.copy_stream

    def run(name):
        with scheduler.resident(name), torch.no_grad():
            return models[name](x)

    try:
        for name in ("a", "b", "c", "a"):
            run(name)
        torch.accelerator.synchronize()
        with held_until_host_waits(copy_stream, "Residency.cancel_load"), point():
            with scheduler.resident("a"):
                assert scheduler.prefetch("b")
                with torch.no_grad():
                    models["b"][0].weight.add_(1)  # on the host: b's tensors view its master
            outputs = {then: run(then)}
            drain(compute_stream())
        outputs["b"] = run("b")
        for name, output in outputs.items():
            same(output, expected[name], f"{name}'s output")
    finally:
        torch.accelerator.synchronize()
        scheduler.close()


@pytest.mark.gpu
def test_an_edit_during_a_prefetch_is_copied_again(device):
    """group/residency.py:Residency._recopy_edited waited for the first copy before issuing the second,
    a wait the audit found redundant and removed: the compute stream waits for the second copy's
    completion (in finish_load), which implies the first, since the copy stream runs them in
    order.  b's edited output, with its copy stream held while the phase is queued, shows it."""
    for _ in range(REPEATS):
        prefetch_then(device, contextlib.nullcontext, then="b")


@pytest.mark.gpu
@pytest.mark.harmless_removal
def test_a_cancelled_prefetch_needs_no_wait_on_the_simulated_device(device):
    """group/residency.py:Residency.cancel_load -> completion.synchronize(): harmless here (see the
    table): nothing reads the abandoned copy's destination before a later copy, queued after it
    on the copy stream, overwrites it, and the pinned source is not reused before the copy ran."""
    audit_harmless(lambda point: prefetch_then(device, point, then="c"), CANCEL_SYNCHRONIZE)


@pytest.mark.gpu
@pytest.mark.harmless_removal
def test_a_cancelled_prefetch_needs_no_retire(device):
    """group/residency.py:Residency.cancel_load -> storage.retire(): harmless (see the
    table)."""
    audit_harmless(lambda point: prefetch_then(device, point, then="c"), CANCEL_RETIRE)


# -- releases: the memory goes back to the allocator -----------------------------------------------


def handed_out_again(buffer_ptr: int, nbytes: int, device) -> None:
    """Raise WrongBits unless the allocator hands out the memory at `buffer_ptr` again (it was
    freed: the caching allocator reuses the last block of that size freed on this stream)."""
    probe = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if probe.data_ptr() != buffer_ptr:
        raise WrongBits(f"the released buffer at {buffer_ptr:#x} is still allocated")


def released_at(point, owner, device, release: Callable[[], object]) -> None:
    """Note where `owner`'s device buffer is, let `release()` free it at the audited `point`, and
    raise WrongBits unless the allocator hands that memory out again (`handed_out_again`): after
    the point, or - where `release()` returns a context not entered yet (a phase that frees the
    buffer as it begins) - inside that context."""
    buffer = owner.device_storage.buffer
    ptr, nbytes = buffer.data_ptr(), buffer.numel()
    del buffer, owner
    with point():
        during = release()
        if during is not None:
            with during:
                handed_out_again(ptr, nbytes, device)
            return
    handed_out_again(ptr, nbytes, device)


def released_by(device, point, *, how: str) -> None:
    """A buffer is released by placement (`how`) and its memory must be free again."""
    models = {"m": mlp(1), "t": Tower(2)}
    scheduler = Scheduler(device)
    if how == "remove":
        scheduler.add("m", models["m"], policy="resident")
    else:
        scheduler.add("m", models["m"])
        scheduler.add("t", models["t"], layers=True)
        with scheduler.resident("m"):
            pass
    removed = []  # kept past the check: the caller may keep what remove returns

    def release():
        if how == "remove":
            removed.append(scheduler.remove("m"))
            assert removed[0].device_storage is not None
        elif how == "release_shared":
            scheduler.offload_all()
        else:
            return scheduler.resident("t")  # as it begins, it releases the other mode's buffers
        return None

    try:
        released_at(point, scheduler["m"], device, release)
    finally:
        torch.accelerator.synchronize()
        scheduler.close()


@pytest.mark.gpu
def test_removing_a_resident_group_frees_its_buffer(device):
    """placement.py:Placement.remove -> device_storage.release()."""
    audit(lambda point: released_by(device, point, how="remove"), REMOVE_RELEASE)


@pytest.mark.gpu
def test_offload_all_frees_the_shared_buffers(device):
    """placement.py:DeviceBuffers.release_all -> storage.release() (offload_all)."""
    audit(lambda point: released_by(device, point, how="release_shared"), FREE_ALL_RELEASE)


@pytest.mark.gpu
def test_a_layer_phase_frees_the_module_mode_buffers(device):
    """placement.py:DeviceBuffers.make_room -> storage.release()."""
    audit(lambda point: released_by(device, point, how="other_mode"), MAKE_ROOM_RELEASE)


def released_by_an_auto_plan(device, point, *, how: str) -> None:
    """A storage of an auto plan's part is released by placement (`how`: "part" - a block swapped
    apart, when its group leaves; "own" - an own part in a storage of its own, when its group
    leaves; "replan" - a kept block, when a new plan swaps it; "replan_own" - a kept own part,
    when a new plan swaps it) and its memory must be free again.  The plans are set by hand
    (`Placement.replan`), so the planner's choice does not matter."""
    scheduler = Scheduler(device, auto={"device_budget": 2**30, "headroom": 0})
    scheduler.add("m", mlp(1))
    tower = scheduler.add("t", Tower(2))
    blocks = [name for name in tower.plan.where if name != "t"]
    # The head and the blocks are the same size, and the allocator hands out the block of that
    # size freed last: only the released storages move (the rest is kept), the last is checked.
    kept = {"t": Where.KEPT} | dict.fromkeys(blocks, Where.KEPT)
    plans = {"own": {"t": Where.SWAPPED} | dict.fromkeys(blocks, Where.KEPT),
             "part": {"t": Where.KEPT} | dict.fromkeys(blocks, Where.SWAPPED),
             "replan": kept, "replan_own": kept}
    new_plans = {"replan": plans["part"], "replan_own": plans["own"]}

    def release():
        if how in new_plans:
            with scheduler._lock:
                scheduler._placement.replan(tower, tower.plan.replace(new_plans[how]))
        else:
            with scheduler.resident("m"):
                pass

    try:
        with scheduler._lock:
            scheduler._placement.replan(tower, tower.plan.replace(plans[how]))
        with scheduler.resident("t"):
            pass
        owner = tower if how in ("own", "replan_own") else tower.apart[-1]
        released_at(point, owner, device, release)
    finally:
        torch.accelerator.synchronize()
        scheduler.close()


@pytest.mark.gpu
def test_a_block_swapped_apart_frees_its_storage_when_its_group_leaves(device):
    """mover.py:PartMover.move_out -> part.device_storage.release(), by PartsApart.evict."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="part"), MOVE_OUT_RELEASE)


@pytest.mark.gpu
def test_an_own_part_in_a_storage_of_its_own_frees_it_when_its_group_leaves(device):
    """placement.py:Placement._leave -> group.device_storage.release()."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="own"), OWN_STORAGE_RELEASE)


@pytest.mark.gpu
def test_a_re_plan_frees_the_storage_of_a_block_it_no_longer_keeps(device):
    """mover.py:PartMover.move_out -> part.device_storage.release(), by
    PartsApart.evict_unkept for a part apart."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="replan"), MOVE_OUT_RELEASE)


@pytest.mark.gpu
def test_a_re_plan_frees_the_storage_of_an_own_part_it_no_longer_keeps(device):
    """mover.py:PartMover.move_out -> part.device_storage.release(), by
    PartsApart.evict_unkept for the group's own part."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="replan_own"),
          MOVE_OUT_RELEASE)


def fresh_buffer_beside_an_alias(device, point) -> None:
    """The user keeps a device view of a's weight after a's phase; the next load into that storage
    gets a fresh buffer (the old one is aliased) and must not re-point tensors into the old one."""
    with groups(device) as g:
        g.run("a")
        g.run("b")
        g.run("a")
        kept = g.models["a"][0].weight.detach()  # a view of the shared buffer, kept by the user
        with point():
            output = g.run("b")
        same(output, g.expected["b"], "b's output")
        del kept


@pytest.mark.gpu
def test_a_fresh_buffer_drops_the_views_of_the_old_one(device):
    """transport.py:DeviceStorage.prepare -> self.release()."""
    audit(lambda point: fresh_buffer_beside_an_alias(device, point), FRESH_BUFFER_RELEASE)


# -- implicit host waits: a misfit moved to the host, a comparison on the host, a fingerprint ---


def retyped_then_read_on_the_host(device, point, shift: int) -> None:
    """a's first weight, plus `shift`, is given a new dtype on the device while resident (queued
    on the held compute stream); its eviction moves that misfit to the host as it is, and the host
    reads it at once: it must hold the cast's bytes.  (Each run shifts by another amount: pinned
    memory a removed run reads may be a block an earlier run's copy filled.)"""
    with groups(device, detect_edits=False) as g:
        g.run("b")
        g.run("a")
        torch.accelerator.synchronize()
        weight = g.models["a"][0].weight
        expected = (g.host_copies["a"][0].weight.detach() + shift).half()
        with held_until_host_waits(compute_stream(), "Residency.evict"), point():
            with g.scheduler.resident("a"), torch.no_grad():
                weight.data = (weight.data + shift).half()  # new storage, new dtype: a misfit
            g.scheduler.offload_all()
            assert weight.device.type == "cpu"
            on_host = weight.detach().clone()  # what the host reads right after the eviction
        same(on_host, expected, "a's re-typed weight, moved to the host")


@pytest.mark.gpu
def test_a_misfit_is_on_the_host_before_the_host_reads_it(device):
    """group/residency.py:Residency.evict -> tensors[i].detach().to("cpu") (a blocking copy)."""
    shifts = itertools.count(1)
    audit(lambda point: retyped_then_read_on_the_host(device, point, next(shifts)), MISFIT_TO_HOST)


def replaced_on_the_host_then_compared(device, point) -> None:
    """While a is resident, a kernel edits its first weight's device bytes (queued on the held
    compute stream) and the user then gives that weight new storage on the host (zeros).  The
    eviction compares the new tensor with the device bytes on the host (`_same_bytes`) and must
    write the zeros back."""
    with groups(device, detect_edits=False) as g:
        g.run("b")
        g.run("a")
        torch.accelerator.synchronize()
        weight = g.models["a"][0].weight
        zeros = torch.zeros_like(g.host_copies["a"][0].weight.detach())
        with held_until_host_waits(compute_stream(), "_same_bytes"), point():
            with g.scheduler.resident("a"), torch.no_grad():
                weight.data.add_(1)  # the device bytes, edited (queued: not made yet)
                weight.data = zeros.clone()  # new storage on the host
            g.scheduler.offload_all()
        same(weight.detach(), zeros, "a's new weight in its host master")


@pytest.mark.gpu
def test_a_tensor_moved_to_the_host_is_compared_after_the_device_bytes_were_made(device):
    """residency.py:_same_bytes -> the device view's .cpu() (its second `cpu`; an implicit host
    wait).  Removed, the host compares with whatever the pinned memory held: here bytes equal to
    the new tensor's, so the change is taken for none."""
    audit(lambda point: replaced_on_the_host_then_compared(device, point), SAME_BYTES_ON_HOST)


@pytest.mark.gpu
def test_a_fingerprint_reads_the_digests_after_the_kernels_that_made_them(device):
    """agreement.py:_fingerprints -> .cpu() (an implicit host wait): the ranks sharing a master
    compare fingerprints of their changed device bytes before one of them writes
    (`digest_ranges`); driven directly, as multi-rank tests run gloo on the CPU."""
    nbytes = 64 * 1024
    expected = digest_ranges(torch.full((nbytes,), 3, dtype=torch.uint8), [(0, nbytes)])

    def scenario(point):
        buffer = torch.full((nbytes,), 2, dtype=torch.uint8, device=device)
        torch.accelerator.synchronize()
        with held_until_host_waits(compute_stream(), "_fingerprints"), point():
            buffer.add_(1)  # queued on the held compute stream
            fingerprint = digest_ranges(buffer, [(0, nbytes)])
        if fingerprint != expected:
            raise WrongBits("the fingerprint of the edited device bytes differs from theirs on "
                            "the host")

    audit(scenario, FINGERPRINT_DIGESTS)


# -- the table stays whole, and each row's test removes its call ---------------------------------

TABLE_HEADING = "### Synchronisation audit"
_ROW = re.compile(r"^\|\s*`(?P<file>[\w/]+\.py):(?P<function>[\w.<>]+)`\s*\|\s*`(?P<call>\w+)`"
                  r"\s*#(?P<place>\d+)\s*\|(?P<orders>[^|]*)\|(?P<removal>[^|]*)\|(?P<test>[^|]*)"
                  r"\|(?P<failures>[^|]*)\|\s*$")


def table_rows() -> dict[tuple[str, str, str, int], dict[str, str]]:
    """(file, function, call, place) -> the row's cells, from docs/design.md's audit table."""
    text = (ROOT / "docs" / "design.md").read_text()
    assert TABLE_HEADING in text, f"docs/design.md has no {TABLE_HEADING!r} section"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line.strip())
        if match:
            key = (match["file"], match["function"], match["call"], int(match["place"]))
            assert key not in rows, f"two rows for {key}"
            rows[key] = {cell: match[cell].strip() for cell in ("removal", "test", "failures")}
    return rows


def audits_in_this_file() -> dict[str, tuple[str, list[Site]]]:
    """Test name -> ("audit" or "harmless", the sites it removes), read from this file: the
    `audit(...)` / `audit_harmless(...)` calls in each test and the `Site` constants they pass."""
    found = {}
    for node in ast.parse(Path(__file__).read_text()).body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in (
                    "audit", "audit_harmless") and len(call.args) == 2:
                kind = "audit" if call.func.id == "audit" else "harmless"
                site = globals()[call.args[1].id]
                assert isinstance(site, Site), f"{node.name} passes {call.args[1].id}, not a Site"
                known_kind, sites = found.setdefault(node.name, (kind, []))
                assert known_kind == kind, f"{node.name} both audits and shows harmless"
                sites.append(site)
    return found


def _marked_harmless(test: Callable) -> bool:
    return any(mark.name == "harmless_removal" for mark in getattr(test, "pytestmark", []))


def test_every_ordering_call_has_a_row():
    calls, rows = ordering_calls(), table_rows()
    missing = [f"{file}:{line}: `{call}` #{place} in {function}; add the row\n"
               f"    | `{file}:{function}` | `{call}` #{place} | <what it orders> | <removal> | "
               f"<the test in tests/test_sync_audit.py that fails without it, or why none can> "
               f"| <failures of 20> |"
               for (file, function, call, place), line in sorted(calls.items())
               if (file, function, call, place) not in rows]
    assert not missing, (
        "ordering calls with no row in the \"Synchronisation audit\" table of docs/design.md "
        "(section \"Streams (accelerators)\"):\n  " + "\n  ".join(missing))
    stale = [f"{file}:{function} `{call}` #{place}" for (file, function, call, place)
             in sorted(rows) if (file, function, call, place) not in calls]
    assert not stale, ("rows of docs/design.md's \"Synchronisation audit\" table name calls the "
                       "source no longer makes (or at another place); update them:\n  "
                       + "\n  ".join(stale))


@pytest.mark.fast
def test_each_row_names_the_test_that_removes_it():
    """A row's tests remove that very call (an audit: it fails 20 of 20 removed; an experiment
    marked harmless_removal: right bits either way), with the removal the row states; a row with
    no test says why; every site a test removes has its row."""
    rows, audits = table_rows(), audits_in_this_file()
    defined = {node.name for node in ast.parse(Path(__file__).read_text()).body
               if isinstance(node, ast.FunctionDef)}
    problems = []
    for key, row in sorted(rows.items()):
        named = re.findall(r"`(test_\w+)`", row["test"])
        problems += [f"{key}: names {name}, which does not exist" for name in named
                     if name not in defined]
        removing = [name for name in named
                    if any(site.key == key for site in audits.get(name, ("", []))[1])]
        problems += [f"{key}: names {name}, which does not remove this call" for name in named
                     if name in defined and name not in removing]
        if not named and not row["test"].startswith(("not ", "harmless")):
            problems.append(f"{key}: no test, and no reason (start it with 'not ...')")
        for name in removing:
            site = next(s for s in audits[name][1] if s.key == key)
            if row["removal"] != site.removal:
                problems.append(f"{key}: the removal column says {row['removal']!r}; "
                                f"{name} removes it as {site.removal!r}")
    for name, (kind, sites) in sorted(audits.items()):
        problems += [f"{name} removes {site}, whose row does not name it" for site in sites
                     if name not in re.findall(r"`(test_\w+)`",
                                               rows.get(site.key, {}).get("test", ""))]
        if _marked_harmless(globals()[name]) != (kind == "harmless"):
            problems.append(f"{name}: an audit_harmless experiment is marked harmless_removal, "
                            "an audit is not")
    assert not problems, "\n".join(problems)


def test_each_removal_replaces_exactly_one_node_of_the_source_as_loaded():
    """Every site a test removes rewrites (on any machine: nothing runs) to code that differs
    from the function's, from the source the function was loaded from."""
    sites = {site.key: site for _, found in audits_in_this_file().values() for site in found}
    assert sites
    for site in sites.values():
        live, code = removed_code(site)
        assert bytecode(code) != bytecode(live.__code__), f"{site}: the rewrite changed nothing"
        assert code.co_qualname == live.__code__.co_qualname


@pytest.mark.fast
def test_a_removal_takes_out_the_one_call_for_the_block_only():
    """On the CPU: with `DeviceBuffers.release_all`'s release removed, offload_all keeps the buffer;
    outside the block it frees it again."""
    def buffer_after_offload_all():
        scheduler = Scheduler("cpu")
        scheduler.add("m", mlp(1))
        with scheduler.resident("m"):
            pass
        scheduler.offload_all()
        kept = scheduler["m"].device_storage.buffer is not None
        scheduler.close()
        return kept

    with pytest.MonkeyPatch.context() as patch:
        remove_at(patch, FREE_ALL_RELEASE)
        assert buffer_after_offload_all()
    assert not buffer_after_offload_all()


@pytest.mark.fast
def test_places_count_the_calls_of_a_name_in_one_function_in_source_order():
    tree = ast.parse("def f(s):\n    s.release(); s.wait()\n    def g():\n        s.release()\n"
                     "    s.release(s.tolist())\n    s.copy_(s, non_blocking=True)\n"
                     "    s.copy_(s)\n")
    assert {key: call.lineno for key, (call, _) in call_sites(tree, "x.py").items()} == {
        ("x.py", "f", "release", 1): 2, ("x.py", "f", "wait", 1): 2,
        ("x.py", "f.g", "release", 1): 4, ("x.py", "f", "release", 2): 5,
        ("x.py", "f", "tolist", 1): 5, ("x.py", "f", "copy_", 1): 7}


@pytest.mark.fast
def test_a_site_that_is_not_in_the_source_is_refused_by_name():
    with pytest.raises(LookupError, match=r"PartMover.move_out `release` #2: no such call"):
        removed_code(Site(_MOVER, "PartMover.move_out", "release", 2))
