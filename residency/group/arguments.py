"""Checks of the arguments users pass to `Scheduler` and `NoOffload`, shared by both.

Each check raises a typed error (`RegistrationError`, `ConfigError`) whose message says what was
given and what is accepted, before anything is built.
"""

from __future__ import annotations

import difflib
from collections.abc import Container, Iterable, Mapping

import torch
from torch import nn

from residency.options.budget import AutoOptions, as_auto_options
from residency.options.vllm_omni import COMPONENTS
from residency.core.enums import Policy
from residency.core.errors import ConfigError, RegistrationError
from residency.options.host_options import HostOptions, as_host_options
from residency.device.transport import default_device

__all__ = [
    "as_excluded",
    "as_modules",
    "check_flag",
    "check_host",
    "check_name",
    "check_options",
    "parse_device",
    "parse_policy",
    "unknown_group_message",
]


def check_name(name: object, *taken: Container[str]) -> None:
    """Refuse a group name that is not a non-empty string, or is in one of the `taken` tables:
    the one wording of `Scheduler`, its registry and `NoOffload` alike.

        check_name("dit", groups, aliases, claims)   # RegistrationError: already registered
        check_name(name)                              # only its type
    """
    if not isinstance(name, str) or not name:
        raise RegistrationError(
            f"a group name must be a non-empty string, not {name!r}; name groups after what "
            "they are, for example 'text_encoder' or 'dit'"
        )
    if any(name in table for table in taken):
        raise RegistrationError(
            f"a group named {name!r} is already registered; choose another name, or call "
            f"scheduler.remove({name!r}) first"
        )


def unknown_group_message(
    name: object, groups: Mapping[str, str | None], aliases: Mapping[str, str]
) -> str:
    """Why `name` leads to no group and what to do, for `UnknownGroupError`: the one wording of
    `Scheduler` and `NoOffload` alike.

    `groups` maps each group name to its category (or None), `aliases` each alias to its group.
    The message suggests the nearest name when there is one ("did you mean ...?"), says how
    pipeline groups are named when `name` is a category, lists groups and aliases apart, and
    suggests registering `name` only when it is none of these near misses.

        unknown_group_message("transfomer", {"transformer": "dit"}, {})
        # "no group named 'transfomer'; did you mean 'transformer'? The groups are 'transformer'."
    """
    known = _known_names(groups, aliases)
    if not isinstance(name, str):
        return f"group names are strings, not {type(name).__name__} ({name!r}). {known}"
    if name in COMPONENTS and groups:
        members = ", ".join(repr(g) for g, category in groups.items() if category == name)
        return (
            f"no group named {name!r}. Groups made from a pipeline are named after their "
            f"components, not by category; the {name!r} components here are "
            f"{members or 'none (that category was not registered)'}. {known}"
        )
    close = difflib.get_close_matches(name, [*groups, *aliases], n=1)
    if close:
        return f"no group named {name!r}; did you mean {close[0]!r}? {known}"
    return (
        f"no group named {name!r}. {known} To make a group of that name, register its modules "
        f"first: scheduler.add({name!r}, modules)."
    )


def _known_names(groups: Mapping[str, object], aliases: Mapping[str, str]) -> str:
    """One sentence listing the groups, and one listing the aliases (when there are any)."""
    if not groups:
        return "No groups are registered yet."
    listed = f"The groups are {', '.join(map(repr, sorted(groups)))}."
    if not aliases:
        return listed
    paths = ", ".join(f"{path!r} (group {group!r})" for path, group in sorted(aliases.items()))
    return f"{listed} The aliases (module paths that enter a group) are {paths}."


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise RegistrationError(f"{name}={value!r}; give True or False")


def parse_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    try:
        return Policy(policy)
    except ValueError:
        accepted = ", ".join(repr(p.value) for p in Policy)
        raise RegistrationError(
            f"unknown policy {policy!r}; accepted policies are {accepted}"
        ) from None


def as_modules(name: str, modules: object) -> tuple[nn.Module, ...]:
    if isinstance(modules, nn.Module):
        return (modules,)
    if isinstance(modules, (str, bytes, torch.Tensor)) or not isinstance(modules, Iterable):
        raise RegistrationError(
            f"group {name!r}: expected an nn.Module or an iterable of them, got "
            f"{type(modules).__name__}"
        )
    roots = tuple(modules)
    if not roots:
        raise RegistrationError(
            f"group {name!r}: the module list is empty; pass at least one nn.Module"
        )
    for index, module in enumerate(roots):
        if not isinstance(module, nn.Module):
            raise RegistrationError(
                f"group {name!r}: item {index} is a {type(module).__name__}, not an nn.Module; "
                "pass modules (for example pipe.text_encoder), not tensors or names"
            )
    return roots


def as_excluded(
    name: str, exclude: nn.Module | Iterable[nn.Module], roots: tuple[nn.Module, ...]
) -> tuple[nn.Module, ...]:
    excluded = (exclude,) if isinstance(exclude, nn.Module) else tuple(exclude)
    inside = {id(m) for root in roots for m in root.modules()}
    for module in excluded:
        if not isinstance(module, nn.Module) or id(module) not in inside:
            raise RegistrationError(
                f"group {name!r}: exclude= takes submodules of the modules being added, and "
                f"{type(module).__name__} is not one of them; pass modules reached from them"
            )
    return excluded


def parse_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device {device!r} is not a device torch knows ({error})") from None
    if parsed.type != "cpu" and not _accelerator_is(parsed.type):
        raise ConfigError(
            f"device {device!r} is not available here; use Scheduler() for the current "
            "accelerator (or the CPU when there is none), or Scheduler('cpu')"
        )
    return parsed


def _accelerator_is(kind: str) -> bool:
    if not torch.accelerator.is_available():
        return False
    return torch.accelerator.current_accelerator().type == kind


def check_options(chunk_nbytes, device_memory_limit, wait_timeout, record_limit, pin_memory, *,
                  auto=None, host=None, process_group=None
                  ) -> tuple[AutoOptions | None, HostOptions]:
    """The constructor's numbers and flags, checked before anything is built (no collective of
    `process_group` either); returns the options of ``auto=`` (`check_auto`) and of ``host=``
    (`check_host`)."""
    if isinstance(chunk_nbytes, bool) or not isinstance(chunk_nbytes, int) or chunk_nbytes < 1:
        raise ConfigError(f"chunk_nbytes={chunk_nbytes!r}; give a positive whole number of bytes")
    limit = device_memory_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConfigError(
            f"device_memory_limit={limit!r}; give a whole number of bytes, or None for no limit"
        )
    if wait_timeout is not None and (
        isinstance(wait_timeout, bool) or not isinstance(wait_timeout, (int, float))
        or wait_timeout <= 0
    ):
        raise ConfigError(
            f"wait_timeout={wait_timeout!r}; give a positive number of seconds, or None to wait "
            "as long as it takes"
        )
    if isinstance(record_limit, bool) or not isinstance(record_limit, int) or record_limit < 0:
        raise ConfigError(f"record_limit={record_limit!r}; give a whole number of records (>= 0)")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ConfigError(f"pin_memory={pin_memory!r}; give True, False, or None for automatic")
    return check_auto(auto, device_memory_limit), check_host(host, process_group)


def check_host(host: object, process_group: object) -> HostOptions:
    """The constructor's ``host=`` as `HostOptions`, checked with its ``process_group``."""
    options = as_host_options(host)
    if options.memory_limit is not None and process_group is not None:
        raise ConfigError(
            f"host memory_limit={options.memory_limit} with a process_group: the ranks of a host "
            "share their host masters, and shared masters are not file-backed yet, so the limit "
            "could not hold. Leave memory_limit out with a process group (the masters are then "
            "the weights once per host), or run one process per host"
        )
    return options


def check_auto(auto: object, device_memory_limit: int | None) -> AutoOptions | None:
    """The constructor's ``auto=`` as options (None: the fixed module and layer plans)."""
    options = as_auto_options(auto)
    if options is not None and device_memory_limit is not None:
        raise ConfigError(
            f"device_memory_limit={device_memory_limit!r} with auto=: an auto plan's limit is "
            "its device budget; give auto={'device_budget': ...} and drop device_memory_limit"
        )
    return options
