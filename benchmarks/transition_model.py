"""``python -m benchmarks.transition_model``: a MODEL, not a measurement, of one phase change on one
8-GPU node, with ``weight_transfer="rank-local"`` against ``"allgather"`` (issue 15).

    python -m benchmarks.transition_model             # table, and results/transition_model.json
    python -m benchmarks.transition_model --h2d-gbps 50 --host-cap-gbps 300 --out /tmp/model/

No GPU runs here: the figures are arithmetic on the assumptions below, each written into the JSON
with its value, its kind (measured, published, derived or chosen) and its source.  The single-GPU
host-to-device rate is the measured one when a GPU check has run (``ceiling.h2d_gbps`` of a
``results/gpu-check-*.json`` that is not a dry run); otherwise a published figure, labelled so.

[Note: the model]
The ranks of a data-parallel job run the same pipeline, so the node's k GPUs enter the same phase
together and load the incoming group of S bytes at the same time:

* rank-local: every GPU copies the whole group host to device:   t = S / r
* all-gather: every GPU copies 1/k of it (residency/multirank/sharded.py), then one all-gather over NVLink
  assembles it on every GPU:                                     t = (S / k) / r + S (k-1) / (k B)

r is one GPU's host-to-device rate while all k copy at once: min(H / u, C / k), its own PCIe link
(H, shared by u GPUs behind one switch uplink) or its share of the host's memory bandwidth C.  B
is the all-gather's bus bandwidth as nccl-tests defines it (busbw = algbw (k-1)/k for all_gather,
S the gathered bytes: ``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests), so the gather takes
S (k-1) / (k B).  Subtracting, all-gather is faster exactly when B > r (k > 1): the saving is
S (k-1)/k (1/r - 1/B).  The host reads S bytes per phase change with all-gather, k S with
rank-local.  Both times are proportional to S, so their ratio does not depend on the group's size.

Not modelled: fixed latencies (a phase change of a few MB is latency-bound; these groups are GBs),
the overlap of a shard's copy with the gather (our implementation runs them one after the other,
as modelled), NUMA distance to the host pages, edit detection's digests, and eviction (unchanged
weights are not copied back).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs

__all__ = ["Assumption", "Node", "assumptions", "main", "model", "transition"]

GB = 1e9
#: What the output says it is, first thing.
LABEL = ("MODEL, not a measurement: arithmetic on the assumptions listed with their sources "
         "(benchmarks/transition_model.py); no GPU ran")
RESULTS = Path(__file__).resolve().parent / "results"

#: The published single-GPU host-to-device rate, used when no GPU check has measured one.
PUBLISHED_H2D_GBPS = 55.0
PUBLISHED_H2D_SOURCE = (
    "published: NVIDIA's nvbandwidth host-to-device copies on H100 (PCIe Gen5 x16) report "
    "56.7-57.1 GB/s per GPU (https://github.com/NVIDIA/nvbandwidth/issues/6); rounded down to 55 "
    "GB/s, 87% of the link's 63 GB/s per direction (32 GT/s x 16 lanes, 128b/130b encoding)"
)


@attrs.frozen(kw_only=True)
class Assumption:
    """One input of the model: its value, unit, kind and where it comes from."""

    value: float | int | None
    unit: str
    #: "measured" (on a device, by benchmarks/gpu_check.py), "published" (a public figure),
    #: "derived" (computed from published specifications) or "chosen" (a scenario parameter).
    kind: str = attrs.field(validator=attrs.validators.in_(
        ("measured", "published", "derived", "chosen")))
    source: str


def _positive(_instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _whole(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be a whole number of at least 1, got {value!r}")


@attrs.frozen(kw_only=True)
class Node:
    """One node's transfer rates (see [Note: the model]).

        node = Node(h2d_gbps=55, allgather_busbw_gbps=360, host_cap_gbps=614.4, gpus=8)
        node.rank_local_s(28e9)       # 28 GB / 55 GB/s = 0.509 s
    """

    #: One GPU's host-to-device rate on its own (pinned memory, large copies), GB/s.
    h2d_gbps: float = attrs.field(validator=_positive)
    #: The all-gather's bus bandwidth over the node's GPUs (nccl-tests' busbw), GB/s.
    allgather_busbw_gbps: float = attrs.field(validator=_positive)
    #: The host memory bandwidth all GPUs' copies share, GB/s; None: no cap.
    host_cap_gbps: float | None = attrs.field(default=None, validator=_positive)
    #: GPUs on the node, all loading the same group at once (k).
    gpus: int = attrs.field(default=8, validator=_whole)
    #: GPUs sharing one PCIe uplink to the host (u).
    gpus_per_uplink: int = attrs.field(default=1, validator=_whole)

    def per_gpu_gbps(self) -> float:
        """r: one GPU's host-to-device rate while all of them copy at once."""
        link = self.h2d_gbps / self.gpus_per_uplink
        if self.host_cap_gbps is None:
            return link
        return min(link, self.host_cap_gbps / self.gpus)

    def bottleneck(self) -> str:
        link = self.h2d_gbps / self.gpus_per_uplink
        if self.host_cap_gbps is not None and self.host_cap_gbps / self.gpus < link:
            return "host memory"
        return "PCIe"

    def rank_local_s(self, nbytes: float) -> float:
        """Every GPU copies all `nbytes`: S / r."""
        return nbytes / (self.per_gpu_gbps() * GB)

    def allgather_s(self, nbytes: float) -> tuple[float, float]:
        """(the shard's copy, the all-gather): (S / k) / r and S (k-1) / (k B)."""
        k = self.gpus
        copy = nbytes / k / (self.per_gpu_gbps() * GB)
        gather = nbytes * (k - 1) / k / (self.allgather_busbw_gbps * GB)
        return copy, gather


def transition(node: Node, nbytes: float) -> dict:
    """The modelled phase change of a group of `nbytes` on `node`, both ways."""
    rank_local = node.rank_local_s(nbytes)
    copy, gather = node.allgather_s(nbytes)
    return {
        "nbytes": nbytes,
        "per_gpu_h2d_gbps": node.per_gpu_gbps(),
        "bottleneck": node.bottleneck(),
        "rank_local_s": rank_local,
        "allgather_s": copy + gather,
        "allgather_copy_s": copy,
        "allgather_gather_s": gather,
        "allgather_speedup": rank_local / (copy + gather),
        "host_bytes_read": {"rank_local": nbytes * node.gpus, "allgather": nbytes},
    }


# -- the assumptions ----------------------------------------------------------------------------


def measured_h2d(results: Path = RESULTS) -> Assumption | None:
    """The newest GPU check's measured pinned host-to-device rate, or None when none ran."""
    for path in sorted(results.glob("gpu-check-*.json"), reverse=True):
        data = json.loads(path.read_text())
        gbps = data.get("sections", {}).get("ceiling", {}).get("h2d_gbps")
        if data.get("dry_run") is False and gbps:
            name = data.get("device_name", "the device")
            return Assumption(value=gbps, unit="GB/s", kind="measured", source=(
                f"measured: pinned host-to-device bulk copy on {name}, {path.name} "
                "(benchmarks/gpu_check.py, section ceiling)"))
    return None


def assumptions(
    *,
    h2d_gbps: float | None = None,
    allgather_busbw_gbps: float = 360.0,
    host_cap_gbps: float | None = 614.4,
    gpus: int = 8,
    gpus_per_uplink: int = 1,
    results: Path = RESULTS,
) -> dict[str, Assumption]:
    """Every input of the model with its source; `h2d_gbps` None: measured, else published."""
    if h2d_gbps is not None:
        h2d = Assumption(value=h2d_gbps, unit="GB/s", kind="chosen", source="given by the caller")
    else:
        h2d = measured_h2d(results) or Assumption(
            value=PUBLISHED_H2D_GBPS, unit="GB/s", kind="published", source=PUBLISHED_H2D_SOURCE)
    return {
        "h2d_gbps": h2d,
        "allgather_busbw_gbps": Assumption(
            value=allgather_busbw_gbps, unit="GB/s",
            kind="published" if allgather_busbw_gbps == 360.0 else "chosen", source=(
                "published: nccl-tests all_gather_perf on 8x H100 SXM (NVLink 4 through "
                "NVSwitch), 128 MB-16 GB messages: busbw saturates at ~360 GB/s, and an NCCL "
                "maintainer answers \"360 GB/s is exactly what we'd expect on H100\" "
                "(https://github.com/NVIDIA/nccl-tests/issues/326); below NVLink 4's 450 GB/s per "
                "direction. Bus bandwidth as nccl-tests defines it for all_gather: busbw = algbw "
                "(k-1)/k (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)")),
        "host_cap_gbps": Assumption(
            value=host_cap_gbps, unit="GB/s",
            kind="derived" if host_cap_gbps == 614.4 else "chosen", source=(
                "derived: the DGX H100's host is two Intel Xeon Platinum 8480C (Sapphire Rapids; "
                "NVIDIA DGX H100 datasheet), each with 8 DDR5-4800 channels of 38.4 GB/s: "
                "2 x 8 x 38.4 = 614.4 GB/s, a theoretical peak (two DIMMs per channel may run "
                "slower, and a sustained STREAM figure is lower still: see the 'host memory 300 "
                "GB/s' scenario). None: no cap")),
        "gpus": Assumption(value=gpus, unit="GPUs", kind="chosen", source=(
            "one 8-GPU node (HGX/DGX H100 class), every GPU a rank of the same data-parallel "
            "job, all entering the phase together")),
        "gpus_per_uplink": Assumption(value=gpus_per_uplink, unit="GPUs", kind="chosen", source=(
            "each GPU has a PCIe Gen5 x16 path of its own to host memory; on a board where two "
            "GPUs share one switch uplink, 2 (see that scenario)")),
    }


#: The groups modelled: (name, bytes, where the size comes from).
GROUPS = (
    ("Wan2.2 A14B DiT expert, bf16", 28e9,
     "Wan2.2 A14B: each of its two DiT experts has ~14B parameters; bf16 is 2 bytes each"),
    ("text encoder, bf16", 5e9, "a ~2.5B-parameter text encoder in bf16"),
)

#: Scenarios beside the assumptions as given: (name, what changes).
SCENARIOS = (
    ("as assumed", {}),
    ("host memory 300 GB/s sustained", {"host_cap_gbps": 300.0}),
    ("two GPUs per PCIe uplink", {"gpus_per_uplink": 2}),
)


def model(given: dict[str, Assumption]) -> dict:
    """The JSON: the label, the formulas, every assumption and a row per scenario and group."""
    base = {name: assumption.value for name, assumption in given.items()}
    scenarios = []
    for name, changes in SCENARIOS:
        node = Node(**{**base, **changes})
        scenarios.append({
            "scenario": name, "changes": changes,
            "rows": [{"group": group, "size_source": source, **transition(node, nbytes)}
                     for group, nbytes, source in GROUPS],
        })
    return {
        "kind": "model",
        "measurement": False,
        "label": LABEL,
        "formulas": {
            "per_gpu_h2d": "r = min(h2d_gbps / gpus_per_uplink, host_cap_gbps / gpus)",
            "rank_local_s": "S / r",
            "allgather_s": "(S / k) / r + S (k - 1) / (k * allgather_busbw_gbps)",
            "allgather_faster_when": "allgather_busbw_gbps > r (and k > 1)",
        },
        "assumptions": {name: attrs.asdict(assumption) for name, assumption in given.items()},
        "scenarios": scenarios,
        "command": "python -m benchmarks.transition_model",
    }


def table(result: dict) -> str:
    """The model as text: one block per scenario."""
    lines = [result["label"], ""]
    for name, assumption in result["assumptions"].items():
        lines.append(f"  {name} = {assumption['value']} {assumption['unit']} "
                     f"({assumption['kind']})")
    for scenario in result["scenarios"]:
        first = scenario["rows"][0]
        lines += ["", f"{scenario['scenario']}: each GPU copies at {first['per_gpu_h2d_gbps']:.1f} "
                      f"GB/s while all copy ({first['bottleneck']} bound)",
                  f"  {'group':<30} {'size':>8} {'rank-local':>11} {'all-gather':>11} "
                  f"{'(copy + gather)':>17} {'faster':>7}"]
        for row in scenario["rows"]:
            lines.append(
                f"  {row['group']:<30} {row['nbytes'] / GB:>5.1f} GB {row['rank_local_s']:>9.3f} s "
                f"{row['allgather_s']:>9.3f} s   ({row['allgather_copy_s']:.3f} + "
                f"{row['allgather_gather_s']:.3f}) {row['allgather_speedup']:>6.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transition_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--h2d-gbps", type=float, default=None,
                        help="one GPU's host-to-device GB/s (default: measured by a GPU check "
                             f"in benchmarks/results, else the published {PUBLISHED_H2D_GBPS})")
    parser.add_argument("--allgather-busbw-gbps", type=float, default=360.0,
                        help="all-gather bus bandwidth over the node, GB/s (default: 360)")
    parser.add_argument("--host-cap-gbps", type=float, default=614.4,
                        help="host memory bandwidth the GPUs share, GB/s (default: 614.4; 0: none)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs on the node (default: 8)")
    parser.add_argument("--gpus-per-uplink", type=int, default=1,
                        help="GPUs sharing one PCIe uplink (default: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder for transition_model.json (default: benchmarks/results)")
    args = parser.parse_args(argv)
    try:
        given = assumptions(h2d_gbps=args.h2d_gbps, allgather_busbw_gbps=args.allgather_busbw_gbps,
                            host_cap_gbps=args.host_cap_gbps or None, gpus=args.gpus,
                            gpus_per_uplink=args.gpus_per_uplink)
        result = model(given)
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transition_model.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
