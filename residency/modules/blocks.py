"""Which blocks a model streams in layer mode, in which order, and which are kept (issue 14).

    chosen = model_blocks(pipe.transformer, path="transformer", resident_layers=1)
    chosen.lists               # ('transformer_blocks', 'single_transformer_blocks')
    chosen.kept, chosen.streamed  # Block(path='transformer_blocks.0', ...), the rest in forward order
    chosen.largest_streamed_nbytes   # the largest streamed block (a slot holds it, aligned)
    print(chosen.describe())

    blocks = pipeline_blocks(pipe, {"transformer": t1, "transformer_2": t2},
                                  {"text_encoder": te}, resident_layers=2)

Pure: reads modules (their tables and declared attributes), moves no tensor, sets no attribute,
logs nothing (``chosen.note`` is the line to log).  Placement (slots, prefetch, wrappers) is the
core's; this file only answers *what* streams.

Where the blocks come from, first match wins (as vLLM-Omni 0.30 reads them, ``offloader/
offload_plan.py``, ``block_discovery.py``, ``plan_resolver.py``):

1. the pipeline's ``_offload_plan`` (read duck-typed: any object with these attributes):
   ``block_attrs`` maps a DiT path to the attributes naming its block lists; ``resident_dit_paths``
   names the DiTs whose leading blocks ``resident_layers`` may keep; ``encoder_block_attrs`` maps an
   encoder path to its block-list paths; ``offload_submodules`` maps a DiT's child name to that
   child's block-list attribute (a large non-DiT submodule, e.g. a context encoder, streamed too);
   ``on_demand_component_paths`` names components whose residency the pipeline owns
   (``load_to_device``/``offload_to_cpu`` in 0.30): here they are swapped whole, never streamed.
   ``encoder_component_types`` is not read (encoders are what the pipeline lists);
   ``encoder_dlo_weight_replication`` concerns all-gather and is read by `residency.pipelines.discovery`.
2. the model class's ``_layerwise_offload_blocks_attrs: ClassVar[list[str]]`` (dotted attributes
   naming block lists), or the deprecated singular ``_layerwise_offload_blocks_attr``.
3. diffusers' own declaration, ``ModelMixin._repeated_blocks`` (the class names of the blocks its
   regional compilation compiles, e.g. ``["WanTransformerBlock"]``; `repeated_block_lists`): the
   outermost ``nn.ModuleList``s whose blocks are all of those classes, in registration order,
   whatever share of the bytes they hold, when they sit in one module (a DiT's stack).  Declared
   classes held in no such list (HunyuanVideo's ``HunyuanVideoPatchEmbed``) are not streamed.
   When none is in a list, or the lists are spread over several modules (a UNet's
   ``BasicTransformerBlock``s, one short list inside each down and up block, registered in another
   order than they run), the declaration is not read and the lists are found.  ``chosen.note``
   names ``_repeated_blocks`` as the source.
4. found (`find_block_lists`): the outermost ModuleLists of repeated blocks (at least 2
   children of one class, all but at most one with identical parameter shapes - T5's first block
   and SD3's last differ), those of one module (the model itself, or e.g. T5's ``encoder``)
   holding at least half the model's parameter bytes, the shallowest such module first.
   ``chosen.note`` says which were chosen.  A UNet has none: its down/up blocks differ in class,
   and its repeated resnets and attentions are spread over several modules, none holding half
   the bytes; it is refused (module mode swaps it whole).  A list of one block is not found
   (nothing repeats): declare it.

Order.  Blocks stream in list order, the lists in declaration order (for Flux
``transformer_blocks`` then ``single_transformer_blocks``), found lists in registration order (the
order the model's ``__init__`` assigned them), which is the order every diffusers DiT runs them.
``offload_submodules`` lists come after the DiT's own lists: streaming is a ring (the last block
prefetches the first for the next step), so a child that runs before the blocks every step is in
the right cyclic place too.  A model that runs blocks in another order (skip-layer guidance, a
subset, a second CFG pass) stays correct - the core loads any block when it is called - and only
loses prefetch overlap.

Kept blocks.  ``resident_layers`` keeps the first N blocks of a DiT's own lists on the device.  With
an ``_offload_plan`` that declares ``resident_dit_paths``, only those DiTs keep blocks (so Wan2.2's second expert
is not kept by accident); without one, every DiT given keeps them (vLLM-Omni 0.30 refuses
``resident_layers`` without ``resident_dit_paths``: a documented extension).  N larger than the
number of blocks keeps them all (nothing streams; ``chosen.note`` says so), as 0.30 clamps.  One
streamed block is accepted (0.30 refuses it when explicit): it simply occupies one slot.

Refused with `ConfigError` (each message says what to do): a declared attribute that does not
resolve, is not an ``nn.ModuleList``/``nn.Sequential`` or is empty; a block listed twice or inside
another block; blocks that share bytes with each other or with the rest of the model (tied weights
cannot stream separately; the tensors are named); a DiT without repeated blocks; blocks whose
``resident_dit_paths`` names none of the DiTs while ``resident_layers`` asks to keep blocks; two
models claiming one block.  vLLM-Omni 0.30 instead warns and treats a non-iterable module as one
block; here a declaration that cannot be honoured as written is refused.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import MappingProxyType

import attrs
from torch import nn

from residency.options.budget import format_nbytes
from residency.core.errors import ConfigError
from residency.modules.subclasses import Extent, first_shared, leaf_extents, overlapping_runs

__all__ = [
    "SOURCES",
    "Block",
    "ModelBlocks",
    "PipelineBlocks",
    "did_you_mean",
    "find_block_lists",
    "follow_path",
    "is_dotted",
    "model_blocks",
    "pipeline_blocks",
    "repeated_block_lists",
    "reread_blocks",
]

#: Where a model's block lists came from, in order of precedence.
SOURCES = ("offload_plan", "class", "repeated_blocks", "found")
#: Found lists must hold at least this share of the model's bytes (less saves little).
MIN_FOUND_SHARE = 0.5
#: The model class's declaration (vLLM-Omni's), and its deprecated singular form.
CLASS_DECLARATION = "_layerwise_offload_blocks_attrs"
OLD_CLASS_DECLARATION = "_layerwise_offload_blocks_attr"
#: diffusers' declaration (``ModelMixin._repeated_blocks``): the class names of repeated blocks.
DIFFUSERS_DECLARATION = "_repeated_blocks"
_LISTS = (nn.ModuleList, nn.Sequential)
_OUTSIDE = -1


@attrs.frozen(kw_only=True)
class Block:
    """One block: its path in the model, the module, its unique bytes (tied tensors once)."""

    #: Dotted path relative to the model, e.g. "transformer_blocks.0".
    path: str
    module: nn.Module = attrs.field(eq=False, repr=False)
    #: Bytes of its tensors' storage spans, overlapping ones counted once.
    nbytes: int


def _check_blocks(chosen: ModelBlocks) -> None:
    if chosen.source not in SOURCES:
        raise ConfigError(f"ModelBlocks source {chosen.source!r}; accepted are {SOURCES}")
    if not chosen.blocks or not chosen.lists:
        raise ConfigError(f"a ModelBlocks for {chosen.model_path!r} needs at least one block list")
    if not 0 <= chosen.kept_count <= chosen.own_count <= len(chosen.blocks):
        raise ConfigError(
            f"a ModelBlocks for {chosen.model_path!r} keeps {chosen.kept_count} of {chosen.own_count} "
            f"own blocks ({len(chosen.blocks)} in all); keep between 0 and {chosen.own_count}"
        )
    if len({id(b.module) for b in chosen.blocks}) != len(chosen.blocks):
        raise ConfigError(f"a ModelBlocks for {chosen.model_path!r} lists one block twice")


@attrs.frozen(kw_only=True)
class ModelBlocks:
    """What one model streams: its blocks in streaming order, the kept prefix, the resident rest.

        chosen = model_blocks(transformer, path="transformer", resident_layers=2)
        for block in chosen.streamed:           # in the order the forward runs them
            ...
        chosen.largest_streamed_nbytes           # the largest streamed block, unaligned

    The group's resident part while its phase is active is everything outside the blocks
    (`outside_nbytes`) plus the kept blocks; each streamed block has a host master of its own
    (`residency.placement.layers`).  Built by `model_blocks`, which checked every rule; validates itself.
    """

    #: The model's path in its pipeline ("transformer"), or its class name when alone.
    model_path: str
    model: nn.Module = attrs.field(eq=False, repr=False)
    #: One of `SOURCES`.
    source: str
    #: Dotted attributes (relative to the model) of the block lists, in streaming order.
    lists: tuple[str, ...] = attrs.field(converter=tuple)
    #: Every block, in streaming order: the kept ones first.
    blocks: tuple[Block, ...] = attrs.field(converter=tuple)
    #: Blocks of the model's own lists (`offload_submodules` lists follow them; never kept).
    own_count: int
    #: How many leading blocks stay on the device.
    kept_count: int
    #: The `lists` that came from ``extra`` (``offload_submodules``: streamed after the model's
    #: own lists, never kept), and the ``resident_layers`` asked for: what `model_blocks` was
    #: given beyond the model, so the choice can be made again (`reread_blocks`).
    extra_lists: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    resident_layers: int = 0
    #: Bytes of every tensor outside the blocks (the resident part), tied ones once.
    outside_nbytes: int
    #: One line on how the blocks were chosen (found lists, clamping), else None.
    note: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_blocks(self)

    @property
    def kept(self) -> tuple[Block, ...]:
        return self.blocks[: self.kept_count]

    @property
    def streamed(self) -> tuple[Block, ...]:
        return self.blocks[self.kept_count :]

    @property
    def largest_streamed(self) -> Block | None:
        """The streamed block a slot must fit (the first of the largest); None if all are kept."""
        return max(self.streamed, key=lambda b: b.nbytes, default=None)

    @property
    def largest_streamed_nbytes(self) -> int:
        """Bytes of the largest streamed block's tensors, before alignment (0 if all are kept).
        Not a slot's size: the allocated slot is `residency.group.residency.slot_nbytes` (aligned,
        per rank)."""
        largest = self.largest_streamed
        return 0 if largest is None else largest.nbytes

    @property
    def nbytes(self) -> int:
        return self.outside_nbytes + sum(b.nbytes for b in self.blocks)

    def device_nbytes(self, slots: int = 2) -> int:
        """Device bytes while the phase runs: outside + kept + `slots` slots (before alignment)."""
        kept = sum(b.nbytes for b in self.kept)
        streamed = min(slots, len(self.streamed)) * self.largest_streamed_nbytes
        return self.outside_nbytes + kept + streamed

    def _class_suffix(self) -> str:
        name = type(self.model).__name__
        return "" if name == self.model_path else f" ({name})"

    def describe(self) -> str:
        """A few lines for the main job's table: source, counts, bytes, the slot's block.

            print(chosen.describe())
            # transformer (FluxTransformer2DModel): 5 blocks in transformer_blocks, ...
        """
        largest = self.largest_streamed
        slot = f"{format_nbytes(largest.nbytes)} ({largest.path})" if largest else "none (all kept)"
        lines = [
            f"{self.model_path}{self._class_suffix()}: {len(self.blocks)} blocks in "
            f"{', '.join(self.lists)} ({self.source}); kept {self.kept_count}, streamed "
            f"{len(self.streamed)}",
            f"  outside the blocks {format_nbytes(self.outside_nbytes)}, kept "
            f"{format_nbytes(sum(b.nbytes for b in self.kept))}, slot {slot}, on the device "
            f"{format_nbytes(self.device_nbytes())} of {format_nbytes(self.nbytes)}",
        ]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


# -- resolving declared lists ---------------------------------------------------------------------


def is_dotted(path: object) -> bool:
    """Whether `path` is attribute names joined by dots ("transformer_blocks", "encoder.block")."""
    return isinstance(path, str) and bool(path) and "" not in path.split(".")


def follow_path(root: object, path: str) -> tuple[object, str, str | None]:
    """Walk dotted `path` from `root`, a module's children first, then attributes: the one path
    resolution of block lists (`model_blocks`) and of a pipeline's components (discovery).

        follow_path(pipe, "prompt_adapter.encoder")  # (encoder, "prompt_adapter.encoder", None)
        follow_path(pipe, "prompt_adapter.encodr")   # (adapter, "prompt_adapter", "encodr")

    Returns (what it reached, the names walked to it, None), or, where a name does not resolve,
    (the last object reached, the names walked to it, that name).  Reads only.
    """
    target, walked = root, []
    for name in path.split("."):
        modules = target._modules if isinstance(target, nn.Module) else {}
        if name in modules:
            target = modules[name]
        else:
            try:
                target = getattr(target, name)
            except AttributeError:
                return target, ".".join(walked), name
        walked.append(name)
    return target, path, None


def did_you_mean(target: object, name: str) -> str:
    """The hint " Did you mean 'x'?", x the name of `target` closest to `name` (its child modules
    and instance attributes first, then any attribute); "" when none is close."""
    children = list(target._modules) if isinstance(target, nn.Module) else []
    instance = [n for n in getattr(target, "__dict__", {}) if not n.startswith("__")]
    for candidates in (children + instance, [n for n in dir(target) if not n.startswith("__")]):
        close = difflib.get_close_matches(name, candidates, n=1)
        if close:
            return f" Did you mean {close[0]!r}?"
    return ""


def _resolve_list(
    model: nn.Module, where: str, attr: object, listed_in: str
) -> Sequence[nn.Module]:
    """The block list at dotted `attr` of `model`; `ConfigError` saying what to fix if none."""
    if not is_dotted(attr):
        raise ConfigError(
            f"{where}: {listed_in} names {attr!r}, which is not a dotted attribute; write "
            "attribute names joined by dots, for example 'transformer_blocks'"
        )
    target, _, missing = follow_path(model, attr)
    if missing is not None:
        raise ConfigError(
            f"{where}: {listed_in} names {attr!r}, which does not resolve: "
            f"{type(target).__name__} has no attribute {missing!r}.{did_you_mean(target, missing)} "
            f"Fix {listed_in}"
        )
    if not isinstance(target, _LISTS):
        raise ConfigError(
            f"{where}: {listed_in} names {attr!r}, which is a {type(target).__name__}, not an "
            "nn.ModuleList of blocks; name the ModuleList that holds the repeated blocks"
        )
    if len(target) == 0:
        raise ConfigError(
            f"{where}: {listed_in} names {attr!r}, an empty {type(target).__name__}; name a list "
            "that holds the blocks, or remove it from the declaration"
        )
    return target


def _declared_attrs(value: object, where: str, listed_in: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Collection) or isinstance(value, Mapping):
        raise ConfigError(
            f"{where}: {listed_in} is {value!r}; it must be a list of dotted attribute names, "
            "for example ['transformer_blocks', 'single_transformer_blocks']"
        )
    return tuple(value)


def class_declaration(model: nn.Module) -> tuple[str, ...] | None:
    """The block lists the model's class declares (vLLM-Omni's ClassVar), or None.

        class MyDiT(nn.Module):
            _layerwise_offload_blocks_attrs = ["blocks"]
        class_declaration(MyDiT())   # ('blocks',)
    """
    cls = type(model)
    declared = getattr(cls, CLASS_DECLARATION, None)
    where = f"{cls.__name__}.{CLASS_DECLARATION}"
    if declared:
        return _declared_attrs(declared, cls.__name__, where)
    old = getattr(cls, OLD_CLASS_DECLARATION, None)
    if old is not None:
        return (old,) if isinstance(old, str) else _declared_attrs(old, cls.__name__, where)
    return None


def repeated_block_lists(model: nn.Module) -> tuple[tuple[str, ...], str] | None:
    """The ModuleLists holding the block classes the model's class names in diffusers'
    ``_repeated_blocks``, and a line saying so; None when it names none, none is in a list, or
    the lists sit in more than one module (see the module docstring).

        repeated_block_lists(wan_transformer)
        # (('blocks',), 'WanTransformer3DModel declares _repeated_blocks ...: blocks (2 x ...)')

    A list counts when it is not inside another counted list and all its blocks are of the
    named classes (matched by class name, as diffusers' ``compile_repeated_blocks`` does).
    """
    cls = type(model)
    declared = getattr(cls, DIFFUSERS_DECLARATION, None)
    if not declared:
        return None
    if isinstance(declared, str) or not isinstance(declared, Collection) or not all(
        isinstance(name, str) for name in declared
    ):
        raise ConfigError(
            f"{cls.__name__}.{DIFFUSERS_DECLARATION} is {declared!r}; it must be a list of block "
            "class names, for example ['WanTransformerBlock']"
        )
    names = list(dict.fromkeys(declared))
    lists: list[str] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(f"{outer}.") for outer in lists):
            continue
        if isinstance(module, nn.ModuleList) and len(module) and all(
            type(block).__name__ in names for block in module
        ):
            lists.append(path)
    if len({path.rpartition(".")[0] for path in lists}) != 1:
        return None
    summary = ", ".join(_list_summary(model, path) for path in lists)
    return tuple(lists), (
        f"{cls.__name__} declares {DIFFUSERS_DECLARATION} {names} (diffusers); streaming "
        f"the lists that hold them: {summary}"
    )


# -- finding lists --------------------------------------------------------------------------------


def _shapes(block: nn.Module) -> tuple:
    return tuple((name, tuple(t.shape), t.dtype)
                 for name, t in (*block.named_parameters(), *block.named_buffers()))


def _is_repeated(candidate: nn.Module) -> bool:
    """At least 2 children of one class holding tensors, all but at most one of one shape set.

    One odd block is allowed: T5's first block carries the relative-attention bias, SD3's last
    block is context-only.
    """
    children = list(candidate._modules.values())
    if len(children) < 2 or len({type(c) for c in children}) != 1:
        return False
    shapes = [_shapes(c) for c in children]
    common = max(shapes.count(s) for s in shapes)
    return all(shapes) and common >= len(shapes) - 1


def _parameter_nbytes(module: nn.Module) -> int:
    """Parameter bytes only: a tiny model's positional-table buffers would skew the share."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def find_block_lists(model: nn.Module) -> tuple[tuple[str, ...], str]:
    """The model's lists of repeated blocks, in registration order, and a line saying why.

    The outermost ModuleLists of repeated blocks (`_is_repeated`) are grouped by the module
    holding them; the first group, shallowest first, whose lists hold at least half the model's
    parameter bytes is chosen (Flux: the model's own two lists; T5: ``encoder.block``).

        find_block_lists(flux_transformer)
        # (('transformer_blocks', 'single_transformer_blocks'), 'found 2 lists of ...')

    Raises `ConfigError` when no lists of repeated blocks hold half the model's bytes (a UNet),
    naming the candidates and how to declare block lists.
    """
    by_parent: dict[str, list[str]] = {}
    inside: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer in inside):
            continue
        if isinstance(module, nn.ModuleList) and _is_repeated(module):
            inside.append(name)
            by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    total = max(_parameter_nbytes(model), 1)
    for parent in sorted(by_parent, key=lambda p: p.count(".") + bool(p)):
        names = by_parent[parent]
        share = sum(_parameter_nbytes(model.get_submodule(n)) for n in names) / total
        if share >= MIN_FOUND_SHARE:
            return tuple(names), _found_line(model, names, share)
    raise ConfigError(_none_found_message(model, inside, total))


def _list_summary(model: nn.Module, name: str) -> str:
    blocks = model.get_submodule(name)
    return f"{name} ({len(blocks)} x {type(blocks[0]).__name__})"


def _found_line(model: nn.Module, names: Sequence[str], share: float) -> str:
    lists = ", ".join(_list_summary(model, n) for n in names)
    return (
        f"{type(model).__name__} declares no block lists; found {len(names)} list"
        f"{'s' if len(names) > 1 else ''} of repeated blocks: {lists}, {share:.0%} of its "
        "parameter bytes"
    )


def _none_found_message(model: nn.Module, candidates: Sequence[str], total: int) -> str:
    cls = type(model).__name__
    seen = ", ".join(
        f"{_list_summary(model, n)} holding "
        f"{_parameter_nbytes(model.get_submodule(n)) / total:.0%}" for n in candidates
    )
    found = (f"only {seen}: no one module's lists hold half" if seen
             else "none (a list of a single block does not count as repeated)")
    return (
        f"{cls} has no list of repeated blocks to stream (nn.ModuleLists of at least 2 blocks "
        f"of one class, in one module, holding at least half its parameter bytes); found "
        f"{found}. Declare the block lists on the class ({CLASS_DECLARATION} = ['blocks']) or "
        "in the pipeline's _offload_plan.block_attrs, or offload this model in module mode"
    )


# -- bytes and tied tensors -----------------------------------------------------------------------


def _walk(root: nn.Module, prefix: str, skip: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) under `root` once each, depth first, not entering modules in `skip`."""
    seen: set[int] = set()
    pending = [(prefix, root)]
    while pending:
        name, module = pending.pop()
        if id(module) in seen or id(module) in skip:
            continue
        seen.add(id(module))
        yield name, module
        children = [(f"{name}.{key}" if name else key, child)
                    for key, child in module._modules.items() if child is not None]
        pending.extend(reversed(children))


def _owned_extents(
    model: nn.Module, blocks: Sequence[Block]
) -> Iterator[tuple[int, str, Extent]]:
    """(owner, path, extent) of every plain tensor (a wrapper's inner ones): owner is the block's
    index, or `_OUTSIDE` for the rest.

    The outside walk does not enter blocks, but does reach a module that is both inside a block
    and elsewhere: its tensors then have two owners, which `_account` refuses.
    """
    roots = [(i, b.path, b.module, set()) for i, b in enumerate(blocks)]
    outside = (_OUTSIDE, "", model, {id(b.module) for b in blocks})
    for owner, prefix, root, skip in [*roots, outside]:
        for name, module in _walk(root, prefix, skip):
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None:
                        slot = f"{name}.{key}" if name else key
                        for path, found in leaf_extents(tensor):
                            yield owner, ".".join((slot, *path)), found


def _owner_name(blocks: Sequence[Block], owner: int) -> str:
    return "outside the blocks" if owner == _OUTSIDE else f"in block {blocks[owner].path!r}"


def _tied_message(where: str, blocks: Sequence[Block], first: tuple, second: tuple) -> str:
    (owner_a, path_a), (owner_b, path_b) = first, second
    return (
        f"{where}: {path_b!r} ({_owner_name(blocks, owner_b)}) shares its bytes with {path_a!r} "
        f"({_owner_name(blocks, owner_a)}); tied weights across blocks cannot stream separately. "
        "Untie them (clone one), or declare block lists that keep both tensors in one block or "
        "both outside the blocks"
    )


def _account(where: str, model: nn.Module, blocks: Sequence[Block]) -> dict[int, int]:
    """Unique bytes per owner; `ConfigError` for bytes shared across owners (tied tensors)."""
    owned = list(_owned_extents(model, blocks))
    owners = [owner for owner, _, _ in owned]
    paths = [path for _, path, _ in owned]
    extents = [found for _, _, found in owned]
    shared = first_shared(extents, owners)
    if shared is not None:
        first, second = shared
        raise ConfigError(_tied_message(where, blocks, (owners[first], paths[first]),
                                        (owners[second], paths[second])))
    nbytes = dict.fromkeys([_OUTSIDE, *range(len(blocks))], 0)
    for run in overlapping_runs(extents):
        nbytes[owners[run.members[0]]] += run.end - run.start
    return nbytes


# -- one model ------------------------------------------------------------------------------------


def _collect_blocks(
    where: str, model: nn.Module, lists: Sequence[str], listed_in: str
) -> list[tuple[str, nn.Module]]:
    """(path, block) of every block of `lists`, in order."""
    return [(f"{attr}.{index}", block)
            for attr in lists
            for index, block in enumerate(_resolve_list(model, where, attr, listed_in))]


def _check_distinct(where: str, blocks: Sequence[tuple[str, nn.Module]], listed_in: str) -> None:
    """No block twice, none inside another (a list declared twice, or a list inside a block)."""
    paths: dict[int, str] = {}
    for path, block in blocks:
        if id(block) in paths:
            other = paths[id(block)]
            raise ConfigError(
                f"{where}: {listed_in} gives one block twice, as {other!r} and {path!r}; "
                "list each block list once"
            )
        paths[id(block)] = path
    for path, block in blocks:
        for inner_path, inner in _walk(block, path, set()):
            if inner is not block and id(inner) in paths:
                raise ConfigError(
                    f"{where}: {listed_in} gives the block {paths[id(inner)]!r}, which sits "
                    f"inside the block {path!r}; declare only the outer list of blocks"
                )


def _choose_lists(
    model: nn.Module, where: str, declared: Sequence[str] | None
) -> tuple[str, tuple[str, ...], str, str | None]:
    """(source, lists, where they were listed, note) by the precedence in the module docstring."""
    if declared is not None:
        return "offload_plan", tuple(declared), f"_offload_plan for {where!r}", None
    from_class = class_declaration(model)
    if from_class is not None:
        return "class", from_class, f"{type(model).__name__}.{CLASS_DECLARATION}", None
    repeated = repeated_block_lists(model)
    if repeated is not None:
        lists, line = repeated
        return ("repeated_blocks", lists, f"{type(model).__name__}.{DIFFUSERS_DECLARATION}",
                line)
    try:
        found, line = find_block_lists(model)
    except ConfigError as error:
        if where == type(model).__name__:
            raise
        raise ConfigError(f"{where}: {error}") from None
    return "found", found, "the found lists", line


def model_blocks(
    model: nn.Module,
    *,
    path: str | None = None,
    declared: Sequence[str] | None = None,
    extra: Sequence[str] = (),
    resident_layers: int = 0,
) -> ModelBlocks:
    """The blocks `model` streams and keeps: from `declared` lists, its class's declaration
    (vLLM-Omni's, then diffusers' ``_repeated_blocks``), or found.

        chosen = model_blocks(transformer, path="transformer", resident_layers=2)
        chosen = model_blocks(dit, declared=["gen_layers"])   # an _offload_plan's block_attrs

    `extra` names further lists streamed after the model's own (``offload_submodules``: a
    child's "context_encoder.layers"); they are never kept.  `resident_layers` larger than the
    model's own blocks keeps them all (a note says so).  Raises `ConfigError` as the module
    docstring lists.
    """
    where = path or type(model).__name__
    if type(resident_layers) is not int or resident_layers < 0:
        raise ConfigError(
            f"{where}: resident_layers is {resident_layers!r}; give a whole number of at least 0"
        )
    source, lists, listed_in, note = _choose_lists(model, where, declared)
    own = _collect_blocks(where, model, lists, listed_in)
    everything = own + _collect_blocks(where, model, extra, "_offload_plan.offload_submodules")
    _check_distinct(where, everything, listed_in)
    blocks = [Block(path=p, module=m, nbytes=0) for p, m in everything]
    nbytes = _account(where, model, blocks)
    kept = min(resident_layers, len(own))
    if resident_layers > len(own):
        note = _join(note, f"resident_layers {resident_layers} is more than the {len(own)} "
                           "blocks: all are kept on the device, none stream")
    return ModelBlocks(
        model_path=where, model=model, source=source, lists=(*lists, *extra),
        blocks=[attrs.evolve(b, nbytes=nbytes[i]) for i, b in enumerate(blocks)],
        own_count=len(own), kept_count=kept, outside_nbytes=nbytes[_OUTSIDE], note=note,
        extra_lists=tuple(extra), resident_layers=resident_layers,
    )


def reread_blocks(chosen: ModelBlocks) -> ModelBlocks:
    """`chosen` made again from the model as it is now, with what it was made from: the same
    declared lists (or the class's, or found again), the same extra lists and ``resident_layers``.

        chosen = reread_blocks(chosen)    # a block replaced in its list is chosen now
    """
    own = chosen.lists[: len(chosen.lists) - len(chosen.extra_lists)]
    return model_blocks(chosen.model, path=chosen.model_path,
                       declared=own if chosen.source == "offload_plan" else None,
                       extra=chosen.extra_lists, resident_layers=chosen.resident_layers)


def _join(note: str | None, more: str) -> str:
    return more if note is None else f"{note}; {more}"


# -- a pipeline -----------------------------------------------------------------------------------


def _proxy(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@attrs.frozen(kw_only=True)
class PipelineBlocks:
    """The blocks of a pipeline's DiTs and encoders, and the encoders swapped whole.

        blocks = pipeline_blocks(pipe, dits, encoders, resident_layers=1)
        blocks.dits["transformer"].streamed
        blocks.whole          # {"text_encoder_2": "no repeated blocks found: ..."}
        print(blocks.describe())
    """

    owner: str
    #: DiT path -> its blocks, in the order given.
    dits: Mapping[str, ModelBlocks] = attrs.field(converter=_proxy, hash=False)
    #: Encoder path -> its blocks, for encoders that stream.
    encoders: Mapping[str, ModelBlocks] = attrs.field(converter=_proxy, hash=False)
    #: Encoder path -> why it is swapped whole instead.
    whole: Mapping[str, str] = attrs.field(converter=_proxy, hash=False)
    #: The DiTs whose leading blocks `resident_layers` keeps.
    keeping: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        owners: dict[int, str] = {}
        for chosen in (*self.dits.values(), *self.encoders.values()):
            for block in chosen.blocks:
                other = owners.setdefault(id(block.module), f"{chosen.model_path}.{block.path}")
                if other != f"{chosen.model_path}.{block.path}":
                    raise ConfigError(
                        f"{self.owner}: the block {chosen.model_path}.{block.path} is also "
                        f"{other}; declare one owner for each block list"
                    )

    def describe(self) -> str:
        lines = [chosen.describe() for chosen in (*self.dits.values(), *self.encoders.values())]
        lines += [f"{path}: swapped whole ({why})" for path, why in self.whole.items()]
        return "\n".join(lines)


def _declared_field(offload_plan: object, name: str, kind: type, owner: str) -> object:
    value = getattr(offload_plan, name, None)
    if value is None:
        return kind()
    wanted = Mapping if kind is dict else Collection
    if not isinstance(value, wanted) or isinstance(value, str):
        raise ConfigError(
            f"{owner}._offload_plan.{name} is {value!r}; it must be a "
            f"{'mapping' if kind is dict else 'set of paths'}, as in vLLM-Omni's OffloadPlan"
        )
    return value


def _keeping(owner: str, offload_plan: object, dits: Mapping, resident_layers: int) -> tuple[str, ...]:
    declared = _declared_field(offload_plan, "resident_dit_paths", frozenset, owner)
    if not declared:
        return tuple(dits)
    keeping = tuple(path for path in dits if path in declared)
    if resident_layers and not keeping:
        raise ConfigError(
            f"{owner}: resident_layers is {resident_layers}, but its _offload_plan's "
            f"resident_dit_paths {sorted(declared)} names none of its DiTs {list(dits)}; fix "
            "resident_dit_paths, or set resident_layers to 0"
        )
    return keeping


def _submodule_lists(owner: str, offload_plan: object, dit: nn.Module) -> tuple[str, ...]:
    declared = _declared_field(offload_plan, "offload_submodules", dict, owner)
    return tuple(f"{child}.{attr}" for child, attr in declared.items() if child in dit._modules)


def _encoder_blocks(
    owner: str, offload_plan: object, path: str, encoder: nn.Module
) -> ModelBlocks | str:
    """The encoder's offload_plan, or why it is swapped whole (declared lists that fail are refused)."""
    if path in _declared_field(offload_plan, "on_demand_component_paths", frozenset, owner):
        return "on demand in the pipeline's _offload_plan"
    declared = _declared_field(offload_plan, "encoder_block_attrs", dict, owner).get(path)
    if declared is not None:
        declared = _declared_attrs(declared, path, f"_offload_plan.encoder_block_attrs[{path!r}]")
        return model_blocks(encoder, path=path, declared=declared)
    if class_declaration(encoder) is None and repeated_block_lists(encoder) is None:
        try:
            find_block_lists(encoder)
        except ConfigError as error:
            return f"no repeated blocks found: {error}"
    return model_blocks(encoder, path=path)


def pipeline_blocks(
    pipeline: object,
    dits: Mapping[str, nn.Module],
    encoders: Mapping[str, nn.Module] = MappingProxyType({}),
    *,
    resident_layers: int = 0,
    owner: str | None = None,
) -> PipelineBlocks:
    """The blocks of the selected DiTs and encoders of `pipeline` (paths -> modules).

        blocks = pipeline_blocks(pipe, {"transformer": pipe.transformer,
                                             "transformer_2": pipe.transformer_2},
                                      {"text_encoder": pipe.text_encoder}, resident_layers=2)

    Reads the pipeline's ``_offload_plan`` duck-typed (see the module docstring for each field;
    `pipeline` may be None: nothing declared).  `owner` names it in messages (default: its class name).
    A DiT must stream (no blocks: `ConfigError`); an encoder streams where its lists are declared
    or found, and is otherwise swapped whole (``blocks.whole`` says why); encoders keep no blocks.
    """
    owner = owner or type(pipeline).__name__
    offload_plan = getattr(pipeline, "_offload_plan", None)
    keeping = _keeping(owner, offload_plan, dits, resident_layers)
    block_attrs = _declared_field(offload_plan, "block_attrs", dict, owner)
    dit_blocks = {}
    for path, dit in dits.items():
        declared = block_attrs.get(path)
        if declared is not None:
            declared = _declared_attrs(declared, path, f"_offload_plan.block_attrs[{path!r}]")
        dit_blocks[path] = model_blocks(
            dit, path=path, declared=declared, extra=_submodule_lists(owner, offload_plan, dit),
            resident_layers=resident_layers if path in keeping else 0,
        )
    encoder_blocks, whole = {}, {}
    for path, encoder in encoders.items():
        result = _encoder_blocks(owner, offload_plan, path, encoder)
        if isinstance(result, str):
            whole[path] = result
        else:
            encoder_blocks[path] = result
    return PipelineBlocks(owner=owner, dits=dit_blocks, encoders=encoder_blocks, whole=whole,
                          keeping=keeping if resident_layers else ())
