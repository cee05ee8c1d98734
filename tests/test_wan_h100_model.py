"""benchmarks/wan_h100.py: the arithmetic of the Wan2.2-T2V-A14B H100 model, and its labelling.

The model (not a measurement): a steady call's seconds are vLLM-Omni's no-offload 74.6 s plus
the copy time no compute hides ([Note: the schedule] in the benchmark).  Checked here against the
formulas written out by hand at 80, 48 and 24 GB; the JSON says "MODEL" and names a source for
every assumption.  The simulated check itself is a benchmark run (benchmarks/README.md).
"""

from __future__ import annotations

import json

import pytest

from _benchmarks import import_benchmarks

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)

(wan,) = import_benchmarks("wan_h100")
GB = 1e9
RATE = 55 * GB
E, OWN, BLOCK, VAE = 11.4 * GB, 0.4 * GB, 0.704 * GB, 0.5 * GB
X = OWN + 40 * BLOCK  # one expert
FORWARD = (74.63497 - 0.5 - 4.0) / 80


@pytest.fixture(scope="module")
def p():
    return wan.pipeline(wan.assumptions(55.0))


def test_the_pipeline_is_the_assumptions(p):
    assert (p.encoder, p.own, p.block, p.blocks, p.vae) == (E, OWN, BLOCK, 40, VAE)
    assert p.passes == (36, 44)  # 18 high-noise steps of 40, two forwards each
    assert p.forward_s == pytest.approx(FORWARD)
    assert p.compute_s == pytest.approx(74.63497)
    assert p.headroom == 6 * GB and p.rate == RATE


def test_without_offloading_it_fits_only_the_80_gb_card(p):
    assert wan.model(p, "none", 80 * GB)["seconds"] == pytest.approx(74.63497)
    assert not wan.model(p, "none", 48 * GB)["fits"]


@pytest.mark.parametrize("budget", [80, 48])
def test_module_mode_loads_the_encoder_and_both_experts_whole(p, budget):
    row = wan.model(p, "module", budget * GB)
    assert row["nbytes"] == pytest.approx(E + 2 * X)
    assert row["seconds"] == pytest.approx(74.63497 + (E + 2 * X) / RATE)


def test_module_mode_does_not_fit_24_gb(p):
    assert not wan.model(p, "module", 24 * GB)["fits"]  # an expert is 28.6 GB
    assert not wan.model(p, "module + prefetch", 24 * GB)["fits"]


def test_prefetch_hides_each_copy_behind_the_phase_it_overlaps_where_both_fit(p):
    at_80 = wan.model(p, "module + prefetch", 80 * GB)
    hidden = (max(0, E / RATE - 4.0) + max(0, X / RATE - 0.5)
              + max(0, X / RATE - 36 * FORWARD))
    assert at_80["exposed_s"] == pytest.approx(hidden)
    at_48 = wan.model(p, "module + prefetch", 48 * GB)  # both experts: 57.2 GB > 42
    assert at_48["exposed_s"] == pytest.approx(hidden + X / RATE)
    assert at_48["how"].endswith("prefetched, prefetched, loaded")


def test_layer_mode_streams_every_block_when_copies_hide_behind_compute(p):
    copy = BLOCK / RATE
    assert copy < FORWARD / 40  # 12.8 ms of copy per block against 21.9 ms of compute
    row = wan.model(p, "layer", 24 * GB)
    assert row["how"] == "resident_layers=0"
    entries = sum(OWN + n * 40 * BLOCK + BLOCK for n in (36, 44))  # own, passes, the ring
    assert row["nbytes"] == pytest.approx(E + entries)
    assert row["exposed_s"] == pytest.approx(E / RATE + 2 * (OWN / RATE + copy))


def test_auto_keeps_everything_at_80_gb_and_is_the_planners_choice_below(p):
    assert wan.model(p, "auto", 80 * GB)["nbytes"] == 0
    at_48 = wan.model(p, "auto", 48 * GB)
    assert at_48["fits"] and 0 < at_48["nbytes"] < E + 2 * X  # less than module mode moves
    at_24 = wan.model(p, "auto", 24 * GB)
    layer = wan.model(p, "layer", 24 * GB)
    assert at_24["fits"] and at_24["nbytes"] <= layer["nbytes"]


def test_an_unknown_mode_is_refused(p):
    with pytest.raises(ValueError, match=r"mode 'sequential': give one of"):
        wan.model(p, "sequential", 80 * GB)


def test_the_simulated_pipeline_is_the_h100s_bytes_scaled_down(p):
    parts = wan._sim_parts(p)
    sizes = {name: sum(t.nbytes for t in m.state_dict().values()) for name, m in parts.items()}
    assert sizes["transformer"] == pytest.approx(X / wan.BYTE_SCALE, rel=0.01)
    assert sizes["text_encoder"] == pytest.approx(E / wan.BYTE_SCALE, rel=0.01)
    assert sizes["vae"] == pytest.approx(VAE / wan.BYTE_SCALE, rel=0.01)
    assert len(parts["transformer"].blocks) == 40


def test_the_json_says_model_and_names_every_source(tmp_path, capsys):
    out = tmp_path / "wan.json"
    assert wan.main(["--h2d-gbps", "55", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["label"].startswith("MODEL, not a measurement")
    assert result["simulated"] is None
    for name, assumption in result["assumptions"].items():
        assert assumption["source"], name
        assert assumption["kind"] in ("measured", "published", "derived", "chosen")
    modes = {(row["budget_gb"], row["mode"]) for row in result["rows"]}
    assert modes == {(b, m) for b in (80, 48, 24) for m in wan.MODES}
    printed = capsys.readouterr().out
    assert "| 80 GB | module | 75.9 | 68.5 | 121.6 |" in printed


@pytest.mark.parametrize("argv, message", [
    (["--calls", "0"], "--calls must be at least 1"),
    (["--h2d-gbps", "-3"], "--h2d-gbps must be positive"),
])
def test_arguments_are_checked_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "wan.json"
    with pytest.raises(SystemExit):
        wan.main([*argv, "--out", str(out)])
    assert message in capsys.readouterr().err
    assert not out.exists()
