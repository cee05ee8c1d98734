"""The synchronisation audit (issue 19): every ordering point of the library, and a test that fails
when that one point is removed.

docs/design.md, "Synchronisation audit", is the table: each ordering call in residency/ (file, enclosing function, call) -> the test below that catches its removal, or why
none can.  `test_every_ordering_call_has_a_row` reads the package's source and keeps the table
whole.

[Note: how a point is removed, and how a race is made certain]
A point is removed for one caller only: `remove_call` wraps the method so that a call coming from
the named function does what the point would do without its ordering (usually nothing) and every
other call goes through.  A run with the point removed must give wrong bits (an output differing
from the never-offloaded model's, an edit missing from the host master, a host read of bytes not
written yet); a run with it kept must give the right ones.  The race is not left to timing: the
simulated device's worker hold stops the stream that would otherwise win (`simdevice.hold`), and
the other stream is let run first as far as it can (`drain`).  Where the host itself must wait for
the held stream (a write-back's `Completion.synchronize`), `held_until_host_waits` releases the
hold once the main thread is inside that wait, so a kept run does not deadlock and a removed run
(which never waits there) reads the host master while the stream is still held.

`drain` cannot tell a stream that waits on held work (the kept run) from a slow one, so it gives
up after `DRAIN_S`; that bound only costs kept runs time: a removed run's stream has nothing to
wait for.

Each test runs its scenario `REPEATS` times kept and `REPEATS` times removed (2 in CI);
``RESIDENCY_AUDIT_REPEATS=20`` runs the acceptance check (20 of 20 failures removed, 20 of 20 passes
kept).  The scenarios need the worker hold, so they run on the simulated device only.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from residency import Scheduler
from residency.engine.digests import ChangeDetector
from residency.engine.memory import DeviceStorage
from residency.engine.plan import Where
from residency.engine.transport import AcceleratorTransport, Completion, Transport

import simdevice
from _accelerator import device as accelerator_device, is_simulated

ROOT = Path(__file__).resolve().parent.parent
REPEATS = int(os.environ.get("RESIDENCY_AUDIT_REPEATS", "2"))
#: How long `drain` lets a stream run before it takes it for blocked (see the module note).
DRAIN_S = 0.25
#: A host wait on a held stream fails after this (a harness bug, never a result).
WAIT_TIMEOUT_S = 30.0
WIDTH = 64

_SYNCHRONIZE = Completion.synchronize.__code__
_CHANGED_WINDOWS = ChangeDetector.changed_windows.__code__


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


def remove_call(monkeypatch, owner, name: str, caller: str | None,
                instead: Callable | None = None) -> None:
    """Remove the ordering `owner.name` performs for calls made from function `caller` (None: from
    every caller): such a call runs `instead` (default: nothing); every other call goes through."""
    original = owner.__dict__[name]

    def audited(*args, **kwargs):
        if caller is None or sys._getframe(1).f_code.co_name == caller:
            return None if instead is None else instead(*args, **kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, audited)


def remove_stream_call(monkeypatch, name: str, caller: str) -> None:
    """Remove the call of `name` on the copy stream (a torch.Stream) that transport method
    `caller` makes: while `caller` runs, the transport sees its copy stream through a subclass
    of torch.Stream that skips that call (the same stream: same id, same worker)."""
    def skipped(self, *args, **kwargs):
        if sys._getframe(1).f_code.co_name == caller:
            return None
        return getattr(torch.Stream, name)(self, *args, **kwargs)

    audited_type = type("AuditedStream", (torch.Stream,), {name: skipped})
    original = AcceleratorTransport.__dict__[caller]

    def audited_caller(self, *args, **kwargs):
        stream = self.copy_stream
        self.copy_stream = audited_type(stream_id=stream.stream_id,
                                        device_index=stream.device_index,
                                        device_type=stream.device_type)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.copy_stream = stream

    monkeypatch.setattr(AcceleratorTransport, caller, audited_caller)


def drain(stream: torch.Stream, within: float = DRAIN_S) -> bool:
    """Let `stream` run what it can (at most `within` seconds); True when it has nothing left."""
    deadline = time.monotonic() + within
    while not stream.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


@contextlib.contextmanager
def held_until_host_waits(stream: torch.Stream, waiting_in, caller: str, drained=()):
    """Hold `stream` until the main thread is inside `waiting_in` (a code object) called, at some
    depth, from function `caller` - a host wait that needs the stream - then let each of `drained`
    run what it can and release the hold.  Without that wait, the hold lasts the whole block."""
    main = threading.get_ident()
    finished = threading.Event()
    holding = contextlib.ExitStack()
    holding.enter_context(simdevice.hold(stream))

    def waiting() -> bool:
        frame, inside = sys._current_frames().get(main), False
        while frame is not None:
            inside = inside or frame.f_code is waiting_in
            if inside and frame.f_code.co_name == caller:
                return True
            frame = frame.f_back
        return False

    def watch() -> None:
        while not finished.is_set():
            if waiting():
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
        watcher.join()
        holding.close()


def audit_not_caught(scenario: Callable, remove: Callable) -> None:
    """The experiment for a point no test catches: `scenario(point)` gives the right bits in every
    run, the point kept or removed.  Fails the day the point becomes needed there (then it needs
    a row with a real test)."""
    for remover in (None, remove):
        for _ in range(REPEATS):
            try:
                scenario(_point(remover))
            finally:
                torch.accelerator.synchronize()


def audit(scenario: Callable, remove: Callable) -> None:
    """Run `scenario(point)` REPEATS times with the point kept and REPEATS times with it removed:
    the scenario does its racy step inside ``with point():``, where a removed run has the point
    taken out (by `remove(monkeypatch)`; set-up and checks run unpatched).  Every kept run must
    pass, every removed run must see wrong bits."""
    wrong = {"kept": [], "removed": []}
    for way in ("kept", "removed"):
        for _ in range(REPEATS):
            try:
                scenario(_point(remove if way == "removed" else None))
            except WrongBits as failure:
                wrong[way].append(str(failure))
            finally:
                torch.accelerator.synchronize()
    assert not wrong["kept"], f"with the point kept, {len(wrong['kept'])} of {REPEATS} runs " \
                              f"saw wrong bits: {wrong['kept'][0]}"
    assert len(wrong["removed"]) == REPEATS, (
        f"with the point removed, only {len(wrong['removed'])} of {REPEATS} runs saw wrong bits: "
        "the test does not catch its removal")


def _point(remove: Callable | None):
    @contextlib.contextmanager
    def point():
        with pytest.MonkeyPatch.context() as patch:
            if remove is not None:
                remove(patch)
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


def _eventless(original):
    def issue_without_event(self, pairs):
        original(self, pairs)
        return Completion()
    return issue_without_event


@pytest.mark.gpu
def test_a_phase_waits_for_its_load(device):
    """component.py:Residency._finish_load -> Completion.wait()."""
    audit(lambda point: load_then_compute(device, point),
          lambda patch: remove_call(patch, Completion, "wait", "_finish_load"))


@pytest.mark.gpu
def test_the_compute_stream_waits_on_the_load_event(device):
    """transport.py:Completion.wait -> wait_event (every caller)."""
    audit(lambda point: load_then_compute(device, point),
          lambda patch: remove_call(patch, Completion, "wait", None))


@pytest.mark.gpu
def test_a_load_records_its_end_on_the_copy_stream(device):
    """transport.py:AcceleratorTransport.to_device -> copy_stream.record_event()."""
    original = AcceleratorTransport.to_device
    audit(lambda point: load_then_compute(device, point),
          lambda patch: remove_call(patch, AcceleratorTransport, "to_device", "_begin_load",
                                    instead=_eventless(original)))


@pytest.mark.gpu
def test_a_streamed_block_waits_for_its_copy(device):
    """Layer mode: BlockStream._park -> Residency._finish_load -> Completion.wait()."""
    audit(lambda point: load_then_compute(device, point, layers=True),
          lambda patch: remove_call(patch, Completion, "wait", "_finish_load"))


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


def _forget_retired(self, destination):
    self._retired.pop(destination.untyped_storage().data_ptr(), None)


@pytest.mark.gpu
def test_an_eviction_retires_its_buffer(device):
    """component.py:Residency._leave_device -> transport.retire(buffer)."""
    audit(lambda point: evict_then_overwrite(device, point),
          lambda patch: remove_call(patch, AcceleratorTransport, "retire", "_leave_device"))


@pytest.mark.gpu
def test_retire_records_on_the_compute_stream(device):
    """transport.py:AcceleratorTransport.retire -> current_stream().record_event()."""
    audit(lambda point: evict_then_overwrite(device, point),
          lambda patch: remove_call(patch, AcceleratorTransport, "retire", None))


@pytest.mark.gpu
def test_a_copy_into_a_retired_buffer_waits(device):
    """transport.py:AcceleratorTransport._wait_retired -> copy_stream.wait_event(retired)."""
    audit(lambda point: evict_then_overwrite(device, point),
          lambda patch: remove_call(patch, AcceleratorTransport, "_wait_retired", "to_device",
                                    instead=_forget_retired))


@pytest.mark.gpu
def test_a_slot_is_not_overwritten_under_the_block_that_read_it(device):
    """Layer mode: BlockStream._evict -> SlotPlacement.evict -> Residency._evict ->
    transport.retire(slot buffer)."""
    audit(lambda point: evict_then_overwrite(device, point, layers=True),
          lambda patch: remove_call(patch, AcceleratorTransport, "retire", "_leave_device"))


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
    return max(storage.size_hint for storage in placement._buffers.exclusive)


@pytest.mark.gpu
def test_a_new_buffer_waits_for_compute_queued_before_it(device):
    """transport.py:AcceleratorTransport.allocate_device -> current_stream().record_event()."""
    audit(lambda point: allocate_over_freed_memory(device, point),
          # DeviceStorage.prepare allocates through `in_context` (one line: see residency.engine.locks),
          # the only caller of allocate_device there is.
          lambda patch: remove_call(patch, AcceleratorTransport, "allocate_device", "in_context",
                                    instead=Transport.allocate_device))


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
        caller = "_copy_to_master"
        held = g.copy_stream if hold == "copy" else compute_stream()
        drained = () if hold == "copy" else (g.copy_stream,)
        with held_until_host_waits(held, _SYNCHRONIZE, caller, drained), point():
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
    """write_back.py:_copy_to_master -> to_host(...).synchronize(), for chunks."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=True, hold="copy"),
          lambda patch: remove_call(patch, Completion, "synchronize", "_copy_to_master"))


@pytest.mark.gpu
def test_the_host_waits_for_written_back_tensors(device):
    """write_back.py:_copy_to_master -> to_host(...).synchronize(), for tensors."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=False, hold="copy"),
          lambda patch: remove_call(patch, Completion, "synchronize", "_copy_to_master"))


@pytest.mark.gpu
def test_completion_synchronize_waits_for_the_copy_event(device):
    """transport.py:Completion.synchronize -> event.synchronize() (every caller)."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=False, hold="copy"),
          lambda patch: remove_call(patch, Completion, "synchronize", None))


@pytest.mark.gpu
def test_a_write_back_records_its_end_on_the_copy_stream(device):
    """transport.py:AcceleratorTransport.to_host -> copy_stream.record_event()."""
    original = AcceleratorTransport.to_host
    audit(lambda point: edit_then_read_master(device, point, detect_edits=True, hold="copy"),
          lambda patch: remove_call(patch, AcceleratorTransport, "to_host", "_copy_to_master",
                                    instead=_eventless(original)))


@pytest.mark.gpu
def test_a_write_back_waits_for_the_compute_that_edited(device):
    """transport.py:AcceleratorTransport.to_host -> copy_stream.wait_stream(compute).

    With detection off: with it on, reading the digest flags already made the host wait for the
    edit (`test_the_eviction_reads_the_flags_after_the_edit`)."""
    audit(lambda point: edit_then_read_master(device, point, detect_edits=False, hold="compute"),
          lambda patch: remove_stream_call(patch, "wait_stream", "to_host"))


# -- the digest flags: read after the kernels that may edit ---------------------------------------


def _flags_read_without_waiting(self, buffer_bytes):
    """changed_windows as it would be if its read did not wait: the flags copied into host memory
    without a host wait, and read at once."""
    from residency.engine.digests import _merged_ranges

    flags = self.changed_flags(buffer_bytes)
    on_host = torch.zeros(flags.shape, dtype=torch.bool, pin_memory=True)
    on_host.copy_(flags, non_blocking=True)
    return _merged_ranges(on_host.tolist(), self._layout.window_nbytes, self._nbytes)


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
            with held_until_host_waits(compute_stream(), _CHANGED_WINDOWS, "_write_back_edits"), \
                    point():
                with g.scheduler.resident("a"), torch.no_grad():
                    weight.data.add_(1)
                g.scheduler.offload_all()
            same(weight.detach(), expected, "a's edited weight in its host master")

    audit(scenario, lambda patch: patch.setattr(ChangeDetector, "changed_windows",
                                                _flags_read_without_waiting))


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


def _forget_only(self, storage):
    self._retired.pop(storage.untyped_storage().data_ptr(), None)


@pytest.mark.gpu
def test_release_orders_reuse_after_copies_in_flight(device):
    """transport.py:AcceleratorTransport.release -> current_stream().wait_stream(copy_stream)."""
    audit(lambda point: copy_in_flight_then_release(device, point),
          lambda patch: remove_call(patch, AcceleratorTransport, "release", None,
                                    instead=_forget_only))


@pytest.mark.gpu
def test_device_storage_release_forwards_to_the_transport(device):
    """memory.py:DeviceStorage.release -> transport.release(buffer)."""
    audit(lambda point: copy_in_flight_then_release(device, point),
          lambda patch: remove_call(patch, AcceleratorTransport, "release", "release"))


# -- the table stays whole -------------------------------------------------------------------------

#: Calls that order work between streams or between the host and the device.
ORDERING_CALLS = frozenset({
    "wait_event", "wait_stream", "record_event", "record_stream", "record", "synchronize",
    "retire", "release", "wait", "tolist", "item",
})
TABLE_HEADING = "### Synchronisation audit"
_ROW = re.compile(r"^\|\s*`(?P<file>[\w/]+\.py):(?P<function>[\w.]+)`\s*\|\s*`(?P<call>\w+)`\s*\|"
                  r"(?P<orders>[^|]*)\|(?P<test>[^|]*)\|\s*$")


def ordering_calls() -> dict[tuple[str, str, str], int]:
    """(file, enclosing Class.function, call name) -> first line, for every ordering call."""
    found: dict[tuple[str, str, str], int] = {}
    for path in sorted(ROOT.glob("residency/**/*.py")):
        relative = path.relative_to(ROOT).as_posix()
        _visit(ast.parse(path.read_text(), relative), relative, [], found)
    return found


def _visit(node: ast.AST, relative: str, scope: list[str], found: dict) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _visit(child, relative, [*scope, child.name], found)
            continue
        if isinstance(child, ast.Call):
            func = child.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ORDERING_CALLS:
                key = (relative, ".".join(scope) or "<module>", name)
                found.setdefault(key, child.lineno)
        _visit(child, relative, scope, found)


def table_rows() -> dict[tuple[str, str, str], str]:
    """(file, function, call) -> the row's test column, from docs/design.md's audit table."""
    text = (ROOT / "docs" / "design.md").read_text()
    assert TABLE_HEADING in text, f"docs/design.md has no {TABLE_HEADING!r} section"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line.strip())
        if match:
            rows[(match["file"], match["function"], match["call"])] = match["test"].strip()
    return rows


def test_every_ordering_call_has_a_row():
    calls, rows = ordering_calls(), table_rows()
    missing = [f"{file}:{line}: `{call}` in {function}; add the row\n"
               f"    | `{file}:{function}` | `{call}` | <what it orders> | <the test in "
               f"tests/test_sync_audit.py that fails without it, or why none can> |"
               for (file, function, call), line in sorted(calls.items())
               if (file, function, call) not in rows]
    assert not missing, (
        "ordering calls with no row in the \"Synchronisation audit\" table of docs/design.md "
        "(section \"Streams (accelerators)\"):\n  " + "\n  ".join(missing))
    stale = [f"{file}:{function} `{call}`" for (file, function, call) in sorted(rows)
             if (file, function, call) not in calls]
    assert not stale, ("rows of docs/design.md's \"Synchronisation audit\" table name calls the "
                       "source no longer makes; remove or update them:\n  " + "\n  ".join(stale))


def test_every_test_the_table_names_exists():
    defined = {node.name for node in ast.parse(Path(__file__).read_text()).body
               if isinstance(node, ast.FunctionDef)}
    named = {name for test in table_rows().values() for name in re.findall(r"`(test_\w+)`", test)}
    assert named, "the audit table names no test"
    unknown = sorted(named - defined)
    assert not unknown, f"the audit table names tests that do not exist: {unknown}"


# -- a replaced tensor: its comparison is read after the kernel that made it -----------------------

def _flags_without_waiting(pairs):
    """write_back._same_bytes as it would be if its read did not wait for the comparison: the
    host sees what the flag memory held before (here an earlier answer, "same")."""
    from residency.engine.write_back import _as_bytes

    flags = torch.stack([(_as_bytes(a) == _as_bytes(b)).all() for a, b in pairs])
    on_host = torch.ones(flags.shape, dtype=torch.bool, pin_memory=True)
    on_host.copy_(flags, non_blocking=True)
    return on_host.tolist()


@pytest.mark.gpu
def test_a_replaced_tensor_is_compared_after_it_was_made(device):
    """write_back.py:_same_bytes -> .tolist() (an implicit host wait)."""
    from residency.engine import write_back

    def scenario(point):
        with groups(device, detect_edits=False) as g:
            g.run("b")
            g.run("a")
            torch.accelerator.synchronize()
            weight = g.models["a"][0].weight
            expected = g.host_copies["a"][0].weight.detach() * 2
            with held_until_host_waits(compute_stream(), write_back._same_bytes.__code__,
                                       "_write_back_replaced"), point():
                with g.scheduler.resident("a"), torch.no_grad():
                    weight.data = weight.data * 2  # new storage, new bytes (queued: not made yet)
                g.scheduler.offload_all()
            same(weight.detach(), expected, "a's replaced weight in its host master")

    audit(scenario, lambda patch: patch.setattr(write_back, "_same_bytes", _flags_without_waiting))


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
        with held_until_host_waits(copy_stream, _SYNCHRONIZE, "_cancel_load"), point():
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
    """component.py:Residency._recopy_edited waited for the first copy before issuing the second,
    a wait the audit found redundant and removed: the compute stream waits for the second copy's
    completion (in _finish_load), which implies the first, since the copy stream runs them in
    order.  b's edited output, with its copy stream held while the phase is queued, shows it."""
    for _ in range(REPEATS):
        prefetch_then(device, contextlib.nullcontext, then="b")


@pytest.mark.gpu
def test_a_cancelled_prefetch_needs_no_wait_on_the_simulated_device(device):
    """component.py:Residency._cancel_load -> completion.synchronize(): not caught here (see the
    table): nothing reads the abandoned copy's destination before a later copy, queued after it
    on the copy stream, overwrites it, and the pinned source is not reused before the copy ran."""
    audit_not_caught(lambda point: prefetch_then(device, point, then="c"),
                     lambda patch: remove_call(patch, Completion, "synchronize", "_cancel_load"))


@pytest.mark.gpu
def test_a_cancelled_prefetch_needs_no_retire(device):
    """component.py:Residency._cancel_load -> transport.retire(buffer): not caught (see the
    table)."""
    audit_not_caught(lambda point: prefetch_then(device, point, then="c"),
                     lambda patch: remove_call(patch, AcceleratorTransport, "retire",
                                               "_cancel_load"))


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
    if how == "withdraw":
        scheduler.add("m", models["m"], policy="resident")
    else:
        scheduler.add("m", models["m"])
        scheduler.add("t", models["t"], layers=True)
        with scheduler.resident("m"):
            pass
    removed = []  # kept past the check: the caller may keep what remove returns

    def release():
        if how == "withdraw":
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
    """placement.py:Placement.withdraw -> device_storage.release()."""
    audit(lambda point: released_by(device, point, how="withdraw"),
          lambda patch: remove_call(patch, DeviceStorage, "release", "_withdraw"))


@pytest.mark.gpu
def test_offload_all_frees_the_shared_buffers(device):
    """buffers.py:DeviceBuffers.free_all -> storage.release() (offload_all)."""
    audit(lambda point: released_by(device, point, how="release_shared"),
          lambda patch: remove_call(patch, DeviceStorage, "release", "free_all"))


@pytest.mark.gpu
def test_a_layer_phase_frees_the_module_mode_buffers(device):
    """buffers.py:DeviceBuffers.make_room -> storage.release()."""
    audit(lambda point: released_by(device, point, how="other_mode"),
          lambda patch: remove_call(patch, DeviceStorage, "release", "make_room"))


def released_by_an_auto_plan(device, point, *, how: str) -> None:
    """A storage of an auto plan's part is released by placement (`how`: "part" - a block swapped
    apart, when its group leaves; "own" - an own part in a storage of its own, when its group
    leaves; "replan" - a kept block, when a new plan swaps it) and its memory must be free again.
    The plans are set by hand (`Placement.replan`), so the planner's choice does not matter."""
    scheduler = Scheduler(device, auto={"device_budget": 2**30, "headroom": 0})
    scheduler.add("m", mlp(1))
    tower = scheduler.add("t", Tower(2))
    blocks = [name for name in tower.plan.where if name != "t"]
    # The head and the blocks are the same size, and the allocator hands out the block of that
    # size freed last: only the released storages move (the rest is kept), the last is checked.
    plans = {"own": {"t": Where.SWAPPED} | dict.fromkeys(blocks, Where.KEPT),
             "part": {"t": Where.KEPT} | dict.fromkeys(blocks, Where.SWAPPED),
             "replan": {"t": Where.KEPT} | dict.fromkeys(blocks, Where.KEPT)}

    def release():
        if how == "replan":
            with scheduler._lock:
                scheduler._placement.replan(tower, tower.plan.replace(plans["part"]))
        else:
            with scheduler.resident("m"):
                pass

    try:
        with scheduler._lock:
            scheduler._placement.replan(tower, tower.plan.replace(plans[how]))
        with scheduler.resident("t"):
            pass
        released_at(point, tower if how == "own" else tower.apart[-1], device, release)
    finally:
        torch.accelerator.synchronize()
        scheduler.close()


@pytest.mark.gpu
def test_a_block_swapped_apart_frees_its_storage_when_its_group_leaves(device):
    """apart.py:PartsApart.evict -> part.device_storage.release()."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="part"),
          lambda patch: remove_call(patch, DeviceStorage, "release", "evict"))


@pytest.mark.gpu
def test_an_own_part_in_a_storage_of_its_own_frees_it_when_its_group_leaves(device):
    """placement.py:Placement._leave -> group.device_storage.release()."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="own"),
          lambda patch: remove_call(patch, DeviceStorage, "release", "_leave"))


@pytest.mark.gpu
def test_a_re_plan_frees_the_storage_of_a_block_it_no_longer_keeps(device):
    """apart.py:PartsApart.drop_unkept -> part.device_storage.release()."""
    audit(lambda point: released_by_an_auto_plan(device, point, how="replan"),
          lambda patch: remove_call(patch, DeviceStorage, "release", "drop_unkept"))


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
    """memory.py:DeviceStorage.prepare -> self.release()."""
    audit(lambda point: fresh_buffer_beside_an_alias(device, point),
          lambda patch: remove_call(patch, DeviceStorage, "release", "prepare"))
