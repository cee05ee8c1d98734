"""`check_weight_files`: a diffusers folder's safetensors headers and sharded indexes, checked
without reading a tensor (the CLI's use of it: tests/test_main.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from residency import ResidencyError, WeightFileError
from residency.adapters.weight_files import check_weight_files

from _damaged_weights import DAMAGES, FILE, INDEX, save_tiny_sdxl, write


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny SDXL, saved once per module (copy it before damaging it)."""
    pytest.importorskip("diffusers")
    return save_tiny_sdxl(tmp_path_factory.mktemp("saved") / "sdxl")


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "sdxl", symlinks=True))


def test_a_saved_pipeline_passes_and_every_weight_file_is_listed(folder: Path):
    expected = sorted(path for path in folder.rglob("*")
                      if path.name.endswith((".safetensors", ".safetensors.index.json")))
    checked = check_weight_files(folder)
    assert checked == expected
    relative = {path.relative_to(folder).as_posix() for path in checked}
    assert {FILE, INDEX, "text_encoder_2/model.safetensors",
            "vae/diffusion_pytorch_model.safetensors"} <= relative
    shards = set(json.loads((folder / INDEX).read_text())["weight_map"].values())
    assert len(shards) > 1 and {f"unet/{shard}" for shard in shards} <= relative
    assert check_weight_files(str(folder)) == expected  # a str folder too


@pytest.mark.fast
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_file_is_refused_with_its_name_the_problem_and_what_to_do(
        folder: Path, damage: str):
    message = DAMAGES[damage](folder)
    with pytest.raises(WeightFileError) as error:
        check_weight_files(folder)
    assert str(error.value) == message
    assert isinstance(error.value, ResidencyError) and isinstance(error.value, ValueError)


@pytest.mark.fast
def test_a_folder_that_is_not_there_is_refused(tmp_path: Path):
    missing = tmp_path / "no such model"
    with pytest.raises(WeightFileError) as error:
        check_weight_files(missing)
    assert str(error.value) == (f"{missing}: there is no such folder; give a diffusers model "
                                "folder (one written by pipe.save_pretrained or downloaded from "
                                "the Hub)")


@pytest.mark.fast
def test_only_the_component_subfolders_are_checked(folder: Path):
    """from_pretrained reads neither the folder's own top level (a single-file checkpoint beside
    the components) nor hidden folders (``.cache/huggingface`` of a Hub download)."""
    (folder / "single_file.safetensors").write_bytes(b"not safetensors")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "model.safetensors").write_bytes(b"nor this")
    checked = check_weight_files(folder)
    assert folder / "single_file.safetensors" not in checked
    assert all(".cache" not in path.parts for path in checked)
    (folder / "unet" / "extra.safetensors").write_bytes(b"\x01")  # a component's file is checked
    with pytest.raises(WeightFileError, match=r"^unet/extra\.safetensors: 1 bytes, too short"):
        check_weight_files(folder)


@pytest.mark.fast
def test_edge_cases_that_are_whole(tmp_path: Path):
    """No tensors at all; a zero-element tensor; a sub-byte dtype filling whole bytes; metadata;
    a header padded with spaces (as safetensors itself pads to 8 bytes)."""
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "empty.safetensors", {}, b"")
    write(tmp_path / "a" / "mixed.safetensors", b"".join([
        b'{"__metadata__": {"format": "pt"}, ',
        b'"zero": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}, ',
        b'"packed": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}, ',
        b'"six": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [3, 6]}}    ',
    ]), b"\0" * 6)
    checked = check_weight_files(tmp_path)
    assert [path.name for path in checked] == ["empty.safetensors", "mixed.safetensors"]
    safetensors = pytest.importorskip("safetensors")
    for path in checked:  # and the safetensors library opens them
        with safetensors.safe_open(path, "np") as opened:
            assert len(list(opened.keys())) == (3 if path.name == "mixed.safetensors" else 0)


@pytest.mark.fast
def test_only_the_headers_are_read(tmp_path: Path):
    """A header describing 16 GiB of tensors in a sparse file: the check passes at once."""
    (tmp_path / "dit").mkdir()
    path = tmp_path / "dit" / "huge.safetensors"
    nbytes = 16 * 2**30
    write(path, {"w": {"dtype": "BF16", "shape": [2**33], "data_offsets": [0, nbytes]}}, b"")
    header_end = path.stat().st_size
    try:
        os.truncate(path, header_end + nbytes)
    except OSError:
        pytest.skip("the filesystem cannot hold a sparse 16 GiB file")
    read_before = _bytes_read()
    assert check_weight_files(tmp_path) == [path]
    assert _bytes_read() - read_before < 2**20


def _bytes_read() -> int:
    """What this process has read through read calls so far (Linux's /proc/self/io `rchar`)."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        pytest.skip("this system has no /proc/self/io to count the bytes read")
    return int(next(line.split()[1] for line in lines if line.startswith("rchar:")))


@pytest.mark.fast
@pytest.mark.parametrize("damage", [name for name in DAMAGES
                                    if "index" not in name and name != "unreadable"])
def test_what_the_check_refuses_the_safetensors_library_refuses_too(folder: Path, damage: str):
    """The rules are the format's, not stricter: safetensors (a test dependency only; the check
    does not use it) fails to open each damaged file."""
    safetensors = pytest.importorskip("safetensors")
    DAMAGES[damage](folder)
    with pytest.raises(Exception, match="Error while deserializing header"):
        with safetensors.safe_open(folder / FILE, "np"):
            pass


@pytest.mark.fast
def test_the_check_needs_nothing_but_the_standard_library():
    """It reads bytes and JSON itself: safetensors, torch, diffusers need not be installed."""
    import ast
    import residency.adapters.weight_files as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "json", "math", "os", "pathlib", "residency.core.errors"}
