"""Bytes and time per call against the device budget (issue 22): the auto plan, module mode, the
best fixed layer mode, and diffusers' offloading where it runs.

    python -m benchmarks.budget                     # CPU: bytes per call, wall time per call
    python -m benchmarks.budget --device sim        # the simulated timing mode: time per call
    python -m benchmarks.budget --plot              # benchmarks/results/budget.png from the JSONs

A Wan2.2-shaped pipeline (`benchmarks.wan_shaped`) sized in the real model's ratios (text encoder
11 : expert 28 : expert 28 : VAE 0.5, as bf16 Wan2.2-T2V-A14B's ~11, ~28, ~28 and ~0.5 GB) runs
under device budgets from 0.2x to 1.2x of its weights.  For each budget:

* auto: ``Scheduler(auto={"device_budget": b, "headroom": 0})``; steady state is the mean of the
  calls after the plan the first call made (bytes from the records, as `Scheduler.plan` shows).
* module mode: the encoder and experts swapped whole, the VAE kept; it runs where its largest
  phase fits (its bytes per call do not depend on the budget).
* layer mode: the experts' blocks streamed with ``resident_layers=k`` kept, the encoder swapped;
  for each budget the k that fits and moves least ("the best fixed layer mode").
* diffusers' ``enable_model_cpu_offload`` and group offloading (block level): points where they
  run (an accelerator; on the CPU they do not move weights, so none are drawn).

Bytes per call are the scheduler's records (transitions + block loads), the peak is the
scheduler's ``device_nbytes`` sampled inside every phase.  The goal (benchmarks/test_budget.py
checks it at the tiny scale): auto moves at most the smaller of module and layer mode at every
budget, and nothing from the second call on when everything fits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import attrs
import torch

from benchmarks import simulator, wan_shaped
from benchmarks.machine import describe_machine
from residency import Scheduler, model_blocks

__all__ = ["BUDGETS", "measure", "plain_output", "sweep", "sweep_on", "write_plot"]

RESULTS = Path(__file__).resolve().parent / "results"
#: Budgets as fractions of the pipeline's weights.
BUDGETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
#: The simulated timing mode's link and per-op delay (see `benchmarks.simulator.timing`).
SIM_TIMING = {"copy_bandwidth": 1e9, "compute_delay": 2e-4}


def config(scale: str) -> wan_shaped.WanShaped:
    """The pipeline: 'small' (~80 MB, the committed figures) or 'tiny' (kilobytes, the check)."""
    if scale == "tiny":
        return wan_shaped.WanShaped(dim=32, text_dim=32, vocab=64, text_blocks=3, dit_blocks=8,
                                    vae_blocks=1, tokens=4, text_tokens=4, steps=4, boundary=2,
                                    dtype=torch.float32)
    return wan_shaped.WanShaped(dim=192, text_dim=256, vocab=2000, text_blocks=5, dit_blocks=16,
                                vae_blocks=4, tokens=64, text_tokens=16, steps=8, boundary=4,
                                dtype=torch.float32)


class _Sampled:
    """`benchmarks.wan_shaped.run`'s offload surface over a scheduler, sampling its device bytes
    at the end of every phase (the slots are allocated by then)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.peak = scheduler, 0

    def phase(self, name: str):
        return _SampledPhase(self, self.scheduler.resident(name))

    def finish(self) -> None:
        pass


class _SampledPhase:
    def __init__(self, owner: _Sampled, phase) -> None:
        self._owner, self._phase = owner, phase

    def __enter__(self):
        return self._phase.__enter__()

    def __exit__(self, *exc_info):
        self._owner.peak = max(self._owner.peak, self._owner.scheduler.device_nbytes)
        return self._phase.__exit__(*exc_info)


def _scheduler(kind: str, parts, device, *, budget: int | None = None, kept: int = 0) -> Scheduler:
    auto = {"device_budget": budget, "headroom": 0} if kind == "auto" else None
    scheduler = Scheduler(device, auto=auto)
    scheduler.add("text_encoder", parts["text_encoder"])
    for name in ("transformer", "transformer_2"):
        layers = model_blocks(parts[name], path=name, resident_layers=kept) \
            if kind == "layer" else False
        scheduler.add(name, parts[name], layers=layers)
    scheduler.add("vae", parts["vae"], policy="resident")
    return scheduler


def measure(kind: str, c, state, device, *, calls: int = 3, budget: int | None = None,
            kept: int = 0) -> dict:
    """Steady-state bytes and seconds per call of one configuration (the first call warms, or
    for auto observes), its peak device bytes, and its output against the plain run's."""
    parts = {name: module.to(device) for name, module in wan_shaped.build(c, state).items()}
    ids, latents = wan_shaped.inputs(c, device)
    scheduler = _scheduler(kind, parts, device, budget=budget, kept=kept)
    offload = _Sampled(scheduler)
    try:
        wan_shaped.run(parts, offload, c, ids, latents)
        offload.peak, per_call = 0, []
        for _ in range(calls):
            moved, start = scheduler.transitions.nbytes + scheduler.block_records.nbytes, \
                time.perf_counter()
            output = wan_shaped.run(parts, offload, c, ids, latents)
            _synchronize(device)
            per_call.append((scheduler.transitions.nbytes + scheduler.block_records.nbytes - moved,
                             time.perf_counter() - start))
        result = {"kind": kind, "budget": budget, "resident_layers": kept,
                  "nbytes": per_call[-1][0], "seconds": min(s for _, s in per_call),
                  "peak": offload.peak, "output": output.float().cpu()}
        if kind == "auto":
            result["predicted"] = scheduler.plan.predicted.nbytes
            result["plan"] = scheduler.plan.describe()
        return result
    finally:
        scheduler.close()


def sweep(scale: str, device: torch.device) -> dict:
    """Every configuration at every budget (see the module docstring)."""
    c = config(scale)
    state = wan_shaped.make_state(c, device)
    total = sum(t.nbytes for part in state.values() for t in part.values())
    plain = plain_output(c, state, device)
    module = measure("module", c, state, device)
    layers = [measure("layer", c, state, device, kept=k) for k in range(c.dit_blocks + 1)]
    rows = []
    for fraction in BUDGETS:
        budget = int(total * fraction)
        row = {"fraction": fraction, "budget": budget}
        try:
            auto = measure("auto", c, state, device, budget=budget)
        except Exception as error:  # no plan fits: recorded, not drawn
            row["auto"] = {"error": f"{type(error).__name__}: {error}"}
        else:
            auto["bit_identical"] = torch.equal(auto.pop("output"), plain)
            row["auto"] = auto
        if module["peak"] <= budget:
            row["module"] = {k: v for k, v in module.items() if k != "output"}
        fitting = [run for run in layers if run["peak"] <= budget]
        if fitting:
            best = min(fitting, key=lambda run: (run["nbytes"], run["seconds"]))
            row["layer"] = {k: v for k, v in best.items() if k != "output"}
        rows.append(row)
    exact = all(torch.equal(run["output"], plain) for run in (module, *layers))
    return {"machine": {**describe_machine(), "device": str(device)},
            "simulated": simulator.LABEL if simulator.is_simulated(device) else None,
            "timing": SIM_TIMING if simulator.is_simulated(device) else None,
            "scale": scale, "total_nbytes": total, "module_and_layer_bit_identical": exact,
            "peers": _peers(c, state, device, plain), "rows": rows}


def sweep_on(device: str, sweep, scale: str) -> dict:
    """``sweep(scale, device)`` on the CPU ("cpu"), or on the simulated accelerator in its timing
    mode (`SIM_TIMING`) for "sim": the two devices the budget benchmarks run on."""
    if device == "sim":
        sim = simulator.load(asynchronous=True)
        with simulator.timing(**SIM_TIMING):
            return sweep(scale, sim)
    return sweep(scale, torch.device("cpu"))


def plain_output(c, state, device) -> torch.Tensor:
    """One call of the pipeline never offloaded (all on `device`), on the host."""
    from benchmarks.peers import install

    parts = wan_shaped.build(c, state)
    ids, latents = wan_shaped.inputs(c, device)
    offload = install("none", parts, device)
    return wan_shaped.run(parts, offload, c, ids, latents).float().cpu()


def _peers(c, state, device: torch.device, plain: torch.Tensor) -> dict:
    """diffusers' offloaders where they run (an accelerator): seconds per call (the fastest of
    three after a warm-up), the allocator's peak, and the bytes per call their documented
    behaviour moves (computed, not recorded: their hooks keep no records) - model offload loads
    every component once per call; block-level group offload loads every block, and each
    module's leftovers, at each forward."""
    from benchmarks.peers import PEERS, install, unavailable

    found = {}
    for peer in PEERS:
        why = unavailable(peer, device)
        if why is not None:
            found[peer] = {"skipped": why}
            continue
        parts = wan_shaped.build(c, state)
        ids, latents = wan_shaped.inputs(c, device)
        offload = install(peer, parts, device)
        try:
            wan_shaped.run(parts, offload, c, ids, latents)
            torch.accelerator.reset_peak_memory_stats()
            seconds = []
            for _ in range(3):
                _synchronize(device)
                start = time.perf_counter()
                output = wan_shaped.run(parts, offload, c, ids, latents)
                _synchronize(device)
                seconds.append(time.perf_counter() - start)
            peak = _allocator_peak()
        finally:
            offload.close()
        weights = {name: sum(t.nbytes for t in part.values()) for name, part in state.items()}
        forwards = {"text_encoder": 1, "transformer": c.boundary,
                    "transformer_2": c.steps - c.boundary, "vae": 1}
        per_call = sum(weights.values()) if peer == "diffusers_model_cpu_offload" else \
            sum(weights[name] * forwards[name] for name in weights)
        found[peer] = {"seconds": min(seconds), "peak": peak, "nbytes_computed": per_call,
                       "bit_identical": bool(torch.equal(output.float().cpu(), plain))}
    return found


def _allocator_peak() -> int | None:
    try:
        return torch.accelerator.max_memory_allocated()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def write_plot(results: list[dict], path: Path) -> str | None:
    """Bytes per call (each run) and time per call (each run, labelled) against the budget."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[plot]'); the plot was skipped"
    figure, axes = pyplot.subplots(1, 1 + len(results), figsize=(6 * (1 + len(results)), 5))
    styles = {"auto": ("o-", "auto plan"), "module": ("s--", "module mode"),
              "layer": ("^:", "best layer mode (resident_layers)")}
    first = results[0]
    for kind, (style, label) in styles.items():
        xs = [r["fraction"] for r in first["rows"] if "nbytes" in r.get(kind, {})]
        ys = [r[kind]["nbytes"] / 2**20 for r in first["rows"] if "nbytes" in r.get(kind, {})]
        axes[0].plot(xs, ys, style, label=label)
    for result in results:
        for peer, run in result["peers"].items():
            if run.get("peak") and "nbytes_computed" in run:
                axes[0].plot([run["peak"] / result["total_nbytes"]], [run["nbytes_computed"] / 2**20],
                             "x", markersize=9, label=f"{peer} (bytes computed, at its peak)")
    axes[0].set(xlabel="device budget / weights", ylabel="MiB moved per call (steady state)",
                title=f"bytes per call ({first['scale']}, {_size(first['total_nbytes'])} of weights)")
    axes[0].legend()
    for axis, result in zip(axes[1:], results):
        for kind, (style, label) in styles.items():
            rows = [r for r in result["rows"] if "seconds" in r.get(kind, {})]
            axis.plot([r["fraction"] for r in rows], [r[kind]["seconds"] for r in rows], style,
                      label=label)
        for peer, run in result["peers"].items():
            if run.get("peak") and "seconds" in run:
                axis.plot([run["peak"] / result["total_nbytes"]], [run["seconds"]], "x",
                          markersize=9, label=f"{peer} (at its peak)")
        where = "SIMULATED accelerator (timing mode)" if result["simulated"] else \
            result["machine"].get("cpu_model", "CPU")
        axis.set(xlabel="device budget / weights", ylabel="seconds per call",
                 title=f"time per call: {where}")
        axis.legend()
    skipped = {f"{peer} on {r['machine']['device']}: {run['skipped']}" for r in results
               for peer, run in r["peers"].items() if "skipped" in run}
    figure.suptitle(f"residency auto plan, {first['machine']['date']}"
                    + (f"; not run: {'; '.join(sorted(skipped))}" if skipped else ""), fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return None


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _table(result: dict) -> str:
    lines = [f"| budget | auto MiB/call | module MiB/call | best layer MiB/call (k) | auto s | "
             f"module s | layer s |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        def cell(kind, field, scale=2**20):
            value = row.get(kind, {}).get(field)
            return "-" if value is None else f"{value / scale:.2f}" if scale != 1 else f"{value:.3f}"
        layer_k = row.get("layer", {}).get("resident_layers")
        lines.append(f"| {row['fraction']:.1f}x | {cell('auto', 'nbytes')} | "
                     f"{cell('module', 'nbytes')} | {cell('layer', 'nbytes')}"
                     f"{'' if layer_k is None else f' ({layer_k})'} | {cell('auto', 'seconds', 1)} | "
                     f"{cell('module', 'seconds', 1)} | {cell('layer', 'seconds', 1)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "sim"), default="cpu")
    parser.add_argument("--scale", choices=("small", "tiny"), default="small")
    parser.add_argument("--plot", action="store_true",
                        help="only draw benchmarks/results/budget.png from the JSONs there")
    args = parser.parse_args(argv)
    if not args.plot:
        result = sweep_on(args.device, sweep, args.scale)
        out = RESULTS / f"budget-{args.device}.json"
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(_table(result))
        print(f"wrote {out}")
    found = [json.loads((RESULTS / f"budget-{device}.json").read_text())
             for device in ("cpu", "sim") if (RESULTS / f"budget-{device}.json").exists()]
    found.sort(key=lambda r: r["simulated"] is not None)
    reason = write_plot(found, RESULTS / "budget.png") if found else "no results to draw"
    print(reason or f"wrote {RESULTS / 'budget.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
