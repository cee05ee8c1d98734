"""The warm-restart cache: a group's packed host master as a file, mapped by a later start.

    key = group_key(inventory, alignment, file_sources)          # None: not cacheable (why logged)
    path = cache_path(directory, "transformer", key)
    mapped = map_master(path, key, inventory.layout)             # a hit: the chunks, mapped
    if mapped is None:
        master = ...pack as usual...
        write_master(path, key, inventory.layout, master.chunks) # False: not written (warned)

One file per group, in the master's final layout: a header page (magic, format version, the key,
each chunk's size and file offset), then the chunks, each at an offset that is a multiple of
4096.  A later start maps the file instead of copying every byte again: a repeat start is served
by the page cache at memory speed.  The file's name holds the group's name and the key's first
hex digits; `write_master` removes the group's files of other keys once the new one is in place.

[Note: the key]
A cached master may only stand in for the bytes packing would make, so the key is a SHA-256 over
everything that decides them: the format version and byte order; the alignment class of the
device (`residency.modules.tensors.Alignment`: where each region starts, and so every output bit);
the layout (chunk sizes, each region's chunk, offset and size); every tensor's place (region,
offset, size, stride, dtype) and the slots it is reachable from; and each region's source.  A
region read from a weight file that is still its untouched mapping is named by the file's
identity (`residency.host.file_reads.FileSource`: path, offset, device, inode, size, mtime):
rewriting or touching the file changes the key.  The few regions that are not file views (buffers
computed at construction, such as a transformer's rotary tables) are named by a SHA-256 of their
bytes, as long as they are at most `UNFILED_FRACTION` of the group's bytes; a group that is mostly
memory (edited, converted, built in code) is not cached, and the log says why.  The header
repeats the whole key, so a file renamed, or built for other files or another alignment class
under a colliding name, is a miss, never wrong weights.

[Note: why MAP_PRIVATE]
The master is written again while the session runs (an edit made while resident is written back
into it).  A private mapping takes those writes into copy-on-write pages of this process: the
edit is kept for the session and the cache file never changes, so the next start maps the bytes
the key names.  A file replaced by a later cache write is a new inode (`os.replace`), so pages of
a mapping already made never see another file's bytes.  The chunk bodies are not checksummed:
the file is trusted as the weight files are (a file is only ever complete under its final name).

[Note: writing a cache file]
The file is written under a temporary name ``<final>.<pid>-<random>.partial`` in the same
directory, its space reserved first (``posix_fallocate``: a full disk fails at once, not after
gigabytes), flushed (``fsync``) and renamed into place (``os.replace``, atomic), then the
directory is flushed.  Any OSError (ENOSPC, EDQUOT, EFBIG, a read-only file system) removes the
temporary file and warns once that the cache was not written and why; the run goes on with the
packed master.  An interrupt removes it too.  A process killed while writing leaves its temporary
file behind; the next write in that directory removes temporary files whose process is gone (a
process of another PID namespace sharing the directory may look gone: its write then fails,
warned, and nothing wrong is left).

[Note: page-locking a mapped master]
On CUDA the mapping is registered for DMA (``cudaHostRegister``), so copies to the device read
the mapped pages themselves, with no staging copy.  The registration is writable (the master is
written back into): the kernel then gives each page of the private mapping its own copy as it
pins it, once, at memory speed; a read-only registration would keep the page cache's pages, but
the first write-back would move the process's page away from the registered one and later copies
would read stale bytes.  The registration is dropped with the mapping, when the last chunk view
of it dies.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import struct
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from residency.device.page_lock import RegisteredMapping
from residency.modules.tensors import Alignment, Inventory, PackLayout

if TYPE_CHECKING:
    from residency.host.file_reads import FileSource

__all__ = [
    "FORMAT_VERSION",
    "MappedMaster",
    "UNFILED_FRACTION",
    "cache_path",
    "group_key",
    "map_master",
    "prepare_directory",
    "write_master",
]

_log = logging.getLogger("residency")

#: Bumped whenever the file format or the key's contents change: older files are then misses.
FORMAT_VERSION = 1
#: The first bytes of every cache file.
MAGIC = b"residency-master"
#: Chunks start at multiples of this in the file (a page: the mapping's chunks are page-aligned).
FILE_ALIGNMENT = 4096
#: A group is cached when the bytes of its regions that are not file views are at most this
#: fraction of its bytes (they are hashed into the key; see [Note: the key]).
UNFILED_FRACTION = 1 / 8
#: Cache files end so; temporary ones end in ``.partial``.
SUFFIX = ".master"
_PARTIAL = ".partial"
_PREFIX = struct.Struct("<16sII")  # magic, format version, header length
#: A header is read whole; a longer length field is damage, not a header to allocate for.
_HEADER_LIMIT = 64 << 20
#: os.write moves at most about 2 GiB per call on Linux; write in pieces of this many bytes.
_WRITE_PIECE = 1 << 30


def group_key(inventory: Inventory, alignment: Alignment,
              sources: Sequence[FileSource | None]) -> tuple[str | None, str]:
    """The cache key of `inventory`'s master on a device of `alignment` (see [Note: the key]),
    and why there is none when it is None.  `sources` are the regions' file sources
    (`residency.host.file_reads.find_file_sources`), read before packing.

        key, why = group_key(inventory, alignment_for(device), sources)
    """
    layout = inventory.layout
    unfiled = [r for r, source in enumerate(sources) if source is None]
    unfiled_nbytes = sum(layout.region_nbytes[r] for r in unfiled)
    if unfiled_nbytes > UNFILED_FRACTION * max(inventory.nbytes, 1):
        return None, (f"{unfiled_nbytes} of its {inventory.nbytes} bytes are not untouched views "
                      "of weight files (edited, converted or built in memory)")
    regions = inventory.source_regions
    if unfiled and (regions is None or any(regions[r][0].device.type != "cpu" for r in unfiled)):
        return None, "some of its tensors are not in host memory"
    digest = hashlib.sha256()
    _feed(digest, ["residency master", FORMAT_VERSION, sys.byteorder,
                   alignment.boundary, alignment.keep_source_offset])
    _feed(digest, [layout.chunk_nbytes, layout.region_chunk, layout.region_offset,
                   layout.region_nbytes, layout.boundary])
    for place, slots in zip(inventory.places, inventory.slots):
        _feed(digest, [place.region, place.byte_offset, place.size, place.stride,
                       str(place.dtype), [slot.describe() for slot in slots]])
    for region, source in enumerate(sources):
        if source is None:
            storage, first = regions[region]  # type: ignore[index]
            _feed(digest, ["bytes", _bytes_digest(storage, first, layout.region_nbytes[region])])
        else:
            _feed(digest, ["file", source.path, source.offset, source.device, source.inode,
                           source.size, source.mtime_ns])
    return digest.hexdigest(), ""


def _feed(digest, items: list) -> None:
    """Add `items` to `digest` unambiguously (as one JSON line)."""
    digest.update(json.dumps(items, separators=(",", ":")).encode() + b"\n")


def _bytes_digest(storage: torch.UntypedStorage, first: int, nbytes: int) -> str:
    if nbytes == 0:
        return hashlib.sha256().hexdigest()
    return hashlib.sha256(_host_bytes(storage.data_ptr() + first, nbytes)).hexdigest()


def _host_bytes(address: int, nbytes: int) -> memoryview:
    """The `nbytes` of host memory at `address`, as a buffer (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def cache_path(directory: Path, group_name: str, key: str) -> Path:
    """The cache file of group `group_name` under `key`: ``<name>-<name digest>-<key>.master``
    (the name made safe for a file name; its digest keeps ``a[b]`` and ``a_b_`` apart).

        cache_path(Path("/cache"), "dit[blocks.0]", key)   # /cache/dit_blocks.0_-1f2e3d4c-9a8b...
    """
    return Path(directory) / f"{_group_stem(group_name)}-{key[:32]}{SUFFIX}"


def _group_stem(group_name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", group_name)[:80]
    return f"{safe}-{hashlib.sha256(group_name.encode()).hexdigest()[:8]}"


def prepare_directory(directory: Path) -> str | None:
    """Create the cache directory if missing; None when it is usable, else why not."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as error:
        return f"it cannot be created ({error.strerror or error})"
    if not os.path.isdir(directory):
        return "it is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "it is not writable by this user"
    return None


# -- writing ------------------------------------------------------------------------------------


def write_master(path: Path, key: str, layout: PackLayout, chunks: Sequence[torch.Tensor]) -> bool:
    """Write `chunks` (host uint8 tensors laid out as `layout`) as the cache file `path` for
    `key`; True when it is in place.  Any OSError warns that the cache was not written and
    leaves nothing behind (see [Note: writing a cache file]); the caller goes on without it.

        write_master(path, key, inventory.layout, master.chunks)
    """
    path = Path(path)
    _remove_dead_partials(path.parent)
    header, offsets, total = _header(key, layout)
    partial = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}{_PARTIAL}")
    try:
        _write_file(partial, header, offsets, total, chunks)
        os.replace(partial, path)
        _sync_directory(path.parent)
    except OSError as error:
        _discard(partial)
        _warn_not_written(path, error)
        return False
    except BaseException:
        _discard(partial)
        raise
    _remove_other_keys(path)
    return True


def _header(key: str, layout: PackLayout) -> tuple[bytes, list[int], int]:
    """The header bytes, each chunk's file offset and the file's size."""
    description = {"key": key, "chunk_nbytes": list(layout.chunk_nbytes)}
    text = json.dumps(description, separators=(",", ":")).encode()
    header = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text
    offsets, end = [], _aligned(len(header), FILE_ALIGNMENT)
    for nbytes in layout.chunk_nbytes:
        offsets.append(end)
        end = _aligned(end + nbytes, FILE_ALIGNMENT)
    return header, offsets, offsets[-1] + layout.chunk_nbytes[-1] if offsets else end


def _write_file(partial: Path, header: bytes, offsets: list[int], total: int,
                chunks: Sequence[torch.Tensor]) -> None:
    with open(partial, "xb", buffering=0, opener=_owner_only) as file:  # closed by any exit
        descriptor = file.fileno()
        _reserve(descriptor, total)
        _write_all(descriptor, 0, memoryview(header))
        for offset, chunk in zip(offsets, chunks):
            if chunk.numel():
                _write_all(descriptor, offset, _host_bytes(chunk.data_ptr(), chunk.numel()))
        os.ftruncate(descriptor, total)
        os.fsync(descriptor)


def _owner_only(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def _reserve(descriptor: int, total: int) -> None:
    """Reserve the file's blocks, so a full disk fails here; file systems without it skip it."""
    try:
        os.posix_fallocate(descriptor, 0, max(total, 1))
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _write_all(descriptor: int, offset: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        written = os.pwrite(descriptor, data[done : done + _WRITE_PIECE], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "the write made no progress")
        done += written


def _sync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _discard(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:  # never created, or already gone
        pass


def _warn_not_written(path: Path, error: OSError) -> None:
    reasons = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
               errno.EFBIG: "the file would exceed the allowed file size",
               errno.EROFS: "the file system is read-only"}
    why = reasons.get(error.errno, error.strerror or str(error))
    warnings.warn(
        f"the warm-restart cache file {path} was not written: {why} ({error}). This run goes on "
        "with the master in memory, and the next start packs it again; free space in the cache "
        "directory or point cache_directory elsewhere",
        RuntimeWarning,
        stacklevel=4,
    )


def _remove_dead_partials(directory: Path) -> None:
    """Remove temporary files whose writing process is gone (see [Note: writing a cache file])."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = re.search(r"\.(\d+)-[0-9a-f]+" + re.escape(_PARTIAL) + "$", name)
        if match is not None and not _alive(int(match.group(1))):
            _discard(Path(directory) / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_other_keys(path: Path) -> None:
    """Remove the cache files of the same group under other keys (its files changed)."""
    stem = path.name[: -len(SUFFIX)].rsplit("-", 1)[0]
    for other in path.parent.glob(f"{_glob_escape(stem)}-*{SUFFIX}"):
        if other.name != path.name and other.name[len(stem) + 1 : -len(SUFFIX)].isalnum():
            _discard(other)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


# -- mapping ------------------------------------------------------------------------------------


@attrs.frozen
class MappedMaster:
    """A cache file mapped copy-on-write: one uint8 tensor per chunk of the layout.

        mapped = map_master(path, key, inventory.layout)
        mapped.chunks[0].data_ptr() % 4096 == 0
    """

    #: One host tensor per chunk, views of the mapping (which they keep alive).
    chunks: list[torch.Tensor] = attrs.field(eq=False)
    _mapping: RegisteredMapping = attrs.field(eq=False, repr=False, alias="mapping")
    #: The file mapped.
    path: Path

    @property
    def pinned(self) -> bool:
        return bool(self._mapping.registered)

    def page_lock(self) -> None:
        """Register the whole mapping for DMA with CUDA (see [Note: page-locking a mapped
        master]); raises RuntimeError when the driver refuses (the caller goes on pageable)."""
        if self.pinned:
            return
        if not torch.cuda.is_available():
            raise RuntimeError("page-locking a mapped master needs CUDA, and none is available")
        pointer = ctypes.addressof(ctypes.c_char.from_buffer(self._mapping))
        self._mapping.register(pointer, len(self._mapping),
                               what=f"the {len(self._mapping)}-byte mapping of {self.path}")


def map_master(path: Path, key: str, layout: PackLayout) -> MappedMaster | None:
    """The cache file `path` mapped copy-on-write (see [Note: why MAP_PRIVATE]) when it holds
    the master of `key` laid out as `layout`; None when there is none or it does not fit (logged:
    the caller packs and writes the file again).

        mapped = map_master(path, key, inventory.layout)
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        with open(path, "rb", buffering=0) as file:  # the mapping outlives the descriptor
            why = _check_header(file.fileno(), key, layout)
            if why is not None:
                _log.info("warm-restart cache %s %s; rebuilding it", path, why)
                return None
            mapping = RegisteredMapping(file.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as error:  # ValueError: emptied since it was checked
        _log.info("warm-restart cache %s cannot be mapped (%s); rebuilding it", path, error)
        return None
    return _chunks_of(mapping, path, key, layout)


def _check_header(descriptor: int, key: str, layout: PackLayout) -> str | None:
    """Why the file open as `descriptor` is not the master of `key` and `layout`, or None."""
    size = os.fstat(descriptor).st_size
    prefix = os.pread(descriptor, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        return "is shorter than its header"
    magic, version, length = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        return "is not a residency master cache file"
    if version != FORMAT_VERSION:
        return f"has format version {version}, not {FORMAT_VERSION}"
    if length > min(size, _HEADER_LIMIT):
        return "has a damaged header"
    try:
        description = json.loads(os.pread(descriptor, length, _PREFIX.size))
        stored_key, stored_sizes = description["key"], description["chunk_nbytes"]
    except (ValueError, KeyError, TypeError):
        return "has a damaged header"
    if stored_key != key:
        return "was built for other weight files, another layout or another alignment class"
    if tuple(stored_sizes) != layout.chunk_nbytes:
        return "has other chunk sizes than the layout"
    expected = _header(key, layout)[2]
    if size < expected:
        return f"is truncated ({size} of {expected} bytes)"
    return None


def _chunks_of(
    mapping: RegisteredMapping, path: Path, key: str, layout: PackLayout
) -> MappedMaster | None:
    offsets = _header(key, layout)[1]  # the header was checked: it is the one `key` makes
    chunks = [
        torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        if nbytes else torch.empty(0, dtype=torch.uint8)
        for offset, nbytes in zip(offsets, layout.chunk_nbytes)
    ]
    misplaced = [c for c in chunks if c.numel() and c.data_ptr() % layout.boundary]
    if misplaced:
        _log.info("warm-restart cache %s mapped off the %d-byte grid; rebuilding it", path,
                  layout.boundary)
        return None
    return MappedMaster(chunks, mapping=mapping, path=path)


def _aligned(nbytes: int, boundary: int) -> int:
    return -(-nbytes // boundary) * boundary
