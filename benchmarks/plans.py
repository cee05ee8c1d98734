"""Plans that hold (issue 47): an auto plan's predicted bytes and seconds per call against what
steady calls measure, at three device budgets, with and without classifier-free guidance.

    python -m benchmarks.plans                     # CPU -> results/plans-cpu.json
    python -m benchmarks.plans --device sim        # the simulated accelerator's timing mode
    python -m benchmarks.plans --scale tiny        # seconds, for the smoke test
    python -m benchmarks.plans --search            # the planner's search alone -> plans-search.json

The Wan2.2-shaped pipeline of `benchmarks.budget` (text encoder 11 : expert 28 : expert 28 : VAE
0.5) runs under ``Scheduler(auto={"device_budget": b, "headroom": 0})`` at 0.25x, 0.5x and 1.2x
of its weights.  Each call is marked (``with scheduler.call():``), as the diffusers adapter marks
``pipe(...)``.  With guidance each step runs its expert twice - conditional and unconditional -
each forward a phase entry of its own, as the adapter enters one per forward; nothing is
declared, so the plan learns the passes from the first call.

Per configuration: 3 calls to settle (the plan made after the first call, the one after the
second, and one more), then 5 steady calls.  The plan in force after the third call predicts
bytes and seconds per call; the goal: each steady call moves exactly the predicted bytes, and
the predicted seconds are within 15% of the median of the 5 steady calls' spans
(`scheduler.calls`).  The plan must also stay the same through the steady calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import simulator, wan_shaped
from benchmarks.budget import SIM_TIMING, config, sweep_on
from benchmarks.machine import describe_machine
from residency import Scheduler

__all__ = ["BUDGETS", "GOAL", "measure", "search_times", "search_workloads", "sweep"]

RESULTS = Path(__file__).resolve().parent / "results"
#: Device budgets as fractions of the pipeline's weights.
BUDGETS = (0.25, 0.5, 1.2)
#: Predicted seconds per call within this fraction of the steady median.
GOAL = 0.15
SETTLE, STEADY = 3, 5


def run(parts, scheduler: Scheduler, c, ids, latents, *, guidance: bool) -> torch.Tensor:
    """One marked call: encode, `steps` steps over the two experts (twice each with guidance,
    the unconditional pass on a zero context), decode."""
    with torch.no_grad(), scheduler.call():
        with scheduler.resident("text_encoder"):
            context = parts["text_encoder"](ids)
        empty = torch.zeros_like(context)
        for step in range(c.steps):
            expert = "transformer" if step < c.boundary else "transformer_2"
            with scheduler.resident(expert):
                conditional = parts[expert](latents, context)
            if guidance:
                with scheduler.resident(expert):
                    unconditional = parts[expert](latents, empty)
                conditional = unconditional + 5.0 * (conditional - unconditional)
            latents = conditional
        with scheduler.resident("vae"):
            return parts["vae"](latents)


def measure(c, state, device: torch.device, fraction: float, guidance: bool) -> dict:
    """One configuration: its calls' bytes and spans, the settled plan's prediction, the goal."""
    total = sum(t.nbytes for part in state.values() for t in part.values())
    parts = {name: module.to(device) for name, module in wan_shaped.build(c, state).items()}
    ids, latents = wan_shaped.inputs(c, device)
    scheduler = Scheduler(device, auto={"device_budget": int(total * fraction), "headroom": 0})
    try:
        for name in ("text_encoder", "transformer", "transformer_2"):
            scheduler.add(name, parts[name])
        scheduler.add("vae", parts["vae"], policy="resident")
        for _ in range(SETTLE):
            run(parts, scheduler, c, ids, latents, guidance=guidance)
        plan = scheduler.plan
        for _ in range(STEADY):
            run(parts, scheduler, c, ids, latents, guidance=guidance)
        calls = list(scheduler.calls)
        steady = calls[-STEADY:]
        median = statistics.median(call.seconds for call in steady)
        ratio = plan.predicted.seconds / median
        return {
            "fraction": fraction, "guidance": guidance, "budget": int(total * fraction),
            "calls": [{"number": call.number, "nbytes": call.nbytes, "seconds": call.seconds}
                      for call in calls],
            "predicted_nbytes": plan.predicted.nbytes,
            "predicted_seconds": plan.predicted.seconds,
            "steady_median_seconds": median, "ratio": ratio,
            "bytes_exact": all(call.nbytes == plan.predicted.nbytes for call in steady),
            "seconds_within_goal": abs(ratio - 1) <= GOAL,
            "plan_held": scheduler.plan.plans == plan.plans,
            "passes": {w.name: w.passes for w in plan.workloads},
            "plan": scheduler.plan.describe(),
        }
    finally:
        scheduler.close()


def sweep(scale: str, device: torch.device) -> dict:
    c = config(scale)
    state = wan_shaped.make_state(c, device)
    load_before = os.getloadavg()
    rows = [measure(c, state, device, fraction, guidance)
            for guidance in (False, True) for fraction in BUDGETS]
    return {"machine": {**describe_machine(), "device": str(device)},
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "simulated": simulator.LABEL if simulator.is_simulated(device) else None,
            "timing": SIM_TIMING if simulator.is_simulated(device) else None,
            "scale": scale, "goal": f"predicted seconds within {GOAL:.0%} of the median of "
            f"{STEADY} steady calls; bytes exact", "rows": rows}


#: The search's workloads: a Wan-shaped set (text encoder of 6 blocks, two experts, a resident
#: VAE) with 16-block experts (this benchmark's pipeline) and 40-block ones (Wan2.2-T2V-A14B's).
SEARCH_BLOCKS = (16, 40)
SEARCH_BUDGETS = (0.25, 0.5, 0.7, 0.9, 0.99, 1.2)


def search_workloads(blocks: int) -> list:
    """The planner's view of a Wan-shaped pipeline whose experts have `blocks` blocks (sizes in
    the real model's ratios, MiB-scaled; each expert runs 8 forwards a call)."""
    from residency.auto.planner import Workload

    mib = 2**20
    groups = [Workload(name="text_encoder", own=(2 * mib,) * 2, compute_seconds=0.01,
                       blocks=tuple((f"te.{i}", 2 * mib, 2 * mib) for i in range(6)))]
    for name in ("transformer", "transformer_2"):
        groups.append(Workload(name=name, own=(mib,) * 2, passes=8, compute_seconds=0.2,
                               blocks=tuple((f"{name}.{i}", 4 * mib, 4 * mib)
                                            for i in range(blocks))))
    groups.append(Workload(name="vae", own=(3 * mib,) * 2, compute_seconds=0.05))
    return groups


def search_times(repeats: int = 3) -> list[dict]:
    """Seconds of one `choose` per expert depth, budget and objective (the least of `repeats`)."""
    import time

    from residency.auto.planner import choose

    rows = []
    for blocks in SEARCH_BLOCKS:
        groups = search_workloads(blocks)
        total = sum(w.own[1] + sum(b[2] for b in w.blocks) for w in groups)
        for fraction in SEARCH_BUDGETS:
            for overlap in (False, True):
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    choose(groups, weights_budget=int(total * fraction), bandwidth=10e9,
                           overlap=overlap)
                    times.append(time.perf_counter() - start)
                rows.append({"blocks": blocks, "fraction": fraction, "overlap": overlap,
                             "seconds": min(times), "repeats": times})
    return rows


def _table(result: dict) -> str:
    lines = ["| budget | guidance | predicted MiB | steady MiB | bytes exact | predicted s | "
             "median s | ratio | within 15% |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        steady = row["calls"][-1]["nbytes"] / 2**20
        lines.append(f"| {row['fraction']}x | {'yes' if row['guidance'] else 'no'} | "
                     f"{row['predicted_nbytes'] / 2**20:.1f} | {steady:.1f} | "
                     f"{row['bytes_exact']} | {row['predicted_seconds']:.3f} | "
                     f"{row['steady_median_seconds']:.3f} | {row['ratio']:.3f} | "
                     f"{row['seconds_within_goal']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plans", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "sim"), default="cpu")
    parser.add_argument("--scale", choices=("small", "tiny"), default="small")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON to write (default: results/plans-DEVICE.json)")
    parser.add_argument("--search", action="store_true",
                        help="time the planner's search alone (results/plans-search.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.search:
        out = args.out or RESULTS / "plans-search.json"
        result = {"machine": describe_machine(), "load_average": os.getloadavg(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"), "rows": search_times()}
        out.write_text(json.dumps(result, indent=2) + "\n")
        for row in result["rows"]:
            print(f"{row['blocks']:>3} blocks  {row['fraction']:>5}x  "
                  f"{'time' if row['overlap'] else 'bytes':<5}  {row['seconds']:.4f} s")
        print(f"written to {out}")
        return 0
    result = sweep_on(args.device, sweep, args.scale)
    out = args.out or RESULTS / f"plans-{args.device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
