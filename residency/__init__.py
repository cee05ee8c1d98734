"""residency: keep one exclusive group of modules on the accelerator, swap the rest from pinned host memory.

    from residency import Scheduler

    scheduler = Scheduler()
    scheduler.add("text_encoder", pipe.text_encoder)
    scheduler.add("dit", pipe.transformer)
    scheduler.add("vae", pipe.vae, policy="resident")
    with scheduler.resident("text_encoder"):
        embeddings = pipe.text_encoder(ids)
    with scheduler.resident("dit"):
        latents = pipe.transformer(latents, embeddings)
"""

from residency.blocks import BlockPlan, ModelBlocks, model_blocks, plan_blocks  # historical names
from residency.component import Policy, Residency, ResidencyState
from residency.config import OffloadConfig, resolve_config
from residency.discovery import (
    ComponentGroups,
    ComponentPlan,  # historical name
    SupportsComponentDiscovery,
    apply_plan,  # historical name
    group_components,
    plan_components,  # historical name
    register_groups,
)
from residency.errors import (
    CollectiveError,
    ConfigError,
    DeadlockError,
    DeviceMemoryError,
    HostMemoryError,
    ModuleChangedError,
    PhaseError,
    RegistrationError,
    ResidencyError,
    SchedulerClosedError,
    UnknownGroupError,
)
from residency.no_offload import NoOffload
from residency.omni import OmniOffloadMixin
from residency.records import (
    BlockLog,
    BlockRecord,
    TransitionLog,
    TransitionRecord,
    chrome_trace,
    summarize,
)
from residency.scheduler import Phase, Scheduler
from residency.split import SplitModel
from residency.transport import AcceleratorTransport, Completion, CpuTransport, Transport

__all__ = [
    # the top-level API
    "Scheduler",
    "NoOffload",
    "Residency",
    "Phase",
    "Policy",
    "ResidencyState",
    # configuration and pipelines
    "OffloadConfig",
    "resolve_config",
    "SupportsComponentDiscovery",
    "SplitModel",
    "OmniOffloadMixin",
    "ComponentGroups",
    "group_components",
    "register_groups",
    "ComponentPlan",  # historical name, for one release (docs/surface.md)
    "plan_components",  # historical name, for one release
    "apply_plan",  # historical name, for one release
    # layer mode (Scheduler.add(..., layers=...))
    "model_blocks",
    "plan_blocks",  # historical name of model_blocks (kept)
    "ModelBlocks",
    "BlockPlan",  # historical name, for one release
    # transports (inject one with Scheduler(transport=...))
    "Transport",
    "CpuTransport",
    "AcceleratorTransport",
    "Completion",
    # records
    "TransitionRecord",
    "TransitionLog",
    "BlockRecord",
    "BlockLog",
    "summarize",
    "chrome_trace",
    # errors
    "ResidencyError",
    "CollectiveError",
    "ConfigError",
    "DeadlockError",
    "DeviceMemoryError",
    "HostMemoryError",
    "ModuleChangedError",
    "PhaseError",
    "RegistrationError",
    "SchedulerClosedError",
    "UnknownGroupError",
]
