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
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import re
import stat
import threading
from collections.abc import Iterable, Sequence

import attrs
import torch

from residency.engine.errors import WeightFileError

__all__ = [
    "FileReader", "FileSource", "PIECE_NBYTES", "READ_THREADS", "find_file_sources", "replaced",
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
        with open("/proc/self/maps") as maps:
            found = _Finder(_MAPS_LINE.findall(maps.read()))
        try:
            return [found.source(storage, first, length)
                    for (storage, first), length in zip(sources, nbytes)]
        finally:
            found.close()
    except OSError:
        return [None] * len(nbytes)


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
        if nbytes <= 0 or storage.device.type != "cpu":
            return None
        address = storage.data_ptr() + first
        mapping = self._mapping_of(address, nbytes)
        if mapping is None:
            return None
        offset = mapping.file_offset + (address - mapping.start)
        key = (mapping.path, mapping.device, mapping.inode)
        if key not in self._identities:
            self._identities[key] = _identity(mapping)
        identity = self._identities[key]
        if identity is None or identity["size"] < offset + nbytes:
            return None
        if _written(self._pagemap_descriptor(), address, nbytes):
            return None
        return FileSource(path=mapping.path, offset=offset, **identity)

    def close(self) -> None:
        if self._pagemap is not None:
            os.close(self._pagemap)

    def _pagemap_descriptor(self) -> int:
        if self._pagemap is None:
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        return self._pagemap

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
    problem = _changed(source, os.fstat(file.fileno()))
    if problem is not None:
        file.close()
        raise WeightFileError(
            f"{source.path}: {problem} since the pipeline was loaded from it, so it no longer "
            "holds the tensors' bytes. Keep weight files unchanged until offloading is enabled, "
            "or load the pipeline again from the folder; the weights keep their values"
        )
    return file


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
        f"truncated while offloading was enabled (it had {piece.source.size} bytes). Restore "
        "the file (download it again) and load the pipeline again; the weights keep their values"
    )


def _read_failed(piece: _Piece, error: OSError) -> WeightFileError:
    failure = WeightFileError(
        f"{piece.source.path}: reading the tensor bytes [{piece.file_offset}, "
        f"{piece.file_offset + piece.nbytes}) of the weight file failed ({error}). Check the "
        "disk or file system and load the pipeline again; the weights keep their values"
    )
    failure.__cause__ = error
    return failure
