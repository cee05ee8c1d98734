"""The diffusers adapter: model-level offloading for a diffusers pipeline in one call.

    from residency.adapters.diffusers import disable_offload, enable_offload

    scheduler = enable_offload(pipe, {"mode": "module", "components": ["dit", "text_encoder"]})
    video = pipe("a cat on the moon").frames        # outputs bit-identical to the plain pipeline
    disable_offload(pipe)                            # the pipeline as it was, weights on one device

What it finds in ``pipe.components`` (modules only; ``None`` and non-module parts are skipped):

* DiTs: ``transformer``, ``transformer_2``, ``transformer_3``, ... — each its own exclusive group,
  named by the component name, so Wan2.2's two experts exclude each other;
* encoders: ``text_encoder``, ``text_encoder_2``, ..., ``image_encoder`` — one group,
  "text_encoder";
* the VAE: ``vae`` — group "vae";
* every other module component — a resident-policy group named by its component name.

The grouping itself is `residency.discovery.plan_components`, the same rule as
``Scheduler.from_pipeline``: unselected categories stay resident on the device.

Each module of an exclusive group gets a thin wrapper around its instance's bound ``forward``,
``encode`` and ``decode`` (those it has) that enters ``scheduler.resident(group)`` and sends tensor
arguments to the compute device.  No accelerate or diffusers hook is installed and no class is
changed: the wrappers are instance attributes, removed again by `disable_offload`.

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
offloaded component answers with the host, where its weights wait.  The wrapper therefore moves
tensor arguments (also inside lists, tuples and dicts) to the compute device; on the host, or for
arguments already there, that costs a device comparison.

[Note: adapter state]
`_OFFLOADED` maps each offloaded pipeline to what `disable_offload` must undo: its scheduler, the
wrappers it set, and the device each component was on.  It is a ``WeakKeyDictionary``: nothing is
stuck on the pipeline, a pipeline that is dropped takes its entry with it, and the wrappers are the
only instance attributes set on modules.  It holds state of live pipelines, not configuration.
The originals need no saving: deleting a wrapper lets the class's method show through again.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Iterator, Mapping

import attrs
import torch
from torch import nn

from residency.config import OffloadConfig, resolve_config
from residency.discovery import ENCODER_GROUP, ComponentPlan, apply_plan, plan_components
from residency.errors import ConfigError, RegistrationError, ResidencyError
from residency.scheduler import Scheduler

__all__ = ["disable_offload", "enable_offload", "offload_scheduler"]

#: Component names of the denoising transformers (each its own exclusive group when selected).
DIT_NAMES = re.compile(r"transformer(_\d+)?")
#: Component names of the encoders (one group, "text_encoder").
ENCODER_NAMES = re.compile(r"text_encoder(_\d+)?|image_encoder")
#: Component names of the VAE (group "vae").
VAE_NAMES = re.compile(r"vae")
#: The entry points wrapped on every module of an exclusive group (those the module has).
ENTRY_POINTS = ("forward", "encode", "decode")


@attrs.frozen(eq=False)
class _Offload:
    """What `enable_offload` changed on one pipeline, so that `disable_offload` can undo it."""

    scheduler: Scheduler
    #: (module, entry point name) of every wrapper set as an instance attribute.
    wrapped: tuple[tuple[nn.Module, str], ...]
    #: (component module, the device its weights were on before).
    devices: tuple[tuple[nn.Module, torch.device], ...]


#: Pipeline -> its `_Offload` (see [Note: adapter state]).
_OFFLOADED: weakref.WeakKeyDictionary[object, _Offload] = weakref.WeakKeyDictionary()


def enable_offload(
    pipe: object,
    config: OffloadConfig | Mapping | str | None = None,
    *,
    device: torch.device | str | None = None,
) -> Scheduler:
    """Offload `pipe`'s components by phase: one exclusive group on `device` at a time.

        scheduler = enable_offload(pipe)                       # module mode, dit + text_encoder
        frames = pipe(prompt, generator=generator).frames
        print(scheduler.transitions.count, "phase changes")

    `config` is an `OffloadConfig`, a mapping, a JSON string, or None for the default
    (``{"mode": "module", "components": ["dit", "text_encoder"]}``).  `device` defaults to the
    current accelerator, else the CPU.  Returns the pipeline's `Scheduler`.

    Raises `RegistrationError` when the pipeline is already offloaded (by this function or another
    offloader's hooks) and `ConfigError` for a config or pipeline the grouping rules refuse; a
    refused call changes nothing.
    """
    owner = type(pipe).__name__
    components = _module_components(pipe)
    if pipe in _OFFLOADED:
        raise RegistrationError(
            f"offloading is already enabled on this {owner}; a second enable_offload would wrap "
            "its components twice. Use the scheduler the first call returned "
            "(offload_scheduler(pipe)), or call disable_offload(pipe) first"
        )
    parsed = resolve_config(config) or OffloadConfig(mode="module")
    _check_no_instance_wrappers(owner, components)
    plan = _plan(owner, components, parsed)
    scheduler = Scheduler(device, pin_memory=None if parsed.pin_memory else False)
    devices = tuple((module, _device_of(module)) for module in components.values())
    try:
        apply_plan(scheduler, plan)
    except BaseException:
        scheduler.close()
        raise
    wrapped = tuple(_wrap_exclusive_groups(scheduler, plan))
    _OFFLOADED[pipe] = _Offload(scheduler, wrapped, devices)
    _place_execution_device(pipe, scheduler, plan)
    return scheduler


def disable_offload(pipe: object) -> None:
    """Undo `enable_offload`: remove every wrapper and put each component back where it was.

        disable_offload(pipe)
        pipe(prompt)              # the plain pipeline again

    The scheduler is closed (its weights return to host memory, then each component moves back to
    the device it was on before).  Refused, changing nothing, while a phase is active or when
    offloading is not enabled on `pipe`.
    """
    offload = _OFFLOADED.get(pipe)
    if offload is None:
        raise ResidencyError(
            f"offloading is not enabled on this {type(pipe).__name__}; there is nothing to "
            "disable (enable_offload(pipe) turns it on)"
        )
    offload.scheduler.close()
    for module, name in offload.wrapped:
        delattr(module, name)  # the class's method shows through again
    for module, device in offload.devices:
        if device.type != "cpu":
            module.to(device)
    del _OFFLOADED[pipe]


def offload_scheduler(pipe: object) -> Scheduler | None:
    """The scheduler `enable_offload` attached to `pipe`, or None when it is not offloaded."""
    offload = _OFFLOADED.get(pipe)
    return None if offload is None else offload.scheduler


# -- discovery ------------------------------------------------------------------------------------


def _module_components(pipe: object) -> dict[str, nn.Module]:
    components = getattr(pipe, "components", None)
    if not isinstance(components, Mapping):
        raise ResidencyError(
            f"{type(pipe).__name__} has no `components` mapping; enable_offload takes a diffusers "
            "pipeline (DiffusionPipeline). For your own model code, use Scheduler.from_pipeline"
        )
    return {name: part for name, part in components.items() if isinstance(part, nn.Module)}


def _plan(owner: str, components: dict[str, nn.Module], config: OffloadConfig) -> ComponentPlan:
    categories: dict[str, dict[str, nn.Module]] = {"dit": {}, "encoder": {}, "vae": {}, "other": {}}
    for name, module in components.items():
        categories[_category(name)][name] = module
    _check_both_found(owner, categories, config)
    return plan_components(owner, categories["dit"], categories["encoder"], categories["vae"],
                           categories["other"], config)


def _check_both_found(owner: str, categories: dict[str, dict], config: OffloadConfig) -> None:
    """The grouping rule's refusal, worded for component names rather than declarations."""
    if config.mode != "module" or not {"dit", "text_encoder"} <= set(config.components):
        return
    for category, names in (("dit", "transformer, transformer_2, ..."),
                            ("encoder", "text_encoder, text_encoder_2, ..., image_encoder")):
        if not categories[category]:
            found = sorted(name for table in categories.values() for name in table)
            other = "text_encoder" if category == "dit" else "dit"
            raise ConfigError(
                f"{owner}: the offload config selects 'dit' and 'text_encoder', but {owner} has "
                f"no {category} component (named {names}); its module components are {found}. "
                f'Select only the components it has, for example {{"mode": "module", '
                f'"components": ["{other}"]}}'
            )


def _category(name: str) -> str:
    for pattern, category in ((DIT_NAMES, "dit"), (ENCODER_NAMES, "encoder"), (VAE_NAMES, "vae")):
        if pattern.fullmatch(name):
            return category
    return "other"


def _check_no_instance_wrappers(owner: str, components: dict[str, nn.Module]) -> None:
    """Refuse components whose entry points are already instance attributes.

    That is another offloader's hook (accelerate's model and sequential offload and diffusers'
    group offloading all replace the component's own ``forward``) or residency's wrapper through a
    pipeline sharing the component.  Hooks on submodules only (a block cache) do not conflict.
    """
    for name, module in components.items():
        replaced = [entry for entry in ENTRY_POINTS if entry in vars(module)]
        if replaced:
            raise RegistrationError(
                f"{owner}: component {name!r} already has an instance-level {replaced[0]!r}: a "
                "hook of another offloader (enable_model_cpu_offload, enable_sequential_cpu_"
                "offload, group offloading) or residency's wrapper from a pipeline sharing this "
                "component. Remove it first (pipe.remove_all_hooks(), or disable_offload on the "
                "other pipeline), then call enable_offload"
            )


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


# -- wrappers -------------------------------------------------------------------------------------


def _wrap_exclusive_groups(
    scheduler: Scheduler, plan: ComponentPlan
) -> Iterator[tuple[nn.Module, str]]:
    """Wrap each entry point of each module of an exclusive group; yield (module, name) of each.

    `_check_no_instance_wrappers` made sure none of them is an instance attribute yet.
    """
    for group, members in plan.exclusive.items():
        for _, module in members:
            for name in ENTRY_POINTS:
                method = getattr(module, name, None)
                if callable(method):
                    setattr(module, name, _in_phase(scheduler, group, method))
                    yield module, name


def _in_phase(scheduler: Scheduler, group: str, method: Callable) -> Callable:
    """`method`, run inside ``scheduler.resident(group)`` with tensor arguments on the device."""
    device = scheduler.device

    @functools.wraps(method)
    def in_phase(*args, **kwargs):
        with scheduler.resident(group):
            return method(*_to_device(args, device), **_to_device(kwargs, device))

    return in_phase


def _to_device(value, device: torch.device):
    """`value` with every tensor (also inside lists, tuples and dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _place_execution_device(pipe: object, scheduler: Scheduler, plan: ComponentPlan) -> None:
    """Make one component sit on the device when none does (see [Note: the execution device])."""
    if plan.resident or not plan.exclusive:
        return
    first = ENCODER_GROUP if ENCODER_GROUP in plan.exclusive else next(iter(plan.exclusive))
    with scheduler.resident(first):  # pipelines encode first: this load is not wasted
        pass
