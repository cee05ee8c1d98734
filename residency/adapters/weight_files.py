"""Check a diffusers folder's weight files before anything loads them: every ``*.safetensors``
file's header, and every sharded index (``*.safetensors.index.json``).

    from residency.adapters.weight_files import check_weight_files

    files = check_weight_files("./Wan2.2-T2V-A14B-Diffusers")   # every file checked, sorted
    # WeightFileError: text_encoder/model.safetensors: truncated: the header says 1048576 bytes
    # of tensors, the file holds 524288 after its header; download it again

Only the headers are read (and each file's size, from ``os.stat``), never a tensor, so a 67 GB
folder checks in milliseconds.  The files checked are those in the folder's component subfolders
(any depth; the folder's own top level and hidden folders are not read by
``DiffusionPipeline.from_pretrained``, so they are left alone).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the tensors'
bytes.  The rules (as the safetensors library itself checks them when it opens a file):

* N fits inside the file (and under safetensors' own limit, `MAX_HEADER_BYTES`);
* the JSON is an object; its ``"__metadata__"`` entry, if any, an object of strings; every other
  entry a tensor: ``"dtype"`` one of `DTYPE_BITS`, ``"shape"`` a list of non-negative whole
  numbers, ``"data_offsets"`` ``[begin, end]``, 0 <= begin <= end;
* each tensor's bytes (its shape's product times its dtype's size) are ``end - begin``;
* the tensors' bytes, in order of their offsets, start at 0 and follow each other without gaps or
  overlaps, and the last one ends where the file does: a truncated or padded file is refused.

A sharded index (``{"metadata": ..., "weight_map": {tensor: shard file}}``, beside its shards)
must name shards that exist, and each tensor it maps must be in the shard it names.

Every component the folder's ``model_index.json`` names (an entry ``[library, class]``; ``[null,
null]`` is an absent component) must have its subfolder, and a component that is a model (its
subfolder holds a ``config.json``, as ``save_pretrained`` of every diffusers and transformers
model writes it; schedulers, tokenizers and processors write other files) must have a weight file
there: a ``*.safetensors`` file or sharded index, or a ``*.bin`` file (the legacy format, whose
contents are not checked).  A folder without a ``model_index.json`` is checked file by file only.

The first problem raises `WeightFileError`, its message naming the file (relative to the folder),
what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from residency.core.errors import WeightFileError

__all__ = ["check_weight_files", "DTYPE_BITS", "MAX_HEADER_BYTES"]

#: The bits of one element of each dtype the safetensors format knows (safetensors 0.8).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
#: The largest header the safetensors library opens (its ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000
#: What to do about a damaged file.
_REDO = "download it again"
_INDEX_SUFFIX = ".safetensors.index.json"
#: The weight file `save_pretrained` writes for a model of each library (named when it is missing).
_WEIGHT_FILE = {"diffusers": "diffusion_pytorch_model.safetensors",
                "transformers": "model.safetensors"}


def check_weight_files(folder: str | os.PathLike) -> list[Path]:
    """Check every weight file in `folder`'s component subfolders; returns the files checked
    (``folder / relative path``, safetensors files and sharded indexes, sorted).

        check_weight_files("./sdxl")   # [.../text_encoder/model.safetensors, ...]

    Raises `WeightFileError` for the first damaged file (module docstring: the rules), or when
    `folder` is not a folder; reads only the headers.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightFileError(f"{folder}: there is no such folder; give a diffusers model folder "
                              "(one written by pipe.save_pretrained or downloaded from the Hub)")
    _check_components(folder)
    files = _component_files(folder, "*.safetensors")
    indexes = _component_files(folder, f"*{_INDEX_SUFFIX}")
    tensors = {path: _tensor_names(folder, path) for path in files}
    for index in indexes:
        _check_index(folder, index, tensors)
    return sorted([*tensors, *indexes])


def _check_components(folder: Path) -> None:
    """Every component ``model_index.json`` names has its subfolder, and every model component a
    weight file there (module docstring)."""
    try:
        declared = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # no index to check against (the callers that need one say so themselves)
    if not isinstance(declared, dict):
        return
    for name, entry in declared.items():
        if name.startswith("_") or not _names_a_component(entry):
            continue
        subfolder = folder / name
        if not subfolder.is_dir():
            raise WeightFileError(
                f"component {name!r}: model_index.json names it ({entry[0]}.{entry[1]}), but "
                f"the folder {name}/ is missing; save the pipeline again, or download that "
                "component's folder")
        if (subfolder / "config.json").is_file() and not _weight_files_in(subfolder):
            expected = _WEIGHT_FILE.get(entry[0], "model.safetensors")
            raise WeightFileError(
                f"component {name!r}: {name}/{expected} is missing (the folder holds no weight "
                f"file: no *.safetensors, sharded index or *.bin), so {entry[1]} has no weights "
                "to load; save the pipeline again, or download that file")


def _names_a_component(entry: object) -> bool:
    """Whether a model_index.json entry is ``[library, class]`` (not ``[null, null]``)."""
    return (isinstance(entry, list) and len(entry) == 2
            and all(isinstance(part, str) for part in entry))


def _weight_files_in(subfolder: Path) -> bool:
    """Whether `subfolder` names a weight file (a broken link counts: the per-file check that
    follows says it cannot be read)."""
    return any(path.is_file() or path.is_symlink() for pattern in ("*.safetensors", f"*{_INDEX_SUFFIX}", "*.bin")
               for path in subfolder.glob(pattern))


def _component_files(folder: Path, pattern: str) -> list[Path]:
    """The files matching `pattern` in `folder`'s subfolders, hidden folders left out."""
    found = []
    for path in folder.rglob(pattern):
        parts = path.relative_to(folder).parts
        if len(parts) > 1 and not any(part.startswith(".") for part in parts[:-1]):
            found.append(path)
    return sorted(found)


def _refuse(folder: Path, path: Path, problem: str) -> WeightFileError:
    return WeightFileError(f"{_shown(folder, path)}: {problem}")


def _shown(folder: Path, path: Path) -> str:
    """`path` as a message names it: relative to `folder` when it lies there."""
    return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)


def _tensor_names(folder: Path, path: Path) -> set[str]:
    """Check one safetensors file; the names of its tensors."""
    header, data_bytes = _read_header(folder, path)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                    isinstance(value, str) for value in entry.values()):
                raise _refuse(folder, path, "its \"__metadata__\" is not an object of strings; "
                              f"the header is damaged; {_REDO}")
            continue
        begin, end = _check_entry(folder, path, name, entry)
        spans.append((begin, end, name))
    _check_layout(folder, path, sorted(spans), data_bytes)
    return {name for _, _, name in spans}


def _read_header(folder: Path, path: Path) -> tuple[dict, int]:
    """The header's JSON object and the bytes after the header."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < 8:
                raise _refuse(folder, path, f"{size} bytes, too short for a safetensors file (it "
                              f"begins with an 8-byte header length); {_REDO}")
            length = int.from_bytes(file.read(8), "little")
            if length > size - 8:
                raise _refuse(folder, path, f"the header length says {length} bytes, the file "
                              f"holds {size - 8} after it: not a safetensors file, or truncated; "
                              f"{_REDO}")
            if length > MAX_HEADER_BYTES:
                raise _refuse(folder, path, f"the header length says {length} bytes, more than "
                              f"safetensors opens ({MAX_HEADER_BYTES}): not a safetensors file; "
                              f"{_REDO}")
            raw = file.read(length)
    except OSError as error:
        raise _refuse(folder, path, f"cannot be read ({error.strerror}); check that it exists "
                      f"and is readable, or {_REDO}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise _refuse(folder, path, f"the header is not JSON (not UTF-8 at byte {error.start}); "
                      f"the file is damaged; {_REDO}") from None
    except json.JSONDecodeError as error:
        raise _refuse(folder, path, f"the header is not JSON ({error.msg} at byte {error.pos}); "
                      f"the file is damaged; {_REDO}") from None
    if not isinstance(header, dict):
        raise _refuse(folder, path, f"the header is a JSON {type(header).__name__}, not an "
                      f"object of tensors; the file is damaged; {_REDO}")
    return header, size - 8 - length


def _check_entry(folder: Path, path: Path, name: str, entry: object) -> tuple[int, int]:
    """Check one tensor's header entry; its ``[begin, end]``."""
    def refuse(problem: str) -> WeightFileError:
        return _refuse(folder, path, f"tensor {name!r} {problem}; the header is damaged; {_REDO}")

    if not isinstance(entry, dict):
        raise refuse(f"has a JSON {type(entry).__name__} in the header, not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise refuse(f"has no {field!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise refuse(f"has dtype {dtype!r}, which safetensors does not know (it knows "
                     f"{', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_whole(n) and n >= 0 for n in shape):
        raise refuse(f"has shape {shape!r}, not a list of non-negative whole numbers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_whole, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        raise refuse(f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    begin, end = offsets
    if bits % 8:
        raise refuse(f"is {dtype} {shape}: {bits} bits, not a whole number of bytes")
    if bits // 8 != end - begin:
        raise refuse(f"is {dtype} {shape}: {bits // 8} bytes, but its data_offsets [{begin}, "
                     f"{end}] hold {end - begin}")
    return begin, end


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layout(folder: Path, path: Path, spans: list[tuple[int, int, str]],
                  data_bytes: int) -> None:
    """The tensors' bytes (`spans`, sorted) follow each other from 0 to the end of the file."""
    end, previous = 0, None
    for begin, next_end, name in spans:
        if begin > end:
            where = f"after tensor {previous!r}" if previous else "at the start of the data"
            raise _refuse(folder, path, f"bytes {end} to {begin} of the data belong to no tensor "
                          f"(a gap {where}, before tensor {name!r}); the header is damaged; "
                          f"{_REDO}")
        if begin < end:
            raise _refuse(folder, path, f"tensors {previous!r} and {name!r} overlap (bytes "
                          f"{begin} to {min(end, next_end)} of the data); the header is damaged; "
                          f"{_REDO}")
        end, previous = next_end, name
    if end > data_bytes:
        raise _refuse(folder, path, f"truncated: the header says {end} bytes of tensors, the "
                      f"file holds {data_bytes} after its header; {_REDO}")
    if end < data_bytes:
        raise _refuse(folder, path, f"{data_bytes - end} bytes too long: the header says {end} "
                      f"bytes of tensors, the file holds {data_bytes} after its header; {_REDO}")


def _check_index(folder: Path, index: Path, tensors: dict[Path, set[str]]) -> None:
    """Check a sharded index against its shards (`tensors`: each checked file's tensor names)."""
    try:
        declared = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refuse(folder, index, f"cannot be read as JSON ({error}); {_REDO}") from None
    weight_map = declared.get("weight_map") if isinstance(declared, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(shard, str) for shard in weight_map.values()):
        raise _refuse(folder, index, "has no \"weight_map\" object of tensor names to shard "
                      f"files: not a sharded index; {_REDO}")
    for name, shard_name in weight_map.items():
        shard = index.parent / shard_name
        if shard not in tensors:
            if not shard.is_file():
                raise _refuse(folder, index, f"names the shard {_shown(folder, shard)}, which is "
                              "missing; download the missing shard again")
            tensors[shard] = _tensor_names(folder, shard)
        if name not in tensors[shard]:
            raise _refuse(folder, index, f"maps tensor {name!r} to {_shown(folder, shard)}, which "
                          "does not hold it; download the index and its shards again")
