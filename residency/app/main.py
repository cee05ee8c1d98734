"""``python -m residency``: run a pipeline with and without offloading, print the phase timeline.

    python -m residency                              # synthetic Wan2.2-shaped pipeline, "small"
    python -m residency --size tiny --steps 4 --trace trace.json
    python -m residency --diffusion-offload-config '{"mode": "module", "components": ["dit"]}'
    python -m residency --pipeline ./Wan2.2-T2V-A14B-Diffusers --height 480 --width 832 --no-check

It runs the pipeline once without offloading and once under the offload config (default: module
mode, dit and text_encoder), checks that the outputs are bit-identical, and prints each phase
change: bytes moved, seconds, GB/s, the floor (a plain copy of the same bytes, measured in the same
run) and the peak device bytes.  ``--diffusion-offload-config null`` means offloading off: the
pipeline runs once, nothing offloaded, and the report says so; an auto config (``{"mode": "auto",
"auto_options": {"device_budget": "20GiB"}}``) reaches the scheduler as its ``auto=``.  Every
argument is checked before any work (the device exists, the trace path is writable, the pipeline
folder holds a diffusers model whose weight files are whole - every safetensors header and sharded
index checked, no tensor read - the config validates).  Exit status (`EXIT_STATUSES`): 0 when
the outputs are identical, 1 when they differ, 2 for bad arguments or a refused configuration, 3
when the run crashed (an unexpected exception: its traceback, then a one-line summary, go to
stderr).  Progress lines go to stderr as the run goes, and so do the library's notes (logger
``residency``, INFO and up).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency.adapters.weight_files import check_weight_files
from residency.adapters.diffusers import (
    ENTRY_POINTS,
    PhaseEntry,
    describe,
    disable_offload,
    from_pretrained,
    offload_scheduler,
)
from residency.vllm_omni.config import OffloadConfig
from residency.engine.budget import format_nbytes
from residency.engine.errors import ResidencyError, WeightFileError
from residency.engine.scheduler import Scheduler
from residency.app.synthetic import SIZES, SyntheticWan22
from residency.app.timeline import (
    PhaseRecorder,
    PhaseSpan,
    format_timeline,
    measure_floor,
    timeline_rows,
    write_trace,
)
from residency.engine.transport import default_device

__all__ = ["main"]

#: The offload config when no flag gives one.
DEFAULT_CONFIG = OffloadConfig(mode="module", components=("dit", "text_encoder"))
#: ``args.diffusion_offload_config`` when the flag is absent (JSON ``null`` parses to None).
#: (Not a string: argparse would parse a string default as JSON.)
NOT_GIVEN = object()
DEFAULT_PROMPT = "a cat walking on the moon"
#: Exit statuses, as `--help` lists them.
EXIT_OK, EXIT_DIFFERS, EXIT_USAGE, EXIT_CRASHED = 0, 1, 2, 3
EPILOG = """exit status:
  0  the outputs are bit-identical (or not compared: --no-check, or null: offloading off)
  1  the outputs differ
  2  bad usage: an argument, the offload config or the pipeline was refused (nothing was run)
  3  crashed: an unexpected error; its traceback and a one-line summary are on stderr"""


@attrs.define(kw_only=True)
class Run:
    """What one invocation measured."""

    title: str
    scheduler: Scheduler
    #: (name, policy, bytes) of each group, in registration order.
    groups: list[tuple[str, str, int]]
    records: list
    #: Layer mode: the block records of the run, and a line per streaming group.
    block_records: list
    layer_lines: list[str]
    first_index: int
    recorder: PhaseRecorder | None
    #: The phases of the offloaded run, as the trace's "phases" track shows them.
    spans: list[PhaseSpan]
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
        "are bit-identical and print the phase timeline.\nThe offload config defaults to module "
        "mode with dit and text_encoder;\n--diffusion-offload-config null runs the pipeline once "
        "without offloading.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=list(SIZES), default="small",
                        help="synthetic pipeline size (default: small; a14b: Wan2.2's real shape)")
    parser.add_argument("--steps", type=_positive, default=8, help="denoising steps (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="noise and weight seed (default: 0)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT,
                        help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--device", default=None,
                        help="compute device, e.g. cpu, cuda, cuda:1 (default: the current "
                        "accelerator, else cpu); checked before the run")
    parser.add_argument("--trace", metavar="OUT.json", type=Path, default=None,
                        help="write a Chrome/Perfetto trace of phases and transfers (the path is "
                        "checked for writing before the run)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the run without offloading (for models that do not fit)")
    parser.add_argument("--nproc", metavar="N", type=_positive, default=1,
                        help="run the synthetic job on N ranks of this host (torch.distributed "
                        "via torchrun, gloo): the ranks share one host master per group, each "
                        "checks its own output, rank 0 prints the report (default: 1)")
    diffusers = parser.add_argument_group("a local diffusers model instead of the synthetic one")
    diffusers.add_argument("--pipeline", metavar="PATH", type=Path, default=None,
                           help="a diffusers model folder with a model_index.json "
                           "(DiffusionPipeline.from_pretrained, local files only)")
    diffusers.add_argument("--height", type=_positive, default=None,
                           help="output height in pixels (default: the pipeline's)")
    diffusers.add_argument("--width", type=_positive, default=None,
                           help="output width in pixels (default: the pipeline's)")
    diffusers.add_argument("--num-frames", type=_positive, default=None,
                           help="video frames, for video pipelines (default: the pipeline's)")
    diffusers.add_argument("--call-args", metavar="JSON", type=_json_object, default={},
                           help="more keyword arguments for the pipeline call, as a JSON object")
    add_offload_arguments(parser)
    parser.set_defaults(diffusion_offload_config=NOT_GIVEN)  # tells the default from JSON null
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and check `argv`, run, print the report; returns the exit status (see `EPILOG`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = _offload_config(parser, args)
    device = _check_arguments(parser, args)
    if args.nproc > 1:
        return _launch_ranks(args.nproc, sys.argv[1:] if argv is None else argv)
    try:
        with _printing_notes():
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank that _launch_ranks started
                _join_ranks()
                with _leaving_the_job():
                    return _run_and_report(args, config, device)
            return _run_and_report(args, config, device)
    except ResidencyError as error:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {error}\n")
    except Exception as error:  # an unexpected failure: say so, with its own exit status
        traceback.print_exc()
        summary = str(error).splitlines()[0] if str(error) else ""
        print(f"{parser.prog}: crashed: {type(error).__name__}: {summary} (traceback above); "
              f"exit status {EXIT_CRASHED}", file=sys.stderr)
        return EXIT_CRASHED


def _offload_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> OffloadConfig | None:
    """The config the flags ask for: `DEFAULT_CONFIG` when neither offloading flag is given, None
    (offloading off) for ``--diffusion-offload-config null``."""
    given = args.diffusion_offload_config is not NOT_GIVEN
    if not given and not args.enable_cpu_offload:
        return DEFAULT_CONFIG
    flags = argparse.Namespace(**vars(args))
    if not given:
        flags.diffusion_offload_config = None
    return offload_config_from_args(parser, flags)


@contextlib.contextmanager
def _printing_notes() -> Iterator[None]:
    """Print the library's notes (logger ``residency``, INFO and up) to stderr while the job runs.

    They say which blocks layer mode streams and why, which components were left unclassified,
    what a stage with nothing to take turns with does: part of what the job reports, and silent
    without a handler (Python shows only warnings then).  The logger's level and handlers are
    restored afterwards."""
    logger = logging.getLogger("residency")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("residency %(levelname)s: %(message)s"))
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run_and_report(
    args: argparse.Namespace, config: OffloadConfig | None, device: torch.device
) -> int:
    if config is None:
        return _run_without_offloading(args, device)
    run = (_run_pipeline if args.pipeline else _run_synthetic)(args, config, device)
    if _is_first_rank():
        print(_report(run, config, device))
        if dist.is_initialized():
            shared = [n for n in run.scheduler if run.scheduler[n].host_master.shared_group]
            print(f"ranks: {dist.get_world_size()}; groups whose host master they share: "
                  f"{', '.join(shared) or 'none'}")
    else:
        same = run.expected is None or torch.equal(run.output, run.expected)
        print(f"rank {dist.get_rank()}: output {'bit-identical' if same else 'DIFFERS'}")
    if args.trace is not None:
        write_trace(args.trace, run.records, run.spans, run.block_records)
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    run.scheduler.close()
    if run.expected is None or torch.equal(run.output, run.expected):
        return EXIT_OK
    return EXIT_DIFFERS


def _progress(stage: str) -> Callable[[str], None]:
    """A progress reporter: one line to stderr per call, with the seconds since it was made."""
    start = time.perf_counter()

    def report(line: str) -> None:
        print(f"[{time.perf_counter() - start:8.2f} s] {stage}: {line}", file=sys.stderr,
              flush=True)

    return report


# -- several ranks (--nproc) ---------------------------------------------------------------------


def _launch_ranks(nproc: int, argv: list[str]) -> int:
    """Run this job on `nproc` ranks through torchrun; the worst rank's exit status.

    The ranks get the same arguments less ``--nproc`` (torchrun's own parser would take it for
    its ``--nproc-per-node``); torchrun's WORLD_SIZE tells them they are ranks of a job.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "residency", *_without_nproc(argv)]
    return subprocess.run(command, check=False).returncode


def _without_nproc(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for argument in argv:
        if skip:
            skip = False
        elif argument == "--nproc":
            skip = True
        elif not argument.startswith("--nproc="):
            kept.append(argument)
    return kept


def _join_ranks() -> None:
    """Join the job torchrun started (gloo: host-side collectives; every rank on its device)."""
    dist.init_process_group("gloo")


@contextlib.contextmanager
def _leaving_the_job() -> Iterator[None]:
    """Leave the job together: wait for every rank, then tear the process group down.

    A gloo group left to the interpreter's exit is destroyed while its threads may still run, and
    the process can abort ("terminate called without an active exception") after its work is
    done.  A rank that failed skips the barrier (the others' collectives then fail, typed)."""
    yield
    dist.barrier()
    dist.destroy_process_group()


def _process_group() -> object:
    return dist.group.WORLD if dist.is_initialized() else None


def _is_first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# -- checking the arguments before any work -------------------------------------------------------


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Refuse (exit status 2) what would fail later; returns the compute device."""
    device = _check_device(parser, args.device)
    if args.trace is not None:
        _check_writable(parser, args.trace)
    if args.pipeline is not None:
        _check_pipeline_folder(parser, args.pipeline)
        if args.nproc > 1:
            parser.error("--nproc runs the synthetic pipeline; leave it out with --pipeline")
    return device


def _check_device(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    if text is None:
        return default_device()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"--device {text!r} is not a device name; give cpu, cuda, cuda:1, ...")
    if device.type == "cpu":
        return device
    available = ["cpu"]
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        count = torch.accelerator.device_count()
        available += [f"{accelerator.type}:{index}" for index in range(count)]
        if accelerator.type == device.type and (device.index or 0) < count:
            return device
    parser.error(f"--device {text}: there is no such device on this machine (available: "
                 f"{', '.join(available)}); leave --device out to use the default")


def _check_writable(parser: argparse.ArgumentParser, path: Path) -> None:
    """Open `path` for appending (creating it only for the check) so a bad path fails now."""
    if path.is_dir():
        parser.error(f"--trace {path} is a folder; give a file name, e.g. {path / 'trace.json'}")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        parser.error(f"--trace {path}: cannot write there ({error.strerror}); give a path in a "
                     "folder that exists and is writable")
    if not existed:
        path.unlink()


def _check_pipeline_folder(parser: argparse.ArgumentParser, path: Path) -> None:
    index = path / "model_index.json"
    if not index.is_file():
        parser.error(f"--pipeline {path}: no model_index.json there; give a diffusers model "
                     "folder (one written by pipe.save_pretrained or downloaded from the Hub)")
    try:
        declared = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        parser.error(f"--pipeline {path}: model_index.json cannot be read as JSON ({error}); "
                     "save the pipeline again with pipe.save_pretrained")
    if not isinstance(declared, dict) or "_class_name" not in declared:
        parser.error(f"--pipeline {path}: model_index.json names no pipeline class "
                     "(\"_class_name\"); it is not a diffusers model folder")
    try:  # every safetensors header and sharded index; no tensor is read
        check_weight_files(path)
    except WeightFileError as error:  # one line: the file, what is wrong, what to do
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: --pipeline {path}: {error}\n")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        parser.error("--pipeline needs diffusers: pip install -e \".[diffusers]\"")


# -- the synthetic pipeline -----------------------------------------------------------------------


def _run_synthetic(args: argparse.Namespace, config: OffloadConfig, device: torch.device) -> Run:
    _progress("build")(f"synthetic pipeline, size {args.size!r}")
    pipe = SyntheticWan22.build(args.size, seed=args.seed)
    expected, plain_seconds = None, None
    if args.check:
        pipe.offload = Scheduler.from_pipeline(pipe, None, device=device)  # NoOffload
        pipe(args.prompt, steps=1, seed=args.seed,  # warm-up: one-time costs are not offloading's
             progress=_progress("warm-up"))
        start = time.perf_counter()
        expected = pipe(args.prompt, steps=args.steps, seed=args.seed,
                        progress=_progress("run without offloading")).cpu()
        plain_seconds = time.perf_counter() - start
        pipe.to("cpu")
        _release_device_memory(device)
    scheduler = Scheduler.from_pipeline(pipe, config, device=device,
                                        process_group=_process_group())
    recorder = PhaseRecorder(scheduler, synchronize=device.type != "cpu")
    pipe.offload = recorder
    _reset_allocator_peak(device)
    start = time.perf_counter()
    output = pipe(args.prompt, steps=args.steps, seed=args.seed,
                  progress=_progress("run with offloading")).cpu()
    seconds = time.perf_counter() - start
    return _finish(
        scheduler, recorder=recorder, spans=recorder.spans, output=output, expected=expected,
        plain_seconds=plain_seconds, offloaded_seconds=seconds, device=device,
        title=f"synthetic Wan2.2-T2V-A14B-shaped pipeline, size {args.size!r}, {args.steps} steps",
    )


# -- a local diffusers pipeline -------------------------------------------------------------------


def _run_pipeline(args: argparse.Namespace, config: OffloadConfig, device: torch.device) -> Run:
    """The first call of a plain copy against the first call of an offloaded copy.

    A diffusers pipeline may carry state between calls, so each copy is loaded fresh and called
    once; the plain copy is dropped before the offloaded one is loaded (never both in memory).
    """
    expected, plain_seconds = None, None
    report = _progress(f"pipeline {args.pipeline}")
    if args.check:
        report("loading, then the run without offloading")
        plain = _load_pipeline(args.pipeline).to(device)
        start = time.perf_counter()
        expected = _generate(plain, args)
        plain_seconds = time.perf_counter() - start
        del plain
        _release_device_memory(device)
    report("loading, then the run with offloading")
    pipe = _load_offloaded(args.pipeline, config, device)
    print(describe(pipe, config), flush=True)  # how each component is grouped, and why
    scheduler = offload_scheduler(pipe)
    _reset_allocator_peak(device)
    start = time.perf_counter()
    with _recording_phases(pipe) as spans:
        output = _generate(pipe, args)
    seconds = time.perf_counter() - start
    run = _finish(
        scheduler, recorder=None, spans=spans, output=output, expected=expected,
        plain_seconds=plain_seconds, offloaded_seconds=seconds, device=device,
        title=f"{type(pipe).__name__} from {args.pipeline}, {args.steps} steps",
    )
    disable_offload(pipe)
    return run


def _generate(pipe, args: argparse.Namespace) -> torch.Tensor:
    """One call of the diffusers pipeline `pipe` with the flags' arguments; its output tensor."""
    kwargs = {"prompt": args.prompt, "num_inference_steps": args.steps, "output_type": "pt"}
    for name in ("height", "width", "num_frames"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    kwargs |= args.call_args
    generator = torch.Generator().manual_seed(args.seed)
    return _first_tensor(pipe(**kwargs, generator=generator)).cpu()


@contextlib.contextmanager
def _recording_phases(pipe) -> Iterator[list[PhaseSpan]]:
    """Record each call of `pipe`'s offloaded entry points as a phase (the trace's "phases").

    The synthetic pipeline enters its phases through a `PhaseRecorder`; a diffusers pipeline
    enters them in the adapter's `PhaseEntry` wrappers, so each of those gets a timing wrapper on
    top for the block's duration, and is put back when it ends.
    """
    spans: list[PhaseSpan] = []
    timed = []
    for module in pipe.components.values():
        for attribute in ENTRY_POINTS:
            entry = vars(module).get(attribute) if isinstance(module, torch.nn.Module) else None
            if isinstance(entry, PhaseEntry):
                setattr(module, attribute, _TimedEntry(entry, spans))
                timed.append((module, attribute, entry))
    try:
        yield spans
    finally:
        for module, attribute, entry in timed:
            setattr(module, attribute, entry)


class _TimedEntry:
    """Calls a `PhaseEntry` and appends a `PhaseSpan` for the call (see `_recording_phases`)."""

    def __init__(self, entry: PhaseEntry, spans: list[PhaseSpan]) -> None:
        functools.update_wrapper(self, entry)  # inspect.signature sees the original's
        self._entry = entry
        self._spans = spans

    def __call__(self, *args, **kwargs):
        log = self._entry.scheduler.transitions
        count, start = log.count, time.perf_counter()
        try:
            return self._entry(*args, **kwargs)
        finally:
            # The call's phase change, if it made one: the first transition after `count`.
            position = count - (log.count - len(log))
            record = log[position] if log.count > count and position >= 0 else None
            self._spans.append(PhaseSpan(
                name=self._entry.group, start=start, end=time.perf_counter(),
                enter_seconds=record.seconds if record is not None else 0.0,
                transition=count if log.count > count else None,
                thread=threading.current_thread().name))


def _load_pipeline(path: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _load_offloaded(path: Path, config: OffloadConfig, device: torch.device):
    """The pipeline at `path`, offloaded as it loads: its masters read from the weight files."""
    from diffusers import DiffusionPipeline

    pipe = from_pretrained(DiffusionPipeline, path, config, device=device, local_files_only=True)
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


# -- offloading off: --diffusion-offload-config null ----------------------------------------------


def _run_without_offloading(args: argparse.Namespace, device: torch.device) -> int:
    """One run with every component on `device` and nothing offloaded; the report says so.

    There is no second run to compare with, so the output is not compared (exit status 0).  The
    synthetic pipeline's phases (all doing nothing) still go to ``--trace``.
    """
    recorder = None
    if args.pipeline:
        report = _progress(f"pipeline {args.pipeline}")
        report("loading, then the run without offloading")
        pipe = _load_pipeline(args.pipeline).to(device)
        title = f"{type(pipe).__name__} from {args.pipeline}, {args.steps} steps"
        start = time.perf_counter()
        output = _generate(pipe, args)
    else:
        _progress("build")(f"synthetic pipeline, size {args.size!r}")
        pipe = SyntheticWan22.build(args.size, seed=args.seed)
        recorder = PhaseRecorder(Scheduler.from_pipeline(pipe, None, device=device))  # NoOffload
        pipe.offload = recorder
        title = (f"synthetic Wan2.2-T2V-A14B-shaped pipeline, size {args.size!r}, "
                 f"{args.steps} steps")
        start = time.perf_counter()
        output = pipe(args.prompt, steps=args.steps, seed=args.seed,
                      progress=_progress("run without offloading")).cpu()
    seconds = time.perf_counter() - start
    if not _is_first_rank():
        print(f"rank {dist.get_rank()}: ran without offloading")
    else:
        shape = "x".join(map(str, output.shape))
        print("\n".join([
            f"residency: {title}, on {device} (torch {torch.__version__})",
            "offload config: null (no offloading)",
            f"run without offloading: {seconds:.3f} s",
            f"output: {shape} {output.dtype}, not compared (offloading is off: one run only)",
        ]))
    if args.trace is not None:
        write_trace(args.trace, [], recorder.spans if recorder is not None else ())
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return EXIT_OK


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
    _progress("floor")("a plain copy of each group's bytes")
    floor = measure_floor(scheduler)
    groups = [(name, scheduler[name].policy.value, scheduler[name].nbytes) for name in scheduler]
    return Run(scheduler=scheduler, groups=groups, records=records, first_index=first_index,
               recorder=recorder, floor=floor, allocator_peak=allocator_peak,
               peak_device_bytes=peak, block_records=list(scheduler.block_records),
               layer_lines=_layer_lines(scheduler), **measured)


def _layer_lines(scheduler: Scheduler) -> list[str]:
    """A line per layer-mode group: the blocks each model streams, and what they moved; under an
    auto plan, the plan (`AutoPlan.describe`: what each group keeps, swaps and streams, and the
    bytes per call predicted beside the measured)."""
    if scheduler.plan is not None:
        return scheduler.plan.describe().splitlines()
    lines = []
    log = scheduler.block_records
    for name in scheduler:
        lines += [f"  {line}" for stream in scheduler[name].streams
                  for blocks in stream.model_blocks for line in blocks.describe().splitlines()]
    if lines:
        lines.insert(0, "layer mode:")
        lines.append(f"  block copies: {log.copies} ({format_nbytes(log.nbytes)}), through 2 "
                     f"slots; per-block records in scheduler.block_records (and --trace)")
    return lines


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
        lines.append(f"  {name:<16} {policy:<10} {format_nbytes(nbytes):>10}")
    lines += run.layer_lines
    if run.plain_seconds is not None:
        lines.append(
            f"run without offloading: {run.plain_seconds:.3f} s; with offloading: "
            f"{run.offloaded_seconds:.3f} s (x{run.offloaded_seconds / run.plain_seconds:.2f})"
        )
        lines.append(_what_the_ratio_means(device))
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


def _what_the_ratio_means(device: torch.device) -> str:
    """How to read the two runs' seconds on `device`: one line under them."""
    if device.type == "cpu":
        return ("  (on the CPU the \"device\" is host memory: offloading saves nothing, and a "
                "ratio under 1 is no speed-up - the plain run pays its own first-touch costs; on "
                "an accelerator the ratio is the time offloading costs, for the device bytes it "
                "saves: peak device bytes below)")
    return ("  (the ratio is the time offloading costs, for the device bytes it saves: peak "
            "device bytes below, against the plain run's whole model)")


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
