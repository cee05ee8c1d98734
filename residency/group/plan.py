"""A group's plan: where each of its parts is between its phases and during them.

    plan = Plan.for_group("transformer", Policy.EXCLUSIVE, (model_blocks(dit),))
    plan.own.where              # Where.SWAPPED: loaded whole when its phase begins
    plan.streamed               # ("transformer.blocks.0", ...): through the two slots
    print(plan.describe())      # transformer: own part swapped; 8 parts streamed

A group is *parts*: its own part (every tensor outside the blocks planned apart from it: in layer
mode the kept blocks are inside it) and one part per block planned apart (streamed, or under an
auto plan kept or swapped by itself).  The plan says, for each part, one `Where`:

* ``KEPT``: on the device between phases and during them (a group of policy 'resident': a VAE);
* ``SWAPPED``: loaded whole when its group's phase begins, evicted when another group's does;
* ``STREAMED``: on the host between phases; during its group's phase it passes through one of the
  two reused block slots, one block after another.

Module mode and layer mode are two plans: an own part kept or swapped, nothing streamed; an own
part swapped, its blocks streamed.  An auto plan (`residency.auto.planner`) places each block by
itself: kept, swapped or streamed apart from the own part, which is kept or swapped (its blocks
then have host masters of their own, so a new plan moves nothing but bytes); a group whose own
part is swapped and some of whose blocks are kept is *partly kept*.

The plan is data, made before the group is packed (`Plan.for_group`) and read by the owners that
carry it out: the placement (`residency.placement.placement`: which buffers a group loads into,
whether it may be prefetched, what is loaded at registration; `residency.placement.apart` for the
parts placed whole apart) and the group's stream (`residency.placement.layers`, which the plan's
streamed parts become). A plan can be computed: `Plan` validates itself, so whatever computes one
(a budget) gets a typed error for a plan no owner can carry out, before anything is packed.

Nothing here is layer mode's: a group has a stream for its streamed parts in layer mode and none
in module mode (`Residency.streams`), and the owners carry out every plan by going over them, so
no owner asks which mode a group is in.  In the glossary
(docs/design.md) *plan* means this and nothing else: the blocks a model streams are its
`ModelBlocks`, the groups found in a pipeline are its `ComponentGroups`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from residency.modules.blocks import ModelBlocks
from residency.core.enums import Policy
from residency.core.errors import RegistrationError

__all__ = ["Part", "Plan", "Where"]


class Where(enum.Enum):
    """Where one part of a group is, between its phases and during them."""

    #: On the device always: loaded when the group is added, never evicted.
    KEPT = "kept"
    #: On the device during its group's phases, loaded whole; on the host between them.
    SWAPPED = "swapped"
    #: On the host between phases; through a block slot, one block at a time, during them.
    STREAMED = "streamed"


@attrs.frozen
class Part:
    """One part of a group in its plan: its name and where it is."""

    #: The group's name for its own part; "<model path>.<block path>" for a block.
    name: str
    where: Where


def _check_parts(plan: Plan, _attribute, parts: tuple[Part, ...]) -> None:
    if not parts or parts[0].name != plan.group:
        raise RegistrationError(
            f"a plan for group {plan.group!r} begins with the group's own part, named "
            f"{plan.group!r}; it begins with {parts[0].name if parts else 'nothing'!r}"
        )
    own = parts[0]
    if own.where is Where.STREAMED:
        raise RegistrationError(
            f"group {plan.group!r}: its own part (everything outside its blocks) is kept or "
            "swapped; only blocks stream through the slots"
        )
    if not plan.exclusive and any(part.where is not Where.KEPT for part in parts):
        raise RegistrationError(
            f"group {plan.group!r} is kept on the device (policy 'resident'), so nothing of it "
            "streams or swaps; drop its streamed blocks (layers=) or use policy='exclusive'"
        )
    names = [part.name for part in parts]
    if len(set(names)) != len(names):
        raise RegistrationError(f"a plan for group {plan.group!r} names a part twice: {names}")


@attrs.frozen
class Plan:
    """Where each part of one group is (see the module docstring); validates itself.

        plan = Plan.for_group("vae", Policy.RESIDENT, ())
        plan.own.where is Where.KEPT        # True
    """

    group: str
    #: The group's own part first, then each block planned apart from it: streamed ones in
    #: streaming order.
    parts: tuple[Part, ...] = attrs.field(converter=tuple, validator=_check_parts)
    #: Whether the group is swapped by phases (policy 'exclusive'); a 'resident' group's plan
    #: keeps its own part and nothing else.
    exclusive: bool = attrs.field(default=True, kw_only=True)
    #: Whether a swapped own part loads into the scheduler's reused buffers (the fixed module and
    #: layer plans) or, as every part apart does, into a storage of its own, released when it
    #: leaves (an auto plan's: its device bytes are then exactly its parts').
    reuses_buffers: bool = attrs.field(default=True, kw_only=True)

    @classmethod
    def for_group(cls, name: str, policy: Policy, model_blocks: Sequence[ModelBlocks], *,
                  apart: bool = False) -> Plan:
        """Module mode (no `model_blocks`): the own part kept (policy 'resident') or swapped.
        Layer mode: the own part swapped, each streamed block of each `ModelBlocks` streamed.
        With `apart` (an auto scheduler's first plan of a group, before the planner's), each
        of those blocks is swapped apart from the own part instead: the group moves as in
        module mode, and any plan of its parts can follow without packing it again."""
        exclusive = policy is Policy.EXCLUSIVE
        own = Where.SWAPPED if exclusive else Where.KEPT
        where = Where.SWAPPED if apart else Where.STREAMED
        blocks = [Part(f"{chosen.model_path}.{block.path}", where)
                  for chosen in model_blocks for block in chosen.streamed]
        return cls(name, (Part(name, own), *blocks), exclusive=exclusive,
                   reuses_buffers=not apart)

    def replace(self, where: Mapping[str, Where]) -> Plan:
        """This plan with the parts named in `where` placed there (an auto plan's choice).

            plan.replace({"dit": Where.KEPT, "dit.blocks.0": Where.KEPT})
        """
        unknown = sorted(set(where) - set(self.where))
        if unknown:
            raise RegistrationError(f"group {self.group!r} has no parts {unknown}")
        return Plan(self.group, [Part(p.name, where.get(p.name, p.where)) for p in self.parts],
                    exclusive=self.exclusive, reuses_buffers=self.reuses_buffers)

    # Derived from `parts` once (read on every phase change: attributes, not calls).
    #: The group's own part: every tensor outside the blocks planned apart from it.
    own: Part = attrs.field(init=False, eq=False, repr=False)
    #: Where each part is, by name.
    where: Mapping[str, Where] = attrs.field(init=False, eq=False, repr=False)
    #: The names of the streamed parts, in streaming order.
    streamed: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)
    #: The names of the blocks kept on the device apart from the own part (they stay there
    #: while other groups run: partial residency when the own part is swapped).
    kept: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)
    #: The names of the blocks swapped apart from the own part (loaded with it, each into a
    #: storage of its own, and evicted with it).
    swapped: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)
    #: Whether any part streams (layer mode).
    streams: bool = attrs.field(init=False, eq=False, repr=False)
    #: ``"layer"`` when parts stream, else ``"module"``: which of the reused buffers the own part
    #: loads into (`residency.placement.placement.DeviceBuffers`: a phase holds only its mode's buffers).
    mode: str = attrs.field(init=False, eq=False, repr=False)
    #: Whether the group may be copied beside the current one before its phase (see [Note:
    #: layer mode holds no buffer sized for another group] in `residency.placement.placement`): its
    #: own part is swapped and is all that moves.
    prefetchable: bool = attrs.field(init=False, eq=False, repr=False)
    #: Whether every byte of the group stays on the device: its phases move nothing.
    wholly_kept: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        rest = self.parts[1:]
        named = {where: tuple(p.name for p in rest if p.where is where) for where in Where}
        streamed, swapped = named[Where.STREAMED], named[Where.SWAPPED]
        own_kept = self.parts[0].where is Where.KEPT
        for name, value in (("own", self.parts[0]),
                            ("where", MappingProxyType({p.name: p.where for p in self.parts})),
                            ("streamed", streamed), ("kept", named[Where.KEPT]),
                            ("swapped", swapped), ("streams", bool(streamed)),
                            ("mode", "layer" if streamed else "module"),
                            ("prefetchable", not own_kept and not streamed and not swapped
                             and self.reuses_buffers),
                            ("wholly_kept", own_kept and not streamed and not swapped)):
            object.__setattr__(self, name, value)

    def describe(self) -> str:
        """One line: where the own part is, and how many parts are kept, swapped and streamed
        apart from it.

            transformer: own part swapped; 8 parts streamed through the block slots
        """
        text = f"{self.group}: own part {self.own.where.value}"
        for names, how in ((self.kept, "kept"), (self.swapped, "swapped")):
            if names:
                text += f"; {len(names)} parts {how} apart"
        if self.streams:
            text += f"; {len(self.streamed)} parts streamed through the block slots"
        return text
