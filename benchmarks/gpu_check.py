"""``python -m benchmarks.gpu_check``: the prepared check for one GPU (issue 4, item 8).

    python -m benchmarks.gpu_check --out benchmarks/results/      # one GPU; < 8 min on an H200
    python -m benchmarks.gpu_check --device sim --out /tmp/check/ # the simulated device, small sizes
    python -m benchmarks.gpu_check --dry-run --out /tmp/check/    # the CPU, tiny sizes: code paths only

Measures, in one run, on one device (the process's accelerator: CUDA, or any other that implements
torch's device-generic API, ``torch.accelerator``, ``torch.Stream`` and ``torch.Event``):

* ``ceiling``       the pinned host-to-device ceiling: one large bulk copy (and device-to-host);
* ``onload``        our onload GB/s for 1, 4 and 16 GiB groups, the transition latency against the
                    ceiling, registration (seconds, pinned bytes, peak host RSS), peak device memory;
* ``eviction``      eviction of unchanged weights per 1,000 tensors; write-back of changed ones;
* ``reentry``       re-entry of the resident group, beside accelerate's hook on the same model;
* ``steady_state``  host syncs in a loop of phases (on CUDA ``torch.cuda.set_sync_debug_mode("error")``
                    and a profiler count of synchronize calls, on the simulated device its counter
                    of host waits; groups with ``detect_edits=False``, and the syncs per transition
                    with detection on), ``memory_reserved`` over 1,000 transitions;
* ``edits``         issue 12: eviction of an unchanged group (digests on the device) against the
                    copy floor of its bytes; a swap with and without edit detection; bytes moved for
                    an int8 (torchao) group against its bf16 twin;
* ``pipeline``      the synthetic Wan2.2-shaped pipeline (`benchmarks.wan_shaped`, ~5.3 GiB) with no
                    offload, with ours, and under diffusers' ``enable_model_cpu_offload`` and group
                    offloading (skipped, with the reason, when diffusers is not importable);
* ``host_tiers``    issue 23: a warm-restart cache file mapped as the cache maps it, page-locked
                    (the pinning rate) and copied to the device from (the rate against the
                    ceiling); pinning memory by registering touched pages and by ``pin_memory``;
* ``layers``        issue 14: a DiT of Wan2.1/2.2-14B blocks (`benchmarks.layers`, 8 x 672 MiB,
                    bf16) with the sequence length chosen so that a block's compute takes at least
                    its copy (both recorded); steps with no offload, in layer mode with
                    resident_layers 0 and 2 (and 0 without edit detection), and under diffusers'
                    group offloading (block level, one block per group, a stream): bit identity,
                    step time against no offload, peak device memory, and from
                    ``scheduler.block_records`` that the copy of block i+1 was issued before block
                    i's compute (a profile adds how much of the copies' device time ran under
                    compute).  ``--sections layers`` runs it alone (~1.5 min).

Writes ``gpu-check-<device>-<date>.json`` under ``--out`` after every section (a run cut short still
leaves what it measured), with a ``must_show`` block judging issue 4's goals.  Each section catches
its own errors and records them; the exit code is 1 when any section failed.  ``--budget-s`` (default
420) skips what would not fit.  The CUDA-only measurements (sync-debug mode, the profiler's device
timeline, the pinned allocator's statistics, the device's name) are recorded as skipped, with the
reason, on any other device.

``--device sim`` runs the check on the simulated asynchronous device of ``tests/simdevice``
(`benchmarks.simulator`; CI does, in a process of its own) at the dry run's sizes: the very code
an accelerator run uses - streams, events, pinned masters, device digests - with copies and ops
queued on worker threads; its figures are a simulation's, labelled so in the JSON.  In
``--dry-run`` the CPU stands in for the GPU: every code path the CPU has runs at tiny sizes, and
the figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from benchmarks import budget as budget_sweep
from benchmarks import layers as layer_models
from benchmarks import simulator, wan_shaped
from benchmarks.floor import synchronize
from benchmarks.goals import LAYER_STEP
from benchmarks.machine import describe_machine
from benchmarks.models import ManyModules, Stack
from benchmarks.peers import OFFLOADERS, install, unavailable
from benchmarks.scale import GiB, KiB, MiB
from residency import Scheduler
from residency.modules.tensors import DEFAULT_CHUNK_NBYTES

__all__ = ["CheckSizes", "main"]

_ROOT = Path(__file__).resolve().parent.parent


@attrs.frozen(kw_only=True)
class CheckSizes:
    """How big each section is: `full` for an H200, `dry` for a CPU dry run and the simulated
    device."""

    ceiling_nbytes: int
    repeats: int
    onload_sizes: tuple[int, ...] = attrs.field(converter=tuple)
    #: Bytes per tensor of the onload groups (16 MiB: 1,024 tensors in a 16 GiB group).
    onload_tensor_nbytes: int
    evict_nbytes: int
    evict_tensors: int
    steady_nbytes: int
    steady_tensors: int
    steady_phases: int
    reserved_transitions: int
    reentry_modules: int
    reentry_calls: int
    pipeline: wan_shaped.WanShaped
    pipeline_calls: int
    #: Layer mode: the DiT (its `tokens` is replaced by the first of `layer_tokens` whose block
    #: compute takes at least `layer_compute_over_copy` times the block's copy), and steps timed.
    layer_dit: layer_models.DiTShape
    layer_tokens: tuple[int, ...] = attrs.field(converter=tuple)
    layer_calls: int
    layer_compute_over_copy: float = 1.2
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def full(cls) -> CheckSizes:
        return cls(ceiling_nbytes=4 * GiB, repeats=5, onload_sizes=(1 * GiB, 4 * GiB, 16 * GiB),
                   onload_tensor_nbytes=16 * MiB, evict_nbytes=256 * MiB, evict_tensors=10_000,
                   steady_nbytes=256 * MiB, steady_tensors=256, steady_phases=200,
                   reserved_transitions=1_000, reentry_modules=1_000, reentry_calls=5_000,
                   pipeline=wan_shaped.WanShaped.full(), pipeline_calls=3,
                   layer_dit=layer_models.DiTShape.wan_14b(blocks=8),
                   layer_tokens=(4_096, 8_192, 16_384, 32_768), layer_calls=5)

    @classmethod
    def dry(cls) -> CheckSizes:
        return cls(ceiling_nbytes=4 * MiB, repeats=2, onload_sizes=(256 * KiB, 1 * MiB),
                   onload_tensor_nbytes=64 * KiB, evict_nbytes=256 * KiB, evict_tensors=100,
                   steady_nbytes=64 * KiB, steady_tensors=8, steady_phases=10,
                   reserved_transitions=20, reentry_modules=50, reentry_calls=50,
                   pipeline=wan_shaped.WanShaped.tiny(), pipeline_calls=1,
                   layer_dit=layer_models.DiTShape.tiny(blocks=4), layer_tokens=(4, 8),
                   layer_calls=2, dtype=torch.float32)


@attrs.define
class _Check:
    """What the sections share: the device, the sizes, the clock, and the results so far."""

    device: torch.device
    sizes: CheckSizes
    #: The CPU stands in for the device (``--dry-run``), or the simulated device does (``sim``).
    dry_run: bool
    deadline: float
    path: Path
    results: dict
    #: Pinned host-to-device bytes per second, once ``ceiling`` has run.
    ceiling_bps: float | None = None

    def save(self) -> None:
        """Write the results so far (atomically: a run cut short leaves a whole file)."""
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        temporary.replace(self.path)


# -- sections ------------------------------------------------------------------------------------


def ceiling(check: _Check) -> dict:
    """The physical limit: one bulk copy from pinned host memory to the device, and back."""
    n, device = check.sizes.ceiling_nbytes, check.device
    pinned = device.type != "cpu"
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned).fill_(1)
    back = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    on_device = torch.empty(n, dtype=torch.uint8, device=device)
    h2d = _seconds(lambda: on_device.copy_(host, non_blocking=pinned), device, check.sizes.repeats)
    d2h = _seconds(lambda: back.copy_(on_device, non_blocking=pinned), device, check.sizes.repeats)
    check.ceiling_bps = n / statistics.median(h2d)
    result = {"nbytes": n, "pinned": pinned, "h2d_seconds": h2d, "d2h_seconds": d2h,
              "h2d_gbps": n / statistics.median(h2d) / 1e9,
              "d2h_gbps": n / statistics.median(d2h) / 1e9}
    on_stream = _event_seconds(lambda: on_device.copy_(host, non_blocking=pinned), device,
                               check.sizes.repeats)
    if on_stream is not None:  # the device's own clock: no host wake-up in it
        result.update(h2d_event_seconds=on_stream,
                      h2d_event_gbps=n / statistics.median(on_stream) / 1e9)
    return result


def onload(check: _Check) -> dict:
    """Our onload GB/s per group size, against the ceiling; registration facts for each group."""
    groups = {}
    for size in check.sizes.onload_sizes:
        remaining = check.deadline - time.monotonic()
        if remaining < 30 + 6 * size / 1e9:
            groups[_size_name(size)] = {"skipped": f"time budget: {remaining:.0f} s left"}
            continue
        groups[_size_name(size)] = _onload_one(check, size)
        _release_memory(check.device)
    return {"groups": groups}


def _onload_one(check: _Check, size: int) -> dict:
    device, sizes = check.device, check.sizes
    scheduler = Scheduler(device)
    module = Stack(size, max(1, size // sizes.onload_tensor_nbytes), dtype=sizes.dtype)
    registration = _register(scheduler, "big", module)
    group = scheduler["big"]
    scheduler.add("small", Stack(4 * KiB, 1, dtype=sizes.dtype))
    _reset_peak(device)
    seconds = []
    for _ in range(sizes.repeats + 1):
        _enter(scheduler, "small", device)
        start = time.perf_counter()
        _enter(scheduler, "big", device)
        seconds.append(time.perf_counter() - start)
    seconds = seconds[1:]  # the first load allocates device storage
    evictions = [r.evict_seconds for r in scheduler.transitions if r.from_group == "big"]
    median = statistics.median(seconds)
    result = {
        "nbytes": group.nbytes, "tensors": len(group.tensors), "onload_seconds": seconds,
        "onload_gbps": group.nbytes / median / 1e9,
        "evict_unchanged_median_s": statistics.median(evictions),
        "peak_device_bytes": _peak(device), "registration": registration,
    }
    if check.ceiling_bps:
        result["fraction_of_ceiling"] = group.nbytes / median / check.ceiling_bps
        result["latency_vs_ceiling"] = median / (group.nbytes / check.ceiling_bps)
    scheduler.close()
    return result


def _register(scheduler: Scheduler, name: str, module) -> dict:
    """Time ``add``; report pinned bytes against weight bytes and the peak host RSS it needed."""
    rss_before = _rss() if _reset_peak_rss() else None  # without a reset, VmHWM means nothing
    pinned_before = _pinned_active_bytes(scheduler.device)
    start = time.perf_counter()
    group = scheduler.add(name, module)
    seconds = time.perf_counter() - start
    peak = _peak_rss()
    pinned_after = _pinned_active_bytes(scheduler.device)
    pinned = None if pinned_before is None or pinned_after is None else pinned_after - pinned_before
    return {
        # What the pinned allocator handed out for the master (its rounding included), if known.
        "pinned_allocator_nbytes": pinned,
        "pinned_allocator_over_weights": None if pinned is None else pinned / group.nbytes,
        "seconds": seconds, "gbps": group.nbytes / seconds / 1e9, "weight_nbytes": group.nbytes,
        "master_nbytes": group.host_master.nbytes, "pinned": group.host_master.pinned,
        "master_over_weights": group.host_master.nbytes / group.nbytes,
        "chunk_nbytes": scheduler.chunk_nbytes,
        "peak_rss_over_start_nbytes": None if peak is None or rss_before is None else peak - rss_before,
        "host_allocator": _host_allocator_stats(scheduler.device),
    }


def eviction(check: _Check) -> dict:
    """Eviction time of unchanged weights per 1,000 tensors; write-back of changed weights."""
    device, sizes = check.device, check.sizes
    scheduler = Scheduler(device)
    group = scheduler.add("many", Stack(sizes.evict_nbytes, sizes.evict_tensors, dtype=sizes.dtype))
    scheduler.add("small", Stack(4 * KiB, 1, dtype=sizes.dtype))
    result = {"nbytes": group.nbytes, "tensors": len(group.tensors)}
    for changed in (False, True):
        records = []
        for _ in range(sizes.repeats + 1):
            with scheduler.resident("many"):
                if changed:
                    with torch.no_grad():
                        for tensor in group.tensors:
                            tensor.neg_()  # new bytes: digests see every changed chunk
            synchronize(device)
            _enter(scheduler, "small", device)
            records.append(scheduler.transitions[-1])
        records = records[1:]
        evict_s = statistics.median(r.evict_seconds for r in records)
        key = "changed" if changed else "unchanged"
        result[key] = {"evict_median_s": evict_s, "written_back": records[-1].written_back,
                       "per_1000_tensors_s": evict_s / len(group.tensors) * 1_000}
        if changed:
            result[key]["write_back_gbps"] = records[-1].written_back / evict_s / 1e9
    scheduler.close()
    return result


def reentry(check: _Check) -> dict:
    """Re-entering the resident group, and accelerate's hook per forward, on ~1,000 modules."""
    device, calls = check.device, check.sizes.reentry_calls
    scheduler = Scheduler(device)
    model = ManyModules(check.sizes.reentry_modules)
    scheduler.add("model", model)
    _enter(scheduler, "model", device)

    def reenter():
        with scheduler.resident("model"):
            pass

    result = {"modules": len(list(model.modules())), "reentry_s": _per_call(reenter, calls)}
    x = torch.ones(1, device=device)
    with torch.no_grad():
        result["residency_forward_s"] = _per_call(lambda: _forward_in_phase(scheduler, model, x),
                                                  calls)
        plain = ManyModules(check.sizes.reentry_modules).to(device)
        result["plain_forward_s"] = _per_call(lambda: plain(x), calls)
        result["accelerate"] = _accelerate_forward(check, x, calls)
    synchronize(device)
    scheduler.close()
    return result


def _forward_in_phase(scheduler, model, x):
    with scheduler.resident("model"):
        return model(x)


def _accelerate_forward(check: _Check, x: torch.Tensor, calls: int) -> dict:
    try:
        from accelerate import cpu_offload_with_hook
    except ImportError:
        return {"skipped": "accelerate is not installed"}
    result = {}
    for label, execution_device in (("device", check.device), ("str", str(check.device))):
        model = ManyModules(check.sizes.reentry_modules)
        cpu_offload_with_hook(model, execution_device=execution_device)
        model(x)
        result[f"forward_s_execution_device_{label}"] = _per_call(lambda m=model: m(x), calls)
    return result


def steady_state(check: _Check) -> dict:
    """Host syncs in a loop of phases, and memory_reserved over many transitions."""
    device, sizes = check.device, check.sizes
    scheduler = Scheduler(device)
    modules = {name: Stack(sizes.steady_nbytes, sizes.steady_tensors, dtype=sizes.dtype)
               for name in ("a", "b", "c")}
    for name, module in modules.items():
        scheduler.add(name, module, detect_edits=name == "c")
    x = torch.ones(1, dtype=sizes.dtype, device=device)

    def alternating(names: str) -> Callable[[int], None]:
        def phases(count: int) -> None:
            with torch.no_grad():
                for i in range(count):
                    name = names[i % 2]
                    with scheduler.resident(name):
                        modules[name](x)

        return phases

    phases = alternating("ab")
    phases(4)
    synchronize(device)
    result = {"phases": sizes.steady_phases, "sync_debug": _sync_debug(phases, sizes.steady_phases,
                                                                        device),
              "profiled_syncs": _profiled_syncs(phases, sizes.steady_phases, device),
              "counted_syncs": _counted_syncs(phases, sizes.steady_phases, device),
              "memory_reserved": _reserved_over(phases, sizes.reserved_transitions, device)}

    detected = alternating("ac")  # "c" detects edits: each eviction of it reads its flags
    detected(4)
    synchronize(device)
    result["with_detection_profiled_syncs"] = _profiled_syncs(detected, sizes.steady_phases, device)
    counted = _counted_syncs(detected, sizes.steady_phases, device)
    if "host_syncs" in counted:  # every other phase change evicts "c"
        evictions = sizes.steady_phases // 2
        counted.update(evictions_with_detection=evictions,
                       host_syncs_per_detected_eviction=counted["host_syncs"] / evictions)
    result["with_detection_counted_syncs"] = counted
    synchronize(device)
    scheduler.close()
    return result


def edits(check: _Check) -> dict:
    """Issue 12: what finding edits costs on the device, and what quantized weights move."""
    device, sizes = check.device, check.sizes
    result = {"evict_unchanged": _evict_unchanged(check)}
    for detect in (True, False):
        scheduler = Scheduler(device)
        for name in ("a", "b"):
            scheduler.add(name, Stack(sizes.evict_nbytes, 64, dtype=sizes.dtype),
                          detect_edits=detect)
        for name in ("a", "b", "a", "b"):
            _enter(scheduler, name, device)
        swaps = []
        for step in range(sizes.repeats):
            _enter(scheduler, "ab"[step % 2], device)
            swaps.append(scheduler.transitions[-1].seconds)
        result[f"swap_detect_edits_{detect}_median_s"] = statistics.median(swaps)
        scheduler.close()
    result["quantized"] = _quantized_bytes(check)
    return result


def _evict_unchanged(check: _Check) -> dict:
    device, sizes = check.device, check.sizes
    scheduler = Scheduler(device)
    group = scheduler.add("g", Stack(sizes.evict_nbytes, 64, dtype=sizes.dtype))
    scheduler.add("small", Stack(4 * KiB, 1, dtype=sizes.dtype))
    seconds = []
    for _ in range(sizes.repeats + 1):
        _enter(scheduler, "g", device)
        _enter(scheduler, "small", device)
        seconds.append(scheduler.transitions[-1].evict_seconds)
    chunks = group.host_master.chunks
    targets = [torch.empty(c.numel(), dtype=torch.uint8, device=device) for c in chunks]

    def copy_all() -> None:
        for target, chunk in zip(targets, chunks):
            target.copy_(chunk, non_blocking=True)

    floor = statistics.median(_seconds(copy_all, device, sizes.repeats))
    evict = statistics.median(seconds[1:])
    scheduler.close()
    return {"nbytes": group.nbytes, "evict_median_s": evict, "copy_floor_s": floor,
            "ratio": evict / floor, "goal": "<= 0.6x the copy floor (CPU goal; device: report)"}


def _quantized_bytes(check: _Check) -> dict:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as error:
        return {"skipped": f"torchao is not importable here ({error})"}
    device = check.device
    bf16 = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)
    int8 = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)
    quantize_(int8, Int8WeightOnlyConfig())
    moved = {}
    for name, model in (("bf16", bf16), ("int8", int8)):
        scheduler = Scheduler(device)
        scheduler.add(name, model)
        scheduler.add("other", Stack(4 * KiB, 1, dtype=torch.bfloat16))
        _enter(scheduler, name, device)
        moved[name] = scheduler.transitions[-1].nbytes
        scheduler.close()
    return {"bf16_nbytes": moved["bf16"], "int8_nbytes": moved["int8"],
            "int8_over_bf16": moved["int8"] / moved["bf16"]}


def _sync_debug(phases: Callable[[int], None], count: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode needs CUDA"
                           + (" (see counted_syncs)" if simulator.is_simulated(device) else "")}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        phases(count)
        outcome = {"host_syncs": 0}
    except RuntimeError as error:  # raised at the first sync: at least one
        outcome = {"host_syncs": 1, "first_sync": str(error).splitlines()[0]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return outcome


def _profiled_syncs(phases: Callable[[int], None], count: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "counting CUDA runtime synchronize calls needs CUDA"}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        phases(count)
    synchronize(device)
    calls = Counter(e.name for e in profiler.events()
                    if "Synchronize" in e.name or e.name in ("cudaMemcpy", "cudaFree", "cudaMalloc"))
    return {"calls": dict(calls), "host_syncs": sum(n for k, n in calls.items() if "Synchronize" in k)}


def _counted_syncs(phases: Callable[[int], None], count: int, device: torch.device) -> dict:
    """The simulated device's own count of host waits over `count` phases (every stream, event
    and device synchronize, read of a device value, and copy that is not asynchronous)."""
    if not simulator.is_simulated(device):
        return {"skipped": "the simulated device's counter of host waits (sync_debug on CUDA)"}
    before = simulator.host_syncs()
    phases(count)
    host_syncs = simulator.host_syncs() - before
    synchronize(device)
    return {"host_syncs": host_syncs, "phases": count}


def _reserved_over(phases: Callable[[int], None], transitions: int, device: torch.device) -> dict:
    if device.type == "cpu":
        phases(transitions)
        return {"skipped": "memory_reserved needs an accelerator (the loop still ran)",
                "transitions": transitions}
    marks, done = {}, 0
    for mark in sorted({m for m in (10, 100, transitions) if m <= transitions}):
        phases(mark - done)
        done = mark
        synchronize(device)
        marks[str(mark)] = torch.accelerator.memory_reserved(device.index)
    return {"transitions": transitions, "reserved_at": marks,
            "flat": marks[str(transitions)] == next(iter(marks.values())),
            "max_reserved": torch.accelerator.max_memory_reserved(device.index)}


def _compare_modes(check: _Check, entries, *, budget_s: float, run) -> dict:
    """Run `run(label)` -> (result, output) for each (label, reason-to-skip or None) while at least
    `budget_s` of the check's time is left; a mode that fails is recorded, not fatal (it must not
    hide the others), and each output is compared bit for bit with the first one."""
    modes, reference = {}, None
    for label, reason in entries:
        remaining = check.deadline - time.monotonic()
        if reason is None and remaining < budget_s:
            reason = f"time budget: {remaining:.0f} s left"
        if reason is not None:
            modes[label] = {"skipped": reason}
            continue
        try:
            modes[label], output = run(label)
        except Exception as error:
            modes[label] = {"error": f"{type(error).__name__}: {error}",
                            "traceback": traceback.format_exc().splitlines()[-6:]}
            _release_memory(check.device)
            continue
        reference = output if reference is None else reference
        modes[label]["bit_identical_to_none"] = bool(torch.equal(output, reference))
        del output
        _release_memory(check.device)
    return modes


def pipeline(check: _Check) -> dict:
    """The Wan2.2-shaped pipeline under every offloader; overhead against bytes moved / ceiling."""
    device, config = check.device, check.sizes.pipeline
    state = wan_shaped.make_state(config, device)
    ids, latents = wan_shaped.inputs(config, device)
    entries = [(mode, unavailable(mode, device, allow_cpu=check.dry_run)) for mode in OFFLOADERS]
    modes = _compare_modes(check, entries, budget_s=45,
                           run=lambda mode: _pipeline_mode(check, mode, state, ids, latents))
    weights = {name: sum(t.nbytes for t in part.values()) for name, part in state.items()}
    moved = sum(n for name, n in weights.items() if name != "vae")
    result = {"config": attrs.asdict(config, value_serializer=lambda i, a, v: str(v)
                                     if isinstance(v, torch.dtype) else v),
              "weight_nbytes": weights, "moved_per_call_nbytes": moved, "modes": modes}
    result.update(_pipeline_verdicts(modes, moved, check.ceiling_bps))
    return result


def _pipeline_mode(check: _Check, mode: str, state, ids, latents) -> tuple[dict, torch.Tensor]:
    device, config = check.device, check.sizes.pipeline
    parts = wan_shaped.build(config, state)
    start = time.perf_counter()
    offload = install(mode, parts, device, resident=("vae",))
    setup_s = time.perf_counter() - start
    _reset_peak(device)
    output = wan_shaped.run(parts, offload, config, ids, latents)  # warm-up call
    seconds = []
    for _ in range(check.sizes.pipeline_calls):
        synchronize(device)
        start = time.perf_counter()
        output = wan_shaped.run(parts, offload, config, ids, latents)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    result = {"setup_s": setup_s, "call_seconds": seconds, "median_s": statistics.median(seconds),
              "peak_device_bytes": _peak(device)}
    output = output.to("cpu")
    offload.close()
    return result, output


def _pipeline_verdicts(modes: dict, moved: int, ceiling_bps: float | None) -> dict:
    none, ours = modes.get("none", {}).get("median_s"), modes.get("residency", {}).get("median_s")
    if none is None or ours is None:
        return {}
    verdicts = {"residency_overhead_s": ours - none}
    if ceiling_bps:
        floor = moved / ceiling_bps
        verdicts["moved_over_ceiling_s"] = floor
        verdicts["overhead_over_floor"] = (ours - none) / floor
    peer = modes.get("diffusers_model_cpu_offload", {}).get("median_s")
    if peer is not None and ours > none:
        verdicts["speedup_vs_model_cpu_offload"] = (peer - none) / (ours - none)
    return verdicts


# -- layer mode (issue 14) -------------------------------------------------------------------------

#: The layer section's modes: (label, `benchmarks.layers` mode, resident_layers).
LAYER_MODES = (
    ("none", "none", 0),
    ("layers_resident_0", "layers", 0),
    ("layers_resident_2", "layers", 2),
    ("layers_resident_0_no_detection", "layers_no_detection", 0),
    ("diffusers_group_offload", "diffusers_group_offload", 0),
)


def layer_mode(check: _Check) -> dict:
    """Issue 14: a Wan-shaped DiT streamed block by block, against no offload and diffusers."""
    device, sizes = check.device, check.sizes
    state = layer_models.make_state(sizes.layer_dit, device)
    sizing = _layer_tokens(check, state)
    shape = sizes.layer_dit.with_tokens(sizing["tokens"])
    args = layer_models.inputs(shape, device)
    spec = {label: (mode, resident_layers) for label, mode, resident_layers in LAYER_MODES}
    entries = [(label, unavailable(mode, device, allow_cpu=check.dry_run)
                if mode.startswith("diffusers") else None) for label, (mode, _) in spec.items()]
    modes = _compare_modes(check, entries, budget_s=30,
                           run=lambda label: _layer_mode_run(check, shape, state, args, *spec[label]))
    none_s = modes.get("none", {}).get("median_s")
    compute_covers_copy = sizing["block_compute_s"] >= sizing["block_copy_s"]
    for label, result in modes.items():
        if none_s and "median_s" in result:
            result["over_none"] = result["median_s"] / none_s
            if label.startswith("layers"):
                verdict = LAYER_STEP.judge({"ratio": result["over_none"]})
                if not compute_covers_copy:
                    verdict.update(met=None, note="a block's compute is shorter than its copy "
                                                  "here: the goal does not apply")
                result["goal"] = verdict
    return {"shape": attrs.asdict(shape, value_serializer=lambda i, a, v: str(v)
                                  if isinstance(v, torch.dtype) else v),
            "block_nbytes": shape.block_nbytes(), "sizing": sizing,
            "compute_covers_copy": compute_covers_copy, "modes": modes}


def _layer_tokens(check: _Check, state: dict) -> dict:
    """The first sequence length of `layer_tokens` at which one block's compute takes at least
    `layer_compute_over_copy` times the copy of its bytes (pinned host to device); the last one
    if none does.  Both times are recorded for every length tried."""
    device, sizes = check.device, check.sizes
    shape = sizes.layer_dit
    block = layer_models.WanBlock(shape.dim, shape.ffn_dim, shape.heads).to(shape.dtype)
    prefix = "blocks.0."
    block.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    block.requires_grad_(False).to(device)
    floor = layer_models.StepFloor(lambda: None, [shape.block_nbytes()], device)
    copy_s = statistics.median(_seconds(floor.copies, device, sizes.repeats))
    tried, chosen = {}, None
    for tokens in sizes.layer_tokens:
        block_args = tuple(torch.randn(1, n, shape.dim, device=device, dtype=shape.dtype)
                           for n in (tokens, shape.text_tokens, 6))
        with torch.no_grad():
            compute = statistics.median(_seconds(functools.partial(block, *block_args), device,
                                                 sizes.repeats))
        tried[str(tokens)] = compute
        chosen = tokens
        if compute >= sizes.layer_compute_over_copy * copy_s:
            break
    del block
    _release_memory(device)
    return {"tokens": chosen, "block_copy_s": copy_s, "block_compute_s": tried[str(chosen)],
            "block_compute_s_by_tokens": tried,
            "copy_gbps": shape.block_nbytes() / copy_s / 1e9}


def _layer_mode_run(check: _Check, shape, state, args, mode: str, resident_layers: int):
    device, sizes = check.device, check.sizes
    model = layer_models.build(shape, state)
    start = time.perf_counter()
    run = layer_models.install(mode, model, device, resident_layers=resident_layers)
    setup_s = time.perf_counter() - start
    try:
        _reset_peak(device)
        output = run.step(*args)  # warm-up: slots allocated, block 0 prefetched for the next step
        run.step(*args)
        seconds = []
        for _ in range(sizes.layer_calls):
            start = time.perf_counter()
            output = run.step(*args)
            seconds.append(time.perf_counter() - start)
        result = {"setup_s": setup_s, "step_seconds": seconds,
                  "median_s": statistics.median(seconds), "peak_device_bytes": _peak(device),
                  "device_weight_nbytes": run.device_nbytes}
        if run.scheduler is not None:
            streamed = len(run.block_nbytes)
            records = list(run.scheduler.block_records)[-3 * streamed:]
            order = layer_models.prefetch_order(records, streamed)
            result.update(streamed_blocks=streamed, kept_blocks=shape.blocks - streamed,
                          block_copies=run.scheduler.block_records.copies,
                          prefetch_order=order, records_of_last_step=[
                              {"index": r.index, "kind": r.kind, "slot": r.slot,
                               "nbytes": r.nbytes, "t": r.time} for r in records])
        result["copy_under_compute"] = _copy_under_compute(run, args)
        return result, output.to("cpu")
    finally:
        run.close()


def _copy_under_compute(run, args) -> dict:
    """From a profile of one step: the host-to-device copies' device time, and the share of it
    that ran while a kernel ran (the overlap layer mode is for)."""
    if run.device.type != "cuda":
        return {"skipped": "a device-side profile needs CUDA"}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            run.step(*args)
        copies, kernels = [], []
        for event in profiler.events():
            if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            span = (event.time_range.start, event.time_range.end)
            (copies if "HtoD" in event.name else kernels if "Memcpy" not in event.name
             and "Memset" not in event.name else []).append(span)
        copy_us = sum(end - start for start, end in copies)
        under = sum(_covered(span, kernels) for span in copies)
        return {"h2d_copies": len(copies), "h2d_device_us": copy_us, "kernels": len(kernels),
                "h2d_under_compute_fraction": under / copy_us if copy_us else None}
    except Exception as error:  # a profiler quirk must not lose the section's figures
        return {"error": f"{type(error).__name__}: {error}"}


def _covered(span: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """How much of `span` lies under the union of `intervals`."""
    start, end = span
    covered, reach = 0.0, start
    for first, last in sorted(intervals):
        if last <= reach or first >= end:
            continue
        first = max(first, reach)
        covered += min(last, end) - first
        reach = min(last, end)
    return covered


def auto_plan(check: _Check) -> dict:
    """Issue 22: the Wan2.2-shaped pipeline under auto plans of 0.3x, 0.6x and 1.2x its weights:
    bytes per call measured against predicted, the peak of the scheduler's device bytes against
    the budget, the fastest call, and the output against the never-offloaded run's."""
    device, config = check.device, check.sizes.pipeline
    state = wan_shaped.make_state(config, device)
    total = sum(t.nbytes for part in state.values() for t in part.values())
    plain = budget_sweep.plain_output(config, state, device)
    runs = {}
    for fraction in (0.3, 0.6, 1.2):
        try:
            run = budget_sweep.measure("auto", config, state, device, budget=int(total * fraction),
                                       calls=check.sizes.pipeline_calls)
        except Exception as error:  # no plan fits this budget: recorded
            runs[str(fraction)] = {"error": f"{type(error).__name__}: {error}"}
            continue
        run["bit_identical_to_none"] = bool(torch.equal(run.pop("output"), plain))
        run["within_budget"] = run["peak"] <= run["budget"]
        run["measured_equals_predicted"] = run["nbytes"] == run["predicted"]
        runs[str(fraction)] = run
        _release_memory(device)
    return {"weight_nbytes": total, "budgets": runs}


def host_tiers(check: _Check) -> dict:
    """Issue 23: a warm-restart cache file mapped copy-on-write as `residency.host.master_cache`
    maps it, page-locked as it page-locks it (`RegisteredMapping.register`, the page cache warm):
    the pinning rate, and the host-to-device rate from the mapping against the ceiling; beside
    them, the two ways a master in memory is pinned (pre-touched pages registered, the allocator's
    ``pin_memory``).  The pinning figures need CUDA (recorded as skipped elsewhere)."""
    import mmap
    import tempfile

    from residency.device.page_lock import RegisteredMapping

    n, device = check.sizes.ceiling_nbytes, check.device
    on_device = torch.empty(n, dtype=torch.uint8, device=device)
    result: dict = {"nbytes": n}
    with tempfile.TemporaryFile(dir=os.environ.get("RESIDENCY_CACHE_DIR")) as file:
        piece = bytes(range(256)) * (MiB // 256)
        for offset in range(0, n, MiB):  # written whole: its pages in the page cache
            file.write(piece[: min(MiB, n - offset)])
        file.flush()
        mapping = RegisteredMapping(file.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        host = torch.frombuffer(mapping, dtype=torch.uint8)
        host[::4096].sum()  # every page read and mapped, as a warm start maps its cache
        if device.type == "cuda":
            start = time.perf_counter()
            mapping.register(host.data_ptr(), n, what=f"the {n}-byte mapped cache file")
            seconds = time.perf_counter() - start
            result.update(cache_pin_seconds=seconds, cache_pin_gbps=n / seconds / 1e9)
        else:
            result["cache_pin"] = {"skipped": f"cudaHostRegister needs CUDA ({device.type})"}
        pinned = device.type == "cuda"
        h2d = _seconds(lambda: on_device.copy_(host, non_blocking=pinned), device,
                       check.sizes.repeats)
        result.update(cache_h2d_seconds=h2d, cache_h2d_gbps=n / statistics.median(h2d) / 1e9)
        if check.ceiling_bps:
            result["cache_h2d_fraction_of_ceiling"] = n / statistics.median(h2d) / check.ceiling_bps
        del host
    if device.type == "cuda":
        result.update(_memory_pinning_rates(n))
    return result


def _memory_pinning_rates(n: int) -> dict:
    """Seconds to pin `n` bytes of memory: pages touched then registered (the exact-size route
    of `residency.device.transport`), and ``torch.empty(pin_memory=True)`` (cudaHostAlloc)."""
    from residency.device.transport import _page_locked_exact

    start = time.perf_counter()
    registered = _page_locked_exact(n)
    registered.fill_(1)
    touched_seconds = time.perf_counter() - start
    del registered
    start = time.perf_counter()
    allocated = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    allocated.fill_(1)
    alloc_seconds = time.perf_counter() - start
    del allocated
    return {"register_anonymous_gbps": n / touched_seconds / 1e9,
            "pin_memory_alloc_gbps": n / alloc_seconds / 1e9}


SECTIONS: dict[str, Callable[[_Check], dict]] = {
    "ceiling": ceiling, "onload": onload, "eviction": eviction, "reentry": reentry,
    "steady_state": steady_state, "edits": edits, "pipeline": pipeline, "layers": layer_mode,
    "auto": auto_plan, "host_tiers": host_tiers,
}


# -- issue 4's "Must show" -------------------------------------------------------------------------


def must_show(results: dict) -> dict:
    """Judge issue 4's goals from the sections' results (None where a section did not run)."""
    sections = results["sections"]
    onloads = [r for r in sections.get("onload", {}).get("groups", {}).values()
               if "fraction_of_ceiling" in r]
    registrations = [r["registration"] for r in onloads]
    steady = sections.get("steady_state", {})
    counts = [steady.get(key, {}).get("host_syncs")
              for key in ("sync_debug", "profiled_syncs", "counted_syncs")]
    counts = [n for n in counts if n is not None]
    evict = sections.get("eviction", {}).get("unchanged", {}).get("per_1000_tensors_s")
    pipe = sections.get("pipeline", {})
    peak_rss = [r["peak_rss_over_start_nbytes"] - r["chunk_nbytes"] for r in registrations
                if r.get("peak_rss_over_start_nbytes") is not None]
    return {
        "onload_fraction_of_ceiling": _verdict(min((r["fraction_of_ceiling"] for r in onloads),
                                                   default=None), 0.90, at_least=True),
        "evict_unchanged_per_1000_tensors_s": _verdict(evict, 1e-3),
        "host_syncs_in_steady_state": _verdict(max(counts) if counts else None, 0),
        "pipeline_overhead_over_floor": _verdict(pipe.get("overhead_over_floor"), 1.10),
        "speedup_vs_model_cpu_offload": _verdict(pipe.get("speedup_vs_model_cpu_offload"), 3.0,
                                                 at_least=True),
        "pinned_over_weights": _verdict(max((max(r["master_over_weights"],
                                                 r["pinned_allocator_over_weights"] or 0)
                                             for r in registrations), default=None), 1.02),
        "peak_rss_over_weights_plus_one_chunk_nbytes": _verdict(max(peak_rss, default=None), 0),
        **_layer_verdicts(sections.get("layers", {})),
    }


def _layer_verdicts(layers: dict) -> dict:
    """Issue 14: the slowest layer-mode step against no offload (judged only when a block's
    compute covers its copy), and whether every block's copy was issued ahead of the block
    before it."""
    modes = [r for label, r in layers.get("modes", {}).items() if label.startswith("layers")]
    ratios = [r["over_none"] for r in modes if "over_none" in r]
    worst = max(ratios, default=None)
    verdict = _verdict(worst, LAYER_STEP.limit)
    if worst is not None and not layers.get("compute_covers_copy"):
        verdict.update(met=None, note="a block's compute is shorter than its copy: not judged")
    orders = [r["prefetch_order"]["ok"] for r in modes if "prefetch_order" in r]
    return {"layer_step_over_none": verdict,
            "layer_next_copy_issued_before_compute": {
                "value": all(orders) if orders else None, "met": all(orders) if orders else None}}


def _verdict(value, limit, *, at_least: bool = False) -> dict:
    met = None if value is None else bool(value >= limit if at_least else value <= limit)
    return {"value": value, "limit": limit, "at_least" if at_least else "at_most": True, "met": met}


# -- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    wanted = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = [name for name in wanted if name not in SECTIONS]
    if unknown:
        print(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.dry_run and args.device != "accelerator":
        print(f"--dry-run runs on the CPU; it cannot be combined with --device {args.device}",
              file=sys.stderr)
        return 2
    device = _open_device(args)
    if device is None:
        return 2
    threads = torch.get_num_threads()
    if device.type == "cpu" or simulator.is_simulated(device):
        torch.set_num_threads(1)  # tiny ops; a second thread only adds wake-up latency on small VMs
    try:
        return _check(args, device, wanted)
    finally:
        torch.set_num_threads(threads)


def _open_device(args: argparse.Namespace) -> torch.device | None:
    """The device the check runs on, or None (with the reason on stderr) when there is none."""
    if args.dry_run:
        return torch.device("cpu")
    if args.device == "sim":
        try:
            # Asynchronous, as a GPU is: copies and ops are queued on the streams' worker threads.
            return simulator.load(asynchronous=True)
        except Exception as error:  # SimBuildError: the compiler's message says why
            print(f"the simulated device is not available: {error}", file=sys.stderr)
            return None
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        print("no accelerator here: run on a GPU machine, pass --device sim for the simulated "
              "device (tests/simdevice), or pass --dry-run to exercise the code paths on the CPU "
              "at tiny sizes", file=sys.stderr)
        return None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _check(args: argparse.Namespace, device: torch.device, wanted: list[str]) -> int:
    small = args.dry_run or simulator.is_simulated(device)
    sizes = CheckSizes.dry() if small else CheckSizes.full()
    start = time.monotonic()
    check = _Check(device=device, sizes=sizes, dry_run=args.dry_run, deadline=start + args.budget_s,
                   path=_output_path(Path(args.out), device, args.dry_run), results={})
    check.results.update(_header(check))
    failed = _run_sections(check, wanted, start)
    print(json.dumps(check.results["must_show"], indent=2))
    print(f"wrote {check.path} in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


def _run_sections(check: _Check, wanted: list[str], start: float) -> list[str]:
    failed = []
    for name in wanted:
        remaining = check.deadline - time.monotonic()
        if remaining < 10:
            check.results["sections"][name] = {"skipped": f"time budget: {remaining:.0f} s left"}
            continue
        print(f"[{time.monotonic() - start:6.1f} s] {name} ...", flush=True)
        section_start = time.monotonic()
        try:
            outcome = SECTIONS[name](check)
        except Exception as error:  # one broken section must not lose the others' figures
            failed.append(name)
            outcome = {"error": f"{type(error).__name__}: {error}",
                       "traceback": traceback.format_exc().splitlines()[-8:]}
            _release_memory(check.device)
        outcome["section_seconds"] = time.monotonic() - section_start
        check.results["sections"][name] = outcome
        check.results["elapsed_s"] = time.monotonic() - start
        check.results["must_show"] = must_show(check.results)
        check.save()
    return failed


def _header(check: _Check) -> dict:
    machine = describe_machine()
    simulated = simulator.is_simulated(check.device)
    if check.dry_run:
        note = "CPU dry run at tiny sizes: it exercises the code paths; the figures mean nothing"
    elif simulated:
        note = (f"{simulator.LABEL}; the dry run's sizes: it exercises an accelerator's code paths "
                "with real asynchrony; the figures are a simulation's")
    else:
        note = ("medians of repeated runs; host wall clock with the device synchronized around "
                "each measured step")
    return {
        "check": "benchmarks/gpu_check.py (issue 4, item 8)",
        "dry_run": check.dry_run, "simulated": simulated,
        "note": note,
        "device": str(check.device), "device_name": _device_name(check.device),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine, "sizes": attrs.asdict(check.sizes, recurse=False, value_serializer=
                                                  lambda i, a, v: str(v) if not isinstance(
                                                      v, (int, float, tuple, list)) else v),
        "default_chunk_nbytes": DEFAULT_CHUNK_NBYTES, "sections": {}, "must_show": {},
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if simulator.is_simulated(device):
        return "sim (simulated)"
    return device.type


def _output_path(out: Path, device: torch.device, dry_run: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    name = "dry-run-cpu" if dry_run else _device_name(device)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return out / f"gpu-check-{slug}-{date}.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(_ROOT / "benchmarks" / "results"),
                        help="directory for the JSON (default benchmarks/results/)")
    parser.add_argument("--device", choices=("accelerator", "sim"), default="accelerator",
                        help="accelerator: the process's own (default); sim: the simulated "
                             "device of tests/simdevice, at the dry run's sizes (its figures are a "
                             "simulation's)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every section on the CPU at tiny sizes (no GPU needed)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip sections that would start after this many seconds (default 420)")
    parser.add_argument("--sections", default="",
                        help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    return parser


# -- small helpers ---------------------------------------------------------------------------------


def _enter(scheduler: Scheduler, name: str, device: torch.device) -> None:
    with scheduler.resident(name):
        pass
    synchronize(device)


def _seconds(copy: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    copy()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _per_call(function: Callable[[], object], calls: int, loop_seconds: float = 0.05) -> float:
    """Median over 5 loops of the mean seconds per call.  A loop makes at most `calls` calls and
    lasts about `loop_seconds` (a hook that walks 1,000 modules per call must not take minutes)."""
    start = time.perf_counter()
    function()
    once = time.perf_counter() - start
    calls = max(1, min(calls, int(loop_seconds / max(once, 1e-9))))
    means = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def _size_name(nbytes: int) -> str:
    return f"{nbytes // GiB}GiB" if nbytes >= GiB else f"{nbytes // MiB}MiB" if nbytes >= MiB \
        else f"{nbytes // KiB}KiB"


def _event_seconds(work: Callable[[], object], device: torch.device,
                   repeats: int) -> list[float] | None:
    """The device's own time for each of `repeats` calls of `work`: between two timing events
    recorded on the current stream around it (None on the CPU, which has no events)."""
    if device.type == "cpu":
        return None
    seconds = []
    for _ in range(repeats):
        start = torch.Event(device=device, enable_timing=True)
        end = torch.Event(device=device, enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return seconds


def _reset_peak(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device.index)


def _peak(device: torch.device) -> int | None:
    return None if device.type == "cpu" else torch.accelerator.max_memory_allocated(device.index)


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type != "cpu":
        torch.accelerator.synchronize(device.index)
        torch.accelerator.empty_cache()


def _host_allocator_stats(device: torch.device) -> dict | None:
    """Bytes the pinned (caching host) allocator holds, when torch exposes them."""
    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats_of is None:
        return None
    try:
        stats = stats_of()
    except RuntimeError:
        return None
    return {k: v for k, v in stats.items() if "bytes" in k and ("current" in k or "peak" in k)}


def _pinned_active_bytes(device: torch.device) -> int | None:
    stats = _host_allocator_stats(device)
    return None if not stats else stats.get("active_bytes.current")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss() -> int | None:
    return _status_kib("VmRSS")


def _peak_rss() -> int | None:
    return _status_kib("VmHWM")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs); True if done."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
