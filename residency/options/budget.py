"""`AutoOptions`: how much device memory an auto plan may use, parsed and checked in one place.

    options = AutoOptions(device_budget="38GiB")           # or 0.9: nine tenths of the free memory
    scheduler = Scheduler("cuda", auto=options)             # or auto={"device_budget": "38GiB"}
    budget, headroom = options.resolve(free=80 * 2**30)     # bytes; headroom: kept for activations

An auto scheduler (`residency.auto.planner`) chooses, for each group and part, whether it stays on
the device, is swapped whole or is streamed, so that the weights it holds never exceed
``budget - headroom``.  [Note: budgets parse one way]: the budget is bytes or a fraction of the
device memory free when the scheduler resolves it (its construction, and each
`Scheduler.set_device_budget`).  Headroom is what the plan leaves free for activations and the
allocator: bytes (0 too); by default a twentieth of the budget (`DEFAULT_HEADROOM_FRACTION`).  A phase order may be declared (the group names of one call, in
order); else the first call observes it, planned as if every group took turns in registration
order.  Every refusal is a `ConfigError` that names the field, the value and what is accepted.

[Note: budgets parse one way]
Bytes are an int (>= 1 for a budget, >= 0 for a headroom or a limit), or text: digits with an
optional unit (``"2048"``, ``"500MB"``, ``"38GiB"``), or a decimal with a unit of KB or more that
comes to a whole number of bytes (``"1.5GiB"``; ``"3.7B"`` and ``"1.0001KB"`` do not).  A fraction
is a float in (0, 1] or text ``"N%"`` with N in (0, 100].  Text is never a bare fraction: ``"0.5"``
could be half the memory or half a byte, so it is refused, as are ``"1.5"`` and ``"2.0"``.  Every
refusal names both forms.  A budget in bytes above the device's total memory (where it reports
one) is taken, with one warning naming both figures at each resolution.

`parse_nbytes` reads a byte count; `format_nbytes` writes one back as text (what the auto plan's,
the blocks' and the timeline's descriptions print).
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

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
_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_BYTES_FORMS = ("a size such as '38GiB', '1.5GiB', '500MB', '2048' (units B, KB, MB, GB, TB, KiB, "
                "MiB, GiB, TiB; a decimal needs KB or more and must come to whole bytes)")
_FRACTION_FORMS = ("a fraction of the free device memory: a float in (0, 1] such as 0.9, or a "
                   "percentage such as '90%'")
_log = logging.getLogger("residency")
_FIELDS = ("device_budget", "headroom", "phase_order", "passes", "drift")


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
    """Bytes from a whole number >= 0 or a size text ([Note: budgets parse one way]).

        parse_nbytes("headroom", "1.5GiB")    # 1610612736
        parse_nbytes("headroom", "3.7B")      # ConfigError: not a whole number of bytes
    """
    nbytes = _nbytes(value)
    if nbytes is None:
        raise ConfigError(f"{field}={value!r}; give bytes: a whole number >= 0, or {_BYTES_FORMS}")
    return nbytes


def _nbytes(value: object) -> int | None:
    """The bytes `value` names, or None when it names none (negative, fractional, not a size)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None or match.group(3).lower() not in _UNITS:
        return None
    whole, decimals, unit = match.group(1), match.group(2), _UNITS[match.group(3).lower()]
    if decimals is None:
        return int(whole) * unit
    exact = Fraction(f"{whole}.{decimals}") * unit
    return int(exact) if unit >= _UNITS["kb"] and exact.denominator == 1 else None


def _share(budget: object) -> float | None:
    """The fraction of the free memory a budget names (a float, or "N%" text), else None."""
    if isinstance(budget, float):
        return budget
    match = _PERCENT.match(budget) if isinstance(budget, str) else None
    return None if match is None else float(match.group(1)) / 100


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
    share = _share(value)
    if share is not None and 0.0 < share <= 1.0:
        return
    if share is None and (_nbytes(value) or 0) >= 1:
        return
    raise ConfigError(
        f"device_budget={value!r}; give bytes (a whole number >= 1, or {_BYTES_FORMS}) or "
        f"{_FRACTION_FORMS}; text is never a bare fraction (write 0.5 or '50%', not '0.5')")


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


def _to_passes(value: object) -> object:
    if isinstance(value, Mapping) and all(isinstance(name, str) for name in value):
        return tuple(sorted(value.items()))
    return value


def _check_passes(_instance, _attribute, value: object) -> None:
    if value is None:
        return
    if (isinstance(value, tuple) and value and all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]
            and type(pair[1]) is int and pair[1] >= 1 for pair in value)):
        return
    shown = dict(value) if isinstance(value, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 for p in value) else value  # as the user gave it
    raise ConfigError(
        f"passes={shown!r}; give an object of group names and the forwards of each group's "
        "model one call runs, each a whole number >= 1 (e.g. {'transformer': 100} for 50 steps "
        "under classifier-free guidance run as two batches), or leave it out to learn them from "
        "the first call")


def _check_drift(_instance, _attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"drift={value!r}; give a positive fraction, e.g. {DEFAULT_DRIFT}")


@attrs.frozen
class AutoOptions:
    """The options of an auto plan (see the module docstring); validates itself.

        AutoOptions.from_dict({"device_budget": "24GiB", "headroom": "2GiB"})
    """

    #: Bytes (an int or a size text), or a fraction of the free device memory (a float in (0, 1]
    #: or "N%"); None: all of it.  [Note: budgets parse one way]
    device_budget: int | str | float | None = attrs.field(
        default=None, validator=_check_budget, eq=lambda value: (type(value), value))
    #: Bytes (or a size text) kept free for activations; None: `DEFAULT_HEADROOM_FRACTION` of
    #: the budget.
    headroom: int | str | None = attrs.field(default=None, validator=_check_headroom)
    #: The group names one call enters, in order; None: observed on the first call.
    phase_order: tuple[str, ...] | None = attrs.field(default=None, converter=_to_order,
                                                      validator=_check_order)
    #: Forwards of each group's model one call runs, by group name (a denoiser: its steps, twice
    #: each under classifier-free guidance run as two batches), as ((name, count), ...) sorted by
    #: name (a mapping is converted); None: one per phase until the first call is observed.
    passes: tuple[tuple[str, int], ...] | None = attrs.field(
        default=None, converter=_to_passes, validator=_check_passes)
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
        if "passes" in given:
            given["passes"] = dict(given["passes"])
        return given

    def resolve(self, free: int | None, total: int | None = None) -> tuple[int, int]:
        """(budget, headroom) in bytes; `free` is the device memory free now (None: unknown,
        refused for a fractional or absent budget); `total` the device's whole memory (None:
        unknown), which a budget in bytes above it is warned about."""
        budget = self.device_budget
        fraction = 1.0 if budget is None else _share(budget)
        if fraction is not None:
            if free is None:
                raise ConfigError(
                    f"device_budget={budget!r} is a share of the free device memory, and this "
                    "device does not report it; give bytes, e.g. device_budget='20GiB'"
                )
            budget = int(free * fraction)
        else:
            budget = parse_nbytes("device_budget", budget)
            if total is not None and budget > total:
                _log.warning("device_budget=%r (%s) is more than the device's total memory (%s): "
                             "the plan may place more than fits; give a smaller budget, or a "
                             "fraction such as 0.9", self.device_budget, format_nbytes(budget),
                             format_nbytes(total))
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
