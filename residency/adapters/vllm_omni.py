"""`OmniOffloadMixin`: vLLM-Omni's model-level offload protocol, served by `Scheduler.from_pipeline`.

    class WanPipeline(OmniOffloadMixin, SupportsComponentDiscovery, nn.Module):
        _dit_modules = ("transformer", "transformer_2")
        _encoder_modules = ("text_encoder",)
        _vae_modules = ("vae",)

        def forward(self, ids, latents):
            with self.omni_scheduler.resident("text_encoder"):
                context = self.text_encoder(ids)
            with self.omni_scheduler.resident("transformer"):
                return self.transformer(latents, context)

vLLM-Omni 0.30's ``ModelLevelOffloadBackend`` hands a pipeline that has these two methods the whole
job (``isinstance(pipeline, SupportsModelCpuOffload)``):

    pipe.enable_omni_model_cpu_offload(device=device, pin_memory=True, use_hsdp=False,
                                       offload_components=frozenset({"dit"}))  # only when the
    ...                                                                        # config names them
    pipe.disable_omni_model_cpu_offload()   # also after any failure inside enable

so a pipeline built on this library plugs into vLLM-Omni's backend unchanged.
"""

from __future__ import annotations

from collections.abc import Collection
import torch
from torch import nn

from residency.options.vllm_omni import LEGACY_COMPONENTS, OffloadConfig
from residency.core.errors import ConfigError, RegistrationError
from residency.group.no_offload import NoOffload
from residency.scheduler.scheduler import Scheduler

__all__ = ["OmniOffloadMixin"]


class OmniOffloadMixin:
    """vLLM-Omni's ``enable/disable_omni_model_cpu_offload`` for a pipeline that declares its parts.

        pipe.enable_omni_model_cpu_offload(device=torch.device("cuda"), pin_memory=True,
                                           use_hsdp=False, offload_components=frozenset({"dit"}))
        with pipe.omni_scheduler.resident("transformer"):
            latents = pipe.transformer(latents, context)
        pipe.disable_omni_model_cpu_offload()   # every weight back in host memory

    The pipeline declares its components as `Scheduler.from_pipeline` reads them (the four
    ClassVars, through `SupportsComponentDiscovery` or vLLM-Omni's own mixin).  While enabled, the
    scheduler is the pipeline's instance attribute ``_omni_scheduler`` (read it as
    `omni_scheduler`); a copy or pickle of the pipeline leaves it out, so a copy is a plain,
    detached pipeline.  Rules: ``use_hsdp=True`` is refused (`ConfigError`), enabling twice is
    refused (`RegistrationError`), and a refused call changes nothing.  Disabling when not enabled
    does nothing, so vLLM-Omni's clean-up after a failed enable always succeeds.
    """

    #: The scheduler while offloading is enabled, else None (the instance attribute shadows it).
    _omni_scheduler: Scheduler | None = None

    @property
    def omni_scheduler(self) -> Scheduler | NoOffload:
        """The scheduler while enabled; otherwise a `NoOffload`, so phases run unchanged."""
        return self._omni_scheduler if self._omni_scheduler is not None else NoOffload()

    def enable_omni_model_cpu_offload(
        self,
        *,
        device: torch.device,
        pin_memory: bool = True,
        use_hsdp: bool = False,
        offload_components: Collection[str] | None = None,
    ) -> None:
        """Offload the declared components: one exclusive group on `device` at a time.

        `offload_components` are the config's components ("dit", "text_encoder"; "vae" here too);
        None is the legacy switch: every DiT and every encoder take turns (`LEGACY_COMPONENTS`).
        `pin_memory` pins the host masters where `device` can use pinned memory.
        """
        owner = type(self).__name__
        _check_no_hsdp(owner, use_hsdp)
        if self._omni_scheduler is not None:
            raise RegistrationError(
                f"model-level offload is already enabled on this {owner}; call "
                "disable_omni_model_cpu_offload() first, or keep using its omni_scheduler"
            )
        components = LEGACY_COMPONENTS if offload_components is None else offload_components
        config = OffloadConfig(mode="module", components=components, pin_memory=pin_memory)
        self._omni_scheduler = Scheduler.from_pipeline(self, config, device=device)

    def disable_omni_model_cpu_offload(self) -> None:
        """Close the scheduler: every weight back in host memory, the pipeline plain again.

        Does nothing when offloading is not enabled (also after a failed enable, which has left
        nothing behind).  Refused, changing nothing, while a phase is active.
        """
        scheduler = self._omni_scheduler
        if scheduler is None:
            return
        scheduler.close()
        del self._omni_scheduler
        for module in _submodules(self):
            if vars(module).get("scheduler") is scheduler:  # a split model `from_pipeline` set up
                del vars(module)["scheduler"]  # back to its default, a fresh NoOffload

    def __getstate__(self) -> dict:
        parent = getattr(super(), "__getstate__", None)  # object has one from Python 3.11
        state = dict(parent() if parent is not None else vars(self))
        state.pop("_omni_scheduler", None)  # a scheduler belongs to the original's tensors
        return state


def _check_no_hsdp(owner: str, use_hsdp: object) -> None:
    if use_hsdp is False:
        return
    if use_hsdp is True:
        raise ConfigError(
            f"{owner}.enable_omni_model_cpu_offload got use_hsdp=True: residency cannot offload "
            "an HSDP-sharded pipeline (HSDP turns parameters into sharded DTensors, and the "
            "scheduler moves whole local tensors); turn HSDP off for this stage "
            "(parallel_config.use_hsdp=False) or turn model-level CPU offload off"
        )
    raise ConfigError(
        f"{owner}.enable_omni_model_cpu_offload got use_hsdp={use_hsdp!r} "
        f"({type(use_hsdp).__name__}); give True or False"
    )


def _submodules(pipeline: object) -> list[nn.Module]:
    return list(pipeline.modules()) if isinstance(pipeline, nn.Module) else []
