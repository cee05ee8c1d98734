"""The copy engine: moving packed bytes between host chunks and device storage.

The scheduler and `Residency` only ever talk to a `Transport`; they never call ``copy_`` or touch a
stream themselves.  Two implementations exist:

* `CpuTransport` — the "device" is host memory too.  Copies are plain memcpy into a reused
  buffer and complete before they return.  Every behaviour of the library runs through it in CI.
* `AcceleratorTransport` — a dedicated copy stream and events, through torch's device-generic
  stream API (`torch.Stream`, `torch.Event`, `torch.accelerator`), so one code path serves CUDA,
  ROCm, XPU and other accelerators.

`DeviceStorage` — one device buffer that tensors are views of while resident.  The exclusive groups
of a scheduler share one (only one of them is resident at a time); each resident-policy group has
its own.  It is reused across transitions and re-allocated only when it is too small or when
something outside the library still aliases it.  A group asks it once per direction: a load
begins with `DeviceStorage.begin_load` (a buffer, the views, one bulk copy per chunk of the host
master) and a residency ends with `DeviceStorage.retire` (the write-back's copies, which the host
waits for, then the buffer retired); the write-back decides its copies in
`residency.group.residency`.

`free_device_memory` says how many bytes a device has free (the host's available memory for the
CPU, its cgroup's room when smaller: `residency.device.host_memory`): what an auto plan's budget
is a fraction of, and what placement's prefetch fits within;
`device_total_memory` all it has (a budget above it is warned about).

[Note: completions instead of synchronisation]
A load returns a `Completion`.  ``completion.wait()`` makes the *compute stream* wait for the copy
(an event wait queued on the device), it does not block the host.  On the CPU the copy has already
happened and ``wait`` does nothing.  The scheduler calls ``wait`` before a phase body runs, so kernels
in the body are ordered after the bytes they read, while the host runs ahead.

[Note: reusing device storage safely]
Evicting a group only re-points its tensors to host memory; kernels already queued on the compute
stream may still read the old device storage.  `Transport.retire` records, on the compute stream,
the point after which the storage is no longer read; the next copy *into* that storage first waits
for that point on the copy stream.  Storage is therefore never overwritten under a running kernel.

[Note: the alias check before reuse]
A weight view kept by user code (``w = linear.weight.detach()``) shares the device buffer's storage.
Overwriting the buffer with another group would silently change ``w``.  The storage's reference count
tells: the buffer itself, the views this class created, and nothing else.  Any surplus means an alias,
and the buffer is abandoned (left to its alias) and a fresh one allocated.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from residency.core.errors import DeviceMemoryError
from residency.core.locks import in_context
from residency.device.host_memory import host_memory
from residency.device.page_lock import RegisteredMapping
from residency.modules.tensors import Inventory, data_ptrs, make_views

if TYPE_CHECKING:
    from residency.host.memory import HostMaster

__all__ = [
    "AcceleratorTransport", "Completion", "CpuTransport", "DeviceStorage", "Transport",
    "transport_for",
]

_log = logging.getLogger("residency")
_use_count = torch._C._storage_Use_Count

#: (destination, source) byte tensors of equal length.
CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class Completion:
    """The end of a copy.  ``wait()`` orders later compute after it without blocking the host."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.Event | None = None) -> None:
        self._event = event

    def wait(self) -> None:
        """Make the current (compute) stream wait for the copy; a no-op for completed copies."""
        if self._event is not None:
            torch.accelerator.current_stream(self._event.device).wait_event(self._event)

    def synchronize(self) -> None:
        """Block the host until the copy is done (used only before the host reads copied bytes)."""
        if self._event is not None:
            self._event.synchronize()


DONE = Completion()


class Transport:
    """Moves bytes between host chunks and device storage; allocates both kinds of memory."""

    device: torch.device

    def allocate_host(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """A uint8 host tensor of exactly `nbytes`, page-locked when `pin`.

        Raises the runtime's error when pinning fails; `HostMaster` decides what to do then.
        """
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def allocate_device(self, nbytes: int) -> torch.Tensor:
        """A uint8 device tensor of `nbytes`; raises the allocator's own out-of-memory error."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def to_device(self, pairs: CopyPairs) -> Completion:
        raise NotImplementedError

    def to_host(self, pairs: CopyPairs) -> Completion:
        raise NotImplementedError

    def to_host_synchronized(self, pairs: CopyPairs) -> None:
        """Copy to the host and block the host until the bytes are there: for a caller that
        reads them next (a write-back: the master may be read at once)."""
        self.to_host(pairs).synchronize()

    def retire(self, storage: torch.Tensor) -> None:
        """Mark the point after which compute no longer reads `storage` (see the note above)."""

    def release(self, storage: torch.Tensor) -> None:
        """Called before device storage is dropped, so its memory is not reused under a copy."""

    def can_pin(self) -> bool:
        return False


class CpuTransport(Transport):
    """The device is the host: copies are synchronous memcpy and complete before returning."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def to_device(self, pairs: CopyPairs) -> Completion:
        for destination, source in pairs:
            destination.copy_(source)
        return DONE

    def to_host(self, pairs: CopyPairs) -> Completion:
        return self.to_device(pairs)


class AcceleratorTransport(Transport):
    """Copies on a dedicated copy stream; completions are events the compute stream waits on."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device(self.device.type, torch.accelerator.current_device_index())
        #: Host-to-device and device-to-host copies run here, beside compute.
        self.copy_stream = torch.Stream(self.device)
        #: Recorded on the compute stream at eviction; the next copy into the storage waits on it.
        self._retired: dict[int, torch.Event] = {}

    def can_pin(self) -> bool:
        return True

    def allocate_host(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """Exact-size page-locked memory on CUDA (see [Note: exact-size pinned memory])."""
        if pin and self.device.type == "cuda" and nbytes > 0:
            return _page_locked_exact(nbytes)
        return super().allocate_host(nbytes, pin=pin)

    def to_device(self, pairs: CopyPairs) -> Completion:
        for destination, _ in pairs:
            self._wait_retired(destination)
        return Completion(in_context(self.copy_stream, self._copy_on_stream, pairs))

    def to_host(self, pairs: CopyPairs) -> Completion:
        # The copy stream must not read device bytes before compute has finished writing them.
        self.copy_stream.wait_stream(torch.accelerator.current_stream(self.device))
        return Completion(in_context(self.copy_stream, self._copy_on_stream, pairs))

    def _copy_on_stream(self, pairs: CopyPairs) -> torch.Event:
        """Issue `pairs` on the copy stream (the current one here); the event of their end.
        Entered on one line (see [Note: a context on one line] in `residency.core.locks`)."""
        for destination, source in pairs:
            destination.copy_(source, non_blocking=True)
        return self.copy_stream.record_event()

    def retire(self, storage: torch.Tensor) -> None:
        event = torch.accelerator.current_stream(self.device).record_event()
        self._retired[storage.untyped_storage().data_ptr()] = event

    def allocate_device(self, nbytes: int) -> torch.Tensor:
        """A device buffer whose first copy waits for compute queued before its allocation.

        The caching allocator may hand out a block that kernels already queued on the compute
        stream still read (a tensor freed a moment ago); the copy stream must not write it first.
        """
        buffer = super().allocate_device(nbytes)
        event = torch.accelerator.current_stream(self.device).record_event()
        self._retired[buffer.untyped_storage().data_ptr()] = event
        return buffer

    def release(self, storage: torch.Tensor) -> None:
        # The caching allocator may hand the memory to compute-stream work as soon as it is freed;
        # that work must come after every copy still queued into or out of it.
        torch.accelerator.current_stream(self.device).wait_stream(self.copy_stream)
        self._retired.pop(storage.untyped_storage().data_ptr(), None)

    def _wait_retired(self, destination: torch.Tensor) -> None:
        event = self._retired.pop(destination.untyped_storage().data_ptr(), None)
        if event is not None:
            self.copy_stream.wait_event(event)


class DeviceStorage:
    """A reusable device buffer and the views each group has into it (see the notes above).

    ``views_for(key, inventory)`` returns views laid out for `inventory`, reusing the buffer when it is
    large enough and not aliased, else allocating a fresh one.  The views of a group stay valid (and
    its tensors land at the same addresses) for as long as the buffer is reused.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: Allocate at least this many bytes (the largest group that will load here), so the
        #: buffer is allocated once rather than grown group by group.
        self.size_hint = 0
        self.buffer: torch.Tensor | None = None
        self._views: dict[object, list[torch.Tensor]] = {}
        self._pointers: dict[object, list[int]] = {}
        self._view_count = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def is_aliased(self) -> bool:
        """Whether something besides this object and its views still references the buffer."""
        if self.buffer is None:
            return False
        # 1 for self.buffer, 1 for the temporary storage object made to ask, 1 per view.
        return _use_count(self.buffer.untyped_storage()._cdata) > 2 + self._view_count

    def prepare(self, nbytes: int) -> bool:
        """Make sure a buffer of at least `nbytes` exists that nothing outside aliases.

        Returns True when a fresh buffer was allocated.  An allocation that fails is tried once
        more after the accelerator's caching allocator gave back the memory it keeps and no
        tensor holds (another tenant's or our own freed blocks); its second failure propagates
        unchanged, with no buffer held.
        """
        if self.buffer is not None and (self.buffer.numel() >= nbytes) and not self.is_aliased():
            return False
        if self.buffer is not None and self.is_aliased():
            _log.info("device storage is aliased outside the scheduler; allocating a fresh buffer")
        self.release()
        self.buffer = self._allocate(max(nbytes, self.size_hint))
        return True

    def _allocate(self, nbytes: int) -> torch.Tensor:
        # The buffer outlives the caller's mode; see [Note: a context on one line] in locks.py.
        try:
            return in_context(torch.inference_mode(False), self._transport.allocate_device, nbytes)
        except (MemoryError, RuntimeError):
            if self._transport.device.type != "cpu":
                torch.accelerator.empty_cache()
            return in_context(torch.inference_mode(False), self._transport.allocate_device, nbytes)

    def views_for(self, key: object, inventory: Inventory) -> list[torch.Tensor]:
        """Views of the buffer laid out for `inventory` (cached per key while the buffer lives).

        Only this object holds them, so `release` really frees the buffer.
        """
        views = self._views.get(key)
        if views is None:
            assert self.buffer is not None
            views = _views_into_buffer(inventory, self.buffer)
            self._views[key] = views
            self._pointers[key] = data_ptrs(views)
            self._view_count += len(views)
        return views

    def begin_load(self, key: object, inventory: Inventory, master: HostMaster, nbytes: int, *,
                   name: str) -> tuple[list[torch.Tensor], list[int], Completion]:
        """Issue the load of `master` (laid out as `inventory`) into this storage, for group
        `name`: `prepare_load`, then its copies on the transport.  Returns the views the tensors
        will be re-pointed to, their data pointers and the copy's `Completion`.

            views, pointers, completion = storage.begin_load(group, inventory, master, nbytes,
                                                             name=group.name)
        """
        views, pointers, copies = self.prepare_load(key, inventory, master, nbytes, name=name)
        return views, pointers, self._transport.to_device(copies)

    def prepare_load(self, key: object, inventory: Inventory, master: HostMaster, nbytes: int,
                     *, name: str):
        """Everything a load of `master` (laid out as `inventory`) into this storage needs but the
        copy (a load whose ranks split the copy makes it itself): a buffer of at least `nbytes`
        (`prepare`), the views the tensors will be re-pointed to, their data pointers (plain
        ints: holding them keeps no memory alive; where eviction finds ``.data = ...``), and the
        (device slice, host chunk) copies, one bulk copy per chunk.  An allocation that fails is
        a `DeviceMemoryError` that names group `name` and says what to do.

            views, pointers, copies = storage.prepare_load(group, inventory, master, nbytes,
                                                           name=group.name)
        """
        try:
            self.prepare(nbytes)
        except (MemoryError, RuntimeError) as error:
            raise _allocation_failed(name, nbytes, self._transport.device, error) from error
        views = self.views_for(key, inventory)
        bases, buffer = inventory.layout.chunk_base, self.buffer
        copies = [(buffer[base : base + c.numel()], c) for base, c in zip(bases, master.chunks)]
        return views, self._pointers[key], copies

    def retire(self, write_back: CopyPairs = ()) -> None:
        """End a residency in this storage: copy `write_back`'s (host slice, device slice) pairs
        to the host, which waits for them (it may read the master at once), then mark the point
        after which compute no longer reads the buffer ([Note: reusing device storage safely]).
        Repeatable: an eviction cut short retires again when it is retried.

            storage.retire(pairs)     # an eviction: what changed written back, the buffer retired
            storage.retire()          # a cancelled load: nothing to write back
        """
        if write_back:
            self._transport.to_host_synchronized(write_back)
        if self.buffer is not None:  # else released meanwhile: nothing reads it
            self._transport.retire(self.buffer)

    def forget(self, key: object) -> None:
        """Drop the views made for `key` (a group that was unregistered or re-packed)."""
        views = self._views.pop(key, None)
        self._pointers.pop(key, None)
        if views is not None:
            self._view_count -= len(views)

    def release(self) -> None:
        """Drop the buffer and every view of it (memory returns once no tensor uses it)."""
        if self.buffer is not None:
            self._transport.release(self.buffer)
        self.buffer = None
        self._views.clear()
        self._pointers.clear()
        self._view_count = 0


def _allocation_failed(name: str, nbytes: int, device, error: BaseException) -> DeviceMemoryError:
    return DeviceMemoryError(
        f"group {name!r} needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of device memory on "
        f"{device} and the allocation failed ({error}). Free device memory, raise the "
        "scheduler's device_memory_limit, or split the group; the group stays offloaded"
    )


def _views_into_buffer(inventory: Inventory, buffer: torch.Tensor) -> list[torch.Tensor]:
    layout = inventory.layout
    bases = layout.chunk_base
    region_base = [bases[c] + o for c, o in zip(layout.region_chunk, layout.region_offset)]
    return make_views(inventory.places, buffer.untyped_storage(), region_base, buffer.device)


def _page_locked_exact(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory, exactly (no power-of-two rounding).

    [Note: exact-size pinned memory]
    PyTorch's pinned allocator rounds every request up to a power of two (a 20.4 GiB request was
    reported to pin 32 GiB).  Registering anonymous pages with ``cudaHostRegister`` pins exactly the
    bytes asked for, page-aligned, and the pages are only committed as they are registered chunk by
    chunk, so building a master never needs twice the host memory.
    """
    region = RegisteredMapping(-1, nbytes)
    _ask_for_huge_pages(region)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    region.register(tensor.data_ptr(), nbytes, what=f"{nbytes} bytes")
    return tensor


def _ask_for_huge_pages(region: mmap.mmap) -> None:
    """Back `region` with transparent huge pages where the kernel allows (fewer pin faults)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # kernels without transparent huge pages: 4 KiB pages it is
            pass


def transport_for(device: torch.device) -> Transport:
    """The transport that serves `device`: memcpy for the CPU, streams and events otherwise."""
    if device.type == "cpu":
        return CpuTransport(device)
    return AcceleratorTransport(device)


def default_device() -> torch.device:
    """The current accelerator when one is present, else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def free_device_memory(device: torch.device, held: int = 0) -> int | None:
    """Bytes free on `device` (with `held`, what the caller holds there now, counted as free):
    the accelerator's free memory by the device-generic API, or the host's available memory on
    the CPU; None where the backend cannot tell (a PrivateUse1 allocator may not implement it).

        free_device_memory(torch.device("cuda", 0))                  # free bytes, or None
        free_device_memory(device, held=placement.device_nbytes)      # as if ours were freed
    """
    if device.type == "cpu":
        available = _host_available()
        return None if available is None else available + held
    try:
        free, _ = torch.accelerator.get_memory_info(device.index)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return free + held


def device_total_memory(device: torch.device) -> int | None:
    """All the memory `device` has, in bytes: the accelerator's total by the device-generic API,
    or the host's (``os.sysconf``) on the CPU; None where the backend cannot tell.

        device_total_memory(torch.device("cuda", 0))     # 85899345920 on an 80 GB H100
    """
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        return torch.accelerator.get_memory_info(device.index)[1]
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _host_available() -> int | None:
    """What the process can still take of host memory: MemAvailable, or its cgroup's room when
    smaller (`residency.device.host_memory`), else the free pages."""
    available = host_memory().available
    if available is not None:
        return available
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else None
    return None if pages is None else pages * os.sysconf("SC_PAGE_SIZE")
