"""The inventory of a module set's tensors: what is unique, where it goes in a pack, how to re-point it.

Three ideas live here and nowhere else:

* **Deduplication.** Tied weights are one `Parameter` object reached through two modules; shared
  storage is two tensor objects viewing one allocation.  Both are kept tied by packing each distinct
  *storage* once (a `Region`) and making every tensor that viewed it a view of that one region again.
* **The pack layout.** Regions are laid end to end (each aligned) into chunks of at most
  `chunk_nbytes`; a region larger than a chunk gets a chunk of its own, of exact size.  The host
  master keeps the chunks apart; device storage lays them end to end in one buffer.
* **Where a tensor lands.** Each region starts where a plain run would have put its tensors
  (`Alignment`), so kernels pick the same code path and every output bit matches.

[Note: alignment decides the bits]
Matrix kernels choose their code path by operand address: MKL's GEMV/GEMM on AVX-512 gave a
24x16 ``F.linear`` results differing by 4.8e-07 between two placements of the same weights, and
cuBLASLt picks kernels by operand alignment (PyTorch passes it as ``MIN_ALIGNMENT_*_BYTES``).  So
"bit-identical to the model never offloaded" needs each tensor where that model has it:
* on a CPU device, the model runs on the weights as the user loaded them, at whatever address
  (safetensors leaves them 8-byte aligned).  A region keeps its first byte's address modulo 64 (a
  cache line, the CPU allocator's alignment, the widest vector load), so every tensor in it sits at
  the same ``data_ptr() % 64`` as when it was registered;
* on an accelerator, a plain ``.to(device)`` gives every tensor a fresh allocation, which the
  caching allocator aligns to 512 bytes.  Regions start at multiples of 512.
* **Re-pointing.** A tensor is moved by assigning its data (``tensor.data = view``): the Python
  object, its ``requires_grad`` and its version counter stay; only the storage it reads changes.

[Note: why re-pointing goes through the `data` descriptor]
``setattr(t, "data", v)`` costs ~0.7 us per tensor; calling the C descriptor's ``__set__`` through
``map`` costs ~0.23 us (2-core CPU, torch 2.13).  A transition re-points every tensor of two groups,
so this is the per-tensor floor of the library and is kept in C as far as Python allows.  A ``map``
of C callables also runs no bytecode, so a ``KeyboardInterrupt`` cannot land half-way through it.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable, Sequence

import attrs
import torch
from torch import nn

from residency.core.errors import RegistrationError
from residency.core.locks import in_context
from residency.modules.subclasses import (
    WrapperSet,
    attached_tensors,
    check_rebuild_keeps_inner_tensors,
    extent,
    inner_tensors,
    is_plain,
    is_plain_storage_parameter,
    is_wrapper,
    overlapping_runs,
    unsupported_message,
)

__all__ = [
    "ACCELERATOR_ALIGNMENT",
    "CPU_ALIGNMENT",
    "Alignment",
    "AttachedSlot",
    "DEFAULT_CHUNK_NBYTES",
    "InnerSlot",
    "Inventory",
    "PackLayout",
    "Slot",
    "TensorPlace",
    "TensorSlot",
    "alignment_for",
    "make_views",
    "repoint",
    "repoint_group",
    "take_inventory",
]

#: Regions are packed into chunks of this many bytes (a power of two; see memory.py for why).
DEFAULT_CHUNK_NBYTES = 256 * 2**20


def _check_power_of_two(value: int) -> None:
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ValueError(f"an alignment boundary is a positive power of two, not {value!r}")


@attrs.frozen
class Alignment:
    """Where a region may start in a pack (see [Note: alignment decides the bits]).

        alignment_for(torch.device("cpu"))    # Alignment(boundary=64, keep_source_offset=True)
        alignment_for(torch.device("cuda"))   # Alignment(boundary=512, keep_source_offset=False)

    A region starts at a multiple of `boundary`, plus, with `keep_source_offset`, its first byte's
    address modulo `boundary` where it was registered.  Buffers the pack is laid into must start
    at a multiple of `boundary` (the CPU and caching allocators' own alignments).
    """

    #: A power of two; chunks in device storage also start at multiples of it.
    boundary: int = attrs.field(validator=lambda _i, _a, v: _check_power_of_two(v))
    keep_source_offset: bool


#: A CPU device computes on the weights where the user loaded them: keep each address modulo 64.
CPU_ALIGNMENT = Alignment(boundary=64, keep_source_offset=True)
#: An accelerator's caching allocator puts a fresh tensor at a multiple of 512 bytes.
ACCELERATOR_ALIGNMENT = Alignment(boundary=512, keep_source_offset=False)


def alignment_for(device: torch.device) -> Alignment:
    """The placement a plain run on `device` gives weights (see [Note: alignment decides the bits])."""
    return CPU_ALIGNMENT if device.type == "cpu" else ACCELERATOR_ALIGNMENT


_set_data = torch._C.TensorBase.data.__set__
_get_version = operator.attrgetter("_version")
_data_ptr = torch._C.TensorBase.data_ptr


@attrs.frozen
class TensorSlot:
    """One place a tensor is reachable from: ``owner._parameters[name]`` or ``owner._buffers[name]``."""

    owner: nn.Module
    name: str
    is_buffer: bool

    def table(self) -> dict:
        """The module's ``_buffers`` or ``_parameters`` dict this slot is an entry of."""
        return self.owner._buffers if self.is_buffer else self.owner._parameters

    def current(self) -> torch.Tensor | None:
        """The tensor the module holds in this slot now."""
        return self.table().get(self.name)

    def describe(self) -> str:
        kind = "buffer" if self.is_buffer else "parameter"
        return f"{kind} {self.name!r} of {type(self.owner).__name__}"


@attrs.frozen
class InnerSlot:
    """An inner tensor of the wrapper subclass in `base`: ``base.current()`` then attribute `path`.

        InnerSlot(TensorSlot(linear, "weight", False), ("qdata",)).describe()
        # "inner tensor 'qdata' of the Int8Tensor parameter 'weight' of Linear"
    """

    base: TensorSlot
    path: tuple[str, ...]

    def current(self) -> torch.Tensor | None:
        """The tensor the wrapper in `base` holds at `path` now (None when the path is gone)."""
        return _follow(self.base.current(), self.path)

    def describe(self) -> str:
        wrapper = type(self.base.current()).__name__
        return f"inner tensor {'.'.join(self.path)!r} of the {wrapper} {self.base.describe()}"


@attrs.frozen
class AttachedSlot:
    """A tensor kept with the Parameter subclass in `base`, found at attribute `path` of it (or,
    with `on_module`, of its module): bitsandbytes' ``weight.quant_state.absmax``, ``state.SCB``.

    It is moved by identity wherever it is referenced later (bitsandbytes hands ``CB`` from the
    parameter to its module on the first forward), so the structure check does not watch it.
    """

    base: TensorSlot
    path: tuple[str, ...]
    on_module: bool

    def current(self) -> torch.Tensor | None:
        """The tensor at `path` now (None when the path is gone)."""
        start = self.base.owner if self.on_module else self.base.current()
        return _follow(start, self.path)

    def describe(self) -> str:
        if self.on_module:
            return f"tensor {'.'.join(self.path)!r} of {type(self.base.owner).__name__}"
        return f"tensor {'.'.join(self.path)!r} attached to the {self.base.describe()}"


#: Every kind of place a packed tensor is reachable from.
Slot = TensorSlot | InnerSlot | AttachedSlot


def _follow(start: object, path: Sequence[str]) -> torch.Tensor | None:
    for name in path:
        start = getattr(start, name, None)
    return start  # type: ignore[return-value]


@attrs.frozen
class TensorPlace:
    """A tensor's place in the pack layout: its region, its byte offset in it, size, stride and
    dtype (not `residency.placement.placement.Placement`, which says what is on the device)."""

    region: int
    #: Offset from the region's first byte, in bytes (a multiple of the dtype's itemsize).
    byte_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen
class PackLayout:
    """Where every region lives: its chunk and its offset in that chunk, and each chunk's size."""

    chunk_nbytes: tuple[int, ...]
    region_chunk: tuple[int, ...]
    region_offset: tuple[int, ...]
    region_nbytes: tuple[int, ...]
    #: Chunks start at multiples of this in device storage (`Alignment.boundary`).
    boundary: int

    #: Total bytes of all chunks (unique tensor bytes plus alignment padding).
    nbytes: int = attrs.field(init=False)
    #: Offset of each chunk when the chunks are laid end to end (device storage).
    chunk_base: tuple[int, ...] = attrs.field(init=False)
    #: Bytes needed to lay every chunk end to end, each aligned.
    contiguous_nbytes: int = attrs.field(init=False)
    # The totals are facts of the layout, fixed when it is made (read on every load).

    @nbytes.default
    def _sum_chunks(self) -> int:
        return sum(self.chunk_nbytes)

    @chunk_base.default
    def _lay_end_to_end(self) -> tuple[int, ...]:
        bases, total = [], 0
        for size in self.chunk_nbytes:
            bases.append(total)
            total += _aligned(size, self.boundary)
        return tuple(bases)

    @contiguous_nbytes.default
    def _sum_aligned(self) -> int:
        return sum(_aligned(size, self.boundary) for size in self.chunk_nbytes)


@attrs.define(eq=False, kw_only=True)
class Inventory:
    """The unique tensors of a set of modules, where each is reachable from, and how they pack.

    Built by `take_inventory`; the source storages are only referenced until the host master has
    copied them (`source_regions` is cleared then).
    """

    modules: tuple[nn.Module, ...]
    #: The plain tensors to pack and re-point: parameters, buffers, wrappers' inner tensors,
    #: Parameter subclasses and the tensors attached to them.
    tensors: tuple[torch.Tensor, ...]
    slots: tuple[tuple[Slot, ...], ...]
    places: tuple[TensorPlace, ...]
    layout: PackLayout
    #: Per region: (source storage, first byte in it) to copy from; dropped once packed.
    source_regions: list[tuple[torch.UntypedStorage, int]] | None
    #: A picture of the modules' structure, to notice tensors added or replaced after `add`.
    structure: Structure
    #: The wrapper subclasses, rebuilt per device by `repoint_group`; None when there are none.
    wrappers: WrapperSet | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the unique tensors' storages: tied and shared weights count once."""
        return sum(self.layout.region_nbytes)

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    def shares_region(self, index: int) -> bool:
        """Whether tensor `index` shares its storage (region) with another tensor of the group."""
        region = self.places[index].region
        return sum(p.region == region for p in self.places) > 1

    def regions_in_chunk(self, chunk: int) -> list[int]:
        return [r for r, c in enumerate(self.layout.region_chunk) if c == chunk]

    def tensors_in_regions(self, regions: Iterable[int]) -> list[int]:
        wanted = set(regions)
        return [i for i, p in enumerate(self.places) if p.region in wanted]

    def changes_while_resident(self, pointers: list[int], homes: Sequence[torch.Tensor]):
        """What an eviction reads of the tensors, in one call: each one's version counter, which
        were given new storage since `pointers` were taken (`moved_from`), and which of those no
        longer fit their places `homes` (`misfits`)."""
        moved = moved_from(self.tensors, pointers)
        return versions(self.tensors), moved, self.misfits(homes, moved) if moved else []

    def changes_while_offloaded(self, pointers: list[int], homes: Sequence[torch.Tensor]):
        """What a load reads of the modules and tensors, in one call: why the group must be
        re-packed first (the modules' structure changed, or a tensor given new storage no longer
        fits its place in `homes`; None: it may load as packed), and which tensors were given
        new storage since `pointers` were taken."""
        moved = moved_from(self.tensors, pointers)
        why = self.changed_structure()
        if why is None and moved:
            why = self.describe_misfit(self.misfits(homes, moved))
        return why, moved

    def misfits(self, homes: Sequence[torch.Tensor], replaced: list[int]) -> list[tuple[int, str]]:
        """(index, why) of the tensors `replaced` (given new storage) whose bytes cannot go back
        to their places `homes` (the master's views).

        A new dtype, shape or stride needs a new layout; new storage for one of several tensors
        that shared a storage broke the tie, and writing it back would change the others.
        """
        found = []
        for i in replaced:
            tensor, home = self.tensors[i], homes[i]
            if (tensor.dtype, tensor.shape, tensor.stride()) != (home.dtype, home.shape, home.stride()):
                found.append((i, f"it changed from {_kind(home)} to {_kind(tensor)}"))
            elif self.shares_region(i):
                found.append((i, "it was given new storage, untying it from the tensors it "
                                 "shared storage with"))
        return found

    def describe_misfit(self, misfits: list[tuple[int, str]]) -> str | None:
        """The first of `misfits` in words (why the group must be re-packed), or None."""
        if not misfits:
            return None
        index, why = misfits[0]
        return f"the {self.slots[index][0].describe()}: {why}"

    def changed_structure(self) -> str | None:
        """Describe how the modules changed since registration; None if they did not.

        The common case is one comparison of identity tuples; the description is only worked out
        when something did change.
        """
        if self.structure.unchanged():
            return None
        for tensor, slots in zip(self.tensors, self.slots):
            for slot in slots:
                if not isinstance(slot, AttachedSlot) and slot.current() is not tensor:
                    return f"the {slot.describe()} was replaced or removed"
        return "a submodule, parameter or buffer was added or replaced"


def take_inventory(
    modules: Sequence[nn.Module],
    *,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    exclude: Sequence[nn.Module] = (),
    alignment: Alignment = CPU_ALIGNMENT,
    allow_empty: bool = False,
) -> Inventory:
    """List the unique tensors of `modules`, group them by storage and lay out their pack.

    Submodules in `exclude` (and everything under them) are left out.  Regions are placed by
    `alignment` (the device's: `alignment_for`).  Tensor subclasses are reached through
    (`residency.modules.subclasses`): a wrapper's inner tensors and a Parameter subclass's attached tensors
    are listed with `InnerSlot`/`AttachedSlot`.  Raises `RegistrationError` (and touches nothing)
    for meta or lazy tensors, other tensor subclasses, non-strided layouts, or a module set
    without any tensor (unless `allow_empty`: a layer-mode group whose weights are all in its
    streamed blocks).

        inventory = take_inventory([transformer], alignment=alignment_for(device))
        inventory.tensors, inventory.slots[0][0].describe(), inventory.nbytes
    """
    submodules = unique_submodules(modules, exclude)
    owners = _collect_slots(submodules)
    if not owners and not allow_empty:
        names = ", ".join(type(m).__name__ for m in modules)
        raise RegistrationError(
            f"the modules ({names}) hold no parameters or buffers, so there is nothing to offload; "
            "register only modules with weights"
        )
    for tensor, tensor_slots in owners.values():
        _check_supported(tensor, tensor_slots[0])
    wrapped: list[tuple[torch.Tensor, list[TensorSlot]]] = []
    if not all(is_plain(tensor) for tensor, _ in owners.values()):
        owners, wrapped = _reach_through_subclasses(owners)
    tensors = tuple(tensor for tensor, _ in owners.values())
    slots = tuple(tuple(s) for _, s in owners.values())
    places, region_sources, region_nbytes = _place_in_regions(tensors)
    skews = [_skew(source, alignment) for source in region_sources]
    layout = _lay_out(region_nbytes, skews, chunk_nbytes, alignment.boundary)
    structure = Structure(submodules)
    return Inventory(
        modules=tuple(submodules),
        tensors=tensors,
        slots=slots,
        places=places,
        layout=layout,
        source_regions=region_sources,
        structure=structure,
        wrappers=WrapperSet(wrapped, on_swap=structure.expect) if wrapped else None,
    )


def _reach_through_subclasses(
    owners: dict[int, tuple[torch.Tensor, list[Slot]]],
) -> tuple[dict[int, tuple[torch.Tensor, list[Slot]]], list[tuple[torch.Tensor, list[Slot]]]]:
    """Replace each wrapper by its inner tensors and add each Parameter subclass's attached ones.

    Returns the plain tensors to pack (id -> tensor and slots, in order) and the wrappers with
    their module slots.
    """
    reached: dict[int, tuple[torch.Tensor, list[Slot]]] = {}
    wrapped = []
    for tensor, slots in owners.values():
        base = slots[0]
        if is_wrapper(tensor):
            check_rebuild_keeps_inner_tensors(tensor, base.describe())
            wrapped.append((tensor, slots))
            found = [(inner, InnerSlot(base, path)) for path, inner in inner_tensors(tensor)]
        else:
            reached.setdefault(id(tensor), (tensor, []))[1].extend(slots)
            found = [] if is_plain(tensor) else [
                (t, AttachedSlot(base, path, on_module))
                for on_module, path, t in attached_tensors(tensor, base.owner)
            ]
        for inner, slot in found:
            _check_reached(inner, slot)
            reached.setdefault(id(inner), (inner, []))[1].append(slot)
    return reached, wrapped


class Structure:
    """Every (table, key) -> object entry of the modules' ``_parameters``, ``_buffers`` and
    ``_modules`` tables, and each table's size, as seen at registration.

    `unchanged()` is one pass of C-level ``map`` calls (about 0.1 us per entry): a replaced or
    removed entry fails the identity test, an added one changes a table's size.  The scheduler's
    own stores into a slot (a wrapper's device twin, `WrapperSet`) are told with `expect`.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._tables: list[dict] = []
        self._entry_tables: list[dict] = []
        self._keys: list[str] = []
        self._values: list[object] = []
        for module in modules:
            for table in (module._parameters, module._buffers, module._modules):
                self._tables.append(table)
                for key, value in table.items():
                    self._entry_tables.append(table)
                    self._keys.append(key)
                    self._values.append(value)
        self._sizes = list(map(len, self._tables))
        #: (id(table), key) -> entry index, for `expect`.
        self._index: dict[tuple[int, str], int] | None = None

    def unchanged(self) -> bool:
        if list(map(len, self._tables)) != self._sizes:
            return False
        current = map(dict.get, self._entry_tables, self._keys)
        return all(map(operator.is_, current, self._values))

    def expect(self, table: dict, key: str, value: object) -> None:
        """Record that the scheduler itself stored `value` at ``table[key]``."""
        if self._index is None:  # built on the first swap: groups without wrappers never pay
            self._index = {(id(t), k): i for i, (t, k) in enumerate(zip(self._entry_tables, self._keys))}
        index = self._index.get((id(table), key))
        if index is not None:
            self._values[index] = value


def make_views(
    places: Sequence[TensorPlace],
    storage: torch.UntypedStorage,
    region_base: Sequence[int],
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per placement, viewing `storage` at byte `region_base[region]` + its offset."""
    # Views outlive the call; made under inference mode they could never be written again.
    # Entered on one line: see [Note: a context on one line] in `residency.core.locks`.
    return in_context(torch.inference_mode(False), in_context, torch.no_grad(), _make_views,
                      places, storage, region_base, device)


def _make_views(places, storage, region_base, device) -> list[torch.Tensor]:
    views = []
    for p in places:
        byte_offset = region_base[p.region] + p.byte_offset
        view = torch.empty(0, dtype=p.dtype, device=device)
        view.set_(storage, byte_offset // p.dtype.itemsize, p.size, p.stride)
        views.append(view)
    return views


def repoint(tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Make each tensor read its view's storage (object, grad flag and version counter stay)."""
    collections.deque(map(_set_data, tensors, views), maxlen=0)


def repoint_group(inventory: Inventory, views: Sequence[torch.Tensor]) -> None:
    """Re-point every tensor of `inventory` to `views`, then put each wrapper subclass's twin for
    the views' device in its slots (see [Note: re-pointing wrapper subclasses]).

        repoint_group(group.inventory, device_views)   # load
        repoint_group(group.inventory, host_views)     # evict

    A group without wrappers pays one attribute test over `repoint`.
    """
    collections.deque(map(_set_data, inventory.tensors, views), maxlen=0)
    if inventory.wrappers is not None:
        inventory.wrappers.follow(views[0].device)


def _kind(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {tuple(tensor.shape)} strides {tensor.stride()}"


def moved_from(tensors: Sequence[torch.Tensor], pointers: list[int]) -> list[int]:
    """Indices of the tensors whose data pointer is no longer the one in `pointers` (given new
    storage: ``.data = ...``, ``module.to(...)``), in order; one pass over the pointers."""
    now = data_ptrs(tensors)
    if now == pointers:
        return []
    return [i for i, p in enumerate(now) if p != pointers[i]]


def versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's version counter: it moves on every in-place change made through the tensor."""
    return list(map(_get_version, tensors))


def data_ptrs(tensors: Sequence[torch.Tensor]) -> list[int]:
    return list(map(_data_ptr, tensors))


def _aligned(nbytes: int, boundary: int) -> int:
    return -(-nbytes // boundary) * boundary


def _skew(source: tuple[torch.UntypedStorage, int], alignment: Alignment) -> int:
    """Where in its boundary a region starts: its source address modulo the boundary, or 0."""
    if not alignment.keep_source_offset:
        return 0
    storage, first = source
    return (storage.data_ptr() + first) % alignment.boundary


def unique_submodules(
    modules: Sequence[nn.Module], exclude: Sequence[nn.Module] = ()
) -> list[nn.Module]:
    """Every module under `modules` once, depth first, skipping the subtrees in `exclude`."""
    skipped = {id(module) for module in exclude}
    seen: dict[int, nn.Module] = {}
    pending = list(reversed(modules))
    while pending:
        module = pending.pop()
        if id(module) in skipped or id(module) in seen:
            continue
        seen[id(module)] = module
        pending.extend(reversed([m for m in module._modules.values() if m is not None]))
    return list(seen.values())


def _collect_slots(
    submodules: Sequence[nn.Module],
) -> dict[int, tuple[torch.Tensor, list[TensorSlot]]]:
    """Map id(tensor) -> (tensor, every slot that holds it), in module traversal order."""
    owners: dict[int, tuple[torch.Tensor, list[TensorSlot]]] = {}
    for module in submodules:
        for table, is_buffer in ((module._parameters, False), (module._buffers, True)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                entry = owners.setdefault(id(tensor), (tensor, []))
                entry[1].append(TensorSlot(module, name, is_buffer))
    return owners


def _check_supported(tensor: torch.Tensor, slot: Slot) -> None:
    if isinstance(tensor, nn.parameter.UninitializedTensorMixin):
        raise RegistrationError(
            f"the {slot.describe()} is lazy (not yet initialised); run one forward or "
            "materialise the module before registering it"
        )
    if not (is_plain(tensor) or is_wrapper(tensor) or is_plain_storage_parameter(tensor)):
        raise RegistrationError(unsupported_message(tensor, slot.describe()))
    _check_dense(tensor, slot)


def _check_reached(tensor: torch.Tensor, slot: Slot) -> None:
    """A wrapper's inner tensor or an attached tensor must be a plain dense tensor."""
    if not is_plain(tensor):
        raise RegistrationError(unsupported_message(tensor, slot.describe()))
    _check_dense(tensor, slot)


def _check_dense(tensor: torch.Tensor, slot: Slot) -> None:
    if tensor.is_meta:
        raise RegistrationError(
            f"the {slot.describe()} is on the meta device and holds no data; load real weights "
            "(for example with load_state_dict(..., assign=True)) before registering the module"
        )
    if tensor.layout != torch.strided:
        raise RegistrationError(
            f"the {slot.describe()} has layout {tensor.layout}; only dense (strided) tensors "
            "can be offloaded"
        )


def _place_in_regions(
    tensors: Sequence[torch.Tensor],
) -> tuple[tuple[TensorPlace, ...], list[tuple[torch.UntypedStorage, int]], list[int]]:
    """Group tensors into regions: each run of overlapping bytes of one storage is one region.

    Tensors that overlap (tied views, a fused weight and its slices) stay views of one region;
    tensors that merely sit in one storage side by side (as they do in our own host master, when a
    group is refreshed) get regions of their own.
    """
    places: list[TensorPlace | None] = [None] * len(tensors)
    sources, nbytes = [], []
    extents = [extent(tensor) for tensor in tensors]
    for run in overlapping_runs(extents):
        region = len(sources)
        sources.append((tensors[run.members[0]].untyped_storage(), run.start))
        nbytes.append(run.end - run.start)
        for i in run.members:
            t = tensors[i]
            places[i] = TensorPlace(region, extents[i].start - run.start, tuple(t.shape),
                                      t.stride(), t.dtype)
    return tuple(places), sources, nbytes  # type: ignore[return-value]


def _lay_out(
    region_nbytes: Sequence[int], region_skew: Sequence[int], chunk_nbytes: int, boundary: int
) -> PackLayout:
    """First-fit in order: regions fill chunks of `chunk_nbytes`; an oversize region gets its own.

    A region starts at a multiple of `boundary` plus its skew (see `Alignment`).
    """
    chunks: list[int] = []
    region_chunk, region_offset = [], []
    open_chunk = None
    for nbytes, skew in zip(region_nbytes, region_skew):
        if skew + nbytes > chunk_nbytes:
            chunks.append(skew + nbytes)
            region_chunk.append(len(chunks) - 1)
            region_offset.append(skew)
            continue
        start = None if open_chunk is None else _aligned(chunks[open_chunk], boundary)
        if start is None or start + skew + nbytes > chunk_nbytes:
            chunks.append(0)
            open_chunk, start = len(chunks) - 1, 0
        offset = start + skew
        chunks[open_chunk] = offset + nbytes
        region_chunk.append(open_chunk)
        region_offset.append(offset)
    return PackLayout(
        chunk_nbytes=tuple(chunks),
        region_chunk=tuple(region_chunk),
        region_offset=tuple(region_offset),
        region_nbytes=tuple(region_nbytes),
        boundary=boundary,
    )
