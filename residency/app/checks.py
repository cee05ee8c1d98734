"""The main job's arguments, checked before any work: each refusal exits with status 2 and one
line that says what is wrong and what to do, before a weight is built, read or moved.

    device = check_arguments(parser, args)   # parser.error(...) for the first problem found

What is checked: the device exists; ``--trace`` and ``--plot`` can be written (and ``--plot`` has
matplotlib); the synthetic ``--size`` fits this host's memory (`available_host_memory`, one
function that tests replace); a ``--pipeline`` folder holds a diffusers model whose weight files
are whole, every component its ``model_index.json`` names included (`check_weight_files`), and
``--call-args`` (with ``--height``, ``--width``, ``--num-frames``) names only arguments its
pipeline class's ``__call__`` takes.  The offload config itself is parsed by the flags
(`residency.adapters.cli`), and a plan that cannot fit is refused by the job before its first run.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
from pathlib import Path

import torch

from residency.adapters.weight_files import check_weight_files
from residency.app.synthetic import SIZES, weight_nbytes
from residency.app.timeline import usable_cores
from residency.options.budget import format_nbytes
from residency.core.errors import WeightFileError
from residency.device.host_memory import host_memory
from residency.device.transport import default_device

__all__ = ["PLOT_SUFFIXES", "available_host_memory", "check_arguments", "host_nbytes_needed"]

#: The picture formats ``--plot`` writes, by file name ending (matplotlib's Agg and vector
#: back ends).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
#: Host memory one process of the job uses beside the weights: the interpreter, torch, the
#: activations of the synthetic sizes (about 250 MiB measured at size small, rounded up).
PROCESS_NBYTES = 512 * 2**20
#: The flags that become keyword arguments of a diffusers pipeline's call, by keyword.
CALL_FLAGS = {"height": "--height", "width": "--width", "num_frames": "--num-frames"}
#: What the job itself passes to every diffusers call (`--call-args` may override them).
JOB_CALL_ARGUMENTS = ("prompt", "num_inference_steps", "output_type", "generator")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Refuse (exit status 2, through `parser`) what would fail later; returns the device."""
    device = _check_device(parser, args.device)
    _check_threads(parser, args.threads, args.nproc)
    if args.trace is not None:
        _check_writable(parser, "--trace", args.trace, "trace.json")
    if args.plot is not None:
        _check_plot(parser, args.plot)
    if args.pipeline is not None:
        if args.nproc > 1:
            parser.error("--nproc runs the synthetic pipeline; leave it out with --pipeline")
        class_name = _check_pipeline_folder(parser, args.pipeline)
        _check_call_arguments(parser, args, class_name)
    else:
        _check_host_memory(parser, args.size, args.nproc, device)
    return device


def _check_threads(parser: argparse.ArgumentParser, threads: int | None, nproc: int) -> None:
    """At most one intra-op thread per core this process may use, all ranks together."""
    if threads is None:
        return
    cores = usable_cores()
    if threads * nproc > cores:
        ranks = f" on each of {nproc} ranks" if nproc > 1 else ""
        parser.error(f"--threads {threads}{ranks} asks for {threads * nproc} threads; this "
                     f"process may use {cores} cores: give at most {max(cores // nproc, 1)}, "
                     "or 1 on a machine other processes load")


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


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: Path, example: str) -> None:
    """Open `path` for appending (creating it only for the check) so a bad path fails now."""
    if path.is_dir():
        parser.error(f"{flag} {path} is a folder; give a file name, e.g. {path / example}")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        parser.error(f"{flag} {path}: cannot write there ({error.strerror}); give a path in a "
                     "folder that exists and is writable")
    if not existed:
        path.unlink()


def _check_plot(parser: argparse.ArgumentParser, path: Path) -> None:
    if path.suffix.lower() not in PLOT_SUFFIXES:
        parser.error(f"--plot {path}: give a file name ending in {', '.join(PLOT_SUFFIXES)} (the "
                     "ending chooses the picture's format)")
    _check_writable(parser, "--plot", path, "timeline.png")
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which is not installed: pip install -e \".[plot]\"")


# -- host memory for --size -----------------------------------------------------------------------


def available_host_memory() -> int | None:
    """The bytes this host can still give the process without swapping or passing its memory
    cgroup's limit (`residency.device.host_memory`), or None where the kernel does not say."""
    return host_memory().available


def host_nbytes_needed(size: str, nproc: int, device: torch.device) -> int:
    """About the host memory the main job needs for the synthetic `size` on `nproc` ranks.

    While a group is packed its weights exist twice on the host (the built modules and the host
    master); on the CPU the device storage (the largest exclusive group and the resident ones)
    is host memory too; ranks share one master per group but build their own modules."""
    components = weight_nbytes(SIZES[size])
    weights = sum(components.values())
    device_storage = max(components[name] for name in ("text_encoder", "transformer"))
    device_storage += components["vae"]
    per_rank = weights + PROCESS_NBYTES + (device_storage if device.type == "cpu" else 0)
    return weights + nproc * per_rank


def _check_host_memory(parser: argparse.ArgumentParser, size: str, nproc: int,
                       device: torch.device) -> None:
    available = available_host_memory()
    if available is None:
        return
    needed = host_nbytes_needed(size, nproc, device)
    if needed <= available:
        return
    weights = sum(weight_nbytes(SIZES[size]).values())
    fitting = [name for name in SIZES if host_nbytes_needed(name, nproc, device) <= available]
    advice = (f"give --size {fitting[-1]} (the largest that fits) or run on a larger host"
              if fitting else "run on a larger host")
    ranks = f" on {nproc} ranks" if nproc > 1 else ""
    parser.error(f"--size {size}{ranks} needs about {format_nbytes(needed)} of host memory (its "
                 f"weights, {format_nbytes(weights)}, are on the host twice while they are "
                 f"packed), and this host has {format_nbytes(available)} available; {advice}")


# -- a diffusers folder ---------------------------------------------------------------------------


def _check_pipeline_folder(parser: argparse.ArgumentParser, path: Path) -> str:
    """Check the folder; returns the pipeline class name its model_index.json gives."""
    index = path / "model_index.json"
    if not index.is_file():
        parser.error(f"--pipeline {path}: no model_index.json there; give a diffusers model "
                     "folder (one written by pipe.save_pretrained or downloaded from the Hub)")
    try:
        declared = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        parser.error(f"--pipeline {path}: model_index.json cannot be read as JSON ({error}); "
                     "save the pipeline again with pipe.save_pretrained")
    if not isinstance(declared, dict) or not isinstance(declared.get("_class_name"), str):
        parser.error(f"--pipeline {path}: model_index.json names no pipeline class "
                     "(\"_class_name\"); it is not a diffusers model folder")
    try:  # every component's folder, every safetensors header and sharded index; no tensor read
        check_weight_files(path)
    except WeightFileError as error:  # one line, no usage: the file, what is wrong, what to do
        parser.exit(2, f"{parser.prog}: error: --pipeline {path}: {error}\n")
    if importlib.util.find_spec("diffusers") is None:
        parser.error("--pipeline needs diffusers: pip install -e \".[diffusers]\"")
    return declared["_class_name"]


def _check_call_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                          class_name: str) -> None:
    """Every keyword the call will get is one the pipeline class's ``__call__`` takes (a class
    diffusers does not export, such as a community pipeline, is not checked)."""
    import diffusers

    pipeline_class = getattr(diffusers, class_name, None)
    if not isinstance(pipeline_class, type):
        return
    parameters = inspect.signature(pipeline_class.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [name for name in parameters if name != "self"]
    given = {name: f"--call-args key {name!r}" for name in args.call_args}
    given |= {name: flag for name, flag in CALL_FLAGS.items() if getattr(args, name) is not None}
    given |= {name: f"the job's own {name}=" for name in JOB_CALL_ARGUMENTS}
    unknown = [what for name, what in given.items() if name not in parameters]
    if unknown:
        parser.error(f"{class_name}.__call__ takes no {', '.join(unknown)}; it accepts "
                     f"{', '.join(accepted)}")
