"""The Scheduler: a registry of groups, ``resident()`` phases and the one-exclusive-group rule.

    scheduler = Scheduler()                        # the current accelerator, else the CPU
    scheduler.add("text_encoder", encoder)
    scheduler.add("dit", transformer)
    scheduler.add("vae", vae, policy="resident")   # placed on the device now, never evicted
    with scheduler.resident("text_encoder"):
        embeddings = encoder(ids)
    for step in steps:
        with scheduler.resident("dit"):            # the first entry swaps; the rest cost a counter
            latents = transformer(latents, embeddings)

[Note: holds, nesting and threads]
A thread *holds* the group of its innermost active phase.  A group can only be evicted when nobody
holds it.  Entering a phase of another group first gives up the thread's own hold (a nested phase
suspends the outer one), then waits until the resident group has no holders, then swaps.  Leaving the
nested phase gives up its hold and takes the outer group back, swapping again if needed.  Because a
waiting thread never holds anything, threads cannot deadlock on each other through the scheduler.
Waiters are served first come, first served; a thread asking for the group already resident joins it
at once unless someone queued earlier for another group.

What can still hang is a hold that is never released: a thread that ended inside a phase (a phase
must be left on the thread that entered it).  Waiters notice such holds and raise `DeadlockError`;
``wait_timeout`` turns any longer wait into a `DeadlockError` too.
"""

from __future__ import annotations

import collections
import difflib
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import attrs
import torch
from torch import nn
from torch.profiler import record_function

from residency.arguments import (
    as_excluded,
    as_modules,
    check_name,
    check_options,
    parse_device,
    parse_policy,
)
from residency.component import Policy, Residency
from residency.errors import (
    DeadlockError,
    HostMemoryError,
    PhaseError,
    RegistrationError,
    SchedulerClosedError,
    UnknownGroupError,
)
from residency.memory import DeviceStorage, HostMaster
from residency.no_offload import NoOffload
from residency.records import TransitionLog, TransitionRecord
from residency.tensors import DEFAULT_CHUNK_NBYTES, Inventory, alignment_for, take_inventory
from residency.transport import Transport, transport_for

__all__ = ["Phase", "Scheduler"]

_log = logging.getLogger("residency")

#: How often a waiting thread looks for holders whose threads have ended (seconds).
_DEAD_HOLDER_POLL = 0.05


class Phase:
    """One ``with scheduler.resident(name):`` block.  Not reusable, not re-entrant.

        with scheduler.resident("dit") as dit:    # dit is the group's Residency
            latents = transformer(latents)

    Inside the block the group is resident, also after nested phases of other groups have exited.
    Entering a second time, or exiting on another thread or out of order, raises `PhaseError`.
    """

    __slots__ = ("_scheduler", "group", "_status")

    def __init__(self, scheduler: Scheduler, group: Residency) -> None:
        self._scheduler = scheduler
        #: The Residency this phase makes resident.
        self.group = group
        self._status = "new"

    def __repr__(self) -> str:
        return f"<Phase {self.group.name!r} {self._status}>"

    def __enter__(self) -> Residency:
        if self._status != "new":
            raise PhaseError(
                f"this phase of {self.group.name!r} was already entered; a phase is not "
                f"reusable: write `with scheduler.resident({self.group.name!r}):` again"
            )
        self._scheduler._enter(self)
        self._status = "active"
        return self.group

    def __exit__(self, *exc_info) -> None:
        if self._status != "active":
            raise PhaseError(f"the phase of {self.group.name!r} is {self._status}, not active")
        self._scheduler._exit(self)
        self._status = "exited"


class _Frames(list):
    """One thread's stack of (phase, group the frame needs resident); weakly referenceable."""

    __slots__ = ("__weakref__",)


class _ThreadPhases(threading.local):
    """Per thread: the stack of active phases and the exclusive group the thread holds.

    Each thread's stack is also entered (weakly) in the scheduler's `every_stack`, so calls that
    must know whether *any* thread has a phase of a group open (`refresh`, `remove`) can look; a
    thread's stack leaves that set when the thread ends.
    """

    def __init__(self, every_stack: weakref.WeakValueDictionary, lock: threading.Lock) -> None:
        #: Resident-policy phases repeat the outer frame's group.
        self.stack = _Frames()
        self.held: Residency | None = None
        self.thread = threading.current_thread()
        with lock:  # `_check_not_in_a_phase` iterates the table under the same lock
            every_stack[id(self.stack)] = self.stack


@attrs.frozen
class _Claim:
    """A group being packed by `add`: its name, modules and tensors are taken."""

    name: str
    policy: Policy
    inventory: Inventory


class _Request:
    __slots__ = ("group",)

    def __init__(self, group: Residency) -> None:
        self.group = group


class Scheduler:
    """Keeps at most one exclusive group of modules on the device; moves weights on phase changes.

        scheduler = Scheduler("cuda")
        scheduler.add("generator", model.generator)
        with scheduler.resident("generator"):
            out = model.generator(x)

    Rules: a tensor belongs to one group at most; exclusive groups are swapped by ``resident()``;
    resident-policy groups are placed on the device at ``add`` and never evicted; outputs are
    bit-identical to the same modules never offloaded.  See the module docstring for threads.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        pin_memory: bool | None = None,
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
        device_memory_limit: int | None = None,
        wait_timeout: float | None = None,
        record_limit: int = 10_000,
        transport: Transport | None = None,
    ) -> None:
        check_options(chunk_nbytes, device_memory_limit, wait_timeout, record_limit, pin_memory)
        #: Where resident groups live.
        self.device = parse_device(device)
        self._transport = transport if transport is not None else transport_for(self.device)
        #: Where tensors land in device storage: where a plain run on the device has them.
        self._alignment = alignment_for(self.device)
        #: Pin host masters (default: when the transport can use pinned memory).
        self.pin_memory = self._transport.can_pin() if pin_memory is None else pin_memory
        self.chunk_nbytes = chunk_nbytes
        #: Most device bytes this scheduler's storages may hold together (None: no limit).
        self.device_memory_limit = device_memory_limit
        self.wait_timeout = wait_timeout
        #: One record per phase change (the newest `record_limit`), with running totals.
        self.transitions = TransitionLog(record_limit)
        self._groups: dict[str, Residency] = {}
        self._aliases: dict[str, str] = {}
        #: Exclusive groups share these buffers: slot 0 always, slot 1 only once prefetch is used.
        self._exclusive_slots = (DeviceStorage(self._transport), DeviceStorage(self._transport))
        #: A group whose copy was started early by `prefetch` (LOADING, not yet re-pointed).
        self._prefetched: Residency | None = None
        self._resident_storages: dict[str, DeviceStorage] = {}
        # `with self._lock` guards all state below; `_cond` (same lock) is only for waiting.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._every_stack: weakref.WeakValueDictionary[int, _Frames] = weakref.WeakValueDictionary()
        self._local = _ThreadPhases(self._every_stack, self._lock)
        self._current: Residency | None = None
        #: Threads holding the current group (a thread holds at most one group at a time).
        self._holders: set[threading.Thread] = set()
        self._queue: collections.deque[_Request] = collections.deque()
        #: Groups `add` is packing outside the lock (see [Note: packing outside the lock]).
        self._packing: dict[str, _Claim] = {}
        self._closed = False
        if not self.pin_memory:
            _log.info("host masters on %s are pageable memory (pin_memory=False)", self.device)

    @classmethod
    def from_pipeline(
        cls,
        pipeline: object,
        config: object = None,
        *,
        enable_cpu_offload: bool = False,
        device: torch.device | str | None = None,
    ) -> Scheduler | NoOffload:
        """Build a scheduler from a pipeline's declared components (see `residency.discovery`).

            scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]})
            with scheduler.resident("transformer"):
                ...
        """
        from residency.discovery import scheduler_from_pipeline

        return scheduler_from_pipeline(
            cls, pipeline, config, enable_cpu_offload=enable_cpu_offload, device=device
        )

    # -- registry ------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        modules: nn.Module | Iterable[nn.Module],
        *,
        policy: str | Policy = "exclusive",
        exclude: nn.Module | Iterable[nn.Module] = (),
    ) -> Residency:
        """Register `modules` as group `name` and pack their weights into a host master.

        ``policy="exclusive"`` groups are swapped by ``resident()``; ``policy="resident"`` groups
        are placed on the device now and never evicted.  Submodules in `exclude` (and all under
        them) are left out, so they can form groups of their own.  A refused call changes nothing.

            scheduler.add("text_encoder", [clip, t5])
            scheduler.add("vae", pipe.vae, policy="resident")
            scheduler.add("shared", model, policy="resident", exclude=[model.reasoner, model.generator])
        """
        self._check_open()
        policy = parse_policy(policy)
        roots = as_modules(name, modules)
        excluded = as_excluded(name, exclude, roots)
        with self._lock:
            check_name(name, [*self._groups, *self._aliases, *self._packing])
            inventory = take_inventory(
                roots, chunk_nbytes=self.chunk_nbytes, exclude=excluded, alignment=self._alignment
            )
            self._check_modules_free(name, inventory.modules)
            self._check_tensors_free(name, inventory)
            self._check_budget(name, inventory, policy)
            self._packing[name] = _Claim(name, policy, inventory)
        # [Note: packing outside the lock] Building a master of many GiB takes seconds; phases of
        # other threads must not wait for it.  The claim above keeps the name, modules and tensors
        # from being registered twice meanwhile.
        try:
            master = self._pack(name, inventory)
        finally:
            with self._lock:
                del self._packing[name]
        with self._lock:
            self._check_open()
            residency = self._enroll(name, roots, policy, inventory, master, excluded)
        if policy is Policy.RESIDENT:
            self._place_resident(residency)
        return residency

    def alias(self, path: str, name: str) -> None:
        """Let ``resident(path)`` enter group `name` (dotted module paths of a pipeline).

        Refused (changing nothing) for a path that is not a non-empty string, that names a group,
        or that already leads to another group.
        """
        group = self._lookup(name)
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

    def __getitem__(self, name: str) -> Residency:
        return self._lookup(name)

    def __contains__(self, name: object) -> bool:
        return name in self._groups or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._groups))

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"current={self.current!r}"
        return f"<Scheduler on {self.device}: {len(self)} group(s), {status}>"

    @property
    def current(self) -> str | None:
        """Name of the exclusive group on the device now, or None."""
        group = self._current
        return None if group is None else group.name

    @property
    def device_nbytes(self) -> int:
        """Bytes of device storage the scheduler holds now (shared exclusive buffers included)."""
        storages = [*self._exclusive_slots, *self._resident_storages.values()]
        return sum(storage.nbytes for storage in storages)

    def resident_groups(self) -> list[str]:
        """Names of every group whose weights are on the device now (a consistent snapshot)."""
        with self._lock:
            return [name for name, group in self._groups.items() if group.is_resident]

    # -- phases --------------------------------------------------------------------------------

    def resident(self, name: str) -> Phase:
        """A phase: inside ``with scheduler.resident(name):`` the group is on the device.

        The group stays resident after the block until another group is asked for, so a loop that
        re-enters it costs a counter, not a copy.  `name` may also be a registered alias.
        """
        group = self._groups.get(name)
        if group is None:
            group = self._lookup(name)
        return Phase(self, group)

    def offload_all(self) -> None:
        """Evict the resident exclusive group and free the shared device storage.

        Resident-policy groups stay.  Refused (changing nothing) while any phase is active.
        """
        self._check_open()
        with self._lock:
            self._check_no_holders("offload all groups")
            self._cancel_prefetch()
            if self._current is not None:
                self._switch_to(None)
            for slot in self._exclusive_slots:
                slot.release()

    def prefetch(self, name: str) -> bool:
        """Start copying group `name` to the device now, beside the resident group; opt-in.

            with scheduler.resident("text_encoder"):
                scheduler.prefetch("dit")      # the copy overlaps the encoder's compute
                embeddings = encoder(ids)
            with scheduler.resident("dit"):    # only re-points: the bytes are already there
                ...

        Both groups' bytes then sit on the device at once, so this is done only when
        ``device_memory_limit`` (or, on CUDA without a limit, the free device memory) allows
        both, and it keeps a second device buffer for as long as the scheduler uses prefetch.
        Returns whether a copy was started (False: already resident, already prefetching, or no room).
        The one-resident-group rule still holds for tensors: the prefetched group's tensors keep
        reading the host master until its phase begins.
        """
        self._check_open()
        group = self._lookup(name)
        with self._lock:
            if not group.exclusive or group is self._current or group is self._prefetched:
                return False
            if not self._room_for_prefetch(group):
                return False
            self._cancel_prefetch()
            group._begin_load(self._free_slot(group), watch_edits=True)
            self._prefetched = group
            return True

    def refresh(self, name: str) -> Residency:
        """Re-register group `name` after its modules changed (new, replaced or re-typed tensors).

        The modules' current tensors are packed into a fresh host master; the group ends offloaded
        (resident-policy groups are placed again).
        """
        self._check_open()
        group = self._lookup(name)
        name = group.name  # `name` may have been an alias
        with self._lock:
            self._check_not_in_a_phase(group, "refresh")
            inventory = take_inventory(
                group.modules,
                chunk_nbytes=self.chunk_nbytes,
                exclude=group.excluded,
                alignment=self._alignment,
            )
            self._check_tensors_free(name, inventory, ignore=group)
            self._check_budget(name, inventory, group.policy)
            aliases = [path for path, target in self._aliases.items() if target == name]
            self._unregister(group)
            master = self._pack(name, inventory)
            residency = self._enroll(
                name, group.modules, group.policy, inventory, master, group.excluded
            )
            self._aliases.update(dict.fromkeys(aliases, name))
        if residency.policy is Policy.RESIDENT:
            self._place_resident(residency)
        return residency

    def remove(self, name: str) -> Residency:
        """Unregister group `name`; its modules keep their weights in host memory.

        Refused while a phase of the group is active.  Tensors the user re-typed or re-shaped
        while the group was resident are left as the user made them (moved to the host).
        """
        self._check_open()
        group = self._lookup(name)
        with self._lock:
            self._check_not_in_a_phase(group, "remove")
            self._remove(group)
        return group

    def close(self) -> None:
        """Return every group's weights to host memory and release device storage.

        The modules stay usable on the host; the scheduler refuses further use.  Refused
        (changing nothing) while any phase is active.
        """
        with self._lock:
            if self._closed:
                return
            self._check_no_holders("close the scheduler")
            for group in self._groups.values():
                self._check_not_in_a_phase(group, "close the scheduler with")
            self._closed = True
            for group in list(self._groups.values()):
                self._remove(group)
            for slot in self._exclusive_slots:
                slot.release()
            self._cond.notify_all()  # waiters wake up to SchedulerClosedError

    def _remove(self, group: Residency) -> None:
        self._cancel_prefetch()
        if group.is_resident:
            group._evict(keep_changed=True)
        self._unregister(group)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- phase machinery (see [Note: holds, nesting and threads]) -------------------------------

    def _enter(self, phase: Phase) -> None:
        if self._closed:
            self._check_open()
        local = self._local
        stack = local.stack
        group = phase.group
        target = group if group.exclusive else (stack[-1][1] if stack else None)
        held = local.held
        if target is not held:
            if held is None and target is self._current:
                with self._lock:  # fast path: join the resident group, no tensor work
                    if target is self._current and not self._queue:
                        self._holders.add(local.thread)
                        local.held = target
                        stack.append((phase, target))
                        return
            self._move_hold(target, restore_on_failure=True, push=phase)
            return
        if not group.exclusive:  # a resident-policy phase holds nothing: check it still exists
            with self._lock:
                self._check_registered(group)
                stack.append((phase, target))
            return
        stack.append((phase, target))  # re-entry of the group this thread holds: nothing to do

    def _exit(self, phase: Phase) -> None:
        local = self._local
        stack = local.stack
        if not stack or stack[-1][0] is not phase:
            raise self._misplaced_exit(phase)
        stack.pop()
        target = stack[-1][1] if stack else None
        if target is not local.held:
            if target is None:
                with self._lock:  # fast path: give up the hold, nothing to load
                    self._release(local.held)
                    local.held = None
                    return
            self._move_hold(target, restore_on_failure=False)

    def _misplaced_exit(self, phase: Phase) -> PhaseError:
        stack = self._local.stack
        if all(frame[0] is not phase for frame in stack):
            return PhaseError(
                f"the phase of {phase.group.name!r} was left on thread "
                f"{threading.current_thread().name!r}, which did not enter it; leave a phase on "
                "the thread that entered it"
            )
        return PhaseError(
            f"the phase of {phase.group.name!r} was left while the phase of "
            f"{stack[-1][0].group.name!r} inside it is still active; leave phases in the reverse "
            "order of entering them"
        )

    def _move_hold(
        self, target: Residency | None, *, restore_on_failure: bool, push: Phase | None = None
    ) -> None:
        """Give up this thread's hold and take `target`'s; push `push`'s frame in the same
        critical section, so no other thread can see the hold without the frame."""
        local = self._local
        previous = local.held
        with self._lock:
            if previous is not None:
                self._release(previous)
                local.held = None
            try:
                if target is not None:
                    self._acquire(target)
                    local.held = target
                if push is not None:
                    local.stack.append((push, target))
            except BaseException as error:
                if restore_on_failure and previous is not None:
                    self._restore_hold(previous, error)
                raise

    def _restore_hold(self, previous: Residency, error: BaseException) -> None:
        try:
            self._acquire(previous)
            self._local.held = previous
        except BaseException as restore_error:  # the first error is the one to report
            note = (
                f"residency: group {previous.name!r} could not be made resident again "
                f"({restore_error!r}); the enclosing phase runs without it"
            )
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(note)
            else:
                _log.error(note)

    def _release(self, group: Residency) -> None:
        self._holders.discard(self._local.thread)
        if self._queue and not self._holders:
            self._cond.notify_all()

    def _acquire(self, group: Residency) -> None:
        if self._current is group and not self._queue:
            self._holders.add(self._local.thread)
            return
        request = _Request(group)
        self._queue.append(request)
        try:
            self._wait_for_turn(request)
            self._check_registered(group)
            if self._current is not group:
                self._switch_to(group)
        finally:
            self._queue.remove(request)
            self._cond.notify_all()
        self._holders.add(self._local.thread)

    def _wait_for_turn(self, request: _Request) -> None:
        """Wait until `request` may join the resident group or swap it out (first come, first served)."""
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        while not self._may_proceed(request):
            self._check_open()
            self._check_dead_holders(request.group)
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlockError(
                    f"waited {self.wait_timeout} s for group {request.group.name!r}: "
                    f"{self._describe_holders()}. Leave phases promptly, or raise wait_timeout"
                )
            self._cond.wait(_DEAD_HOLDER_POLL)

    def _may_proceed(self, request: _Request) -> bool:
        for earlier in self._queue:
            if earlier is request:
                break
            if earlier.group is not request.group:
                return False
        if self._current is request.group:
            return True
        return not self._holders and self._queue[0] is request

    def _check_dead_holders(self, wanted: Residency) -> None:
        dead = [thread for thread in self._holders if not thread.is_alive()]
        if not dead or len(dead) < len(self._holders):
            return
        self._holders.clear()
        names = ", ".join(repr(t.name) for t in dead)
        held = self._current.name if self._current else None
        raise DeadlockError(
            f"group {wanted.name!r} waited on group {held!r}, held by phases of thread(s) {names} "
            "that ended without leaving them; those holds are now released. Leave every phase on "
            "the thread that entered it (use `with`)"
        )

    def _describe_holders(self) -> str:
        held = self._current.name if self._current else None
        names = ", ".join(repr(t.name) for t in self._holders) or "no thread"
        return f"group {held!r} is held by {names}"

    def _switch_to(self, group: Residency | None) -> None:
        """Evict the current exclusive group and load `group`; called with no holders."""
        previous = self._current
        start = time.perf_counter()
        written = 0
        if previous is not None:
            with record_function(f"residency::evict {previous.name}"):
                written = previous._evict()
        self._current = None
        evicted = time.perf_counter()
        nbytes = 0
        if group is not None:
            with record_function(f"residency::load {group.name}"):
                nbytes = self._load(group)
        self._current = group
        self.transitions.append(
            TransitionRecord(
                from_group=previous.name if previous is not None else None,
                to_group=group.name if group is not None else None,
                nbytes=nbytes,
                written_back=written,
                start=start,
                evict_seconds=evicted - start,
                load_seconds=time.perf_counter() - evicted,
                thread=threading.current_thread().name,
            )
        )

    def _load(self, group: Residency) -> int:
        if group is self._prefetched:
            self._prefetched = None
            return group._finish_load()
        self._cancel_prefetch()
        return group._load(self._free_slot(group))

    def _free_slot(self, group: Residency) -> DeviceStorage:
        """The exclusive slot `group` should load into: its last one unless the resident group uses it."""
        occupied = self._current.device_storage if self._current is not None else None
        if group.device_storage is not occupied:
            return group.device_storage
        first, second = self._exclusive_slots
        return second if occupied is first else first

    def _cancel_prefetch(self) -> None:
        if self._prefetched is not None:
            self._prefetched._cancel_load()
            self._prefetched = None

    def _room_for_prefetch(self, group: Residency) -> bool:
        """Whether the buffer `group` would be copied into fits beside everything already held."""
        slot = self._free_slot(group)
        needed = max(group.inventory.layout.contiguous_nbytes, slot.size_hint)
        growth = 0 if slot.nbytes >= needed and not slot.is_aliased() else needed
        if self.device_memory_limit is not None:
            held = self.device_nbytes - (slot.nbytes if growth else 0)
            return held + growth <= self.device_memory_limit
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return growth <= free
        return self.device.type == "cpu"

    # -- registration helpers ------------------------------------------------------------------

    def _pack(self, name: str, inventory: Inventory) -> HostMaster:
        master = _pack(name, inventory, self._transport, pin=self.pin_memory)
        if self.pin_memory and not master.pinned:  # pinning failed (and warned): stop trying
            self.pin_memory = False
        return master

    def _enroll(
        self,
        name: str,
        roots: tuple[nn.Module, ...],
        policy: Policy,
        inventory: Inventory,
        master: HostMaster,
        excluded: tuple[nn.Module, ...],
    ) -> Residency:
        """Make a packed group known (called with the lock held)."""
        storage = self._exclusive_slots[0]
        if policy is Policy.RESIDENT:
            storage = self._resident_storages[name] = DeviceStorage(self._transport)
        residency = Residency(
            name, roots, policy, inventory, master, storage, self._transport, excluded=excluded
        )
        self._groups[name] = residency
        for slot in self._exclusive_slots:
            slot.size_hint = self._largest_exclusive()
        return residency

    def _unregister(self, group: Residency) -> None:
        if self._prefetched is group:
            self._cancel_prefetch()
        if self._current is group:
            self._current = None
        for storage in {group.device_storage, *self._exclusive_slots}:
            storage.forget(group)
        self._resident_storages.pop(group.name, None)
        del self._groups[group.name]
        for path in [p for p, n in self._aliases.items() if n == group.name]:
            del self._aliases[path]

    def _place_resident(self, residency: Residency) -> None:
        """Load a resident-policy group now; if that fails, unregister it (weights stay on host)."""
        start = time.perf_counter()
        try:
            nbytes = residency._load()
        except BaseException:
            with self._lock:
                self._unregister(residency)
            raise
        record = TransitionRecord(
            from_group=None,
            to_group=residency.name,
            nbytes=nbytes,
            written_back=0,
            start=start,
            evict_seconds=0.0,
            load_seconds=time.perf_counter() - start,
            thread=threading.current_thread().name,
        )
        self.transitions.append(record)

    def _lookup(self, name: str) -> Residency:
        group = self._groups.get(name)
        if group is None and name in self._aliases:
            group = self._groups[self._aliases[name]]
        if group is None:
            self._check_open()
            known = sorted(self._groups) + sorted(self._aliases)
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownGroupError(
                f"no group named {name!r}; known groups: {', '.join(map(repr, known)) or 'none'}."
                f"{hint} Register it with scheduler.add({name!r}, modules) first"
            ) from None
        return group

    def _check_registered(self, group: Residency) -> None:
        if self._groups.get(group.name) is not group:
            raise UnknownGroupError(
                f"group {group.name!r} was removed or refreshed after this phase was created; "
                f"create the phase again with scheduler.resident({group.name!r})"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosedError(
                "this scheduler was closed; its modules are back in host memory. Create a new "
                "Scheduler and add the modules again to keep offloading"
            )

    def _check_not_in_a_phase(self, group: Residency, action: str) -> None:
        """Refuse while any thread holds `group`, waits for it, or has a phase of it open (also
        one suspended by nesting).  Called with the lock held."""
        held = group is self._current and bool(self._holders)
        queued = any(request.group is group for request in self._queue)
        framed = any(
            phase.group is group or needed is group
            for stack in self._every_stack.values()
            for phase, needed in list(stack)
        )
        if held or queued or framed:
            raise PhaseError(
                f"cannot {action} group {group.name!r} while a phase of it is active "
                "(possibly suspended by a nested phase); call it between phases"
            )

    def _check_no_holders(self, action: str) -> None:
        if self._holders:
            raise PhaseError(
                f"cannot {action} while a phase is active; {self._describe_holders()}. "
                "Call it between phases"
            )

    def _claims(self) -> list[Residency | _Claim]:
        """Every registered group, and every group being packed by `add` right now."""
        return [*self._groups.values(), *self._packing.values()]

    def _check_modules_free(self, name: str, submodules: Iterable[nn.Module]) -> None:
        owners = {id(m): other for other in self._claims() for m in other.inventory.modules}
        for module in submodules:
            other = owners.get(id(module))
            if other is not None:
                raise RegistrationError(
                    f"cannot add group {name!r}: its {type(module).__name__} module already "
                    f"belongs to group {other.name!r}. A module belongs to one group; remove it "
                    f"from {other.name!r}, register a different module, or exclude it"
                )

    def _check_tensors_free(
        self, name: str, inventory: Inventory, ignore: Residency | None = None
    ) -> None:
        owners = {
            id(t): other
            for other in self._claims()
            if other is not ignore
            for t in other.inventory.tensors
        }
        spans = _storage_spans(g for g in self._groups.values() if g is not ignore)
        for tensor, slots in zip(inventory.tensors, inventory.slots):
            other = owners.get(id(tensor)) or _owner_by_address(spans, tensor)
            if other is not None:
                raise RegistrationError(
                    f"cannot add group {name!r}: its {slots[0].describe()} shares storage with "
                    f"group {other.name!r}. A tensor belongs to one group; put both modules in "
                    "one group, or untie the weights before registering"
                )

    def _largest_exclusive(self) -> int:
        """Device bytes of the largest exclusive group (the shared buffer's size)."""
        sizes = [g.inventory.layout.contiguous_nbytes for g in self._groups.values() if g.exclusive]
        return max(sizes, default=0)

    def _check_budget(self, name: str, inventory: Inventory, policy: Policy) -> None:
        """Refuse a group whose device bytes, with those already planned, exceed the limit."""
        limit = self.device_memory_limit
        if limit is None:
            return
        needs = {g.name: (g.policy, g.inventory.layout.contiguous_nbytes) for g in self._claims()}
        needs[name] = (policy, inventory.layout.contiguous_nbytes)
        exclusive = max((n for p, n in needs.values() if p is Policy.EXCLUSIVE), default=0)
        planned = exclusive + sum(n for p, n in needs.values() if p is Policy.RESIDENT)
        if planned > limit:
            raise RegistrationError(
                f"cannot add group {name!r}: it needs {needs[name][1]} bytes of device memory, "
                f"and with the groups already registered the device would need {planned} bytes, "
                f"over device_memory_limit={limit}. Raise the limit or split the group"
            )


def _storage_spans(groups: Iterable[Residency]) -> list[tuple[int, int, Residency]]:
    spans = []
    for group in groups:
        for chunk in group.host_master.chunks:
            spans.append((chunk.data_ptr(), chunk.data_ptr() + chunk.numel(), group))
        buffer = group.device_storage.buffer
        if group.is_resident and buffer is not None:
            spans.append((buffer.data_ptr(), buffer.data_ptr() + buffer.numel(), group))
    return spans


def _owner_by_address(spans, tensor: torch.Tensor) -> Residency | None:
    pointer = tensor.data_ptr()
    if tensor.untyped_storage().nbytes() == 0:
        return None
    for start, end, group in spans:
        if start <= pointer < end:
            return group
    return None


def _pack(name: str, inventory: Inventory, transport: Transport, *, pin: bool) -> HostMaster:
    try:
        return HostMaster.pack(inventory, transport, pin=pin)
    except MemoryError as error:
        nbytes = inventory.layout.nbytes
        raise HostMemoryError(
            f"cannot add group {name!r}: its host master needs {nbytes} bytes "
            f"({nbytes / 2**20:.1f} MiB) of host memory and the allocation failed ({error}). Free "
            "host memory or register fewer modules at once; the weights keep their values"
        ) from error
