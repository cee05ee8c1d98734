"""Tensor subclasses in a group: which plain tensors they hold, and wrappers that follow the device.

The inventory (`residency.modules.tensors`) packs and re-points plain tensors only.  This file tells it
which plain tensors a subclass holds, and rebuilds the wrappers whose device is fixed:

* **Traceable wrapper subclasses** (``__tensor_flatten__`` / ``__tensor_unflatten__``: torchao's
  ``Int8Tensor`` and ``Float8Tensor``, torch's ``TwoTensor``) hold no storage of their own; their
  inner tensors (flattened recursively: a wrapper may hold wrappers) are packed and re-pointed.
* **Parameter subclasses with plain storage** (diffusers' ``GGUFParameter``, bitsandbytes'
  ``Params4bit`` and ``Int8Params``) are re-pointed as they are, keeping their class and attributes.
  Tensors *attached* to them (bitsandbytes' ``quant_state.absmax``/``code``/``offset``/``state2``,
  ``CB``/``SCB``), or kept by their module next to them (``Linear4bit.quant_state``,
  ``Linear8bitLt.state.CB``/``SCB``), move with the group too: they are found by walking the
  ``__dict__`` of the parameter, of its module, and of the plain objects those hold.
* Anything else is refused with `unsupported_message`.

It also holds the one rule of "these tensors share bytes", through whatever subclass holds them:
a tensor reads an `Extent` (a byte range of one storage; a wrapper reads its inner tensors'), and
`overlapping_runs` groups extents into runs of overlapping bytes.  The inventory's regions, the
registry's ownership checks, discovery's and layer mode's refusals of tied weights all ask it.

[Note: re-pointing wrapper subclasses]
A wrapper's inner tensors are plain tensors, re-pointed with ``.data = view`` like any other: the
wrapper object keeps reading them, so on a CPU device the wrapper is kept as it is (its identity,
and every reference to it, stay valid; nothing but the plain re-point is paid).  But a wrapper's own
``device`` is fixed when it is built (``_make_wrapper_subclass(..., device=...)``): moved to an
accelerator, its inner tensors would be on ``cuda:0`` while the wrapper still says ``cpu``, and code
that reads ``weight.device`` (casts, dispatch, ``torch.compile``'s fake tensors) would be wrong.
So for each device a group is re-pointed to, `WrapperSet.follow` keeps one *twin* of every wrapper,
rebuilt once with ``__tensor_unflatten__`` around the *same* inner tensor objects (checked at
registration: `check_rebuild_keeps_inner_tensors`), and puts the twin in the module's
``_parameters``/``_buffers`` slot; on eviction the host wrapper goes back.  Because the twins share
the inner tensor objects, re-pointing the inner tensors moves both, the twins are built once per
device for the session, and a swap costs one dict store per wrapper slot.
The trade-off: on an accelerator a wrapper parameter's *identity* changes with residency
(``module.weight`` is the host wrapper while offloaded and its device twin while resident); a
reference kept across a phase change (an optimizer's param list) holds the other one.  Quantized
weights are rarely trained; plain parameters and parameter subclasses never change identity.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from residency.core.errors import RegistrationError

__all__ = [
    "Extent",
    "ModuleSlot",
    "ByteRun",
    "WrapperSet",
    "attached_tensors",
    "check_rebuild_keeps_inner_tensors",
    "extent",
    "first_shared",
    "inner_tensors",
    "is_plain",
    "is_plain_storage_parameter",
    "is_wrapper",
    "leaf_extents",
    "overlapping_runs",
    "storage_key",
    "unsupported_message",
]

#: How deep the walk for attached tensors goes (bitsandbytes: param -> quant_state -> state2 -> absmax).
_ATTACHED_DEPTH = 4
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
#: Attribute values that are never walked into (they hold no quantization state).
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, nn.Module, torch.dtype,
           torch.device, torch.Size, str, bytes, int, float, bool)

Path = tuple[str, ...]


class ModuleSlot(Protocol):
    """A module table entry holding a wrapper (`residency.modules.tensors.TensorSlot` is one)."""

    name: str

    def table(self) -> dict: ...


def is_plain(tensor: torch.Tensor) -> bool:
    """A ``torch.Tensor`` or ``nn.Parameter`` itself, not a subclass."""
    return type(tensor) in _PLAIN_TYPES


def is_wrapper(tensor: torch.Tensor) -> bool:
    """A traceable wrapper subclass: its data are its inner tensors (``__tensor_flatten__``)."""
    return is_traceable_wrapper_subclass(tensor)


def is_plain_storage_parameter(tensor: torch.Tensor) -> bool:
    """A Parameter subclass over ordinary storage (no ``__torch_dispatch__`` of its own)."""
    return (
        isinstance(tensor, nn.Parameter)
        and type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and not is_wrapper(tensor)
    )


def unsupported_message(tensor: torch.Tensor, where: str) -> str:
    """Why `tensor` (found at `where`) cannot be offloaded, and what can."""
    kind = type(tensor)
    return (
        f"the {where} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass the scheduler "
        "cannot move: it is neither a traceable wrapper subclass (__tensor_flatten__/"
        "__tensor_unflatten__, as torchao's quantized tensors are) nor an nn.Parameter subclass "
        "over plain storage (as diffusers' GGUFParameter and bitsandbytes' Params4bit/Int8Params "
        "are). Register modules holding plain tensors, Parameters or those subclasses only, or "
        "leave this module out with exclude="
    )


def inner_tensors(wrapper: torch.Tensor) -> list[tuple[Path, torch.Tensor]]:
    """(attribute path, tensor) of every tensor a wrapper is made of, wrappers flattened too.

        inner_tensors(int8_weight)   # [(("qdata",), t), (("scale",), t), (("zero_point",), t)]

    Leaves may still be subclasses (a wrapper around a GGUFParameter); the caller checks them.
    """
    found = []
    names, _ = wrapper.__tensor_flatten__()
    for name in names:
        inner = getattr(wrapper, name)
        if is_wrapper(inner):
            found.extend(((name, *path), t) for path, t in inner_tensors(inner))
        else:
            found.append(((name,), inner))
    return found


def attached_tensors(parameter: torch.Tensor, owner: nn.Module) -> list[tuple[bool, Path, torch.Tensor]]:
    """(on the module?, attribute path, tensor) of tensors kept with a Parameter subclass.

        attached_tensors(linear4bit.weight, linear4bit)
        # [(False, ("quant_state", "absmax"), t), (False, ("quant_state", "code"), t), ...]

    Walks the parameter's ``__dict__`` and the owner module's non-table attributes, into plain
    Python objects (not modules, types or tensors) up to a small depth.  May list a tensor twice.
    """
    seen: set[int] = {id(parameter), id(owner)}
    found = [(False, path, t) for path, t in _walk(vars(parameter), (), seen, _ATTACHED_DEPTH)]
    module_attrs = {k: v for k, v in vars(owner).items() if not k.startswith("_")}
    found += [(True, path, t) for path, t in _walk(module_attrs, (), seen, _ATTACHED_DEPTH)]
    return found


def _walk(attrs: dict, prefix: Path, seen: set[int], depth: int) -> Iterator[tuple[Path, torch.Tensor]]:
    for name, value in attrs.items():
        if id(value) in seen or value is None:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield (*prefix, name), value
        elif depth > 1 and not isinstance(value, _OPAQUE) and hasattr(value, "__dict__"):
            yield from _walk(vars(value), (*prefix, name), seen, depth - 1)


def rebuild(wrapper: torch.Tensor) -> torch.Tensor:
    """A new wrapper of the same class around `wrapper`'s current inner tensor objects.

    Nested wrappers are rebuilt first, so every level takes its device from the inner tensors.
    """
    names, context = wrapper.__tensor_flatten__()
    inner = {}
    for name in names:
        value = getattr(wrapper, name)
        inner[name] = rebuild(value) if is_wrapper(value) else value
    twin = type(wrapper).__tensor_unflatten__(inner, context, wrapper.size(), wrapper.stride())
    if getattr(wrapper, "_is_param", False):
        twin._is_param = True  # what nn.Parameter(subclass) marks; our own fresh object
    if wrapper.is_leaf and wrapper.requires_grad != twin.requires_grad:
        twin.requires_grad_(wrapper.requires_grad)
    return twin


def check_rebuild_keeps_inner_tensors(wrapper: torch.Tensor, where: str) -> None:
    """Refuse a wrapper class whose ``__tensor_unflatten__`` copies or converts its inner tensors.

    Its device twin would then read tensors the scheduler does not move (see the module note).
    """
    try:
        twin = rebuild(wrapper)
    except Exception as error:  # a third-party constructor: any failure means "cannot rebuild"
        raise RegistrationError(_rebuild_message(wrapper, where, f"failed: {error!r}")) from error
    before = [t for _, t in inner_tensors(wrapper)]
    after = [t for _, t in inner_tensors(twin)]
    if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
        raise RegistrationError(_rebuild_message(wrapper, where, "made new inner tensors"))


def _rebuild_message(wrapper: torch.Tensor, where: str, what: str) -> str:
    return (
        f"the {where} is a {type(wrapper).__qualname__} wrapper whose __tensor_unflatten__ "
        f"{what}; the scheduler rebuilds wrappers around the same inner tensors when they move "
        "to an accelerator, so it cannot offload this class. Leave the module out with exclude="
    )


class WrapperSet:
    """The wrapper subclasses of a group, the slots that hold each, and their twin per device.

        wrappers = WrapperSet([(int8_weight, [slot])], on_swap=structure.expect)
        wrappers.follow(torch.device("cuda", 0))   # slots now hold twins built for cuda:0
        wrappers.follow(torch.device("cpu"))       # the host wrappers are back

    Call `follow` after re-pointing the inner tensors (see [Note: re-pointing wrapper subclasses]).
    `on_swap(table, key, value)` hears of every slot store, so the structure check stays true.
    """

    def __init__(
        self,
        wrappers: list[tuple[torch.Tensor, list[ModuleSlot]]],
        on_swap: Callable[[dict, str, object], None],
    ) -> None:
        self._slots = [slots for _, slots in wrappers]
        #: Per wrapper: device -> the wrapper object for it (the registered one under its device).
        self._twins: list[dict[torch.device, torch.Tensor]] = [
            {_normalised(w.device): w} for w, _ in wrappers
        ]
        self._current = [w for w, _ in wrappers]
        self._on_swap = on_swap

    def __len__(self) -> int:
        return len(self._slots)

    def follow(self, device: torch.device) -> None:
        """Put in every wrapper's slots the twin whose ``device`` is `device` (building it once)."""
        device = _normalised(device)
        for index, twins in enumerate(self._twins):
            twin = twins.get(device)
            if twin is None:
                twin = twins[device] = rebuild(self._current[index])
            if twin is not self._current[index]:
                self._swap(index, twin)

    def _swap(self, index: int, twin: torch.Tensor) -> None:
        previous = self._current[index]
        for slot in self._slots[index]:
            table = slot.table()
            if table.get(slot.name) is previous:  # a slot the user replaced is theirs
                table[slot.name] = twin
                self._on_swap(table, slot.name, twin)
        self._current[index] = twin


def _normalised(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` name one device: compare with the index filled in."""
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            return torch.device(device.type, module.current_device())
    return device


# -- the bytes a tensor reads ---------------------------------------------------------------------


class Extent(NamedTuple):
    """The bytes a plain tensor can read: ``[start, end)`` of the storage `storage` names.

        extent(weight)   # Extent(storage=(device(type='cpu'), 94..), start=0, end=1024)
    """

    #: `storage_key` of the tensor: tensors share bytes only within one storage.
    storage: Hashable
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class ByteRun(NamedTuple):
    """A run of overlapping bytes of one storage (`overlapping_runs`): what packs as one region."""

    storage: Hashable
    start: int
    end: int
    #: Indices of the extents in the run, in byte order (ties in the order given).
    members: tuple[int, ...]


def storage_key(tensor: torch.Tensor) -> Hashable:
    """What tells storages apart: (device, first byte's address).  A tensor on the meta device or
    with an empty storage holds no bytes to share: it is its own storage."""
    if tensor.is_meta:
        return ("object", id(tensor))
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return ("empty", id(tensor))
    return (storage.device, storage.data_ptr())


def extent(tensor: torch.Tensor) -> Extent:
    """The bytes of its storage a plain tensor can read (by its offset, sizes and strides)."""
    itemsize = tensor.element_size()
    start = tensor.storage_offset() * itemsize
    if tensor.numel() == 0:
        return Extent(storage_key(tensor), start, start)
    reach = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return Extent(storage_key(tensor), start, start + reach * itemsize)


def leaf_extents(tensor: torch.Tensor) -> list[tuple[Path, Extent]]:
    """(attribute path, extent) of the plain tensors `tensor` reads: a wrapper subclass's inner
    tensors (`inner_tensors`), or the tensor itself at path ``()``.

        leaf_extents(int8_weight)   # [(("qdata",), Extent(...)), (("scale",), Extent(...)), ...]
    """
    if is_wrapper(tensor):
        return [(path, extent(inner)) for path, inner in inner_tensors(tensor)]
    return [((), extent(tensor))]


def overlapping_runs(extents: Sequence[Extent]) -> list[ByteRun]:
    """The extents grouped into runs of overlapping bytes of one storage, in the order of each
    run's first extent given.

        overlapping_runs([extent(w), extent(w.T), extent(b)])   # [ByteRun(..., members=(0, 1)),
                                                                #  ByteRun(..., members=(2,))]

    Extents that merely sit side by side in one storage are in runs of their own; an extent of
    no bytes joins the run it sits strictly inside (a view of nothing in a region).
    """
    by_storage: dict[Hashable, list[int]] = {}
    for index, found in enumerate(extents):
        by_storage.setdefault(found.storage, []).append(index)
    runs: list[ByteRun] = []
    for key, members in by_storage.items():
        members.sort(key=lambda i: (extents[i].start, extents[i].end))
        run: list[int] = []
        start = end = 0
        for index in members:
            if run and extents[index].start < end:
                end = max(end, extents[index].end)
            else:
                if run:
                    runs.append(ByteRun(key, start, end, tuple(run)))
                run, start, end = [], extents[index].start, extents[index].end
            run.append(index)
        runs.append(ByteRun(key, start, end, tuple(run)))
    return sorted(runs, key=lambda r: min(r.members))


def first_shared(extents: Sequence[Extent], owners: Sequence[Hashable]) -> tuple[int, int] | None:
    """The first two extents of different `owners` (one per extent) that share bytes, as
    (the run's first extent, the first of another owner in it); None when no bytes are shared.

        first_shared([extent(a), extent(b)], ["block 0", "block 1"])   # (0, 1) if a and b overlap

    Extents of no bytes share nothing.
    """
    kept = [i for i, found in enumerate(extents) if found.end > found.start]
    for run in overlapping_runs([extents[i] for i in kept]):
        first = kept[run.members[0]]
        for member in run.members[1:]:
            if owners[kept[member]] != owners[first]:
                return first, kept[member]
    return None
