"""The Scheduler: the public verbs, wired to the three owners of its state.

    scheduler = Scheduler()                        # the current accelerator, else the CPU
    scheduler.add("text_encoder", encoder)
    scheduler.add("dit", transformer)
    scheduler.add("vae", vae, policy="resident")   # placed on the device now, never evicted
    with scheduler.resident("text_encoder"):
        embeddings = encoder(ids)
    for step in steps:
        with scheduler.resident("dit"):            # the first entry swaps; the rest cost a lock
            latents = transformer(latents, embeddings)

This file only wires and checks; each question has its answer elsewhere (docs/design.md):
who may run -> `residency.scheduler.holds`; whose module or tensor is this -> `residency.group.registry`; what is on
the device -> `residency.placement.placement`; how bytes move -> `residency.device.transport`.  One lock guards all
three owners (see [Note: one lock, checked where state changes] in `residency.core.locks`).

[Note: interrupts]
A `KeyboardInterrupt` (or SystemExit, or any exception a trace or profile callback raises) can
arrive at any line of the package, and a user does not choose where Ctrl-C lands.  Whatever it
interrupts, the owners agree afterwards, nothing is lost and nothing waits for ever, with no user
action beyond catching it (tests/test_interrupts.py injects one at every line).  Deferring
SIGINT cannot be the answer (a trace callback's exception cannot be deferred), so the rules are:

* Each owner's state is written last, in one line where several fields change together
  (``self._pending, self.state = None, OFFLOADED``): stores of one line cannot be separated.
  A group's ``state`` is its truth; the owners above it read it to decide.
* A step of several statements is undone or rolled forward in ``except BaseException`` (then
  re-raised): a load that did not commit is cancelled (`Residency.finish_load`); an eviction
  whose re-pointing happened is completed (`Residency.evict`); `Placement.settle` makes
  ``current``, ``prefetched`` and each block stream agree with the groups' states; a phase entry
  is undone and a phase exit completed (`Holds.settle`, which also moves the thread's hold back
  to what its innermost phase needs); a registration is undone (`Scheduler._register`); a
  ``refresh`` and a ``close`` are completed.  Undo code may be slow (a swap back); it runs once.
* No ``finally`` and no multi-line ``with`` on a normal path: their cleanup starts on a line of
  its own, where an interrupt skips it.  Cleanup is in the ``try`` body and again in the
  handler, made repeatable (a block forward's exit takes a token, once); contexts are entered on
  one line ([Note: a context on one line] in `residency.core.locks`).
* Where no undo is possible - an interrupt at the first line of ``Phase.__exit__``, before any
  of its code, after which its ``with`` statement is over - the step is completed at the next
  call at the latest: a phase nothing refers to any more but its frame is closed by the next
  phase change, exit, `close` or waiting thread (`Holds.collect_abandoned`).  A traceback kept
  alive (``sys.last_traceback`` in a notebook) keeps that phase open until it is released.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from residency.scheduler.admission import Admission, GroupSpec, check_open, sharded_load
from residency.placement.adoption import Adoption
from residency.multirank.agreement import PhaseLedger
from residency.group.arguments import as_excluded, as_modules, check_flag, check_name, check_options
from residency.group.arguments import parse_device, parse_policy
from residency.modules.blocks import ModelBlocks
from residency.auto.auto import AutoPlan, AutoPlanner
from residency.options.budget import AutoOptions
from residency.group.residency import Residency
from residency.pipelines.discovery import scheduler_from_pipeline
from residency.core.enums import PhaseStatus, Policy
from residency.core.errors import ConfigError, PhaseError
from residency.scheduler.holds import Holds, Turn, WaitLog, note_failed_return, turns_for
from residency.options.host_options import HostOptions
from residency.placement.layers import as_model_blocks, auto_blocks, streamed_modules
from residency.core.locks import locked, new_lock
from residency.group.no_offload import NoOffload
from residency.multirank.node import node_view
from residency.host.memory import HostUsage
from residency.host.packing import Packer
from residency.placement.placement import DeviceBuffers, Placement
from residency.group.records import BlockLog, CallLog, CallRecord, TransitionLog, WaitStats
from residency.group.calls import Call, Calls
from residency.options.order import TurnOrder, as_turn_order
from residency.group.registry import Registry
from residency.modules.tensors import DEFAULT_CHUNK_NBYTES
from residency.device.transport import Transport, transport_for

__all__ = ["Phase", "Scheduler"]

_log = logging.getLogger("residency")
_ACTIVE = PhaseStatus.ACTIVE


class Phase:
    """One ``with scheduler.resident(name):`` block.  Not reusable, not re-entrant.

        with scheduler.resident("dit") as dit:    # dit is the group's Residency
            latents = transformer(latents)

    Inside the block the group is resident, also after nested phases of other groups have exited.
    Entering a second time, or exiting on another thread or out of order, raises `PhaseError`
    (see [Note: misnested exits] in `residency.scheduler.holds`).
    """

    __slots__ = ("_gate", "group", "status")

    def __init__(self, gate: PhaseGate, group: Residency) -> None:
        self._gate = gate
        #: The Residency this phase makes resident.
        self.group = group
        #: Where the phase is in its life; written by the scheduler's holds only.
        self.status = PhaseStatus.NEW

    def __repr__(self) -> str:
        return f"<Phase {self.group.name!r} {self.status.value}>"

    def __enter__(self) -> Residency:
        if self.status is not PhaseStatus.NEW:
            raise PhaseError(
                f"this phase of {self.group.name!r} was already entered; a phase is not "
                f"reusable: write `with scheduler.resident({self.group.name!r}):` again"
            )
        gate = self._gate
        try:  # the lock on one line: see [Note: a context on one line] in residency.core.locks
            with gate.lock: return gate.enter(self)  # noqa: E701
        except BaseException:  # undone, whatever it reached (see [Note: interrupts])
            locked(gate.lock, gate.settle, self)
            raise

    def __exit__(self, *exc_info) -> None:
        gate = self._gate
        try:
            if self.status is _ACTIVE:
                with gate.lock: return gate.leave(self)  # noqa: E701
            self._exit_inactive()
        except PhaseError:  # refused: nothing changed
            raise
        except BaseException:  # completed (see [Note: interrupts])
            locked(gate.lock, gate.settle, self)
            raise

    def _exit_inactive(self) -> None:
        status = self.status
        if status is PhaseStatus.LEAVING:
            locked(self._gate.lock, self._gate.leave, self)
        elif status is PhaseStatus.EXITED_LATE:  # see [Note: misnested exits]
            self.status = PhaseStatus.EXITED
        else:
            raise PhaseError(f"the phase of {self.group.name!r} is {status.value}, not active")


class PhaseGate:
    """Where every phase of one scheduler enters and leaves, in three steps that go down: the
    holds say whose turn it is (they wait; they never move bytes), the placement makes the
    turn's group current, then the holds grant the hold.  Also the auto plan, which learns of
    each entry first.  Made once per scheduler; it refers to the owners only, never back to the
    facade.

        with gate.lock: return gate.enter(phase)     # Phase.__enter__
    """

    __slots__ = ("auto", "calls", "holds", "lock", "placement", "registry")

    def __init__(self, lock, holds: Holds, placement: Placement, registry: Registry,
                 auto: AutoPlanner | None, calls: Calls) -> None:
        self.lock, self.holds, self.placement, self.registry, self.auto, self.calls = (
            lock, holds, placement, registry, auto, calls)

    def enter(self, phase: Phase) -> Residency:
        """Open `phase` (the lock held): the auto plan learns of it, its group's block forwards
        are in place, then the holds give the thread its turn (`Holds.join`)."""
        holds = self.holds
        if holds.closed:
            check_open(holds)
        if self.auto is not None:
            self.auto.entering(phase.group, self.placement.current, self.registry,
                               not holds.has_holders())
        for stream in phase.group.streams:
            stream.rewrap()
        joined = holds.join(phase)
        return self._take(joined) if type(joined) is Turn else joined

    def begin_call(self) -> int:
        """Begin a marked call (the lock held; `Call.begin`); refused on a closed scheduler.  A
        call its thread left open ends "found" first; the auto plan learns of both."""
        check_open(self.holds)
        number, found = self.calls.begin(marked=True)
        if self.auto is not None:
            if found is not None:
                self.auto.call_ended(found, self.registry)
            self.auto.call_began(self.registry, not self.holds.has_holders())
        return number

    def end_call(self, number: int, ending: str) -> CallRecord | None:
        """End call `number` (the lock held; `Call.end`): its record, None when not open."""
        record = self.calls.end(number, ending)
        if self.auto is not None and record is not None:
            self.auto.call_ended(record, self.registry)
        return record

    def leave(self, phase: Phase) -> None:
        """Close `phase` (the lock held); the thread's hold moves to what its outer phase needs
        (`Holds.leave`), made current first when it must be."""
        turn = self.holds.leave(phase)
        if turn is not None:
            self._take(turn)

    def settle(self, phase: Phase) -> None:
        """Undo or complete an entry or exit of `phase` that stopped half-way (`Holds.settle`;
        [Note: interrupts]), the group the thread needs made current again when it must be."""
        turn = self.holds.settle(phase)
        if turn is not None:
            self._take(turn)

    def _take(self, turn: Turn) -> Residency | None:
        """Carry out `turn`: the placement makes its group current, then the holds grant it.  A
        switch that fails is refused and raised, the thread given back the group it held when
        the turn says so."""
        switching = self.placement.current is not turn.group
        try:
            if switching:
                self.placement.switch_to(turn.group, turn.choice)
        except BaseException as error:
            back = self.holds.refuse(turn, error)
            if back is not None:
                self._give_back(back, error)
            raise
        if switching and self.auto is not None:
            self.auto.switched()  # a co-tenant gets back what the switch freed
        return self.holds.grant(turn)

    def _give_back(self, turn: Turn, error: BaseException) -> None:
        """Carry out a turn that gives the thread its previous group back after `error` (its
        grant raises `error`); a failure to do so is noted on `error`."""
        try:
            self._take(turn)
        except BaseException as failure:
            if failure is not error:
                note_failed_return(error, turn.group, failure)


class Scheduler:
    """Keeps at most one exclusive group of modules on the device; moves weights on phase changes.

        scheduler = Scheduler("cuda")
        scheduler.add("generator", model.generator)
        with scheduler.resident("generator"):
            out = model.generator(x)

    Rules: a tensor belongs to one group at most, and a module to one scheduler in the process;
    exclusive groups are swapped by ``resident()``; resident-policy groups are placed on the device
    at ``add`` and never evicted; outputs are bit-identical to the same modules never offloaded.
    Threads: see [Note: holds, nesting and threads] in `residency.scheduler.holds`.

    With ``process_group`` (the default group of an initialised ``torch.distributed`` job), the
    ranks on one host share one host master per group when they hold the same weights ([Note: one
    host copy per node] in `residency.host.packing`): constructing the scheduler, ``add``, and every
    eviction of a shared group (phase changes, ``close``) are then collective - call them in the
    same order on every rank.  Writes to a shared master are agreed (`residency.multirank.agreement`); ranks
    that changed it differently raise `CollectiveError` and keep their device copies.  With
    ``host`` (`HostOptions`): a warm-restart cache, a memory limit, reads behind the first phase.
    ``order`` (`TurnOrder`): how threads waiting for groups take turns (by group by default).
    """

    def __init__(
        self, device: torch.device | str | None = None, *, pin_memory: bool | None = None,
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES, device_memory_limit: int | None = None,
        wait_timeout: float | None = None, record_limit: int = 10_000,
        transport: Transport | None = None, process_group: object = None,
        auto: AutoOptions | Mapping | bool | None = None, host: HostOptions | Mapping | None = None,
        order: TurnOrder | Mapping | str | None = None,
    ) -> None:
        auto_options, host = check_options(chunk_nbytes, device_memory_limit, wait_timeout,
            record_limit, pin_memory, auto=auto, host=host, process_group=process_group)
        self.order = as_turn_order(order, process_group=process_group)  #: waiters' turns
        self.device = parse_device(device)  #: where resident groups live
        self._transport = transport if transport is not None else transport_for(self.device)
        pin = self._transport.can_pin() if pin_memory is None else pin_memory
        node = None if process_group is None else node_view(process_group)
        self._packer = Packer(self._transport, device=self.device, chunk_nbytes=chunk_nbytes,
                              pin_memory=pin, node=node, host=host)
        #: Records of phase changes and (layer mode) of block moves: the newest `record_limit`.
        self.transitions, self.block_records = TransitionLog(record_limit), BlockLog(record_limit)
        calls = Calls(self.transitions, self.block_records, record_limit)
        self._lock = new_lock()
        self._registry = Registry(self._lock, owner_label=f"<Scheduler on {self.device}>")
        buffers = DeviceBuffers(self._transport)
        adoption = Adoption(self._packer, self._registry, buffers, device_memory_limit=device_memory_limit)
        self._placement = Placement(self._lock, self._transport, device=self.device, buffers=buffers,
                                    adoption=adoption, transitions=self.transitions,
                                    block_log=self.block_records)
        self._holds = Holds(self._lock, self._placement, self._registry, wait_timeout=wait_timeout,
                            turns=turns_for(self.order), waits=WaitLog(record_limit))
        self._admission = Admission(self._lock, registry=self._registry, packer=self._packer,
                                    placement=self._placement, holds=self._holds,
                                    transport=self._transport, block_records=self.block_records,
                                    auto=auto_options is not None)
        self._auto = None if auto_options is None else AutoPlanner(
            auto_options, placement=self._placement, transport=self._transport, calls=calls,
            collective=node is not None)
        self._gate = PhaseGate(self._lock, self._holds, self._placement, self._registry, self._auto,
                               calls)
        self._ledger = None if node is None else PhaseLedger(self._packer.node.group)  #: agreement
        _note_pageable(self.pin_memory, self.device, self._transport)

    @property
    def pin_memory(self) -> bool:
        """Whether host masters are pinned (off, with a warning, after a failure to pin)."""
        return self._packer.pin_memory

    @property
    def host_usage(self) -> HostUsage:
        """The host bytes the groups' masters hold: requested, pinned, file-backed, shared."""
        return locked(self._lock, HostUsage.of, (master for group in self._registry for master
                                                 in group.host_masters))

    @property
    def wait_timeout(self) -> float | None:
        """Longest wait for a group, in seconds, before `DeadlockError` (None: no limit)."""
        return self._holds.wait_timeout

    @property
    def waits(self) -> dict[str, WaitStats]:
        """Per group: phase entries, how many waited for their turn, and p50/p99/max seconds."""
        return self._holds.waits.summary()

    @property
    def chunk_nbytes(self) -> int:
        """Host masters are built in chunks of at most this many bytes."""
        return self._packer.chunk_nbytes

    @classmethod
    def from_pipeline(cls, pipeline: object, config: object = None, *,
                      enable_cpu_offload: bool = False, device: torch.device | str | None = None,
                      process_group: object = None) -> Scheduler | NoOffload:
        """Build a scheduler from a pipeline's declared components (see `residency.pipelines.discovery`).

            scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]})
            with scheduler.resident("transformer"):
                ...

        `process_group`: as for `Scheduler` (host masters shared by the ranks of a node).
        """
        make = functools.partial(cls, process_group=process_group)
        return scheduler_from_pipeline(make, pipeline, config, enable_cpu_offload=enable_cpu_offload,
                                       device=device, process_group=process_group)

    # -- registration ----------------------------------------------------------------------------

    def add(
        self,
        name: str,
        modules: nn.Module | Iterable[nn.Module],
        *,
        policy: str | Policy = "exclusive",
        exclude: nn.Module | Iterable[nn.Module] = (),
        category: str | None = None,
        detect_edits: bool = True,
        weight_transfer: str = "rank-local",
        layers: bool | ModelBlocks | Iterable[ModelBlocks] = False,
    ) -> Residency:
        """Register `modules` as group `name` and pack their weights into a host master.

        ``policy="exclusive"`` groups are swapped by ``resident()``, ``policy="resident"`` ones
        placed on the device now; `exclude`'s submodules (and all under them) are left out;
        `category` is the config component ("dit", ...).  No edit made while resident is lost
        (``detect_edits=False`` opts out: docs/guarantees.md).  ``weight_transfer="allgather"``:
        a node's ranks split the copy (`residency.multirank.sharded`).  ``layers=True`` (or
        `ModelBlocks`) streams an exclusive group's blocks through two device slots in its
        phases (`residency.placement.layers`).  A refused call changes nothing.

            scheduler.add("text_encoder", [clip, t5])
            scheduler.add("vae", pipe.vae, policy="resident")
            scheduler.add("shared", model, policy="resident", exclude=[model.reasoner, model.generator])
            scheduler.add("transformer", dit, layers=model_blocks(dit, resident_layers=2))
        """
        check_open(self._holds)
        policy = parse_policy(policy)
        check_name(name, ())
        check_flag("detect_edits", detect_edits)
        sharded = sharded_load(self._packer.node, self._ledger, name, weight_transfer)
        roots = as_modules(name, modules)
        given = self._blocks_for(name, roots, layers, policy)
        excluded = as_excluded(name, exclude, roots) + streamed_modules(given)
        group = self._admission.register(GroupSpec(
            name=name, roots=roots, policy=policy, excluded=excluded, category=category,
            detect_edits=detect_edits, model_blocks=given, sharded=sharded))
        return self._auto.added(group, self._registry, self._lock, self._admission.remove) \
            if self._auto is not None else group

    def alias(self, path: str, name: str) -> None:
        """Let ``resident(path)`` enter group `name` (dotted module paths of a pipeline).

        Refused (changing nothing) for a path that is not a non-empty string, that names a group,
        or that already leads to another group.
        """
        locked(self._lock, self._registry.alias, path, name)

    def refresh(self, name: str) -> Residency:
        """Re-register group `name` after its modules changed (new, replaced or re-typed tensors).

        The modules' current tensors are packed into a fresh host master; the group ends offloaded
        (resident-policy groups are placed again).  Phases of the group are refused meanwhile.
        """
        check_open(self._holds)
        group = self._admission.refresh(name)
        self._plan_again(f"group {name!r} refreshed")
        return group

    def remove(self, name: str) -> Residency:
        """Unregister group `name`; its modules keep their weights in host memory.

        Refused while a phase of the group is active.  Tensors the user re-typed or re-shaped
        while the group was resident are left as the user made them (moved to the host).
        """
        check_open(self._holds)
        group = locked(self._lock, self._admission.remove, name, "remove")
        self._plan_again(f"group {name!r} removed")
        return group

    def _plan_again(self, reason: str) -> None:
        """An auto scheduler plans its groups again (a group left, or was packed again): now,
        or while another group's phase is active at the next call's beginning."""
        if self._auto is not None:
            locked(self._lock, self._auto.plan_again, self._registry, reason,
                   not self._holds.has_holders())

    def close(self, *, reopen: str = "") -> None:
        """Return every group's weights to host memory and release device storage.

        The modules stay usable on the host; later calls are refused, advising `reopen` (default:
        a new Scheduler).  Refused (changing nothing) while any phase is active.  If a group cannot
        be evicted (a write-back the ranks disagree on), the error propagates with the groups not
        yet closed still registered: fix the cause and close again.
        """
        locked(self._lock, self._admission.close, reopen)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Residency:
        check_open(self._holds)
        return self._registry.lookup(name)

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __len__(self) -> int:
        return len(self._registry)

    def __repr__(self) -> str:
        status = "closed" if self._holds.closed else f"current={self.current!r}"
        return f"<Scheduler on {self.device}: {len(self)} group(s), {status}>"

    @property
    def current(self) -> str | None:
        """Name of the exclusive group whose phase holds the device now, or None (under an auto
        plan other groups may keep parts there too: `resident_groups`)."""
        return getattr(self._placement.current, "name", None)

    @property
    def transport(self) -> Transport:
        """How bytes move (read-only): the transport given, else its device's (`transport_for`)."""
        return self._transport

    @property
    def host_options(self) -> HostOptions:
        """Where host masters live (`residency.options.host_options`), as given to ``host=``."""
        return self._packer.host

    @property
    def auto_options(self) -> AutoOptions | None:
        """The options of an auto plan (`residency.options.budget`); None: the fixed plans."""
        return None if self._auto is None else self._auto.options

    @property
    def plan(self) -> AutoPlan | None:
        """The auto plan in force (`residency.auto.auto.AutoPlan`: each group's plan, the
        prediction per call, each call's measured figures; ``.describe()``), or None."""
        return None if self._auto is None else self._auto.plan

    def set_device_budget(self, device_budget: int | str | float) -> None:
        """Give an auto scheduler a new device budget (bytes, a size such as "20GiB", or a
        fraction of the free device memory) and re-plan now.  Refused, changing nothing, during
        a phase, without ``auto=``, or when no plan fits the budget.

            scheduler.set_device_budget("20GiB")
        """
        check_open(self._holds)
        if self._auto is None:
            raise ConfigError("set_device_budget is for an auto scheduler; create it with "
                              "Scheduler(auto={'device_budget': ...})")
        locked(self._lock, self._set_device_budget, device_budget)

    def _set_device_budget(self, device_budget: object) -> None:
        self._admission.check_no_holders("set the device budget")
        self._auto.set_budget(self._registry, device_budget)

    @property
    def device_memory_limit(self) -> int | None:
        """Most device bytes this scheduler's storages may hold together (None: no limit)."""
        return self._placement.device_memory_limit

    @property
    def device_nbytes(self) -> int:
        """Bytes of device storage the scheduler holds now (shared exclusive buffers included)."""
        return locked(self._lock, getattr, self._placement, "device_nbytes")

    def resident_groups(self) -> list[str]:
        """Names of every group whose weights are on the device now (a consistent snapshot): the
        current group and those kept whole; a partly kept group (auto) only while current."""
        return locked(self._lock, self._placement.resident_names)

    # -- phases --------------------------------------------------------------------------------

    def resident(self, name: str) -> Phase:
        """A phase: inside ``with scheduler.resident(name):`` the group is on the device.

        The group stays resident after the block until another group is asked for, so a loop that
        re-enters it costs a lock, not a copy.  `name` may also be a registered alias.
        """
        group = self._registry.groups.get(name) if isinstance(name, str) else None  # a read
        if group is None:  # an alias, or no group: the registry is asked
            check_open(self._holds)
            group = self._registry.lookup(name)
        return Phase(self._gate, group)

    def call(self) -> Call:
        """A call: one use of the whole pipeline (one request), its bytes and span recorded in
        `calls` when it ends ([Note: what a call is] in `residency.group.calls`).

            with scheduler.call():
                ...                                # every phase of one request
            scheduler.calls[-1].nbytes, scheduler.calls[-1].seconds
        """
        return Call(self._gate)

    @property
    def calls(self) -> CallLog:
        """Every call ended (`CallRecord`: the newest ``record_limit`` and running totals)."""
        return self._gate.calls.log

    def offload_all(self) -> None:
        """Evict the resident exclusive group and free the shared device storage.

        Resident-policy groups stay.  Refused (changing nothing) while any phase is active.
        """
        check_open(self._holds)
        locked(self._lock, self._offload_all)

    def _offload_all(self) -> None:
        self._admission.check_no_holders("offload all groups")
        self._placement.offload_all()

    def prefetch(self, name: str) -> bool:
        """Start copying group `name` to the device now, beside the resident group; opt-in.

            with scheduler.resident("text_encoder"):
                scheduler.prefetch("dit")      # the copy overlaps the encoder's compute
                embeddings = encoder(ids)
            with scheduler.resident("dit"):    # only re-points: the bytes are already there
                ...

        Done only when ``device_memory_limit`` (or, on CUDA without a limit, the free device
        memory) allows both groups' bytes at once.  Returns whether a copy was started (False:
        already resident or prefetching, or no room); the group reads its host master until its
        phase begins.
        """
        check_open(self._holds)
        return locked(self._lock, self._prefetch, name)

    def _prefetch(self, name: str) -> bool:
        return self._placement.prefetch(self._registry.lookup(name))

    def _blocks_for(self, name: str, roots, layers, policy: Policy):
        """The blocks `add` packs apart: ``layers=``'s, or an auto plan's (not in a phase)."""
        if self._auto is None:
            return as_model_blocks(name, roots, layers, policy)
        locked(self._lock, self._admission.check_no_holders,
               f"add group {name!r} to an auto scheduler (it plans every group again)")
        return auto_blocks(name, roots, layers, policy)


def _note_pageable(pinned: bool, device: torch.device, transport: Transport) -> None:
    """Say that host masters are pageable memory (unless `pinned`), and why."""
    if pinned:
        return
    why = "pin_memory=False" if transport.can_pin() else "the device is the host: nothing to pin"
    _log.info("host masters on %s are pageable memory (%s)", device, why)
