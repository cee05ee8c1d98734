"""The ResidencyError family: every error the library raises for misuse.

Each message says what was wrong and what to do about it.  A call refused with one of
these errors has changed nothing.
"""

from __future__ import annotations

__all__ = [
    "ResidencyError",
    "RegistrationError",
    "UnknownGroupError",
    "PhaseError",
    "DeadlockError",
    "ModuleChangedError",
    "DeviceMemoryError",
    "HostMemoryError",
    "SchedulerClosedError",
    "ConfigError",
    "CollectiveError",
    "WeightFileError",
]


class ResidencyError(Exception):
    """Base of every error the library raises for misuse."""


class RegistrationError(ResidencyError, ValueError):
    """A registration refused: `Scheduler.add` given bad modules, names, policies or overlapping
    ownership; `enable_offload` on a pipeline already offloaded, `disable_offload` on one that
    is not."""


class UnknownGroupError(ResidencyError, LookupError):
    """A group name (or module path) that the scheduler does not know.

    Derives from `LookupError` rather than `KeyError` so the message prints as written.
    """


class PhaseError(ResidencyError, RuntimeError):
    """A phase was used against its rules: exited out of order, re-entered, or left on another thread."""


class DeadlockError(PhaseError):
    """A phase change waits for holders that can never leave (their threads are gone) or timed out."""


class ModuleChangedError(ResidencyError, RuntimeError):
    """A diffusers pipeline's component was replaced or added after `enable_offload`: it would run
    outside every phase.  Raised by the pipeline's next offloaded call; change components with
    offloading off (`disable_offload`, change, `enable_offload`).

    Changes inside a registered module (a new dtype, new or replaced tensors) raise nothing: the
    scheduler re-packs the group at its next phase change (`Scheduler.refresh(name)` does it now).
    """


class DeviceMemoryError(ResidencyError, MemoryError):
    """A group could not be placed on the device: its storage did not fit."""


class HostMemoryError(ResidencyError, MemoryError):
    """A group's host master could not be allocated: the host is out of memory."""


class SchedulerClosedError(ResidencyError, RuntimeError):
    """The scheduler was used after `close()`."""


class ConfigError(ResidencyError, ValueError):
    """An offload configuration (dict, JSON, CLI flag or legacy switch) that cannot be honoured."""


class CollectiveError(ResidencyError, RuntimeError):
    """The ranks of a process group could not agree: they asked for different steps (phases,
    write-backs), changed a shared master differently, or a rank died or did not arrive within the
    group's timeout.  Raised on every rank that could be reached, with the same message."""


class WeightFileError(ResidencyError, ValueError):
    """A model folder's weight file is damaged: a safetensors header that does not parse or does
    not describe the file (truncated, padded, tensors that overlap or leave gaps), or a sharded
    index naming a shard that is missing or does not hold a tensor it maps (or the folder is not
    there).  Raised by
    `residency.adapters.weight_files.check_weight_files` (``python -m residency --pipeline``
    checks the folder with it before any work); the message names the file and what to do.
    Also raised when a host master is read from the weight files a pipeline was loaded from
    (`residency.host.file_reads.FileReader`) and a file was replaced, truncated or could not be
    read since; the tensors then keep their values."""
