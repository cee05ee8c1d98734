"""Masters read behind the first phase (issue 23): ``add`` returns before a group's weight files
are read, the files are read in first-use order on the scheduler's thread, and a group's first
load waits for its own bytes only - with every weight as the plain pipeline has it (on the CPU and
on the simulated accelerator), every edit made meanwhile kept (peft's merge included), failures
typed, removed groups' reads stopped, and an interrupt at any line of an add or of the commit
leaving the weights and the owners intact.

A `Gate` holds the reads of chosen components (their folder's name) until it is opened and
records which component each chunk read was for: the tests see the order and the overlap
without timing anything.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from residency import ConfigError, PhaseError, Scheduler, WeightFileError
from residency.host import read_behind
from residency.host.file_reads import FileReader, FileSource, find_file_sources
from residency.modules.tensors import take_inventory

from _helpers import assert_same_tensors, every_tensor
from _tiny_pipelines import wan22_call

#: In the order a call first uses them (and the adapter adds them).
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
ALL = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}


@pytest.fixture(scope="module")
def saved(saved_wan22) -> Path:
    return saved_wan22


def _inside(thread_id: int, function: str, file_name: str) -> bool:
    """Whether thread `thread_id` is running `function` of a file named `file_name` now."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_name == function and code.co_filename.endswith(file_name):
            return True
        frame = frame.f_back
    return False


class Gate:
    """Holds the chunk reads of the components named at construction until `open`; records the
    component of every chunk read in `reads`, in order."""

    def __init__(self, *closed: str) -> None:
        self.closed = {name: threading.Event() for name in closed}
        self.reads: list[str] = []

    def open(self, name: str) -> None:
        self.closed[name].set()

    def install(self, monkeypatch) -> None:
        """The scheduler's reading thread reads through this gate (our own module's name)."""
        gate = self

        class GatedReader(FileReader):
            def start(self, chunk, reads):
                reads = list(reads)
                for name in sorted({Path(source.path).parent.name for source, _, _ in reads}):
                    gate.reads.append(name)
                    if name in gate.closed:
                        assert gate.closed[name].wait(30), f"the gate for {name} stayed closed"
                super().start(chunk, reads)

        monkeypatch.setattr(read_behind, "FileReader", GatedReader)


def load(folder: Path, **kwargs):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def offloaded(folder: Path, config=ALL, **kwargs):
    from diffusers import DiffusionPipeline

    from residency.adapters.diffusers import from_pretrained

    pipe = from_pretrained(DiffusionPipeline, folder, config, device="cpu", **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def still_on_its_files(module) -> bool:
    """Whether every saved tensor of `module` is still an untouched view of its weight file."""
    inventory = take_inventory([module])
    found = find_file_sources(inventory.source_regions, inventory.layout.region_nbytes)
    saved = {id(tensor) for tensor in module.state_dict(keep_vars=True).values()}
    return all(isinstance(found[place.region], FileSource)
               for tensor, place in zip(inventory.tensors, inventory.places) if id(tensor) in saved)


def arriving(scheduler) -> list[str]:
    return [name for name in scheduler if scheduler[name].host_master.arrival is not None]


def no_reading_thread_left() -> bool:
    """Whether the scheduler's reading thread ended (it ends once its queue is empty)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name in ("residency-arrive",
                                                               "residency-read")]:
            return True
        time.sleep(0.01)
    return False


def test_from_pretrained_returns_before_the_reads_and_a_call_is_bit_identical(saved: Path):
    from residency.adapters.diffusers import offload_scheduler

    plain = load(saved)
    expected = plain(**wan22_call(seed=0)).frames
    pipe = offloaded(saved)
    scheduler = offload_scheduler(pipe)
    assert list(scheduler) == list(COMPONENTS)  # added in the order a call first uses them
    # The encoder sits on the device (its read was waited for); the others wait for their phase.
    assert arriving(scheduler) == ["transformer", "transformer_2", "vae"]
    assert all(still_on_its_files(getattr(pipe, name)) for name in arriving(scheduler))
    assert torch.equal(pipe(**wan22_call(seed=0)).frames, expected)
    assert arriving(scheduler) == []
    for name in COMPONENTS:
        assert_same_tensors(getattr(pipe, name), getattr(plain, name), name)
        group = scheduler[name]
        if not group.is_resident:  # offloaded: every tensor views its master's chunks
            chunks = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in group.host_master.chunks]
            assert all(any(a <= t.data_ptr() < b for a, b in chunks)
                       for t in group.tensors if t.numel()), name
    assert no_reading_thread_left()


@pytest.mark.fast
def test_background_reads_can_be_switched_off(saved: Path):
    from residency.adapters.diffusers import offload_scheduler

    pipe = offloaded(saved, host={"background_reads": False})
    assert arriving(offload_scheduler(pipe)) == []
    assert not any(still_on_its_files(getattr(pipe, name)) for name in COMPONENTS[1:])


def two_experts(folder: Path, monkeypatch, gate: Gate, **host):
    """The two experts of a fresh load under a scheduler that reads behind, in parts of 8 KiB."""
    gate.install(monkeypatch)
    pipe = load(folder)
    scheduler = Scheduler("cpu", chunk_nbytes=2**13, host={"background_reads": True, **host})
    scheduler.add("transformer", pipe.transformer)
    scheduler.add("transformer_2", pipe.transformer_2)
    return pipe, scheduler


def test_a_phase_waits_for_its_own_group_only(saved: Path, monkeypatch):
    gate = Gate("transformer_2")
    pipe, scheduler = two_experts(saved, monkeypatch, gate)
    plain = load(saved)
    with scheduler.resident("transformer"):  # transformer_2's reads are held meanwhile
        assert_same_tensors(pipe.transformer, plain.transformer, "transformer")
    assert arriving(scheduler) == ["transformer_2"]
    assert scheduler["transformer_2"].host_master.still_reading
    assert scheduler.prefetch("transformer_2") is False  # a prefetch does not wait for reads
    gate.open("transformer_2")
    with scheduler.resident("transformer_2"):
        assert_same_tensors(pipe.transformer_2, plain.transformer_2, "transformer_2")
    assert gate.reads[0] == "transformer" and set(gate.reads) == {"transformer", "transformer_2"}
    scheduler.close()
    assert no_reading_thread_left()


def test_the_group_a_phase_asks_for_is_read_next(saved: Path, monkeypatch):
    gate = Gate("transformer")  # the first chunk of the first group added is held
    pipe, scheduler = two_experts(saved, monkeypatch, gate)
    queue = scheduler._packer._reads  # white-box: the gate opens once the phase hurried it

    def open_once_hurried():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                queue._queue and queue._queue[0].name == "transformer_2"):
            time.sleep(0.005)
        gate.open("transformer")

    threading.Thread(target=open_once_hurried, daemon=True).start()
    with scheduler.resident("transformer_2"):
        pass
    # transformer_2 was read whole right after the chunk in flight, before transformer's rest.
    first = gate.reads.index("transformer_2")
    assert gate.reads[:first] == ["transformer"]
    assert gate.reads[first:].count("transformer_2") == gate.reads.count("transformer_2") > 1
    assert gate.reads[first + gate.reads.count("transformer_2"):].count("transformer") > 0
    with scheduler.resident("transformer"):
        assert_same_tensors(pipe.transformer, load(saved).transformer, "transformer")
    scheduler.close()


@pytest.mark.parametrize("when", ["after the reads", "during the reads"])
def test_edits_before_the_first_load_are_kept(saved: Path, monkeypatch, when: str):
    """In place, through .data, by a kernel writing the bytes (ctypes), new storage, and a
    buffer computed at construction (not in the file): each is the weight after the load."""
    import ctypes

    gate = Gate("transformer_2")
    pipe, scheduler = two_experts(saved, monkeypatch, gate)
    if when == "after the reads":
        gate.open("transformer_2")
        deadline = time.monotonic() + 10
        while scheduler["transformer_2"].host_master.still_reading and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        assert not scheduler["transformer_2"].host_master.still_reading
    reference = load(saved).transformer_2
    for model in (pipe.transformer_2, reference):
        block = model.blocks[0]
        with torch.no_grad():
            model.proj_out.weight.mul_(2)
            block.ffn.net[0].proj.weight.data.add_(1)
            model.scale_shift_table.data = model.scale_shift_table.detach() * 3
            model.rope.freqs_cos.add_(0.5)
        bias = block.attn1.to_q.bias
        ctypes.memset(bias.data_ptr(), 0, bias.numel() * bias.element_size())
    gate.open("transformer_2")
    with scheduler.resident("transformer_2"):
        assert_same_tensors(pipe.transformer_2, reference, "transformer_2")
    with scheduler.resident("transformer"):
        pass
    assert_same_tensors(pipe.transformer_2, reference, "transformer_2, offloaded")
    scheduler.close()


def test_a_lora_merged_by_peft_while_the_reads_go_on_is_kept(saved: Path, monkeypatch):
    """peft's merge writes ``base_layer.weight.data`` in place (no version counter moves), into
    pages the reader is reading from the file meanwhile: the commit copies the merged bytes."""
    peft = pytest.importorskip("peft")
    gate = Gate("transformer_2")
    pipe, scheduler = two_experts(saved, monkeypatch, gate)
    reference = load(saved).transformer_2
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"],
                             init_lora_weights=False)
    for model in (pipe.transformer_2, reference):
        torch.manual_seed(11)
        peft.get_peft_model(model.blocks[0], config).merge_and_unload()  # structure as before
    assert not still_on_its_files(pipe.transformer_2)
    gate.open("transformer_2")
    with scheduler.resident("transformer_2"):
        assert_same_tensors(pipe.transformer_2, reference, "transformer_2")
    assert not torch.equal(reference.blocks[0].attn1.to_q.weight,
                           load(saved).transformer_2.blocks[0].attn1.to_q.weight)  # it merged
    scheduler.close()


@pytest.mark.fast
def test_a_group_changed_before_its_first_load_is_re_packed_and_its_reads_dropped(
        saved: Path, monkeypatch):
    gate = Gate("transformer_2")
    pipe, scheduler = two_experts(saved, monkeypatch, gate)
    reference = load(saved).transformer_2
    for model in (pipe.transformer_2, reference):
        model.extra = torch.nn.Parameter(torch.arange(4.0))  # a new parameter: re-packed
    old = scheduler["transformer_2"].host_master.arrival
    gate.open("transformer_2")
    with scheduler.resident("transformer_2"):  # re-packed (read behind again), then loaded
        assert_same_tensors(pipe.transformer_2, reference, "transformer_2")
    assert old.cancelled and old not in scheduler._packer._reads._queue
    scheduler.close()
    assert no_reading_thread_left()


@pytest.mark.fast
def test_a_file_truncated_before_its_read_is_a_typed_error(saved: Path, monkeypatch, tmp_path):
    import shutil

    folder = Path(shutil.copytree(saved, tmp_path / "wan"))
    gate = Gate("transformer_2")
    pipe, scheduler = two_experts(folder, monkeypatch, gate)
    weights = folder / "transformer_2" / "diffusion_pytorch_model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, 100)
    gate.open("transformer_2")
    for _ in range(2):  # every load says so, and changes nothing
        with pytest.raises(WeightFileError) as error:
            with scheduler.resident("transformer_2"):
                pass
        message = str(error.value)  # every word: tests/test_truncated_weights.py
        assert message.startswith(
            f"cannot load group 'transformer_2': the weight file {weights} was truncated to 100 "
            f"bytes (it had {size} bytes when the pipeline was loaded) before the group's first "
            "load, so 42 of the 44 tensors (")
        assert message.endswith(
            "Load the pipeline again (from_pretrained) once the file is restored (download it "
            "again); until then every load of group 'transformer_2' raises this error")
        assert not scheduler["transformer_2"].is_resident
        assert "transformer_2" in arriving(scheduler)
    # Past the cut, every tensor is on the meta device: none views the file's mapping any more.
    lost = [t for t in pipe.transformer_2.state_dict().values() if t.is_meta]
    assert len(lost) == 42
    with scheduler.resident("transformer"):  # the other group is unaffected
        assert_same_tensors(pipe.transformer, load(saved).transformer, "transformer")
    scheduler.remove("transformer_2")
    scheduler.close()


def test_a_file_replaced_before_its_read_leaves_the_loaded_weights(saved, monkeypatch, tmp_path):
    import shutil

    folder = Path(shutil.copytree(saved, tmp_path / "wan"))
    gate = Gate("transformer_2")
    pipe, scheduler = two_experts(folder, monkeypatch, gate)
    weights = folder / "transformer_2" / "diffusion_pytorch_model.safetensors"
    replacement = bytearray(weights.read_bytes())
    replacement[-4096:] = bytes(4096)
    (tmp_path / "new").write_bytes(replacement)
    os.replace(tmp_path / "new", weights)  # a new inode, other bytes at the same offsets
    gate.open("transformer_2")
    with scheduler.resident("transformer_2"):  # its mapping still holds the loaded bytes
        assert_same_tensors(pipe.transformer_2, load(saved).transformer_2, "transformer_2")
    assert "transformer_2" in gate.reads  # the part was asked for, and read from memory
    scheduler.close()


@pytest.mark.fast
def test_a_removed_group_is_not_read_and_keeps_its_file_views(saved: Path, monkeypatch):
    gate = Gate("transformer")
    pipe, scheduler = two_experts(saved, monkeypatch, gate)
    scheduler.remove("transformer_2")
    gate.open("transformer")
    assert no_reading_thread_left()
    assert "transformer_2" not in gate.reads
    assert still_on_its_files(pipe.transformer_2)
    assert_same_tensors(pipe.transformer_2, load(saved).transformer_2, "transformer_2")
    scheduler.close()  # transformer: never loaded either; its reads were dropped
    assert still_on_its_files(pipe.transformer)


@pytest.mark.fast
def test_only_groups_on_weight_files_are_read_behind(saved: Path, tmp_path: Path):
    pipe = load(saved)
    scheduler = Scheduler("cpu", host={"background_reads": True})
    scheduler.add("in_memory", torch.nn.Linear(8, 8))  # nothing to read: packed at add
    scheduler.add("transformer", pipe.transformer)
    assert arriving(scheduler) == ["transformer"]
    scheduler.close()
    cached = Scheduler("cpu", host={"background_reads": True, "cache_directory": tmp_path})
    cached.add("transformer_2", pipe.transformer_2)  # the cache needs the master at add
    assert arriving(cached) == []
    cached.close()


@pytest.mark.fast
def test_measuring_the_floor_of_a_master_still_arriving_is_refused(saved: Path, monkeypatch):
    from residency.app.timeline import measure_floor

    gate = Gate("transformer_2")
    _, scheduler = two_experts(saved, monkeypatch, gate)
    with pytest.raises(PhaseError) as error:
        measure_floor(scheduler)
    assert str(error.value) == (
        "measure_floor: the host masters of ['transformer', 'transformer_2'] are still read "
        "behind the first phase (never loaded yet); call it after each group's first phase")
    gate.open("transformer_2")
    scheduler.close()


def test_a_phase_waiting_for_its_reads_says_how_far_they_are(saved, monkeypatch, caplog):
    """Off a terminal: log lines per 10% while a phase waits (masters over PROGRESS_THRESHOLD;
    lowered here so the tiny expert counts as large)."""
    import logging

    from residency.host import memory

    monkeypatch.setattr(memory, "PROGRESS_THRESHOLD", 1)
    gate = Gate("transformer_2")
    _, scheduler = two_experts(saved, monkeypatch, gate)
    waiter = threading.get_ident()

    def open_once_waiting():  # once this thread waits in the phase (no timer: under load the
        deadline = time.monotonic() + 30  # reads could end before the phase began to wait)
        while time.monotonic() < deadline and not _inside(waiter, "_wait", "read_behind.py"):
            time.sleep(0.005)
        gate.open("transformer_2")

    threading.Thread(target=open_once_waiting, daemon=True).start()
    with caplog.at_level(logging.INFO, logger="residency"):
        with scheduler.resident("transformer_2"):
            pass
    lines = [r.getMessage() for r in caplog.records if "waiting for group" in r.getMessage()]
    assert lines and lines[-1].startswith(
        "waiting for group 'transformer_2': reading its host master: 100% of 0.0 GiB")
    scheduler.close()


@pytest.mark.fast
def test_background_reads_must_be_a_flag():
    with pytest.raises(ConfigError) as error:
        Scheduler("cpu", host={"background_reads": "on"})
    assert str(error.value) == "background_reads='on'; give True or False"


@pytest.mark.gpu
def test_on_an_accelerator_a_master_read_behind_is_pinned_and_exact(saved: Path):
    """The reading thread allocates pinned chunks; the copies to the device run on the copy
    stream after the commit: every weight on the device is the plain model's (the simulated
    device's delays make a missing wait show as wrong bits)."""
    from _accelerator import device as accelerator_device

    device = accelerator_device()
    pipe = load(saved)
    scheduler = Scheduler(device, host={"background_reads": True})
    for name in ("transformer", "transformer_2"):
        scheduler.add(name, getattr(pipe, name))
    assert arriving(scheduler) == ["transformer", "transformer_2"]
    for _ in range(2):
        for name in ("transformer", "transformer_2"):
            reference = getattr(load(saved), name).to(device)
            with scheduler.resident(name):
                assert_same_tensors(getattr(pipe, name), reference, name)
    for name in ("transformer", "transformer_2"):
        master = scheduler[name].host_master
        assert master.pinned and all(chunk.is_pinned() for chunk in master.chunks)
    torch.accelerator.synchronize()
    scheduler.close()


# -- interrupts: the commit of an arrived master, at every line ------------------------------------

#: Interrupt every n-th point of the first load's sweep, and of the add's under ``--sweep=lines``
#: (which CI interrupts at each line's first execution; READ_BEHIND_STRIDE=1: every point).
SWEEP_STRIDE = int(os.environ.get("READ_BEHIND_STRIDE", 29))


@pytest.mark.beside
def test_an_interrupt_anywhere_in_a_first_load_keeps_the_weights(saved: Path):
    # Not marked `beside`: run in the parent, which otherwise waits for the second child.
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from _interrupts import consistent, sweep

    reference = {name: tensor.detach().clone() for name, tensor in every_tensor(
        WanTransformer3DModel.from_pretrained(saved / "transformer")).items()}

    def build():
        model = WanTransformer3DModel.from_pretrained(saved / "transformer")
        scheduler = Scheduler("cpu", chunk_nbytes=2**16, host={"background_reads": True})
        scheduler.add("transformer", model)
        scheduler.add("text_encoder", UMT5EncoderModel.from_pretrained(saved / "text_encoder"))
        group = scheduler["transformer"]
        assert group.host_master.arrival is not None
        assert group.host_master.arrival.done.wait(10)  # the points: the commit and the load
        return scheduler, model

    def operation(world):
        with world[0].resident("transformer"):
            pass

    def intact(world):
        scheduler, model = world
        assert consistent(scheduler) == []
        for _ in range(2):  # its first load completes what the interrupt left, then it leaves
            for name in ("transformer", "text_encoder"):
                with scheduler.resident(name):
                    pass
            assert scheduler["transformer"].host_master.arrival is None
            tensors = every_tensor(model)
            assert tensors.keys() == reference.keys()
            for name, tensor in tensors.items():
                assert torch.equal(tensor.detach(), reference[name]), name
        scheduler.close()

    points = sweep(build, operation, intact, stride=SWEEP_STRIDE, every_line=False)
    assert points > 50


@pytest.mark.beside
def test_an_interrupt_anywhere_in_an_add_that_reads_behind_keeps_the_weights(saved: Path):
    """An add interrupted at any line: undone (the arrival cancelled, the tensors the file views
    they were) or done (the group loads and is exact); no reading thread is left behind."""
    from diffusers import WanTransformer3DModel

    from _interrupts import consistent, sweep

    reference = {name: tensor.detach().clone() for name, tensor in every_tensor(
        WanTransformer3DModel.from_pretrained(saved / "transformer")).items()}

    def build():
        model = WanTransformer3DModel.from_pretrained(saved / "transformer")
        return Scheduler("cpu", chunk_nbytes=2**16, host={"background_reads": True}), model

    def operation(world):
        world[0].add("transformer", world[1])

    def intact(world):
        scheduler, model = world
        assert consistent(scheduler) == []
        if "transformer" in scheduler:
            with scheduler.resident("transformer"):
                pass
        tensors = every_tensor(model)
        assert tensors.keys() == reference.keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor.detach(), reference[name]), name
        scheduler.close()
        assert no_reading_thread_left()

    points = sweep(build, operation, intact, stride=SWEEP_STRIDE)  # CI: every line, once
    assert points > 20
