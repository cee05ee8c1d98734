"""Where a scheduler's host masters live: the options of the host tiers, checked by themselves.

    scheduler = Scheduler("cuda", host={"cache_directory": "~/.cache/residency"})
    scheduler = Scheduler("cuda", host=HostOptions(memory_limit="16GiB"))

By default (no options) every master is host memory of the process: pinned when it can be, or a
node-shared segment when ranks of one host share it.  The options add two tiers:

- ``cache_directory``: a warm-restart cache.  A master packed from weight files (tensors that are
  still untouched views of a safetensors mapping) is written there in its final layout, one file
  per group, keyed by the source files' identity and the alignment class; a later start maps the
  file instead of packing again (`residency.host.master_cache`).
- ``memory_limit``: the host bytes the masters may hold.  Masters beyond it stay file-backed (a
  writable file of ours in ``spill_directory``), paged in when their group is read, read ahead
  before the phase that needs them, and dropped when the limit needs the room.

And one about when a master is built:

- ``background_reads``: a group whose tensors are still views of their weight files is read
  behind the first phase: ``add`` returns at once, the files are read on a thread of the
  scheduler's in the order the groups were added, and a group's first load waits for its own
  bytes only (`residency.host.read_behind`).  Off by default (``add`` returns with the master
  built); `residency.adapters.diffusers.from_pretrained` turns it on.

One owner: the `Packer` holds the options for its scheduler; nothing else reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from residency.options.budget import check_option_keys, parse_nbytes
from residency.core.errors import ConfigError

__all__ = ["HostOptions", "as_host_options"]

_FIELDS = ("cache_directory", "memory_limit", "spill_directory", "background_reads")


def _to_path(value: object) -> object:
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(os.path.expanduser(str(value)))
    return value


def _check_directory(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, Path):
        raise ConfigError(
            f"{attribute.name}={value!r}; give a directory path (a str or os.PathLike), or None"
        )


def _check_flag(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}={value!r}; give True or False")


def _to_nbytes(value: object) -> object:
    return value if value is None else parse_nbytes("memory_limit", value)


@attrs.frozen(kw_only=True)
class HostOptions:
    """The host tiers of a scheduler's masters (see the module docstring); validates itself.

        HostOptions(cache_directory="/scratch/residency-cache", memory_limit="16GiB")
    """

    #: Where packed masters are cached for a warm restart; None: no cache.
    cache_directory: Path | None = attrs.field(default=None, converter=_to_path,
                                               validator=_check_directory)
    #: The host bytes the masters may hold (a whole number or a size text such as ``"16GiB"``);
    #: None: no limit, every master in memory.
    memory_limit: int | None = attrs.field(default=None, converter=_to_nbytes)
    #: Where masters beyond `memory_limit` keep their file; None: `cache_directory` when given,
    #: else the system's temporary directory.
    spill_directory: Path | None = attrs.field(default=None, converter=_to_path,
                                               validator=_check_directory)
    #: Read the masters of groups still on their weight files in the background, each group's
    #: first load waiting for its own bytes; False: ``add`` reads them before it returns.
    background_reads: bool = attrs.field(default=False, validator=_check_flag)

    @classmethod
    def from_dict(cls, options: object) -> HostOptions:
        """From a mapping with the keys above, each optional."""
        if isinstance(options, HostOptions):
            return options
        check_option_keys("host", options, _FIELDS, give="HostOptions or an object")
        return cls(**options)


def as_host_options(host: object) -> HostOptions:
    """The constructor's ``host=`` as options (None: every master in host memory, no cache)."""
    return HostOptions() if host is None else HostOptions.from_dict(host)
