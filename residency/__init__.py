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

from importlib import metadata as _metadata

from residency.modules.blocks import ModelBlocks, model_blocks
from residency.group.residency import Policy, Residency, ResidencyState
from residency.options.vllm_omni import OffloadConfig, resolve_config
from residency.pipelines.discovery import (
    ComponentGroups,
    SupportsComponentDiscovery,
    group_components,
    register_groups,
)
from residency.core.errors import (
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
    WeightFileError,
)
from residency.group.no_offload import NoOffload
from residency.adapters.vllm_omni import OmniOffloadMixin
from residency.group.records import (
    BlockLog,
    BlockRecord,
    CallRecord,
    TransitionLog,
    TransitionRecord,
    TurnChoice,
    WaitStats,
    chrome_trace,
    summarize,
)
from residency.options.order import TurnOrder
from residency.scheduler.scheduler import Phase, Scheduler
from residency.pipelines.split import SplitModel
from residency.host.memory import HostUsage
from residency.device.transport import AcceleratorTransport, Completion, CpuTransport, Transport
from residency.core.enums import PhaseStatus

#: This package's version, from its installed metadata; "0+unknown" when it runs from a source
#: tree that was never installed (no metadata to read).
try:
    __version__ = _metadata.version("residency")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"

# What users and pipeline authors import.  Extenders' names (transports, completions, the
# records' classes, Residency) are listed by `residency.extend`; they stay importable from
# here.
__all__ = [
    # the top-level API
    "Scheduler",
    "NoOffload",
    "Phase",
    "PhaseStatus",
    "Policy",
    "ResidencyState",
    # configuration and pipelines
    "OffloadConfig",
    "TurnOrder",
    "resolve_config",
    "SupportsComponentDiscovery",
    "SplitModel",
    "OmniOffloadMixin",
    "ComponentGroups",
    "group_components",
    "register_groups",
    # layer mode (Scheduler.add(..., layers=...))
    "model_blocks",
    "ModelBlocks",
    # records
    "CallRecord",
    "HostUsage",
    "summarize",
    "TurnChoice",
    "WaitStats",
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
    "WeightFileError",
]
