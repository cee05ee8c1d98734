"""The diffusers adapter: model-level offloading for a diffusers pipeline in one call.

    from residency.adapters.diffusers import disable_offload, enable_offload

    scheduler = enable_offload(pipe, {"mode": "module", "components": ["dit", "text_encoder"]})
    video = pipe("a cat on the moon").frames        # outputs bit-identical to the plain pipeline
    disable_offload(pipe)                            # the pipeline as it was, weights on one device

`disable_offload` and `enable_offload` are refused (`PhaseError`) while a call of the pipeline
runs - from a ``callback_on_step_end``, say - and `pipeline_calls(pipe)` counts the calls (see
[Note: pipeline calls] in residency/adapters/pipeline_calls.py).

What it finds in ``pipe.components`` (modules only; ``None`` and non-module parts are skipped):

* DiTs: ``transformer``, ``transformer_2``, ``transformer_3``, ... — each its own exclusive group,
  named by the component name, so Wan2.2's two experts exclude each other;
* encoders: ``text_encoder``, ``text_encoder_2``, ..., ``image_encoder`` — one group,
  "text_encoder";
* the VAE: ``vae`` — group "vae";
* every other module component — a resident-policy group named by its component name.

The grouping itself is `residency.pipelines.discovery.group_components`, the same rule as
``Scheduler.from_pipeline``: unselected categories stay resident on the device.

Each module of an exclusive group gets a `PhaseEntry` in place of its instance's bound
``forward``, ``encode`` and ``decode`` (those it has): a thin callable that enters
``scheduler.resident(group)`` and sends tensor arguments to the compute device.  No accelerate or
diffusers hook is installed and no class is changed: the entries are instance attributes, removed
again by `disable_offload`.

[Note: the execution device]
Diffusers creates latents, timesteps and prompt embeddings on ``pipe._execution_device``.  Without
offloading hooks that property returns ``pipe.device``, which is documented to prefer a component
that is *not* on the host ("When components are split across devices ... the accelerator device is
returned").  So it is right as long as one component sits on the compute device: resident-policy
groups (the VAE by default) always do, and the scheduler keeps the last exclusive group resident
until another one is asked for.  When every component is offloadable, `enable_offload` loads the
encoder group (what pipelines run first) at once, so the rule holds from the first call on.  This
is the legitimate mechanism: the alternatives are accelerate's ``_hf_hook.execution_device`` and
diffusers' group-offloading hook registry, both attributes stuck on user modules that other code
probes.
After ``scheduler.offload_all()`` no component is on the device; enter any phase before the next
call (``with scheduler.resident("text_encoder"): pass``).

Diffusers also asks each component where *its* inputs go (``get_module_execution_device``), and an
offloaded component answers with the host, where its weights wait.  The entry therefore moves
tensor arguments (also inside lists, tuples and dicts) to the compute device; on the host, or for
arguments already there, that costs a device comparison.

[Note: adapter state]
There is no registry: the `PhaseEntry` wrappers are the adapter's state.  All the entries one
`enable_offload` call sets share one `_Offload` record: the scheduler, a weak reference to the
pipeline, every module component with the device it was on before (resident-policy
components included, though they get no entry) and the pipeline's `PipelineCalls`.  Nothing else
is set on modules; on the pipeline, only the two `CallBoundary` wrappers of [Note: pipeline
calls]; nothing at module level.

* Finding it.  `offload_scheduler`, `disable_offload` and the second-call check of
  `enable_offload` read the entry points of ``pipe.components`` (``vars(module)``, no probing of
  the class) and follow each one's chain of wrappers (`_chain`).  Entries sit on component roots
  only (every member of an exclusive group is a component), so no submodule walk is needed.  A
  pipeline is offloaded when one of its components carries a live entry whose record belongs to
  it.
* Siblings.  A pipeline built from another's components (``FluxPipeline(**pipe.components)``)
  sees the same entries; the record's weak reference tells the two apart, so the sibling is
  refused with the component's name and told to disable the other pipeline.  A record whose
  pipeline has been dropped belongs to whichever pipeline still holds its components, so its
  entries can still be removed.
* Undoing.  Close the scheduler (weights back in host memory), take the record's boundaries off
  the pipeline, then its entries off the recorded components (see [Note: other wrappers]), move
  each recorded component back to its device.  Boundaries go first: the entries are what finds
  the record, so a repeat after an interrupt still finds it and removes what is left.
  `enable_offload` sets them in the other order, entries first, for the same reason.
* Lifetime.  An entry holds its module's bound method and the module holds the entry: a cycle the
  garbage collector frees with the pipeline, scheduler and host masters included.  A boundary
  and its pipeline make the same cycle; the record holds the pipeline weakly and never its
  boundaries, so a sibling holding the components does not keep the pipeline alive.
* Copies.  ``copy.deepcopy`` of an entry is a deep copy of what it wraps, so a copied module gets
  its own class method bound to the copy (or a copy of another wrapper) and its own weights: it is
  plain and detached.  The record (and its scheduler, which holds a lock) is never copied.
* Nothing to find by.  A config that offloads none of the pipeline's components would set no
  entry, so nothing could later find the record; `enable_offload` refuses it (`ConfigError`).  It
  would only have moved every component onto the device, which ``pipe.to(device)`` does.

[Note: other wrappers]
Other code sets per-instance wrappers too: diffusers' caches (``transformer.enable_cache(...)``:
FasterCache and friends) replace the component's ``forward`` through diffusers' hook registry, and
they set ``__wrapped__`` (functools.update_wrapper) to what they wrapped.  The adapter composes with
them in either order and undoes only what it did:

* Set before `enable_offload`: the entry wraps the wrapper (``entry.method``, ``entry.replaced``),
  and `disable_offload` puts that very object back.  Remove such a wrapper only after
  `disable_offload`: diffusers' ``disable_cache`` restores the ``forward`` it saw, which would drop
  residency's entry and leave the component running outside its phase.
* Set after: the entry is buried in the other wrapper's chain, where no generic code can take it
  out.  `disable_offload` finds it by following ``__wrapped__`` (`_chain`) and *detaches* it: its
  record is dropped (no scheduler held) and every later call passes straight through to what it
  wrapped, with the component's weights back where they were.  The other wrapper stays and
  keeps working; a later `enable_offload` wraps it anew, and when the other wrapper is removed and
  puts the detached entry back on top, the next `enable_offload` looks through it.
* The record sits in a ``__slots__`` slot: a wrapper set on top copies the entry's ``__dict__``
  (functools.update_wrapper) and so never carries the scheduler.
* The pipeline's `CallBoundary` wrappers compose with other wrappers of ``check_inputs`` and
  ``maybe_free_model_hooks`` the same way (both are `InstanceWrapper` objects).
* Offloaders are refused, not composed: accelerate's hooks (``enable_model_cpu_offload``,
  sequential offload) and diffusers' group offloading move the same weights.
* Caches are refused when a component all-gathers: see [Note: caches and all-gather].

[Note: caches and all-gather]
With ``weight_transfer="allgather"`` (``module_options``, or ``layer_options`` in layer mode) a
group's load is a collective: every rank of the node must load the same groups in the same order.
A diffusers cache (``transformer.enable_cache(...)``: FirstBlockCache, FasterCache,
PyramidAttentionBroadcast, TaylorSeer, MagCache, SeaCache, TextKVCache, or the same hooks applied
by hand) decides on each rank alone, from that rank's activations, which blocks or calls to skip.
Under data parallelism the ranks hold different prompts, so they may skip different work.  In
layer mode a skipped block is a skipped all-gathered load.  In module mode the caches diffusers
ships skip work inside one call, which leaves the phases alone, but a cache that skips a whole
call skips a phase (vLLM-Omni's prompt-embedding cache does, for the encoder), and any component's
skipped phase moves the next all-gathered load.  vLLM-Omni 0.30 refuses a ``cache_backend`` with
all-gather in every mode; so does `enable_offload`, for a cache on any component:

* Cache first, then `enable_offload`: refused up front with a `ConfigError` naming the cache, the
  component carrying it and the all-gathered components, before anything is changed.  Found by
  the component's ``_cache_config`` (set by ``enable_cache``) and by the cache hooks' names in
  diffusers' hook registries (`CACHE_HOOKS`), on the component and every submodule.
* `enable_offload` first, then ``enable_cache``: nothing can be seen up front.  Every phase change
  then looks at the components' ``_cache_config`` (a dictionary lookup per component, only when
  something all-gathers) and refuses the phase with the same `ConfigError` before its load, so a
  rank that enabled the cache never reaches the collective.
* Whatever is not seen (hooks applied by hand after `enable_offload`, a cache enabled on some
  ranks only, a rank-local cache of the caller's own that skips a phase) ends in the scheduler's
  `CollectiveError`, never a hang: before each all-gathered load the ranks agree on (sequence,
  group) through the `PhaseLedger`; a rank that skipped a load asks for another step than the
  others at its next agreement, and every rank raises (or, if it asks for none, the others raise
  within the node group's timeout).

"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import attrs
import torch
from torch import nn

from residency.options.vllm_omni import OffloadConfig, resolve_config
from residency.adapters.diffusers_roles import KINDS, Role, roles_of
from residency.adapters.pipeline_calls import (
    CallBoundary,
    CallEnd,
    Ending,
    PipelineCalls,
    check_not_in_call,
    remove_boundaries,
    set_boundaries,
)
from residency.adapters.weight_files import check_weight_files
from residency.pipelines.discovery import (
    ENCODER_GROUP,
    ComponentGroups,
    build_scheduler,
    check_transfers_have_ranks,
    group_components,
    note_module_mode_cost,
)
from residency.core.errors import (
    ConfigError,
    ModuleChangedError,
    PhaseError,
    RegistrationError,
)
from residency.options.host_options import HostOptions, as_host_options
from residency.modules.instance_wrappers import InstanceWrapper, chain
from residency.group.calls import Call
from residency.scheduler.scheduler import Phase, Scheduler

__all__ = [
    "CallBoundary",
    "CallEnd",
    "Ending",
    "PhaseEntry",
    "PipelineCalls",
    "describe",
    "disable_offload",
    "enable_offload",
    "from_pretrained",
    "offload_scheduler",
    "pipeline_calls",
]

_log = logging.getLogger("residency")
#: The entry points wrapped on every module of an exclusive group (those the module has).
ENTRY_POINTS = ("forward", "encode", "decode")
#: The config when none is given.
DEFAULT_CONFIG = OffloadConfig(mode="module", components=("dit", "text_encoder"))
#: The hooks diffusers' caches register in its hook registries (diffusers 0.42), by name, with the
#: cache each belongs to: what `enable_offload` refuses next to all-gather (see [Note: caches and
#: all-gather]).
CACHE_HOOKS = MappingProxyType({
    "faster_cache_denoiser": "FasterCache",
    "faster_cache_block": "FasterCache",
    "fbc_leader_block_hook": "FirstBlockCache",
    "fbc_block_hook": "FirstBlockCache",
    "mag_cache_leader_block_hook": "MagCache",
    "mag_cache_block_hook": "MagCache",
    "pyramid_attention_broadcast": "PyramidAttentionBroadcast",
    "sea_cache_root": "SeaCache",
    "sea_cache_leader_block": "SeaCache",
    "sea_cache_block": "SeaCache",
    "sea_cache_post_norm": "SeaCache",
    "taylorseer_cache": "TaylorSeerCache",
    "text_kv_cache_transformer": "TextKVCache",
    "text_kv_cache_block": "TextKVCache",
})


def enable_offload(
    pipe: object,
    config: OffloadConfig | Mapping | str | None = None,
    *,
    device: torch.device | str | None = None,
    process_group: object = None,
    host: HostOptions | Mapping | None = None,
) -> Scheduler:
    """Offload `pipe`'s components by phase: one exclusive group on `device` at a time.

        scheduler = enable_offload(pipe)                       # module mode, dit + text_encoder
        frames = pipe(prompt, generator=generator).frames
        print(scheduler.transitions.count, "phase changes")

    `config` is an `OffloadConfig`, a mapping, a JSON string, or None for the default
    (``{"mode": "module", "components": ["dit", "text_encoder"]}``).  `device` defaults to the
    current accelerator, else the CPU.  `process_group`: as for `Scheduler` (the ranks of a node
    share host masters; enabling is then collective).  `host`: the host tiers' options
    (`HostOptions`: cache directory, memory limit), as for `Scheduler`.  Returns the pipeline's
    `Scheduler`; `pipeline_calls(pipe)` counts its calls from then on.

    Raises `RegistrationError` when the pipeline is already offloaded (by this function or another
    offloader's hooks), `PhaseError` during a call of the pipeline (from a callback such as
    ``callback_on_step_end``, or another thread: enable before ``pipe(...)`` or after it returns;
    see [Note: pipeline calls] in pipeline_calls.py), and `ConfigError` for an object that is not
    a diffusers pipeline, a config or pipeline the grouping rules refuse, one that offloads none
    of its components, or one that all-gathers a component while a diffusers cache is enabled
    ([Note: caches and all-gather]); a refused call changes nothing.
    """
    owner = type(pipe).__name__
    components = _module_components(pipe, "enable_offload")
    if _offload_of(pipe, components) is not None:
        raise RegistrationError(
            f"offloading is already enabled on this {owner}; a second enable_offload would wrap "
            "its components twice. Use the scheduler the first call returned "
            "(offload_scheduler(pipe)), or call disable_offload(pipe) first"
        )
    check_not_in_call(pipe, "enable")
    parsed = resolve_config(config) or DEFAULT_CONFIG
    _check_no_other_offloader(owner, components)
    _check_not_shared(owner, components)
    gathered = _Gathered.of(parsed)
    if gathered is not None:
        gathered.check_no_cache(owner, components)
        check_transfers_have_ranks(owner, parsed, process_group)
    found, roles = _find_groups(pipe, components, parsed)
    placements = tuple((name, module, _device_of(module)) for name, module in components.items())
    pin_memory = None if parsed.pin_memory else False
    scheduler = build_scheduler(
        found, lambda: Scheduler(device, pin_memory=pin_memory, process_group=process_group,
                                 auto=parsed.auto_options, host=host, order=parsed.order)
    )
    leftovers = _leftovers(owner, found, roles)
    if leftovers is not None:
        _log.warning("%s", leftovers)
    offload = _Offload(scheduler=scheduler, pipeline=weakref.ref(pipe), placements=placements,
                       calls=PipelineCalls(pipe), gathered=gathered)
    _wrap_groups(offload, found)
    _mark_calls(offload.calls, scheduler)
    _note_cost_at_first_call(offload.calls, scheduler, parsed.mode)
    set_boundaries(offload.calls, pipe)  # after the entries: see [Note: adapter state], "Undoing"
    _place_execution_device(scheduler, found)
    return scheduler


def _mark_calls(calls: PipelineCalls, scheduler: object) -> None:
    """Mark each counted pipeline call on `scheduler` (`Scheduler.call`): one ``pipe(...)`` is
    one call of ``scheduler.calls`` and of an auto plan's ``measured``; a call found ended
    afterwards ends "found" (its seconds run to then: the plan learns nothing from it)."""
    if not isinstance(scheduler, Scheduler):
        return
    marks: dict[int, Call] = {}  # the pipeline's open call (one at a time), by its number

    def started(number: int) -> None:
        marks[number] = scheduler.call().begin()

    def ended(end: CallEnd) -> None:
        mark = marks.pop(end.number, None)
        if mark is not None:
            mark.end(end.how.value)

    calls.on_end(ended)
    calls.on_start(started)


def _note_cost_at_first_call(calls: PipelineCalls, scheduler: object, mode: str) -> None:
    """Say what module mode costs, once, as the pipeline's first call starts
    (`note_module_mode_cost`): the device's free memory is then what the calls will have, the
    pipeline's other parts placed."""
    said: list[bool] = []

    def started(number: int) -> None:
        if not said:
            said.append(True)
            note_module_mode_cost(scheduler, mode)

    calls.on_start(started)


def from_pretrained(
    pipeline_class: type,
    path: str | os.PathLike,
    config: OffloadConfig | Mapping | str | None = None,
    *,
    device: torch.device | str | None = None,
    process_group: object = None,
    host: HostOptions | Mapping | None = None,
    **kwargs,
) -> object:
    """Load a diffusers pipeline from the folder `path` and offload it: its host masters are
    read straight from the weight files (see [Note: reading regions from their files] in
    residency/host/memory.py), so the weights pass through host memory once, and they are read
    behind the first phase: this returns before the reads end, and each component's first phase
    waits for its own bytes only (`residency.host.read_behind`).

        from diffusers import DiffusionPipeline

        pipe = from_pretrained(DiffusionPipeline, "./Wan2.2-T2V-A14B", dtype=torch.bfloat16)
        with offload_scheduler(pipe):           # closed at the end, the weights left on the host
            frames = pipe("a cat on the moon").frames

    ``pipeline_class.from_pretrained(path, **kwargs)`` loads it (any keyword diffusers takes),
    then ``enable_offload(pipe, config, device=..., process_group=..., host=...)`` offloads it;
    the scheduler is ``offload_scheduler(pipe)``.  `host` as for `Scheduler`, with
    ``background_reads`` on unless it says ``False`` (a `HostOptions` is taken as it is: its
    default is off).  Checked before anything loads: `config` (`ConfigError`), `host`
    (`ConfigError`), `pipeline_class` (`ConfigError` unless it has ``from_pretrained``), the
    folder's weight files (`WeightFileError`, `check_weight_files`).  Returns the pipeline.
    """
    resolve_config(config)
    if host is None or isinstance(host, Mapping):
        host = {"background_reads": True, **(host or {})}
    host = as_host_options(host)
    if not (isinstance(pipeline_class, type) and callable(getattr(pipeline_class,
                                                                   "from_pretrained", None))):
        raise ConfigError(
            f"from_pretrained(pipeline_class={pipeline_class!r}, ...): give a diffusers pipeline "
            "class, such as diffusers.DiffusionPipeline or the folder's own class (WanPipeline, "
            "FluxPipeline, ...)"
        )
    check_weight_files(path)
    pipe = pipeline_class.from_pretrained(path, **kwargs)
    enable_offload(pipe, config, device=device, process_group=process_group, host=host)
    return pipe


def disable_offload(pipe: object) -> None:
    """Undo `enable_offload`: remove every wrapper and put each component back where it was.

        disable_offload(pipe)
        pipe(prompt)              # the plain pipeline again

    The scheduler is closed (its weights return to host memory, then each component moves back to
    the device it was on before), and `pipeline_calls(pipe)` is None again.  Refused, changing
    nothing, when offloading is not enabled on `pipe` (`RegistrationError`; also when its
    components are offloaded through another pipeline sharing them: disable that one), during a
    call of the pipeline (`PhaseError`: from a callback such as ``callback_on_step_end``, or from
    another thread while ``pipe(...)`` runs; call it after the call returns, see [Note: pipeline
    calls]), or while a phase is active (`PhaseError`: a ``with scheduler.resident(...)`` block).
    After a call that raised it works: that call has ended.
    """
    components = _module_components(pipe, "disable_offload")
    owner = type(pipe).__name__
    offload = _offload_of(pipe, components)
    if offload is None:
        raise _not_enabled(owner, components)
    check_not_in_call(pipe, "disable")
    offload.calls.refresh()  # a call that raised ends, its listeners told, before they go
    _close(owner, offload.scheduler)
    remove_boundaries(offload.calls, pipe)  # before the entries that find the record
    for _, module, device in offload.placements:
        offload.unwrap(module)  # what each entry wrapped is the entry point again
        if device.type != "cpu":
            module.to(device)


def _close(owner: str, scheduler: Scheduler) -> None:
    """Close `scheduler`, refused (changing nothing) while one of its phases is active; its later
    refusals advise ``enable_offload(pipe)``, not a new Scheduler."""
    try:
        scheduler.close(reopen=(
            f"Offloading was disabled on this {owner} (disable_offload); call "
            "enable_offload(pipe) to offload it again, and use the scheduler that call returns"))
    except PhaseError:
        raise PhaseError(
            f"cannot disable offloading on this {owner} while one of its phases is active (a "
            "component's forward is running, or a `with scheduler.resident(...)` block is open); "
            "call disable_offload(pipe) after the pipeline call returns"
        ) from None


def offload_scheduler(pipe: object) -> Scheduler | None:
    """The scheduler `enable_offload` attached to `pipe`, or None when it is not offloaded.

        scheduler = offload_scheduler(pipe)
        if scheduler is not None:
            print(scheduler.transitions.count, "phase changes so far")
    """
    components = _components_of(pipe)
    offload = None if components is None else _offload_of(pipe, components)
    return None if offload is None else offload.scheduler


def pipeline_calls(pipe: object) -> PipelineCalls | None:
    """The `PipelineCalls` of `pipe` while it is offloaded, or None.

        calls = pipeline_calls(pipe)
        pipe(prompt)
        print(calls.started, calls.ended)      # 1 1

    A new `enable_offload` gives a new one, counting from zero.
    """
    components = _components_of(pipe)
    offload = None if components is None else _offload_of(pipe, components)
    return None if offload is None else offload.calls


# -- the adapter's state (see [Note: adapter state]) ----------------------------------------------


@attrs.frozen(eq=False)
class _Offload:
    """What one `enable_offload` call changed, shared by every `PhaseEntry` it set."""

    #: The scheduler `enable_offload` returned.
    scheduler: Scheduler
    #: The pipeline it was called on, weakly: tells it apart from a sibling sharing components.
    pipeline: weakref.ref
    #: (component name, module, the device its weights were on before) of every module
    #: component, resident-policy ones included.
    placements: tuple[tuple[str, nn.Module, torch.device], ...]
    #: The pipeline's calls, counted by its `CallBoundary` wrappers (see [Note: pipeline calls]).
    calls: PipelineCalls
    #: The config components that all-gather, or None (see [Note: caches and all-gather]).
    gathered: _Gathered | None = None

    def check_phase_change(self) -> None:
        """The checks a phase change runs before its load: the components are the ones
        offloaded, and none has gained a cache while something all-gathers."""
        self.check_components()
        if self.gathered is None:
            return
        pipe = self.pipeline()
        owner = "pipeline" if pipe is None else type(pipe).__name__
        self.gathered.check_no_enabled_cache(owner, self.placements)

    def check_components(self) -> None:
        """Refuse to run when the pipeline's module components are not the ones offloaded.

        A component replaced or added after `enable_offload` (``register_modules``, attribute
        assignment, ``load_ip_adapter``, a ``controlnet=`` swap) would run with its weights
        wherever they are, outside every phase: `ModuleChangedError`, naming it.  A module that
        wraps the offloaded one (``torch.compile``'s ``_orig_mod``) is the same component.
        """
        pipe = self.pipeline()
        now = None if pipe is None else _components_of(pipe)
        if not now:
            return
        offloaded = {name: module for name, module, _ in self.placements}
        for name, module in now.items():
            recorded = offloaded.get(name)
            if recorded is not None and recorded in (module, getattr(module, "_orig_mod", None)):
                continue
            change = "replaced" if name in offloaded else "added"
            owner = type(pipe).__name__
            raise ModuleChangedError(
                f"{owner}: component {name!r} was {change} after enable_offload (it is now a "
                f"{type(module).__name__}), so its weights are not offloaded and it would run "
                "outside every phase. Change components while offloading is off: "
                "disable_offload(pipe), then register_modules / load_ip_adapter / assign, then "
                "enable_offload(pipe)"
            )

    def belongs_to(self, pipe: object) -> bool:
        """Whether this is `pipe`'s record (a record whose pipeline is gone belongs to any)."""
        owner = self.pipeline()
        return owner is None or owner is pipe

    def unwrap(self, module: nn.Module) -> None:
        """Take this record's entries off `module` (see [Note: other wrappers]).

        An outermost entry is replaced by what it wrapped; one buried under another wrapper is
        detached in place (a pass-through from then on).
        """
        for name in ENTRY_POINTS:
            for entry in _chain(vars(module).get(name)):
                if entry.offload is self:
                    entry.remove()


@attrs.frozen
class _Gathered:
    """The config components whose weights are all-gathered, and the config field that says so.

        gathered = _Gathered.of(config)      # None when every component is rank-local
        gathered.check_no_cache("WanPipeline", pipe.components)

    See [Note: caches and all-gather].
    """

    #: Selected components with weight_transfer "allgather", in config order.
    components: tuple[str, ...]
    #: "module_options" or "layer_options": where the config sets it.
    field: str

    @classmethod
    def of(cls, config: OffloadConfig) -> _Gathered | None:
        gathered = config.allgathered()
        if not gathered:
            return None
        field = "layer_options" if config.mode == "layer" else "module_options"  # module, auto
        return cls(gathered, field)

    def check_no_cache(self, owner: str, components: Mapping[str, nn.Module]) -> None:
        """Refuse a cache on any module component or its submodules (before `enable_offload`)."""
        for name, module in components.items():
            cache = _cache_on(module)
            if cache is not None:
                raise self._refusal(owner, name, cache, (
                    f"Disable the cache first (pipe.{name}.disable_cache()), or give "
                    f"{list(self.components)} weight_transfer 'rank-local'"))

    def check_no_enabled_cache(
        self, owner: str, placements: tuple[tuple[str, nn.Module, torch.device], ...]
    ) -> None:
        """Refuse a phase once ``enable_cache`` ran on a component after `enable_offload`."""
        for name, module, _ in placements:
            cache = _enabled_cache(module)
            if cache is not None:
                raise self._refusal(owner, name, cache, (
                    "It was enabled after enable_offload, so this phase is refused before its "
                    f"load, on this rank. Disable the cache (pipe.{name}.disable_cache()), or "
                    "disable_offload(pipe) and enable offloading again with weight_transfer "
                    "'rank-local'"))

    def _refusal(self, owner: str, name: str, cache: str, fix: str) -> ConfigError:
        return ConfigError(
            f"{owner}: component {name!r} has diffusers' {cache}, a rank-local cache, and the "
            f"offload config all-gathers {list(self.components)} ({self.field}: weight_transfer "
            "'allgather'). Such a cache decides on each rank alone which blocks or calls to skip, "
            "so the ranks could skip different loads and their all-gathers would no longer pair "
            "(vLLM-Omni 0.30 refuses a cache_backend with all-gather for the same reason). "
            f"{fix}"
        )


def _enabled_cache(module: nn.Module) -> str | None:
    """The cache ``module.enable_cache(config)`` set on `module` ("FirstBlockCache"), or None."""
    config = vars(module).get("_cache_config")
    if config is None:
        return None
    return type(config).__name__.removesuffix("Config")


def _cache_on(component: nn.Module) -> str | None:
    """The diffusers cache on `component` or any of its submodules, or None.

    Found by ``_cache_config`` (``enable_cache``) or by a `CACHE_HOOKS` name in a submodule's
    hook registry (a cache's ``apply_*`` function called directly).
    """
    for submodule in component.modules():
        cache = _enabled_cache(submodule)
        if cache is not None:
            return cache
        registry = vars(submodule).get("_diffusers_hook")
        if registry is None:
            continue
        for hook, cache in CACHE_HOOKS.items():
            if registry.get_hook(hook) is not None:
                return cache
    return None


def _enter_phase(offload: _Offload, group: str) -> Phase:
    """Enter `group`'s phase, checking the components first at a phase change.

    Kept out of ``torch.compile``'s graphs (`PhaseEntry` calls it marked so): a compiled
    component (``transformer.compile()``) traces what the entry wraps and runs the phase change
    itself eagerly.
    """
    scheduler = offload.scheduler
    if scheduler.current != group:  # a phase change, or a resident-policy group
        offload.check_phase_change()
    phase = scheduler.resident(group)
    phase.__enter__()
    return phase


def _exit_phase(phase: Phase, error: BaseException | None) -> None:
    """Leave a phase `_enter_phase` entered (also kept out of compiled graphs)."""
    phase.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)


class PhaseEntry(InstanceWrapper):
    """A module's own ``forward``, ``encode`` or ``decode``, run inside its group's phase.

        pipe.transformer.forward      # <PhaseEntry 'forward' of group 'transformer'>
        pipe.transformer(latents)     # with scheduler.resident("transformer"): original(latents)

    `enable_offload` sets one as an instance attribute for each entry point of each module of an
    exclusive group.  It wraps what a call ran before: the class's method, or another per-instance
    wrapper already there (a diffusers cache hook); `disable_offload` puts that back.  Tensor
    arguments (also inside lists, tuples and dicts) go to the compute device first (see [Note: the
    execution device]).  ``inspect.signature`` sees the original's signature (``__wrapped__``).
    The entries are the adapter's only state (see [Note: adapter state]).

    A *detached* entry (``offload is None``) is a pass-through: what `disable_offload` leaves when
    another wrapper holds the entry inside its own chain (see [Note: other wrappers]).  A deep copy
    of an entry is a deep copy of what it wraps: a copied module is plain and detached.  Setting,
    finding, removing, detaching and copying are `InstanceWrapper`'s (`attached` is the record).
    """

    # The record is the `attached` slot, not in __dict__: a wrapper set on top of an entry copies
    # the entry's __dict__ into its own (functools.update_wrapper), and must not carry the
    # scheduler.
    __slots__ = ("group", "__dict__")

    def __init__(self, offload: _Offload, group: str, module: nn.Module, name: str) -> None:
        super().__init__(module, name, offload)
        functools.update_wrapper(self, self.__wrapped__)  # its name, docstring and __dict__
        self.__dict__.pop("__wrapped__", None)  # a copied one, hidden by the slot
        #: The exclusive group entered around each call.
        self.group = group
        # See [Note: the entries under torch.compile]; each mark on its own (an interrupt
        # between them leaves the second for the next entry).
        if PhaseEntry._enter_phase is _enter_phase:
            PhaseEntry._enter_phase = staticmethod(torch.compiler.disable(_enter_phase))
        if PhaseEntry._exit_phase is _exit_phase:
            PhaseEntry._exit_phase = staticmethod(torch.compiler.disable(_exit_phase))

    # [Note: the entries under torch.compile]
    # The phase change runs outside any graph: `_enter_phase` and `_exit_phase` are marked with
    # `torch.compiler.disable` when the first entry is made, not when this module is imported
    # (marking imports torch._dynamo: seconds of ``python -m residency``'s start, which a run
    # without the adapter or without compile never needs).  Marked before any entry runs, so
    # before any tracing; the same two functions for every entry.
    _enter_phase = staticmethod(_enter_phase)
    _exit_phase = staticmethod(_exit_phase)

    @property
    def offload(self) -> _Offload | None:
        """The record shared by every entry of the same `enable_offload` call; None once
        detached."""
        return self.attached

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler whose phase this entry enters (None once detached)."""
        return None if self.attached is None else self.attached.scheduler

    def __call__(self, *args, **kwargs):
        offload = self.attached
        if offload is None:
            return self.__wrapped__(*args, **kwargs)
        phase = self._enter_phase(offload, self.group)
        device = offload.scheduler.device
        try:
            result = self.__wrapped__(*_to_device(args, device), **_to_device(kwargs, device))
        except BaseException as error:
            self._exit_phase(phase, error)
            raise
        self._exit_phase(phase, None)
        return result

    def __repr__(self) -> str:
        name = getattr(self, "__name__", "?")
        if self.attached is None:
            return f"<PhaseEntry {name!r}, detached>"
        return f"<PhaseEntry {name!r} of group {self.group!r}>"


def _chain(entry_point: object) -> Iterator[PhaseEntry]:
    """Every `PhaseEntry` in the chain of wrappers under `entry_point`, outermost first
    (`residency.modules.instance_wrappers.chain`: ``__wrapped__``, which diffusers' and accelerate's
    hooks set through functools.update_wrapper)."""
    return (link for link in chain(entry_point) if isinstance(link, PhaseEntry))


def _live_entries(components: Mapping[str, nn.Module]) -> Iterator[tuple[str, PhaseEntry]]:
    """(component name, entry) of every entry not detached, outermost or buried, on a component."""
    for name, module in components.items():
        for attribute in ENTRY_POINTS:
            for entry in _chain(vars(module).get(attribute)):
                if entry.offload is not None:
                    yield name, entry


def _offload_of(pipe: object, components: Mapping[str, nn.Module]) -> _Offload | None:
    """`pipe`'s record, found through the entries on its components; None when not offloaded."""
    return next(
        (e.offload for _, e in _live_entries(components) if e.offload.belongs_to(pipe)), None
    )


def _not_enabled(owner: str, components: Mapping[str, nn.Module]) -> RegistrationError:
    shared = next((name for name, _ in _live_entries(components)), None)
    if shared is None:
        return RegistrationError(
            f"offloading is not enabled on this {owner}, so there is nothing to disable. "
            "enable_offload(pipe) turns it on; offload_scheduler(pipe) is None while it is off."
        )
    return RegistrationError(
        f"offloading is not enabled on this {owner}, but its component {shared!r} is offloaded "
        "through another pipeline that shares it; call disable_offload on that pipeline"
    )


# -- discovery ------------------------------------------------------------------------------------


def _components_of(pipe: object) -> dict[str, nn.Module] | None:
    """`pipe`'s module components, or None when it has no `components` mapping."""
    components = getattr(pipe, "components", None)
    if not isinstance(components, Mapping):
        return None
    return {name: part for name, part in components.items() if isinstance(part, nn.Module)}


def _module_components(pipe: object, verb: str) -> dict[str, nn.Module]:
    """`pipe`'s module components; `ConfigError` for an object that is not a pipeline."""
    components = _components_of(pipe)
    if components is None:
        raise ConfigError(
            f"{verb} takes a diffusers pipeline (a DiffusionPipeline, such as the pipe that "
            f"from_pretrained returns), and a {type(pipe).__name__} is not one: it has no "
            "`components` mapping. Pass the pipeline, not one of its models; for your own model "
            "code, use Scheduler.from_pipeline, or Scheduler.add for a single module"
        )
    return components


def _find_groups(
    pipe: object, components: dict[str, nn.Module], config: OffloadConfig
) -> tuple[ComponentGroups, dict[str, Role]]:
    """The grouping of `pipe`'s module components, and each one's `Role`."""
    owner = type(pipe).__name__
    roles = roles_of(pipe, components)
    kinds: dict[str, dict[str, nn.Module]] = {kind: {} for kind in KINDS}
    companions: dict[str, dict[str, nn.Module]] = {}
    for name, role in roles.items():
        kinds[role.kind][name] = components[name]
        if role.joins is not None:
            companions.setdefault(role.joins, {})[name] = components[name]
    found = group_components(owner, kinds["dit"], kinds["encoder"], kinds["vae"],
                           kinds["resident"], config, companions=companions, pipeline=pipe)
    _check_something_offloaded(owner, components, found, config)
    return found, roles


def _check_something_offloaded(
    owner: str, components: dict[str, nn.Module], found: ComponentGroups, config: OffloadConfig
) -> None:
    """Refuse groups found without an exclusive one (see [Note: adapter state], "Nothing to find by")."""
    if found.exclusive:
        return
    raise ConfigError(
        f"{owner}: the offload config selects {list(config.components)}, which matches none of "
        f"{owner}'s module components {sorted(components)}, so nothing would be offloaded. "
        "Select components it has (describe(pipe) shows how each is classified; 'vae' selects "
        "its VAE, vocoder, movq, ...), or move it with pipe.to(device) instead"
    )


def _leftovers(owner: str, found: ComponentGroups, roles: Mapping[str, Role]) -> str | None:
    """The one line naming the components that stay on the device because no rule placed them."""
    left = [f"{name} ({role.why})" for name, role in roles.items() if role.kind == "resident"]
    if not left:
        return None
    return (f"{owner}: kept on the device while offloading, since no category holds them: "
            f"{', '.join(left)}")


def describe(
    pipe: object, config: OffloadConfig | Mapping | str | None = None
) -> str:
    """How `enable_offload(pipe, config)` would group `pipe`'s components, as a table.

        print(describe(pipe))
        # StableDiffusionXLControlNetPipeline, components ['dit', 'text_encoder']:
        # component       kind       group          policy     why
        # controlnet      companion  unet           exclusive  named like a step companion
        # ...

    Changes nothing; raises what `enable_offload` would raise for the config.
    """
    parsed = resolve_config(config) or DEFAULT_CONFIG
    components = _module_components(pipe, "describe")
    found, roles = _find_groups(pipe, components, parsed)
    policies = {name: "exclusive" for name in found.exclusive} | {
        name: "resident" for name in found.resident}
    groups = {path: group for group, path, _ in found.members()}
    rows = [("component", "kind", "group", "policy", "why")] + [
        (name, role.kind, groups[name], policies[groups[name]], role.why)
        for name, role in roles.items()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{type(pipe).__name__}, components {list(parsed.components)}:"] + [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4]
        for row in rows
    ]
    notes = [found.note, _leftovers(type(pipe).__name__, found, roles)]
    return "\n".join(lines + [f"note: {note}" for note in notes if note])


def _check_no_other_offloader(owner: str, components: dict[str, nn.Module]) -> None:
    """Refuse components another offloader moves: two offloaders would fight over the weights.

    accelerate's hooks (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``) leave
    ``_hf_hook`` on the modules they manage; diffusers' group offloading registers a
    "group_offloading" hook in its ``_diffusers_hook`` registry.  Other wrappers (a cache) compose.
    """
    for name, module in components.items():
        for submodule in module.modules():
            if "_hf_hook" in vars(submodule):
                raise RegistrationError(
                    f"{owner}: component {name!r} is managed by accelerate's hooks "
                    "(enable_model_cpu_offload or enable_sequential_cpu_offload); two offloaders "
                    "would fight over its weights. Call pipe.remove_all_hooks() first, then "
                    "enable_offload"
                )
            registry = vars(submodule).get("_diffusers_hook")
            if registry is not None and registry.get_hook("group_offloading") is not None:
                raise RegistrationError(
                    f"{owner}: component {name!r} has diffusers' group offloading; two "
                    "offloaders would fight over its weights, and group offloading cannot be "
                    "removed in place. Load the component again without enable_group_offload, "
                    "then call enable_offload"
                )


def _check_not_shared(owner: str, components: dict[str, nn.Module]) -> None:
    """Refuse components offloaded through another pipeline that shares them."""
    shared = next((name for name, _ in _live_entries(components)), None)
    if shared is not None:
        raise RegistrationError(
            f"{owner}: component {shared!r} is already offloaded through another pipeline that "
            "shares it (residency's wrapper is on it). Call disable_offload on that pipeline "
            "first, then enable_offload"
        )


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


# -- entries --------------------------------------------------------------------------------------


def _wrap_groups(offload: _Offload, found: ComponentGroups) -> None:
    """Set a `PhaseEntry` for each entry point of each module of every group.

    Each entry wraps what a call runs now: the class's method, or another wrapper already set on
    the instance (see [Note: other wrappers]); residency's own detached entries on top are looked
    through, so entries do not pile up.  Entries of resident-policy groups move no weights;
    they check that the components are still the ones offloaded (`_Offload.check_components`).
    """
    for group, members in (*found.exclusive.items(), *found.resident.items()):
        for _, module in members:
            for name in ENTRY_POINTS:
                if callable(getattr(module, name, None)):
                    PhaseEntry(offload, group, module, name).install()


def _to_device(value, device: torch.device):
    """`value` with every tensor (also inside lists, tuples and dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _place_execution_device(scheduler: Scheduler, found: ComponentGroups) -> None:
    """Make one component sit on the device when none does (see [Note: the execution device])."""
    if found.resident:
        return
    first = ENCODER_GROUP if ENCODER_GROUP in found.exclusive else next(iter(found.exclusive))
    with scheduler.resident(first):  # pipelines encode first: this load is not wasted
        pass
