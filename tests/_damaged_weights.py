"""A tiny diffusers folder with real weight files, and the ways to damage one of them.

    folder = save_tiny_sdxl(tmp_path / "sdxl")         # its unet sharded, with an index
    expected = DAMAGES["truncated"](folder)            # damages the folder; the message it expects
    with pytest.raises(WeightFileError) as error:
        check_weight_files(folder)
    assert str(error.value) == expected

Each damage edits the bytes of a file that ``save_pretrained`` wrote (its header read here with
``struct``/``json``, independently of the checker), and returns the exact message
`residency.adapters.weight_files.check_weight_files` must give (the CLI prefixes ``--pipeline
PATH: ``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

#: The single-file component the damages edit, and the sharded one's index.
FILE = "text_encoder/model.safetensors"
INDEX = "unet/diffusion_pytorch_model.safetensors.index.json"
REDO = "download it again"


def save_tiny_sdxl(folder: Path) -> Path:
    """A tiny SDXL pipeline saved to `folder` (safetensors; the unet in shards of 64 KB)."""
    from _tiny_pipelines import tiny_sdxl

    tiny_sdxl().save_pretrained(folder, safe_serialization=True, max_shard_size="64KB")
    return folder


def read(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and the bytes after it."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write(path: Path, header: dict | bytes, data: bytes, *, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)


def tensors_in_order(header: dict) -> list[tuple[int, int, str]]:
    return sorted((*entry["data_offsets"], name) for name, entry in header.items()
                  if name != "__metadata__")


def _entry_damage(problem: str, **fields) -> Callable[[Path], str]:
    """A damage that sets `fields` of the file's first tensor (a value None: deletes the field);
    the message names the tensor and `problem`."""
    def damage(folder: Path) -> str:
        path = folder / FILE
        header, data = read(path)
        name = tensors_in_order(header)[0][2]
        for field, value in fields.items():
            if value is None:
                del header[name][field]
            else:
                header[name][field] = value
        write(path, header, data)
        return f"{FILE}: tensor {name!r} {problem}; the header is damaged; {REDO}"
    return damage


def too_short(folder: Path) -> str:
    (folder / FILE).write_bytes(b"\x01\x02")
    return (f"{FILE}: 2 bytes, too short for a safetensors file (it begins with an 8-byte header "
            f"length); {REDO}")


def header_length_beyond_the_file(folder: Path) -> str:
    path = folder / FILE
    raw = path.read_bytes()
    size = len(raw)
    path.write_bytes(size.to_bytes(8, "little") + raw[8:])  # the length: the whole file
    return (f"{FILE}: the header length says {size} bytes, the file holds {size - 8} after it: "
            f"not a safetensors file, or truncated; {REDO}")


def header_length_beyond_the_limit(folder: Path) -> str:
    path = folder / FILE
    write(path, b"", b"", length=200_000_000)
    os.truncate(path, 200_000_100)  # sparse: nothing written
    return (f"{FILE}: the header length says 200000000 bytes, more than safetensors opens "
            f"(100000000): not a safetensors file; {REDO}")


def header_not_json(folder: Path) -> str:
    write(folder / FILE, b'{"t": nope}', b"")
    return f"{FILE}: the header is not JSON (Expecting value at byte 6); the file is damaged; {REDO}"


def header_not_utf8(folder: Path) -> str:
    write(folder / FILE, b'{"\xff": 1}', b"")
    return (f"{FILE}: the header is not JSON (not UTF-8 at byte 2); the file is damaged; {REDO}")


def header_not_an_object(folder: Path) -> str:
    write(folder / FILE, b"[1, 2]", b"")
    return (f"{FILE}: the header is a JSON list, not an object of tensors; the file is damaged; "
            f"{REDO}")


def metadata_not_strings(folder: Path) -> str:
    path = folder / FILE
    header, data = read(path)
    header["__metadata__"] = {"format": 1}
    write(path, header, data)
    return (f"{FILE}: its \"__metadata__\" is not an object of strings; the header is damaged; "
            f"{REDO}")


def entry_not_an_object(folder: Path) -> str:
    path = folder / FILE
    header, data = read(path)
    name = tensors_in_order(header)[0][2]
    header[name] = 3
    write(path, header, data)
    return (f"{FILE}: tensor {name!r} has a JSON int in the header, not an object; the header is "
            f"damaged; {REDO}")


def size_mismatch(folder: Path) -> str:
    path = folder / FILE
    header, data = read(path)
    name = tensors_in_order(header)[0][2]
    entry = header[name]
    entry["shape"] = [*entry["shape"], 2]  # twice the elements, the same offsets
    write(path, header, data)
    begin, end = entry["data_offsets"]
    return (f"{FILE}: tensor {name!r} is {entry['dtype']} {entry['shape']}: {2 * (end - begin)} "
            f"bytes, but its data_offsets [{begin}, {end}] hold {end - begin}; the header is "
            f"damaged; {REDO}")


def _shift_tensors(folder: Path, first: int, shift: int) -> list[tuple[int, int, str]]:
    """Move the tensors from the `first`-th (in offset order) on by `shift` bytes, inserting
    zeros before them (`shift` > 0) or dropping bytes at the end (< 0); the tensors as they
    were."""
    path = folder / FILE
    header, data = read(path)
    spans = tensors_in_order(header)
    start = spans[first][0]
    for begin, end, name in spans[first:]:
        header[name]["data_offsets"] = [begin + shift, end + shift]
    data = data[:start] + b"\0" * shift + data[start:] if shift > 0 else data[:shift]
    write(path, header, data)
    return spans


def gap_between_tensors(folder: Path) -> str:
    spans = _shift_tensors(folder, 1, 4)
    (_, end, first), (_, _, second) = spans[:2]
    return (f"{FILE}: bytes {end} to {end + 4} of the data belong to no tensor (a gap after "
            f"tensor {first!r}, before tensor {second!r}); the header is damaged; {REDO}")


def gap_before_the_first_tensor(folder: Path) -> str:
    spans = _shift_tensors(folder, 0, 4)
    return (f"{FILE}: bytes 0 to 4 of the data belong to no tensor (a gap at the start of the "
            f"data, before tensor {spans[0][2]!r}); the header is damaged; {REDO}")


def overlap_between_tensors(folder: Path) -> str:
    spans = _shift_tensors(folder, 1, -4)
    (_, end, first), (_, _, second) = spans[:2]
    return (f"{FILE}: tensors {first!r} and {second!r} overlap (bytes {end - 4} to {end} of the "
            f"data); the header is damaged; {REDO}")


def truncated(folder: Path) -> str:
    path = folder / FILE
    header, data = read(path)
    write(path, header, data[:-100])
    return (f"{FILE}: truncated: the header says {len(data)} bytes of tensors, the file holds "
            f"{len(data) - 100} after its header; {REDO}")


def padded(folder: Path) -> str:
    path = folder / FILE
    header, data = read(path)
    write(path, header, data + b"\0" * 100)
    return (f"{FILE}: 100 bytes too long: the header says {len(data)} bytes of tensors, the file "
            f"holds {len(data) + 100} after its header; {REDO}")


def unreadable(folder: Path) -> str:
    path = folder / FILE
    path.unlink()
    path.symlink_to(folder / "no such blob")  # a broken link, as a half-deleted Hub cache has
    return (f"{FILE}: cannot be read (No such file or directory); check that it exists and is "
            f"readable, or {REDO}")


def _shards(folder: Path) -> tuple[dict, dict[str, list[str]]]:
    declared = json.loads((folder / INDEX).read_text())
    shards: dict[str, list[str]] = {}
    for name, shard in declared["weight_map"].items():
        shards.setdefault(shard, []).append(name)
    return declared, shards


def index_names_a_missing_shard(folder: Path) -> str:
    _, shards = _shards(folder)
    missing = sorted(shards)[1]
    (folder / "unet" / missing).unlink()
    return (f"{INDEX}: names the shard unet/{missing}, which is missing; download the missing "
            f"shard again")


def index_maps_a_tensor_to_the_wrong_shard(folder: Path) -> str:
    declared, shards = _shards(folder)
    first, second = sorted(shards)[:2]
    name = shards[second][0]
    declared["weight_map"][name] = first
    (folder / INDEX).write_text(json.dumps(declared))
    return (f"{INDEX}: maps tensor {name!r} to unet/{first}, which does not hold it; download "
            f"the index and its shards again")


def index_not_json(folder: Path) -> str:
    (folder / INDEX).write_text('{"weight_map": ')
    return (f"{INDEX}: cannot be read as JSON (Expecting value: line 1 column 16 (char 15)); "
            f"{REDO}")


def index_without_a_weight_map(folder: Path) -> str:
    (folder / INDEX).write_text('{"metadata": {}}')
    return (f"{INDEX}: has no \"weight_map\" object of tensor names to shard files: not a sharded "
            f"index; {REDO}")


#: Each damage: it damages a saved folder and returns the message the check must give.
DAMAGES: dict[str, Callable[[Path], str]] = {
    "too short": too_short,
    "header length beyond the file": header_length_beyond_the_file,
    "header length beyond the limit": header_length_beyond_the_limit,
    "header not JSON": header_not_json,
    "header not UTF-8": header_not_utf8,
    "header not an object": header_not_an_object,
    "metadata not strings": metadata_not_strings,
    "entry not an object": entry_not_an_object,
    "entry without dtype": _entry_damage("has no 'dtype'", dtype=None),
    "entry without shape": _entry_damage("has no 'shape'", shape=None),
    "entry without data_offsets": _entry_damage("has no 'data_offsets'", data_offsets=None),
    "unknown dtype": _entry_damage(
        "has dtype 'F12', which safetensors does not know (it knows BOOL, F4, F6_E2M3, F6_E3M2, "
        "U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, "
        "U32, F32, C64, F64, I64, U64)", dtype="F12"),
    "negative shape": _entry_damage(
        "has shape [-1, 4], not a list of non-negative whole numbers", shape=[-1, 4]),
    "bad data_offsets": _entry_damage(
        "has data_offsets [5], not [begin, end] with 0 <= begin <= end", data_offsets=[5]),
    "sub-byte size": _entry_damage(
        "is F4 [3]: 12 bits, not a whole number of bytes", dtype="F4", shape=[3]),
    "size mismatch": size_mismatch,
    "gap between tensors": gap_between_tensors,
    "gap before the first tensor": gap_before_the_first_tensor,
    "overlap between tensors": overlap_between_tensors,
    "truncated": truncated,
    "padded": padded,
    "unreadable": unreadable,
    "index names a missing shard": index_names_a_missing_shard,
    "index maps a tensor to the wrong shard": index_maps_a_tensor_to_the_wrong_shard,
    "index not JSON": index_not_json,
    "index without a weight_map": index_without_a_weight_map,
}

