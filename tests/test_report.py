"""The main job's report (issue 32): it tells the truth on a busy CPU and draws its timeline.

The job runs in this process (`residency.app.main.main` with capsys); the timeline's and the
picture's functions are also tested on records and changes given here, so each figure is checked
against what it must be.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch

from residency import Scheduler
from residency.app import timeline
from residency.app.main import main
from residency.app.plot import PlotError, write_plot
from residency.app.timeline import (
    MIN_FLOOR_BYTES,
    MIN_FLOOR_SECONDS,
    NOT_MEANINGFUL,
    REPEATS,
    ChangeCosts,
    MachineLoad,
    RepeatedChange,
    Samples,
    format_changes,
    format_device_bytes,
    format_timeline,
    machine_load,
    measure_changes,
    timeline_rows,
    wait_for_reads,
)
from residency.options.budget import format_nbytes
from residency.core.errors import ResidencyError
from residency.group.records import TransitionRecord

from _accelerator import device as accelerator_device

WAN_CALL = ["--height", "16", "--width", "16", "--num-frames", "5",
            "--call-args", '{"max_sequence_length": 8}']
CPU = torch.device("cpu")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(source, target, nbytes, start, seconds, written=0):
    return TransitionRecord(from_group=source, to_group=target, nbytes=nbytes,
                            written_back=written, start=start, evict_seconds=0.0,
                            load_seconds=seconds, thread="MainThread")


def change(source, target, nbytes, seconds, floor, count=1):
    return RepeatedChange(from_group=source, to_group=target, nbytes=nbytes, count_in_run=count,
                          seconds=Samples(seconds), floor=Samples(floor))


def report_of(capsys, *argv: str) -> list[str]:
    """The report lines of ``python -m residency ARGV`` run here (exit status 0)."""
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def quiet(monkeypatch) -> None:
    """The host's load average reads as 0: no warning."""
    monkeypatch.setattr(timeline, "load_average", lambda: 0.0)


# -- a group the call never loads -----------------------------------------------------------------


def test_a_saved_wan22_at_one_step_leaves_transformer_2_unloaded_and_the_job_still_passes(
        saved_wan22: Path, capsys, monkeypatch):
    """At one step Wan2.2's low-noise expert is never used: its master is still read behind the
    first phase when the floors are measured, and the job measured only the groups loaded."""
    quiet(monkeypatch)
    lines = report_of(capsys, "--pipeline", str(saved_wan22), "--steps", "1", *WAN_CALL)
    assert lines[-1].startswith("output: bit-identical to the run without offloading "
                                "(torch.equal on ")
    assert "  not loaded by this run: transformer_2 (no change of the run loaded it: no floor " \
        "measured)" in lines
    measured = [line.split()[0:3] for line in lines if re.match(r"    \S+ -> \S+ ", line)]
    assert ["text_encoder", "->", "transformer"] in measured
    assert not [m for m in measured if "transformer_2" in m]


# -- the header: threads and load -----------------------------------------------------------------


def test_the_header_names_torchs_thread_count(capsys, monkeypatch):
    quiet(monkeypatch)
    header = report_of(capsys, "--size", "tiny", "--steps", "2")[0]
    cores = machine_load().cores
    assert header.endswith(f"on cpu (torch {torch.__version__}; 1 intra-op thread; load average "
                           f"0.00 on {cores} cores)")  # conftest: one intra-op thread
    assert MachineLoad(threads=2, load_average=1.5, cores=4).describe() == \
        "2 intra-op threads; load average 1.50 on 4 cores"
    assert MachineLoad(threads=2, load_average=None, cores=4).describe() == \
        "2 intra-op threads; 4 cores, load average unknown"


def test_a_loaded_machine_is_warned_about_under_the_header(capsys, monkeypatch):
    cores = machine_load().cores
    monkeypatch.setattr(timeline, "load_average", lambda: cores + 1.5)
    lines = report_of(capsys, "--size", "tiny", "--steps", "2")
    assert lines[1] == (
        f"warning: the machine is loaded (load average {cores + 1.5:.2f} over the last minute, "
        f"on {cores} cores): other processes share the cores, so one run's seconds swing from "
        "run to run; read the medians of the repeated phase changes below, and their spread")


@pytest.mark.parametrize("reading", [0.0, None], ids=["quiet", "no-load-average"])
def test_a_quiet_machine_gets_no_warning(capsys, monkeypatch, reading):
    monkeypatch.setattr(timeline, "load_average", lambda: reading)
    lines = report_of(capsys, "--size", "tiny", "--steps", "2")
    assert not [line for line in lines if line.startswith("warning:")]
    assert lines[1].startswith("offload config: ")
    at_cores = MachineLoad(threads=1, load_average=2.0, cores=2)
    assert not at_cores.loaded and at_cores.warning() is None  # above the cores, not at them


# -- the repeated changes: medians, spread, the noise rule ----------------------------------------


@pytest.mark.fast
def test_samples_give_the_median_and_the_min_max_spread():
    samples = Samples([0.004, 0.001, 0.002, 0.009, 0.003])
    assert samples.median == 0.003 and samples.spread == (0.001, 0.009)
    assert Samples([1.0, 3.0]).median == 2.0
    assert samples.over(0.001).values == pytest.approx((4.0, 1.0, 2.0, 9.0, 3.0))
    with pytest.raises(ResidencyError, match="Samples: no values; measure at least once"):
        Samples([])


@pytest.mark.fast
def test_a_changes_ratio_is_each_repeat_over_the_floors_median():
    big = change("a", "b", 2 * MIN_FLOOR_BYTES, [0.004, 0.002, 0.003], [0.001, 0.0012, 0.0009])
    assert big.change == "a -> b" and big.comparable
    assert big.times_floor.median == pytest.approx(3.0)  # 0.003 / 0.001
    assert big.times_floor.spread == pytest.approx((2.0, 4.0))
    text = format_changes(ChangeCosts(changes=(big,), repeats=3))
    row = next(line for line in text.splitlines() if line.startswith("    a -> b"))
    assert row.split()[5:] == ["3.00", "[2.00-4.00]", "1.00", "[0.900-1.20]", "3.00",
                               "[2.00-4.00]"]  # ms [min-max], floor ms [min-max], x floor
    assert text.splitlines()[0].startswith("phase changes against the floor: each change of the "
                                           "run made again 3 times after it")


@pytest.mark.fast
def test_the_runs_ratio_weighs_each_change_by_how_often_the_run_made_it():
    once = change("a", "b", MIN_FLOOR_BYTES, [0.002], [0.001])              # x2, once
    thrice = change("b", "a", MIN_FLOOR_BYTES, [0.004], [0.001], count=3)   # x4, three times
    noise = change(None, "c", 1024, [0.5], [0.001])                         # left out
    costs = ChangeCosts(changes=(once, thrice, noise))
    assert costs.times_floor == pytest.approx((0.002 + 3 * 0.004) / (0.001 + 3 * 0.001))
    assert "the run's loads of 1 MiB and more at these medians: x3.50 the floor" \
        in format_changes(costs)
    assert ChangeCosts(changes=(noise,)).times_floor is None
    assert "the run's loads" not in format_changes(ChangeCosts(changes=(noise,)))


@pytest.mark.fast
def test_x_floor_is_left_out_for_small_loads_and_short_floors_and_the_legend_says_what_they_took():
    shown = change("a", "big", MIN_FLOOR_BYTES, [2 * MIN_FLOOR_SECONDS], [MIN_FLOOR_SECONDS])
    small = change("big", "small", 9 * 1024, [0.0015], [0.004])                 # under 1 MiB
    short = change("small", "fast", MIN_FLOOR_BYTES, [0.060], [MIN_FLOOR_SECONDS / 2])
    assert [c.comparable for c in (shown, small, short)] == [True, False, False]
    lines = format_changes(ChangeCosts(changes=(shown, small, short))).splitlines()
    assert lines[2].split()[-2:] == ["2.00", "[2.00-2.00]"]
    assert lines[3].split()[-1] == NOT_MEANINGFUL and lines[4].split()[-1] == NOT_MEANINGFUL
    legend = next(line for line in lines if "x floor left out" in line)
    assert legend == (
        f"  x floor left out ({NOT_MEANINGFUL}) for a load under 1 MiB or a floor under 100 us: "
        "such a change took 1.50-60.0 ms here (medians), its copy's floor 0.050-4.00 ms, so its "
        "time is what a change costs besides the copy (edit detection's digests, torch's thread "
        "wake-ups, the lock, re-pointing each tensor), and the ratio would say nothing about the "
        "copy")
    only_shown = format_changes(ChangeCosts(changes=(shown,)))
    assert "left out" not in only_shown and NOT_MEANINGFUL not in only_shown.splitlines()[2]


@pytest.mark.fast
def test_the_legend_names_the_changes_not_made_again_and_the_groups_never_loaded():
    first = change(None, "a", MIN_FLOOR_BYTES, [0.002], [0.001])
    text = format_changes(ChangeCosts(
        changes=(first,), not_repeated=(("- -> vae", "a resident-policy group: placed once, "
                                          "never evicted"),),
        never_loaded=("b", "c"), still_reading=("c",)))
    assert "  a change from - (nothing on the device) follows offload_all, which frees the " \
        "shared device storage: like the run's, it allocates that storage again" in text
    assert "  not made again: - -> vae (a resident-policy group: placed once, never evicted)" \
        in text
    assert "  not loaded by this run: b, c (no change of the run loaded them: no floor measured)" \
        in text
    assert "the floors were measured while the reads of c from their weight files went on" in text


@pytest.mark.fast
def test_measure_changes_makes_each_change_of_the_run_again_beside_its_floor():
    scheduler = Scheduler("cpu")
    for name in ("a", "b"):
        scheduler.add(name, torch.nn.Linear(512, 512))      # 1 MiB and a bias
    scheduler.add("c", torch.nn.Linear(4, 4), policy="resident")
    for name in ("a", "b", "a"):
        with scheduler.resident(name):
            pass
    records = list(scheduler.transitions)
    count = scheduler.transitions.count
    costs = measure_changes(scheduler, records)
    assert [(c.from_group, c.to_group, c.count_in_run) for c in costs.changes] == \
        [(None, "a", 1), ("a", "b", 1), ("b", "a", 1)]
    assert [c.nbytes for c in costs.changes] == [r.nbytes for r in records if r.to_group != "c"]
    assert all(len(c.seconds.values) == len(c.floor.values) == REPEATS for c in costs.changes)
    assert all(min(c.seconds.values) > 0 and min(c.floor.values) > 0 for c in costs.changes)
    assert costs.not_repeated == (("- -> c", "a resident-policy group: placed once, never "
                                   "evicted"),)
    assert costs.never_loaded == () and costs.repeats == REPEATS
    made = [r for r in list(scheduler.transitions)[len(records):] if r.to_group is not None]
    assert scheduler.transitions.count > count
    for pair in ((None, "a"), ("a", "b"), ("b", "a")):  # each repeat is the change it names
        assert sum((r.from_group, r.to_group) == pair for r in made) >= REPEATS
    assert scheduler.current is None  # offloaded at the end
    scheduler.close()


def test_wait_for_reads_gives_up_on_reads_that_make_no_progress():
    class Stuck:  # an arriving master whose reads never advance
        still_reading, arrival = True, type("Arrival", (), {"read_nbytes": 5, "nbytes": 10})()

    class Group:
        host_master = Stuck()

    class Groups(dict):
        def __iter__(self):
            return iter(self.keys())

    said = []
    start = time.perf_counter()
    assert wait_for_reads(Groups(t2=Group()), said.append, stall_seconds=0.2,
                          poll_seconds=0.01) == ("t2",)
    assert time.perf_counter() - start < 30  # bounded
    assert said == ["waiting for the reads of t2 (5 B of 10 B) before measuring the floor"]
    assert wait_for_reads(Groups(), said.append) == ()


# -- the run's table: the total line --------------------------------------------------------------


@pytest.mark.fast
def test_the_total_line_gives_bytes_seconds_and_written_bytes_and_no_single_run_ratio():
    records = [record(None, "a", 2 * 2**20, 10.0, 0.002), record("a", "b", 2**20, 10.5, 0.004),
               record("b", None, 0, 11.0, 0.001, written=512)]
    rows = timeline_rows(records, first_index=7)
    assert [r.index for r in rows] == [8, 9, 10] and [r.at for r in rows] == [0.0, 0.5, 1.0]
    text = format_timeline(rows, device=CPU)
    assert text.splitlines()[-1] == "total: 3.0 MiB moved in 7.00 ms, 512 B written back"
    assert "—" not in text and "floor" not in text  # ratios are the repeated changes' alone
    assert text.splitlines()[1].split() == ["#", "at", "ms", "transition", "moved", "written",
                                            "ms", "GB/s"]


def test_the_report_has_no_placeholder_dashes_and_no_fixed_cost_claim(capsys, monkeypatch):
    quiet(monkeypatch)
    lines = report_of(capsys, "--size", "tiny", "--steps", "4")
    text = "\n".join(lines)
    assert "—" not in text and "tens of microseconds" not in text
    assert re.search(r"^total: [\d.]+ KiB moved in [\d.]+ ms, 0 B written back$", text, re.M)
    assert "(one run each)" in text and "ratio is left out" in text  # on the CPU
    legend = next(line for line in lines if "x floor left out" in line)
    took = re.search(r"such a change took ([\d.]+)-([\d.]+) ms here", legend)
    assert took and 0 < float(took[1]) <= float(took[2])  # measured in this run
    rows = [line for line in lines if re.match(r"    \S+ -> \S+ ", line)]
    assert [row.split()[:3] for row in rows] == [["-", "->", "text_encoder"],
                                                ["text_encoder", "->", "transformer"],
                                                ["transformer", "->", "transformer_2"]]
    assert all(row.split()[-1] == NOT_MEANINGFUL for row in rows)  # tiny groups: noise


# -- device bytes ---------------------------------------------------------------------------------


@pytest.mark.fast
def test_device_bytes_are_reported_with_and_without_offloading():
    assert format_device_bytes(plain=2**30, storage_peak=2**29, allocator_peak=None,
                               device=CPU) == (
        "device bytes: 1.0 GiB without offloading (the model's weights), 512.0 MiB at most in "
        "the scheduler's storages (packed loads, with their padding) with offloading")
    assert format_device_bytes(plain=3 * 2**30, storage_peak=2**29, allocator_peak=2**30,
                               device=torch.device("cuda")) == (
        "device bytes: 3.0 GiB without offloading (allocator peak: weights and activations), "
        "1.0 GiB (allocator peak: weights and activations; 512.0 MiB at most in the "
        "scheduler's storages (packed loads, with their padding)) with offloading")
    assert format_device_bytes(plain=None, storage_peak=2**29, allocator_peak=None,
                               device=CPU) == (
        "device bytes: with offloading 512.0 MiB at most in the scheduler's storages (packed "
        "loads, with their padding); without: not measured (--no-check)")


def test_the_job_reports_the_device_bytes_the_run_without_offloading_held(capsys, monkeypatch):
    """Each size says what it counts, and they add up: the groups' weights are the model's bytes;
    each timeline row moves its group's packed load; the storages hold the largest exclusive load
    beside the resident ones."""
    quiet(monkeypatch)
    lines = report_of(capsys, "--size", "tiny", "--steps", "2")
    header = next(i for i, line in enumerate(lines) if line.startswith("groups: "))
    assert lines[header] == ("groups: policy        weights  a load moves (packed, with "
                             "alignment padding)")
    rows = [line.split() for line in lines[header + 1: header + 5]]
    weights = {row[0]: float(row[2]) for row in rows}
    loads = {row[0]: (row[1], float(row[4])) for row in rows}
    line = next(line for line in lines if line.startswith("device bytes: "))
    plain = re.match(r"device bytes: ([\d.]+) KiB without offloading \(the model's weights\), "
                     r"([\d.]+) KiB at most in the scheduler's storages \(packed loads, with "
                     r"their padding\) with offloading$", line)
    assert plain, line
    assert float(plain[1]) == pytest.approx(sum(weights.values()), abs=0.2)  # the whole model
    exclusive = max(nbytes for policy, nbytes in loads.values() if policy == "exclusive")
    resident = sum(nbytes for policy, nbytes in loads.values() if policy == "resident")
    assert float(plain[2]) == pytest.approx(exclusive + resident, abs=0.2)
    timeline = [line.split() for line in lines if re.match(r"  \d+ +[\d.]+  \S+ -> \S+", line)]
    assert timeline and all(float(row[5]) == loads[row[4]][1] for row in timeline)


@pytest.mark.gpu
def test_on_an_accelerator_the_report_compares_allocator_peaks_and_times_each_change(
        capsys, monkeypatch):
    """The changes made again are synchronised around each one ([Note: timing on
    accelerators]); both device-byte figures are the allocator's peaks."""
    quiet(monkeypatch)
    device = accelerator_device()
    lines = report_of(capsys, "--size", "tiny", "--steps", "2", "--device", str(device))
    assert lines[-1].startswith("output: bit-identical to the run without offloading")
    line = next(line for line in lines if line.startswith("device bytes: "))
    peaks = re.match(r"device bytes: ([\d.]+) KiB without offloading \(allocator peak: weights "
                     r"and activations\), ([\d.]+) KiB \(allocator peak: weights and "
                     r"activations; [\d.]+ KiB at most in the scheduler's storages \(packed "
                     r"loads, with their padding\)\) with offloading$", line)
    assert peaks, line
    assert next(line for line in lines if line.startswith("run without offloading: ")) \
        .endswith(", one run each)")  # the ratio is kept on an accelerator, and says so
    rows = [line for line in lines if re.match(r"    \S+ -> \S+ ", line)]
    assert [row.split()[:3] for row in rows] == [["-", "->", "text_encoder"],
                                                ["text_encoder", "->", "transformer"],
                                                ["transformer", "->", "transformer_2"]]
    # Issue 48: the host masters' pinned bytes against the bytes requested, and what module
    # mode costs where the device would hold every group (the tiny pipeline: it would).
    host = re.fullmatch(r"host masters: ([\d.]+ KiB) requested, ([\d.]+ KiB) pinned",
                        next(line for line in lines if line.startswith("host masters: ")))
    assert host and host[1] == host[2], host
    assert any(line.startswith("module mode moves every exclusive group's bytes at every call")
               and line.endswith('{"mode": "auto"} would keep them on the device and move '
                                 'nothing after the first call') for line in lines)


def test_on_the_cpu_the_report_gives_the_host_masters_and_no_module_mode_cost(capsys,
                                                                             monkeypatch):
    quiet(monkeypatch)
    lines = report_of(capsys, "--size", "tiny", "--steps", "2")
    assert re.fullmatch(r"host masters: [\d.]+ KiB requested, 0 B pinned \(the CPU device "
                        r"copies from pageable memory\)",
                        next(line for line in lines if line.startswith("host masters: ")))
    assert not any(line.startswith("module mode moves") for line in lines)


# -- the picture ----------------------------------------------------------------------------------


def test_plot_writes_a_png_of_the_timeline(tmp_path: Path, capsys, monkeypatch):
    quiet(monkeypatch)
    pyplot_before = "matplotlib.pyplot" in sys.modules
    picture = tmp_path / "timeline.png"
    lines = report_of(capsys, "--size", "tiny", "--steps", "4", "--plot", str(picture))
    assert f"plot: {picture} (the run's phases and loads; each phase change against the " \
        "floor)" in lines
    data = picture.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_before  # no pyplot state left


@pytest.mark.fast
def test_write_plot_draws_ratios_and_left_out_changes_in_the_format_its_name_asks(tmp_path):
    records = [record(None, "a", 2**20, 1.0, 0.002), record("a", "b", 2**20, 1.1, 0.004)]
    spans = [timeline.PhaseSpan(name=n, start=s, end=s + 0.05, enter_seconds=0.0,
                                transition=None, thread="MainThread")
             for n, s in (("a", 1.0), ("b", 1.1))]
    costs = ChangeCosts(changes=(change(None, "a", 2**20, [0.002, 0.003], [0.001, 0.001]),
                                 change("a", "b", 1024, [0.004], [0.00001])), repeats=2)
    svg = write_plot(tmp_path / "t.svg", title="t", records=records, spans=spans, costs=costs)
    text = svg.read_text()
    assert text.startswith("<?xml") and "<svg" in text
    png = write_plot(tmp_path / "t.png", title="t", records=records, spans=spans, costs=costs)
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.fast
def test_without_matplotlib_the_plot_is_refused_with_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(PlotError) as error:
        write_plot(tmp_path / "t.png", title="t", records=[], spans=[],
                   costs=ChangeCosts(changes=()))
    assert isinstance(error.value, ResidencyError)
    assert str(error.value) == ("drawing the timeline (--plot) needs matplotlib, which is not "
                                "installed: pip install -e \".[plot]\"")
    assert not (tmp_path / "t.png").exists()


@pytest.mark.fast
def test_a_samples_figure_prints_in_milliseconds_with_three_digits():
    assert [timeline._ms(s) for s in (1.24, 0.0235, 0.00124, 0.000152)] == \
        ["1240", "23.5", "1.24", "0.152"]
    assert format_nbytes(2**20) == "1.0 MiB"


@pytest.mark.fast
def test_the_report_excerpt_in_the_docs_has_the_headers_the_code_prints(capsys, monkeypatch):
    """docs/diffusers.md, "The main job": the excerpt's header and legend lines are the report's
    own (a run at the tiny size prints the same ones; only the figures differ)."""
    quiet(monkeypatch)
    text = (Path(__file__).resolve().parent.parent / "docs" / "diffusers.md").read_text()
    section = text[text.index("## The main job"):]
    excerpt = section[section.index("```\nresidency: "):].split("```")[1].splitlines()
    headers = [line for line in excerpt if line.startswith((
        "groups: ", "  #     at ms", "    transition ", "phase changes against the floor: ",
        "  a change from - ", "  (on the CPU the "))]
    assert len(headers) == 6, headers
    lines = report_of(capsys, "--size", "tiny", "--steps", "2")
    assert [line for line in headers if line not in lines] == []
