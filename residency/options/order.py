"""`TurnOrder`: in which order threads waiting for groups get their turns, checked by itself.

    scheduler = Scheduler("cuda", order="group")              # the default
    scheduler = Scheduler("cuda", order={"by": "group", "max_wait": 0.25})
    scheduler = Scheduler("cuda", order="arrival")            # first come, first served

Many requests on one pipeline run the same phases (encoder, experts, VAE) on their own threads.
First come, first served makes every request pay every phase change; served by group, the
requests that need the group on the device go together and share its load, and the group with
the most waiting work goes next (`residency.scheduler.holds` says how).  ``max_wait`` bounds how
long any waiter is passed over: once a thread has waited that long, its group goes next.

``order=None`` (the default) is group order with ``max_wait`` learned (``max_wait=None``): a
fixed number of seconds is either too short for long steps (a waiter ages in under one step of
the group on the device, and every turn then ends after one step of each holder) or too long for
short ones, so the default bound is `AUTO_STEPS` times the pace of the group on the device - the
median time between two departures from it, measured by the turns - within `AUTO_MAX_WAIT` (its
own pace: a group of short phases, VAE tiles say, does not shorten a DiT's bound).  One
thread alone is served exactly as first come (nobody else to wait for), and with several
requests the measured phase changes per request drop severalfold with a tail no worse than
first come's at 8 requests (benchmarks/README.md, "Many requests").  A scheduler with a
``process_group`` defaults to arrival order: its ranks must switch groups in the same order, and
group order decides from each rank's own threads' timing (``order="group"`` there is refused).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from residency.core.errors import ConfigError

__all__ = ["AUTO_MAX_WAIT", "AUTO_STEPS", "ORDERS", "TurnOrder", "as_turn_order"]

#: The orders of turns: by group (requests share phase changes) or by arrival (first come).
ORDERS = ("group", "arrival")
#: Under the learned default, a waiter is passed over for at most this many paces of the group on
#: the device (its steps): enough for the requests of a turn to finish their runs of
#: steps (8 requests x 5 steps in benchmarks/serving.py), so that they share the group's load.
AUTO_STEPS = 64
#: The learned bound's limits in seconds: before any pace is measured it is the lower one.
AUTO_MAX_WAIT = (0.5, 60.0)
_KEYS = ("by", "max_wait")
_FORMS = ('"group", "arrival", {"by": "group", "max_wait": <seconds>}, {"by": "arrival"} or '
          "None (the default: group order, max_wait learned)")


def _check_by(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, str) or value not in ORDERS:
        raise ConfigError(f"order 'by' is {value!r}; accepted forms of order are {_FORMS}")


def _check_max_wait(_instance: object, _attribute: object, value: object) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise ConfigError(
            f"order 'max_wait' is {value!r}; give a finite number of seconds >= 0 (how long a "
            f"waiter may be passed over) or leave it out (learned: {AUTO_STEPS} steps of the "
            f"device, {AUTO_MAX_WAIT[0]:g}-{AUTO_MAX_WAIT[1]:g} s)")


@attrs.frozen(kw_only=True)
class TurnOrder:
    """How waiting threads take turns: ``by`` "group" or "arrival"; ``max_wait``: under group
    order, the longest a waiter is passed over, in seconds (arrival order passes nobody over).

        TurnOrder(by="group", max_wait=0.25)
        Scheduler("cuda", order=TurnOrder(by="arrival"))

    ``max_wait=None`` (the default) is learned: `AUTO_STEPS` steps of the device, measured,
    within `AUTO_MAX_WAIT` seconds (the module's docstring says why).
    """

    #: "group": waiters of the group on the device join it, then the group with the most
    #: waiting work goes next; "arrival": first come, first served.
    by: str = attrs.field(default="group", validator=_check_by)
    #: Seconds a waiter may be passed over under group order before its group goes next; None:
    #: learned from the pace of the group on the device.
    max_wait: float | None = attrs.field(default=None, validator=_check_max_wait)

    @classmethod
    def from_dict(cls, data: Mapping) -> TurnOrder:
        """Parse ``{"by": "group", "max_wait": 0.25}`` (``by`` required)."""
        for key in data:
            if key not in _KEYS:
                raise ConfigError(
                    f"order has unknown key {key!r}; accepted keys are 'by' and 'max_wait' "
                    f"(accepted forms: {_FORMS})")
        if "by" not in data:
            raise ConfigError(f"order {dict(data)!r} has no 'by'; accepted forms are {_FORMS}")
        return cls(**data)

    def to_dict(self) -> dict:
        return {"by": self.by, "max_wait": self.max_wait}


def as_turn_order(value: object, *, process_group: object = None) -> TurnOrder:
    """`value` (a `TurnOrder`, "group", "arrival", a mapping or None) as a `TurnOrder`;
    `ConfigError` naming the accepted forms otherwise.  None is group order, or arrival order
    with a `process_group` (see the module's docstring); group order with one is refused."""
    if value is None:
        order = TurnOrder(by="group" if process_group is None else "arrival")
    elif isinstance(value, TurnOrder):
        order = value
    elif isinstance(value, str) and value in ORDERS:
        order = TurnOrder(by=value)
    elif isinstance(value, Mapping):
        order = TurnOrder.from_dict(value)
    else:
        raise ConfigError(f"order={value!r}; accepted forms are {_FORMS}")
    if order.by == "group" and process_group is not None:
        raise ConfigError(
            "order='group' with a process_group: the ranks must switch groups in the same order "
            "(their loads and evictions are collective), and group order decides from each "
            "rank's own threads' timing; give order='arrival' (the default with a process_group)")
    return order
