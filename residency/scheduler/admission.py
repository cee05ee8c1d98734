"""Admission: how a group comes to be registered, and how it leaves (``add``, ``refresh``,
``remove``, ``close``).

    admission.register(GroupSpec(name="dit", roots=(transformer,), policy=Policy.EXCLUSIVE))
    admission.remove(group, "remove")

A registration claims the name, modules and tensors under the lock, packs the host master outside
it (see [Note: packing outside the lock]), then enrolls the group with the registry and gives it
its place with the placement; whatever step an exception (an interrupt included) stops at is
undone.  A removal evicts and forgets a group, refused while a phase of it is active.  The
facade checks the arguments and takes the lock; this file asks the registry, the packer, the
placement and the holds, and calls nothing above them.  It holds no state of its own.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

import attrs
from torch import nn

from residency.placement.adoption import why_shared
from residency.core.enums import Policy
from residency.group.residency import Residency
from residency.modules.blocks import ModelBlocks
from residency.core.errors import PhaseError, RegistrationError, SchedulerClosedError
from residency.scheduler.holds import Holds
from residency.placement.layers import build_stream, restream, streamed_modules
from residency.core.locks import locked
from residency.host.packing import Packer
from residency.group.plan import Plan
from residency.placement.placement import Placement
from residency.group.records import BlockLog
from residency.group.registry import Claim, Registry
from residency.multirank.sharded import ShardedLoad
from residency.device.transport import Transport

__all__ = ["Admission", "GroupSpec", "check_open", "sharded_load"]


@attrs.frozen(kw_only=True)
class GroupSpec:
    """What `Scheduler.add` was given for one group, checked (or what a refresh reads back from
    the group it replaces): carried down whole to the owners that build the group.

        spec = GroupSpec(name="dit", roots=(transformer,), policy=Policy.EXCLUSIVE)
    """

    name: str
    roots: tuple[nn.Module, ...]
    policy: Policy
    #: Submodules left out of the group (theirs are other groups' or none's).
    excluded: tuple[nn.Module, ...] = ()
    #: The config component ("dit", ...), or None.
    category: str | None = None
    detect_edits: bool = True
    #: The blocks packed apart from the own part (layer mode, or an auto plan's); () for none.
    model_blocks: tuple[ModelBlocks, ...] = ()
    #: How a group shared by a node's ranks loads (``weight_transfer="allgather"``), or None.
    sharded: ShardedLoad | None = None


class Admission:
    """Registers and removes the groups of one scheduler (see the module docstring)."""

    def __init__(self, lock: threading.RLock, *, registry: Registry, packer: Packer,
                 placement: Placement, holds: Holds, transport: Transport,
                 block_records: BlockLog, auto: bool = False) -> None:
        self._lock = lock
        self._registry = registry
        self._packer = packer
        self._placement = placement
        self._holds = holds
        self._transport = transport
        self._block_records = block_records
        #: Whether groups are planned by an auto scheduler: each block is packed apart from the
        #: own part (swapped, until the planner places it), so any plan can follow.
        self._auto = auto

    def refresh(self, name: str) -> Residency:
        """Withdraw group `name` and register its modules again as they are now (see
        `Scheduler.refresh`); an interrupted refresh is rolled forward once."""
        old, model_blocks, excluded, aliases = locked(self._lock, self._read_for_refresh, name)
        try:
            return self._refresh(old, model_blocks, excluded, aliases)
        except BaseException:  # rolled forward once (see [Note: interrupts] in residency.scheduler.scheduler)
            if name not in self._registry:
                self._refresh(old, model_blocks, excluded, aliases)
            raise

    def register(self, spec: GroupSpec, aliases: Iterable[str] = ()) -> Residency:
        """Plan, claim, pack and enroll the group `spec` describes (`add`, `refresh`); on any
        exception, whatever step it reached is undone (see [Note: interrupts] in the facade).

        The plan (`residency.group.plan`) comes first: it names the parts that are packed."""
        plan = Plan.for_group(spec.name, spec.policy, spec.model_blocks, apart=self._auto)
        streamed = tuple(self._packer.inventory((m,), ())
                         for m in streamed_modules(spec.model_blocks))
        inventory = self._packer.inventory(spec.roots, spec.excluded,
                                           allow_empty=len(plan.parts) > 1)
        claim = Claim(spec.name, spec.policy, inventory, streamed, spec.sharded)
        group = None
        try:
            locked(self._lock, self._reserve, claim)
            group = self._pack_claimed(claim, plan, spec)
            return locked(self._lock, self._enroll, group, claim, aliases)
        except BaseException:
            locked(self._lock, self._cancel, claim, group)
            raise

    def _reserve(self, claim: Claim) -> None:
        """Check a claim against everything registered and reserve it."""
        check_open(self._holds)
        self._registry.check_claimable(claim)
        self._placement.check_budget(
            claim.name, self._registry.needs(claim.name, claim.policy, claim.device_need))
        self._registry.claim(claim)

    def _cancel(self, claim: Claim, group: Residency | None) -> None:
        """Undo a registration that did not complete: its claim, the wrappers of its stream."""
        self._registry.release_claim(claim)
        if group is not None and group not in list(self._registry):
            _cancel_reads(group)
            for stream in group.streams:
                stream.close()

    def _pack_claimed(self, claim: Claim, plan: Plan, spec: GroupSpec) -> Residency:
        """Pack a claimed group outside the lock (see [Note: packing outside the lock])."""
        # [Note: packing outside the lock] Building a master of many GiB takes seconds; phases of
        # other threads must not wait for it.  The claim keeps the name, modules and tensors
        # from being registered twice meanwhile.
        sharded = claim.sharded
        pack = functools.partial(self._packer.pack, require_shared=why_shared(sharded))
        group = Residency(
            claim.name, spec.roots, claim.policy, claim.inventory,
            pack(claim.name, claim.inventory), self._transport, excluded=spec.excluded,
            category=spec.category, detect_edits=spec.detect_edits, sharded=sharded, plan=plan,
        )
        try:
            group.streams = build_stream(
                group, spec.model_blocks, claim.streamed, pack=pack, transport=self._transport,
                slots=self._placement.slots, lock=self._lock, log=self._block_records,
            )
            return group
        except BaseException:
            for stream in group.streams:
                stream.close()
            raise

    def _enroll(self, group: Residency, claim: Claim, aliases: Iterable[str]) -> Residency:
        """Register a packed group and give it its place (an always-resident one loads now);
        undone on any exception."""
        check_open(self._holds)
        try:
            self._registry.enroll(group, aliases)
            self._placement.admit(group)
            return group
        except BaseException:
            self._placement.remove(group, evict=True)
            self._registry.unregister(group)
            raise

    def check_not_in_a_phase(self, group: Residency, action: str) -> None:
        self._holds.collect_abandoned()
        if self._holds.involves(group):
            raise PhaseError(
                f"cannot {action} group {group.name!r} while a phase of it is active "
                "(possibly suspended by a nested phase); call it between phases"
            )

    def check_no_holders(self, action: str) -> None:
        self._holds.collect_abandoned()
        if self._holds.has_holders():
            raise PhaseError(
                f"cannot {action} while a phase is active; "
                f"{self._holds.describe_holders(self._placement.current)}. Call it between phases"
            )


    def _read_for_refresh(self, name: str) -> tuple:
        old = self._registry.lookup(name)  # a phase of it refuses the refresh in `remove`
        return (old, *restream(old), self._registry.aliases_of(old))

    def _refresh(self, old: Residency, model_blocks, excluded, aliases) -> Residency:
        """Withdraw `old` (its edits written back, its tensors on its host master), then register
        its modules again as they are.  Repeatable: each step reads where the last one ended."""
        locked(self._lock, self.remove, old, "refresh")
        return self.register(GroupSpec(
            name=old.name, roots=old.modules, policy=old.policy, excluded=excluded,
            category=old.category, detect_edits=old.detect_edits, model_blocks=model_blocks,
            sharded=old.sharded), aliases)

    def close(self, reopen: str) -> None:
        """Every group leaves, then the owners close (`Scheduler.close`; the lock held): refused,
        changing nothing, while a phase is active; a second close does nothing.  Repeatable: an
        interrupted step is done again by the next close."""
        if self._holds.closed:
            return
        self.check_no_holders("close the scheduler")
        for group in self._registry:
            self.check_not_in_a_phase(group, "close the scheduler with")
        for group in self._registry:
            self.remove(group, "close the scheduler with")
        try:  # repeatable: an interrupted step is done again
            self._close_owners(reopen)
        except BaseException:
            self._close_owners(reopen)
            raise

    def _close_owners(self, reopen: str) -> None:
        self._placement.release_shared()
        self._registry.close()
        self._holds.close(reopen)  # the one closed flag; waiters wake up to SchedulerClosedError

    def remove(self, group: Residency | str, action: str) -> Residency:
        """Evict `group` (or the group named so) and forget it; refused while a phase of it is
        active, or when its eviction is refused (then nothing changed).  Completes an
        interrupted removal."""
        group = self._registry.lookup(group) if isinstance(group, str) else group
        if self._registry.get(group.name) is not group:
            return group  # removed already (an interrupted refresh's second try)
        self.check_not_in_a_phase(group, action)
        try:
            self._placement.remove(group, evict=True)
            self._registry.unregister(group)
            _cancel_reads(group)
        except BaseException:  # rolled forward unless the eviction was refused
            if not group.is_resident or group.exclusive and self._placement.current is not group:
                self._placement.remove(group, evict=False)
                self._registry.unregister(group)
                _cancel_reads(group)
            raise
        return group


def sharded_load(node, ledger, name: str, weight_transfer: object) -> ShardedLoad | None:
    """How group `name` loads: None for ``"rank-local"``; refused without a node to share."""
    if weight_transfer == "rank-local":
        return None
    if weight_transfer != "allgather":
        raise RegistrationError(
            f"group {name!r}: weight_transfer={weight_transfer!r}; give 'rank-local' (every "
            "rank copies all bytes) or 'allgather' (the ranks of a node split the copy)"
        )
    if node is None:
        raise RegistrationError(
            f"group {name!r}: weight_transfer='allgather' splits the copy among the ranks of "
            "a node, and this scheduler has none; create it with "
            "Scheduler(process_group=...) in a job with several ranks per host"
        )
    return ShardedLoad(group=node.group, local_rank=node.local_rank,
                       local_world=node.local_world_size, ledger=ledger)


def _cancel_reads(group: Residency) -> None:
    """A group that leaves before its first load: the reads of its masters still arriving
    (`residency.host.read_behind`) stop, and its tensors stay on their weight files."""
    for part in (group, *group.parts):
        part.host_master.cancel_reads()


def check_open(holds: Holds) -> None:
    """Refuse a verb of a closed scheduler, with the advice its `close` left (`Holds.reopen`)."""
    if holds.closed:
        raise SchedulerClosedError(
            f"this scheduler was closed; its modules are back in host memory. {holds.reopen}"
        )
