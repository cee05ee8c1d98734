"""Reading masters from weight files (issue 23): which regions of a freshly loaded pipeline are
still their safetensors file's bytes (`find_file_sources`), and that an edit is never one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from residency.engine.file_reads import FileSource, find_file_sources
from residency.engine.tensors import take_inventory

from _tiny_pipelines import tiny_wan22

COMPONENTS = ("transformer", "text_encoder", "vae")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Wan2.2 (UMT5 encoder, two experts, Wan VAE), saved once per module."""
    pytest.importorskip("diffusers")
    folder = tmp_path_factory.mktemp("saved") / "wan"
    tiny_wan22().save_pretrained(folder)
    return folder


def load(folder: Path, **kwargs):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sources_of(module):
    inventory = take_inventory([module])
    found = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
    return inventory, found


def region_of(inventory, tensor: torch.Tensor) -> int:
    index = next(i for i, t in enumerate(inventory.tensors) if t is tensor)
    return inventory.places[index].region


def region_bytes(inventory, region: int) -> bytes:
    storage, first = inventory.source_regions[region]
    nbytes = inventory.layout.region_nbytes[region]
    view = torch.empty(0, dtype=torch.uint8).set_(storage, first, (nbytes,))
    return view.numpy().tobytes()


def state_dict_regions(module, inventory) -> set[int]:
    """The regions of the tensors the file holds (parameters and persistent buffers)."""
    saved = {id(tensor) for tensor in module.state_dict(keep_vars=True).values()}
    return {place.region for tensor, place in zip(inventory.tensors, inventory.places)
            if id(tensor) in saved}


@pytest.mark.parametrize("name", COMPONENTS)
def test_every_saved_region_of_a_fresh_load_is_found_at_its_file_offset(saved: Path, name: str):
    module = getattr(load(saved), name)
    inventory, found = sources_of(module)
    assert len(found) == len(inventory.layout.region_nbytes)
    for region in state_dict_regions(module, inventory):
        source = found[region]
        assert isinstance(source, FileSource), region
        info = os.stat(source.path)
        assert Path(source.path).is_relative_to(saved / name)
        assert (source.device, source.inode, source.size, source.mtime_ns) == (
            info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        with open(source.path, "rb") as file:
            file.seek(source.offset)
            on_file = file.read(inventory.layout.region_nbytes[region])
        assert on_file == region_bytes(inventory, region)


def test_non_persistent_buffers_are_not_in_a_file(saved: Path):
    module = load(saved).transformer
    inventory, found = sources_of(module)
    unsaved = set(range(len(found))) - state_dict_regions(module, inventory)
    assert unsaved  # the rotary embedding's tables are computed, not saved
    assert all(found[region] is None for region in unsaved)


@pytest.mark.parametrize("how", ["in place", "through .data"])
def test_an_edited_tensor_is_not_the_files_bytes(saved: Path, how: str):
    module = load(saved).transformer
    weight = module.proj_out.weight
    with torch.no_grad():
        (weight if how == "in place" else weight.data).mul_(2)
    inventory, found = sources_of(module)
    assert found[region_of(inventory, weight)] is None
    # A tensor whose pages the edit did not touch is still found.
    assert isinstance(found[region_of(inventory, module.blocks[0].ffn.net[0].proj.weight)],
                      FileSource)


def test_an_edit_of_a_single_byte_on_a_tensors_last_page_is_seen(saved: Path):
    module = load(saved).vae
    weight = max(module.parameters(), key=lambda p: p.numel())
    with torch.no_grad():
        weight.view(-1)[-1] += 1
    inventory, found = sources_of(module)
    assert found[region_of(inventory, weight)] is None


def test_a_file_replaced_or_truncated_since_it_was_mapped_is_not_a_source(saved: Path, tmp_path):
    import shutil

    folder = Path(shutil.copytree(saved, tmp_path / "wan"))
    pipe = load(folder)
    replaced = folder / "vae" / "diffusion_pytorch_model.safetensors"
    os.replace(shutil.copy(replaced, tmp_path / "copy"), replaced)  # a new inode at the path
    truncated = folder / "text_encoder" / "model.safetensors"
    os.truncate(truncated, 100)
    for name in ("vae", "text_encoder"):
        _, found = sources_of(getattr(pipe, name))
        assert found and all(source is None for source in found)


def test_memory_that_is_no_file_is_not_a_source():
    module = torch.nn.Linear(64, 64)
    _, found = sources_of(module)
    assert found == [None, None]
