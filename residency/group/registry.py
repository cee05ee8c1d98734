"""The registry: group names, aliases, claims, and every ownership rule.

The one answer to "whose module or tensor is this?" - asked by the scheduler at registration and by
discovery and the diffusers adapter before they build groups.

* A **group** is a registered `Residency`; a **claim** is a group `add` is still packing (its name,
  modules and tensors are taken already); an **alias** is another name (a dotted module path) that
  leads to a group.
* A tensor belongs to one group at most (storage shared with another group's tensor counts: tied
  weights must be in one group).
* A module belongs to one group of one scheduler in the process.

[Note: the one process-wide map]
Two schedulers that accepted the same module would both re-point its tensors and hold its weights
twice.  To refuse the second, ownership has to be known across schedulers, so a process-wide
``WeakKeyDictionary`` maps each registered module to its owner (a weak reference to the registry and
the group name).  It is the library's only module-level state: weak on both sides, so it keeps
nothing alive, and written only under the owning scheduler's lock plus its own small lock.

Fields (guarded by the scheduler lock; `Registry` is their one mutator):

* ``_groups``: name -> group.  Invariant: names, aliases and claim names are pairwise distinct.
  ``groups`` is a read-only view of it, live: the phase entry reads it without a call (the
  scheduler's lookup of a name, the holds' check that a waiting group is still registered).
* ``_aliases``: alias -> group name.  Invariant: every alias leads to a registered group.
* ``_claims``: name -> `Claim` while `add` packs outside the lock.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Iterable, Iterator

import attrs
import torch
from torch import nn

from residency.group.arguments import check_name, unknown_group_message
from residency.group.residency import Residency, device_need
from residency.core.enums import Policy
from residency.core.errors import ConfigError, RegistrationError, UnknownGroupError
from residency.core.locks import CHECKING, check_held, locked
from residency.multirank.sharded import ShardedLoad
from residency.modules.subclasses import extent, first_shared, leaf_extents, overlapping_runs
from residency.modules.tensors import Inventory

__all__ = [
    "Claim",
    "Registry",
    "check_modules_unowned",
    "check_tensors_disjoint",
    "owned_modules",
    "owner_of",
    "repacked_claim",
]

# See [Note: the one process-wide map].
_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, str]] = weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.Lock()


@attrs.frozen
class Claim:
    """A group being packed by `add`: its name, modules and tensors are taken."""

    name: str
    policy: Policy
    inventory: Inventory
    #: Layer mode: each streamed part's inventory (outside `inventory`).
    streamed: tuple[Inventory, ...] = ()
    #: How its loads split among the node's ranks (``weight_transfer="allgather"``), or None.
    sharded: ShardedLoad | None = None

    @property
    def inventories(self) -> tuple[Inventory, ...]:
        """Everything the group will own (as `Residency.inventories`)."""
        return (self.inventory, *self.streamed)

    @property
    def device_need(self) -> int:
        """Device bytes the group will need while current (as `Residency.device_need`)."""
        return device_need(self.inventory, self.streamed, self.sharded)


def repacked_claim(group: Residency, part: Residency, inventory: Inventory) -> Claim:
    """`group` as it will be once `part` (the group itself, or one of its streamed parts) is
    re-packed from `inventory`: what the device budget is checked against."""
    streamed = tuple(inventory if other is part else other.inventory for other in group.parts)
    own = inventory if part is group else group.inventory
    return Claim(group.name, group.policy, own, streamed, group.sharded)


def owned_modules(owner: Residency | Claim) -> list[nn.Module]:
    """Every module a group or claim owns (its streamed blocks' included)."""
    return [module for inventory in owner.inventories for module in inventory.modules]


def owner_of(module: nn.Module) -> tuple[Registry, str] | None:
    """The registry and group that own `module` in this process, or None."""
    return locked(_OWNERS_LOCK, _live_owner, module)


def _live_owner(module: nn.Module) -> tuple[Registry, str] | None:
    found = _OWNERS.get(module)
    if found is None:
        return None
    registry = found[0]()
    return None if registry is None or not registry.is_open else (registry, found[1])


def check_modules_unowned(owner: str, modules: Iterable[tuple[str, nn.Module]]) -> None:
    """Refuse a plan whose (path, module) pairs include a module another scheduler owns, before
    anything is registered: a refused plan must move no tensor."""
    for path, module in modules:
        found = owner_of(module)
        if found is not None:
            registry, group = found
            raise RegistrationError(
                f"{owner}: the {type(module).__name__} at {path!r} already belongs to group "
                f"{group!r} of another scheduler ({registry.owner_label}). A module belongs to "
                "one scheduler; close that scheduler (or disable its offloading) first"
            )


class Registry:
    """Names, aliases and claims of one scheduler, and the ownership checks (see module docstring).

        registry.claim(Claim("dit", Policy.EXCLUSIVE, inventory))   # refuses taken modules/tensors
        registry.enroll(group)                                      # after packing
    """

    def __init__(self, lock: threading.RLock, owner_label: str) -> None:
        self._lock = lock
        #: How other schedulers' refusals name this one ("<Scheduler on cpu>").
        self.owner_label = owner_label
        self.is_open = True  # guarded by the lock
        self._groups: dict[str, Residency] = {}  # guarded by the lock
        #: name -> group, read-only and live (written only through this registry).
        self.groups: types.MappingProxyType[str, Residency] = types.MappingProxyType(self._groups)
        self._aliases: dict[str, str] = {}  # guarded by the lock
        self._claims: dict[str, Claim] = {}  # guarded by the lock

    # -- queries --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Residency]:
        return iter(list(self._groups.values()))

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, name: object) -> bool:
        return name in self._groups or name in self._aliases

    def names(self) -> list[str]:
        return list(self._groups)

    def get(self, name: object) -> Residency | None:
        """The group `name` (or alias) leads to, or None; the phase entry's fast lookup."""
        try:
            return self._groups[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            pass
        if isinstance(name, str) and name in self._aliases:
            return self._groups.get(self._aliases[name])
        return None

    def lookup(self, name: object) -> Residency:
        """The group `name` (or an alias) leads to; `UnknownGroupError` with a hint otherwise."""
        group = self.get(name) if isinstance(name, str) else None
        if group is None:
            raise UnknownGroupError(self._unknown(name)) from None
        return group

    def aliases_of(self, group: Residency) -> list[str]:
        return [path for path, name in self._aliases.items() if name == group.name]

    def unregistered(self, group: Residency) -> UnknownGroupError:
        """The refusal of a phase whose `group` is no longer the one registered under its name
        (``groups.get(group.name) is not group``: removed or refreshed since)."""
        return UnknownGroupError(
            f"group {group.name!r} was removed or refreshed after this phase was created; "
            f"create the phase again with scheduler.resident({group.name!r})"
        )

    def needs(
        self, name: str, policy: Policy, need: int, ignore: Residency | None = None
    ) -> list[tuple[Policy, int]]:
        """(policy, device bytes) of every group and claim but `ignore`, then of the new one
        (`need` bytes: its ``device_need``)."""
        others = [*self._groups.values(), *self._claims.values()]
        return [
            *((o.policy, o.device_need) for o in others if o is not ignore),
            (policy, need),
        ]

    def check_claimable(
        self,
        claim: Claim,
        *,
        replacing: Residency | None = None,
    ) -> None:
        """Refuse a claim whose name, modules or tensors are taken; changes nothing.

        A tensor is taken when its bytes overlap those of a registered group's or claim's
        tensor in one storage (`residency.modules.subclasses.overlapping_runs`: the one rule of shared
        bytes), wherever those live now, so a view of another group's host master, device
        storage or block slot is refused.  `replacing` is a group being re-packed under its own
        name (`refresh`): its name, modules and tensors do not count as taken.
        """
        if replacing is None:
            check_name(claim.name, self._groups, self._aliases, self._claims)
        self._check_modules_free(claim.name, owned_modules(claim), replacing)
        self._check_tensors_free(claim, replacing)

    # -- mutators -------------------------------------------------------------------------------

    def claim(self, claim: Claim) -> None:
        """Reserve a name, modules and tensors for a group being packed (`check_claimable` first).

        The modules are checked again and taken in one step under the process-wide map's lock:
        another scheduler may have taken one since `check_claimable` (its own lock is not ours).
        """
        if CHECKING:
            check_held(self._lock)
        self._claims[claim.name] = claim  # first: `release_claim` undoes what follows
        try:
            self._take_modules(owned_modules(claim), claim.name, checking=True)
        except BaseException:
            self.release_claim(claim)
            raise

    def release_claim(self, claim: Claim) -> None:
        """Give up `claim` (its packing failed, or was interrupted), if it is still held;
        repeatable (see [Note: interrupts] in `residency.scheduler.scheduler`)."""
        if CHECKING:
            check_held(self._lock)
        if self._claims.get(claim.name) is not claim:
            return
        self._release_modules(owned_modules(claim))
        del self._claims[claim.name]

    def enroll(self, group: Residency, aliases: Iterable[str] = ()) -> None:
        """Register a packed group under its claimed name (and `aliases`); takes its modules."""
        if CHECKING:
            check_held(self._lock)
        self._groups[group.name] = group
        self._aliases.update(dict.fromkeys(aliases, group.name))
        self._take_modules(owned_modules(group), group.name)
        self._claims.pop(group.name, None)  # last: an interrupted enroll is undone by `unregister`

    def unregister(self, group: Residency) -> None:
        """Forget `group`, its aliases and its modules' ownership."""
        if CHECKING:
            check_held(self._lock)
        self._release_modules(owned_modules(group))
        for path in self.aliases_of(group):
            del self._aliases[path]
        if self._groups.get(group.name) is group:  # last; repeatable, also after a half enroll
            del self._groups[group.name]

    def retake(self, group: Residency, before: Iterable[nn.Module]) -> None:
        """`group` (or one of its blocks) was re-packed: it owned `before`, and now owns what
        its inventories list (new submodules taken, dropped ones freed)."""
        if CHECKING:
            check_held(self._lock)
        now = owned_modules(group)
        self._take_modules(now, group.name)
        kept = {id(module) for module in now}
        self._release_modules([module for module in before if id(module) not in kept])

    def alias(self, path: object, name: str) -> None:
        """Let `path` lead to group `name` (or the group an alias `name` leads to); refused
        (changing nothing) when it names or leads elsewhere."""
        if CHECKING:
            check_held(self._lock)
        group = self.lookup(name)
        if not isinstance(path, str) or not path:
            raise RegistrationError(f"an alias must be a non-empty string, not {path!r}")
        if path in self._groups and self._groups[path] is not group:
            raise RegistrationError(
                f"{path!r} is the name of group {path!r}; it cannot also lead to {group.name!r}"
            )
        if self._aliases.get(path, group.name) != group.name:
            raise RegistrationError(
                f"{path!r} already leads to group {self._aliases[path]!r}; it cannot also lead "
                f"to {group.name!r}. Call scheduler.remove({self._aliases[path]!r}) first"
            )
        self._aliases[path] = group.name

    def close(self) -> None:
        if CHECKING:
            check_held(self._lock)
        self.is_open = False

    def _take_modules(
        self, modules: Iterable[nn.Module], name: str, *, checking: bool = False
    ) -> None:
        locked(_OWNERS_LOCK, self._take_modules_locked, list(modules), name, checking)

    def _take_modules_locked(self, modules: list[nn.Module], name: str, checking: bool) -> None:
        if checking:
            for module in modules:
                owner = _live_owner(module)
                if owner is not None and owner[0] is not self:
                    raise RegistrationError(_taken_message(name, module, owner, self))
        for module in modules:
            _OWNERS[module] = (weakref.ref(self), name)

    def _release_modules(self, modules: Iterable[nn.Module]) -> None:
        locked(_OWNERS_LOCK, self._release_modules_locked, modules)

    def _release_modules_locked(self, modules: Iterable[nn.Module]) -> None:
        for module in modules:
            found = _OWNERS.get(module)
            if found is not None and found[0]() is self:
                del _OWNERS[module]

    # -- ownership checks -------------------------------------------------------------------------

    def _check_tensors_free(self, claim: Claim, ignore: Residency | None) -> None:
        """Refuse a claim whose tensors share bytes with another group's or claim's, wherever
        those live now (a host master, device storage, a block slot, or the user's storage)."""
        slots = [tensor_slots[0] for inventory in claim.inventories
                 for tensor_slots in inventory.slots]
        owners: list[Residency | Claim | None] = [None] * len(slots)
        extents = [extent(t) for inventory in claim.inventories for t in inventory.tensors]
        for other in [*self._groups.values(), *self._claims.values()]:
            if other is not ignore and other.name != claim.name:
                for inventory in other.inventories:
                    owners += [other] * inventory.tensor_count
                    extents += map(extent, inventory.tensors)
        for run in overlapping_runs(extents):
            sharing = [i for i in run.members if extents[i].nbytes]
            mine = [i for i in sharing if owners[i] is None]
            theirs = [owners[i] for i in sharing if owners[i] is not None]
            if mine and theirs:
                raise RegistrationError(
                    f"cannot add group {claim.name!r}: its {slots[mine[0]].describe()} shares "
                    f"storage with group {theirs[0].name!r}. A tensor belongs to one group; put "
                    "both modules in one group, or untie the weights before registering"
                )

    def _check_modules_free(
        self, name: str, modules: Iterable[nn.Module], replacing: Residency | None
    ) -> None:
        for module in modules:
            owner = owner_of(module)
            if owner is None or (replacing is not None and owner == (self, replacing.name)):
                continue
            raise RegistrationError(_taken_message(name, module, owner, self))

    def _unknown(self, name: object) -> str:
        groups = {group.name: group.category for group in self._groups.values()}
        return unknown_group_message(name, groups, self._aliases)


def _taken_message(
    name: str, module: nn.Module, owner: tuple[Registry, str], asking: Registry
) -> str:
    registry, group = owner
    where = "" if registry is asking else f" of another scheduler ({registry.owner_label})"
    return (
        f"cannot add group {name!r}: its {type(module).__name__} module already belongs to "
        f"group {group!r}{where}. A module belongs to one group of one scheduler; remove it "
        f"from {group!r}" + (" or close that scheduler" if where else "")
        + ", register a different module, or exclude it"
    )


def check_tensors_disjoint(
    owner: str, members: Iterable[tuple[str, str, Iterable[torch.Tensor]]]
) -> None:
    """Refuse a plan in which two groups would hold one storage: (group, path, tensors) per listed
    module.  Discovery and the adapter ask this before registering anything, so a refused plan
    changes nothing; `Registry.check_claimable` applies the same rule group by group."""
    owners, paths, extents = [], [], []
    for group, path, tensors in members:
        for tensor in tensors:
            for _, found in leaf_extents(tensor):
                owners.append(group)
                paths.append(path)
                extents.append(found)
    shared = first_shared(extents, owners)
    if shared is not None:
        first, second = shared
        raise ConfigError(
            f"{owner}: {paths[second]!r} (group {owners[second]!r}) shares a tensor with "
            f"{paths[first]!r} (group {owners[first]!r}); a tensor belongs to one group: list "
            "both modules in one category (in a split model: keep the tensor inside one part or "
            "outside every part), or untie the weights"
        )
