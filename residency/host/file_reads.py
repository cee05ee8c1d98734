"""Reading a master's bytes straight from the weight files its tensors are mapped from.

`find_file_sources` tells, per region of an inventory, whether its bytes are still exactly a
range of a file the process has mapped (a safetensors file that ``from_pretrained`` mapped and
left the parameters as views of), and where: a `FileSource`, or None.

    sources = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)

[Note: which mapped bytes are still the file's]
``from_pretrained`` (diffusers, transformers) leaves parameters as views of a private
(``MAP_PRIVATE``) mapping of the safetensors file.  A page of such a mapping is in one of three
states, which /proc/self/pagemap tells (one 64-bit entry per page):

- not present (bit 63 clear, bit 62 clear): never touched, or touched only for reading and since
  reclaimed; reading it gives the file's bytes;
- present and file-backed (bit 63 set, bit 61 set): the page cache's page, mapped for reading;
  the file's bytes;
- present and anonymous (bit 63 set, bit 61 clear), or swapped (bit 62 set; only anonymous pages
  of a private mapping are swapped): a copy-on-write copy the process made by writing the page.
  Its bytes are the process's, no longer the file's.

A region is the file's only if no page it touches was ever written.  An edit made before
registration (``param.data.mul_(2)`` on the mapped tensor, a LoRA merged in place) leaves
copy-on-write pages, so that region reads as None and is copied from memory, edit included:
reading the file there would silently undo the edit.  Anything this cannot prove (anonymous or
device memory, a file replaced or gone since it was mapped, /proc unreadable) is None too: the
memory copy is always right, the file read only faster.

`FileReader` reads such ranges into a host chunk on a few threads ("residency-read"), where
`HostMaster.pack` would otherwise copy them from the mapping (which faults every page in, on one
thread):

    with FileReader() as reader:
        reader.start(chunk, [(source, offset_in_chunk, nbytes), ...])
        ...                   # copy the other regions meanwhile
        reader.finish()       # waits; a failed read raises WeightFileError naming the file

[Note: the reader's threads and the chunk's lifetime]
A read writes into the chunk through a memoryview of it (``chunk.numpy()``), which holds a
reference to the chunk's tensor: the memory a thread writes into cannot be freed under it, whatever
the caller does.  The caller's rule is stronger: no thread writes into a chunk once the call that
started the reads has returned or raised.  `finish` and `close` join every thread they started,
and keep joining when a KeyboardInterrupt lands while they wait (the interrupt is re-raised once
the threads are gone; the stop flag makes the threads quit after the piece in flight, so the wait
is at most one piece of `PIECE_NBYTES` per thread).  An interrupt that lands in the caller before
``finish`` is reached leaves the ``with`` block, whose exit is `close`.  Files are opened on the
caller's thread, checked against their `FileSource` identity there (a refused `start` started
nothing), and closed after the threads are joined.

[Note: a mapping whose file was cut short]
A tensor that views a file mapping reads the file's pages, so it is only as good as the file:

- a file *truncated* under a mapping (``os.truncate``, ``cp`` over it, an editor saving in
  place) takes every page past its new end with it: touching one raises SIGBUS, which kills the
  process.  Private copy-on-write pages go too (the kernel drops them with the file's pages
  when it truncates), so an edit made there is lost as well.  The page that holds the new end
  reads as zeros past it, without a fault;
- a file *replaced* at its path (``os.replace``, a download renamed into place) or deleted
  leaves the mapping on the old file, which keeps every byte it had: nothing faults.

`find_mapped_regions` tells, per region, which file mapping it lies in (written pages or not)
and how many of its first bytes can be read now: the file's size now (``os.stat``, while the
path still names the mapped file) less the region's offset in it.  When the path names another
file, or none, the old file's end is probed instead through /proc/self/mem, where a read of a
page that would fault fails with EIO rather than killing the process (a bisection over the
region's pages); the page before the first unreadable one counts as unreadable too, since its
bytes past the unknown end read as zeros, not as the weights.  `copy_mapped` copies a region's
readable bytes the same way, so a file cut shorter during the copy ends the copy, not the
process; `find_loss` says which tensors lie past the readable bytes.  What this cannot see: a
file rewritten in place at its old size (its untouched pages then read the new bytes, as the
plain pipeline's tensors would), and a disk that fails to read a page inside the file.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import operator
import os
import re
import stat
import threading
from collections.abc import Iterable, Sequence

import attrs
import torch

from residency.core.errors import WeightFileError

__all__ = [
    "FileReader", "FileSource", "Loss", "MappedRegion", "PIECE_NBYTES", "READ_THREADS",
    "copy_mapped", "find_file_sources", "find_loss", "find_mapped_regions", "look_up_files",
    "replaced", "tensor_end",
]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61


@attrs.frozen(kw_only=True)
class FileSource:
    """A region's bytes as a range of the file at ``path``, from ``offset``; the file identified
    as it was when found (``os.stat``), so a reader can tell it was replaced or truncated since.

        FileSource(path="/models/wan/transformer/x.safetensors", offset=4096, device=2049,
                   inode=131, size=9_000_000_000, mtime_ns=1_700_000_000_000_000_000)

    ``size`` is the whole file's size, not the region's (the region's length is the layout's).
    """

    #: The file's path as /proc/self/maps names it.
    path: str
    #: The file's byte offset of the region's first byte.
    offset: int
    #: ``st_dev``, ``st_ino``, ``st_size`` and ``st_mtime_ns`` of the file when it was found.
    device: int
    inode: int
    size: int
    mtime_ns: int


@attrs.frozen
class _Mapping:
    """A file mapping of /proc/self/maps (adjacent lines of one file joined)."""

    start: int
    end: int
    file_offset: int
    device: tuple[int, int]  # (major, minor)
    inode: int
    path: str


#: An address range, as /proc/self/map_files names each file mapping.
_RANGE = re.compile(r"([0-9a-f]+)-([0-9a-f]+)")

#: A readable file mapping's line of /proc/self/maps: start, end, offset, major, minor, inode
#: (non-zero), path.
_MAPS_LINE = re.compile(
    r"^([0-9a-f]+)-([0-9a-f]+) r\S* ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) ([1-9][0-9]*) +(/.*)$",
    re.MULTILINE,
)


def find_file_sources(
    sources: Sequence[tuple[torch.UntypedStorage, int]], nbytes: Sequence[int]
) -> list[FileSource | None]:
    """Per region (``sources[i]``: its storage and first byte; ``nbytes[i]``: its length), the
    file range its bytes still are, or None (see [Note: which mapped bytes are still the file's]).

        sources = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
    """
    try:
        found = _file_mappings(sources)
    except OSError:
        return [None] * len(nbytes)
    try:
        return _sources_in(found, sources, nbytes)
    finally:
        found.close()


def _file_mappings(sources: Sequence[tuple[torch.UntypedStorage, int] | None]) -> _Finder:
    """The file mappings of /proc/self/maps, or none when no host region of `sources` starts in
    one: the names of /proc/self/map_files (every file mapping's address range, no more) are
    read first, in a fifth of the time the maps' lines take to parse, and a pack of a model in
    plain memory (every registration that loaded no mapped file) stops there."""
    regions = [*filter(None, sources)]
    if regions:  # (a device pointer among them at worst makes the maps parsed: `mapping_at`)
        storages, firsts = zip(*regions)
        if not _any_in_a_file_mapping([*map(operator.add, map(torch.UntypedStorage.data_ptr,
                                                              storages), firsts)]):
            return _Finder([])
    with open("/proc/self/maps") as maps:
        return _Finder(_MAPS_LINE.findall(maps.read()))


def _any_in_a_file_mapping(addresses: list[int]) -> bool:
    """Whether an address lies in a file mapping (True when /proc/self/map_files cannot say).
    Parsed and searched in C (`map`, `bisect`): hundreds of mappings cost no Python line each."""
    try:
        names = os.listdir("/proc/self/map_files")
    except OSError:
        return True
    bounds = _RANGE.findall(" ".join(names))
    if not bounds:  # every process maps files (its interpreter, libc): this listing says nothing
        return True
    firsts, lasts = zip(*bounds)
    ranges = sorted(zip(map(int, firsts, itertools.repeat(16)),
                        map(int, lasts, itertools.repeat(16))))
    starts, ends = zip(*((-1, -1), *ranges))  # a sentinel below every address: no index -1
    found = map(bisect.bisect_right, itertools.repeat(starts), addresses)
    return any(map(operator.lt, addresses, map(ends.__getitem__, map(operator.add, found,
                                                                        itertools.repeat(-1)))))


class _Finder:
    """One call's look-ups: the file mappings (columns parsed in C: a pack of a model in plain
    memory pays per region, not per line of the maps), the pagemap (opened when first needed),
    each file's stat identity once."""

    def __init__(self, rows: list[tuple[str, ...]]) -> None:
        columns = list(zip(*rows)) or [()] * 7
        self._starts = list(map(int, columns[0], itertools.repeat(16)))
        self._ends = list(map(int, columns[1], itertools.repeat(16)))
        self._rows = rows
        self._pagemap: int | None = None
        self._identities: dict[tuple, dict | None] = {}

    def source(self, storage: torch.UntypedStorage, first: int, nbytes: int) -> FileSource | None:
        found = self.mapping_at(storage, first, nbytes)
        if found is None:
            return None
        mapping, offset = found
        key = (mapping.path, mapping.device, mapping.inode)
        if key not in self._identities:
            self._identities[key] = _identity(mapping)
        identity = self._identities[key]
        if identity is None or identity["size"] < offset + nbytes:
            return None
        if _written(self._pagemap_descriptor(), storage.data_ptr() + first, nbytes):
            return None
        return FileSource(path=mapping.path, offset=offset, **identity)

    def close(self) -> None:
        if self._pagemap is not None:
            os.close(self._pagemap)

    def _pagemap_descriptor(self) -> int:
        if self._pagemap is None:
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        return self._pagemap

    def mapping_at(self, storage: torch.UntypedStorage, first: int, nbytes: int
                   ) -> tuple[_Mapping, int] | None:
        """The file mapping that holds a region's bytes (written pages or not), and the file
        offset of its first byte; None for memory that is no file's."""
        if nbytes <= 0 or storage.device.type != "cpu":
            return None
        address = storage.data_ptr() + first
        mapping = self._mapping_of(address, nbytes)
        if mapping is None:
            return None
        return mapping, mapping.file_offset + (address - mapping.start)

    def _mapping_of(self, address: int, nbytes: int) -> _Mapping | None:
        """The file mapping holding ``[address, address + nbytes)``, lines that continue it
        (the same file, contiguous addresses and offsets) joined; or None."""
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0 or address >= self._ends[index]:
            return None
        mapping = _mapping(self._rows[index])
        while address + nbytes > mapping.end and index + 1 < len(self._rows):
            index += 1
            following = _mapping(self._rows[index])
            if not _continues(mapping, following):
                return None
            mapping = attrs.evolve(mapping, end=following.end)
        return mapping if address + nbytes <= mapping.end else None


def _identity(mapping: _Mapping) -> dict | None:
    """The file's stat identity, if the path still names the mapped file; else None (replaced,
    deleted, not a regular file)."""
    try:
        info = os.stat(mapping.path)
    except OSError:
        return None
    same = (os.major(info.st_dev), os.minor(info.st_dev)) == mapping.device
    if not (stat.S_ISREG(info.st_mode) and same and info.st_ino == mapping.inode):
        return None
    return {"device": info.st_dev, "inode": info.st_ino, "size": info.st_size,
            "mtime_ns": info.st_mtime_ns}


def _written(pagemap: int, address: int, nbytes: int) -> bool:
    """Whether any page of ``[address, address + nbytes)`` is a private copy the process wrote
    (present and anonymous, or swapped)."""
    first_page, last_page = address // _PAGE, (address + nbytes - 1) // _PAGE
    count = last_page - first_page + 1
    data = os.pread(pagemap, 8 * count, 8 * first_page)
    if len(data) != 8 * count:
        return True  # cannot tell: treat as written (the memory copy is always right)
    entries = torch.frombuffer(bytearray(data), dtype=torch.int64)
    present = entries < 0  # bit 63
    swapped = (entries >> 62) & 1 == 1
    file_page = (entries >> 61) & 1 == 1
    return bool(((present & ~file_page) | swapped).any())


def _mapping(row: tuple[str, ...]) -> _Mapping:
    start, end, offset, major, minor, inode, path = row
    return _Mapping(int(start, 16), int(end, 16), int(offset, 16), (int(major, 16),
                    int(minor, 16)), int(inode), path)


def _continues(last: _Mapping, mapping: _Mapping) -> bool:
    return (
        last.end == mapping.start
        and (last.device, last.inode, last.path) == (mapping.device, mapping.inode, mapping.path)
        and last.file_offset + (last.end - last.start) == mapping.file_offset
    )


# -- what of a mapping can still be read (see [Note: a mapping whose file was cut short]) ------


@attrs.frozen(kw_only=True)
class MappedRegion:
    """A region whose bytes lie in a file mapping (written pages or not), and how many of its
    first bytes can be read now without a fault.

        found = find_mapped_regions(sources, layout.region_nbytes)[region]   # None: no file's
        if found is not None and found.readable < layout.region_nbytes[region]:
            ...   # the file was cut short under the region: the rest is gone
    """

    #: The mapped file's path, as /proc/self/maps names it.
    path: str
    #: The file offset of the region's first byte.
    offset: int
    #: The file's size now; None when its path no longer names the mapped file (replaced or
    #: deleted: the mapping's end was probed instead).
    size: int | None
    #: How many of the region's first bytes can be read now (all of them unless the file was
    #: cut short under the region).
    readable: int


def find_mapped_regions(
    sources: Sequence[tuple[torch.UntypedStorage, int] | None], nbytes: Sequence[int]
) -> list[MappedRegion | None]:
    """Per region (``sources[i]``: its storage and first byte, or None; ``nbytes[i]``: its
    length), the file mapping it lies in and how much of it can be read now, or None for memory
    that is no file's (see [Note: a mapping whose file was cut short]).  Reads no tensor byte.

        cut = [r for r, m in enumerate(find_mapped_regions(sources, sizes))
               if m is not None and m.readable < sizes[r]]
    """
    try:
        found = _file_mappings(sources)
    except OSError:
        return [None] * len(nbytes)
    return _regions_in(found, sources, nbytes)


def look_up_files(
    sources: Sequence[tuple[torch.UntypedStorage, int]], nbytes: Sequence[int]
) -> tuple[list[MappedRegion | None], list[FileSource | None]]:
    """`find_mapped_regions` and `find_file_sources` of the same regions from one look at the
    process's mappings (a pack asks both: is a file cut short under a region, and which regions
    can be read from their files).

        mapped, files = look_up_files(inventory.source_regions, inventory.layout.region_nbytes)
    """
    try:
        found = _file_mappings(sources)
    except OSError:
        return [None] * len(nbytes), [None] * len(nbytes)
    try:
        return _regions_in(found, sources, nbytes), _sources_in(found, sources, nbytes)
    finally:
        found.close()


def _sources_in(found: _Finder, sources, nbytes) -> list[FileSource | None]:
    """Each region's `FileSource` in the mappings `found` (all None when one cannot be read)."""
    try:
        return [found.source(storage, first, length)
                for (storage, first), length in zip(sources, nbytes)]
    except OSError:
        return [None] * len(nbytes)


def _regions_in(found: _Finder, sources, nbytes) -> list[MappedRegion | None]:
    """Each region's `MappedRegion` in the mappings `found` (None: no file's, or no region)."""
    sizes: dict[tuple, int | None] = {}
    return [None if source is None else _mapped_region(found, *source, length, sizes)
            for source, length in zip(sources, nbytes)]


def _mapped_region(found: _Finder, storage: torch.UntypedStorage, first: int, nbytes: int,
                   sizes: dict) -> MappedRegion | None:
    at = found.mapping_at(storage, first, nbytes)
    if at is None:
        return None
    mapping, offset = at
    key = (mapping.path, mapping.device, mapping.inode)
    if key not in sizes:
        identity = _identity(mapping)
        sizes[key] = None if identity is None else identity["size"]
    size = sizes[key]
    if size is None:
        readable = _readable_prefix(storage.data_ptr() + first, nbytes)
    else:
        readable = min(max(size - offset, 0), nbytes)
    return MappedRegion(path=mapping.path, offset=offset, size=size, readable=readable)


def _readable_prefix(address: int, nbytes: int) -> int:
    """How many of the first bytes of ``[address, address + nbytes)`` lie before its first page
    that faults, less the page before it (see the note); `nbytes` when /proc/self/mem cannot
    be read (nothing can tell: as before)."""
    try:
        mem = open("/proc/self/mem", "rb", buffering=0)
    except OSError:
        return nbytes
    with mem:
        if _can_read(mem.fileno(), address + nbytes - 1):
            return nbytes
        low, high = address // _PAGE, (address + nbytes - 1) // _PAGE  # high faults
        while low < high:  # the first page that faults
            middle = (low + high) // 2
            if _can_read(mem.fileno(), max(middle * _PAGE, address)):
                low = middle + 1
            else:
                high = middle
    return max((high - 1) * _PAGE - address, 0)


def _can_read(mem: int, address: int) -> bool:
    try:
        return len(os.pread(mem, 1, address)) == 1
    except OSError:
        return False


def copy_mapped(source: tuple[torch.UntypedStorage, int], nbytes: int,
                into: torch.Tensor) -> int:
    """Copy the first `nbytes` of region `source` (its storage and first byte) into `into` (a
    uint8 host tensor) through /proc/self/mem: a page that faults ends the copy, not the
    process.  Returns the bytes copied (`nbytes` unless the mapping's file ends sooner now).

        copied = copy_mapped(sources[region], found.readable, buffer)
    """
    storage, first = source
    target = memoryview(into.numpy())[:nbytes]
    try:
        mem = open("/proc/self/mem", "rb", buffering=0)
    except OSError:  # cannot ask: a plain copy, bounded by the file's size found just before
        source_bytes = torch.empty(0, dtype=torch.uint8)
        source_bytes.set_(storage, first, (nbytes,))
        into[:nbytes].copy_(source_bytes)
        return nbytes
    done, address = 0, storage.data_ptr() + first
    with mem:
        while done < nbytes:
            try:
                count = os.preadv(mem.fileno(), [target[done:]], address + done)
            except OSError:  # EIO: the page at `done` faults
                break
            if count == 0:
                break
            done += count
    return done


def tensor_end(place) -> int:
    """The byte just past a tensor's last element, from its region's first byte (a
    `residency.modules.tensors.TensorPlace`); its offset when it has no element."""
    if 0 in place.size:
        return place.byte_offset
    span = 1 + sum((size - 1) * stride for size, stride in zip(place.size, place.stride))
    return place.byte_offset + span * place.dtype.itemsize


@attrs.frozen(kw_only=True)
class Loss:
    """What a weight file cut short took from a set of tensors (an inventory): the tensors
    that lie, whole or in part, past their region's readable bytes, in words for a message.

        loss = find_loss(inventory, inventory.source_regions)
        if loss is not None:
            raise WeightFileError(f"{loss.files} since ...: {loss.tensors} lie past ...")
    """

    #: Indices (inventory order) of the tensors past their region's readable bytes.
    lost: tuple[int, ...]
    #: The files cut short, in words: "the weight file P was truncated to N bytes (it had M
    #: bytes when the pipeline was loaded)", joined with "and".
    files: str
    #: The lost tensors, in words: "3 of the 12 tensors (6144 bytes: 'a', 'b' and 'c')".
    tensors: str


def find_loss(inventory, found: Sequence[MappedRegion | None], *,
              readable: dict[int, int] | None = None,
              known: Sequence[FileSource | None] = ()) -> Loss | None:
    """The `Loss` of `inventory` (a `residency.modules.tensors.Inventory`) whose regions lie in
    the mappings `found` (`find_mapped_regions` of its regions), or None when each region that
    views a mapping can be read whole.  `readable`: what a copy got of some regions (it
    overrides the mapping's readable bytes); `known`: each region's `FileSource` found earlier
    (the file's size then, for the message).

        loss = find_loss(inventory, find_mapped_regions(sources, layout.region_nbytes))
    """
    sizes, readable = inventory.layout.region_nbytes, readable or {}
    ends = {r: readable.get(r, m.readable) for r, m in enumerate(found) if m is not None}
    cut = {r: found[r] for r, end in ends.items() if end < sizes[r]}
    if not cut:
        return None
    lost = tuple(i for i, place in enumerate(inventory.places)
                 if place.region in cut and tensor_end(place) > ends[place.region])
    return Loss(lost=lost, files=_cut_files(cut.values(), known),
                tensors=_lost_tensors(inventory, lost))


def _cut_files(cut, known: Sequence[FileSource | None]) -> str:
    """The files cut short, in words (see `Loss.files`)."""
    sizes_then = {source.path: source.size for source in known if source is not None}
    words = []
    for found in {m.path: m for m in cut}.values():
        then = sizes_then.get(found.path)
        had = "" if then is None else f" (it had {then} bytes when the pipeline was loaded)"
        if found.size is None:
            words.append(f"the weight file {found.path} (no longer at that path) was cut short")
        else:
            words.append(f"the weight file {found.path} was truncated to {found.size} bytes{had}")
    return " and ".join(words)


def _lost_tensors(inventory, lost: Sequence[int]) -> str:
    """The lost tensors, in words (see `Loss.tensors`): their count, bytes and first names."""
    names = _tensor_names(inventory)
    nbytes = sum(inventory.places[i].dtype.itemsize * math.prod(inventory.places[i].size)
                 for i in lost)
    shown = [repr(names[i]) for i in lost[:3]]
    more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
    listed = (", ".join(shown) + more) if more or len(shown) < 2 else (
        ", ".join(shown[:-1]) + f" and {shown[-1]}")
    return f"{len(lost)} of the {inventory.tensor_count} tensors ({nbytes} bytes: {listed})"


def _tensor_names(inventory) -> list[str]:
    """Each tensor's name in its module (``blocks.0.attn1.to_q.weight``), else its slot's."""
    names: dict[int, str] = {}
    for module in inventory.modules:
        for name, tensor in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(tensor), name)
    return [names.get(id(tensor), slots[0].describe())
            for tensor, slots in zip(inventory.tensors, inventory.slots)]


#: The largest read one call asks for: bounds the wait for reads in flight after a stop.
PIECE_NBYTES = 32 * 2**20
#: Threads reading one chunk's ranges.
READ_THREADS = 4


@attrs.frozen
class _Piece:
    """Read ``nbytes`` of the file at ``source`` from ``file_offset`` to ``chunk_offset``."""

    source: FileSource
    file_offset: int
    chunk_offset: int
    nbytes: int


class FileReader:
    """Reads file ranges into host chunks on `threads` threads, in pieces of at most
    `piece_nbytes`, one chunk at a time (see [Note: the reader's threads and the chunk's
    lifetime]).

        with FileReader() as reader:
            reader.start(chunk, [(source, offset_in_chunk, nbytes)])
            reader.finish()

    A file replaced or truncated since its `FileSource` was found, or a read that fails, raises
    `WeightFileError` naming the file; never are other bytes read in its place.
    """

    def __init__(self, threads: int = READ_THREADS, piece_nbytes: int = PIECE_NBYTES) -> None:
        self._thread_count = threads
        self._piece_nbytes = piece_nbytes
        self._batch: _Batch | None = None

    def start(self, chunk: torch.Tensor, reads: Iterable[tuple[FileSource, int, int]]) -> None:
        """Begin reading each ``(source, offset in chunk, nbytes)`` into `chunk` (a uint8 host
        tensor); returns at once.  Files are opened and checked first: a refused start reads
        nothing."""
        assert self._batch is None, "finish() the chunk before starting the next"
        reads = [read for read in reads if read[2] > 0]
        if not reads:
            return
        files = _open_files({source for source, _, _ in reads})
        batch = _Batch(chunk, files, _pieces(reads, self._piece_nbytes))
        self._batch = batch
        batch.spawn(self._thread_count)

    def finish(self) -> None:
        """Wait for the reads `start` began; raise the first failure as `WeightFileError`."""
        batch = self._batch
        if batch is None:
            return
        batch.join()
        self._batch = None
        batch.close_files()
        batch.raise_failure()

    def close(self) -> None:
        """Stop and join any reads in flight (their chunk is abandoned); idempotent."""
        batch = self._batch
        if batch is not None:
            batch.stop.set()
            batch.join()
            self._batch = None
            batch.close_files()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _Batch:
    """One chunk's reads: the pieces left, the threads taking them, the first failure."""

    def __init__(self, chunk: torch.Tensor, files: dict, pieces: list[_Piece]) -> None:
        self.memory = memoryview(chunk.numpy())  # holds the chunk: see the note
        self.files = files
        self.pieces = collections.deque(pieces)
        self.stop = threading.Event()
        self.failures: list[WeightFileError] = []
        self.threads: list[threading.Thread] = []

    def spawn(self, count: int) -> None:
        for _ in range(min(count, len(self.pieces))):
            thread = threading.Thread(target=self._run, name="residency-read", daemon=True)
            self.threads.append(thread)  # before start: join() skips one never started
            thread.start()

    def join(self) -> None:
        """Join every started thread, even through KeyboardInterrupts (re-raised after)."""
        interrupted: KeyboardInterrupt | None = None
        for thread in self.threads:
            while thread.ident is not None and thread.is_alive():
                try:
                    thread.join()
                except KeyboardInterrupt as error:
                    interrupted = error
                    self.stop.set()
        if interrupted is not None:
            raise interrupted

    def close_files(self) -> None:
        for file in self.files.values():
            file.close()

    def raise_failure(self) -> None:
        if self.failures:
            raise self.failures[0]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                piece = self.pieces.popleft()
            except IndexError:
                return
            try:
                self._read(piece)
            except WeightFileError as error:
                self.failures.append(error)
                self.stop.set()
            except OSError as error:
                self.failures.append(_read_failed(piece, error))
                self.stop.set()

    def _read(self, piece: _Piece) -> None:
        descriptor = self.files[_file_key(piece.source)].fileno()
        target = self.memory[piece.chunk_offset : piece.chunk_offset + piece.nbytes]
        done = 0
        while done < piece.nbytes:
            count = os.preadv(descriptor, [target[done:]], piece.file_offset + done)
            if count == 0:
                raise _truncated_while_reading(piece, piece.file_offset + done)
            done += count


def _pieces(reads: list[tuple[FileSource, int, int]], most: int) -> list[_Piece]:
    """The reads cut into pieces of at most `most` bytes, in file order (sequential on disk)."""
    pieces = []
    for source, chunk_offset, nbytes in reads:
        for start in range(0, nbytes, most):
            length = min(most, nbytes - start)
            pieces.append(_Piece(source, source.offset + start, chunk_offset + start, length))
    pieces.sort(key=lambda piece: (piece.source.path, piece.file_offset))
    return pieces


def _file_key(source: FileSource) -> tuple[str, int, int]:
    return (source.path, source.device, source.inode)


def _open_files(sources: set[FileSource]) -> dict:
    """Each distinct file, opened and checked against its identity; on a refusal the files
    opened so far are closed."""
    files: dict = {}
    try:
        for source in sources:
            key = _file_key(source)
            if key not in files:
                files[key] = _open_checked(source)
    except BaseException:
        for file in files.values():
            file.close()
        raise
    return files


def _open_checked(source: FileSource):
    try:
        file = open(source.path, "rb", buffering=0)
    except OSError as error:
        raise WeightFileError(
            f"{source.path}: cannot open the weight file the tensors were loaded from ({error}); "
            "it was moved or deleted since the pipeline was loaded. Keep the model folder in "
            "place until offloading is enabled, or load the pipeline again; the weights keep "
            "their values"
        ) from error
    info = os.fstat(file.fileno())
    problem = _changed(source, info)
    if problem is not None:
        file.close()
        raise WeightFileError(
            f"{source.path}: {problem} since the pipeline was loaded from it, so it no longer "
            "holds the tensors' bytes. Keep weight files unchanged until offloading is enabled, "
            f"or load the pipeline again from the folder; {_what_is_kept(source, info)}"
        )
    return file


def _what_is_kept(source: FileSource, info: os.stat_result) -> str:
    """The weights' fate when `source`'s file changed: a file replaced at its path leaves the
    mapping whole; one cut short takes the mapped bytes past its new end (see [Note: a mapping
    whose file was cut short])."""
    same_file = (info.st_dev, info.st_ino) == (source.device, source.inode)
    if same_file and info.st_size < source.size:
        return "the tensors past its new end are lost with it"
    return "the weights keep their values"


def replaced(source: FileSource) -> bool:
    """Whether `source`'s path no longer names the file it was found in (another file is there,
    or none): its mapping still holds the bytes it was loaded with, the path does not."""
    try:
        info = os.stat(source.path)
    except OSError:
        return True
    return (info.st_dev, info.st_ino) != (source.device, source.inode)


def _changed(source: FileSource, info: os.stat_result) -> str | None:
    if (info.st_dev, info.st_ino) != (source.device, source.inode):
        return "the weight file was replaced (another file is at its path now)"
    if info.st_size < source.size:
        return (f"the weight file was truncated ({info.st_size} bytes, was "
                f"{source.size} bytes)")
    if info.st_size != source.size:
        return f"the weight file changed size ({info.st_size} bytes, was {source.size} bytes)"
    return None


def _truncated_while_reading(piece: _Piece, at: int) -> WeightFileError:
    return WeightFileError(
        f"{piece.source.path}: the weight file ends at byte {at}, inside the tensor bytes "
        f"[{piece.file_offset}, {piece.file_offset + piece.nbytes}) being read: it was "
        f"truncated while offloading was enabled (it had {piece.source.size} bytes), and the "
        "tensors past its new end are lost with it. Restore the file (download it again) and "
        "load the pipeline again"
    )


def _read_failed(piece: _Piece, error: OSError) -> WeightFileError:
    failure = WeightFileError(
        f"{piece.source.path}: reading the tensor bytes [{piece.file_offset}, "
        f"{piece.file_offset + piece.nbytes}) of the weight file failed ({error}). Check the "
        "disk or file system and load the pipeline again; the weights keep their values"
    )
    failure.__cause__ = error
    return failure
