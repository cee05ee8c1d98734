"""Many requests on one pipeline: both orders of turns side by side, at 1, 4 and 8 concurrent
requests (issue 46).

    python -m benchmarks.serving --device cpu --out benchmarks/results/    # ~1 min on 2 cores
    python -m benchmarks.serving --device sim --out benchmarks/results/    # SIMULATED, ~7 min

A request runs the phases of a Wan2.2-shaped pipeline: the text encoder once, then `STEPS`
high-noise and `STEPS` low-noise expert steps (`GROUPS`: Linear layers), each in its own
``with scheduler.resident(...)``, its stream synchronised at the step's end (as a sampler reading
its progress does), `HOST_WORK` seconds of host work between steps.  `concurrency` clients each
run requests back to back (a closed loop) until `REQUESTS` are done; client k starts k /
concurrency of a lone request's time after the first, so that the requests in flight are at
different phases, as independent arrivals leave them (started together, closed-loop clients move in
lockstep, and any order serves lockstep clients in batches).  Per point: phase changes and bytes
per request, throughput, p50/p99 latency, every output compared bit for bit with the first run's
(the same request alone, under arrival order).

A step's compute: on the CPU, `PASSES` passes through the group's layers (real work); on the
simulated device (``--device sim``: tests/simdevice, compute on one stream as a GPU runs one DiT
step at a time), one pass and a busy kernel of `STEP_BUSY` seconds, so that the host dispatches a
step in a fraction of its device time, as a GPU server does (each simulated op costs the host most
of a millisecond of CPU).  The copy rate is set three ways, so that r = swap seconds / step seconds is
about 0.4 (an H100 with Wan2.2), 1 and 4; r, the step and the swap are measured in the run.  The
goals at 8 requests: group order's phase changes per request at most 1/3 of arrival order's; its
throughput over arrival order's at least 90% of (steps + swaps_arrival * r) / (steps + swaps_group
* r); its p99 no worse than arrival order's (10% slack: one run); at 1 request, the same cost within
noise (10%).  Writes ``serving-<device>.json`` and ``serving-<device>.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.machine import describe_machine

#: (group, Linear layers): the encoder, then the two experts.
GROUPS = (("text_encoder", 6), ("high", 12), ("low", 12))
WIDTH, BATCH = 256, 8
STEPS = 5
#: Passes through a group's layers per step on the CPU (real compute).
PASSES = 4
#: On the simulated device, a step is one pass and a busy kernel of this many seconds: its device
#: time several times a swap's fixed cost (the device sleeps `COMPUTE_DELAY` per queued op, the
#: digests' included) and several times the host's dispatch of it.
STEP_BUSY = 0.03
HOST_WORK = 0.002
REQUESTS = 40
CONCURRENCY = (1, 4, 8)
ORDERS = ("arrival", "group")
#: The simulated device's seconds per queued op, and the r values its copy rate is set for.
COMPUTE_DELAY = 0.0005
RATIOS = (0.4, 1.0, 4.0)


def _models(seed: int = 0) -> dict[str, nn.Sequential]:
    torch.manual_seed(seed)
    return {name: nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(depth)))
            for name, depth in GROUPS}


def _steps() -> list[str]:
    return ["text_encoder"] + ["high"] * STEPS + ["low"] * STEPS


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, WIDTH, generator=generator) for _ in range(REQUESTS)]


class Pipeline:
    """One scheduler over fresh models on `device`, under `order`."""

    def __init__(self, device: torch.device, order: str) -> None:
        from residency import Scheduler

        self.device = device
        self.simulated = device.type != "cpu"
        self.models = _models()
        self.scheduler = Scheduler(device, order=order)
        for name, model in self.models.items():
            self.scheduler.add(name, model)

    def step(self, name: str, x: torch.Tensor) -> torch.Tensor:
        with self.scheduler.resident(name), torch.no_grad():
            for _ in range(1 if self.simulated else PASSES):
                x = self.models[name](x)
            if self.simulated:
                from benchmarks import simulator

                simulator.busy(STEP_BUSY)
            _sync_stream(self.device)
        return x

    def request(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        for name in _steps():
            x = self.step(name, x)
            time.sleep(HOST_WORK)
        return x.cpu()


def _sync_stream(device: torch.device) -> None:
    """Wait for this thread's compute stream (not the copy stream) on an accelerator."""
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def serve(device: torch.device, order: str, concurrency: int, inputs) -> dict:
    """`concurrency` closed-loop clients run `inputs` as requests; the figures of the point."""
    pipeline = Pipeline(device, order)
    began = time.perf_counter()
    pipeline.request(inputs[0])  # warm: every group loaded once, every buffer allocated
    stagger = (time.perf_counter() - began) / concurrency
    log = pipeline.scheduler.transitions
    count, nbytes = log.count, log.nbytes
    outputs: dict[int, torch.Tensor] = {}
    latencies: list[float] = []
    pending = list(range(len(inputs)))
    lock = threading.Lock()

    def client(k: int) -> None:
        time.sleep(k * stagger)
        while True:
            with lock:
                if not pending:
                    return
                index = pending.pop(0)
            began = time.perf_counter()
            outputs[index] = pipeline.request(inputs[index])
            with lock:
                latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(600)
    wall = time.perf_counter() - began
    assert len(outputs) == len(inputs), "a client never finished"
    changes, moved = log.count - count, log.nbytes - nbytes
    pipeline.scheduler.close()
    ordered = sorted(latencies)
    return {
        "order": order, "concurrency": concurrency, "requests": len(inputs),
        "phase_changes": changes, "changes_per_request": changes / len(inputs),
        "bytes_per_request": moved / len(inputs), "throughput_rps": len(inputs) / wall,
        "p50_s": statistics.median(ordered), "p99_s": _p99(ordered),
        "wall_s": wall, "stagger_s": stagger, "outputs": outputs,
    }


def _p99(ordered: list[float]) -> float:
    """The nearest-rank 99th percentile of sorted `ordered`."""
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def measure_r(device: torch.device) -> dict:
    """Seconds of one expert step (resident) and of one expert swap, measured, and their ratio."""
    pipeline = Pipeline(device, "arrival")
    x = torch.randn(BATCH, WIDTH).to(device)
    for name in ("high", "low", "high"):  # warm
        pipeline.step(name, x)
    began = time.perf_counter()
    for _ in range(5):
        pipeline.step("high", x)
    step = (time.perf_counter() - began) / 5
    swaps = []
    for name in ("low", "high") * 3:
        began = time.perf_counter()
        with pipeline.scheduler.resident(name):
            if device.type != "cpu":
                torch.accelerator.synchronize(device)
        swaps.append(time.perf_counter() - began)
    pipeline.scheduler.close()
    swap = statistics.median(swaps)
    return {"step_s": step, "swap_s": swap, "r": swap / step}


def _bandwidth_for(ratio: float, instant: dict) -> float:
    """The copy rate that makes a swap `ratio` steps long: a swap is its fixed cost (measured
    with instant copies: digests, re-pointing) plus the expert's bytes over the rate."""
    copy_seconds = ratio * instant["step_s"] - instant["swap_s"]
    return _expert_nbytes() / max(copy_seconds, 0.05 * instant["step_s"])


def _expert_nbytes() -> int:
    return sum(t.numel() * t.element_size() for t in _models()["high"].parameters())


def run_device(device: torch.device, setting: str) -> dict:
    """Every point at one setting: both orders, each concurrency; r measured first."""
    inputs = _inputs()
    r = measure_r(device)
    points = []
    reference = None
    for concurrency in CONCURRENCY:
        for order in ORDERS:
            point = serve(device, order, concurrency, inputs)
            outputs = point.pop("outputs")
            if reference is None:
                reference = outputs
            point["bit_identical"] = all(torch.equal(outputs[i], reference[i]) for i in reference)
            points.append(point)
            print(f"  {setting:>12} {order:>8} x{concurrency}: "
                  f"{point['changes_per_request']:5.2f} changes/request, "
                  f"{point['throughput_rps']:6.2f} req/s, p50 {point['p50_s'] * 1e3:7.1f} ms, "
                  f"p99 {point['p99_s'] * 1e3:7.1f} ms, same bits {point['bit_identical']}",
                  flush=True)
    return {"setting": setting, **r, "points": points, "goals": goals(points, r["r"])}


def goals(points: list[dict], r: float) -> dict:
    """The issue's goals at 8 and at 1 concurrent requests, from one setting's points."""
    at = {(p["order"], p["concurrency"]): p for p in points}
    arrival, group = at[("arrival", 8)], at[("group", 8)]
    steps = len(_steps())
    predicted = ((steps + arrival["changes_per_request"] * r)
                 / (steps + group["changes_per_request"] * r))
    measured = group["throughput_rps"] / arrival["throughput_rps"]
    alone = at[("group", 1)]["throughput_rps"] / at[("arrival", 1)]["throughput_rps"]
    return {
        "changes_ratio_at_8": group["changes_per_request"] / max(arrival["changes_per_request"],
                                                                  1e-9),
        "changes_goal_met": group["changes_per_request"] <= arrival["changes_per_request"] / 3,
        "throughput_ratio_at_8": measured,
        "throughput_predicted_at_8": predicted,
        "throughput_goal_met": measured >= 0.9 * predicted,
        "p99_ratio_at_8": group["p99_s"] / arrival["p99_s"],
        "p99_goal_met": group["p99_s"] <= 1.1 * arrival["p99_s"],
        "alone_throughput_ratio": alone,
        "alone_goal_met": abs(alone - 1) <= 0.1,
        "bit_identical": all(p["bit_identical"] for p in points),
    }


def plot(result: dict, path: Path) -> str | None:
    """Throughput and p99 against concurrency, per order and setting; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[plot]'): plot skipped"
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, run in enumerate(result["runs"]):
        for order, style in (("arrival", "--"), ("group", "-")):
            points = [p for p in run["points"] if p["order"] == order]
            xs = [p["concurrency"] for p in points]
            label = f"{order}, {run['setting']} (r={run['r']:.2f})"
            drawn = {"color": f"C{color}", "marker": "o" if order == "group" else "x",
                     "label": label}
            left.plot(xs, [p["throughput_rps"] for p in points], style, **drawn)
            right.plot(xs, [p["p99_s"] * 1e3 for p in points], style, **drawn)
    left.set(xlabel="concurrent requests", ylabel="requests / s", title="throughput")
    right.set(xlabel="concurrent requests", ylabel="ms", title="p99 latency")
    left.legend(fontsize=7)
    figure.suptitle(result["label"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "sim"), default="cpu",
                        help="the CPU, or the SIMULATED accelerator of tests/simdevice")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for serving-<device>.json and .png")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    runs = []
    if args.device == "sim":
        from benchmarks import simulator

        device = simulator.load(asynchronous=True)
        label = simulator.LABEL
        with simulator.timing(copy_bandwidth=0, compute_delay=COMPUTE_DELAY):  # instant copies
            instant = measure_r(device)
        for ratio in RATIOS:
            bandwidth = _bandwidth_for(ratio, instant)
            with simulator.timing(copy_bandwidth=bandwidth, compute_delay=COMPUTE_DELAY):
                runs.append({**run_device(device, f"r~{ratio:g}"), "copy_bandwidth": bandwidth})
    else:
        device, label = torch.device("cpu"), "CPU, 1 torch thread"
        runs.append(run_device(device, "cpu"))
    result = {"machine": describe_machine(), "load_average": list(_load_average()),
              "label": label, "requests_per_point": REQUESTS, "steps_per_request": len(_steps()),
              "host_work_s": HOST_WORK, "passes_per_step": 1 if args.device == "sim" else PASSES,
              "step_busy_s": STEP_BUSY if args.device == "sim" else 0.0,
              "compute_delay_s": COMPUTE_DELAY if args.device == "sim" else 0.0, "runs": runs}
    name = f"serving-{args.device}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    skipped = plot(result, args.out / f"{name}.png")
    for run in runs:
        print(f"{run['setting']}: r={run['r']:.2f} goals {json.dumps(run['goals'])}")
    if skipped:
        print(skipped)
    return 0


def _load_average() -> tuple[float, float, float]:
    import os

    return os.getloadavg()


if __name__ == "__main__":
    raise SystemExit(main())
