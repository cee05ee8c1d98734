"""A weight file truncated under a pipeline loaded with ``from_pretrained`` (issue 32): every
load of its group gets a `WeightFileError` that says what is lost, and afterwards - after a
refused load, after ``disable_offload``, after a refused ``add`` - no tensor the library gave
back views the file's mapping, so reading every weight cannot kill the process (SIGBUS).

Each case runs in a child process (this file run as a script, forked from a server that has
imported diffusers: `_forkserver.run_python`), since a SIGBUS ends the interpreter: the child
exits 0, or dies by the signal (return code -7) where the library still leaves a tensor on the
cut mapping.  The child reads every weight, checks with /proc/self/maps that none views the
truncated file, and saves the readable ones; this process compares them, bit for bit, with the
same pipeline loaded plain from an untouched copy, and the meta ones with the tensors the file's
own header places past the cut.  The file is cut at half its size: some of transformer_2's
tensors lie before the cut (copied out, exact), some past it (lost, meta).

Two interrupt sweeps (also in a child) cover the new steps: a first load that finds the file cut
short after its reads (the loss found and the tensors moved off the mapping), and a ``close``
that finds it (the same, with the warning); every point leaves the owners consistent, the lost
tensors meta, the others exact, none on the mapping.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

#: The file cut short, in the saved tiny Wan2.2's folder, and its component.
CUT = "transformer_2/diffusion_pytorch_model.safetensors"
COMPONENT = "transformer_2"
ALL = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
#: Interrupt every n-th point of the sweeps (TRUNCATED_SWEEP_STRIDE=1: every point).
SWEEP_STRIDE = int(os.environ.get("TRUNCATED_SWEEP_STRIDE", 17))
SIGBUS_EXIT = -7


# -- what the header says is lost -------------------------------------------------------------------


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return 8 + length, json.loads(raw[8:8 + length])


def cut_at(path: Path) -> int:
    """Where the tests cut the file: half its size."""
    return path.stat().st_size // 2


def lost_names(path: Path, cut: int) -> set[str]:
    """The tensors the file's header places, whole or in part, past byte `cut`."""
    start, header = _header(path)
    return {name for name, entry in header.items()
            if name != "__metadata__" and start + entry["data_offsets"][1] > cut}


def lost_words(folder: Path, cut: int) -> str:
    """The message's words for the lost tensors of the component: how many of its tensors, their
    bytes (from the header), the first three names in the order the group lists its tensors."""
    from diffusers import WanTransformer3DModel

    from residency.modules.tensors import take_inventory

    start, header = _header(folder / CUT)
    lost = lost_names(folder / CUT, cut)
    model = WanTransformer3DModel.from_pretrained(folder / COMPONENT)
    names = {id(t): n for n, t in reversed(list(_every_tensor(model).items()))}
    inventory = take_inventory([model])
    order = [names[id(t)] for t in inventory.tensors if names[id(t)] in lost]
    nbytes = sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in lost)
    shown = ", ".join(repr(n) for n in order[:3])
    return (f"{len(lost)} of the {inventory.tensor_count} tensors ({nbytes} bytes: {shown} and "
            f"{len(lost) - 3} more)")


def loss_words(path: str, cut: int, size: int, tensors: str) -> str:
    return (f"the weight file {path} was truncated to {cut} bytes (it had {size} bytes when the "
            f"pipeline was loaded)"), (
        f"{tensors} lie past where it ends now: their values are lost (neither the file nor "
        "memory holds them). Those tensors are on the meta device now, so reading one raises an "
        "error; the group's other tensors were copied into host memory. Load the pipeline again "
        "(from_pretrained) once the file is restored (download it again)")


def load_error(path: str, cut: int, size: int, tensors: str) -> str:
    """What every load of the group raises once the file is found cut short."""
    files, lost = loss_words(path, cut, size, tensors)
    return (f"cannot load group {COMPONENT!r}: {files} before the group's first load, so {lost}; "
            f"until then every load of group {COMPONENT!r} raises this error")


def leave_warning(path: str, cut: int, size: int, tensors: str) -> str:
    """What the group's removal warns when no load raised the loss."""
    files, lost = loss_words(path, cut, size, tensors)
    return f"group {COMPONENT!r} left the scheduler after {files}: {lost}"


def add_error(path: str, cut: int, tensors: str) -> str:
    """What an ``add`` of the component raises when the file was cut before it."""
    return (f"the weight file {path} was truncated to {cut} bytes since the tensors were loaded "
            f"from it: {tensors} lie past where it ends now, so their values are lost, and "
            "reading one would kill the process (SIGBUS). Load the pipeline (or the model) again "
            "once the file is restored (download it again); nothing was offloaded")


# -- the tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(saved_wan22) -> Path:
    return saved_wan22


@pytest.fixture
def folder(pristine, tmp_path) -> Path:
    """A copy of the saved pipeline this test may cut."""
    return Path(shutil.copytree(pristine, tmp_path / "wan"))


def run_child(scenario: str, folder: Path, out: Path, *args: str, timeout: float = 240):
    from _forkserver import DIFFUSERS, run_python

    out.mkdir(exist_ok=True)
    done = run_python([__file__, scenario, str(folder), str(out), *args], preload=DIFFUSERS,
                      timeout=timeout)
    assert done.returncode != SIGBUS_EXIT, (
        f"the child died by SIGBUS: a tensor still viewed the truncated file\n{done.stderr[-3000:]}")
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


def assert_weights_as_loaded(out: Path, pristine: Path, result: dict, when: str) -> None:
    """The child's weights `when`: transformer_2's tensors past the cut meta, every other weight
    of every component the plain pipeline's, bit for bit."""
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(pristine)
    saved = torch.load(out / f"weights-{when}.pt")
    lost = lost_names(pristine / CUT, cut_at(pristine / CUT))
    assert set(result[f"meta-{when}"]) == {f"{COMPONENT}.{name}" for name in lost}, when
    for component in COMPONENTS:
        for name, expected in _every_tensor(getattr(plain, component)).items():
            key = f"{component}.{name}"
            if key in result[f"meta-{when}"]:
                continue
            assert key in saved, f"{when}: {key} missing"
            assert torch.equal(saved[key].view(torch.uint8), expected.detach().view(torch.uint8)
                               ), f"{when}: {key} differs from the plain pipeline's"


def test_a_load_after_the_file_was_cut_says_what_is_lost_and_no_weight_kills_the_process(
        pristine, folder, tmp_path):
    """The issue's case: transformer_2's file truncated after from_pretrained, before its reads.
    Every call raises the loss; every weight is then readable (meta past the cut), also after
    disable_offload, which warns nothing more."""
    cut, size = cut_at(folder / CUT), (folder / CUT).stat().st_size
    result = run_child("load-then-disable", folder, tmp_path / "out")
    expected = load_error(os.path.realpath(folder / CUT), cut, size, lost_words(pristine, cut))
    assert result["errors"] == [expected, expected]
    assert result["on_the_cut_mapping"] == {"after the load": [], "after disable_offload": []}
    assert result["warnings"] == []
    for when in ("load", "disable"):
        assert_weights_as_loaded(tmp_path / "out", pristine, result, when)


def test_disable_offload_after_the_file_was_cut_warns_and_hands_back_no_cut_mapping(
        pristine, folder, tmp_path):
    """No call was made: disable_offload finds the cut, moves the tensors off the mapping, and
    warns what is lost (once)."""
    cut, size = cut_at(folder / CUT), (folder / CUT).stat().st_size
    result = run_child("disable-without-load", folder, tmp_path / "out")
    tensors = lost_words(pristine, cut)
    assert result["warnings"] == [leave_warning(os.path.realpath(folder / CUT), cut, size,
                                                tensors)]
    assert result["on_the_cut_mapping"] == {"after disable_offload": []}
    assert_weights_as_loaded(tmp_path / "out", pristine, result, "disable")


@pytest.mark.parametrize("background", [True, False], ids=["read-behind", "packed-at-add"])
def test_an_add_after_the_file_was_cut_is_refused_before_any_byte_is_read(
        pristine, folder, tmp_path, background):
    """Cut between the load and ``add``: the add is refused (a typed error naming the file and
    the tensors), reading nothing and changing nothing."""
    cut = cut_at(folder / CUT)
    result = run_child("add", folder, tmp_path / "out", str(int(background)))
    assert result["error"] == add_error(os.path.realpath(folder / CUT), cut,
                                        lost_words(pristine, cut))
    assert result["registered"] == [] and result["pointers_unchanged"]


@pytest.mark.beside
def test_an_interrupt_anywhere_in_a_load_that_finds_the_file_cut_keeps_the_rest(folder, tmp_path):
    result = run_child("sweep-load", folder, tmp_path / "out", str(SWEEP_STRIDE), timeout=540)
    assert result["points"] > 100


@pytest.mark.beside
def test_an_interrupt_anywhere_in_a_close_that_finds_the_file_cut_keeps_the_rest(folder, tmp_path):
    result = run_child("sweep-close", folder, tmp_path / "out", str(SWEEP_STRIDE), timeout=540)
    assert result["points"] > 100


# -- the child ----------------------------------------------------------------------------------------


def _every_tensor(module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(remove_duplicate=False)) | dict(
        module.named_buffers(remove_duplicate=False))


def _on_mapping_of(path: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of `tensors` whose bytes lie in a mapping of the file at `path` (read from
    /proc/self/maps: no tensor byte is touched)."""
    path = os.path.realpath(path)
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().removesuffix(" (deleted)") == path:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    return sorted(name for name, t in tensors.items()
                  if not t.is_meta and any(a <= t.data_ptr() < b for a, b in spans))


def _pipeline_tensors(pipe) -> dict[str, torch.Tensor]:
    return {f"{c}.{n}": t for c in COMPONENTS for n, t in _every_tensor(getattr(pipe, c)).items()}


def _read_every_weight(pipe, out: Path, when: str, result: dict) -> None:
    """Read every byte of every weight (a SIGBUS ends the child here), save the readable ones,
    list the meta ones."""
    tensors = _pipeline_tensors(pipe)
    readable = {name: t.detach().clone() for name, t in tensors.items() if not t.is_meta}
    torch.save(readable, out / f"weights-{when}.pt")
    result[f"meta-{when}"] = sorted(name for name, t in tensors.items() if t.is_meta)


def _gated_pipeline(folder: Path):
    """The pipeline through the adapter's from_pretrained, transformer_2's reads held until the
    event returned is set."""
    from diffusers import DiffusionPipeline

    from residency.adapters.diffusers import from_pretrained
    from residency.host import read_behind
    from residency.host.file_reads import FileReader

    gate = threading.Event()

    class GatedReader(FileReader):
        def start(self, chunk, reads):
            reads = list(reads)
            if any(Path(source.path).parent.name == COMPONENT for source, _, _ in reads):
                assert gate.wait(60), "the gate stayed closed"
            super().start(chunk, reads)

    read_behind.FileReader = GatedReader  # this child's own module: what the reading thread uses
    pipe = from_pretrained(DiffusionPipeline, folder, ALL, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe, gate


def _disable(pipe, result: dict) -> None:
    from residency.adapters.diffusers import disable_offload

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_offload(pipe)
    result["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning
                          and "left the scheduler" in str(w.message)]


def _load_then_disable(folder: Path, out: Path) -> dict:
    from residency import WeightFileError

    from _tiny_pipelines import wan22_call

    pipe, gate = _gated_pipeline(folder)
    os.truncate(folder / CUT, cut_at(folder / CUT))
    gate.set()
    result: dict = {"errors": [], "on_the_cut_mapping": {}}
    for _ in range(2):
        try:
            pipe(**wan22_call())
        except WeightFileError as error:
            result["errors"].append(str(error))
    result["on_the_cut_mapping"]["after the load"] = _on_mapping_of(
        folder / CUT, _pipeline_tensors(pipe))
    _read_every_weight(pipe, out, "load", result)
    _disable(pipe, result)
    result["on_the_cut_mapping"]["after disable_offload"] = _on_mapping_of(
        folder / CUT, _pipeline_tensors(pipe))
    _read_every_weight(pipe, out, "disable", result)
    return result


def _disable_without_load(folder: Path, out: Path) -> dict:
    pipe, gate = _gated_pipeline(folder)
    os.truncate(folder / CUT, cut_at(folder / CUT))
    result: dict = {"on_the_cut_mapping": {}}
    _disable(pipe, result)
    gate.set()
    result["on_the_cut_mapping"]["after disable_offload"] = _on_mapping_of(
        folder / CUT, _pipeline_tensors(pipe))
    _read_every_weight(pipe, out, "disable", result)
    return result


def _add(folder: Path, out: Path, background: str) -> dict:
    from diffusers import DiffusionPipeline

    from residency import Scheduler, WeightFileError

    pipe = DiffusionPipeline.from_pretrained(folder)
    os.truncate(folder / CUT, cut_at(folder / CUT))
    scheduler = Scheduler("cpu", chunk_nbytes=2**13,
                          host={"background_reads": background == "1"})
    pointers = [t.data_ptr() for t in _every_tensor(pipe.transformer_2).values()]
    result: dict = {"error": None}
    try:
        scheduler.add(COMPONENT, pipe.transformer_2)
    except WeightFileError as error:
        result["error"] = str(error)
    result["registered"] = list(scheduler)
    result["pointers_unchanged"] = pointers == [
        t.data_ptr() for t in _every_tensor(pipe.transformer_2).values()]
    scheduler.close()
    return result  # the tensors past the cut are the user's, untouched: not read here


def _sweep(folder: Path, out: Path, stride: str, close: bool) -> dict:
    """An interrupt at every `stride`-th point of a first load (or a close) of a group whose
    file was cut after its reads, before the load."""
    from diffusers import WanTransformer3DModel

    from residency import Scheduler, WeightFileError

    from _interrupts import consistent, sweep

    source = folder / COMPONENT
    reference = {n: t.detach().clone()
                 for n, t in _every_tensor(WanTransformer3DModel.from_pretrained(source)).items()}
    lost = lost_names(source / Path(CUT).name, cut_at(source / Path(CUT).name))
    builds = iter(range(10**6))

    def build():
        copy = Path(shutil.copytree(source, out / f"copy-{next(builds)}"))
        model = WanTransformer3DModel.from_pretrained(copy)
        scheduler = Scheduler("cpu", chunk_nbytes=2**13, host={"background_reads": True})
        scheduler.add(COMPONENT, model)
        assert scheduler[COMPONENT].host_master.arrival.done.wait(30)  # read, not committed
        weights = copy / Path(CUT).name
        os.truncate(weights, cut_at(weights))
        return scheduler, model, weights

    def operation(world):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if close:
                world[0].close()
                return
            try:
                with world[0].resident(COMPONENT):
                    pass
            except WeightFileError:
                pass

    def intact(world):
        scheduler, model, weights = world
        if not close:
            assert consistent(scheduler) == []
            for _ in range(2):  # the loss, found once, raised by every load
                try:
                    with scheduler.resident(COMPONENT):
                        raise AssertionError("a group whose file was cut short loaded")
                except WeightFileError as error:
                    assert str(error).startswith(f"cannot load group {COMPONENT!r}: the weight "
                                                 f"file {os.path.realpath(weights)} was truncated")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scheduler.close()  # completes an interrupted close
        tensors = _every_tensor(model)
        assert _on_mapping_of(weights, tensors) == []
        assert {n for n, t in tensors.items() if t.is_meta} == lost
        for name, tensor in tensors.items():
            if name not in lost:
                assert torch.equal(tensor.detach(), reference[name]), name
        shutil.rmtree(weights.parent)

    return {"points": sweep(build, operation, intact, stride=int(stride), every_line=False)}


SCENARIOS = {
    "load-then-disable": _load_then_disable,
    "disable-without-load": _disable_without_load,
    "add": _add,
    "sweep-load": lambda folder, out, stride: _sweep(folder, out, stride, close=False),
    "sweep-close": lambda folder, out, stride: _sweep(folder, out, stride, close=True),
}


def _child(scenario: str, folder: str, out: str, *args: str) -> None:
    torch.set_num_threads(1)
    result = SCENARIOS[scenario](Path(folder), Path(out), *args)
    (Path(out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _child(*sys.argv[1:])
