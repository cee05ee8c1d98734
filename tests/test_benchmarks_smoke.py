"""The benchmark code cannot rot: the suite at the tiny scale, the report, the GPU check's dry run.

No figure is asserted here (speed goals live in benchmarks/); these tests check that every case
runs, records its floor and ratio, that the report writes what it promises, and that the prepared
GPU script runs every section without an error: on the CPU (its dry run), and on the simulated
device of tests/simdevice, in a process of its own (loading the simulator renames PrivateUse1 for
the whole process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from residency.modules.tensors import ACCELERATOR_ALIGNMENT

from _benchmarks import ROOT, import_benchmarks

gpu_check, goals, report = import_benchmarks("gpu_check", "goals", "report")


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    """Start the whole suite at the tiny scale in a subprocess; it runs beside the dry run below."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "benchmarks/", "-q", "-p", "no:cacheprovider",
         "--bench-scale=tiny", f"--benchmark-json={out}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    yield process, out
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def simulated_suite(tmp_path_factory):
    """Start the accelerator-shaped cases (benchmarks/test_simulated.py) at the tiny scale on the
    simulated device, in a process of their own (loading it renames PrivateUse1 for the process)."""
    out = tmp_path_factory.mktemp("sim-bench") / "sim.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "benchmarks/", "-q", "-p", "no:cacheprovider",
         "--bench-device=sim", "--bench-scale=tiny", f"--benchmark-json={out}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    yield process, out
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def tiny_run(tiny_suite) -> dict:
    """The tiny suite's pytest-benchmark JSON (benchmarks enabled, so floors and ratios exist)."""
    process, out = tiny_suite
    output, _ = process.communicate(timeout=600)  # a hang guard: CI runs it beside the accelerator child
    assert process.returncode == 0, output[-4000:]
    return json.loads(out.read_text())


def test_gpu_check_dry_run_runs_every_section(tiny_suite, tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gpu-check-dry-run-cpu-*.json")
    results = json.loads(path.read_text())
    assert results["dry_run"] is True and results["torch"] and results["date"]
    sections = results["sections"]
    assert set(sections) == set(gpu_check.SECTIONS)
    assert not [name for name, section in sections.items() if "error" in section]
    assert sections["ceiling"]["h2d_gbps"] > 0
    assert all(r["onload_gbps"] > 0 for r in sections["onload"]["groups"].values())
    # Every changed chunk is written back: the weights, plus the alignment padding between them.
    evicted = sections["eviction"]
    assert evicted["nbytes"] <= evicted["changed"]["written_back"] <= 1.01 * evicted["nbytes"]
    assert "needs CUDA" in sections["steady_state"]["sync_debug"]["skipped"]
    modes = sections["pipeline"]["modes"]
    assert not [mode for mode, result in modes.items() if "error" in result]
    assert modes["residency"]["bit_identical_to_none"] is True
    for peer in ("diffusers_model_cpu_offload", "diffusers_group_offload"):
        assert "skipped" in modes[peer] or modes[peer]["bit_identical_to_none"] is True
    assert set(results["must_show"]) >= {"onload_fraction_of_ceiling", "pinned_over_weights"}
    # Issue 14: layer mode with resident_layers 0 and 2 beside no offload and diffusers.
    layer = sections["layers"]
    assert layer["sizing"]["block_copy_s"] > 0 and layer["sizing"]["block_compute_s"] > 0
    streamed = {label: r for label, r in layer["modes"].items() if label.startswith("layers")}
    assert set(streamed) == {"layers_resident_0", "layers_resident_2",
                             "layers_resident_0_no_detection"}
    for label, result in layer["modes"].items():
        assert "skipped" in result or result["bit_identical_to_none"] is True, label
    assert streamed["layers_resident_2"]["kept_blocks"] == 2
    assert all(r["prefetch_order"]["ok"] for r in streamed.values())
    assert results["must_show"]["layer_next_copy_issued_before_compute"]["met"] is True


def test_every_case_records_its_floor_and_ratio(tiny_run):
    cases = {b["name"]: b["extra_info"] for b in tiny_run["benchmarks"]}
    expected = {"test_reentry", "test_swap_400mib", "test_swap_400mib_weights_not_edited",
                "test_eviction[unchanged]", "test_eviction[changed]",
                "test_eviction_of_an_unchanged_swap_sized_group", "test_change_detection[check]",
                "test_per_forward_overhead[accelerate_hook_str]", "test_pipeline_cycle[residency]"}
    assert expected <= set(cases)
    assert any(name.startswith("test_transition_vs_size[") for name in cases)
    assert any(name.startswith("test_transition_vs_tensor_count[") for name in cases)
    assert any(name.startswith("test_cold_start[") for name in cases)
    for name, info in cases.items():
        assert info["floor_s"] > 0, name
        assert info["ratio"] > 0, name
    changed = cases["test_eviction[changed]"]  # every chunk: the weights and the padding between
    assert changed["nbytes"] <= changed["written_back"] <= 1.01 * changed["nbytes"]
    assert cases["test_eviction[unchanged]"]["written_back"] == 0
    assert tiny_run["machine_info"]["cpu_model"]
    assert tiny_run["residency"]["scale"] == "tiny"


def test_layer_cases_record_overhead_steps_and_the_peer(tiny_run):
    """benchmarks/test_layers.py: per-block overhead (detection on and off, the hollow blocks),
    steps under every mode, and diffusers' group offloading (or its skip, with the reason)."""
    cases = {b["name"]: b["extra_info"] for b in tiny_run["benchmarks"]}
    for size in ("shrunk", "shrunk_hollow", "wan1.3b"):
        for detection in ("no_detection", "detection"):
            info = cases[f"test_layer_block_overhead[{size}-{detection}]"]
            assert "per_tensor_overhead_s" in info and info["tensors_per_block"] == 27
            assert info["none_s"] > 0 and info["copy_s"] > 0
    assert cases["test_layer_block_overhead[shrunk_hollow-no_detection]"]["goal"]["text"] == \
        goals.LAYER_BLOCK.text
    for mode in ("none", "layers", "layers_no_detection", "module", "module_swapped"):
        info = cases[f"test_layer_step[{mode}]"]
        assert info["bit_identical"] is True and info["floor_ratio"] > 1, mode
    assert cases["test_layer_step[layers]"]["moved_per_step_nbytes"] > 0
    assert cases["test_layer_step[module]"]["moved_per_step_nbytes"] == 0
    assert cases["test_layer_step[layers]"]["device_nbytes"] < \
        cases["test_layer_step[module]"]["device_nbytes"]
    skipped = {s["case"]: s["reason"] for s in tiny_run["skipped"]}
    peer = "test_layers_vs_group_offload[diffusers_group_offload]"
    assert peer in skipped or cases[peer]["bit_identical"] is True


def test_a_peer_without_an_accelerator_is_skipped_with_its_reason(tiny_run):
    skipped = {s["case"]: s["reason"] for s in tiny_run["skipped"]}
    if tiny_run["residency"]["device"] == "cpu":
        assert "no accelerator" in skipped["test_pipeline_cycle[diffusers_model_cpu_offload]"]
        assert "test_pipeline_cycle[diffusers_model_cpu_offload]" not in {
            b["name"] for b in tiny_run["benchmarks"]}


def test_report_writes_summary_table_and_plot(tiny_run, tmp_path):
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(tiny_run))
    assert report.main(["--json", str(source), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "cpu-summary.json").read_text())
    assert summary["machine"]["cores"] >= 1 and summary["machine"]["torch"]
    reentry = next(c for c in summary["cases"] if c["name"] == "test_reentry")
    assert reentry["goal"]["goal"] == goals.REENTRY.text
    assert reentry["goal"]["met"] is None, "the tiny scale must not judge goals"
    assert summary["skipped"] == tiny_run["skipped"]
    assert summary["plot"] == {"path": "cpu-latency.png"}
    assert (tmp_path / "out" / "cpu-latency.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "out" / "cpu-table.md").read_text()
    assert "| test_swap_400mib |" in table
    layers = summary["layers"]
    assert "## Layer mode (issue 14)" in table and layers["commit"]
    sizes = ("shrunk", "shrunk_hollow", "wan1.3b")
    assert {(r["size"], r["detect_edits"]) for r in layers["block_overhead"]} == {
        (size, detect) for size in sizes for detect in (False, True)}
    assert {r["size"] for r in layers["digests"]} == set(sizes)
    assert set(layers["steps"]) == {"none", "layers", "layers_no_detection", "module",
                                    "module_swapped"}
    judged = [r["goal"] for r in layers["block_overhead"] if "goal" in r]
    assert judged and all(g["met"] is None for g in judged), "the tiny scale must not judge goals"


def test_report_without_matplotlib_still_writes_the_summary(tiny_run, tmp_path, monkeypatch,
                                                             capsys):
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(tiny_run))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert report.main(["--json", str(source), "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "cpu-summary.json").read_text())
    assert "matplotlib is not installed" in summary["plot"]["skipped"]
    assert not (tmp_path / "cpu-latency.png").exists()
    assert "plot: skipped: matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.fast
def test_gpu_check_without_an_accelerator_refuses_and_says_how(tmp_path, capsys):
    if gpu_check.torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--dry-run" in err and "--device sim" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.fast
@pytest.mark.parametrize(("argv", "message"), [
    (["--dry-run", "--device", "sim"], "cannot be combined with --device sim"),
    (["--device", "sim", "--sections", "ceiling,nonsense"], "unknown section(s) ['nonsense']"),
])
def test_gpu_check_refuses_bad_arguments_before_any_work(argv, message, tmp_path, capsys):
    assert gpu_check.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert gpu_check.torch.accelerator.current_accelerator() is None or \
        gpu_check.torch.accelerator.current_accelerator().type != "sim", "the simulator was loaded"


def test_gpu_check_runs_every_section_on_the_simulated_device(tiny_suite, simulated_suite,
                                                             tmp_path):
    """The script an accelerator run will use, end to end on the simulated asynchronous device
    (in a process of its own: loading it renames PrivateUse1 for the whole process; the simulated
    cases run beside it, mostly asleep in the simulator's delays)."""
    finished = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "sim", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = finished.stdout + finished.stderr
    if finished.returncode == 2 and "simulated device is not available" in output:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the simulator did not build in CI:\n{output[-4000:]}")
        pytest.skip(output.strip().splitlines()[-1])
    assert finished.returncode == 0, output[-6000:]
    (path,) = tmp_path.glob("gpu-check-sim-simulated-*.json")
    results = json.loads(path.read_text())
    assert results["simulated"] is True and results["dry_run"] is False
    assert results["device"] == "sim:0" and "SIMULATED" in results["note"]
    sections = results["sections"]
    assert set(sections) == set(gpu_check.SECTIONS)
    assert not {name: s["error"] for name, s in sections.items() if "error" in s}
    ceiling = sections["ceiling"]
    assert ceiling["pinned"] is True and ceiling["h2d_gbps"] > 0 and ceiling["h2d_event_gbps"] > 0
    for group in sections["onload"]["groups"].values():
        assert group["registration"]["pinned"] is True and group["peak_device_bytes"] > 0
    tiers = sections["host_tiers"]  # issue 23: the copy from a mapped cache file; pinning is CUDA's
    assert tiers["cache_h2d_gbps"] > 0 and "CUDA" in tiers["cache_pin"]["skipped"]
    evicted = sections["eviction"]
    assert evicted["unchanged"]["written_back"] == 0
    # Every changed chunk: the weights and the padding between them (512-byte boundaries here).
    padding = evicted["tensors"] * ACCELERATOR_ALIGNMENT.boundary
    assert evicted["nbytes"] <= evicted["changed"]["written_back"] <= evicted["nbytes"] + padding
    steady = sections["steady_state"]
    assert "needs CUDA" in steady["sync_debug"]["skipped"]
    assert steady["counted_syncs"] == {"host_syncs": 0, "phases": steady["phases"]}
    assert steady["with_detection_counted_syncs"]["host_syncs_per_detected_eviction"] == 1
    assert steady["memory_reserved"]["flat"] is True
    assert results["must_show"]["host_syncs_in_steady_state"]["met"] is True
    assert sections["edits"]["quantized"]["int8_over_bf16"] < 0.6
    modes = sections["pipeline"]["modes"]
    assert not {mode: r["error"] for mode, r in modes.items() if "error" in r}
    assert modes["residency"]["bit_identical_to_none"] is True
    layer = sections["layers"]
    for label, result in layer["modes"].items():
        if label.startswith("layers"):
            assert result["bit_identical_to_none"] is True, label
            assert result["prefetch_order"]["ok"] is True, label
        else:
            assert "error" not in result, label
    assert results["must_show"]["layer_next_copy_issued_before_compute"]["met"] is True


@pytest.mark.fast
def test_prefetch_order_reads_the_block_records():
    """`benchmarks.layers.prefetch_order` on a tiny DiT in layer mode: every block's successor
    was issued before it computed; a step run out of order is told apart."""
    from benchmarks import layers

    shape = layers.DiTShape.tiny(blocks=3)
    device = gpu_check.torch.device("cpu")
    run = layers.install("layers", layers.build(shape, layers.make_state(shape, device)), device)
    try:
        args = layers.inputs(shape, device)
        run.step(*args)
        run.step(*args)
        records = list(run.scheduler.block_records)[-9:]
        assert layers.prefetch_order(records, 3)["ok"] is True
        with run.scheduler.resident("dit") as group, gpu_check.torch.no_grad():
            x, context, time_features = args
            hidden = run.model.patch_embedding(x)
            modulation = run.model.time_proj(gpu_check.torch.nn.functional.silu(
                run.model.time_embedder(time_features))).unflatten(1, (6, -1))
            text = run.model.text_embedder(context)
            for index in (2, 0, 1):  # out of order: block 2 is not the prefetched one
                hidden = group.layers()[index](hidden, text, modulation)
        order = layers.prefetch_order(list(run.scheduler.block_records)[-9:], 3)
        assert order["ok"] is False and order["loads_on_demand"] >= 1
    finally:
        run.close()


@pytest.mark.beside  # long, with processes of its own: see tests/_accelerator.py
def test_host_memory_report_measures_shared_and_private_masters(tmp_path):
    """`python -m benchmarks.host_memory` at a small size: both cases per rank count, summed."""
    from benchmarks import host_memory

    assert host_memory.main(["--ranks", "2", "--nbytes-mib", "16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu-host-memory.json").read_text())["rows"]
    assert [(r["ranks"], r["shared"]) for r in rows] == [(2, True), (2, False)]
    shared, private = rows
    assert shared["node_bytes"] < private["node_bytes"], "sharing must hold fewer host bytes"
    assert all(len(r["per_rank_bytes"]) == 2 for r in rows)


def test_simulated_cases_and_their_report_section(simulated_suite, tmp_path):
    """The "accelerator-shaped (simulated)" cases run on the simulator at the tiny scale; the
    report gives them their own section, labelled as a simulation wherever a figure is shown."""
    process, out = simulated_suite
    output, _ = process.communicate(timeout=240)
    built = "--bench-device=sim: the simulated device did not build" not in output
    if process.returncode != 0 and not built:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the simulator did not build in CI:\n{output[-4000:]}")
        pytest.skip("the simulated device did not build")
    assert process.returncode == 0, output[-6000:]
    run = json.loads(out.read_text())
    assert run["residency"]["device"] == "sim:0" and "SIMULATED" in run["residency"]["simulated"]
    cases = {b["name"]: b["extra_info"] for b in run["benchmarks"]}
    steps = {f"test_simulated_layer_step[{mode}-{bound}]"
             for mode in ("layers_no_detection", "layers") for bound in ("compute_bound", "copy_bound")}
    transitions = {f"test_simulated_transition[{p}]" for p in ("no_prefetch", "prefetch")}
    syncs = {f"test_simulated_host_syncs[{m}]" for m in ("layers_no_detection", "layers")}
    assert set(cases) == steps | transitions | syncs, "only the simulated cases run on sim"
    for name in steps:
        info = cases[name]
        assert info["bit_identical"] is True and info["compute_s"] > 0 and info["copy_s"] > 0
        assert info["floor_s"] == pytest.approx(max(info["compute_s"], info["copy_s"]), rel=0.5)
        assert isinstance(info["host_syncs_per_step"], int), name
    assert cases["test_simulated_layer_step[layers-compute_bound]"]["goal"]["text"] == \
        goals.SIM_LAYER_STEP.text
    assert cases["test_simulated_transition[prefetch]"]["prefetch_started"] is True
    assert cases["test_simulated_host_syncs[layers]"]["evictions_per_step"] == 2  # tiny: 2 blocks

    assert report.main(["--json", str(out), "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "sim-summary.json").read_text())
    sim = summary["simulated"]
    assert "SIMULATED" in sim["label"] and "not GPU figures" in sim["label"]
    assert len(sim["layer_steps"]) == 4 and len(sim["transitions"]) == 2
    assert {r["mode"] for r in sim["host_syncs"]} == {"layers_no_detection", "layers"}
    assert all(g["met"] is None for g in summary["goals"]), "the tiny scale must not judge goals"
    assert "simulated run" in summary["plot"]["skipped"]
    table = (tmp_path / "sim-table.md").read_text()
    assert table.startswith("**SIMULATED accelerator")
    assert "## Accelerator-shaped (simulated)" in table and "x max(compute, copy)" in table


def test_simulated_cases_are_skipped_off_the_simulator_saying_how(tiny_run):
    skipped = {s["case"]: s["reason"] for s in tiny_run["skipped"]}
    reason = skipped["test_simulated_transition[prefetch]"]
    assert "--bench-device=sim" in reason


@pytest.mark.fast
def test_the_commit_comparison_checks_its_arguments_before_running(tmp_path, capsys):
    """benchmarks/compare.py refuses a folder that is not a checkout, and fewer than two rounds
    (no noise figure), before it runs anything."""
    from benchmarks import compare

    root = Path(__file__).resolve().parent.parent
    with pytest.raises(SystemExit) as refused:
        compare.main([str(tmp_path), str(root), "-k", "test_reentry"])
    assert refused.value.code == 2
    assert f"{tmp_path} is not a checkout of this project" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        compare.main([str(root), str(root), "-k", "test_reentry", "--rounds", "1"])
    assert refused.value.code == 2
    assert "--rounds must be at least 2" in capsys.readouterr().err


@pytest.mark.beside  # the parent's longest test: in the second child the two cores finish together
def test_cold_start_runs_its_cases_at_the_tiny_scale(tmp_path):
    """Issue 23's benchmark, the cases whose rows say where the masters live, beside the floor:
    each case runs in its child, the outputs are the same bytes, the warm restart maps its cache
    files and the host tier file-backs the groups beyond its limit.  (Against diffusers' plain
    pipeline, every output is compared in tests/test_file_reads.py and test_read_behind.py.)"""
    cases = ["disk_floor", "residency_cache_write", "residency_warm_restart", "host_tier"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--scale", "tiny", "--out",
         str(tmp_path), "--folder", str(tmp_path / "wan"), "--cases", *cases],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "cpu-cold-start.json").read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert list(rows) == cases and result["outputs_identical"] is True
    assert not [case for case, row in rows.items() if "failed" in row]
    assert rows["disk_floor"]["read_gb_per_s"] > 0
    groups = 4  # the text encoder, two experts, the VAE
    assert rows["residency_cache_write"]["mapped_cache_files"] == 0
    assert rows["residency_warm_restart"]["mapped_cache_files"] == groups
    assert rows["residency_warm_restart"]["cached_at_start"] > 0.9
    assert rows["host_tier"]["file_backed_groups"] == ["transformer", "transformer_2"]
    for case in cases[1:]:
        assert rows[case]["seconds"] > 0 and rows[case]["rss_over_held"] > 0, case


def test_plans_runs_every_budget_with_and_without_guidance_at_the_tiny_scale():
    """Issue 47's benchmark: each configuration's steady calls move exactly the bytes the
    settled plan predicts, the plan holds through them, and guidance doubles the passes it
    learned (the seconds against their goal are the benchmark's, on the small scale)."""
    import torch

    (plans,) = import_benchmarks("plans")
    result = plans.sweep("tiny", torch.device("cpu"))
    assert [(row["fraction"], row["guidance"]) for row in result["rows"]] == [
        (fraction, guidance) for guidance in (False, True) for fraction in plans.BUDGETS]
    for row in result["rows"]:
        assert row["bytes_exact"] and row["plan_held"], row["plan"]
        assert len(row["calls"]) == plans.SETTLE + plans.STEADY
        assert row["passes"]["transformer"] == 2 * (2 if row["guidance"] else 1), row["passes"]
        assert row["predicted_seconds"] > 0 and row["steady_median_seconds"] > 0
    assert result["load_average"]["before"] and "| 0.25x | yes |" in plans._table(result)


def test_plans_times_the_search_alone(tmp_path, capsys):
    """``python -m benchmarks.plans --search``: one row per expert depth, budget and objective,
    each search timed, the JSON written with the machine and the date."""
    import json

    (plans,) = import_benchmarks("plans")
    out = tmp_path / "search.json"
    assert plans.main(["--search", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["blocks"], r["fraction"], r["overlap"]) for r in result["rows"]] == [
        (b, f, o) for b in plans.SEARCH_BLOCKS for f in plans.SEARCH_BUDGETS
        for o in (False, True)]
    assert all(r["seconds"] > 0 and len(r["repeats"]) == 3 for r in result["rows"])
    assert result["machine"] and result["date"]
    assert f"written to {out}" in capsys.readouterr().out
