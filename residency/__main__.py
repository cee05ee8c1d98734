"""``python -m residency``: run a pipeline with and without offloading, print the phase timeline.

    python -m residency                              # synthetic Wan2.2-shaped pipeline, "small"
    python -m residency --size tiny --steps 4 --trace trace.json
    python -m residency --diffusion-offload-config '{"mode": "module", "components": ["dit"]}'
    python -m residency --pipeline ./Wan2.2-T2V-A14B-Diffusers --height 480 --width 832 --no-check

It runs the pipeline once without offloading and once under the offload config (default: module
mode, dit and text_encoder), checks that the outputs are bit-identical, and prints each phase
change: bytes moved, seconds, GB/s, the floor (a plain copy of the same bytes, measured in the same
run) and the peak device bytes.  Exit status: 0 when the outputs are identical, 1 when they
differ, 2 for bad arguments or a refused configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import attrs
import torch

from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency.config import OffloadConfig
from residency.errors import ResidencyError
from residency.scheduler import Scheduler
from residency.synthetic import SIZES, SyntheticWan22
from residency.timeline import (
    PhaseRecorder,
    format_bytes,
    format_timeline,
    measure_floor,
    timeline_rows,
    write_trace,
)
from residency.transport import default_device

__all__ = ["main"]

#: The offload config when no flag gives one.
DEFAULT_CONFIG = OffloadConfig(mode="module", components=("dit", "text_encoder"))
DEFAULT_PROMPT = "a cat walking on the moon"


@attrs.define(kw_only=True)
class Run:
    """What one invocation measured."""

    title: str
    scheduler: Scheduler
    #: (name, policy, bytes) of each group, in registration order.
    groups: list[tuple[str, str, int]]
    records: list
    first_index: int
    recorder: PhaseRecorder | None
    floor: dict[str, float]
    output: torch.Tensor
    expected: torch.Tensor | None
    plain_seconds: float | None
    offloaded_seconds: float
    allocator_peak: int | None
    peak_device_bytes: int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m residency",
        description="Run a pipeline with and without model-level offloading; check the outputs "
        "are bit-identical and print the phase timeline.",
    )
    parser.add_argument("--size", choices=list(SIZES), default="small",
                        help="synthetic pipeline size (default: small; a14b: Wan2.2's real shape)")
    parser.add_argument("--steps", type=_positive, default=8, help="denoising steps (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="noise and weight seed (default: 0)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--device", default=None,
                        help="compute device (default: the current accelerator, else cpu)")
    parser.add_argument("--trace", metavar="OUT.json", type=Path, default=None,
                        help="write a Chrome/Perfetto trace of phases and transfers")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the run without offloading (for models that do not fit)")
    diffusers = parser.add_argument_group("a local diffusers model instead of the synthetic one")
    diffusers.add_argument("--pipeline", metavar="PATH", type=Path, default=None,
                           help="a diffusers model folder (DiffusionPipeline.from_pretrained)")
    diffusers.add_argument("--height", type=_positive, default=None)
    diffusers.add_argument("--width", type=_positive, default=None)
    diffusers.add_argument("--num-frames", type=_positive, default=None)
    diffusers.add_argument("--call-args", metavar="JSON", type=_json_object, default={},
                           help="more keyword arguments for the pipeline call, as a JSON object")
    add_offload_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run, print the report; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = offload_config_from_args(parser, args) or DEFAULT_CONFIG
    device = torch.device(args.device) if args.device else default_device()
    try:
        run = (_run_pipeline if args.pipeline else _run_synthetic)(args, config, device)
    except ResidencyError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(_report(run, config, device))
    if args.trace is not None:
        spans = run.recorder.spans if run.recorder is not None else ()
        write_trace(args.trace, run.records, spans)
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    run.scheduler.close()
    return 0 if run.expected is None or torch.equal(run.output, run.expected) else 1


# -- the synthetic pipeline -----------------------------------------------------------------------


def _run_synthetic(args: argparse.Namespace, config: OffloadConfig, device: torch.device) -> Run:
    pipe = SyntheticWan22.build(args.size, seed=args.seed)
    expected, plain_seconds = None, None
    if args.check:
        pipe.scheduler = Scheduler.from_pipeline(pipe, None, device=device)  # NoOffload
        pipe(args.prompt, steps=1, seed=args.seed)  # warm-up: one-time costs are not offloading's
        start = time.perf_counter()
        expected = pipe(args.prompt, steps=args.steps, seed=args.seed).cpu()
        plain_seconds = time.perf_counter() - start
        pipe.to("cpu")
        _release_device_memory(device)
    scheduler = Scheduler.from_pipeline(pipe, config, device=device)
    recorder = PhaseRecorder(scheduler, synchronize=device.type != "cpu")
    pipe.scheduler = recorder
    _reset_allocator_peak(device)
    start = time.perf_counter()
    output = pipe(args.prompt, steps=args.steps, seed=args.seed).cpu()
    seconds = time.perf_counter() - start
    return _finish(
        scheduler, recorder=recorder, output=output, expected=expected, plain_seconds=plain_seconds,
        offloaded_seconds=seconds, device=device,
        title=f"synthetic Wan2.2-T2V-A14B-shaped pipeline, size {args.size!r}, {args.steps} steps",
    )


# -- a local diffusers pipeline -------------------------------------------------------------------


def _run_pipeline(args: argparse.Namespace, config: OffloadConfig, device: torch.device) -> Run:
    """The first call of a plain copy against the first call of an offloaded copy.

    A diffusers pipeline may carry state between calls, so each copy is loaded fresh and called
    once; the plain copy is dropped before the offloaded one is loaded (never both in memory).
    """
    from residency.adapters.diffusers import disable_offload, enable_offload

    kwargs = {"prompt": args.prompt, "num_inference_steps": args.steps, "output_type": "pt"}
    for name in ("height", "width", "num_frames"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    kwargs |= args.call_args

    def generate(pipe) -> torch.Tensor:
        generator = torch.Generator().manual_seed(args.seed)
        return _first_tensor(pipe(**kwargs, generator=generator)).cpu()

    expected, plain_seconds = None, None
    if args.check:
        plain = _load_pipeline(args.pipeline).to(device)
        start = time.perf_counter()
        expected = generate(plain)
        plain_seconds = time.perf_counter() - start
        del plain
        _release_device_memory(device)
    pipe = _load_pipeline(args.pipeline)
    scheduler = enable_offload(pipe, config, device=device)
    _reset_allocator_peak(device)
    start = time.perf_counter()
    output = generate(pipe)
    seconds = time.perf_counter() - start
    run = _finish(
        scheduler, recorder=None, output=output, expected=expected, plain_seconds=plain_seconds,
        offloaded_seconds=seconds, device=device,
        title=f"{type(pipe).__name__} from {args.pipeline}, {args.steps} steps",
    )
    disable_offload(pipe)
    return run


def _load_pipeline(path: Path):
    if not (path / "model_index.json").is_file():
        raise ResidencyError(
            f"--pipeline {path}: no model_index.json there; give a diffusers model folder "
            "(one written by pipe.save_pretrained or downloaded from the Hub)"
        )
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _first_tensor(output) -> torch.Tensor:
    value = output if isinstance(output, torch.Tensor) else output[0]
    if isinstance(value, torch.Tensor):
        return value
    try:
        import numpy

        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(value)
    except ImportError:
        pass
    raise ResidencyError(
        f"the pipeline returned {type(value).__name__}, not a tensor, so the outputs cannot be "
        "compared bit for bit; pass --call-args '{\"output_type\": \"pt\"}' (or \"np\")"
    )


# -- measuring and reporting ----------------------------------------------------------------------


def _finish(scheduler: Scheduler, *, recorder: PhaseRecorder | None, device: torch.device,
            **measured) -> Run:
    """Collect the records, then measure the floor with the exclusive storage released."""
    log = scheduler.transitions
    records, first_index = list(log), log.count - len(log)
    peak = recorder.peak_device_bytes if recorder is not None else 0
    peak = max(peak, scheduler.device_nbytes)
    allocator_peak = _allocator_peak(device)
    scheduler.offload_all()
    floor = measure_floor(scheduler)
    groups = [(name, scheduler[name].policy.value, scheduler[name].nbytes) for name in scheduler]
    return Run(scheduler=scheduler, groups=groups, records=records, first_index=first_index,
               recorder=recorder, floor=floor, allocator_peak=allocator_peak,
               peak_device_bytes=peak, **measured)


def _release_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type != "cpu":
        torch.accelerator.memory.empty_cache()


def _reset_allocator_peak(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats()


def _allocator_peak(device: torch.device) -> int | None:
    if device.type == "cpu":
        return None
    torch.accelerator.synchronize()
    return torch.accelerator.max_memory_allocated()


def _report(run: Run, config: OffloadConfig, device: torch.device) -> str:
    lines = [
        f"residency: {run.title}, on {device} (torch {torch.__version__})",
        f"offload config: {config.to_json()}",
        "groups:",
    ]
    for name, policy, nbytes in run.groups:
        lines.append(f"  {name:<16} {policy:<10} {format_bytes(nbytes):>10}")
    if run.plain_seconds is not None:
        lines.append(
            f"run without offloading: {run.plain_seconds:.3f} s; with offloading: "
            f"{run.offloaded_seconds:.3f} s (x{run.offloaded_seconds / run.plain_seconds:.2f})"
        )
    else:
        lines.append(f"run with offloading: {run.offloaded_seconds:.3f} s (--no-check)")
    rows = timeline_rows(run.records, run.floor, run.recorder, first_index=run.first_index)
    lines.append(format_timeline(rows, peak_device_bytes=run.peak_device_bytes, device=device,
                                 allocator_peak=run.allocator_peak))
    if device.type != "cpu" and run.recorder is None:
        lines.append("(on an accelerator these seconds cover issuing the copies; the synthetic "
                     "pipeline's timeline synchronises around each phase change)")
    lines.append(_verdict(run))
    return "\n".join(lines)


def _verdict(run: Run) -> str:
    shape = "x".join(map(str, run.output.shape))
    if run.expected is None:
        return f"output: {shape} {run.output.dtype}, not compared (--no-check)"
    if torch.equal(run.output, run.expected):
        return (f"output: bit-identical to the run without offloading "
                f"(torch.equal on {shape} {run.output.dtype})")
    if run.output.shape != run.expected.shape:
        return f"output: DIFFERS from the run without offloading: shape {shape} vs " \
               f"{'x'.join(map(str, run.expected.shape))}"
    diff = (run.output.double() - run.expected.double()).abs().max().item()
    return f"output: DIFFERS from the run without offloading (max |difference| {diff:.3g})"


# -- argument types -------------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid JSON: {error.msg} at column {error.colno}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({{...}})")
    return value


if __name__ == "__main__":
    sys.exit(main())
