"""Layer mode: a group's blocks stream through two reused device slots while its phase runs.

    scheduler.add("transformer", dit, layers=True)          # or layers=model_blocks(dit, ...)
    with scheduler.resident("transformer") as group:
        latents = dit(latents, context)                      # each block streams in turn
        for block in group.layers():                         # the explicit form, same streaming
            hidden = block(hidden)

Which blocks stream is `residency.modules.blocks`'s answer (a `ModelBlocks`), and the group's plan
(`residency.group.plan`) names them as its streamed parts; this file is *when*.  A layer-mode
group is one `Residency` for its own part, everything outside the streamed blocks (the kept blocks
included: loaded at the phase's start, evicted at its end, as in module mode), and one small
`Residency` per streamed part with its own host master.  `BlockStream` owns the parts and decides
which goes into which of the two slots and when; the slots' placement
(`residency.placement.slots.SlotPlacement`) carries each move out.

[Note: what is on the device in layer mode]
While the group is current: the outside part, then at most two streamed blocks, one per slot
(`DeviceBuffers.block_slots`, each sized for the largest block and allocated once per run of layer
phases).  Entering block i's forward waits for its copy (or loads it on demand) and issues the
copy of the next block in streaming order into the other slot on the copy stream, so that copy
overlaps block i's compute; leaving block i evicts it (its slot is retired: the next copy into it
waits for block i's compute).  The last block prefetches the first (a ring: the next denoising
step or CFG pass starts without waiting).  No allocation per block, no host wait on the copies.

[Note: keeping every edit in layer mode]
A streamed block's tensors point at its host master whenever the block is not in a slot, so an
edit made then, by any path, lands in the master itself.  A block in a slot is a resident group
in the module-mode sense: its bytes are digested when loaded and again when it leaves
(`Residency.evict`), and what changed is written back - inside its forward (a custom kernel),
and while it waits in a slot between forwards (the first block, prefetched by the last one, is
re-pointed to its slot when the last block ends, so an edit made between steps - a LoRA fused in
a step-end callback - lands in the slot and is written back when it leaves).  A block's copy is
issued when the block before it starts and parked (re-pointed to its slot) when that block ends;
an edit block i's own forward makes to block i+1 meanwhile lands in i+1's master and is copied
again at parking when the version counter or the data pointer shows it (a new dtype or shape
abandons the copy: i+1 is re-packed and loaded at its entry), so the only edit i+1 runs without
is a bytes-only one made there (through ``.data``): it is kept in the master, and i+1 runs once
with its bytes as copied.  The cost: with
``detect_edits`` (the default) each block's departure reads its digest, one host wait per block
on an accelerator; ``detect_edits=False`` removes it (then only version counters and data pointers
tell, as in module mode; docs/guarantees.md).  With a process group the blocks' masters are
node-shared pages: an accumulating edit made to a block outside its slot is applied once per rank
(docs/guarantees.md, "Known limit").

[Note: the block wrappers]
Models that iterate their block lists themselves (every diffusers DiT) need the streaming to
happen at each block's call.  The core sets a per-instance ``forward`` on each streamed block (a
`_BlockForward`, calling the forward it replaced; set, found, removed and deep-copied as every
per-instance wrapper is: [Note: per-instance wrappers] in `residency.modules.instance_wrappers`): no
``register_*_hook``, no class patching, only in layer mode, and removed when the group is
removed, refreshed or the scheduler closes.  It is
the one place the core replaces something on a user's module (docs/design.md says why).  When the
group is not current the wrapper only calls through: the block runs on its host master, as a
module-mode group's modules do outside their phase.  A wrapper another library dropped (one set
below ours and removed later restores the forward it saw: diffusers' ``disable_cache``) is set
again at the group's next phase entry (`BlockStream.rewrap`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from residency.modules.blocks import ModelBlocks, model_blocks, reread_blocks
from residency.group.residency import Residency, slot_nbytes
from residency.core.enums import Policy, ResidencyState
from residency.core.errors import ConfigError, PhaseError, RegistrationError
from residency.modules.instance_wrappers import InstanceWrapper, unreachable
from residency.core.locks import in_context, locked
from residency.host.memory import HostMaster
from residency.group.plan import Plan, Where
from residency.group.records import BlockLog
from residency.placement.slots import SlotPlacement
from residency.modules.tensors import Inventory
from residency.device.transport import Transport

__all__ = [
    "BlockStream", "as_model_blocks", "auto_blocks", "build_stream", "restream",
    "streams_over", "streamed_modules",
]

_OFFLOADED, _LOADING, _RESIDENT = (
    ResidencyState.OFFLOADED, ResidencyState.LOADING, ResidencyState.RESIDENT,
)


def as_model_blocks(
    name: str, roots: Sequence[nn.Module], layers: object, policy: Policy
) -> tuple[ModelBlocks, ...]:
    """`Scheduler.add`'s ``layers=``: False -> (), True -> each root's `ModelBlocks`, else the
    `ModelBlocks` given.

        as_model_blocks("transformer", (dit,), True, Policy.EXCLUSIVE)   # (model_blocks(dit),)
    """
    if layers is False or layers is None:
        return ()
    if policy is not Policy.EXCLUSIVE:
        raise RegistrationError(
            f"group {name!r}: layers= streams the blocks of an exclusive group, and this group's "
            "policy is 'resident' (always on the device, nothing to stream); drop layers= or "
            "use policy='exclusive'"
        )
    if layers is True:
        return tuple(model_blocks(root, path=_model_path(name, roots)) for root in roots)
    if isinstance(layers, ModelBlocks):
        given = (layers,)
    elif isinstance(layers, Iterable) and not isinstance(layers, (str, bytes)):
        given = tuple(layers)
    else:
        given = (layers,)
    inside = {id(m) for root in roots for m in root.modules()}
    for blocks in given:
        if not isinstance(blocks, ModelBlocks):
            raise RegistrationError(
                f"group {name!r}: layers={layers!r}; give True (find each module's blocks) or "
                "ModelBlocks from residency.model_blocks(model, resident_layers=...)"
            )
        if id(blocks.model) not in inside:
            raise RegistrationError(
                f"group {name!r}: the ModelBlocks for {blocks.model_path!r} is of a model outside "
                "the group's modules; give the blocks of the modules you add"
            )
    return given


def auto_blocks(
    name: str, roots: Sequence[nn.Module], layers: object, policy: Policy
) -> tuple[ModelBlocks, ...]:
    """An auto scheduler's ``layers=``: the `ModelBlocks` given (`as_model_blocks`), else each
    root's own blocks where it has block lists (a root without is all own part); none for a
    group of policy 'resident' (kept whole).

        auto_blocks("transformer", (dit,), False, Policy.EXCLUSIVE)   # (model_blocks(dit),)
    """
    if layers is not False and layers is not None:
        return as_model_blocks(name, roots, layers, policy)
    if policy is not Policy.EXCLUSIVE:
        return ()
    found = []
    for root in roots:
        try:
            found.append(model_blocks(root, path=_model_path(name, roots)))
        except ConfigError:  # no block lists: the root moves whole, with the own part
            continue
    return tuple(found)


def _model_path(name: str, roots: Sequence[nn.Module]) -> str | None:
    """What blocks found for a group are named under: the group's name when it has one module
    (as the diffusers adapter names a DiT's blocks in every mode: ``transformer_2.blocks.1``),
    else each module's class name (`model_blocks`' default)."""
    return name if len(roots) == 1 else None


def streamed_modules(given: Sequence[ModelBlocks]) -> tuple[nn.Module, ...]:
    """The modules of every streamed block of `given`, in streaming order."""
    return tuple(block.module for blocks in given for block in blocks.streamed)


def restream(group: Residency) -> tuple[tuple[ModelBlocks, ...], tuple[nn.Module, ...]]:
    """The `ModelBlocks` and the excluded modules `group` is re-registered with (``refresh``):
    each made again (`residency.modules.blocks.reread_blocks`), so a block replaced in its list streams in
    its place."""
    given = tuple(blocks for stream in group.streams for blocks in stream.model_blocks)
    before = {id(m) for m in streamed_modules(given)}
    model_blocks = tuple(reread_blocks(blocks) for blocks in given)
    excluded = tuple(m for m in group.excluded if id(m) not in before)
    return model_blocks, excluded + streamed_modules(model_blocks)


def build_stream(
    group: Residency,
    model_blocks: tuple[ModelBlocks, ...],
    inventories: Sequence[Inventory],
    *,
    pack: Callable[[str, Inventory], HostMaster],
    transport: Transport,
    slots: SlotPlacement,
    lock: threading.RLock,
    log: BlockLog,
) -> tuple[BlockStream, ...]:
    """The streams that carry out `group`'s plan for its blocks: one, with each streamed block
    of `model_blocks` packed into its own host master (`inventories`: one per block, in order);
    none without `model_blocks` (module mode).  Blocks the plan places whole apart from the own
    part (an auto plan's kept and swapped ones) are packed the same way and become
    ``group.apart``; the stream holds the streamed ones (with none it only answers `layers`).

    Each block is a `Residency` named as its part in the plan ("<model path>.<block path>"),
    with the group's category, edit detection and weight transfer (with ``"allgather"`` every
    block load is split among the node's ranks, as the group's own part is).
    """
    if not model_blocks:
        return ()
    modules = streamed_modules(model_blocks)
    parts = []
    for part, module, inventory in zip(group.plan.parts[1:], modules, inventories, strict=True):
        master = pack(f"{group.name}[{part.name}]", inventory)
        parts.append(Residency(
            part.name, (module,), Policy.EXCLUSIVE, inventory, master, transport,
            category=group.category, detect_edits=group.detect_edits, sharded=group.sharded,
        ))
    group.apart = tuple(p for p in parts if p.name not in group.plan.streamed)
    return streams_over(group, model_blocks, parts, group.plan.streamed, slots=slots, lock=lock,
                        log=log)


def streams_over(group: Residency, model_blocks: tuple[ModelBlocks, ...],
                 parts: Iterable[Residency], streamed: Sequence[str], *, slots: SlotPlacement,
                 lock: threading.RLock, log: BlockLog) -> tuple[BlockStream, ...]:
    """The stream of `group`'s parts named in `streamed` (a plan's), in that order: one for
    the blocks of `model_blocks` (with no part streamed it only answers `layers`), none
    without them."""
    if not model_blocks:
        return ()
    by_name = {part.name: part for part in parts}
    return (BlockStream(group, model_blocks, [by_name[name] for name in streamed], slots,
                        lock=lock, log=log),)


def take_plan(group: Residency, plan: Plan, *, slots: SlotPlacement, lock: threading.RLock,
              log: BlockLog) -> None:
    """Give offloaded `group` `plan` (an auto scheduler's re-plan), its parts apart and a
    stream of the parts it streams: the old streams are closed first, and a stream built and not
    taken (an interrupt) is closed again."""
    parts = {part.name: part for part in group.parts}
    given = tuple(blocks for stream in group.streams for blocks in stream.model_blocks)
    for stream in group.streams:
        stream.close()
    apart = tuple(parts[p.name] for p in plan.parts[1:] if p.where is not Where.STREAMED)
    built: tuple[BlockStream, ...] = ()
    try:
        built = streams_over(group, given, parts.values(), plan.streamed, slots=slots, lock=lock,
                             log=log)
        group.plan, group.apart, group.streams = plan, apart, built  # one line: the commit
    except BaseException:
        if group.streams is not built:
            for stream in built:
                stream.close()
        raise


class BlockStream:
    """The streamed parts of one layer-mode group and their way through the two slots.

        stream.start()        # the group became current: park the first block in a slot
        stream.enter(i) ...   # by block i's wrapper, around its forward
        stream.stop()         # the group is evicted: every block back in its master

    The stream decides which block goes into which slot and when; every move is the slots'
    placement's (`residency.placement.slots.SlotPlacement`): this class calls no transition of a
    block's `Residency` itself.

    Fields (guarded by the scheduler lock; this object is their one mutator):

    * ``_occupant``: the block index each slot holds (LOADING or RESIDENT in it), or None.
      Invariant: a block is LOADING or RESIDENT exactly when it is some slot's occupant, and its
      ``device_target`` is that slot.
    * ``_running``: the forwards inside a block now, over all threads: token -> block index (at
      most two blocks: one per slot).  A block leaves its slot when its last forward ends.  The
      token `enter` hands out is what `exit` takes back, once: an exit repeated after an
      interrupt changes nothing.
    * ``_suspended``: forwards that were inside a block when `stop` ran (a nested phase of another
      group); `start` loads those blocks again.  Every forward is counted in exactly one of the
      two from its `enter` to its `exit`.
    * ``active``: whether the group is current (streaming happens) - between `start` and `stop`.
    """

    def __init__(
        self,
        group: Residency,
        model_blocks: tuple[ModelBlocks, ...],
        parts: list[Residency],
        slots: SlotPlacement,
        *,
        lock: threading.RLock,
        log: BlockLog,
    ) -> None:
        self.group = group
        self.name = group.name
        #: What each model streams (made again by ``refresh``: `restream`).
        self.model_blocks = model_blocks
        #: One Residency per streamed part, in streaming order (the plan's streamed parts).
        self.parts = parts
        self._slots = slots
        self._lock = lock
        self._log = log
        self._occupant: list[int | None] = [None, None]
        self._running: dict[object, int] = {}
        self._suspended: dict[object, int] = {}
        self.active = False
        self._wrappers: list[_BlockForward] = []
        try:
            for index, part in enumerate(parts):
                self._wrappers.append(_BlockForward(self, index, part.modules[0]))
                self._wrappers[-1].install()
        except BaseException:  # none left behind (see [Note: interrupts] in residency.scheduler.scheduler)
            for wrapper in self._wrappers:
                wrapper.remove()
            raise

    def __repr__(self) -> str:
        return f"<BlockStream {self.name!r}: {len(self.parts)} blocks, active={self.active}>"

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot must hold: the largest streamed block's laid-out bytes (whole shards,
        when the node's ranks all-gather each block)."""
        return slot_nbytes((part.inventory for part in self.parts), self.group.sharded)

    def layers(self) -> tuple[nn.Module, ...]:
        """Every block of the models (kept and streamed), in the order the model runs them."""
        return tuple(block.module for blocks in self.model_blocks for block in blocks.blocks)

    def describe_outside(self, own: Inventory) -> str:
        """For the group's repr: what its own part (`own`) holds outside the streamed blocks."""
        return (f"; outside its {len(self.parts)} streamed blocks {own.tensor_count} tensors, "
                f"{own.nbytes / 2**20:.1f} MiB")

    # -- the group's phase -----------------------------------------------------------------------

    def start(self) -> None:
        """The group became current: stream from now on, the first block parked in a slot.

        Blocks whose forwards a nested phase of another group interrupted (`stop`) are loaded
        again first, so they finish on their own bytes in a slot.
        """
        self.active = True
        suspended, self._suspended = self._suspended, {}
        self._running.update(suspended)
        for index in sorted(set(suspended.values())):
            if self.parts[index].state is _OFFLOADED:
                self._load_on_demand(index)
            elif self.parts[index].state is _LOADING:
                self._park(index)
        if self.parts:
            self._prefetch(0)
            if self.parts[0].state is _LOADING:
                self._park(0)

    def stop(self, *, repack: bool = True) -> int:
        """The group leaves the device: every block back in its master; returns bytes written.

        If an eviction fails (a write-back refused on a shared master), the error propagates
        with the stream still active; the placement's `settle` then runs it exactly when its
        group is current.  Forwards still inside a block (a nested phase of another group) are
        remembered for `start`.  A block re-typed in its slot is re-packed at once, unless
        `repack` is False (the group is being removed: its tensors stay as the user made them,
        as a removed module-mode group's do).
        """
        written = 0
        for slot, index in enumerate(self._occupant):
            if index is None:
                continue
            part = self.parts[index]
            if part.state is _LOADING:
                self._cancel(index)
            elif part.state is _RESIDENT:
                written += self._evict(index, slot, repack=repack)
        self.active = False
        self._suspended.update(self._running)
        self._running.clear()
        return written

    def settle(self, *, running: bool) -> None:
        """After a move stopped half-way: the slots' marks follow the blocks' states, and the
        stream runs exactly when its group is current (`running`)."""
        self._match_slots()
        if not running and (self.active or self._occupant != [None, None]):
            self.stop(repack=False)
        elif running and not self.active:
            self.start()

    def _match_slots(self) -> None:
        """Mark each slot with the block whose state says it is there (see [Note: a slot's
        occupant is written before a move and cleared by its failure])."""
        for slot, index in enumerate(self._occupant):
            if index is not None and self.parts[index].state is _OFFLOADED:
                self._occupant[slot] = None
        for index, part in enumerate(self.parts):
            slot = self._slots.slot_of(part)
            if slot is not None and index not in self._occupant:
                self._occupant[slot] = index

    def rewrap(self) -> None:
        """Set a block's forward again where another library dropped it: a wrapper set below
        ours and removed later restores the forward it saw (diffusers' ``disable_cache``), which
        bypasses ours.  Called at every phase entry of the group (with the lock held); it costs
        one dictionary lookup per block while each is its block's forward, and walks the
        ``__wrapped__`` chains of the others (`residency.modules.instance_wrappers.unreachable`)."""
        for index in unreachable(self._wrappers):
            wrapper = self._wrappers[index]
            replacement = _BlockForward(self, index, wrapper.module)
            self._wrappers[index] = replacement  # an interrupt after it: set at the next entry
            replacement.install()
            wrapper.remove()

    def close(self) -> None:
        """Stop, take the wrappers off the blocks and drop the slots' views of them."""
        self.stop(repack=False)
        self._suspended.clear()
        for wrapper in self._wrappers:
            wrapper.remove()
        self._slots.forget(self.parts)

    # -- around one block's forward (called by its wrapper) --------------------------------------

    def enter(self, index: int) -> object | None:
        """Make block `index` resident for its forward; returns the forward's token for `exit`,
        or None when the group is not current."""
        return locked(self._lock, self._enter, index)

    def _enter(self, index: int) -> object | None:
        if not self.active:
            return None
        part, token = self.parts[index], object()
        try:
            if part.state is _LOADING:
                self._park(index)
            if part.state is _OFFLOADED:  # not prefetched, or its copy abandoned at parking
                self._load_on_demand(index)
            self._running[token] = index
            self._prefetch((index + 1) % len(self.parts))
            self._record(index, "compute", self._slot_of(index), 0)
            return token
        except BaseException:  # the forward will not run, so no exit will come
            self._running.pop(token, None)
            self._match_slots()
            raise

    def exit(self, token: object) -> None:
        """The forward `token` stands for ended (normally or not): the last one out of its block
        evicts it; a prefetched next block is parked.  A second exit of a token does nothing."""
        locked(self._lock, self._exit, token)

    def _exit(self, token: object) -> None:
        index = self._running.pop(token, None)  # the commit: once per forward
        if index is None:  # stopped while inside (see `stop`), or exited already
            self._suspended.pop(token, None)
            return
        try:
            slot = self._slot_of(index)
            if index not in self._running.values() and slot is not None \
                    and self.parts[index].state is _RESIDENT:
                self._evict(index, slot)
            following = (index + 1) % len(self.parts)
            if self.parts[following].state is _LOADING:
                self._park(following)
        except BaseException:  # the block stays in its slot, or leaves it: either is sound
            self._match_slots()
            raise

    # -- moves (each carried out by the slots' placement) ----------------------------------------
    # [Note: a slot's occupant is written before a move and cleared by its failure]
    # A copy is issued only into a slot already marked as the block's, and a failed move (its
    # load cancelled, its eviction refused half-way) clears the mark before the error goes on, so
    # "a block is LOADING or RESIDENT exactly when it occupies a slot" survives any exception.

    def _prefetch(self, index: int) -> None:
        """Issue block `index`'s copy into a slot no running block uses (if it needs one and
        may have one: `SlotPlacement.may_prefetch`)."""
        if not self._slots.may_prefetch(self.parts[index]):
            return
        slot = self._slot_to_fill()
        if slot is None:
            return
        self._occupant[slot] = index
        try:
            nbytes = self._slots.prefetch(self.parts[index], slot)
        except BaseException:
            self._occupant[slot] = None
            raise
        self._record(index, "prefetch", slot, nbytes)

    def _park(self, index: int) -> None:
        """Finish block `index`'s copy (see [Note: keeping every edit in layer mode]); an
        abandoned copy (`SlotPlacement.park`) frees its slot, and the block loads at its entry."""
        try:
            parked = self._slots.park(self.parts[index])
        except BaseException:  # the load was cancelled: the block is back on its master
            self._vacate(index)
            raise
        if not parked:
            self._vacate(index)

    def _cancel(self, index: int) -> None:
        """Abandon block `index`'s copy; its slot is free whether or not that succeeds."""
        try:
            self._slots.cancel(self.parts[index])
        finally:
            self._vacate(index)

    def _load_on_demand(self, index: int) -> None:
        """Block `index` was not prefetched (run out of order): load it now."""
        slot = self._slot_to_fill()
        if slot is None:
            raise PhaseError(
                f"group {self.name!r}: block {self.parts[index].name} was called while two other "
                f"blocks ({self._describe_running()}) were running, nested in each other's "
                "forwards or on other threads; layer mode streams through two slots, so at most "
                "two blocks run at once. Run the blocks one after another, or register the group "
                "without layers="
            )
        self._occupant[slot] = index
        try:
            nbytes = self._slots.load(self.group, self.parts[index], slot)
        except BaseException:
            self._occupant[slot] = None
            raise
        self._record(index, "load", slot, nbytes)

    def _evict(self, index: int, slot: int, *, repack: bool = True) -> int:
        part = self.parts[index]
        try:
            written = self._slots.evict(self.group, part, repack=repack)
        finally:  # evicted, or refused with the block still RESIDENT (then it keeps its slot)
            if part.state is not _RESIDENT:
                self._occupant[slot] = None
        self._record(index, "evict", slot, written)
        return written

    def _slot_to_fill(self) -> int | None:
        """An empty slot, else one whose block is not running (that block is evicted, or its
        copy cancelled); None when both hold running blocks."""
        running = set(self._running.values())
        candidates = [s for s, held in enumerate(self._occupant) if held not in running]
        empty = [s for s in candidates if self._occupant[s] is None]
        if empty:
            return empty[0]
        if not candidates:
            return None
        slot = candidates[0]
        held = self._occupant[slot]
        if self.parts[held].state is _LOADING:
            self._cancel(held)
        else:
            self._evict(held, slot)
        return slot

    def _vacate(self, index: int) -> None:
        slot = self._slot_of(index)
        if slot is not None:
            self._occupant[slot] = None

    def _slot_of(self, index: int) -> int | None:
        return next((s for s, held in enumerate(self._occupant) if held == index), None)

    def _describe_running(self) -> str:
        return ", ".join(self.parts[i].name for i in sorted(set(self._running.values())))

    def _record(self, index: int, kind: str, slot: int, nbytes: int) -> None:
        self._log.add(self.name, self.parts[index].name, index, kind, slot, nbytes)


class _BlockForward(InstanceWrapper):
    """A streamed block's per-instance ``forward``: stream it in, run the forward it replaced,
    stream it out (see [Note: the block wrappers]).  `attached` is the block's `BlockStream`;
    setting, finding, removing and copying are `InstanceWrapper`'s."""

    __slots__ = ("_index", "_range")

    def __init__(self, stream: BlockStream, index: int, module: nn.Module) -> None:
        super().__init__(module, "forward", stream)
        self._index = index
        self._range = f"residency::block {stream.name}.{stream.parts[index].name}"
        # See [Note: the block forwards under torch.compile]; each mark on its own, so an
        # interrupt between the two leaves the second for the next block forward to make.
        if _BlockForward._enter is _BlockForward._enter_eagerly:
            _BlockForward._enter = torch.compiler.disable(_BlockForward._enter_eagerly)
        if _BlockForward._exit is _BlockForward._exit_eagerly:
            _BlockForward._exit = torch.compiler.disable(_BlockForward._exit_eagerly)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced by torch.compile: see _enter
            return self._traced_call(*args, **kwargs)
        stream, token = self.attached, None
        if stream is None:  # detached: removed with its group
            return self.__wrapped__(*args, **kwargs)
        try:  # no `finally`: see [Note: interrupts] in residency.scheduler.scheduler
            token = stream.enter(self._index)
            if token is None:
                return self.__wrapped__(*args, **kwargs)
            if torch.autograd.profiler._is_profiler_enabled:
                output = in_context(record_function(self._range), self.__wrapped__, *args, **kwargs)
            else:
                output = self.__wrapped__(*args, **kwargs)
            stream.exit(token)
            return output
        except BaseException:
            if token is not None:
                stream.exit(token)  # a second exit of the token does nothing
            raise

    def _traced_call(self, *args, **kwargs):
        token = None
        try:
            token = self._enter()
            if token is None:
                return self.__wrapped__(*args, **kwargs)
            output = self.__wrapped__(*args, **kwargs)
            self._exit(token)
            return output
        except BaseException:
            if token is not None:
                self._exit(token)
            raise

    # [Note: the block forwards under torch.compile]
    # Streaming moves tensors, so it runs outside any graph: torch.compile calls `_enter` and
    # `_exit` eagerly (a graph break on each side of a block's compute).  In eager mode they are
    # not called at all - `__call__` calls the stream directly - because a disabled function
    # costs microseconds per call, about the whole budget of a block's streaming.  They are
    # marked (`torch.compiler.disable`) when the first block forward is made, not when this
    # module is imported: marking imports torch._dynamo, 2.6 s of the 5.5 s `import residency`
    # took on a 2-core VM, which a module-mode job never needs.  Marked once, before any block
    # runs (so before any tracing), and the same two functions for every block: one graph
    # serves every block of a regionally compiled model.
    def _enter_eagerly(self) -> object | None:
        stream = self.attached
        return None if stream is None else stream.enter(self._index)

    def _exit_eagerly(self, token: object) -> None:
        stream = self.attached
        if stream is not None:  # else removed with its group meanwhile: nothing to leave
            stream.exit(token)

    _enter = _enter_eagerly
    _exit = _exit_eagerly

    def __repr__(self) -> str:
        return f"<layer-mode forward of {self._range.split(' ', 1)[1]}>"
