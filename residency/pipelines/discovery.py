"""Component discovery: a pipeline names its parts by dotted path; the scheduler is built from that.

    class WanPipeline(SupportsComponentDiscovery, nn.Module):
        _dit_modules = ("transformer", "transformer_2")
        _encoder_modules = ("text_encoder",)
        _vae_modules = ("vae",)

    config = {"mode": "module", "components": ["dit", "text_encoder"]}
    scheduler = Scheduler.from_pipeline(pipe, config)
    with scheduler.resident("text_encoder"):      # the DiTs leave the device
        context = pipe.text_encoder(ids)
    with scheduler.resident("transformer"):       # the encoder and transformer_2 leave
        latents = pipe.transformer(latents, context)

The grouping rule, in one place (`group_components`):

* each selected DiT is its own exclusive group, named by its dotted path; a DiT that is a
  `SplitModel` gives one exclusive group per part and a resident-policy group, named by its path,
  of the model minus its parts (registered with ``exclude=`` the parts, so tensors held directly
  on the model, such as ``pos_embed``, stay on the device too);
* all selected encoders form one exclusive group, ``"text_encoder"``; selected VAEs one exclusive
  group, ``"vae"``;
* the modules of an unselected category keep the same group names but the resident policy: they
  stay on the device.  `_resident_modules` are resident-policy groups named by their paths;
* every listed path (and every part name) is an alias: ``resident("text_encoder.encoder")`` enters
  the group holding that module.

`group_components` and `register_groups` are pure building blocks for adapters that find modules
their own way (the diffusers adapter); `scheduler_from_pipeline` is what
``Scheduler.from_pipeline`` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar, Protocol

import attrs
import torch
from torch import nn

from residency.modules.blocks import ModelBlocks, did_you_mean, follow_path, is_dotted, pipeline_blocks
from residency.options.vllm_omni import OffloadConfig, resolve_config
from residency.core.enums import Policy
from residency.core.errors import ConfigError
from residency.group.no_offload import NoOffload
from residency.group.registry import check_modules_unowned, check_tensors_disjoint
from residency.pipelines.split import split_parts
from residency.modules.tensors import unique_submodules
from residency.device.transport import free_device_memory
from residency.options.budget import format_nbytes

__all__ = [
    "ENCODER_GROUP",
    "VAE_GROUP",
    "ComponentGroups",
    "Member",
    "SupportsComponentDiscovery",
    "register_groups",
    "build_scheduler",
    "check_transfers_have_ranks",
    "declares_components",
    "group_components",
    "module_mode_cost",
    "note_module_mode_cost",
    "resolve_path",
    "scheduler_from_pipeline",
    "stage_note",
]

#: One listed module: its dotted path from the pipeline and the module.
Member = tuple[str, nn.Module]


class Registrar(Protocol):
    """What `register_groups` needs of a scheduler (`Scheduler` and `NoOffload` both are one).

    Discovery sits below the scheduler: it is handed one (or a factory), never imports it.
    """

    def add(self, name: str, modules, *, policy, exclude, category) -> object: ...
    def alias(self, path: str, name: str) -> None: ...
    def remove(self, name: str) -> object: ...
    def close(self) -> None: ...
    def __contains__(self, name: object) -> bool: ...

_log = logging.getLogger("residency")

#: The name of the one group all selected encoders share.
ENCODER_GROUP = "text_encoder"
#: The name of the one group all VAE modules share.
VAE_GROUP = "vae"

_DECLARATIONS = ("_dit_modules", "_encoder_modules", "_vae_modules", "_resident_modules")


class SupportsComponentDiscovery:
    """Mixin for a pipeline that lists its components by dotted path; subclass beside `nn.Module`.

    Optional: `from_pipeline` reads the four ClassVars from any class that declares them all, so a
    vLLM-Omni pipeline (which subclasses vLLM-Omni's own ``SupportsComponentDiscovery``) works
    unchanged; this mixin gives each an empty default.

        class MyPipeline(SupportsComponentDiscovery, nn.Module):
            _dit_modules = ("transformer",)
            _encoder_modules = ("text_encoder", "prompt_adapter.encoder")
            _vae_modules = ("vae",)
            _resident_modules = ("scheduler_embeddings",)

        scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]})

    Paths are resolved with ``getattr`` from the pipeline, part by part.  See the module docstring
    for which groups they become.
    """

    #: Dotted paths of the denoising transformers; each is its own exclusive group when selected.
    _dit_modules: ClassVar[tuple[str, ...]] = ()
    #: Dotted paths of the text (and other condition) encoders; one group, "text_encoder".
    _encoder_modules: ClassVar[tuple[str, ...]] = ()
    #: Dotted paths of the VAE modules; one group, "vae" (resident unless "vae" is selected).
    _vae_modules: ClassVar[tuple[str, ...]] = ()
    #: Dotted paths of modules that always stay on the device, each a group named by its path.
    _resident_modules: ClassVar[tuple[str, ...]] = ()


def _proxy(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@attrs.frozen(kw_only=True)
class ComponentGroups:
    """Which groups a pipeline's modules form: group name -> its members ((path, module) pairs).

        found = group_components("MyPipeline", dits, encoders, vaes, residents, config)
        register_groups(scheduler, found)
        with scheduler.resident(next(iter(found.exclusive))):
            ...

    A group's modules are the outermost of its members (a member nested in another member of the
    same group adds only an alias), less the subtrees `excluded` names for it (a split model's
    shared group leaves out its parts).  Built by `group_components`, which has checked every rule.
    """

    #: The pipeline's class name, for messages.
    owner: str
    #: Exclusive groups (swapped by phases), in registration order.
    exclusive: Mapping[str, tuple[Member, ...]] = attrs.field(converter=_proxy, hash=False)
    #: Resident-policy groups (always on the device), in registration order.
    resident: Mapping[str, tuple[Member, ...]] = attrs.field(converter=_proxy, hash=False)
    #: Module path or part name -> group name, for ``resident(path)`` (group names excluded).
    aliases: Mapping[str, str] = attrs.field(converter=_proxy, hash=False)
    #: Split models whose `scheduler` attribute `register_groups` sets, with their paths.
    split_models: tuple[Member, ...] = ()
    #: Group name -> submodules left out of it, with all under them (``Scheduler.add(exclude=)``);
    #: only groups that leave something out are listed.
    excluded: Mapping[str, tuple[nn.Module, ...]] = attrs.field(
        factory=dict, converter=_proxy, hash=False
    )
    #: Group name -> the config component it was made for ("dit", "text_encoder", "vae"); groups
    #: of `_resident_modules` have none.
    categories: Mapping[str, str] = attrs.field(factory=dict, converter=_proxy, hash=False)
    #: Layer mode: group name -> the block plans its stream follows (``Scheduler.add(layers=)``);
    #: only groups that stream are listed.
    blocks: Mapping[str, tuple[ModelBlocks, ...]] = attrs.field(
        factory=dict, converter=_proxy, hash=False
    )
    #: Group name -> "allgather" for groups whose ranks split each copy (the config's
    #: ``module_options`` / ``layer_options``); groups not listed are "rank-local".
    weight_transfers: Mapping[str, str] = attrs.field(factory=dict, converter=_proxy, hash=False)
    #: One line on what offloading does for a pipeline missing a stage (`stage_note`), else None.
    note: str | None = None

    def groups(self) -> Iterator[tuple[str, Policy, tuple[nn.Module, ...], tuple[nn.Module, ...]]]:
        """(name, policy, modules, excluded) of every group: exclusive groups first.

            for name, policy, modules, excluded in found.groups():
                scheduler.add(name, modules, policy=policy, exclude=excluded)
        """
        for policy, table in ((Policy.EXCLUSIVE, self.exclusive), (Policy.RESIDENT, self.resident)):
            for name, members in table.items():
                yield name, policy, _outermost(members), self.excluded.get(name, ())

    def members(self) -> Iterator[tuple[str, str, nn.Module]]:
        """(group name, path, module) of every listed module (less ``excluded[group]``)."""
        for table in (self.exclusive, self.resident):
            for name, members in table.items():
                for path, module in members:
                    yield name, path, module


def _outermost(members: Sequence[Member]) -> tuple[nn.Module, ...]:
    modules = [module for _, module in members]
    nested = {
        id(inner)
        for outer in modules
        for inner in outer.modules()
        if inner is not outer
    }
    return tuple(m for m in modules if id(m) not in nested)


# -- planning -----------------------------------------------------------------------------------


def group_components(
    owner_name: str,
    dits: Mapping[str, nn.Module],
    encoders: Mapping[str, nn.Module],
    vaes: Mapping[str, nn.Module],
    residents: Mapping[str, nn.Module],
    config: OffloadConfig | None,
    *,
    companions: Mapping[str, Mapping[str, nn.Module]] = MappingProxyType({}),
    pipeline: object = None,
) -> ComponentGroups:
    """Group a pipeline's modules (each keyed by its dotted path) as `config` selects.

    `config` None means offloading is off: every category is planned resident (for `NoOffload`).

        found = group_components("WanPipeline", {"transformer": t1, "transformer_2": t2},
                               {"text_encoder": te}, {"vae": vae}, {}, config)

    `companions` maps a DiT's path to modules that run inside each of its steps (a ControlNet):
    they join that DiT's group, so a step never swaps (for a split model: its shared group).
    In layer mode the selected DiTs and encoders get block plans (`layer_blocks`; `pipeline`'s
    ``_offload_plan`` is read there).

    Pure: reads the modules, changes nothing.  Raises `ConfigError` (naming `owner_name` and the
    path) for layer mode, a module listed twice, a module nested inside a listed module of another
    group (outside the subtrees that group leaves out), split-model parts that do not resolve or
    contain each other.  A pipeline with no DiT or no encoder is accepted: ``found.note`` says what
    offloading does for it (`stage_note`).
    """
    selected: set[str] = set()
    if config is not None:
        config.require_runnable()
        selected = set(config.components)
    builder = _GroupsBuilder(owner_name)
    for path, dit in dits.items():
        builder.add_dit(path, dit, offload="dit" in selected,
                        companions=tuple(companions.get(path, {}).items()))
    if encoders:
        builder.add(ENCODER_GROUP, _policy("text_encoder", selected), encoders.items(),
                    category="text_encoder")
    if vaes:
        builder.add(VAE_GROUP, _policy("vae", selected), vaes.items(), category="vae")
    for path, module in residents.items():
        builder.add(path, Policy.RESIDENT, [(path, module)])
    found = builder.build()
    return attrs.evolve(
        found, note=stage_note(found, dits, encoders, selected),
        blocks=layer_blocks(found, config, pipeline, dits, encoders),
        weight_transfers=_weight_transfers(found, config, pipeline, encoders),
    )


def layer_blocks(
    found: ComponentGroups,
    config: OffloadConfig | None,
    pipeline: object,
    dits: Mapping[str, nn.Module],
    encoders: Mapping[str, nn.Module],
) -> dict[str, tuple[ModelBlocks, ...]]:
    """Layer mode: group name -> the block plans of its streamed modules (module mode: {}).

    Each selected DiT streams its blocks (`residency.modules.blocks.pipeline_blocks`: declared by
    the pipeline's ``_offload_plan`` or the class - vLLM-Omni's declaration, then diffusers'
    ``_repeated_blocks`` - else found, each model's blocks' source logged at INFO; ``resident_layers``
    keeps leading blocks); a selected encoder streams where its blocks are declared or found and
    is otherwise swapped whole with the rest of the encoder group (vLLM-Omni 0.30 refuses a
    selected text encoder without declared blocks: an extension).  A split model's parts are
    refused.
    """
    if config is None or config.mode != "layer":
        return {}
    selected = set(config.components)
    if "vae" in selected:
        _note_vae_swapped_whole(found.owner, selected)
    streamed_dits = {p: m for p, m in dits.items() if "dit" in selected}
    for path, dit in streamed_dits.items():
        if split_parts(dit):
            raise ConfigError(
                f"{found.owner}: {path!r} is a split model ({', '.join(split_parts(dit))}); layer "
                "mode streams the blocks of whole DiTs only. Use \"mode\": \"module\" for it"
            )
    streamed_encoders = dict(encoders) if "text_encoder" in selected else {}
    resident = config.options_for("dit").resident_layers if "dit" in selected else 0
    found = pipeline_blocks(pipeline, streamed_dits, streamed_encoders,
                                 resident_layers=resident, owner=found.owner)
    for path, why in found.whole.items():
        _log.info("%s: %s is swapped whole in layer mode (%s)", found.owner, path, why)
    for path, streamed in (*found.dits.items(), *found.encoders.items()):
        _log.info("%s: %s streams %d block(s) in layer mode (%s)%s", found.owner, path,
                  len(streamed.blocks), streamed.source,
                  "" if streamed.note is None else f": {streamed.note}")
    plans = {path: (dit_plan,) for path, dit_plan in found.dits.items()}
    if found.encoders:
        plans[ENCODER_GROUP] = tuple(found.encoders.values())
    return plans


def _note_vae_swapped_whole(owner: str, selected: set[str]) -> None:
    """Layer mode streams DiTs and text encoders only: say once what a selected VAE gets instead
    (a warning when nothing else was selected, so the mode does nothing a module config would
    not)."""
    if selected == {"vae"}:
        _log.warning("%s: layer mode streams the blocks of DiTs and text encoders, and the config "
                     "selects only the VAE: it is swapped whole, exactly as {\"mode\": "
                     "\"module\", \"components\": [\"vae\"]} does; add \"dit\" to stream "
                     "the DiTs", owner)
    else:
        _log.info("%s: the VAE is swapped whole in layer mode (layer mode streams the blocks of "
                  "DiTs and text encoders only)", owner)


def _weight_transfers(
    found: ComponentGroups, config: OffloadConfig | None, pipeline: object,
    encoders: Mapping[str, nn.Module],
) -> dict[str, str]:
    """Group name -> "allgather" where the config asks the ranks to split a component's copy."""
    if config is None:
        return {}
    gathered = config.allgathered()
    transfers = {name: "allgather" for name in found.exclusive
                 if found.categories.get(name) in gathered}
    if transfers.get(ENCODER_GROUP) == "allgather":
        _check_encoders_replicated(found.owner, pipeline, encoders)
    return transfers


def check_transfers_have_ranks(owner: str, config: OffloadConfig | None, process_group) -> None:
    """Refuse, before anything is registered, a config that all-gathers a component when no
    process group was given (the ranks that would split the copy).

        check_transfers_have_ranks("WanPipeline", config, process_group=None)
    """
    if config is None or process_group is not None:
        return
    gathered = list(config.allgathered())
    if gathered:
        raise ConfigError(
            f"{owner}: the offload config gives {gathered} weight_transfer 'allgather', which "
            "splits each copy among the ranks of a node, and no process_group was given; pass "
            "process_group= (the job's torch.distributed group, e.g. dist.group.WORLD), or give "
            "them \"weight_transfer\": \"rank-local\""
        )


def _check_encoders_replicated(owner: str, pipeline: object, encoders: Mapping) -> None:
    """All-gathered encoders must be declared replicated where the pipeline declares an
    ``_offload_plan`` (its ``encoder_dlo_weight_replication``, as vLLM-Omni 0.30 requires: encoder
    tensor-parallel shards differ between ranks).  Declared or not, the ranks' bytes are compared
    again at registration (`residency.multirank.agreement.compare_weights`): a declaration is not trusted."""
    offload_plan = getattr(pipeline, "_offload_plan", None)
    if offload_plan is None:
        return
    declared = getattr(offload_plan, "encoder_dlo_weight_replication", None) or frozenset()
    missing = [path for path in encoders if path not in declared]
    if missing:
        raise ConfigError(
            f"{owner}: the offload config all-gathers the text encoders, but {missing} are not in "
            f"its _offload_plan.encoder_dlo_weight_replication {sorted(declared)}: only encoders "
            "whose weights are the same on every rank may all-gather. Give text_encoder "
            "\"weight_transfer\": \"rank-local\", or declare them replicated"
        )


def _policy(component: str, selected: set[str]) -> Policy:
    return Policy.EXCLUSIVE if component in selected else Policy.RESIDENT


def stage_note(found: ComponentGroups, dits: Mapping, encoders: Mapping, selected) -> str | None:
    """The one line that says what module mode does for a pipeline missing a stage, else None.

        note = stage_note(found, {"transformer": t}, {}, {"dit", "text_encoder"})
        # "DiTPipeline has no encoder: 'transformer' is its only exclusive group, so ..."

    The rule for a pipeline with no DiT or no encoder, in one place (`group_components` stores the
    line as ``found.note``; `register_groups` logs it).  As vLLM-Omni 0.30 does with the legacy
    switch, such a pipeline is accepted, not refused; unlike 0.30 (which then offloads nothing,
    and refuses an explicit config), the selected modules it has are still offloaded.
    """
    if not {"dit", "text_encoder"} & set(selected):
        return None
    missing = [kind for kind, listed in (("DiT", dits), ("encoder", encoders)) if not listed]
    if not missing:
        return None
    has = f"{found.owner} has no {' and no '.join(missing)}"
    exclusive = list(found.exclusive)
    if not exclusive:
        return f"{has}: the offload config selects none of its modules, so nothing is offloaded"
    if len(exclusive) == 1:
        hint = " (select 'vae' as well to make it take turns with the VAE)"
        return (
            f"{has}: {exclusive[0]!r} is its only exclusive group, so it has nothing to take turns "
            f"with and stays on the device from its first phase on"
            f"{hint if VAE_GROUP in found.resident else ''}"
        )
    return f"{has}: its exclusive groups {exclusive} take turns on the device"


class _GroupsBuilder:
    """Collects groups and aliases for `group_components`; `build` checks them all."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.groups: list[tuple[str, Policy, tuple[Member, ...], tuple[nn.Module, ...]]] = []
        self.aliases: dict[str, str] = {}
        self.split_models: list[Member] = []
        self.categories: dict[str, str] = {}
        self._resident_part_names: set[str] = set()

    def add(
        self,
        name: str,
        policy: Policy,
        members,
        excluded: tuple[nn.Module, ...] = (),
        *,
        category: str | None = None,
    ) -> None:
        members = tuple(members)
        self.groups.append((name, policy, members, excluded))
        if category is not None:
            self.categories.setdefault(name, category)
        for path, _ in members:
            self.alias(path, name)

    def alias(self, path: str, name: str) -> None:
        if path == name:
            return
        if self.aliases.get(path, name) != name:
            raise ConfigError(
                f"{self.owner}: {path!r} would lead to two groups, {self.aliases[path]!r} and "
                f"{name!r}; give split-model parts names that are unique in the pipeline"
            )
        self.aliases[path] = name

    def add_dit(
        self, path: str, dit: nn.Module, *, offload: bool, companions: tuple[Member, ...] = ()
    ) -> None:
        parts = split_parts(dit)
        if parts:
            self.split_models.append((path, dit))
        if not (parts and offload):
            self.add(path, Policy.EXCLUSIVE if offload else Policy.RESIDENT,
                     [(path, dit), *companions], category="dit")
            for part in parts:
                # Entering any resident-policy group does the same (nothing), so when two
                # resident split models share a part name, the first one's group serves both.
                if part not in self._resident_part_names:
                    self.alias(part, path)
                    self._resident_part_names.add(part)
            return
        part_members = _resolve_parts(self.owner, path, dit, parts)
        for part, members in part_members.items():
            self.add(part, Policy.EXCLUSIVE, members, category="dit")
        part_modules = tuple(m for members in part_members.values() for _, m in members)
        if companions or _has_tensors_outside(dit, part_modules):
            self.add(path, Policy.RESIDENT, [(path, dit), *companions], excluded=part_modules,
                     category="dit")

    def build(self) -> ComponentGroups:
        excluded = {name: modules for name, _, _, modules in self.groups if modules}
        listed = [(name, path, module)
                  for name, _, members, _ in self.groups for path, module in members]
        _check_disjoint(self.owner, listed, excluded)
        tables: dict[Policy, dict[str, tuple[Member, ...]]] = {p: {} for p in Policy}
        for name, policy, members, _ in self.groups:
            if any(name in table for table in tables.values()):
                raise ConfigError(
                    f"{self.owner}: two groups would be named {name!r} (the second from path "
                    f"{members[0][0]!r}); group names come from DiT paths, resident-module "
                    f"paths, split-model parts, {ENCODER_GROUP!r} and {VAE_GROUP!r}: rename "
                    "the attribute or the part"
                )
            tables[policy][name] = members
        found = ComponentGroups(
            owner=self.owner,
            exclusive=tables[Policy.EXCLUSIVE],
            resident=tables[Policy.RESIDENT],
            aliases=self.aliases,
            split_models=tuple(self.split_models),
            excluded=excluded,
            categories=self.categories,
        )
        _check_alias_names(found)
        return found


def _resolve_parts(
    owner: str, path: str, dit: nn.Module, parts: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[Member, ...]]:
    resolved = {}
    for part, part_paths in parts.items():
        listed_in = f"{type(dit).__name__}._split_parts[{part!r}]"
        if not part_paths:
            raise ConfigError(
                f"{owner}: {listed_in} (the split model at {path!r}) lists no paths; give the "
                "part at least one dotted path, relative to the model"
            )
        resolved[part] = tuple(
            (f"{path}.{sub}", resolve_path(owner, dit, sub, listed_in=listed_in, prefix=path))
            for sub in part_paths
        )
    return resolved


def _group_tensors(module: nn.Module, excluded: Sequence[nn.Module]) -> Iterator[torch.Tensor]:
    """Every tensor under `module`, outside the subtrees in `excluded` (tied ones once per slot)."""
    for submodule in unique_submodules([module], excluded):
        for table in (submodule._parameters, submodule._buffers):
            yield from (tensor for tensor in table.values() if tensor is not None)


def _has_tensors_outside(model: nn.Module, parts: Sequence[nn.Module]) -> bool:
    """Whether `model` holds a tensor outside `parts`: directly, or in any other submodule."""
    return next(_group_tensors(model, parts), None) is not None


def _check_disjoint(
    owner: str,
    members: Sequence[tuple[str, str, nn.Module]],
    excluded: Mapping[str, Sequence[nn.Module]],
) -> None:
    """Each module listed once; no listed module inside a listed module of another group.

    A module inside a subtree that the other group leaves out (`excluded`) is not in that group:
    a split model's parts sit inside the model, whose shared group excludes them.
    """
    seen: dict[int, tuple[str, str]] = {}
    for group, path, module in members:
        if id(module) in seen:
            other_group, other_path = seen[id(module)]
            raise ConfigError(
                f"{owner}: the {type(module).__name__} at {path!r} (group {group!r}) is listed "
                f"twice: it is also {other_path!r} (group {other_group!r}); a module belongs to "
                "one group: list it once"
            )
        seen[id(module)] = (group, path)
    containers = [
        (group, path, {id(m) for m in unique_submodules([module], excluded.get(group, ()))}
         - {id(module)})
        for group, path, module in members
    ]
    for group, path, module in members:
        for other_group, other_path, inside in containers:
            if other_group != group and id(module) in inside:
                raise ConfigError(
                    f"{owner}: {path!r} (group {group!r}) is nested inside {other_path!r} (group "
                    f"{other_group!r}); a module belongs to one group: remove {path!r} from its "
                    f"list, or list it in the same category as {other_path!r}"
                )


def _check_alias_names(found: ComponentGroups) -> None:
    names = set(found.exclusive) | set(found.resident)
    for alias, group in found.aliases.items():
        if alias in names:
            raise ConfigError(
                f"{found.owner}: {alias!r} names group {alias!r} and is also a path or part of "
                f"group {group!r}; rename the attribute or the part so that each name means one "
                "group"
            )


# -- paths --------------------------------------------------------------------------------------


def resolve_path(
    owner: str, root: object, path: str, *, listed_in: str, prefix: str = ""
) -> nn.Module:
    """The module at dotted `path` from `root`; `ConfigError` (with the nearest name) if none.

        resolve_path("MyPipeline", pipe, "prompt_adapter.encoder", listed_in="_encoder_modules")
    """
    shown = f"{prefix}.{path}" if prefix else path
    if not is_dotted(path):
        raise ConfigError(
            f"{owner}: {listed_in} lists {shown!r}, which is not a dotted path; write attribute "
            "names joined by dots, for example 'text_encoder' or 'prompt_adapter.encoder'"
        )
    target, walked, missing = follow_path(root, path)
    if missing is not None:
        walked = ".".join(part for part in (prefix, walked) if part)
        raise ConfigError(
            f"{owner}: {listed_in} lists {shown!r}, which does not resolve: "
            f"{type(target).__name__} at {repr(walked) if walked else 'the top'} has no "
            f"attribute {missing!r}.{did_you_mean(target, missing)} Fix the path in {listed_in}"
        )
    if not isinstance(target, nn.Module):
        raise ConfigError(
            f"{owner}: {listed_in} lists {shown!r}, which is a {type(target).__name__}, not an "
            "nn.Module; list module paths only"
        )
    return target


def declares_components(pipeline: object) -> bool:
    """Whether `pipeline`'s class declares all four component ClassVars (mixin or not).

        declares_components(wan_pipe)   # True for a SupportsComponentDiscovery subclass
    """
    return all(hasattr(type(pipeline), declaration) for declaration in _DECLARATIONS)


def _undeclared_message(pipeline: object) -> str:
    owner = type(pipeline).__name__
    if any(c.__name__ == "DiffusionPipeline" and c.__module__.startswith("diffusers")
           for c in type(pipeline).__mro__):
        return (
            f"{owner} is a diffusers pipeline, which does not declare its components the "
            "vLLM-Omni way; offload it with residency.adapters.diffusers.enable_offload(pipe, "
            "config), which finds its components itself"
        )
    missing = [d for d in _DECLARATIONS if not hasattr(type(pipeline), d)]
    return (
        f"{owner} does not declare its components: its class has no {', '.join(missing)}; list "
        "dotted paths in _dit_modules, _encoder_modules, _vae_modules and _resident_modules (an "
        "empty tuple for none), or subclass SupportsComponentDiscovery, which gives each an empty "
        "default"
    )


def _declared_modules(pipeline: object, declaration: str) -> dict[str, nn.Module]:
    owner = type(pipeline).__name__
    paths = getattr(type(pipeline), declaration)
    if isinstance(paths, str) or not isinstance(paths, (tuple, list)):
        raise ConfigError(
            f"{owner}.{declaration} is {paths!r}; it must be a tuple of dotted paths, for "
            "example ('transformer',)"
        )
    modules: dict[str, nn.Module] = {}
    for path in paths:
        if path in modules:
            raise ConfigError(
                f"{owner}: {declaration} lists {path!r} twice; a module belongs to one group: "
                "list it once"
            )
        modules[path] = resolve_path(owner, pipeline, path, listed_in=f"{owner}.{declaration}")
    return modules


# -- applying -----------------------------------------------------------------------------------


def register_groups(scheduler: Registrar, found: ComponentGroups) -> None:
    """Register the groups found and their aliases on `scheduler` and attach its split models.

        groups = group_components("MyPipeline", dits, encoders, vaes, {}, config)
        register_groups(Scheduler("cuda"), groups)

    Each group is added with ``exclude=`` its excluded subtrees and its category.

    All or nothing, in one way: on any exception - a refused or failed ``add``, an interrupt at
    any line - every group found that the scheduler did not hold before is removed (with its
    aliases) and the split models get their previous scheduler back, before the error
    propagates.  Their ownership rules are read first (modules another scheduler owns,
    tensors two groups would share: `ConfigError`, unless offloading is off), not for atomicity
    but so that a refused registration moves no tensor: a removed group's weights stay in its host
    master, where an ``add`` put them.
    """
    if not isinstance(scheduler, NoOffload):
        check_modules_unowned(found.owner, _member_submodules(found))
        check_tensors_disjoint(found.owner, _member_tensors(found))
        if found.note is not None:
            _log.warning("%s", found.note)
    names = [name for name, _, _, _ in found.groups()]
    held = {name for name in names if name in scheduler}  # `add` refuses these: never removed
    attached = [(model, vars(model).get("scheduler")) for _, model in found.split_models]
    try:
        for name, policy, modules, excluded in _in_phase_order(found):
            category = found.categories.get(name)
            scheduler.add(name, modules, policy=policy, exclude=excluded, category=category,
                          **_layer_mode_options(found, name))
        for path, name in found.aliases.items():
            scheduler.alias(path, name)
        for model, _ in attached:
            model.scheduler = scheduler
    except BaseException:
        _undo_plan(scheduler, [n for n in names if n not in held], attached)
        raise


#: Where each category's phase comes in a pipeline call: the prompt is encoded, the latents
#: denoised, then decoded.  Groups of other categories keep their place among the denoisers.
_PHASE_RANK = {"text_encoder": 0, "dit": 1, "vae": 2}


def _in_phase_order(found: ComponentGroups):
    """`found.groups()`: the exclusive groups in the order a call first uses them (encoders,
    denoisers in their own order - Wan2.2's high-noise expert first -, the VAE), then the
    resident ones as they are (all load at once).  A scheduler that reads masters behind the
    first phase reads them in the order they are added (`residency.host.read_behind`)."""
    def rank(group) -> tuple[bool, int]:
        name, policy = group[0], group[1]
        if policy is not Policy.EXCLUSIVE:
            return True, 0
        return False, _PHASE_RANK.get(found.categories.get(name), _PHASE_RANK["dit"])

    return sorted(found.groups(), key=rank)


def _undo_plan(scheduler: Registrar, names: Sequence[str], attached) -> None:
    """What `register_groups` did, undone from what the scheduler holds (not from a list the
    interrupted code may not have written yet)."""
    for model, previous in attached:
        if previous is None:
            vars(model).pop("scheduler", None)
        else:
            model.scheduler = previous
    for name in reversed(names):
        if name in scheduler:
            scheduler.remove(name)


def _layer_mode_options(found: ComponentGroups, name: str) -> dict[str, object]:
    """``add`` keywords beyond module mode's, for the groups that have them: the blocks a group
    streams (``layers=``) and a non-default weight transfer."""
    given = (("layers", found.blocks), ("weight_transfer", found.weight_transfers))
    return {keyword: values[name] for keyword, values in given if name in values}


def build_scheduler(found: ComponentGroups, make_scheduler: Callable[[], Registrar]) -> Registrar:
    """A new scheduler with the groups `found` registered; closed again if they cannot be.

        scheduler = build_scheduler(found, lambda: Scheduler(device))
    """
    scheduler = make_scheduler()
    try:
        register_groups(scheduler, found)
    except BaseException:
        scheduler.close()
        raise
    return scheduler


def _member_submodules(found: ComponentGroups) -> Iterator[tuple[str, nn.Module]]:
    for group, path, module in found.members():
        for submodule in unique_submodules([module], found.excluded.get(group, ())):
            yield path, submodule


def _member_tensors(found: ComponentGroups) -> Iterator[tuple[str, str, Iterable[torch.Tensor]]]:
    for group, path, module in found.members():
        yield group, path, _group_tensors(module, found.excluded.get(group, ()))


def scheduler_from_pipeline(
    make_scheduler: Callable[..., Registrar],
    pipeline: object,
    config: object = None,
    *,
    enable_cpu_offload: object = False,
    device=None,
    process_group: object = None,
) -> Registrar:
    """The scheduler for a pipeline that declares its components (``Scheduler.from_pipeline``).

        scheduler = Scheduler.from_pipeline(pipe, '{"mode": "module", "components": ["dit"]}')

    `config` is an `OffloadConfig`, a mapping, a JSON string or None; with None and no
    `enable_cpu_offload`, offloading is off and a `NoOffload` (modules moved to `device` when given)
    is returned.  See the module docstring for the grouping rules.  Mode "auto" registers the
    groups module mode registers (no ``layers=``) on a scheduler made with
    ``auto=config.auto_options``, whose plan then places them.
    """
    parsed = resolve_config(config, enable_cpu_offload=enable_cpu_offload)
    owner = type(pipeline).__name__
    if not declares_components(pipeline):
        raise ConfigError(_undeclared_message(pipeline))
    dits, encoders, vaes, residents = (_declared_modules(pipeline, d) for d in _DECLARATIONS)
    check_transfers_have_ranks(owner, parsed, process_group)
    found = group_components(owner, dits, encoders, vaes, residents, parsed, pipeline=pipeline)
    if parsed is None:
        return build_scheduler(found, lambda: NoOffload(device))
    pin_memory = None if parsed.pin_memory else False
    scheduler = build_scheduler(
        found, lambda: make_scheduler(device, pin_memory=pin_memory, auto=parsed.auto_options,
                                      order=parsed.order))
    note_module_mode_cost(scheduler, parsed.mode)
    return scheduler


def note_module_mode_cost(scheduler, mode: str) -> bool:
    """Say, in one log line, what module mode costs where it is not needed
    (`module_mode_cost`); returns whether it said so.

        note_module_mode_cost(scheduler, config.mode)   # after the groups are registered
    """
    cost = module_mode_cost(scheduler, mode)
    if cost is not None:
        _log.warning("%s", cost)
    return cost is not None


def module_mode_cost(scheduler, mode: str) -> str | None:
    """What module mode costs where it is not needed, or None: on an accelerator whose free
    memory (the scheduler's own storage counted as free) would hold every group, it still moves
    every exclusive group's bytes at every call, while ``{"mode": "auto"}`` would keep them all
    and move nothing after the first call."""
    device = getattr(scheduler, "device", None)
    if mode != "module" or device is None or device.type == "cpu":
        return None
    free = free_device_memory(device, held=scheduler.device_nbytes)
    groups = [scheduler[name] for name in scheduler]
    moved = sum(group.nbytes for group in groups if group.exclusive)
    if free is None or sum(group.nbytes for group in groups) > free:
        return None
    return ("module mode moves every exclusive group's bytes at every call "
            f"({format_nbytes(moved)} here, {sum(g.exclusive for g in groups)} groups), yet this "
            f"{device} has {format_nbytes(free)} free, enough to hold all of them: "
            "{\"mode\": \"auto\"} would keep them on the device and move nothing after the "
            "first call")