"""The simulated asynchronous accelerator ("sim"), for tests and benchmarks only.

Loading it renames PrivateUse1 to ``sim`` for the whole process and makes it the process's
accelerator, so load it only in a process that runs accelerator tests (see README.md here)::

    from tests import simdevice
    device = simdevice.load(asynchronous=True, compute_delay=0.001)   # torch.device("sim:0")
    with simdevice.controls(copy_bandwidth=1e9):
        ...
    copy_stream = torch.Stream("sim")
    with simdevice.hold(copy_stream):        # its worker starts nothing until the block exits
        ...
    before = simdevice.host_syncs()

Controls (all readable with ``get_controls()``; README.md gives defaults):
  asynchronous    ops return before they ran          compute_delay   seconds added per queued op
  copy_bandwidth  bytes/s a host<->device copy moves (0: instant)      copy_delay  seconds added to each copy
  device_copy_bandwidth  bytes/s a copy within the device moves (0: instant)
  protect         host access to device -> SIGSEGV    memory_info     get_memory_info answers
  capacity        bytes the allocator may reserve     wait_timeout    a longer host wait raises
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "SimBuildError",
    "load",
    "controls",
    "get_controls",
    "hold",
    "host_syncs",
    "count_host_syncs",
    "waiting_threads",
    "pinned_bytes",
    "is_device_pointer",
    "busy",
]

_HERE = Path(__file__).resolve().parent
_BUILD_DIR = _HERE / "build"
_CONTROL_NAMES = (
    "copy_bandwidth",
    "device_copy_bandwidth",
    "copy_delay",
    "compute_delay",
    "protect",
    "asynchronous",
    "memory_info",
    "capacity",
    "wait_timeout",
)
_BOOL_CONTROLS = {"protect", "asynchronous", "memory_info"}
_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1
_lock = threading.Lock()
_extension = None  # the loaded C++ module; set once by load()


class SimBuildError(RuntimeError):
    """The simulator's C++ extension did not build; the message carries the compiler's output."""


def _build():
    from torch.utils import cpp_extension

    _BUILD_DIR.mkdir(exist_ok=True)
    try:
        return cpp_extension.load(
            name="residency_simdevice",
            sources=[str(_HERE / "sim.cpp")],
            build_directory=str(_BUILD_DIR),
            extra_cflags=["-O2"],
            verbose=False,
        )
    except Exception as error:  # the build's error type varies; its text is what matters
        raise SimBuildError(f"the simulated device did not build: {error}") from error


def _device_module(ext) -> types.ModuleType:
    """What torch.sim must offer for torch.accelerator, torch.Stream and generated methods."""
    module = types.ModuleType("torch.sim")
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module._is_in_bad_fork = lambda: False
    module.is_initialized = lambda: True
    module._lazy_init = lambda: None
    # sim ops draw from the CPU generator, which torch.manual_seed seeds
    module.manual_seed = module.manual_seed_all = lambda seed: None

    def set_device(device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise ValueError(f"sim has one device, sim:0; got {device}")

    module.set_device = set_device
    module.synchronize = lambda device=None: torch.accelerator.synchronize()
    module.current_stream = lambda device=None: torch.accelerator.current_stream()
    module.default_stream = lambda device=None: torch.Stream(
        stream_id=0, device_index=0, device_type=_PRIVATEUSE1
    )
    module.Stream = torch.Stream
    module.stream = _stream_context  # torch.cuda.stream's form (diffusers' group offloading)
    module.Event = torch.Event
    module.empty_cache = ext.empty_cache
    module.memory_allocated = lambda device=None: torch.accelerator.memory_allocated()
    module.memory_reserved = lambda device=None: torch.accelerator.memory_reserved()
    module.max_memory_allocated = lambda device=None: torch.accelerator.max_memory_allocated()
    module.mem_get_info = lambda device=None: torch.accelerator.get_memory_info()
    return module


@contextlib.contextmanager
def _stream_context(stream: torch.Stream | None) -> Iterator[None]:
    """Make `stream` current for the block (None: no-op), restoring the previous one, as
    ``torch.cuda.stream`` does; a fresh context per call, so nesting is safe."""
    if stream is None:
        yield
        return
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def load(**initial_controls) -> torch.device:
    """Build (cached in tests/simdevice/build/), load, return ``torch.device("sim:0")``.

    Idempotent: a second call only applies its controls. Raises SimBuildError with the compiler's
    message when the extension does not build::

        device = simdevice.load(asynchronous=True)
    """
    global _extension
    with _lock:
        if _extension is None:
            ext = _build()
            ext.route_cpu_kernels()
            torch.utils.rename_privateuse1_backend("sim")
            torch._register_device_module("sim", _device_module(ext))
            torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
            _extension = ext
    _set(initial_controls)
    return torch.device("sim", 0)


def _ext():
    if _extension is None:
        raise RuntimeError("the simulated device is not loaded: call simdevice.load() first")
    return _extension


def get_controls() -> dict[str, float | bool]:
    """The current value of every control."""
    ext = _ext()
    return {name: (bool(ext.get_control(name)) if name in _BOOL_CONTROLS else ext.get_control(name))
            for name in _CONTROL_NAMES}


def _set(values: dict) -> None:
    unknown = set(values) - set(_CONTROL_NAMES)
    if unknown:
        raise ValueError(
            f"unknown simdevice controls {sorted(unknown)}; the controls are {_CONTROL_NAMES}"
        )
    for name, value in values.items():
        _ext().set_control(name, float(value))


@contextlib.contextmanager
def controls(**values) -> Iterator[None]:
    """Set controls for the block and restore the previous values on exit::

    with simdevice.controls(asynchronous=True, copy_delay=0.01):
        ...
    """
    previous = get_controls()
    _set(values)
    try:
        yield
    finally:
        _set({name: previous[name] for name in values})


@contextlib.contextmanager
def hold(stream: torch.Stream) -> Iterator[None]:
    """Hold `stream`'s worker: it starts no further item until the block exits (an item already
    running finishes). Makes a race deterministic. A host wait on a held stream raises after
    `wait_timeout`::

    with simdevice.hold(copy_stream):
        dst.copy_(src, non_blocking=True)   # queued on copy_stream, not run yet
    """
    _ext().set_held(stream.stream_id, True)
    try:
        yield
    finally:
        _ext().set_held(stream.stream_id, False)


def busy(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for `seconds` and touches no memory, as
    ``torch.cuda._sleep`` does for cycles: a model step's compute in one launch, so that the host's
    dispatch of it stays far shorter than the device's time, as on a GPU.  The host does not wait::

    simdevice.busy(0.03)          # the current stream runs 30 ms of "compute"
    """
    _ext().busy(float(seconds))


def is_device_pointer(address: int) -> bool:
    """Whether `address` lies in memory the simulator's device allocator handed out."""
    return _ext().is_device_pointer(address)


def host_syncs() -> int:
    """Host synchronisations so far in this process (every host wait on the device; README.md)."""
    return _ext().host_syncs()


def waiting_threads() -> set[int]:
    """The threads (``threading.get_ident()``) blocked in a host wait on the device right now: a
    stream, event or device synchronize, a read of a device value, a copy that is not asynchronous,
    whose work has not run yet.  A test that holds a stream releases it once the host waits for
    it, and not before::

    if threading.get_ident() in simdevice.waiting_threads(): ...
    """
    return set(_ext().waiting_threads())


def pinned_bytes() -> int:
    """Bytes the pinned host allocator holds now, its cached free blocks included (what
    ``torch.cuda.host_memory_stats()["allocated_bytes.current"]`` reads on CUDA)."""
    return _ext().pinned_bytes()[1]


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[int]]:
    """Count the host synchronisations inside the block; the count is in ``counted[0]`` after it::

    with simdevice.count_host_syncs() as counted:
        x.item()
    assert counted[0] == 1
    """
    counted = [0]
    start = host_syncs()
    try:
        yield counted
    finally:
        counted[0] = host_syncs() - start
