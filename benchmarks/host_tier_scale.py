"""``python -m benchmarks.host_tier_scale``: a host smaller than the model (issue 23, not in CI).

    python -m benchmarks.host_tier_scale                        # weights 1.3x this machine's RAM
    python -m benchmarks.host_tier_scale --ram-ratio 0.1 --folder /var/tmp/ht-small   # a dry run

A Wan2.2-shaped `WanPipeline` whose weights are `--ram-ratio` times this machine's memory
(``MemTotal``) is written under ``--folder`` once: a UMT5 text encoder and the Wan VAE built as
`benchmarks.cold_start` builds them, and two experts of Wan2.2 A14B's width (5120, 40 heads, FFN
13824) with as many blocks as the ratio asks, written straight into safetensors files block by
block from seeded random values (never whole in memory; each key in the dtype a bf16 load keeps
it in, so loading converts nothing).  Then, each in a fresh child process with the folder's pages
dropped from the page cache:

- ``disk_floor``: the folder's files read once (4 readers, 32 MiB preads): the disk's read rate;
- ``offloaded``: ``residency.adapters.diffusers.from_pretrained`` in layer mode (the experts and
  the encoder stream their blocks) under ``host={"memory_limit": ...}`` (``--limit-ratio`` of the
  RAM): masters beyond the limit are file-backed and paged in by phase.  One call (16x16, one
  frame, two steps: one per expert); each component's inputs and output of its first call are
  kept, with its seconds (phase entry to output) and the bytes the process read from storage
  meanwhile (/proc/self/io ``read_bytes``);
- ``alone:<component>``: that component loaded alone, plainly (``from_pretrained``, never
  offloaded), run on the kept inputs: its output must be the offloaded one's, bit for bit.

Writes ``cpu-host-tier-scale.json`` under ``--out`` (each phase's seconds against its bytes at the
disk floor's rate, and the rate of its reads from storage; the peak resident set against the
limit plus the device storage, host memory on the CPU) and prints a table; a measurement, on this
machine.  Needs disk for the folder (~the ratio times RAM) and for the spill files of the
masters beyond the limit (about as much again).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import proc_number
from benchmarks.cold_start import (
    Scale,
    build_folder,
    drop_page_cache,
    load_arguments,
    read_files,
    status_bytes,
)

__all__ = ["main"]

GiB = 2**30
#: The components whose outputs are compared, in the order a call uses them.
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
#: Wan2.2 A14B's expert width; the block count is chosen to reach the size asked for.
EXPERT = {"heads": 40, "head_dim": 128, "ffn_dim": 13824}
#: The encoder and VAE (built in memory, ~2.4 GiB together).
SMALL = {"text_dim": 2048, "text_layers": 24, "text_ff": 5120, "vocab": 32_000}
_CALL = {"prompt": "a cat on the moon", "height": 16, "width": 16, "num_frames": 1,
         "num_inference_steps": 2, "guidance_scale": 1.0, "max_sequence_length": 8,
         "output_type": "pt"}
_CONFIG = {"mode": "layer", "components": ["dit", "text_encoder"]}
#: The folder's format: a folder of another one (or another target size) is written again.
_FORMAT = 2


def mem_total() -> int:
    """This machine's memory, in bytes."""
    return proc_number("/proc/meminfo", "MemTotal") * 1024


# -- the folder -----------------------------------------------------------------------------------


def build(folder: Path, target: int) -> dict:
    """The folder with about `target` bytes of weights (kept while its stamp matches)."""
    stamp = folder / "host-tier-scale.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("stamp") == [_FORMAT, target]:
        return json.loads(stamp.read_text())
    small = Scale(dit_layers=1, **SMALL, **EXPERT)
    build_folder(folder, small)  # the encoder, the VAE, the tokenizer; experts of one block
    fixed = sum(p.stat().st_size for p in folder.rglob("*.safetensors")
                if p.parent.name not in ("transformer", "transformer_2"))
    per_expert = (target - fixed) // 2
    blocks = None
    for index, name in enumerate(("transformer", "transformer_2")):
        blocks = _write_expert(folder / name, per_expert, seed=index + 1)
    info = {"stamp": [_FORMAT, target], "target": target, "expert_blocks": blocks,
            "weights_bytes": sum(p.stat().st_size for p in folder.rglob("*.safetensors"))}
    stamp.write_text(json.dumps(info))
    return info


def _write_expert(folder: Path, nbytes: int, seed: int) -> int:
    """Replace the one-block expert saved in `folder` by one of as many blocks as reach `nbytes`:
    its config and one safetensors file, written key by key (each key in the dtype the saved
    one-block file has for it)."""
    import torch
    from diffusers import WanTransformer3DModel

    weights = folder / "diffusion_pytorch_model.safetensors"
    saved = _header(weights)
    config = json.loads((folder / "config.json").read_text())
    block = sum(_nbytes(entry) for key, entry in saved.items() if key.startswith("blocks.0."))
    rest = sum(_nbytes(entry) for key, entry in saved.items()
               if key != "__metadata__" and not key.startswith("blocks."))
    blocks = max(1, -(-(nbytes - rest) // block))  # rounded up: at least the size asked for
    config["num_layers"] = blocks
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    entries = []
    for key, tensor in model.state_dict().items():
        pattern = "blocks.0." + key.split(".", 2)[2] if key.startswith("blocks.") else key
        entries.append((key, saved[pattern]["dtype"], list(tensor.shape)))
    _write_safetensors(weights, entries, seed)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return blocks


_DTYPES = {"BF16": 2, "F32": 4, "F16": 2}


def _nbytes(entry: dict) -> int:
    count = 1
    for size in entry["shape"]:
        count *= size
    return count * _DTYPES[entry["dtype"]]


def _header(path: Path) -> dict:
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(length))


def _write_safetensors(path: Path, entries: list[tuple[str, str, list[int]]], seed: int) -> None:
    """A safetensors file of `entries` (key, dtype, shape), values N(0, 0.02) from a seeded pool
    (the bytes of each key differ: the pool is read at a running offset)."""
    import torch

    header, offset = {}, 0
    for key, dtype, shape in entries:
        size = _nbytes({"dtype": dtype, "shape": shape})
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    generator = torch.Generator().manual_seed(seed)
    pools = {name: (torch.randn(2**26, generator=generator) * 0.02).to(dtype).view(torch.uint8)
             .numpy() for name, dtype in (("BF16", torch.bfloat16), ("F32", torch.float32),
                                           ("F16", torch.float16))}
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        cursor = 0
        for key, dtype, shape in entries:
            pool, left = pools[dtype], _nbytes({"dtype": dtype, "shape": shape})
            while left:
                start = cursor % (len(pool) // 2) // 8 * 8
                piece = min(left, len(pool) - start)
                file.write(pool[start : start + piece].tobytes())
                left -= piece
                cursor += piece + 4096
    os.replace(partial, path)


# -- the children ---------------------------------------------------------------------------------


def run_offloaded(folder: Path, limit: int, spill: Path, keep: Path) -> dict:
    """One call of the pipeline offloaded under the host tier; each component's first inputs and
    output saved to `keep`; its seconds per phase and peak resident set."""
    import torch
    from diffusers import DiffusionPipeline

    from residency.adapters.diffusers import from_pretrained, offload_scheduler

    before, read_before = status_bytes("VmRSS"), disk_read_bytes()
    started = time.perf_counter()
    pipe = from_pretrained(DiffusionPipeline, folder, _CONFIG, device="cpu",
                           host={"memory_limit": limit, "spill_directory": spill},
                           **load_arguments())
    loaded, load_read = time.perf_counter() - started, disk_read_bytes() - read_before
    pipe.set_progress_bar_config(disable=True)
    scheduler = offload_scheduler(pipe)
    kept, phases = {}, {}
    _watch(pipe, kept, phases)
    pipe(**_CALL, generator=torch.Generator().manual_seed(0))
    total = time.perf_counter() - started
    torch.save(kept, keep)
    units = [unit for name in scheduler for unit in _units(scheduler[name])]
    grown = status_bytes("VmHWM") - before
    # On the CPU, device storage is host memory too: the largest group's own part and slots.
    storage = max(scheduler[name].device_need for name in scheduler)
    return {"load_seconds": loaded, "load_disk_read_bytes": load_read, "total_seconds": total,
            "phases": phases, "peak_rss_growth_bytes": grown, "device_storage_bytes": storage,
            "rss_over_limit_and_storage": grown / (limit + storage),
            "file_backed_units": sum(u.host_master.spill is not None for u in units),
            "private_units": [u.name for u in units if u.host_master.spill is None],
            "units": len(units), "groups": list(scheduler),
            "component_bytes": {name: _module_nbytes(getattr(pipe, name)) for name in COMPONENTS}}


def disk_read_bytes() -> int:
    """Bytes this process had read from storage so far (/proc/self/io ``read_bytes``: page
    faults of mappings and reads alike; the page cache's hits not counted)."""
    return proc_number("/proc/self/io", "read_bytes")


def _units(group) -> list:
    return [group, *group.parts]


def _module_nbytes(module) -> int:
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _watch(pipe, kept: dict, phases: dict) -> None:
    """Keep each component's first inputs and output, and measure each call: seconds and bytes
    read from storage (forward hooks of the benchmark's own; the VAE measured around
    ``decode``)."""
    for name in COMPONENTS[:-1]:
        module = getattr(pipe, name)

        def before(module, args, kwargs, name=name):
            phases.setdefault(name, []).append(_started())
            kept.setdefault(name, {"args": _detached(args), "kwargs": _detached(kwargs)})

        def after(module, args, kwargs, output, name=name):
            _finished(phases[name][-1])
            kept[name].setdefault("output", _detached(_first(output)))

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
    decode = pipe.vae.decode

    def measured_decode(latents, *args, **kwargs):
        call = _started()
        output = decode(latents, *args, **kwargs)
        phases.setdefault("vae", []).append(_finished(call))
        kept.setdefault("vae", {"args": (_detached(latents),), "kwargs": {},
                                "output": _detached(_first(output))})
        return output

    pipe.vae.decode = measured_decode


def _started() -> dict:
    return {"seconds": -time.perf_counter(), "disk_read_bytes": -disk_read_bytes()}


def _finished(call: dict) -> dict:
    call["seconds"] += time.perf_counter()
    call["disk_read_bytes"] += disk_read_bytes()
    return call


def _first(output):
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    if hasattr(output, "sample"):
        return output.sample
    return output[0] if isinstance(output, (tuple, list)) else output


def _detached(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def run_alone(folder: Path, name: str, keep: Path) -> dict:
    """`name` loaded alone, plainly, run on the kept inputs: whether its output is the same."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    kept = torch.load(keep, weights_only=False)[name]
    dtype = torch.float32 if name == "vae" else torch.bfloat16
    cls = {"text_encoder": UMT5EncoderModel, "vae": AutoencoderKLWan}.get(
        name, WanTransformer3DModel)
    before = status_bytes("VmRSS")
    started, read_before = time.perf_counter(), disk_read_bytes()
    model = cls.from_pretrained(folder / name, torch_dtype=dtype, local_files_only=True)
    with torch.no_grad():
        if name == "vae":
            output = _first(model.decode(*kept["args"], return_dict=False))
        else:
            output = _first(model(*kept["args"], **kept["kwargs"]))
    seconds = time.perf_counter() - started
    expected = kept["output"]
    same = (output.dtype, output.shape) == (expected.dtype, expected.shape) and torch.equal(
        output.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    return {"component": name, "bit_identical": bool(same), "seconds": seconds,
            "disk_read_bytes": disk_read_bytes() - read_before,
            "peak_rss_growth_bytes": status_bytes("VmHWM") - before}


# -- the whole run --------------------------------------------------------------------------------


def _child(case: str, args: argparse.Namespace, out: Path) -> dict:
    drop_page_cache(sorted(args.folder.rglob("*.safetensors")))
    command = [sys.executable, "-m", "benchmarks.host_tier_scale", "--case", case,
               "--folder", str(args.folder), "--case-out", str(out), "--keep", str(args.keep),
               "--limit", str(args.limit), "--spill", str(args.spill)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        return {"case": case, "failed": done.stderr[-3000:]}
    return json.loads(out.read_text())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_tier_scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ram-ratio", type=float, default=1.3,
                        help="the weights as a multiple of MemTotal (default 1.3)")
    parser.add_argument("--limit-ratio", type=float, default=0.25,
                        help="memory_limit as a fraction of MemTotal (default 0.25)")
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/residency-host-tier"),
                        help="where the pipeline is written (default /var/tmp/residency-host-tier)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for cpu-host-tier-scale.json (default benchmarks/results)")
    for hidden in ("--case", "--case-out", "--keep", "--spill"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    return parser


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad arguments before any work (exit status 2, one line)."""
    if not 0 < args.ram_ratio <= 4:
        parser.error(f"--ram-ratio {args.ram_ratio}: give a ratio in (0, 4]")
    if not 0 < args.limit_ratio < 1:
        parser.error(f"--limit-ratio {args.limit_ratio}: give a fraction in (0, 1)")
    parent = args.folder.parent
    if not parent.is_dir():
        parser.error(f"--folder {args.folder}: its parent folder does not exist")
    need = int(args.ram_ratio * mem_total() * 2.1)
    existing = sum(p.stat().st_size for p in args.folder.rglob("*.safetensors")) \
        if args.folder.is_dir() else 0
    free = os.statvfs(parent).f_bavail * os.statvfs(parent).f_frsize + existing
    if free < need:
        parser.error(f"--folder {args.folder}: the folder and the spill files need about "
                     f"{need / GiB:.0f} GiB of disk there and {free / GiB:.0f} GiB are free")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.case is not None:  # a child
        folder, keep = Path(args.folder), Path(args.keep)
        if args.case == "disk_floor":
            files = sorted(folder.rglob("*.safetensors"))
            seconds = read_files(files)
            nbytes = sum(f.stat().st_size for f in files)
            result = {"case": "disk_floor", "seconds": seconds,
                      "read_gb_per_s": nbytes / seconds / 1e9}
        elif args.case == "offloaded":
            result = {"case": "offloaded", **run_offloaded(folder, args.limit, Path(args.spill),
                                                           keep)}
        else:
            result = {"case": args.case, **run_alone(folder, args.case.split(":", 1)[1], keep)}
        Path(args.case_out).write_text(json.dumps(result))
        return 0
    _checked(parser, args)
    memory = mem_total()
    args.out.mkdir(parents=True, exist_ok=True)
    args.folder.mkdir(parents=True, exist_ok=True)
    info = build(args.folder, int(args.ram_ratio * memory))
    args.limit = int(args.limit_ratio * memory)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.folder.parent) as scratch:
        args.keep, args.spill = Path(scratch) / "kept.pt", Path(scratch)
        for case in ("disk_floor", "offloaded", *(f"alone:{c}" for c in COMPONENTS)):
            rows.append(_child(case, args, Path(scratch) / "case.json"))
            print(json.dumps(rows[-1])[:400], flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "cpus": os.cpu_count(), "mem_total_bytes": memory, "memory_limit": args.limit,
              **info, "weights_over_ram": info["weights_bytes"] / memory, "rows": rows,
              "phases": _phases(rows)}
    (args.out / "cpu-host-tier-scale.json").write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))
    failed = any("failed" in row for row in rows)
    identical = all(row.get("bit_identical") for row in rows if row["case"].startswith("alone:"))
    return 0 if identical and not failed else 1


def _phases(rows: list[dict]) -> list[dict]:
    """Per component: its first phase's seconds against its bytes at the disk floor's rate, and
    against the bytes it read from storage at that rate."""
    floor = next((r for r in rows if r["case"] == "disk_floor" and "seconds" in r), None)
    run = next((r for r in rows if r["case"] == "offloaded" and "failed" not in r), None)
    if floor is None or run is None:
        return []
    rate = floor["read_gb_per_s"] * 1e9
    phases = []
    for name in COMPONENTS:
        alone = next((r for r in rows if r["case"] == f"alone:{name}"), {})
        first = (run["phases"].get(name) or [None])[0]
        nbytes = run["component_bytes"][name]
        phase = {"component": name, "bytes": nbytes, "calls": len(run["phases"].get(name, [])),
                 "disk_floor_seconds": nbytes / rate,
                 "bit_identical_to_alone": alone.get("bit_identical")}
        if first is not None:
            phase.update(first_seconds=first["seconds"],
                         first_disk_read_bytes=first["disk_read_bytes"],
                         first_over_floor=first["seconds"] / (nbytes / rate),
                         first_read_gb_per_s=first["disk_read_bytes"] / first["seconds"] / 1e9)
        phases.append(phase)
    return phases


def _table(result: dict) -> str:
    lines = [f"weights {result['weights_bytes'] / GiB:.1f} GiB = "
             f"{result['weights_over_ram']:.2f}x RAM; memory_limit "
             f"{result['memory_limit'] / GiB:.1f} GiB",
             "| component | GiB | first phase s | its bytes at the disk floor s | ratio | "
             "read from disk GiB | at GB/s | bit-identical to it alone |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in result["phases"]:
        lines.append(f"| {p['component']} | {p['bytes'] / GiB:.2f} | {p['first_seconds']:.1f} | "
                     f"{p['disk_floor_seconds']:.1f} | {p['first_over_floor']:.2f} | "
                     f"{p['first_disk_read_bytes'] / GiB:.2f} | {p['first_read_gb_per_s']:.2f} | "
                     f"{p['bit_identical_to_alone']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
