"""The warm-restart cache (residency/host/master_cache.py, issue 23): a tiny Wan2.2 saved with
``save_pretrained`` and loaded with ``DiffusionPipeline.from_pretrained`` (its parameters are then
untouched views of the safetensors mappings), offloaded with ``host={"cache_directory": ...}``.

The first start writes one file per group; a second start maps them (the masters' chunks are
pages of the cache files, by /proc/self/maps), bit-identical to the pipeline never offloaded.
Every bad input gets a rebuilt cache or a warning, never wrong weights: changed source files,
a file for another alignment class or layout, a truncated or damaged file, a full disk, and an
interrupt at any line of writing or mapping.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from residency import Scheduler
from residency.adapters.diffusers import disable_offload, enable_offload
from residency.host.file_reads import find_file_sources
from residency.host.memory import HostMaster
from residency.host.master_cache import (
    cache_path,
    group_key,
    map_master,
    write_master,
)
from residency.modules.tensors import (
    ACCELERATOR_ALIGNMENT,
    CPU_ALIGNMENT,
    DEFAULT_CHUNK_NBYTES,
    take_inventory,
)
from residency.device.transport import CpuTransport

from _interrupts import consistent, sweep

pytest.importorskip("diffusers")

from diffusers import DiffusionPipeline  # noqa: E402

from _tiny_pipelines import tiny_wan22, wan22_call  # noqa: E402

NAMES = ["text_encoder", "transformer", "transformer_2", "vae"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wan") / "wan"
    tiny_wan22().save_pretrained(folder)
    return folder


@pytest.fixture
def wan(saved, tmp_path) -> Path:
    """A copy of the saved pipeline this test may rewrite."""
    return Path(shutil.copytree(saved, tmp_path / "wan"))


def load(folder: Path):
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def start(folder: Path, cache: Path, **options):
    """A fresh pipeline loaded from `folder`, its components added to a cached CPU scheduler."""
    pipe = load(folder)
    scheduler = Scheduler("cpu", host={"cache_directory": cache}, **options)
    groups = {name: scheduler.add(name, getattr(pipe, name)) for name in NAMES}
    return pipe, scheduler, groups


def inputs() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "ids": torch.tensor([[3, 4, 6, 7, 8, 1]]),
        "latents": torch.randn(1, 4, 1, 8, 8, generator=generator),
        "text": torch.randn(1, 6, 16, generator=generator),
    }


def outputs(pipe, scheduler=None) -> dict[str, torch.Tensor]:
    """Each component's output on fixed inputs, inside its phase when `scheduler` is given."""
    given = inputs()
    calls = {
        "text_encoder": lambda m: m(input_ids=given["ids"]).last_hidden_state,
        "transformer": lambda m: m(hidden_states=given["latents"], timestep=torch.tensor([500]),
                                   encoder_hidden_states=given["text"]).sample,
        "vae": lambda m: m.decode(given["latents"]).sample,
    }
    calls["transformer_2"] = calls["transformer"]
    found = {}
    with torch.no_grad():
        for name, call in calls.items():
            module = getattr(pipe, name)
            if scheduler is None:
                found[name] = call(module)
                continue
            with scheduler.resident(name):
                found[name] = call(module)
    return found


def weights(pipe) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value.detach().clone()
            for name in NAMES for key, value in getattr(pipe, name).state_dict().items()}


def assert_same(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys()
    different = [k for k in found if not (found[k].dtype == expected[k].dtype
                                          and torch.equal(found[k], expected[k]))]
    assert not different, different


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.master"))


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds `tensor`'s bytes (by /proc/self/maps), or None."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def is_mapped_from(group, cache: Path) -> bool:
    """Whether every chunk of the group's master lies in a mapping of a file in `cache`."""
    files = [mapped_file(chunk) for chunk in group.host_master.chunks]
    return all(f is not None and Path(f).parent == cache.resolve() for f in files)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- (a) a warm restart maps the cache ----------------------------------------------------------


def test_a_second_start_maps_the_cache_and_matches_the_plain_pipeline(wan, tmp_path):
    cache = tmp_path / "cache"  # created at the first use
    plain = load(wan)
    expected, expected_weights = outputs(plain), weights(plain)

    first, scheduler, groups = start(wan, cache)
    assert len(cache_files(cache)) == len(NAMES)
    assert not any(is_mapped_from(g, cache) for g in groups.values())  # packed, then written
    assert_same(outputs(first, scheduler), expected)
    scheduler.close()

    second, scheduler, groups = start(wan, cache)
    for name, group in groups.items():
        assert is_mapped_from(group, cache), name
        assert all(chunk.data_ptr() % 4096 == 0 for chunk in group.host_master.chunks)
    assert_same(weights(second), expected_weights)
    assert_same(outputs(second, scheduler), expected)
    assert_same(outputs(second, scheduler), outputs(plain))  # the n-th call with the n-th call
    assert len(cache_files(cache)) == len(NAMES)


def test_a_warm_restart_through_enable_offload_runs_the_pipeline_bit_identically(wan, tmp_path):
    """The users' call: ``enable_offload(pipe, host=...)``; the second start's groups are all
    mapped from the cache, and a whole pipeline call equals the plain pipeline's bits."""
    cache = tmp_path / "cache"
    expected = load(wan)(**wan22_call()).frames
    for run in range(2):
        pipe = load(wan)
        scheduler = enable_offload(pipe, device="cpu", host={"cache_directory": cache})
        assert [is_mapped_from(scheduler[name], cache) for name in scheduler] == (
            [run == 1] * len(scheduler))
        assert torch.equal(pipe(**wan22_call()).frames, expected)
        disable_offload(pipe)


def test_an_edit_while_resident_is_kept_and_the_cache_file_never_changes(wan, tmp_path):
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    before = {path: digest(path) for path in cache_files(cache)}
    pipe, scheduler, groups = start(wan, cache)
    assert is_mapped_from(groups["transformer"], cache)
    weight = pipe.transformer.proj_out.weight
    with scheduler.resident("transformer"):
        with torch.no_grad():
            weight.add_(1.0)
        edited = weight.detach().clone()
    with scheduler.resident("vae"):  # the transformer leaves: its edit goes back to the master
        pass
    assert torch.equal(weight, edited)  # offloaded: a view of the mapped master
    assert is_mapped_from(groups["transformer"], cache)
    with scheduler.resident("transformer"):
        assert torch.equal(weight, edited)
    assert {path: digest(path) for path in cache_files(cache)} == before
    scheduler.close()
    third, scheduler, _ = start(wan, cache)  # the next start gets the files' weights back
    assert_same(weights(third), weights(load(wan)))


# -- (c) changed source files -------------------------------------------------------------------


def test_rewritten_weight_files_rebuild_the_cache_with_the_new_weights(wan, tmp_path):
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    old = set(cache_files(cache))
    tiny_wan22(seed=1).save_pretrained(wan)  # the same names and sizes, other values
    new_plain = load(wan)
    pipe, scheduler, groups = start(wan, cache)
    assert not any(is_mapped_from(g, cache) for g in groups.values())
    assert_same(weights(pipe), weights(new_plain))
    assert_same(outputs(pipe, scheduler), outputs(new_plain))
    assert len(cache_files(cache)) == len(NAMES) and not old & set(cache_files(cache))
    scheduler.close()
    again, scheduler, groups = start(wan, cache)
    assert all(is_mapped_from(g, cache) for g in groups.values())
    assert_same(weights(again), weights(new_plain))


def test_a_touched_weight_file_is_not_served_from_the_cache(wan, tmp_path):
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    (weight_file,) = (wan / "vae").glob("*.safetensors")
    info = weight_file.stat()
    os.utime(weight_file, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000))
    pipe, _, groups = start(wan, cache)
    assert not is_mapped_from(groups["vae"], cache)
    assert is_mapped_from(groups["transformer"], cache)
    assert_same(weights(pipe), weights(load(wan)))


# -- (d) a file for another alignment class or layout, truncated or damaged ---------------------


def _keyed(folder: Path, name: str, alignment, chunk_nbytes=DEFAULT_CHUNK_NBYTES):
    module = getattr(load(folder), name)
    inventory = take_inventory([module], alignment=alignment, chunk_nbytes=chunk_nbytes)
    sources = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
    key, why = group_key(inventory, alignment, sources)
    assert key is not None, why
    return module, inventory, key


def test_the_key_names_the_alignment_class_and_the_layout(wan):
    _, cpu_inventory, cpu_key = _keyed(wan, "text_encoder", CPU_ALIGNMENT)
    _, _, accelerator_key = _keyed(wan, "text_encoder", ACCELERATOR_ALIGNMENT)
    _, _, small_chunks_key = _keyed(wan, "text_encoder", CPU_ALIGNMENT, chunk_nbytes=4096)
    assert len({cpu_key, accelerator_key, small_chunks_key}) == 3
    assert _keyed(wan, "text_encoder", CPU_ALIGNMENT)[2] == cpu_key  # a fresh load: the same


def test_a_file_built_for_another_alignment_class_is_not_used(wan, tmp_path, caplog):
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    _, inventory, accelerator_key = _keyed(wan, "text_encoder", ACCELERATOR_ALIGNMENT)
    (path,) = cache.glob("text_encoder-*.master")
    # A file for the accelerator's layout, under the name the CPU start looks for.
    packer_chunks = [torch.zeros(n, dtype=torch.uint8) for n in inventory.layout.chunk_nbytes]
    assert write_master(path, accelerator_key, inventory.layout, packer_chunks)
    with caplog.at_level(logging.INFO, logger="residency"):
        pipe, scheduler, groups = start(wan, cache)
    assert "built for other weight files, another layout or another alignment class" in caplog.text
    assert not is_mapped_from(groups["text_encoder"], cache)
    assert_same(weights(pipe), weights(load(wan)))
    scheduler.close()
    assert is_mapped_from(start(wan, cache)[2]["text_encoder"], cache)  # rebuilt


def test_a_file_for_another_layout_is_not_used_and_is_replaced(wan, tmp_path):
    """Chunks of 16 KiB split every group but the text encoder (10 KB, the same layout as
    before: its file is still the right one)."""
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    old = set(cache_files(cache))
    pipe, scheduler, groups = start(wan, cache, chunk_nbytes=16384)
    split = [name for name in NAMES if len(groups[name].host_master.chunks) > 1]
    assert split == ["transformer", "transformer_2", "vae"]
    assert not any(is_mapped_from(groups[name], cache) for name in split)
    assert is_mapped_from(groups["text_encoder"], cache)
    assert_same(weights(pipe), weights(load(wan)))
    assert_same(outputs(pipe, scheduler), outputs(load(wan)))
    now = set(cache_files(cache))
    assert len(now) == len(NAMES) and len(old & now) == 1  # the split groups' files replaced
    _, inventory, key = _keyed(wan, "transformer", CPU_ALIGNMENT)
    (stale,) = [p for p in old if p.name.startswith("transformer-")]
    assert not stale.exists()
    assert map_master(cache_path(cache, "transformer", key), key, inventory.layout) is None


@pytest.mark.parametrize("damage", ["truncated", "magic", "header", "length", "empty"])
def test_a_truncated_or_damaged_file_is_rebuilt(wan, tmp_path, caplog, damage):
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    (path,) = cache.glob("transformer-*.master")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "magic":
        data[:4] = b"junk"
    elif damage == "header":
        data[30:40] = b"}}}}}}}}}}"
    elif damage == "length":  # the header's length field: 4 GiB
        data[20:24] = b"\xff\xff\xff\xff"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="residency"):
        pipe, scheduler, groups = start(wan, cache)
    assert "rebuilding it" in caplog.text
    assert not is_mapped_from(groups["transformer"], cache)
    assert is_mapped_from(groups["vae"], cache)
    assert_same(outputs(pipe, scheduler), outputs(load(wan)))
    scheduler.close()
    assert is_mapped_from(start(wan, cache)[2]["transformer"], cache)  # the rebuilt file


# -- (e) a full disk ----------------------------------------------------------------------------

def _start_on_a_full_disk(folder: Path, cache: Path) -> dict:
    """In a forked child whose files may not grow past 20000 bytes (RLIMIT_FSIZE, SIGXFSZ
    ignored: writes past it fail with EFBIG, as writes to a full disk fail with ENOSPC): start
    with the cache, compare with the plain pipeline, and report."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read)
            report = _full_disk_report(folder, cache)
            os.write(write, json.dumps(report).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child failed"
    return json.loads(data)


def _full_disk_report(folder: Path, cache: Path) -> dict:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    torch.set_num_threads(1)  # a forked child: no OpenMP pool of the parent's
    plain = outputs(load(folder))
    pipe = load(folder)
    cache.mkdir()
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = Scheduler("cpu", host={"cache_directory": cache})
        for name in NAMES:
            scheduler.add(name, getattr(pipe, name))
    found = outputs(pipe, scheduler)
    return {
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
        "files": sorted(os.listdir(cache)),
        "same": {name: torch.equal(found[name], plain[name]) for name in plain},
    }


def test_a_full_disk_warns_leaves_nothing_and_the_run_goes_on(wan, tmp_path):
    """The text encoder's cache (14 KB) is written; the others' writes fail with EFBIG: each
    warns, leaves no file (final or temporary), and the outputs are the plain pipeline's bits."""
    report = _start_on_a_full_disk(wan, tmp_path / "cache")
    assert report["same"] == {"text_encoder": True, "transformer": True, "transformer_2": True,
                              "vae": True}
    assert [name.split("-")[0] for name in report["files"]] == ["text_encoder"]
    not_written = [w for w in report["warnings"] if "was not written" in w]
    assert len(not_written) == 3, report["warnings"]
    assert all("the file would exceed the allowed file size" in w for w in not_written)
    assert all("goes on with the master in memory" in w for w in not_written)


def test_a_cache_directory_that_cannot_be_made_warns_once_and_the_run_goes_on(wan, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="cannot be used: it cannot be created") as caught:
        pipe, scheduler, _ = start(wan, blocker / "cache")
    assert len([w for w in caught if "cannot be used" in str(w.message)]) == 1
    assert_same(outputs(pipe, scheduler), outputs(load(wan)))


@pytest.mark.fast
def test_a_dead_writers_temporary_file_is_removed_by_the_next_write(wan, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    left = cache / f"vae-x.master.{int(dead.stdout)}-0a1b2c3d.partial"
    left.write_bytes(b"half a master")
    mine = cache / f"vae-y.master.{os.getpid()}-0a1b2c3d.partial"  # a live writer's
    mine.write_bytes(b"being written")
    start(wan, cache)
    assert not left.exists() and mine.exists()


# -- (f) interrupts -----------------------------------------------------------------------------


@pytest.mark.fast
def test_an_interrupt_anywhere_in_writing_leaves_no_file_or_a_whole_one(wan, tmp_path):
    module, inventory, key = _keyed(wan, "text_encoder", CPU_ALIGNMENT)
    expected = weights_of(module)
    chunks = HostMaster.pack(inventory, CpuTransport(), pin=False).chunks
    runs = iter(range(10**6))

    def build():
        folder = tmp_path / f"run{next(runs)}"
        folder.mkdir()
        return cache_path(folder, "text_encoder", key)

    def check(path):
        assert [p.name for p in path.parent.iterdir() if p.name.endswith(".partial")] == []
        if path.exists():
            mapped = map_master(path, key, inventory.layout)
            assert mapped is not None
            assert all(torch.equal(a, b) for a, b in zip(mapped.chunks, chunks))
        assert_same(weights_of(module), expected)

    points = sweep(build, lambda path: write_master(path, key, inventory.layout, chunks), check)
    assert points > 20


def weights_of(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_an_interrupt_anywhere_in_mapping_keeps_every_weight(wan, tmp_path):
    """Every line of the map path (`map_master`, `HostMaster.over_chunks`), then every 1000th of
    a whole ``add`` that maps: the weights keep their values, the file never changes."""
    cache = tmp_path / "cache"
    start(wan, cache)[1].close()
    before = {path: digest(path) for path in cache_files(cache)}
    expected = weights_of(load(wan).text_encoder)
    encoder_class, encoder_folder = type(load(wan).text_encoder), wan / "text_encoder"

    def build_inventory():
        module = encoder_class.from_pretrained(encoder_folder)
        inventory = take_inventory([module])
        sources = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
        key = group_key(inventory, CPU_ALIGNMENT, sources)[0]
        return module, inventory, cache_path(cache, "text_encoder", key), key

    def map_path(world):
        _, inventory, path, key = world
        mapped = map_master(path, key, inventory.layout)
        assert mapped is not None
        master = HostMaster.over_chunks(inventory, mapped.chunks, pinned=False)
        assert mapped_file(master.views[0]) == str(path)

    def check_module(world):
        assert_same(weights_of(world[0]), expected)
        assert {path: digest(path) for path in cache_files(cache)} == before

    assert sweep(build_inventory, map_path, check_module) > 20

    def build():
        module = encoder_class.from_pretrained(encoder_folder)
        return module, Scheduler("cpu", host={"cache_directory": cache})

    def add(world):
        assert is_mapped_from(world[1].add("text_encoder", world[0]), cache)

    def check(world):
        module, scheduler = world
        assert consistent(scheduler) == []
        check_module(world)
        if "text_encoder" in scheduler:
            with scheduler.resident("text_encoder"):
                assert_same(weights_of(module), expected)

    sweep(build, add, check, stride=1000, every_line=False)
