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
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

import attrs
import torch

__all__ = ["FileSource", "find_file_sources"]

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
    """One file mapping of /proc/self/maps (adjacent lines of one file joined)."""

    start: int
    end: int
    file_offset: int
    device: tuple[int, int]  # (major, minor)
    inode: int
    path: str


def find_file_sources(
    sources: Sequence[tuple[torch.UntypedStorage, int]], nbytes: Sequence[int]
) -> list[FileSource | None]:
    """Per region (``sources[i]``: its storage and first byte; ``nbytes[i]``: its length), the
    file range its bytes still are, or None (see [Note: which mapped bytes are still the file's]).

        sources = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
    """
    try:
        mappings = _file_mappings()
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            return [
                _file_source(storage, first, length, mappings, pagemap.fileno())
                for (storage, first), length in zip(sources, nbytes)
            ]
    except OSError:
        return [None] * len(nbytes)


def _file_source(
    storage: torch.UntypedStorage, first: int, nbytes: int, mappings: list[_Mapping], pagemap: int
) -> FileSource | None:
    if nbytes <= 0 or storage.device.type != "cpu":
        return None
    address = storage.data_ptr() + first
    mapping = _mapping_of(mappings, address, nbytes)
    if mapping is None:
        return None
    offset = mapping.file_offset + (address - mapping.start)
    identity = _identity(mapping, offset + nbytes)
    if identity is None or _written(pagemap, address, nbytes):
        return None
    return FileSource(path=mapping.path, offset=offset, **identity)


def _mapping_of(mappings: list[_Mapping], address: int, nbytes: int) -> _Mapping | None:
    for mapping in mappings:
        if mapping.start <= address and address + nbytes <= mapping.end:
            return mapping
    return None


def _identity(mapping: _Mapping, end: int) -> dict | None:
    """The file's stat identity, if the path still names the mapped file and holds ``end``
    bytes; else None (replaced, deleted, truncated, not a regular file)."""
    try:
        info = os.stat(mapping.path)
    except OSError:
        return None
    same = (os.major(info.st_dev), os.minor(info.st_dev)) == mapping.device
    if not (stat.S_ISREG(info.st_mode) and same and info.st_ino == mapping.inode):
        return None
    if info.st_size < end:
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


def _file_mappings() -> list[_Mapping]:
    """The file mappings of /proc/self/maps, adjacent lines of one file (contiguous addresses
    and offsets) joined into one."""
    mappings: list[_Mapping] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            mapping = _parse_maps_line(line)
            if mapping is None:
                continue
            last = mappings[-1] if mappings else None
            if last is not None and _continues(last, mapping):
                mappings[-1] = attrs.evolve(last, end=mapping.end)
            else:
                mappings.append(mapping)
    return mappings


def _parse_maps_line(line: str) -> _Mapping | None:
    fields = line.rstrip("\n").split(maxsplit=5)
    if len(fields) < 6 or not fields[5].startswith("/"):
        return None
    span, perms, offset, device, inode, path = fields
    if perms[0] != "r" or int(inode) == 0 or path.endswith(" (deleted)"):
        return None
    start, end = (int(part, 16) for part in span.split("-"))
    major, minor = (int(part, 16) for part in device.split(":"))
    return _Mapping(start, end, int(offset, 16), (major, minor), int(inode), path)


def _continues(last: _Mapping, mapping: _Mapping) -> bool:
    return (
        last.end == mapping.start
        and (last.device, last.inode, last.path) == (mapping.device, mapping.inode, mapping.path)
        and last.file_offset + (last.end - last.start) == mapping.file_offset
    )
