"""Reading masters from weight files (issue 23): which regions of a freshly loaded pipeline are
still their safetensors file's bytes (`find_file_sources`), and that an edit is never one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from residency.host.file_reads import FileSource, find_file_sources
from residency.modules.tensors import take_inventory

from _helpers import assert_same_tensors, every_tensor

COMPONENTS = ("transformer", "text_encoder", "vae")


@pytest.fixture(scope="module")
def saved(saved_wan22) -> Path:
    return saved_wan22


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


@pytest.mark.fast
def test_non_persistent_buffers_are_not_in_a_file(saved: Path):
    module = load(saved).transformer
    inventory, found = sources_of(module)
    unsaved = set(range(len(found))) - state_dict_regions(module, inventory)
    assert unsaved  # the rotary embedding's tables are computed, not saved
    assert all(found[region] is None for region in unsaved)


@pytest.mark.fast
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


@pytest.mark.fast
def test_an_edit_of_a_single_byte_on_a_tensors_last_page_is_seen(saved: Path):
    module = load(saved).vae
    weight = max(module.parameters(), key=lambda p: p.numel())
    with torch.no_grad():
        weight.view(-1)[-1] += 1
    inventory, found = sources_of(module)
    assert found[region_of(inventory, weight)] is None


@pytest.mark.fast
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


@pytest.mark.fast
def test_memory_that_is_no_file_is_not_a_source():
    module = torch.nn.Linear(64, 64)
    _, found = sources_of(module)
    assert found == [None, None]


@pytest.mark.fast
def test_the_quick_look_at_map_files_agrees_with_the_maps_lines(saved: Path):
    """`find_*` parse /proc/self/maps only when a region starts in some file mapping, which the
    names of /proc/self/map_files tell: never for plain memory, always for a mapped file."""
    from residency.host.file_reads import _any_in_a_file_mapping, find_mapped_regions

    plain = torch.nn.Linear(64, 64)
    mapped = load(saved).transformer
    for module, in_a_file in ((plain, False), (mapped, True)):
        inventory = take_inventory([module])
        found = find_mapped_regions(inventory.source_regions, inventory.layout.region_nbytes)
        starts = [s.data_ptr() + first for s, first in inventory.source_regions]
        assert _any_in_a_file_mapping(starts) is in_a_file
        assert any(region is not None for region in found) is in_a_file


@pytest.mark.fast
def test_looking_for_files_costs_no_python_line_per_mapping_of_the_process(tmp_path: Path):
    """Every pack looks for weight files; the interrupt sweeps interrupt its line events, so a
    Python line per mapping of the process (hundreds: every library) would multiply their
    points.  The count is the same with 200 more file mappings."""
    import mmap

    from _interrupts import Interrupter

    inventory = take_inventory([torch.nn.Linear(64, 64)])

    def line_events() -> int:
        counter = Interrupter()
        counter.run(lambda: find_file_sources(inventory.source_regions,
                                              inventory.layout.region_nbytes))
        return counter.count

    before = line_events()
    mapped = []
    for index in range(200):
        path = tmp_path / f"{index}.bin"
        path.write_bytes(b"\0" * 4096)
        with open(path, "rb") as file:
            mapped.append(mmap.mmap(file.fileno(), 4096, prot=mmap.PROT_READ))
    try:
        assert line_events() == before
    finally:
        for mapping in mapped:
            mapping.close()


@pytest.mark.fast
@pytest.mark.parametrize("background_reads", [False, True])
def test_a_pack_looks_at_the_mappings_once_and_reads_the_hosts_room_once(monkeypatch,
                                                                         background_reads):
    """A private pack of a model in plain memory (one chunk) asks the process's file mappings
    once for both its questions (is a file cut short under a region; which regions can be read
    from their files) and reads the host's room once (`check_host_room`: the first chunk is not
    checked again).  Each look costs a listing of /proc/self/map_files and each reading the
    cgroup files: they were most of a small `add`.  With reads behind, the look that finds no
    file to read behind is the one that checks for cut files."""
    import residency.device.host_memory as host_memory_module
    from residency import Scheduler
    from residency.host import file_reads, memory, packing

    looks, readings = [], []
    real_look, real_reading = file_reads._file_mappings, host_memory_module.host_memory
    monkeypatch.setattr(file_reads, "_file_mappings",
                        lambda sources: looks.append(1) or real_look(sources))
    for module in (packing, memory):
        monkeypatch.setattr(module, "host_memory",
                            lambda *root: readings.append(1) or real_reading(*root))
    scheduler = Scheduler("cpu", host={"background_reads": background_reads})
    model = torch.nn.Linear(64, 64)
    expected = model(torch.ones(2, 64))
    scheduler.add("a", model)
    assert (len(looks), len(readings)) == (1, 1)
    with scheduler.resident("a"):
        assert torch.equal(model(torch.ones(2, 64)), expected)
    scheduler.close()


# -- from_pretrained under residency: the same pipeline as the plain one -------------------------

ALL = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}


def offloaded(folder: Path, config=ALL, **kwargs):
    from diffusers import DiffusionPipeline

    from residency.adapters.diffusers import from_pretrained

    pipe = from_pretrained(DiffusionPipeline, folder, config, device="cpu", **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-saved", "bfloat16"])
def test_from_pretrained_gives_the_plain_pipelines_tensors(saved: Path, dtype):
    kwargs = {} if dtype is None else {"dtype": dtype}
    plain = load(saved, **kwargs)
    pipe = offloaded(saved, **kwargs)
    for name in COMPONENTS:
        assert_same_tensors(getattr(pipe, name), getattr(plain, name), name)
    if dtype is not None:  # Wan's _keep_in_fp32_modules stayed float32, the rest converted
        assert pipe.transformer.scale_shift_table.dtype == torch.float32
        assert pipe.transformer.proj_out.weight.dtype == dtype
    encoder = pipe.text_encoder
    assert encoder.shared.weight is encoder.encoder.embed_tokens.weight  # tied stays tied


def test_a_call_is_bit_identical_to_the_plain_pipelines(saved: Path):
    from _tiny_pipelines import wan22_call

    from residency.adapters.diffusers import offload_scheduler

    expected = load(saved)(**wan22_call(seed=0)).frames
    pipe = offloaded(saved)
    scheduler = offload_scheduler(pipe)
    assert sorted(scheduler) == ["text_encoder", "transformer", "transformer_2", "vae"]
    assert torch.equal(pipe(**wan22_call(seed=0)).frames, expected)
    assert scheduler.transitions.count > 0


@pytest.mark.fast
def test_an_edit_before_offloading_is_kept(saved: Path):
    from residency.adapters.diffusers import enable_offload

    reference, pipe = load(saved), load(saved)
    for model in (reference, pipe):
        with torch.no_grad():
            model.transformer.proj_out.weight.data.mul_(2)
            model.vae.decoder.conv_out.bias.add_(1)
    enable_offload(pipe, ALL, device="cpu")
    for name in COMPONENTS:
        assert_same_tensors(getattr(pipe, name), getattr(reference, name), name)


def rchar() -> int:
    """Bytes this process read through read(2)-family calls (page faults on a mapping are not
    counted)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.fast
def test_the_masters_are_read_from_the_files(saved: Path):
    weights = sum(path.stat().st_size for path in saved.rglob("*.safetensors"))
    before = rchar()
    plain = load(saved)
    plain_read = rchar() - before
    before = rchar()
    pipe = offloaded(saved)
    ours_read = rchar() - before
    assert ours_read - plain_read >= 0.9 * weights, (plain_read, ours_read, weights)
    assert_same_tensors(pipe.transformer, plain.transformer, "transformer")


@pytest.mark.fast
def test_from_pretrained_checks_before_it_loads(saved: Path, tmp_path: Path):
    from diffusers import DiffusionPipeline

    from residency import ConfigError, WeightFileError
    from residency.adapters.diffusers import from_pretrained

    with pytest.raises(ConfigError) as error:
        from_pretrained(DiffusionPipeline, saved, {"mode": "module", "components": ["unet"]})
    assert "unet" in str(error.value)
    with pytest.raises(ConfigError) as error:
        from_pretrained("wan", saved)
    assert str(error.value) == (
        "from_pretrained(pipeline_class='wan', ...): give a diffusers pipeline class, such as "
        "diffusers.DiffusionPipeline or the folder's own class (WanPipeline, FluxPipeline, ...)")
    with pytest.raises(ConfigError) as error:  # host= first: before the folder is looked at
        from_pretrained(DiffusionPipeline, tmp_path / "missing", host={"background_reads": 1})
    assert str(error.value) == "background_reads=1; give True or False"
    with pytest.raises(WeightFileError) as error:
        from_pretrained(DiffusionPipeline, tmp_path / "missing")
    assert str(error.value).startswith(f"{tmp_path / 'missing'}: there is no such folder")


# -- FileReader: the file is checked, failures are typed -----------------------------------------


def read_threads() -> list:
    """The reading threads alive in this process, whoever started them."""
    import threading

    return [thread for thread in threading.enumerate()
            if thread.name in ("residency-read", "residency-arrive")]


@pytest.fixture
def no_earlier_reads():
    """Wait, at most 60 s, for reading threads an earlier test left to end, so that a thread
    this test finds alive is its own.  A scheduler's read-behind worker ends once its queue is
    empty, after that test returned; on a loaded machine it may still be reading (or starting a
    `FileReader` thread) when the next test begins."""
    import time

    deadline = time.monotonic() + 60
    while read_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not read_threads(), f"reading threads of an earlier test still run: {read_threads()}"


def source_for(path: Path, offset: int = 0) -> FileSource:
    info = path.stat()
    return FileSource(path=str(path), offset=offset, device=info.st_dev, inode=info.st_ino,
                      size=info.st_size, mtime_ns=info.st_mtime_ns)


@pytest.mark.fast
def test_the_reader_reads_ranges_in_pieces_on_its_threads(tmp_path: Path,
                                                          no_earlier_reads):
    from residency.host.file_reads import FileReader

    data = bytes(range(256)) * 4096  # 1 MiB
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    chunk = torch.zeros(2**20 + 100, dtype=torch.uint8)
    with FileReader(piece_nbytes=3 * 4096 + 5) as reader:  # many pieces, none page-aligned
        reader.start(chunk, [(source_for(path, 1000), 50, 700_000), (source_for(path), 700_050,
                                                                     300_000)])
        reader.finish()
    assert chunk[50:700_050].numpy().tobytes() == data[1000:701_000]
    assert chunk[700_050:1_000_050].numpy().tobytes() == data[:300_000]
    assert not chunk[:50].any() and not chunk[1_000_050:].any()
    assert not read_threads()


@pytest.mark.fast
def test_a_file_replaced_or_truncated_since_it_was_found_is_refused(tmp_path: Path, no_earlier_reads):
    from residency import WeightFileError
    from residency.host.file_reads import FileReader

    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 10_000)
    found = source_for(path)
    os.truncate(path, 5000)
    chunk = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(WeightFileError) as error, FileReader() as reader:
        reader.start(chunk, [(found, 0, 100)])
    assert str(error.value) == (
        f"{path}: the weight file was truncated (5000 bytes, was 10000 bytes) since the pipeline "
        "was loaded from it, so it no longer holds the tensors' bytes. Keep weight files "
        "unchanged until offloading is enabled, or load the pipeline again from the folder; the "
        "tensors past its new end are lost with it")
    other = tmp_path / "other.bin"
    other.write_bytes(b"y" * 10_000)
    found = source_for(path)
    os.replace(other, path)
    with pytest.raises(WeightFileError) as error, FileReader() as reader:
        reader.start(chunk, [(found, 0, 100)])
    assert str(error.value).startswith(
        f"{path}: the weight file was replaced (another file is at its path now) since the "
        "pipeline was loaded from it")
    os.unlink(path)
    with pytest.raises(WeightFileError) as error, FileReader() as reader:
        reader.start(chunk, [(found, 0, 100)])
    assert str(error.value).startswith(
        f"{path}: cannot open the weight file the tensors were loaded from ([Errno 2] No such "
        f"file or directory: '{path}'); it was moved or deleted since the pipeline was loaded")
    assert not chunk.any() and not read_threads()


@pytest.mark.fast
def test_a_short_read_says_the_file_was_truncated(tmp_path: Path, no_earlier_reads):
    from residency import WeightFileError
    from residency.host.file_reads import FileReader

    path = tmp_path / "weights.bin"
    path.write_bytes(b"z" * 1000)
    chunk = torch.zeros(500, dtype=torch.uint8)
    with FileReader() as reader:
        reader.start(chunk, [(source_for(path, 800), 0, 500)])  # past the end: 200 bytes there
        with pytest.raises(WeightFileError) as error:
            reader.finish()
    assert str(error.value) == (
        f"{path}: the weight file ends at byte 1000, inside the tensor bytes [800, 1300) being "
        "read: it was truncated while offloading was enabled (it had 1000 bytes), and the "
        "tensors past its new end are lost with it. Restore the file (download it again) and "
        "load the pipeline again")
    assert not read_threads()


# -- interrupts: the weights survive a KeyboardInterrupt anywhere in a pack with file reads ------

#: CI interrupts each line of the sweep at its first execution; ``--sweep=lines`` every n-th
#: point too (FILE_READS_SWEEP_STRIDE=1: every point).
SWEEP_STRIDE = int(os.environ.get("FILE_READS_SWEEP_STRIDE", 20))


def test_an_interrupt_anywhere_in_a_pack_with_file_reads_keeps_the_weights(saved: Path,
                                                                          no_earlier_reads):
    from transformers import UMT5EncoderModel

    from residency.host.memory import HostMaster
    from residency.device.transport import CpuTransport

    from _interrupts import sweep

    folder = saved / "text_encoder"
    reference = {name: tensor.detach().clone()
                 for name, tensor in every_tensor(UMT5EncoderModel.from_pretrained(folder)).items()}

    def build():
        model = UMT5EncoderModel.from_pretrained(folder)
        inventory = take_inventory([model], chunk_nbytes=4096)  # a few chunks
        found = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
        assert all(found)
        return model, inventory, found

    def operation(world):  # the files found beforehand: the points are the pack's own
        HostMaster.pack(world[1], CpuTransport(), pin=False, files=world[2])

    def no_reader_left(world):
        assert not read_threads(), "a residency-read thread outlived the pack"

    def intact(world):
        tensors = every_tensor(world[0])
        assert tensors.keys() == reference.keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor.detach(), reference[name]), name

    points = sweep(build, operation, intact, stride=SWEEP_STRIDE, after=no_reader_left)
    assert points > 50


@pytest.mark.fast
def test_the_progress_of_a_master_read_from_files_says_reading(caplog):
    import logging

    from residency.host.memory import Progress

    progress = Progress(3 * 2**30, verb="reading host master")
    with caplog.at_level(logging.INFO, logger="residency"):
        progress.advance(3 * 2**30)
        progress.close()
    assert [record.getMessage() for record in caplog.records] == [
        "reading host master: 100% of 3.0 GiB"]


def test_a_file_replaced_before_offloading_leaves_the_loaded_weights(saved: Path, tmp_path: Path):
    import shutil

    from residency.adapters.diffusers import enable_offload

    folder = Path(shutil.copytree(saved, tmp_path / "wan"))
    reference, pipe = load(saved), load(folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    replacement = bytearray(weights.read_bytes())
    replacement[-4096:] = bytes(4096)  # other bytes at the same offsets, under a new inode
    (tmp_path / "new").write_bytes(replacement)
    os.replace(tmp_path / "new", weights)
    enable_offload(pipe, ALL, device="cpu")
    assert_same_tensors(pipe.transformer, reference.transformer, "transformer")
