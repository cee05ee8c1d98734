"""Rank agreement: same weights on every rank? the same phases in the same order? the same edits?

    verdict = compare_weights("dit", layouts, tensors, group)      # collective over `group`
    verdict.identical                   # True: the ranks may share one master and all-gather
    with PhaseLedger(group) as ledger:
        ledger.enter("transformer")     # collective: every rank enters the same phase here
    decision = agree_write_back("dit", changed_ranges, digest, group)
    if decision.writes:                 # exactly one rank copies the changed bytes to the master
        ...

The pure collective pieces multi-rank offloading is built from (issue 15).  Each call is
collective over a gloo process group (`residency.multirank.node.NodeView.group`, or
``torch.distributed.new_group(backend="gloo")``): every rank of the group calls it at the same
point.  torch.distributed carries everything; there are no sockets of our own.

[Note: one exchange per agreement]
Every agreement is one exchange of ``(point, problem, payload)`` over the group:
  * ``point`` says what the rank is doing ("phase #3: enter 'dit'", "the write-back of 'dit'");
  * ``problem`` is what went wrong on that rank before the exchange (bad input), or None;
  * ``payload`` is what is compared (layouts and checksums, changed ranges and their digest).
It is at most two all-gathers.  First a fixed 256-byte header from every rank: the length of its
pickled ``(problem, payload)`` and its point (utf-8; a longer point is cut and ends in a hash of
the whole, so different points never compare equal).  Every rank receives the same headers, so
every rank takes the same decision from them: points differ -> all raise the divergence error;
every length is 0 (a phase step with nothing wrong) -> done, one round; else a second all-gather
of the bodies, padded to the longest.  Every rank then holds the same list and computes the same
verdict from it, so every rank raises the same error with the same message, at once.  Every
agreement starts with the same header, so two ranks at different agreements (one entering a
phase, another agreeing on a write-back) pair cleanly and both learn it, instead of mixing
payloads.  A local failure travels as a problem rather than being raised alone, which would leave
the others waiting for a rank that left.  (``all_gather_object`` always takes two rounds and
pickles: a phase step cost 1.9 ms with it and 0.47 ms with one header round, 2 ranks on the busy
2-core test machine.)

[Note: timeouts, and a rank that never arrives]
A gloo collective gives up after the group's timeout (``new_group(..., timeout=...)``, or
``init_process_group``'s), and reports a peer that exited at once (the connection closes).  So a
rank that skips an agreement makes the others raise within the timeout, never hang; and as soon as
it reaches its next agreement (its next phase, or `PhaseLedger.finish`, run by the ledger's
``with`` block however it is left) its point differs from the others' and every rank raises the
divergence error at once.  After a timeout the group's collectives can no longer be trusted to
pair: a ledger that saw one refuses every later call, and the job must tear the group down.  The
timeout must exceed the longest local work between two agreements (checksumming a large group at
registration), or a slow rank is taken for a missing one.

[Note: what a checksum detects]
A tensor's fingerprint is blake2b (128 bits) over its length and the `residency.device.digests` window
digests of its element bytes (row and column sums of 1 MiB windows, or of one smaller window for a
smaller tensor): the digest pass runs where the bytes are, at memory speed, and only the digests
(about 1% of the bytes) reach the host, once per device.  The layout is fixed, not chosen per
device, so a CPU rank and a CUDA rank holding the same bytes agree.  Two ranks' bytes are taken
for equal only when every window's row and column sums are equal (see [Note: the digest of a
window, and what it detects] in digests.py: any change of up to three words is always seen, more
escape only by a cancelling coincidence or a crafted permutation) and the hash does not collide.
Tensor-parallel shards differ everywhere; replicated weights loaded from one file are equal.
Element bytes are compared in logical order; the strides are compared as layout.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from residency.device.digests import DigestLayout, window_digests
from residency.core.errors import CollectiveError, ConfigError, RegistrationError

__all__ = [
    "PhaseLedger",
    "PhaseRecord",
    "TensorDifference",
    "TensorLayout",
    "WeightsVerdict",
    "AgreedWriteBack",
    "agree_write_back",
    "compare_weights",
    "describe_tensors",
    "digest_ranges",
]

#: Bytes of an exchange's header: the body's length (8) and the point (see
#: [Note: one exchange per agreement]).
_HEADER = 256
#: How many differing tensors (or ranks) a message names before "and N more".
_NAMED = 5
_MiB = 2**20
#: int64 words per row of the checksum layout (windows are 1 MiB, or the next power of two >= 1 KiB
#: that holds a smaller tensor): the same on every device, so a CPU and a CUDA rank agree.
_COLUMNS = 128


# -- the exchange ---------------------------------------------------------------------------------


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "rank agreement needs torch.distributed: call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, dist.ProcessGroup) or dist.get_backend(group) != "gloo":
        raise ConfigError(
            f"rank agreement runs on a gloo process group (host-side, bounded by its timeout); got "
            f"{group!r}. Pass residency.multirank.node.node_view().group or "
            "torch.distributed.new_group(backend='gloo')"
        )
    return group


def _exchange(
    group: dist.ProcessGroup, point: str, payload: Any, problem: str | None,
    error_type: type[Exception],
) -> dict[int, Any]:
    """Every rank's payload by global rank; the same error on every rank when points or inputs
    disagree.  See [Note: one exchange per agreement]."""
    body = b"" if payload is None and problem is None else pickle.dumps((problem, payload))
    headers = _gather_bytes(group, len(body).to_bytes(8, "little") + _encoded(point), _HEADER,
                            point, error_type)
    ranks = dist.get_process_group_ranks(group)
    points = {rank: header[8:].rstrip(b"\0").decode(errors="replace")
              for rank, header in zip(ranks, headers)}
    if len(set(points.values())) > 1:
        raise error_type(_divergence(points))
    lengths = [int.from_bytes(header[:8], "little") for header in headers]
    if not max(lengths):
        return dict.fromkeys(ranks)
    bodies = _gather_bytes(group, body, max(lengths), point, error_type)
    reports = {rank: pickle.loads(body[:length]) if length else (None, None)
               for rank, body, length in zip(ranks, bodies, lengths)}
    problems = {rank: report[0] for rank, report in reports.items() if report[0]}
    if problems:
        raise error_type(f"{point} was refused on some ranks (global rank: why) {problems}")
    return {rank: report[1] for rank, report in reports.items()}


def _encoded(point: str) -> bytes:
    """The point as it travels in a header: utf-8, cut to fit with a hash of the whole."""
    raw = point.encode()
    if len(raw) <= _HEADER - 8:
        return raw
    whole = hashlib.blake2b(raw, digest_size=16).hexdigest().encode()
    return raw[: _HEADER - 8 - 33] + b"#" + whole


def _gather_bytes(
    group: dist.ProcessGroup, data: bytes, size: int, point: str, error_type: type[Exception]
) -> list[bytes]:
    """Every rank's `data`, each zero-padded to `size` bytes; a failed collective raises."""
    mine = torch.zeros(size, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(gathered, mine, group=group)
    except RuntimeError as error:  # a peer died (closed connection) or the timeout passed
        raise error_type(_no_answer(point, error)) from error
    return [bytes(tensor.numpy()) for tensor in gathered]


def _no_answer(point: str, error: RuntimeError) -> str:
    return (
        f"rank {dist.get_rank()}: {point} failed: a rank of the process group died or did not "
        f"arrive within the group's timeout ({error}). Every rank must reach the same agreements "
        "in the same order; a rank that skips a phase (a cache that skips blocks on some ranks "
        "only) ends here. Look for the first error in the other ranks' logs; the group must be "
        "torn down (its collectives no longer pair)"
    )


def _divergence(points: dict[int, str]) -> str:
    return (
        f"the ranks diverged: they asked for different collective steps (global rank: what it "
        f"asked for) {points}. Ranks that share host masters or all-gather weights must register "
        "the same groups and enter the same phases, in the same order; a rank-local cache that "
        "skips blocks on some ranks only (diffusers' FirstBlockCache) cannot run with "
        "weight_transfer='allgather' or shared masters: turn the cache off, or give each rank its "
        "own master and rank-local transfers. Every rank raised this error"
    )


def _checked(call, *arguments) -> tuple[Any, str | None]:
    """(result, None), or (None, why) for a refusal to report through the exchange."""
    try:
        return call(*arguments), None
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as error:
        return None, f"{type(error).__name__}: {error}"


# -- checksums ------------------------------------------------------------------------------------


def _layout_for(nbytes: int) -> DigestLayout:
    """1 MiB windows, or one window of the next power of two (at least one 1 KiB row) for less."""
    window = max(8 * _COLUMNS, 1 << max(nbytes - 1, 0).bit_length())
    return DigestLayout(window_nbytes=min(window, _MiB), columns=_COLUMNS)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's element bytes as a contiguous, 8-byte aligned 1-D uint8 tensor (a view when
    possible, else a copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
    if tensor.is_meta:
        raise ValueError("a meta tensor has no bytes to compare: load the weights first")
    flat = tensor.detach()
    flat = (flat if flat.is_contiguous() else flat.contiguous()).reshape(-1).view(torch.uint8)
    return flat.clone() if flat.storage_offset() % 8 else flat


def _fingerprints(pieces: Sequence[torch.Tensor]) -> list[str]:
    """A 128-bit hex fingerprint of each 1-D uint8 piece: blake2b of its window digests and length.

    The digests are computed where the bytes are; one host copy per device brings them back.
    """
    digests = [window_digests(piece, _layout_for(piece.numel())).reshape(-1) for piece in pieces]
    on_host: list[torch.Tensor | None] = [None] * len(digests)
    for device in {d.device for d in digests}:
        indexes = [i for i, d in enumerate(digests) if d.device == device]
        flat = torch.cat([digests[i] for i in indexes]).cpu()
        for i, part in zip(indexes, flat.split([digests[i].numel() for i in indexes])):
            on_host[i] = part
    return [
        hashlib.blake2b(piece.numel().to_bytes(8, "little") + part.numpy().tobytes(),
                        digest_size=16).hexdigest()
        for piece, part in zip(pieces, on_host)
    ]


def digest_ranges(buffer_bytes: torch.Tensor, ranges: Iterable[tuple[int, int]]) -> str:
    """A fingerprint of the bytes in `ranges` of a 1-D uint8 buffer, and of the ranges themselves.

        changed = detector.changed_windows(device_buffer)
        decision = agree_write_back("dit", changed, digest_ranges(device_buffer, changed), group)

    The same bytes give the same fingerprint on any device; see [Note: what a checksum detects].
    """
    ranges = _normalized_ranges(ranges)
    pieces = [_as_bytes(buffer_bytes[start:end]) for start, end in ranges]
    text = repr(ranges) + "".join(_fingerprints(pieces))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# -- same weights on every rank? -----------------------------------------------------------------


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(value) for value in values)


@attrs.frozen(kw_only=True)
class TensorLayout:
    """How one tensor of a group looks, as plain data compared across ranks (not its bytes).

        TensorLayout(name="proj.weight", shape=(8, 4), dtype="torch.float32", stride=(4, 1),
                     storage_offset=0, region=0)

    `describe_tensors` builds them from tensors; a caller holding an inventory may build its own.
    """

    #: Where the tensor is reachable from ("blocks.0.attn.weight").
    name: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    #: ``str(tensor.dtype)``.
    dtype: str
    stride: tuple[int, ...] = attrs.field(converter=_int_tuple)
    storage_offset: int
    #: Which storage (or region of overlapping bytes) it reads, numbered by first appearance in
    #: the group: tied weights share one number.  This is the storage-sharing pattern.
    region: int

    def differences(self, other: TensorLayout) -> list[str]:
        """The fields that differ, as "field mine vs other"."""
        return [
            f"{field.name} {getattr(self, field.name)!r} vs {getattr(other, field.name)!r}"
            for field in attrs.fields(TensorLayout)
            if getattr(self, field.name) != getattr(other, field.name)
        ]


def describe_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[TensorLayout, ...]:
    """The layout of each tensor, in order; tensors reading one storage share a region number.

        layouts = describe_tensors(module.named_parameters(remove_duplicate=False))
    """
    regions: dict[tuple[int, int], int] = {}
    layouts = []
    for index, (name, tensor) in enumerate(named_tensors):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (-1, index)
        layouts.append(TensorLayout(
            name=name, shape=tensor.shape, dtype=str(tensor.dtype), stride=tensor.stride(),
            storage_offset=tensor.storage_offset(), region=regions.setdefault(key, len(regions)),
        ))
    return tuple(layouts)


_FIELDS = [field.name for field in attrs.fields(TensorLayout)]


@attrs.frozen(kw_only=True)
class TensorDifference:
    """One tensor position where some ranks differ from the group's lowest rank."""

    #: The position in the group's inventory order.
    index: int
    #: Its name on the lowest rank (or on the first rank that has it).
    name: str
    #: The global ranks whose tensor differs from the lowest rank's.
    ranks: tuple[int, ...] = attrs.field(converter=tuple)
    #: "bytes" (same layout, other values), "layout" (shape, dtype, stride...) or "missing".
    what: str
    #: The layout fields that differ, or which ranks lack the tensor.
    detail: str = ""

    def __str__(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        ranks = list(self.ranks)
        return f"{self.name!r} (#{self.index}) differs on ranks {ranks} in {self.what}{detail}"


@attrs.frozen(kw_only=True)
class WeightsVerdict:
    """Whether every rank holds the same weights for a group (the result of `compare_weights`).

    The same on every rank.  `identical`: the ranks may share one host master and all-gather;
    otherwise (tensor-parallel shards) each rank keeps its own master and copies rank-local.
    """

    #: The group compared.
    name: str
    #: The global ranks compared; the lowest is the reference.
    ranks: tuple[int, ...] = attrs.field(converter=tuple)
    #: Per position in inventory order (as many as the rank with the most tensors has): whether
    #: every rank has the same tensor there, layout and bytes.
    same: tuple[bool, ...] = attrs.field(converter=tuple)
    #: The positions that differ, in order.
    differences: tuple[TensorDifference, ...] = attrs.field(converter=tuple)

    @property
    def identical(self) -> bool:
        return not self.differences

    def describe(self) -> str:
        """One line: "identical on ranks [0, 1]", or the first differing tensors and ranks."""
        if self.identical:
            return (f"the {len(self.same)} tensors of {self.name!r} are identical on ranks "
                    f"{list(self.ranks)}")
        named = "; ".join(str(d) for d in self.differences[:_NAMED])
        more = len(self.differences) - _NAMED
        extra = f"; and {more} more" if more > 0 else ""
        return (f"{len(self.differences)} of the {len(self.same)} tensors of {self.name!r} differ "
                f"between ranks (compared with rank {self.ranks[0]}): {named}{extra}")


def compare_weights(
    name: str,
    layouts: Sequence[TensorLayout],
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    require: str | None = None,
) -> WeightsVerdict:
    """Whether every rank of `group` holds the same weights for group `name`; collective.

    `layouts[i]` describes `tensors[i]` (inventory order; `describe_tensors`).  Each rank
    fingerprints each tensor's bytes where they are (`residency.device.digests` window digests, then
    blake2b: 16 bytes per tensor), and one exchange compares layouts and fingerprints.  The
    verdict is the same on every rank.  `require` says who demands sharing (``"share=True"``, a
    pipeline's ``encoder_dlo_weight_replication``): a declaration is still checked, and when any
    rank requires it and the weights differ, every rank raises `RegistrationError` naming the
    tensors.  Bad input on any rank also raises on every rank.

        verdict = compare_weights("dit", describe_tensors(named), [t for _, t in named], group)
        master = shared_master() if verdict.identical else private_master()
    """
    group = _resolve_group(group)
    report, problem = _checked(_weights_report, layouts, tensors)
    payload = (*(report or ((), ())), require)
    gathered = _exchange(group, f"comparing the weights of {name!r}", payload, problem,
                         RegistrationError)
    verdict = _verdict(name, gathered)
    demand = next((p[2] for p in gathered.values() if p[2] is not None), None)
    if demand is not None and not verdict.identical:
        raise RegistrationError(_required_message(demand, verdict))
    return verdict


def _weights_report(layouts: Sequence[TensorLayout], tensors: Sequence[torch.Tensor]) -> tuple:
    """(layouts as plain tuples, fingerprints): what a rank contributes to the comparison."""
    if len(layouts) != len(tensors):
        raise ValueError(f"{len(layouts)} layouts for {len(tensors)} tensors: pass one per tensor")
    if not all(isinstance(layout, TensorLayout) for layout in layouts):
        raise TypeError("layouts must be TensorLayout objects: use describe_tensors(...)")
    plain = tuple(tuple(getattr(layout, field) for field in _FIELDS) for layout in layouts)
    return plain, _fingerprints([_as_bytes(tensor) for tensor in tensors])


def _verdict(name: str, gathered: dict[int, tuple]) -> WeightsVerdict:
    entries = {
        rank: [(TensorLayout(**dict(zip(_FIELDS, layout))), fingerprint)
               for layout, fingerprint in zip(layouts, fingerprints)]
        for rank, (layouts, fingerprints, _) in gathered.items()
    }
    count = max(len(listed) for listed in entries.values())
    differences = [d for d in (_difference(index, entries) for index in range(count)) if d]
    differing = {d.index for d in differences}
    return WeightsVerdict(name=name, ranks=sorted(entries),
                          same=[index not in differing for index in range(count)],
                          differences=differences)


def _difference(index: int, entries: dict[int, list]) -> TensorDifference | None:
    """How position `index` differs across ranks, compared with the lowest rank that has it."""
    present = {rank: listed[index] for rank, listed in entries.items() if index < len(listed)}
    reference_rank = min(present)
    layout, fingerprint = present[reference_rank]
    missing = sorted(set(entries) - set(present))
    if missing:
        return TensorDifference(index=index, name=layout.name, ranks=missing, what="missing",
                                detail=f"ranks {missing} have fewer tensors")
    moved = {rank: layout.differences(other) for rank, (other, _) in present.items()}
    moved = {rank: fields for rank, fields in moved.items() if fields}
    if moved:
        rank, fields = next(iter(moved.items()))
        return TensorDifference(index=index, name=layout.name, ranks=sorted(moved), what="layout",
                                detail=f"rank {reference_rank} vs rank {rank}: {', '.join(fields)}")
    changed = sorted(rank for rank, (_, other) in present.items() if other != fingerprint)
    if changed:
        return TensorDifference(index=index, name=layout.name, ranks=changed, what="bytes")
    return None


def _required_message(demand: str, verdict: WeightsVerdict) -> str:
    return (
        f"{demand} requires the weights of {verdict.name!r} to be the same on every rank, but "
        f"{verdict.describe()}. Weights that differ between ranks (tensor-parallel shards) cannot "
        f"share one host master or be all-gathered: drop {demand} for {verdict.name!r} (its ranks "
        "then keep their own masters), or load the same weights on every rank"
    )


# -- the same phases in the same order -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PhaseRecord:
    """One agreed step of a `PhaseLedger`: the `sequence`-th, entering `group` (or finishing)."""

    #: 0 for the ledger's first step, counting every step agreed.
    sequence: int
    #: The group entered; None for the final step (`PhaseLedger.finish`).
    group: str | None
    #: Why a rank finished: None normally, else the exception type it left the ledger with.
    left_after: str | None = None

    @property
    def point(self) -> str:
        """What the rank asks for, as the other ranks see it (compared verbatim)."""
        if self.group is not None:
            return f"phase #{self.sequence}: enter {self.group!r}"
        cause = f" after an error ({self.left_after})" if self.left_after else ""
        return f"phase #{self.sequence}: finish (no more phases){cause}"


class PhaseLedger:
    """Every rank of a process group enters the same phases in the same order, or all raise.

        with PhaseLedger(node.group) as ledger:      # leaving the block runs finish() on every rank
            ledger.enter("text_encoder")            # collective, before the phase's collectives
            ledger.enter("transformer")

    `enter(name)` agrees on the record ``(sequence, name)`` with the other ranks in one exchange
    (see [Note: one exchange per agreement]) and returns it.  When the ranks ask for different
    phases (rank 1 enters "text_encoder" while rank 0 enters "transformer"), every rank raises the
    same `CollectiveError` naming what each rank asked for.  A rank that skips a phase raises with the
    others at its next step; the others raise within the group's timeout if it never comes (see
    [Note: timeouts, and a rank that never arrives]).  After any failure the ledger is broken:
    every later call raises at once, without a collective.  One owner (not thread-safe).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = _resolve_group(group)
        #: The number of steps agreed so far (the next step's sequence number).
        self._sequence = 0
        #: The last record agreed, for messages and `__repr__`.
        self._last: PhaseRecord | None = None
        #: The error that broke the ledger, or None.
        self._failure: str | None = None
        self._finished = False

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def last(self) -> PhaseRecord | None:
        return self._last

    @property
    def broken(self) -> bool:
        return self._failure is not None

    def enter(self, group: str) -> PhaseRecord:
        """Agree with every rank that the next phase is `group`; collective.  Returns the record."""
        problem = None if isinstance(group, str) and group else (
            f"a phase names a group by a non-empty string, got {group!r}")
        return self._agree(PhaseRecord(sequence=self._sequence, group=str(group)), problem)

    def finish(self, left_after: str | None = None) -> PhaseRecord:
        """Agree with every rank that there are no more phases; collective.  A rank still waiting
        in a phase makes every rank raise.  Later calls raise."""
        record = self._agree(PhaseRecord(sequence=self._sequence, group=None,
                                         left_after=left_after), None)
        self._finished = True
        return record

    def _agree(self, record: PhaseRecord, problem: str | None) -> PhaseRecord:
        self._check_usable(record)
        try:
            _exchange(self._group, record.point, None, problem, CollectiveError)
        except CollectiveError as error:
            self._failure = str(error)
            raise
        self._sequence += 1
        self._last = record
        return record

    def _check_usable(self, record: PhaseRecord) -> None:
        if self._failure is not None:
            raise CollectiveError(
                f"rank {dist.get_rank()}: the phase ledger is broken, refusing {record.point}: "
                f"{self._failure}. The ranks can no longer agree through this ledger; tear the "
                "process group down (torch.distributed.destroy_process_group) and restart"
            )
        if self._finished:
            raise CollectiveError(
                f"rank {dist.get_rank()}: the phase ledger has finished, refusing {record.point}; "
                "make a new PhaseLedger for more phases (on every rank)"
            )

    def __enter__(self) -> PhaseLedger:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self.broken or self._finished:
            return
        if kind is None:
            self.finish()
            return
        try:  # tell the others why this rank leaves; the error in flight is the one that matters
            self.finish(left_after=kind.__name__)
        except CollectiveError:
            pass

    def __repr__(self) -> str:
        if self.broken:
            state = f"broken at #{self._sequence}"
        elif self._finished:
            state = f"finished after {self._sequence} steps"
        else:
            last = f", last {self._last.point}" if self._last else ""
            state = f"{self._sequence} steps agreed{last}"
        return f"<PhaseLedger rank {dist.get_rank()}: {state}>"


# -- write-back to a shared master -----------------------------------------------------------------


def _normalized_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    normal = tuple((int(start), int(end)) for start, end in ranges)
    previous_end = 0
    for start, end in normal:
        if start < previous_end or end <= start:
            raise ValueError(
                f"byte ranges must be non-empty, increasing and disjoint (start, end) pairs from "
                f"0, got {list(normal)}; pass ChangeDetector.changed_windows(...)"
            )
        previous_end = end
    return normal


@attrs.frozen(kw_only=True)
class AgreedWriteBack:
    """What the ranks sharing a master agreed to write back for a group (`agree_write_back`)."""

    #: The group.
    name: str
    #: The byte ranges every rank changed the same way; empty when nobody changed anything.
    ranges: tuple[tuple[int, int], ...] = attrs.field(converter=tuple)
    #: The global rank that writes them to the shared master; None when there is nothing to write.
    writer: int | None
    #: This process's global rank.
    rank: int

    @property
    def writes(self) -> bool:
        """Whether this rank copies `ranges` to the master (the others must not touch them)."""
        return self.writer == self.rank


def agree_write_back(
    name: str,
    changed: Iterable[tuple[int, int]],
    digest: str | None,
    group: dist.ProcessGroup | None = None,
    *,
    tensors: Sequence[tuple[str, int, int]] = (),
) -> AgreedWriteBack:
    """Decide with the ranks sharing group `name`'s master what to write back; collective.

    `changed` is this rank's changed byte ranges of the group's buffer
    (`ChangeDetector.changed_windows`), `digest` their `digest_ranges` (ignored when nothing
    changed).  Nobody changed anything: nothing to write.  Every rank changed the same ranges to
    the same bytes: the group's lowest rank writes (`AgreedWriteBack.writes`).  Otherwise every
    rank raises the same `CollectiveError`, naming each rank's ranges and the `tensors` (name,
    start, end) they touch; nothing is written, and each rank keeps its device copy.  The writer's copy must
    be ordered before any rank reads the master again (the next agreement, or a barrier).

        decision = agree_write_back("dit", changed, digest_ranges(buffer, changed), node.group)
        if decision.writes:
            for start, end in decision.ranges:
                master[start:end].copy_(buffer[start:end])
    """
    group = _resolve_group(group)
    ranges, problem = _checked(_normalized_ranges, changed)
    if ranges and not isinstance(digest, str):
        problem = problem or f"changed ranges need their digest_ranges(...) string, got {digest!r}"
    report = (ranges, digest if ranges else None)
    gathered = _exchange(group, f"the write-back of {name!r}", report, problem, CollectiveError)
    if len(set(gathered.values())) > 1:
        raise CollectiveError(_disagreement(name, gathered, tensors))
    agreed = next(iter(gathered.values()))[0]
    return AgreedWriteBack(name=name, ranges=agreed, writer=min(gathered) if agreed else None,
                     rank=dist.get_rank())


def _disagreement(name: str, gathered: dict[int, tuple], tensors: Sequence[tuple]) -> str:
    claims = {rank: (f"{list(ranges)} digest {digest[:12]}" if ranges else "nothing")
              for rank, (ranges, digest) in gathered.items()}
    spans = {span for ranges, _ in gathered.values() for span in ranges}
    touched = [t for t, start, end in tensors if any(s < end and start < e for s, e in spans)]
    more = f" and {len(touched) - _NAMED} more" if len(touched) > _NAMED else ""
    names = f"; the tensors in those ranges: {touched[:_NAMED]}{more}" if touched else ""
    return (
        f"the ranks sharing the host master of {name!r} changed it differently while it was "
        f"resident (global rank: changed byte ranges) {claims}{names}. Nothing was written back: "
        "every rank keeps its device copy. A shared master holds one copy for all ranks, so every "
        "rank must make the same edit (load and fuse a LoRA on every rank); weights that differ "
        "between ranks need per-rank masters. Every rank raised this error"
    )
