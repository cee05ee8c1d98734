"""The speed goals of the project, as data: what is measured, the limit, and the words.

    REENTRY.judge({"median_s": 2.4e-6})   # {"goal": "re-entry ...", "value": 2.4e-06, "met": True, ...}

A case names its goal in ``benchmark.extra_info["goal"]``; the report judges it from the JSON alone.
"""

from __future__ import annotations

import attrs

__all__ = [
    "CHANGE_CHECK",
    "EVICT_CHECKED",
    "EVICT_UNCHANGED",
    "LAYER_BLOCK",
    "LAYER_STEP",
    "PER_TENSOR",
    "REENTRY",
    "REGISTRATION",
    "SIM_HOST_SYNCS_PER_EVICTION",
    "SIM_HOST_SYNCS_STEADY",
    "SIM_LAYER_STEP",
    "SIM_PREFETCH",
    "SWAP",
    "Goal",
]


@attrs.frozen(kw_only=True)
class Goal:
    """Met when the case's figure named `metric` is at most `limit`."""

    #: A key of the case's figures (see `benchmarks.figures.derive`).
    metric: str
    limit: float
    #: The goal in words, with its unit.
    text: str

    def as_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Goal:
        return cls(metric=data["metric"], limit=float(data["limit"]), text=data["text"])

    def judge(self, figures: dict) -> dict:
        """The verdict on `figures`; ``met`` is None when the figure is missing (benchmark disabled)."""
        value = figures.get(self.metric)
        met = None if value is None else bool(value <= self.limit)
        return {"goal": self.text, "metric": self.metric, "limit": self.limit, "value": value,
                "met": met}


REENTRY = Goal(metric="median_s", limit=3e-6, text="re-entry of the resident group <= 3 us")
SWAP = Goal(metric="ratio", limit=1.10,
            text="swap between two 400 MiB groups of 400 tensors (detect_edits=False) <= 1.10x "
                 "the copy floor")
PER_TENSOR = Goal(metric="per_tensor_overhead_s", limit=0.5e-6,
                  text="per-tensor overhead of a transition (detect_edits=False) <= 0.5 us")
REGISTRATION = Goal(metric="ratio", limit=1.5,
                    text="cold start (Scheduler.add) <= 1.5x the copy floor")
EVICT_UNCHANGED = Goal(metric="per_1000_tensors_s", limit=1e-3,
                       text="eviction of unchanged weights (detect_edits=False) <= 1 ms per 1,000 "
                            "tensors")
#: Issue 12: no edit is lost, and finding that nothing changed costs well under the copy it saves.
EVICT_CHECKED = Goal(metric="ratio", limit=0.6,
                     text="eviction of an unchanged 400 MiB group, edits detected, <= 0.6x the "
                          "copy floor")
CHANGE_CHECK = Goal(metric="ratio", limit=0.6,
                    text="change check of an unchanged 400 MiB buffer <= 0.6x the copy floor")
#: Issue 14: streaming a block costs its copy and little else.  On a CPU nothing overlaps, so the
#: figure is (layer-mode step - unoffloaded step - copy of the block bytes) / streamed tensors.
LAYER_BLOCK = Goal(metric="per_tensor_overhead_s", limit=1e-6,
                   text="layer mode: per-block overhead beyond the copy (detect_edits=False) <= "
                        "1 us per tensor of the block (CPU)")
#: Issue 14, on an accelerator (benchmarks/gpu_check.py, section "layers"): the copy of block i+1
#: hides under block i's compute when that compute takes at least as long as the copy.
LAYER_STEP = Goal(metric="ratio", limit=1.05,
                  text="layer mode: a denoising step <= 1.05x the unoffloaded step when a block's "
                       "compute >= its copy (accelerator)")

# Issue 19, on the SIMULATED accelerator (benchmarks/test_simulated.py, ``--bench-device=sim``):
# sleeps stand in for copies and kernels, so these say whether the library's streams and events
# overlap what they should and how often the host waits - never what a GPU achieves.
SIM_LAYER_STEP = Goal(metric="ratio", limit=1.05,
                      text="SIMULATED accelerator: a layer-mode step <= 1.05x max(total compute, "
                           "total copy) when a block's copy <= its compute")
SIM_PREFETCH = Goal(metric="ratio", limit=1.05,
                    text="SIMULATED accelerator: encoder -> DiT with prefetch <= 1.05x the "
                         "unoffloaded encoder + DiT when the DiT's copy <= the encoder's compute")
SIM_HOST_SYNCS_STEADY = Goal(metric="host_syncs_per_step", limit=0,
                             text="SIMULATED accelerator: no host synchronisation in a "
                                  "steady-state layer-mode step (detect_edits=False)")
SIM_HOST_SYNCS_PER_EVICTION = Goal(metric="host_syncs_per_eviction", limit=1,
                                   text="SIMULATED accelerator: one host synchronisation per block "
                                        "eviction with edit detection (the flags read)")
