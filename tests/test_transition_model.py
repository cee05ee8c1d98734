"""benchmarks/transition_model.py: the arithmetic of the 8-GPU transition model, and its labelling.

The model (not a measurement): rank-local t = S / r; all-gather t = (S/k) / r + S (k-1) / (k B),
with r = min(H / u, C / k).  Checked against the formula written out here, on both sides of its
crossover (B > r), and the JSON it writes says "model" and names a source for every assumption.
"""

from __future__ import annotations

import json

import pytest

from _benchmarks import ROOT, import_benchmarks

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)

(tm,) = import_benchmarks("transition_model")
GB = 1e9


def test_rank_local_is_the_bytes_over_one_gpus_rate():
    node = tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=None, gpus=8)
    assert node.per_gpu_gbps() == 55
    assert node.rank_local_s(28 * GB) == pytest.approx(28 / 55)


def test_allgather_is_the_shards_copy_plus_the_gather():
    node = tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=None, gpus=8)
    copy, gather = node.allgather_s(28 * GB)
    assert copy == pytest.approx(28 / 8 / 55)
    assert gather == pytest.approx(28 * 7 / 8 / 360)  # nccl-tests: t = S (k-1) / (k busbw)
    row = tm.transition(node, 28 * GB)
    assert row["allgather_s"] == pytest.approx(28 / 8 / 55 + 28 * 7 / 8 / 360)
    assert row["allgather_speedup"] == pytest.approx((28 / 55) / row["allgather_s"])
    assert row["host_bytes_read"] == {"rank_local": 8 * 28 * GB, "allgather": 28 * GB}


@pytest.mark.parametrize("busbw, faster", [(360, True), (55, None), (20, False)],
                         ids=["nvlink-faster", "equal", "nvlink-slower"])
def test_allgather_wins_exactly_when_the_gather_outruns_one_gpus_h2d(busbw, faster):
    node = tm.Node(h2d_gbps=55, allgather_busbw_gbps=busbw, host_cap_gbps=None, gpus=8)
    row = tm.transition(node, 5 * GB)
    if faster is None:
        assert row["allgather_s"] == pytest.approx(row["rank_local_s"])
    else:
        assert (row["allgather_s"] < row["rank_local_s"]) is faster, row


def test_one_gpu_gathers_nothing():
    node = tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=None, gpus=1)
    assert sum(node.allgather_s(5 * GB)) == pytest.approx(node.rank_local_s(5 * GB))


def test_the_host_shares_its_bandwidth_and_uplinks_split_a_link():
    capped = tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=300, gpus=8)
    assert capped.per_gpu_gbps() == pytest.approx(37.5)
    assert capped.bottleneck() == "host memory"
    assert capped.rank_local_s(28 * GB) == pytest.approx(28 / 37.5)
    shared = tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=614.4, gpus=8,
                     gpus_per_uplink=2)
    assert shared.per_gpu_gbps() == pytest.approx(27.5)
    assert shared.bottleneck() == "PCIe"
    # The more the host link is the bottleneck, the more all-gather gains (B fixed, r smaller).
    free = tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=None, gpus=8)
    speedups = [tm.transition(n, 28 * GB)["allgather_speedup"] for n in (free, capped, shared)]
    assert 1 < speedups[0] < speedups[1] < speedups[2], speedups


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match=r"h2d_gbps must be positive, got 0"):
        tm.Node(h2d_gbps=0, allgather_busbw_gbps=360)
    with pytest.raises(ValueError, match=r"gpus must be a whole number of at least 1, got 0"):
        tm.Node(h2d_gbps=55, allgather_busbw_gbps=360, gpus=0)
    with pytest.raises(SystemExit):
        tm.main(["--gpus", "0", "--out", "/nonexistent/never-written"])


def _check_labelled_and_consistent(result: dict) -> None:
    """A model, saying so; every assumption sourced; every row the formula of those assumptions."""
    assert result["kind"] == "model" and result["measurement"] is False
    assert result["label"].startswith("MODEL, not a measurement")
    for name, assumption in result["assumptions"].items():
        assert assumption["kind"] in ("measured", "published", "derived", "chosen"), name
        assert len(assumption["source"]) > 20, name
    for kind in ("h2d_gbps", "allgather_busbw_gbps"):
        if result["assumptions"][kind]["kind"] in ("published", "measured"):
            assert "http" in result["assumptions"][kind]["source"] or (
                "gpu-check" in result["assumptions"][kind]["source"]), kind
    base = {name: a["value"] for name, a in result["assumptions"].items()}
    assert [s["scenario"] for s in result["scenarios"]][0] == "as assumed"
    for scenario in result["scenarios"]:
        node = tm.Node(**{**base, **scenario["changes"]})
        for row in scenario["rows"]:
            expected = tm.transition(node, row["nbytes"])
            numbers = [k for k, v in expected.items() if isinstance(v, float)]
            assert [row[k] for k in numbers] == pytest.approx([expected[k] for k in numbers]), row
            assert row["bottleneck"] == expected["bottleneck"]
            assert row["host_bytes_read"] == expected["host_bytes_read"]


def test_the_json_is_labelled_a_model_with_a_source_for_every_assumption(tmp_path, capsys):
    assert tm.main(["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("MODEL, not a measurement")
    result = json.loads((tmp_path / "transition_model.json").read_text())
    _check_labelled_and_consistent(result)
    groups = [row["group"] for row in result["scenarios"][0]["rows"]]
    assert groups == ["Wan2.2 A14B DiT expert, bf16", "text encoder, bf16"]
    assert result["scenarios"][0]["rows"][0]["nbytes"] == 28 * GB


def test_the_committed_results_are_the_model_of_their_own_assumptions():
    _check_labelled_and_consistent(
        json.loads((ROOT / "benchmarks" / "results" / "transition_model.json").read_text()))


def test_a_measured_h2d_rate_is_preferred_to_the_published_one(tmp_path):
    def check(name: str, dry_run: bool, gbps: float) -> None:
        (tmp_path / name).write_text(json.dumps(
            {"dry_run": dry_run, "device_name": "NVIDIA H200",
             "sections": {"ceiling": {"h2d_gbps": gbps}}}))

    check("gpu-check-dry-run-cpu-2026-12-01.json", True, 3.0)  # a dry run measures nothing
    published = tm.assumptions(results=tmp_path)["h2d_gbps"]
    assert (published.kind, published.value) == ("published", tm.PUBLISHED_H2D_GBPS)
    check("gpu-check-nvidia-h200-2026-12-01.json", False, 52.5)
    measured = tm.assumptions(results=tmp_path)["h2d_gbps"]
    assert (measured.kind, measured.value) == ("measured", 52.5)
    assert "gpu-check-nvidia-h200-2026-12-01.json" in measured.source
    given = tm.assumptions(h2d_gbps=40.0, results=tmp_path)["h2d_gbps"]
    assert (given.kind, given.value) == ("chosen", 40.0)
