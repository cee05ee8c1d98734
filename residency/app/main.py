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
argument is checked before any work (`residency.app.checks`: the device exists, the trace and plot
paths are writable, the synthetic size fits the host's memory, the pipeline folder holds a
diffusers model whose every component has whole weight files - no tensor read - and whose class
takes the call's arguments, the config validates); a plan the config cannot fit is refused
before the first run.  Exit status (`EPILOG`): 0 when the outputs are identical, 1 when they
differ, 2 for bad arguments or a refused configuration, 3 when the run crashed (an unexpected
exception: its traceback, then a one-line summary, go to stderr), 4 when ``--pipeline``'s run
without offloading failed in the pipeline's own call (the model does not take the arguments:
the line says so and suggests the sizes to give), 130 when interrupted (Ctrl-C: one line on
stderr).  Progress lines go to stderr as the run goes, and so do the library's notes
(logger ``residency``, INFO and up).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from importlib import metadata
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from residency.adapters.cli import add_offload_arguments, offload_config_from_args
from residency.adapters.diffusers import (
    ENTRY_POINTS,
    PhaseEntry,
    describe,
    disable_offload,
    enable_offload,
    from_pretrained,
    offload_scheduler,
)
from residency.options.vllm_omni import OffloadConfig
from residency.options.budget import counted, format_nbytes
from residency.core.errors import ResidencyError
from residency.scheduler.scheduler import Scheduler
from residency.app.checks import PLOT_SUFFIXES, check_arguments
from residency.pipelines.discovery import module_mode_cost
from residency.app.plot import write_plot
from residency.app.synthetic import SIZES, SyntheticWan22
from residency.app.timeline import (
    ChangeCosts,
    MachineLoad,
    PhaseRecorder,
    PhaseSpan,
    format_changes,
    format_device_bytes,
    format_timeline,
    machine_load,
    measure_changes,
    timeline_rows,
    wait_for_reads,
    write_trace,
)

__all__ = ["main"]

#: The offload config when no flag gives one.
DEFAULT_CONFIG = OffloadConfig(mode="module", components=("dit", "text_encoder"))
#: ``args.diffusion_offload_config`` when the flag is absent (JSON ``null`` parses to None).
#: (Not a string: argparse would parse a string default as JSON.)
NOT_GIVEN = object()
DEFAULT_PROMPT = "a cat walking on the moon"
#: Exit statuses, as `--help` lists them.
EXIT_OK, EXIT_DIFFERS, EXIT_USAGE, EXIT_CRASHED, EXIT_PLAIN_FAILED, EXIT_INTERRUPTED = (
    0, 1, 2, 3, 4, 130)
EPILOG = """exit status:
  0    the outputs are bit-identical (or not compared: --no-check, or null: offloading off)
  1    the outputs differ
  2    bad usage: an argument, the offload config or the pipeline was refused (nothing was run)
  3    crashed: an unexpected error; its traceback and a one-line summary are on stderr
  4    --pipeline: the run without offloading failed in the pipeline's own call (nothing was
       offloaded): the model does not take these arguments; try --height/--width/--num-frames
  130  interrupted (Ctrl-C): one line on stderr; no shared-memory segment is left behind"""
#: How long a job interrupted on several ranks waits for them to leave before it kills them.
RANKS_LEAVE_S = 30.0


@attrs.define(kw_only=True)
class Run:
    """What one invocation measured."""

    title: str
    scheduler: Scheduler
    #: (name, policy, weight bytes, bytes a load of its own part moves: the packed layout, with
    #: alignment padding) of each group, in registration order.
    groups: list[tuple[str, str, int, int]]
    records: list
    #: Layer mode: the block records of the run, and a line per streaming group.
    block_records: list
    layer_lines: list[str]
    first_index: int
    recorder: PhaseRecorder | None
    #: The phases of the offloaded run, as the trace's "phases" track shows them.
    spans: list[PhaseSpan]
    #: The run's phase changes made again after it, against the floor (`measure_changes`).
    costs: ChangeCosts
    #: torch's threads and the host's load while it was measured.
    load: MachineLoad
    output: torch.Tensor
    expected: torch.Tensor | None
    plain_seconds: float | None
    offloaded_seconds: float
    allocator_peak: int | None
    peak_device_bytes: int
    #: The device bytes the run without offloading held (the model's bytes; the allocator's
    #: peak on an accelerator), or None when it did not run (--no-check).
    plain_device_bytes: int | None = None


def build_parser(prog: str = "python -m residency") -> argparse.ArgumentParser:
    """The job's flags; `prog` is how usage and error lines name the command (`program_name`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
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
    parser.add_argument("--plot", metavar="OUT.png", type=Path, default=None,
                        help="draw the phase timeline of the run with offloading as a picture "
                        f"({', '.join(PLOT_SUFFIXES)}; needs matplotlib: the plot extra); the "
                        "path is checked for writing before the run")
    parser.add_argument("--version", action="version",
                        version=f"residency {_version()} (torch {torch.__version__})")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the run without offloading (for models that do not fit)")
    parser.add_argument("--threads", metavar="N", type=_positive, default=None,
                        help="torch's intra-op threads for the job (default: torch's own, one "
                        "per core); on a machine other processes load, 1 keeps each small "
                        "operation from waiting for a descheduled thread")
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


def _version() -> str:
    """``residency.__version__`` (the package's `__init__` sits above this module's layer, so the
    metadata is read the same way here)."""
    try:
        return metadata.version("residency")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def main(argv: list[str] | None = None) -> int:
    """Parse and check `argv`, run, print the report; returns the exit status (see `EPILOG`)."""
    parser = build_parser(program_name(argv))
    try:
        return _checked_run(parser, argv)
    except KeyboardInterrupt:  # one line, no traceback: the scheduler's state needs no clean-up
        print(f"{parser.prog}: interrupted (Ctrl-C); exit status {EXIT_INTERRUPTED}",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def program_name(argv: list[str] | None) -> str:
    """``residency`` when the console script runs the job, else ``python -m residency`` (also
    for a `main` called with its own `argv`)."""
    if argv is None and Path(sys.argv[0]).name == "residency":
        return "residency"
    return "python -m residency"


def _checked_run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    config = _offload_config(parser, args)
    device = check_arguments(parser, args)
    if args.threads is not None:  # every rank sets its own: _launch_ranks passes the flag on
        torch.set_num_threads(args.threads)
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
    except PlainRunFailed as failed:  # not ours: the pipeline's own call, nothing offloaded
        return _plain_run_failed(parser, failed)
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
    if args.plot is not None and _is_first_rank():  # one picture per job, not per rank
        write_plot(args.plot, title=f"{run.title}, on {device} ({run.load.describe()})",
                   records=run.records, spans=run.spans, costs=run.costs)
        print(f"plot: {args.plot} (the run's phases and loads; each phase change against the "
              "floor)")
    run.scheduler.close()
    if run.expected is None or torch.equal(run.output, run.expected):
        return EXIT_OK
    return EXIT_DIFFERS


def _progress(stage: str) -> Callable[[str], None]:
    """A progress reporter: one line to stderr per call, with the seconds since it was made.

    Each line is one write (``print`` writes the text and its newline apart), so the lines of
    several ranks sharing one stderr pipe never interleave within a line."""
    start = time.perf_counter()

    def report(line: str) -> None:
        sys.stderr.write(f"[{time.perf_counter() - start:8.2f} s] {stage}: {line}\n")
        sys.stderr.flush()

    return report


# -- several ranks (--nproc) ---------------------------------------------------------------------


def _launch_ranks(nproc: int, argv: list[str]) -> int:
    """Run this job on `nproc` ranks through torchrun; the worst rank's exit status.

    The ranks get the same arguments less ``--nproc`` (torchrun's own parser would take it for
    its ``--nproc-per-node``); torchrun's WORLD_SIZE tells them they are ranks of a job.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "residency", *_without_nproc(argv)]
    ranks = subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True)
    interrupted = threading.Event()
    relay = threading.Thread(target=_relay, args=(ranks.stderr, interrupted), daemon=True,
                             name="residency-ranks-stderr")
    relay.start()
    try:
        status = ranks.wait()
    except KeyboardInterrupt:  # see [Note: Ctrl-C on several ranks]
        interrupted.set()
        _stop(ranks)
        raise
    finally:
        relay.join(timeout=RANKS_LEAVE_S)
    return status


def _relay(stream, interrupted: threading.Event) -> None:
    """Copy the ranks' stderr (torchrun's and every rank's) to ours, line by line, until the job
    is interrupted; after that their lines are dropped (see [Note: Ctrl-C on several ranks])."""
    for line in iter(stream.readline, b""):
        if not interrupted.is_set():
            sys.stderr.write(line.decode(errors="replace"))
            sys.stderr.flush()
    stream.close()


def _stop(ranks: subprocess.Popen) -> None:
    """Interrupt torchrun and its ranks, and let them leave within `RANKS_LEAVE_S`; then kill
    them.

    [Note: Ctrl-C on several ranks]
    torchrun runs in a session of its own, so the terminal's SIGINT reaches this process only,
    which passes it to torchrun's whole process group: torchrun and every rank.  Each rank leaves
    through its own KeyboardInterrupt, and a node-shared segment's name is unlinked as soon as
    every rank has mapped it (residency/multirank/shared_memory.py), so a rank that dies
    mid-phase leaves nothing in /dev/shm.  What torchrun and the ranks print while they leave
    (torchrun's traceback of its SignalException, one line per rank) is dropped: the job says
    one line.  The wait is bounded: waiting forever would hang on a rank that ignores the
    signal."""
    try:
        os.killpg(ranks.pid, signal.SIGINT)
        ranks.wait(timeout=RANKS_LEAVE_S)
    except ProcessLookupError:
        ranks.wait()
    except subprocess.TimeoutExpired:
        os.killpg(ranks.pid, signal.SIGKILL)
        ranks.wait()


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


# -- the synthetic pipeline -----------------------------------------------------------------------


def _run_synthetic(args: argparse.Namespace, config: OffloadConfig, device: torch.device) -> Run:
    _progress("build")(f"synthetic pipeline, size {args.size!r}")
    pipe = SyntheticWan22.build(args.size, seed=args.seed)
    expected, plain_seconds, plain_device_bytes = None, None, None
    if args.check:
        _check_plan_fits(pipe, config, device)
        pipe.offload = Scheduler.from_pipeline(pipe, None, device=device)  # NoOffload
        plain_device_bytes = sum(t.nbytes for t in pipe.state_dict().values())
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
        plain_device_bytes=plain_device_bytes,
        title=(f"synthetic Wan2.2-T2V-A14B-shaped pipeline, size {args.size!r}, "
               f"{counted(args.steps, 'step')}"),
    )


def _check_plan_fits(pipe: SyntheticWan22, config: OffloadConfig, device: torch.device) -> None:
    """Refuse, before the first run, an auto config whose budget no plan fits: its groups are
    registered once and closed again (what the offloaded run will register), so the planner's
    `DeviceMemoryError` (exit status 2) comes before anything has run.  Other modes plan
    nothing that a budget can refuse."""
    if config.mode == "auto":
        Scheduler.from_pipeline(pipe, config, device=device,
                                process_group=_process_group()).close()


# -- a local diffusers pipeline -------------------------------------------------------------------


def _run_pipeline(args: argparse.Namespace, config: OffloadConfig, device: torch.device) -> Run:
    """The first call of a plain copy against the first call of an offloaded copy.

    A diffusers pipeline may carry state between calls, so each copy is loaded fresh and called
    once; the plain copy is dropped before the offloaded one is loaded (never both in memory).
    """
    expected, plain_seconds, plain_device_bytes = None, None, None
    report = _progress(f"pipeline {args.pipeline}")
    if args.check:
        report("loading, then the run without offloading")
        plain = _load_pipeline(args.pipeline)
        if config.mode == "auto":  # a budget no plan fits is refused before the first run
            enable_offload(plain, config, device=device)
            disable_offload(plain)
        plain.to(device)
        plain_device_bytes = sum(t.nbytes for module in plain.components.values()
                                 if isinstance(module, torch.nn.Module)
                                 for t in module.state_dict().values())
        start = time.perf_counter()
        try:
            expected = _generate(plain, args)
        except Exception as error:  # in diffusers' code: the arguments do not suit the model
            raise PlainRunFailed(type(plain).__name__) from error
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
        plain_device_bytes=plain_device_bytes,
        title=f"{type(pipe).__name__} from {args.pipeline}, {counted(args.steps, 'step')}",
    )
    disable_offload(pipe)
    return run


class PlainRunFailed(Exception):
    """The run without offloading raised inside the pipeline's own call (its class name is the
    argument, the error its cause): before anything was offloaded, so not the library's."""


def _plain_run_failed(parser: argparse.ArgumentParser, failed: PlainRunFailed) -> int:
    """The traceback, then one line: where it failed, why, what to try; `EXIT_PLAIN_FAILED`."""
    error = failed.__cause__
    traceback.print_exception(error)
    summary = str(error).splitlines()[0] if str(error) else ""
    print(f"{parser.prog}: the run without offloading failed in {failed.args[0]}.__call__ "
          f"(diffusers' own code; nothing was offloaded yet): {type(error).__name__}: {summary}. "
          "The model may not take this size: give --height and --width (and --num-frames for "
          "video) that it was trained for, as its model card or the pipeline's defaults say; "
          f"exit status {EXIT_PLAIN_FAILED}", file=sys.stderr)
    return EXIT_PLAIN_FAILED


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
        title = f"{type(pipe).__name__} from {args.pipeline}, {counted(args.steps, 'step')}"
        start = time.perf_counter()
        output = _generate(pipe, args)
    else:
        _progress("build")(f"synthetic pipeline, size {args.size!r}")
        pipe = SyntheticWan22.build(args.size, seed=args.seed)
        recorder = PhaseRecorder(Scheduler.from_pipeline(pipe, None, device=device))  # NoOffload
        pipe.offload = recorder
        title = (f"synthetic Wan2.2-T2V-A14B-shaped pipeline, size {args.size!r}, "
                 f"{counted(args.steps, 'step')}")
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
    """Collect the run's records, then measure its phase changes again against the floor
    (`measure_changes`, once any reads behind the first phase have ended)."""
    log = scheduler.transitions
    records, first_index = list(log), log.count - len(log)
    peak = recorder.peak_device_bytes if recorder is not None else 0
    peak = max(peak, scheduler.device_nbytes)
    allocator_peak = _allocator_peak(device)
    groups = [(name, scheduler[name].policy.value, scheduler[name].nbytes,
               scheduler[name].inventory.layout.nbytes) for name in scheduler]
    blocks, layer_lines = list(scheduler.block_records), _layer_lines(scheduler)  # the run's own
    report = _progress("floor")
    still_reading = wait_for_reads(scheduler, report)
    report("a plain copy of each loaded group's bytes, then each phase change of the run again")
    costs = measure_changes(scheduler, records, still_reading=still_reading)
    return Run(scheduler=scheduler, groups=groups, records=records, first_index=first_index,
               recorder=recorder, costs=costs, load=machine_load(),
               allocator_peak=allocator_peak, peak_device_bytes=peak, block_records=blocks,
               layer_lines=layer_lines, **measured)


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
    """The job's report: what ran where (with torch's threads and the host's load), the two runs,
    the device bytes, the run's timeline, its phase changes against the floor, the verdict."""
    lines = [
        f"residency: {run.title}, on {device} (torch {torch.__version__}; "
        f"{run.load.describe()})",
        *filter(None, [run.load.warning()]),
        f"offload config: {config.to_json()}",
        f"groups: {'policy':<10} {'weights':>10}  a load moves (packed, with alignment padding)",
    ]
    for name, policy, nbytes, load_nbytes in run.groups:
        lines.append(f"  {name:<16} {policy:<10} {format_nbytes(nbytes):>10}  "
                     f"{format_nbytes(load_nbytes):>10}")
    lines += run.layer_lines
    lines += _what_the_ratio_means(run, device)
    lines.append(format_device_bytes(plain=run.plain_device_bytes,
                                     storage_peak=run.peak_device_bytes,
                                     allocator_peak=run.allocator_peak, device=device))
    usage = getattr(run.scheduler, "host_usage", None)  # NoOffload keeps no host masters
    if usage is not None:
        lines.append(usage.describe() + (" (the CPU device copies from pageable memory)"
                                         if device.type == "cpu" else ""))
    cost = module_mode_cost(run.scheduler, config.mode)
    if cost is not None:
        lines.append(cost)
    rows = timeline_rows(run.records, run.recorder, first_index=run.first_index)
    lines.append(format_timeline(rows, device=device))
    if device.type != "cpu" and run.recorder is None:
        lines.append("(on an accelerator the run's seconds cover issuing the copies; the phase "
                     "changes made again below synchronise around each one)")
    lines.append(format_changes(run.costs))
    lines.append(_verdict(run))
    return "\n".join(lines)


def _what_the_ratio_means(run: Run, device: torch.device) -> list[str]:
    """The two runs' seconds on `device`, and how to read them.

    One run each, so their ratio carries the machine's load as much as offloading's cost.  On
    the CPU the "device" is host memory and offloading saves nothing: the ratio is left out.  On
    an accelerator it is the time offloading costs for the device bytes it saves."""
    if run.plain_seconds is None:
        return [f"run with offloading: {run.offloaded_seconds:.3f} s (--no-check)"]
    seconds = (f"run without offloading: {run.plain_seconds:.3f} s; with offloading: "
               f"{run.offloaded_seconds:.3f} s")
    if device.type == "cpu":
        return [f"{seconds} (one run each)",
                "  (on the CPU the \"device\" is host memory: offloading saves nothing, so the "
                "two runs' ratio is left out - one run each, it swings with the machine's load; "
                "what offloading costs is the phase changes against the floor, below)"]
    ratio = run.offloaded_seconds / run.plain_seconds
    return [f"{seconds} (x{ratio:.2f}, one run each)",
            "  (the ratio is the time offloading costs, for the device bytes it saves: device "
            "bytes below; one run each, so a loaded host moves it too)"]


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
