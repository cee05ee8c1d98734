"""One surface over every offloader we compare: none, ours, diffusers' model and group offloading.

    offload = install("residency", {"text_encoder": te, "dit": dit}, device)
    with offload.phase("text_encoder"):
        context = te(ids)
    ...
    offload.finish()        # the end of one pipeline call (diffusers re-arms its hooks here)
    offload.close()

Peers are applied exactly as their documentation shows; we never patch them.  `unavailable` says
why a peer cannot run here (not installed, no accelerator) so a benchmark can record a skip instead
of a number.

[Note: diffusers' model offload and the pipeline call]
``enable_model_cpu_offload`` chains accelerate hooks in ``model_cpu_offload_seq`` order: running a
component offloads the one before it, and ``maybe_free_model_hooks()`` at the end of a pipeline call
offloads the last and re-arms every hook.  A benchmark cycle therefore ends with ``finish()``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from collections.abc import Iterable

import torch
from torch import nn

from residency import Scheduler

__all__ = ["OFFLOADERS", "PEERS", "Offload", "install", "unavailable"]

#: Every offloader `install` knows; "none" keeps all components on the device.
OFFLOADERS = ("none", "residency", "diffusers_model_cpu_offload", "diffusers_group_offload")
#: The third-party ones.
PEERS = ("diffusers_model_cpu_offload", "diffusers_group_offload")


def unavailable(offloader: str, device: torch.device, *, allow_cpu: bool = False) -> str | None:
    """Why `offloader` cannot be measured on `device`, or None when it can.

    `allow_cpu` lets a dry run exercise a peer's API on the CPU (its figures mean nothing there).
    """
    if offloader not in OFFLOADERS:
        raise ValueError(f"unknown offloader {offloader!r}; choose one of {', '.join(OFFLOADERS)}")
    if offloader not in PEERS:
        return None
    if importlib.util.find_spec("diffusers") is None:
        return "diffusers is not installed (pip install -e '.[peers]')"
    if device.type == "cpu" and not allow_cpu:
        return "no accelerator: diffusers' offloading moves weights to one, and none is present"
    try:
        importlib.import_module("diffusers.hooks")
        importlib.import_module("diffusers.pipelines.pipeline_utils")
    except Exception as error:  # a broken install is a missing peer, not a crash
        return f"diffusers cannot be imported ({type(error).__name__}: {error})"
    return None


class Offload:
    """Components under one offloader.  ``phase(name)`` wraps each use; ``finish()`` ends a call."""

    def __init__(self, name: str, components: dict[str, nn.Module]) -> None:
        self.name = name
        self.components = components

    def phase(self, component: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        """The end of one pipeline call."""

    def close(self) -> None:
        """Undo what `install` did, as far as the offloader allows."""


class _Residency(Offload):
    def __init__(self, components, device, resident: Iterable[str]) -> None:
        super().__init__("residency", components)
        self.scheduler = Scheduler(device)
        for name, module in components.items():
            self.scheduler.add(name, module, policy="resident" if name in resident else "exclusive")

    def phase(self, component: str):
        return self.scheduler.resident(component)

    def close(self) -> None:
        self.scheduler.close()


class _ModelCpuOffload(Offload):
    def __init__(self, components, device) -> None:
        super().__init__("diffusers_model_cpu_offload", components)
        self.pipeline = _diffusion_pipeline(components)
        self.pipeline.enable_model_cpu_offload(device=device)

    def finish(self) -> None:
        self.pipeline.maybe_free_model_hooks()

    def close(self) -> None:
        self.pipeline.remove_all_hooks()


class _GroupOffload(Offload):
    def __init__(self, components, device) -> None:
        from diffusers.hooks import apply_group_offloading

        super().__init__("diffusers_group_offload", components)
        for module in components.values():
            # The settings diffusers documents for speed: block level, one block per group, a stream.
            apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=device.type != "cpu")


def install(offloader: str, components: dict[str, nn.Module], device: torch.device, *,
            resident: Iterable[str] = ()) -> Offload:
    """Apply `offloader` to `components` (host modules, in the order a pipeline call uses them).

    `resident` names components ours keeps on the device for good (a VAE); the peers have no such
    policy and offload them like the rest.
    """
    if offloader == "none":
        for module in components.values():
            module.to(device)
        return Offload("none", components)
    if offloader == "residency":
        return _Residency(components, device, set(resident))
    if offloader == "diffusers_model_cpu_offload":
        return _ModelCpuOffload(components, device)
    if offloader == "diffusers_group_offload":
        return _GroupOffload(components, device)
    raise ValueError(f"unknown offloader {offloader!r}; choose one of {', '.join(OFFLOADERS)}")


def _diffusion_pipeline(components: dict[str, nn.Module]):
    """A diffusers pipeline holding `components`, offloaded in their given order."""
    from diffusers import DiffusionPipeline

    class SyntheticPipeline(DiffusionPipeline):
        model_cpu_offload_seq = "->".join(components)

        def __init__(self, **modules):
            super().__init__()
            self.register_modules(**modules)

    # diffusers reads the component names from the signature of __init__.
    SyntheticPipeline.__init__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in components]
    )
    return SyntheticPipeline(**components)
