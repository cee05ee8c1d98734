"""What a newcomer meets first: the main job's up-front checks (host memory for --size, every
component's weight file, --call-args against the pipeline class, --plot), a budget no plan fits
refused before the first run, Ctrl-C on several ranks, the version and the console script's name,
and the host-memory hint in units."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import residency
from residency.app import checks
from residency.app.main import main, program_name
from residency.core.errors import HostMemoryError

ROOT = Path(__file__).resolve().parent.parent
WAN_CALL = ["--height", "16", "--width", "16", "--num-frames", "5",
            "--call-args", '{"max_sequence_length": 8}']


def refused(capsys, *argv: str) -> str:
    """Run main with `argv`, expect exit status 2 before any run; returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "] run" not in err  # nothing ran
    return err


def test_a_size_larger_than_the_host_is_refused_naming_both_figures(capsys, monkeypatch):
    monkeypatch.setattr(checks, "available_host_memory", lambda: 4 * 2**30)
    err = refused(capsys, "--size", "a14b")
    assert "--size a14b needs about " in err and "of host memory" in err
    assert "this host has 4.0 GiB available; give --size medium (the largest that fits)" in err
    assert "] build:" not in err


@pytest.mark.fast
def test_a_size_that_fits_is_taken(monkeypatch):
    monkeypatch.setattr(checks, "available_host_memory", lambda: 64 * 2**30)
    parser = residency.app.main.build_parser()
    args = parser.parse_args(["--size", "small"])
    assert checks.check_arguments(parser, args) == torch.device("cpu")


@pytest.mark.fast
def test_a_component_without_its_weight_file_is_refused_by_name(capsys, saved_wan22, tmp_path):
    folder = tmp_path / "wan"
    shutil.copytree(saved_wan22, folder)
    (folder / "transformer_2" / "diffusion_pytorch_model.safetensors").unlink()
    err = refused(capsys, "--pipeline", str(folder), "--steps", "1", *WAN_CALL)
    assert err.endswith(
        f"--pipeline {folder}: component 'transformer_2': "
        "transformer_2/diffusion_pytorch_model.safetensors is missing (the folder holds no "
        "weight file: no *.safetensors, sharded index or *.bin), so WanTransformer3DModel has no "
        "weights to load; save the pipeline again, or download that file\n")
    assert "Traceback" not in err


@pytest.mark.fast
def test_a_missing_component_folder_is_refused(capsys, saved_wan22, tmp_path):
    folder = tmp_path / "wan"
    shutil.copytree(saved_wan22, folder)
    shutil.rmtree(folder / "vae")
    err = refused(capsys, "--pipeline", str(folder), "--steps", "1", *WAN_CALL)
    assert "component 'vae': model_index.json names it (diffusers.AutoencoderKLWan), but the " \
           "folder vae/ is missing" in err


@pytest.mark.fast
def test_unknown_call_arguments_are_refused_listing_the_accepted(capsys, saved_wan22):
    err = refused(capsys, "--pipeline", str(saved_wan22), "--steps", "1",
                  "--call-args", '{"bogus_arg": 1, "max_sequence_length": 8}')
    assert "WanPipeline.__call__ takes no --call-args key 'bogus_arg'; it accepts " in err
    assert "num_inference_steps" in err and "max_sequence_length" in err
    assert "Traceback" not in err


@pytest.mark.fast
@pytest.mark.parametrize(("name", "message"), [
    ("timeline.txt", "--plot {path}: give a file name ending in .png, .svg, .pdf"),
    ("missing/timeline.png", "--plot {path}: cannot write there"),
])
def test_a_bad_plot_path_is_refused(capsys, tmp_path, name, message):
    path = tmp_path / name
    err = refused(capsys, "--size", "tiny", "--plot", str(path))
    assert message.format(path=path) in err


@pytest.mark.fast
def test_a_budget_no_plan_fits_is_refused_before_the_first_run(capsys):
    config = '{"mode": "auto", "auto_options": {"device_budget": "1KiB"}}'
    with pytest.raises(SystemExit) as exit_info:
        main(["--size", "tiny", "--steps", "1", "--diffusion-offload-config", config])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no plan of the groups" in err and "fits a weights budget" in err
    assert "run without offloading" not in err and "warm-up" not in err


@pytest.mark.fast
def test_the_version_comes_from_the_metadata(capsys):
    from importlib import metadata

    assert residency.__version__ == metadata.version("residency")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == (f"residency {residency.__version__} "
                                       f"(torch {torch.__version__})\n")


@pytest.mark.fast
def test_the_console_script_names_itself(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/residency"])
    assert program_name(None) == "residency"
    assert program_name(["--size", "tiny"]) == "python -m residency"
    monkeypatch.setattr(sys, "argv", ["/x/residency/__main__.py"])
    assert program_name(None) == "python -m residency"


@pytest.mark.fast
def test_help_lists_the_interrupted_status(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "130  interrupted (Ctrl-C)" in capsys.readouterr().out


def _lines_of(stream) -> queue.Queue:
    """`stream`'s lines, read on a daemon thread into a queue, then None at its end."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


@pytest.mark.beside  # long, with processes of its own: see tests/_accelerator.py
def test_ctrl_c_on_two_ranks_prints_one_line_and_leaves_no_segment():
    before = set(os.listdir("/dev/shm"))
    job = subprocess.Popen([sys.executable, "-m", "residency", "--nproc", "2", "--size", "small",
                            "--steps", "100000", "--no-check"], cwd=ROOT, text=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines = _lines_of(job.stderr)  # read on a thread: a silent job cannot block the test
    seen, deadline = [], time.monotonic() + 240
    while not any("run with offloading: step 3/" in line for line in seen):
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:  # the job ended
            break
        seen.append(line)
    assert any("run with offloading: step 3/" in line for line in seen), "".join(seen)[-3000:]
    job.send_signal(signal.SIGINT)
    job.wait(timeout=120)
    rest = [lines.get(timeout=30)]  # every line after step 3, to the end of the pipe (None)
    while rest[-1] is not None:
        rest.append(lines.get(timeout=30))
    err = "".join(rest[:-1])
    assert job.returncode == 130
    after = [line for line in err.splitlines() if "run with offloading: step" not in line]
    assert after == ["python -m residency: interrupted (Ctrl-C); exit status 130"], err[-3000:]
    assert set(os.listdir("/dev/shm")) <= before


@pytest.mark.fast
def test_the_host_memory_hint_gives_units(tmp_path):
    scheduler = residency.Scheduler("cpu", host={"memory_limit": "64KiB",
                                                 "spill_directory": tmp_path})
    with pytest.raises(HostMemoryError) as raised:
        scheduler.add("big", nn.Linear(256, 256))
    assert "Raise memory_limit to at least" in str(raised.value)
    assert "KiB, e.g. \"memory_limit\": \"1MiB\")" in str(raised.value)
    scheduler.close()


# -- --threads -----------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "argument --threads: 0 is not at least 1"),
    (["--threads", "4096"], "--threads 4096 asks for 4096 threads; this process may use "),
    (["--threads", "2", "--nproc", "4096"], "--threads 2 on each of 4096 ranks asks for 8192 "
                                            "threads"),
])
def test_a_thread_count_the_cores_cannot_take_is_refused(capsys, argv, message):
    assert message in refused(capsys, "--size", "tiny", *argv)


@pytest.mark.fast
def test_threads_sets_torchs_intra_op_threads_for_the_job(capsys, monkeypatch):
    """--threads 1 on a process torch gave two threads: the job runs on one, and says so."""
    from residency.app import timeline

    monkeypatch.setattr(timeline, "load_average", lambda: 0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["--size", "tiny", "--steps", "2", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    header = capsys.readouterr().out.splitlines()[0]
    assert "; 1 intra-op thread; load average 0.00 on " in header


@pytest.mark.fast
def test_the_load_warning_suggests_threads_1_only_when_torch_runs_more():
    from residency.app.timeline import MachineLoad

    two = MachineLoad(threads=2, load_average=4.2, cores=2).warning()
    assert two.endswith(
        "read the medians of the repeated phase changes below, and their spread; each of "
        "torch's operations here waits for all 2 of its intra-op threads, and a thread behind "
        "another process stalls it: --threads 1 runs each on one thread and steadies the figures")
    one = MachineLoad(threads=1, load_average=4.2, cores=2).warning()
    assert one.endswith("and their spread") and "--threads" not in one


@pytest.mark.fast
def test_counts_read_right_in_one_and_many():
    from residency.options.budget import counted

    assert [counted(1, "step"), counted(2, "step"), counted(0, "block")] == [
        "1 step", "2 steps", "0 blocks"]
    assert [counted(1, "entry", "entries"), counted(3, "pass", "passes")] == ["1 entry", "3 passes"]


@pytest.mark.fast
def test_a_one_step_run_says_one_step(capsys, monkeypatch):
    from residency.app import timeline

    monkeypatch.setattr(timeline, "load_average", lambda: 0.0)
    assert main(["--size", "tiny", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "size 'tiny', 1 step" in out and "1 steps" not in out


# -- a pipeline call that fails without offloading ----------------------------------------------


def test_a_size_the_model_cannot_take_says_diffusers_own_call_failed(capsys, saved_wan22):
    """Wan takes heights that are multiples of 16: at 24 the run without offloading fails in
    WanPipeline's own call; the job says so, suggests the sizes, and exits 4 (listed in --help)."""
    argv = ["--pipeline", str(saved_wan22), "--steps", "1", *WAN_CALL]
    argv[argv.index("--height") + 1] = "24"
    assert main(argv) == 4
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "python -m residency: the run without offloading failed in WanPipeline.__call__ "
        "(diffusers' own code; nothing was offloaded yet): ValueError: ")
    assert last.endswith(
        "The model may not take this size: give --height and --width (and --num-frames for "
        "video) that it was trained for, as its model card or the pipeline's defaults say; exit "
        "status 4")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "4    --pipeline: the run without offloading failed" in capsys.readouterr().out


# -- the README: a front door ----------------------------------------------------------------------

#: What a newcomer finds on the README, in this order (issue 45): what it is, the two commands, what
#: the main job prints, the quick start, diffusers in one call, the command line, serving many
#: requests (issue 46), then links.
README_SECTIONS = ["## Two commands on a fresh machine", "## What the main job prints",
                   "## Which mode?", "## Quick start", "## Diffusers in one call",
                   "## Configs and the command line", "## Many requests, one pipeline",
                   "## Further"]


@pytest.mark.fast
def test_the_readme_is_a_front_door_of_at_most_150_lines_whose_links_resolve():
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the README is a front door: move details to docs/"
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == README_SECTIONS
    commands = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert commands[0].startswith("python3 -m venv .venv") and commands[0].endswith(
        "python -m residency")
    assert commands[1].endswith("python -m pytest -q")
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert len(links) >= 8
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
