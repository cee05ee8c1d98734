"""Which windows of a device byte buffer changed since it was loaded: per-window digests on device.

    detector = ChangeDetector()                     # the layout defaults per device type
    detector.remember(device_buffer)                # after a load, ordered after the copy
    ...                                             # the phase runs; anything may edit the bytes
    for start, end in detector.changed_windows(device_buffer):   # at eviction
        host_bytes[start:end].copy_(device_buffer[start:end])

An edit through ``tensor.data`` or by a custom kernel moves neither the version counter nor the
data pointer; only the bytes themselves tell.  So the bytes are digested as they were loaded and
again at eviction, and exactly the windows whose digests differ are written back.

A *window* is this file's unit of detection and write-back (1 MiB on a CPU, 4 MiB on an
accelerator: `DigestLayout.window_nbytes`); it is not a pack *chunk* (`residency.modules.tensors`: a
piece of a host master, 256 MiB by default).

[Note: the digest of a window, and what it detects]
A window of ``window_nbytes`` is read as a ``rows x columns`` matrix of int64 words (8 bytes each,
counted from the start of the buffer).  Its digest is the sum of every row and the sum of every
column: ``rows + columns`` int64 values, added with wrap-around (modulo 2**64).  Addition modulo
2**64 is associative and commutative, so the digest does not depend on the order of the reduction,
the number of threads or the device: the same bytes always give the same digest, CPU or CUDA.

A change is missed only when it leaves every row sum and every column sum of its window unchanged:

* a change confined to one word (any bit flip, any rewrite of one element of 1, 2, 4 or 8 bytes)
  moves its row sum by a nonzero amount modulo 2**64: always detected;
* two or three changed words: at least one of them is alone in its row or in its column, whose
  sum then moves: always detected.  A swap of two different elements of 1, 2, 4 or 8 bytes changes
  at most two words when the elements are naturally aligned (address a multiple of the element
  size, as PyTorch allocates them and the pack layout keeps them): always detected;
* an escape needs at least four changed words whose changes cancel, modulo 2**64, in every row
  and every column they touch: e.g. ``+d`` at (r1, c1) and (r2, c2), ``-d`` at (r1, c2) and
  (r2, c1), the two rows a multiple of ``8 * columns`` bytes apart.  Arithmetic edits (a LoRA merge,
  an optimizer step, a cast, a kernel writing new values) change the bits of the words they touch
  by unrelated amounts; that all of them cancel in every touched row and column sum is a
  coincidence of probability about 2**-64 per sum.  What escapes by construction is a permutation
  of words that keeps the contents of every row and every column (two rows holding the same two
  words in opposite orders, both swapped) or a deliberately crafted cancelling pattern; no
  training or inference step produces either except by such a coincidence.

[Note: the cost, and why rows and columns]
On a CPU the check must cost well under the copy it saves.  A plain sum runs at memory bandwidth
but cannot see a swap; weighted sums see positions, but modulo 2**64 they miss swaps whose
difference is a high power of two (``x`` and ``-x`` in float64 differ by 2**63 as words).  Row and
column sums need no weights, but they are two reductions, so every word is read twice.  No single
torch reduction yields both partitions (a strided view has one pair of strides).

How many windows go in one pair of calls trades where the second read comes from against how many
calls a buffer costs, and the thread count decides (`_windows_per_call`):

* one intra-op thread, a CPU: one pair per window.  The second sum reads the window from the
  core's L2, and no call opens a parallel region, so the count of calls costs only its Python
  overhead; one pair over all windows would read every window twice from memory instead.
* more threads: all windows in one pair, two calls per buffer whatever its size (four sums at
  most per digest: rows and columns of the whole windows, of a last, shorter one).  Every call of
  more than 32,768 words (ATen's grain size) opens a parallel region, and when other processes
  share the cores a region can wait a whole scheduler slice for a descheduled thread.  One pair
  per window opens two regions per MiB, and a check that meets such waits costs tens of times
  the copy, while one pair per buffer stays within about twice it: a bounded worst case, bought
  with about a tenth more reading when no wait comes.
* an accelerator: all windows in one pair (two kernels; HBM at TB/s).

Both give the same digests.  On a CPU neither is used where a C compiler is found: the one-pass
kernel of `residency.device.one_pass` reads each word once, adding it to its row's sum and to its
column's (which stay in L1), over all whole windows in one call on torch's intra-op thread count,
with one join per call.  It is faster than either pair at one thread and at two, and bounded
under load as the single pair is; the torch pairs stay as its fallback.  (The same-run benchmark
is benchmarks/test_change_detection.py; its figures, with machine and date, are in
benchmarks/README.md, "Change detection".)  The
digests take ``(rows + columns) * 8`` bytes per window: 0.9% of the buffer with the CPU layout,
0.3% with the accelerator layout.  (Keeping a copy to ``torch.equal`` against would cost 100% of
the memory and, on a CPU, more time than the copy itself.)

[Note: streams and the one host wait]
`window_digests`, `ChangeDetector.remember` and `ChangeDetector.changed_flags` only queue kernels on
the current stream and keep their results on the device; no byte of the buffer leaves it.  Call
`remember` where the load's copy is already ordered before the current stream (after
``Completion.wait()``), and the check where every kernel that may edit the bytes is queued before
it.  The host waits once, in `changed_windows`, when it reads the flags: it must know which windows
to copy before it can queue their copies.  That read moves one byte per window; the wait itself
lasts until the compute queued before the check and the two digest kernels (one read of the buffer,
~0.1 ms per GiB at HBM speed) are done, so the host loses its run-ahead at that eviction, and only
there (re-entering the resident group checks nothing).  A caller that can decide later may keep
`changed_flags` (a device tensor) and read it then.
"""

from __future__ import annotations

import attrs
import torch

from residency.device.one_pass import one_pass_sums

__all__ = ["ChangeDetector", "DigestLayout", "window_digests"]

MiB = 2**20
_WORD = 8  # bytes in an int64 word


def _positive(instance, attribute, value) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class DigestLayout:
    """How a buffer is cut into windows, and a window into a ``rows x columns`` matrix of int64
    words.

        DigestLayout.for_device(torch.device("cpu"))  # window_nbytes=1048576, columns=128
        DigestLayout(window_nbytes=4 * 2**20, columns=512)

    `window_nbytes` is the unit of detection (and of write-back); a multiple of ``8 * columns``.
    """

    #: Bytes per window; the last window of a buffer may be shorter (it is digested zero-padded).
    window_nbytes: int = attrs.field(validator=_positive)
    #: int64 words per row of a window's matrix.
    columns: int = attrs.field(validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.window_nbytes % (_WORD * self.columns):
            raise ValueError(
                f"window_nbytes ({self.window_nbytes}) must be a multiple of 8 * columns "
                f"({_WORD * self.columns}): a window is a whole number of rows of int64 words"
            )

    @property
    def rows(self) -> int:
        return self.window_nbytes // (_WORD * self.columns)

    @property
    def digest_words(self) -> int:
        """int64 values per window digest: one per row, one per column."""
        return self.rows + self.columns

    def window_count(self, nbytes: int) -> int:
        return -(-nbytes // self.window_nbytes)

    @classmethod
    def for_device(cls, device: torch.device) -> DigestLayout:
        """The measured default.  CPU: 1 MiB windows of 1024 x 128 words (a window stays in L2
        between its two reductions when they run one window at a time: `_windows_per_call`).
        Accelerators: 4 MiB windows of 1024 x 512 words (less state; both reductions run over
        every window at once)."""
        if device.type == "cpu":
            return cls(window_nbytes=1 * MiB, columns=128)
        return cls(window_nbytes=4 * MiB, columns=512)


def window_digests(buffer_bytes: torch.Tensor, layout: DigestLayout) -> torch.Tensor:
    """The digest of every window of `buffer_bytes`: int64, ``(windows, layout.digest_words)``.

        digests = window_digests(device_buffer, DigestLayout.for_device(device_buffer.device))

    Computed on the buffer's device, on the current stream, without a host wait (see the notes).
    `buffer_bytes` is a contiguous 1-D uint8 tensor whose first byte is 8-byte aligned in its
    storage.  The last window, when shorter, is digested as if zero-padded to a full window.
    """
    _check_buffer(buffer_bytes)
    full_windows = buffer_bytes.numel() // layout.window_nbytes
    digests = torch.empty(layout.window_count(buffer_bytes.numel()), layout.digest_words,
                          dtype=torch.int64, device=buffer_bytes.device)
    full_bytes = full_windows * layout.window_nbytes
    _digest_full_windows(buffer_bytes[:full_bytes], layout, digests[:full_windows])
    if full_bytes < buffer_bytes.numel():
        _digest_partial_window(buffer_bytes[full_bytes:], layout, digests[full_windows:])
    return digests


def _check_buffer(buffer_bytes: torch.Tensor) -> None:
    if not isinstance(buffer_bytes, torch.Tensor):
        raise TypeError(f"expected a 1-D uint8 tensor, got {type(buffer_bytes).__name__}")
    if buffer_bytes.dtype != torch.uint8 or buffer_bytes.dim() != 1:
        raise TypeError(
            f"expected a 1-D uint8 tensor (the buffer's bytes), got a {buffer_bytes.dim()}-D "
            f"{buffer_bytes.dtype} tensor; pass tensor.view(torch.uint8).flatten() of the buffer"
        )
    if not buffer_bytes.is_contiguous():
        raise ValueError("the buffer's bytes must be contiguous (stride 1)")
    if buffer_bytes.storage_offset() % _WORD:
        raise ValueError(
            f"the buffer's first byte must be 8-byte aligned in its storage (storage offset "
            f"{buffer_bytes.storage_offset()}): digests count int64 words from it"
        )


def _digest_full_windows(
    window_bytes: torch.Tensor, layout: DigestLayout, out: torch.Tensor
) -> None:
    """Row and column sums of whole windows into `out`: on a CPU, one call of the one-pass
    kernel where it is built; else `_windows_per_call` windows per pair of torch reductions (two
    calls for all of them, or two per window on a one-thread CPU)."""
    if window_bytes.numel() == 0:
        return
    matrices = window_bytes.view(torch.int64).view(-1, layout.rows, layout.columns)
    one_pass = one_pass_sums() if window_bytes.device.type == "cpu" else None
    if one_pass is not None:
        one_pass(matrices, out)  # one call, each word read once
        return
    per_call = _windows_per_call(window_bytes.device, matrices.shape[0])
    batches = zip(matrices.split(per_call), out[:, : layout.rows].split(per_call),
                  out[:, layout.rows :].split(per_call))
    for batch, row_sums, column_sums in batches:
        torch.sum(batch, dim=2, out=row_sums)     # reads the windows from memory
        torch.sum(batch, dim=1, out=column_sums)  # one window: reads it again from the cache


def _windows_per_call(device: torch.device, window_count: int) -> int:
    """Windows per pair of reductions: one on a CPU whose intra-op pool has one thread (the second
    sum reads the window from the cache, and no call opens a parallel region); all of them
    otherwise: two calls per buffer (see [Note: the cost, and why rows and columns]).

        _windows_per_call(torch.device("cpu"), 466)   # 1 under torch.set_num_threads(1), else 466
    """
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return 1
    return max(window_count, 1)


def _digest_partial_window(tail: torch.Tensor, layout: DigestLayout, out: torch.Tensor) -> None:
    """The last, shorter window, digested as if zero-padded to a full window: the rows it fills
    are summed (the last one zero-padded when partial); the missing rows' sums are 0, and they
    add nothing to the column sums.  A small buffer (a layer-mode block's bias) then costs its
    own bytes, not a window's."""
    row_nbytes = _WORD * layout.columns
    rows = -(-tail.numel() // row_nbytes)
    if tail.numel() == rows * row_nbytes:
        matrix = tail.view(torch.int64).view(rows, layout.columns)
    else:
        padded = torch.zeros(rows * row_nbytes, dtype=torch.uint8, device=tail.device)
        padded[: tail.numel()].copy_(tail)
        matrix = padded.view(torch.int64).view(rows, layout.columns)
    torch.sum(matrix, dim=1, out=out[0, :rows])
    out[0, rows : layout.rows].zero_()
    torch.sum(matrix, dim=0, out=out[0, layout.rows :])


class ChangeDetector:
    """The digests of one device byte buffer as loaded, and which windows differ from them now.

        detector = ChangeDetector()
        detector.remember(device_buffer)            # at every load, after the copy
        detector.changed_windows(device_buffer)      # [(0, 1048576), (5242880, ...)]
        detector.take_changes(device_buffer)         # at eviction: the same, and forget

    The reference is what `remember` saw last: the bytes as loaded, not as packed (the host master
    may have been edited while offloaded).  It lives on the buffer's device,
    ``(rows + columns) * 8`` bytes per window; no reference to the buffer itself is kept (so
    `DeviceStorage`'s alias check is unaffected).  `layout` defaults to `DigestLayout.for_device`
    of the first buffer remembered.  Not thread-safe: it has one owner (a group).
    """

    def __init__(self, layout: DigestLayout | None = None) -> None:
        self._layout = layout
        #: int64 ``(windows, digest words)`` on the device, or None before the first `remember`.
        self._reference: torch.Tensor | None = None
        self._nbytes = 0

    @property
    def layout(self) -> DigestLayout | None:
        return self._layout

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer remembered (0 before `remember`)."""
        return self._nbytes

    def remember(self, buffer_bytes: torch.Tensor) -> None:
        """Take `buffer_bytes` as they are now as the reference (queues kernels; no host wait)."""
        _check_buffer(buffer_bytes)
        if self._layout is None:
            self._layout = DigestLayout.for_device(buffer_bytes.device)
        self._reference = window_digests(buffer_bytes, self._layout)
        self._nbytes = buffer_bytes.numel()

    def forget(self) -> None:
        """Drop the reference (the buffer was evicted or re-packed); its device memory is freed."""
        self._reference = None
        self._nbytes = 0

    def changed_flags(self, buffer_bytes: torch.Tensor) -> torch.Tensor:
        """One bool per window, on the device: whether its digest differs from the reference.

        Queues kernels only; reading the result is the caller's host wait.
        """
        reference = self._require_reference(buffer_bytes)
        current = window_digests(buffer_bytes, self._layout)
        return (current != reference).any(dim=1)

    def changed_windows(self, buffer_bytes: torch.Tensor) -> list[tuple[int, int]]:
        """Byte ranges ``(start, end)`` of the changed windows, adjacent ones merged, in order.

        Waits once for the device (see [Note: streams and the one host wait]).  An unchanged
        buffer gives ``[]``; the last range ends at the buffer's length.
        """
        flags = self.changed_flags(buffer_bytes).tolist()
        return _merged_ranges(flags, self._layout.window_nbytes, self._nbytes)

    def take_changes(self, buffer_bytes: torch.Tensor) -> list[tuple[int, int]]:
        """`changed_windows`, then `forget`: an eviction's one question, after which the reference
        has no use.  Asked with nothing remembered (the eviction that forgot was interrupted
        before it ended, and runs again), every byte counts as changed.

            written = write_back(detector.take_changes(device_buffer))   # at eviction
        """
        if self._reference is None:
            _check_buffer(buffer_bytes)
            return [(0, buffer_bytes.numel())] if buffer_bytes.numel() else []
        changed = self.changed_windows(buffer_bytes)
        self.forget()
        return changed

    def _require_reference(self, buffer_bytes: torch.Tensor) -> torch.Tensor:
        if self._reference is None:
            raise RuntimeError(
                "ChangeDetector: call remember(buffer) after a load before asking what changed"
            )
        _check_buffer(buffer_bytes)
        if buffer_bytes.numel() != self._nbytes or buffer_bytes.device != self._reference.device:
            raise ValueError(
                f"ChangeDetector remembered {self._nbytes} bytes on {self._reference.device}, got "
                f"{buffer_bytes.numel()} bytes on {buffer_bytes.device}: remember() the new buffer"
            )
        return self._reference

    def __repr__(self) -> str:
        if self._reference is None:
            return f"<ChangeDetector {self._layout}: nothing remembered>"
        windows = self._reference.shape[0]
        return (f"<ChangeDetector {self._layout}: {self._nbytes} bytes in {windows} windows "
                f"remembered on {self._reference.device}>")


def _merged_ranges(flags: list[bool], window_nbytes: int, nbytes: int) -> list[tuple[int, int]]:
    """Runs of True flags as byte ranges, the last one clipped to `nbytes`."""
    ranges: list[tuple[int, int]] = []
    for index, changed in enumerate(flags):
        if not changed:
            continue
        start, end = index * window_nbytes, min((index + 1) * window_nbytes, nbytes)
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    return ranges
