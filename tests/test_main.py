"""The main job (``python -m residency``), its synthetic pipeline, the timeline and the trace."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from residency import Scheduler
from residency.app.main import build_parser, main
from residency.group.records import TransitionRecord
from residency.app.synthetic import SIZES, SyntheticWan22
from residency.app.timeline import (
    NOT_MEANINGFUL,
    PhaseRecorder,
    format_timeline,
    timeline_rows,
    write_trace,
)

from _damaged_weights import DAMAGES, save_tiny_sdxl
from _forkserver import DIFFUSERS, run_python

#: One intra-op thread in the subprocesses: on a shared 2-core machine OpenMP waits dominate.
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
MODULE_MODE = {"mode": "module", "components": ["dit", "text_encoder"]}
WAN_CALL = ["--height", "16", "--width", "16", "--num-frames", "5",
            "--call-args", '{"max_sequence_length": 8}']



def run_main(*args: str) -> subprocess.CompletedProcess:
    """``python -m residency ARGS`` in a process of its own: a child of a fork server that has
    imported torch, diffusers and transformers, none of our modules ([Note: a fork server for the
    command-line tests] in tests/_forkserver.py)."""
    return run_python(["-m", "residency", *args], env=ENV, timeout=120, preload=DIFFUSERS)


def timeline_row(stdout: str, change: str) -> list[str]:
    """The fields of the timeline row for `change` ("from -> to")."""
    for line in stdout.splitlines():
        if re.match(rf"\s*\d+\s+[\d.]+\s+{re.escape(change)}\s", line):
            return line.split()
    raise AssertionError(f"no row {change!r} in:\n{stdout}")


# -- the command ----------------------------------------------------------------------------------


def test_main_job_prints_the_timeline_and_writes_a_perfetto_trace(tmp_path: Path):
    trace = tmp_path / "trace.json"
    done = run_main("--size", "tiny", "--steps", "4", "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert '"components": ["dit", "text_encoder"]' in out  # the default config
    assert "output: bit-identical to the run without offloading" in out
    # The seconds of the two runs, and why their ratio is left out on the CPU.
    lines = out.splitlines()
    ratio = next(n for n, line in enumerate(lines) if line.startswith("run without offloading:"))
    assert lines[ratio].endswith("(one run each)") and " x" not in lines[ratio]
    assert lines[ratio + 1].startswith('  (on the CPU the "device" is host memory: offloading '
                                       "saves nothing, so the two runs' ratio is left out")
    for change in ("- -> vae", "- -> text_encoder", "text_encoder -> transformer",
                   "transformer -> transformer_2"):
        assert float(timeline_row(out, change)[-2]) > 0  # timed once in the run
    for change in ("- -> text_encoder", "text_encoder -> transformer",
                   "transformer -> transformer_2"):  # made again, beside the floor
        row = next(line.split() for line in lines
                   if re.match(rf"\s+{re.escape(change)}\s+[\d.]+ \S+\s+[\d.]+ \[", line))
        assert row[-1] == NOT_MEANINGFUL  # tiny groups: x floor would measure fixed costs
    assert f"x floor left out ({NOT_MEANINGFUL}) for a load under 1 MiB" in out  # and why
    assert "not made again: - -> vae (a resident-policy group" in out
    assert "device bytes:" in out and "without offloading" in out

    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    phases = [e["name"] for e in slices if e["cat"] == "phase"]
    assert phases == ["text_encoder"] + ["transformer"] * 2 + ["transformer_2"] * 2 + ["vae"]
    loads = {e["name"]: e["args"]["nbytes"] for e in slices if e["cat"] == "transfer"
             and e["name"].startswith("load")}
    assert set(loads) == {"load vae", "load text_encoder", "load transformer", "load transformer_2"}
    assert loads["load transformer"] == loads["load transformer_2"] > 0
    assert {e["name"] for e in slices if e["cat"] == "residency"} >= {"resident transformer"}
    assert all(isinstance(e["tid"], int) for e in events if "tid" in e)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"phases", "resident groups", "MainThread"} <= names


def test_a_config_that_offloads_the_vae_swaps_it_in_last(capsys):
    config = '{"mode": "module", "components": ["dit", "text_encoder", "vae"]}'
    assert main(["--size", "tiny", "--steps", "2", "--diffusion-offload-config", config]) == 0
    out = capsys.readouterr().out
    assert re.search(r"vae\s+exclusive", out)
    moved = timeline_row(out, "transformer_2 -> vae")
    assert moved[4:6] != ["0", "B"]
    assert "bit-identical" in out


@pytest.mark.fast
def test_a_null_config_runs_without_offloading_and_says_so(tmp_path: Path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["--size", "tiny", "--steps", "2", "--diffusion-offload-config", "null",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "offload config: null (no offloading)" in out
    assert "run without offloading: " in out and "with offloading" not in out
    assert "output: 1x2x3x32x32 torch.float32, not compared (offloading is off: one run only)" \
        in out
    assert "groups:" not in out and "phase timeline" not in out  # no scheduler, no transitions
    events = json.loads(trace.read_text())["traceEvents"]
    assert [e["name"] for e in events if e.get("cat") == "phase"] == \
        ["text_encoder", "transformer", "transformer_2", "vae"]
    assert not [e for e in events if e.get("cat") in ("transfer", "residency")]


@pytest.mark.fast
def test_a_null_config_still_checks_the_arguments_first(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--diffusion-offload-config", "null", "--device", "cuda:99"])
    assert exit_info.value.code == 2
    assert "--device cuda:99: there is no such device" in capsys.readouterr().err


def test_the_residency_loggers_notes_are_printed_while_the_job_runs(capsys):
    logger = logging.getLogger("residency")
    level, handlers = logger.level, list(logger.handlers)
    assert main(["--size", "tiny", "--steps", "1"]) == 0
    # An INFO note, which Python's last-resort handler would not show.
    assert "residency INFO: host masters on cpu are pageable memory" in capsys.readouterr().err
    assert (logger.level, logger.handlers) == (level, handlers)  # the job's handler is gone
    logger.info("after the job")
    assert "after the job" not in capsys.readouterr().err


@pytest.mark.fast
def test_a_bad_config_is_a_usage_error_with_the_config_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--size", "tiny", "--diffusion-offload-config",
              '{"mode": "module", "componets": []}'])
    assert exit_info.value.code == 2
    assert "unknown field 'componets'" in capsys.readouterr().err


def test_pipeline_flag_runs_a_saved_diffusers_pipeline(tmp_path: Path):
    pytest.importorskip("diffusers")
    from _tiny_pipelines import tiny_wan22

    tiny_wan22().save_pretrained(tmp_path / "wan")
    trace = tmp_path / "trace.json"
    done = run_main("--pipeline", str(tmp_path / "wan"), "--steps", "4", *WAN_CALL,
                    "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    assert "WanPipeline from" in done.stdout
    assert "output: bit-identical to the run without offloading (torch.equal on 1x5x3x16x16" \
        in done.stdout
    timeline_row(done.stdout, "transformer -> transformer_2")
    # The trace has a "phases" track, as the synthetic job's: each call of an offloaded entry.
    events = json.loads(trace.read_text())["traceEvents"]
    phases = [e for e in events if e.get("cat") == "phase"]
    order = [name for n, name in enumerate(e["name"] for e in phases)
             if n == 0 or phases[n - 1]["name"] != name]
    assert order == ["text_encoder", "transformer", "transformer_2", "vae"]
    assert all(e["dur"] > 0 for e in phases)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {tracks[e["tid"]] for e in phases} == {"phases"}


def test_pipeline_flag_runs_a_saved_sdxl(tmp_path: Path):
    pytest.importorskip("diffusers")
    from _tiny_pipelines import tiny_sdxl

    tiny_sdxl().save_pretrained(tmp_path / "sdxl")
    done = run_main("--pipeline", str(tmp_path / "sdxl"), "--steps", "2", "--height", "8",
                    "--width", "8")
    assert done.returncode == 0, done.stderr
    assert "output: bit-identical to the run without offloading (torch.equal on 1x3x8x8" \
        in done.stdout
    table = done.stdout[done.stdout.index("StableDiffusionXLPipeline, components"):].splitlines()
    assert [row.split()[:4] for row in table[2:6]] == [
        ["vae", "vae", "vae", "resident"], ["text_encoder", "encoder", "text_encoder", "exclusive"],
        ["text_encoder_2", "encoder", "text_encoder", "exclusive"],
        ["unet", "dit", "unet", "exclusive"]]
    timeline_row(done.stdout, "text_encoder -> unet")


@pytest.mark.fast
def test_pipeline_flag_on_a_folder_without_a_model_exits_2(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pipeline", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--pipeline {tmp_path}: no model_index.json there" in capsys.readouterr().err


@pytest.mark.fast
def test_the_console_script_runs_main(capsys):
    scripts = entry_points(group="console_scripts", name="residency")
    if not scripts:
        pytest.skip("the package is not installed with its console script")
    assert [s.value for s in scripts] == ["residency.app.main:main"]
    with pytest.raises(SystemExit) as exit_info:
        next(iter(scripts)).load()(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--diffusion-offload-config" in help_text and "--pipeline PATH" in help_text


# -- transfers in torch.profiler ------------------------------------------------------------------


@pytest.mark.fast
def test_transfers_are_named_ranges_in_a_profiler_trace(tmp_path: Path):
    pipe = SyntheticWan22.build("tiny")
    pipe.offload = Scheduler.from_pipeline(pipe, MODULE_MODE, device="cpu")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profiler:
        pipe("a red dog", steps=4)
    profiler.export_chrome_trace(str(tmp_path / "profile.json"))
    names = {e["name"] for e in json.loads((tmp_path / "profile.json").read_text())["traceEvents"]}
    assert {"residency::load text_encoder", "residency::evict text_encoder",
            "residency::load transformer", "residency::evict transformer",
            "residency::load transformer_2"} <= names
    pipe.offload.close()


# -- the synthetic pipeline -----------------------------------------------------------------------


@pytest.mark.fast
def test_synthetic_builds_are_deterministic_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first, second = SyntheticWan22.build("tiny", seed=3), SyntheticWan22.build("tiny", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    other = SyntheticWan22.build("tiny", seed=4)
    assert not torch.equal(other.transformer.head.weight, first.transformer.head.weight)
    assert torch.equal(first("a cat", steps=2), second("a cat", steps=2))


@pytest.mark.fast
def test_synthetic_offloaded_run_is_bit_identical_and_phases_are_exclusive():
    plain, pipe = SyntheticWan22.build("tiny"), SyntheticWan22.build("tiny")
    scheduler = Scheduler.from_pipeline(pipe, MODULE_MODE, device="cpu")
    recorder = PhaseRecorder(scheduler)
    pipe.offload = recorder
    assert torch.equal(pipe("a red dog", steps=4), plain("a red dog", steps=4))
    assert [s.name for s in recorder.spans] == (
        ["text_encoder"] + ["transformer"] * 2 + ["transformer_2"] * 2 + ["vae"])
    assert [s.transition is not None for s in recorder.spans] == [True, True, False, True, False,
                                                                  False]
    assert recorder.peak_device_bytes == scheduler["transformer"].device_storage.nbytes + \
        scheduler["vae"].device_storage.nbytes
    scheduler.close()


@pytest.mark.fast
def test_the_a14b_size_has_wan22s_parameter_counts():
    with torch.device("meta"):
        pipe = SyntheticWan22(SIZES["a14b"])

    def billions(module):
        return sum(p.numel() for p in module.parameters()) / 1e9

    assert 14.0 < billions(pipe.transformer) < 14.5  # Wan2.2 A14B: ~14 B per expert
    assert 5.6 < billions(pipe.text_encoder) < 5.8    # UMT5-XXL encoder: ~5.7 B
    experts = [path for path, _, _ in pipe.timesteps(40)]
    assert experts[0] == "transformer" and experts[-1] == "transformer_2"


# -- the timeline ---------------------------------------------------------------------------------


def record(source, target, nbytes, start, seconds, written=0):
    return TransitionRecord(from_group=source, to_group=target, nbytes=nbytes,
                            written_back=written, start=start, evict_seconds=0.0,
                            load_seconds=seconds, thread="MainThread")


@pytest.mark.fast
def test_timeline_rows_number_time_and_total_each_transition_of_the_run():
    records = [record(None, "a", 2_000_000, 10.0, 0.002), record("a", "b", 2_000_000, 10.5, 0.004),
               record("b", None, 0, 11.0, 0.001, written=512)]
    rows = timeline_rows(records, first_index=7)
    assert [r.index for r in rows] == [8, 9, 10]
    assert [r.at for r in rows] == [0.0, 0.5, 1.0]
    assert rows[0].gbps == pytest.approx(1.0) and rows[1].gbps == pytest.approx(0.5)
    assert rows[2].gbps is None  # nothing moved: no rate
    text = format_timeline(rows, device=torch.device("cpu"))
    assert "3 transitions in the run with offloading, each timed once" in text
    assert "total: 3.8 MiB moved in 7.00 ms, 512 B written back" in text
    assert "floor" not in text  # a single timing is never set against the floor


@pytest.mark.fast
def test_trace_shows_when_each_group_was_resident(tmp_path: Path):
    records = [record(None, "a", 100, 1.0, 0.1), record("a", "b", 100, 2.0, 0.1)]
    trace = write_trace(tmp_path / "t.json", records)
    resident = {e["name"]: (e["ts"], e["dur"]) for e in trace["traceEvents"]
                if e.get("cat") == "residency"}
    assert resident["resident a"] == pytest.approx((1.1e6, 0.9e6))  # loaded, then evicted at 2.0
    assert resident["resident b"] == pytest.approx((2.1e6, 0.0))    # still resident at the end
    assert not [e for e in trace["traceEvents"] if e["name"] == "evict None"]
    assert json.loads((tmp_path / "t.json").read_text()) == trace


# -- arguments are checked before any work; exit statuses -----------------------------------------


def refused(capsys, *argv: str) -> str:
    """Run main with `argv`, expect exit status 2 before any work; returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "] build:" not in err and "] run" not in err  # nothing ran
    return err


@pytest.mark.fast
def test_a_device_that_is_not_there_is_a_usage_error(capsys):
    err = refused(capsys, "--size", "tiny", "--device", "cuda:99")
    assert "--device cuda:99: there is no such device on this machine (available: cpu" in err
    assert "--device 'gpu0' is not a device name" in refused(capsys, "--device", "gpu0")


@pytest.mark.fast
def test_an_unwritable_trace_path_is_refused_before_the_run(tmp_path: Path, capsys):
    missing = tmp_path / "no such folder" / "trace.json"
    err = refused(capsys, "--size", "tiny", "--trace", str(missing))
    assert f"--trace {missing}: cannot write there (No such file or directory)" in err
    assert "is a folder" in refused(capsys, "--size", "tiny", "--trace", str(tmp_path))
    assert not missing.parent.exists()


@pytest.mark.fast
def test_a_folder_that_is_not_a_diffusers_model_is_refused(tmp_path: Path, capsys):
    (tmp_path / "model_index.json").write_text('{"name": "not a pipeline"}')
    err = refused(capsys, "--pipeline", str(tmp_path))
    assert "model_index.json names no pipeline class" in err
    (tmp_path / "model_index.json").write_text("{")
    assert "model_index.json cannot be read as JSON" in refused(capsys, "--pipeline", str(tmp_path))


@pytest.fixture(scope="module")
def saved_sdxl(tmp_path_factory) -> Path:
    """A tiny SDXL saved once for this module, its unet sharded (copy it before damaging it)."""
    pytest.importorskip("diffusers")
    return save_tiny_sdxl(tmp_path_factory.mktemp("saved") / "sdxl")


@pytest.mark.fast
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_weight_file_is_refused_in_one_line_before_any_work(
        saved_sdxl: Path, tmp_path: Path, capsys, damage: str):
    folder = Path(shutil.copytree(saved_sdxl, tmp_path / "sdxl", symlinks=True))
    message = DAMAGES[damage](folder)
    err = refused(capsys, "--pipeline", str(folder), "--steps", "1")
    assert err == f"python -m residency: error: --pipeline {folder}: {message}\n"


def test_a_truncated_weight_file_exits_2_with_one_line_and_runs_nothing(
        saved_sdxl: Path, tmp_path: Path):
    folder = Path(shutil.copytree(saved_sdxl, tmp_path / "sdxl", symlinks=True))
    message = DAMAGES["truncated"](folder)
    for offloading in ([], ["--diffusion-offload-config", "null"]):
        done = run_main("--pipeline", str(folder), "--steps", "1", *offloading)
        assert done.returncode == 2, done.stderr
        assert done.stderr == f"python -m residency: error: --pipeline {folder}: {message}\n"
        assert "run without offloading" not in done.stdout + done.stderr
        assert done.stdout == ""


def test_a_crash_exits_3_with_the_traceback_and_a_summary(tmp_path: Path):
    pytest.importorskip("diffusers")
    (tmp_path / "model_index.json").write_text(json.dumps(
        {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}
    ))  # a diffusers folder whose weights are whole, but whose transformer config is not JSON
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("not JSON")
    save_file({"w": torch.zeros(2)},
              str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"))
    done = run_main("--pipeline", str(tmp_path), "--steps", "1")
    assert done.returncode == 3, done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m residency: crashed: ") and last.endswith(
        "(traceback above); exit status 3")


@pytest.mark.fast
def test_help_documents_the_exit_statuses_and_every_option(capsys):
    parser = build_parser()
    undocumented = [action.option_strings for action in parser._actions
                    if action.option_strings and not action.help]
    assert undocumented == []
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for status, meaning in (("0", "the outputs are bit-identical"), ("1", "the outputs differ"),
                            ("2", "bad usage"), ("3", "crashed"), ("130", "interrupted (Ctrl-C)")):
        assert re.search(rf"^  {status} +{re.escape(meaning)}", out, re.MULTILINE), status


def test_progress_goes_to_stderr_phase_by_phase(capsys):
    assert main(["--size", "tiny", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    experts = [path for path, _, _ in SyntheticWan22.build("tiny").timesteps(3)]
    for stage in ("run without offloading", "run with offloading"):
        lines = [line.split("] ", 1)[1] for line in err if f"] {stage}: " in line]
        steps = [f"{stage}: step {n}/3: {path}" for n, path in enumerate(experts, start=1)]
        assert lines == [f"{stage}: text_encoder", *steps, f"{stage}: vae"]
    assert "step 1/3" not in captured.out  # the report stays clean


@pytest.mark.beside  # long, with processes of its own: see tests/_accelerator.py
def test_nproc_runs_the_job_on_ranks_that_share_host_masters():
    done = run_main("--nproc", "2", "--size", "tiny", "--steps", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 1: output bit-identical" in done.stdout
    assert "ranks: 2; groups whose host master they share: text_encoder, transformer, " \
        "transformer_2, vae" in done.stdout  # added in the order a call first uses them
    assert "output: bit-identical to the run without offloading" in done.stdout


@pytest.mark.fast
def test_nproc_with_a_diffusers_folder_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    with pytest.raises(SystemExit) as exit_info:
        main(["--pipeline", str(tmp_path), "--nproc", "2"])
    assert exit_info.value.code == 2
    assert "--nproc runs the synthetic pipeline; leave it out with --pipeline" in \
        capsys.readouterr().err
