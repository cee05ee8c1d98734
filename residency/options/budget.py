"""`AutoOptions`: how much device memory an auto plan may use, parsed and checked in one place.

    options = AutoOptions(device_budget="38GiB")           # or 0.9: nine tenths of the free memory
    scheduler = Scheduler("cuda", auto=options)             # or auto={"device_budget": "38GiB"}
    budget, headroom = options.resolve(free=80 * 2**30)     # bytes; headroom: kept for activations

An auto scheduler (`residency.auto.planner`) chooses, for each group and part, whether it stays on
the device, is swapped whole or is streamed, so that the weights it holds never exceed
``budget - headroom``.  The budget is given as bytes (an int), as text (``"38GiB"``, ``"500 MB"``)
or as a fraction in (0, 1] of the device memory free when the scheduler resolves it (its
construction, and each `Scheduler.set_device_budget`).  Headroom is what the plan leaves free for
activations and the allocator: bytes or text; by default a twentieth of the budget
(`DEFAULT_HEADROOM_FRACTION`).  A phase order may be declared (the group names of one call, in
order); else the first call observes it, planned as if every group took turns in registration
order.  Every refusal is a `ConfigError` that names the field, the value and what is accepted.

`parse_nbytes` reads a size given as text; `format_nbytes` writes a byte count back as text
(what the auto plan's, the blocks' and the timeline's descriptions print).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence

import attrs

from residency.core.errors import ConfigError

__all__ = [
    "AutoOptions",
    "DEFAULT_DRIFT",
    "DEFAULT_HEADROOM_FRACTION",
    "check_option_keys",
    "counted",
    "format_nbytes",
    "parse_nbytes",
]

#: Headroom when none is given: this fraction of the resolved budget.
DEFAULT_HEADROOM_FRACTION = 0.05
#: Re-plan when two calls in a row move bytes, or take seconds, off the prediction by more than
#: this fraction of it.
DEFAULT_DRIFT = 0.25

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_FIELDS = ("device_budget", "headroom", "phase_order", "drift")


def check_option_keys(label: str, options: object, fields: Sequence[str], *, give: str) -> None:
    """Refuse `options` (given as `label`) unless it is a mapping whose keys are all among
    `fields`; the message names the first unknown key's close match.

        check_option_keys("auto_options", {"budget": 1}, _FIELDS, give="an object")
        # ConfigError: auto_options has unknown keys ['budget']; ... Did you mean 'device_budget'?
    """
    if not isinstance(options, Mapping):
        raise ConfigError(f"{label}={options!r}; give {give} with any of the keys "
                          f"{', '.join(fields)}")
    unknown = sorted(str(key) for key in options if key not in fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{label} has unknown keys {unknown}; the keys are {', '.join(fields)}{hint}"
        )


def parse_nbytes(field: str, value: object) -> int:
    """Bytes from a whole number or a text such as ``"38GiB"`` or ``"500 MB"``.

        parse_nbytes("headroom", "2GiB")    # 2147483648
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 0:
            return value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ConfigError(
        f"{field}={value!r}; give a whole number of bytes (>= 0) or a size such as '38GiB', "
        "'500MB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )


def format_nbytes(nbytes: float, digits: int = 1) -> str:
    """A byte count as text in the largest binary unit it reaches (B, KiB, MiB, GiB), with
    `digits` decimals (whole bytes below a KiB): what describes and tables print.

        format_nbytes(151_552)           # '148.0 KiB'
        format_nbytes(2**30, digits=2)   # '1.00 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


def counted(count: int, noun: str, plural: str = "") -> str:
    """`count` and `noun`, the noun plural unless the count is one (`plural`, else noun + "s").

        counted(1, "step")                 # '1 step'
        counted(3, "pass", "passes")       # '3 passes'
    """
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _check_budget(_instance, _attribute, value: object) -> None:
    if value is None:
        return
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ConfigError(
                f"device_budget={value!r}; a fraction of the free device memory is in (0, 1]: "
                "give e.g. 0.9, or bytes (an int or a size such as '38GiB')"
            )
        return
    if parse_nbytes("device_budget", value) == 0:
        raise ConfigError(f"device_budget={value!r}; give more than 0 bytes")


def _check_headroom(_instance, _attribute, value: object) -> None:
    if value is not None:
        parse_nbytes("headroom", value)


def _to_order(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _check_order(_instance, _attribute, value: object) -> None:
    if value is None:
        return
    if (not isinstance(value, tuple) or not value
            or not all(isinstance(name, str) and name for name in value)):
        shown = list(value) if isinstance(value, tuple) else value  # as the user gave it
        raise ConfigError(
            f"phase_order={shown!r}; give the group names one call enters, in order (e.g. "
            "['text_encoder', 'transformer', 'vae']), or leave it out to observe the first call"
        )


def _check_drift(_instance, _attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"drift={value!r}; give a positive fraction, e.g. {DEFAULT_DRIFT}")


@attrs.frozen
class AutoOptions:
    """The options of an auto plan (see the module docstring); validates itself.

        AutoOptions.from_dict({"device_budget": "24GiB", "headroom": "2GiB"})
    """

    #: Bytes, a size text, or a fraction in (0, 1] of the free device memory; None: all of it.
    device_budget: int | str | float | None = attrs.field(
        default=None, validator=_check_budget, eq=lambda value: (type(value), value))
    #: Bytes (or a size text) kept free for activations; None: `DEFAULT_HEADROOM_FRACTION` of
    #: the budget.
    headroom: int | str | None = attrs.field(default=None, validator=_check_headroom)
    #: The group names one call enters, in order; None: observed on the first call.
    phase_order: tuple[str, ...] | None = attrs.field(default=None, converter=_to_order,
                                                      validator=_check_order)
    #: Re-plan after two calls in a row off the prediction by more than this fraction.
    drift: float = attrs.field(default=DEFAULT_DRIFT, validator=_check_drift)

    @classmethod
    def from_dict(cls, options: object) -> AutoOptions:
        """From a mapping with the keys above, each optional (``auto_options`` of a config)."""
        if isinstance(options, AutoOptions):
            return options
        check_option_keys("auto_options", options, _FIELDS, give="an object")
        return cls(**options)

    def to_dict(self) -> dict[str, object]:
        """The options given (defaults left out), as a config's ``auto_options``."""
        given = {field.name: getattr(self, field.name) for field in attrs.fields(AutoOptions)
                 if getattr(self, field.name) != field.default}
        if "phase_order" in given:
            given["phase_order"] = list(given["phase_order"])
        return given

    def resolve(self, free: int | None) -> tuple[int, int]:
        """(budget, headroom) in bytes; `free` is the device memory free now (None: unknown,
        refused for a fractional or absent budget)."""
        budget = self.device_budget
        if budget is None or isinstance(budget, float):
            fraction = 1.0 if budget is None else budget
            if free is None:
                raise ConfigError(
                    f"device_budget={budget!r} is a share of the free device memory, and this "
                    "device does not report it; give bytes, e.g. device_budget='20GiB'"
                )
            budget = int(free * fraction)
        else:
            budget = parse_nbytes("device_budget", budget)
        if self.headroom is None:
            return budget, int(budget * DEFAULT_HEADROOM_FRACTION)
        headroom = parse_nbytes("headroom", self.headroom)
        if headroom >= budget:
            raise ConfigError(
                f"headroom={self.headroom!r} ({headroom} bytes) leaves nothing of "
                f"device_budget ({budget} bytes) for weights; give a smaller headroom or a "
                "larger budget"
            )
        return budget, headroom


def as_auto_options(auto: object) -> AutoOptions | None:
    """`Scheduler`'s ``auto=``: None/False (fixed plans), True (defaults), a mapping or options."""
    if auto is None or auto is False:
        return None
    if auto is True:
        return AutoOptions()
    return AutoOptions.from_dict(auto)
