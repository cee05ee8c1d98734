"""A group's plan: where each of its parts is between its phases and during them.

    plan = Plan.for_group("transformer", Policy.EXCLUSIVE, (model_blocks(dit),))
    plan.own.where              # Where.SWAPPED: loaded whole when its phase begins
    plan.streamed               # ("transformer.blocks.0", ...): through the two slots
    print(plan.describe())      # transformer: own part swapped; 8 parts streamed

A group is *parts*: its own part (every tensor outside its streamed blocks, kept blocks included)
and, in layer mode, one part per streamed block.  The plan says, for each part, one `Where`:

* ``KEPT``: on the device between phases and during them (a group of policy 'resident': a VAE);
* ``SWAPPED``: loaded whole when its group's phase begins, evicted when another group's does;
* ``STREAMED``: on the host between phases; during its group's phase it passes through one of the
  two reused block slots, one block after another.

Module mode and layer mode are two plans: an own part kept or swapped, nothing streamed; an own
part swapped, its blocks streamed.  The plan is data, made before the group is packed
(`Plan.for_group`) and read by the owners that carry it out: the placement
(`residency.engine.placement`: which buffers a group loads into, whether it may be prefetched,
what is loaded at registration) and the group's stream (`residency.engine.layers`, which the
plan's streamed parts become).  A
plan can be computed: `Plan` validates itself, so whatever computes one (a budget) gets a typed
error for a plan no owner can carry out, before anything is packed.

Nothing here is layer mode's: a group has a stream for its streamed parts in layer mode and none
in module mode (`Residency.streams`), and the owners carry out every plan by going over them, so
no owner asks which mode a group is in.  In the glossary
(docs/design.md) *plan* means this and nothing else: the blocks a model streams are its
`ModelBlocks`, the groups found in a pipeline are its `ComponentGroups`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from residency.engine.blocks import ModelBlocks
from residency.engine.enums import Policy
from residency.engine.errors import RegistrationError

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
    own, rest = parts[0], parts[1:]
    if own.where is Where.STREAMED:
        raise RegistrationError(
            f"group {plan.group!r}: its own part (everything outside its blocks) is kept or "
            "swapped; only blocks stream through the slots"
        )
    moved = [part.name for part in rest if part.where is not Where.STREAMED]
    if moved:
        raise RegistrationError(
            f"group {plan.group!r}: blocks {moved} are planned {Where.KEPT.value!r} or "
            f"{Where.SWAPPED.value!r} apart from the group's own part; a block stays on the "
            "device by joining the own part (model_blocks(..., resident_layers=k) keeps the "
            "first k), else it streams"
        )
    if rest and own.where is Where.KEPT:
        raise RegistrationError(
            f"group {plan.group!r} is kept on the device (policy 'resident'), so nothing of it "
            "streams; drop its streamed blocks (layers=) or use policy='exclusive'"
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
    #: The group's own part first, then each streamed part in streaming order.
    parts: tuple[Part, ...] = attrs.field(converter=tuple, validator=_check_parts)

    @classmethod
    def for_group(cls, name: str, policy: Policy, model_blocks: Sequence[ModelBlocks]) -> Plan:
        """Module mode (no `model_blocks`): the own part kept (policy 'resident') or swapped.
        Layer mode: the own part swapped, each streamed block of each `ModelBlocks` streamed."""
        own = Where.KEPT if policy is Policy.RESIDENT else Where.SWAPPED
        streamed = [Part(f"{blocks.model_path}.{block.path}", Where.STREAMED)
                    for blocks in model_blocks for block in blocks.streamed]
        return cls(name, (Part(name, own), *streamed))

    # Derived from `parts` once (read on every phase change: attributes, not calls).
    #: The group's own part: every tensor outside its streamed blocks.
    own: Part = attrs.field(init=False, eq=False, repr=False)
    #: The names of the streamed parts, in streaming order.
    streamed: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)
    #: Whether any part streams (layer mode).
    streams: bool = attrs.field(init=False, eq=False, repr=False)
    #: ``"layer"`` when parts stream, else ``"module"``: which of the reused buffers the own part
    #: loads into (`residency.engine.buffers`: a phase holds only its mode's buffers).
    mode: str = attrs.field(init=False, eq=False, repr=False)
    #: Whether the group may be copied beside the current one before its phase (see [Note:
    #: layer mode holds no buffer sized for another group] in `residency.engine.buffers`): its
    #: own part is swapped and nothing of it streams.
    prefetchable: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        streamed = tuple(part.name for part in self.parts[1:])
        for name, value in (("own", self.parts[0]), ("streamed", streamed),
                            ("streams", bool(streamed)),
                            ("mode", "layer" if streamed else "module"),
                            ("prefetchable", self.parts[0].where is Where.SWAPPED
                             and not streamed)):
            object.__setattr__(self, name, value)

    def describe(self) -> str:
        """One line: where the own part is, and how many parts stream.

            transformer: own part swapped; 8 parts streamed through the block slots
        """
        text = f"{self.group}: own part {self.own.where.value}"
        if self.streams:
            text += f"; {len(self.streamed)} parts streamed through the block slots"
        return text
