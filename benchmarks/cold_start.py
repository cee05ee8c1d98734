"""``python -m benchmarks.cold_start``: time from weight files to the first output (issue 23).

    python -m benchmarks.cold_start                        # a ~3 GiB Wan-shaped folder, every case
    python -m benchmarks.cold_start --scale tiny --out /tmp/cs/ --folder /tmp/cs/wan
    python -m benchmarks.cold_start --cases disk_floor residency

A Wan2.2-shaped diffusers pipeline (`WanPipeline`: a UMT5 text encoder, two experts, the Wan VAE,
random weights in bf16) is saved once with ``save_pretrained`` under ``--folder``.  Each case then
runs in a fresh child process, most of them after the folder's pages were dropped from the page
cache (``posix_fadvise(POSIX_FADV_DONTNEED)``: no root needed; the child checks with ``mincore``
that almost nothing of the folder was cached when it started):

- ``disk_floor``: the folder's files read once, in parallel (4 readers, 32 MiB preads): the disk's
  read floor for these bytes;
- ``page_cache_copy``: the same read with every page cached: a copy from the page cache;
- ``diffusers_plain``: ``DiffusionPipeline.from_pretrained`` and one call;
- ``diffusers_model_cpu_offload``: the same with ``enable_model_cpu_offload()`` before the call;
- ``residency``: ``residency.adapters.diffusers.from_pretrained`` (module mode) and one call,
  the masters read behind the first phase (its default);
- ``residency_reads_at_add``: the same with ``background_reads`` off: every master read before
  ``from_pretrained`` returns;
- ``residency_cache_write``: the same with a warm-restart cache directory, empty: the cold start
  that writes the cache;
- ``residency_warm_restart``: the same again, the page cache warm: the cache is mapped;
- ``host_tier``: ``memory_limit`` 0.7x the weights (room for the largest group to page in):
  the masters beyond it file-backed.

Each child reports the seconds from the start of the load to the first output (and to the
pipeline ready for its call: ``loaded_seconds``, where reading behind the first phase shows), its
peak resident set growth (``VmHWM`` less the ``VmRSS`` before the load) and the bytes it holds at
the peak by design (the weights, plus the device storage of the offloaded cases on the CPU), and a
digest of the output: every case must give the same bytes.  Writes ``cpu-cold-start.json`` under
``--out`` and prints a table; a measurement, on this machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import datetime
import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from benchmarks.machine import proc_number

__all__ = ["CASES", "SCALES", "Scale", "build_folder", "drop_page_cache", "load_arguments", "main",
           "read_files", "status_bytes"]

MiB, GiB = 2**20, 2**30

CASES = ("disk_floor", "page_cache_copy", "diffusers_plain", "diffusers_model_cpu_offload",
         "residency", "residency_reads_at_add", "residency_cache_write", "residency_warm_restart",
         "host_tier")
#: Cases that start with the folder dropped from the page cache (the others want it cached).
COLD = frozenset(CASES) - {"page_cache_copy", "residency_warm_restart"}


@attrs.frozen(kw_only=True)
class Scale:
    """The Wan-shaped pipeline's sizes (bf16 weights)."""

    text_dim: int
    text_layers: int
    text_ff: int
    vocab: int
    heads: int
    head_dim: int
    dit_layers: int
    ffn_dim: int
    #: The Wan VAE's base width (Wan's own: 96).
    vae_dim: int = 96


SCALES = {
    # ~3.1 GiB: a 0.4 GiB encoder, two 1.3 GiB experts, the Wan VAE's 0.25 GiB.
    "wan": Scale(text_dim=1024, text_layers=8, text_ff=2816, vocab=32_000, heads=12, head_dim=128,
                 dit_layers=12, ffn_dim=8960),
    # ~12 MiB: a dry run of every case (its figures mean nothing); the experts (~4 MiB each)
    # are the largest groups, as in Wan, so the host tier file-backs them and keeps the VAE.
    "tiny": Scale(text_dim=16, text_layers=1, text_ff=32, vocab=64, heads=2, head_dim=32,
                  dit_layers=2, ffn_dim=8192, vae_dim=8),
}

_WORDS = ["<pad>", "</s>", "<unk>", "a", "cat", "on", "the", "moon"]
_CALL = {"prompt": "a cat on the moon", "height": 16, "width": 16, "num_frames": 1,
         "num_inference_steps": 2, "guidance_scale": 1.0, "max_sequence_length": 8,
         "output_type": "pt"}


# -- the folder -----------------------------------------------------------------------------------


def build_folder(folder: Path, scale: Scale) -> int:
    """Save the Wan-shaped pipeline under `folder` (once: kept while its sizes match); its bytes."""
    stamp = folder / "cold-start-scale.json"
    if stamp.exists() and json.loads(stamp.read_text()) == attrs.asdict(scale):
        return _folder_nbytes(folder)
    import torch
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline,
                           WanTransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    s = scale
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=s.vocab, d_model=s.text_dim, d_kv=64, d_ff=s.text_ff, num_layers=s.text_layers,
        num_heads=max(1, s.text_dim // 64), relative_attention_num_buckets=32))
    experts = [WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=s.heads, attention_head_dim=s.head_dim,
        in_channels=16, out_channels=16, text_dim=s.text_dim, freq_dim=256, ffn_dim=s.ffn_dim,
        num_layers=s.dit_layers) for _ in range(2)]
    pipe = WanPipeline(tokenizer=_tokenizer(), text_encoder=text_encoder, vae=AutoencoderKLWan(base_dim=s.vae_dim),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                       transformer=experts[0], transformer_2=experts[1], boundary_ratio=0.5)
    # Saved in fp32, then loaded as Wan2.2's are (bf16 but `_keep_in_fp32_modules`, an fp32
    # VAE) and saved again: the folder's files hold the dtypes a load asks for, as a
    # released checkpoint does, so loading converts nothing.
    with tempfile.TemporaryDirectory(dir=folder.parent) as fp32:
        pipe.save_pretrained(fp32, safe_serialization=True)
        del pipe, text_encoder, experts
        pipe = WanPipeline.from_pretrained(
            fp32, dtype={"default": torch.bfloat16, "vae": torch.float32})
    pipe.save_pretrained(folder, safe_serialization=True)
    stamp.write_text(json.dumps(attrs.asdict(scale)))
    return _folder_nbytes(folder)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(_WORDS)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="</s>", model_max_length=8)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.safetensors"))


def _folder_nbytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in _weight_files(folder))


# -- the page cache -------------------------------------------------------------------------------


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop the files' clean cached pages (no root needed; pages another
    process maps stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: list[Path]) -> float:
    """The share of the files' pages in the page cache now (``mincore`` over a mapping)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    cached = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        # A private writable mapping (never written) so ctypes can take its address.
        with open(path, "rb") as file, mmap.mmap(file.fileno(), size, flags=mmap.MAP_PRIVATE,
                                                 prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * pages)()
            address = _mapping_address(m)
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            cached += sum(byte & 1 for byte in vector)
            total += pages
    return cached / total if total else 0.0


def _mapping_address(mapping: mmap.mmap) -> int:
    view = (ctypes.c_char * 1).from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def read_files(paths: list[Path], *, readers: int = 4, piece: int = 32 * MiB) -> float:
    """Seconds to read every byte of `paths`, `readers` preads of `piece` bytes at a time (each
    reader into a buffer of its own, reused)."""
    jobs = [(path, offset) for path in paths for offset in range(0, path.stat().st_size, piece)]
    buffers = [bytearray(piece) for _ in range(readers)]

    def read(index: int) -> None:
        for path, offset in jobs[index::readers]:
            with open(path, "rb", buffering=0) as file:
                os.preadv(file.fileno(), [buffers[index]], offset)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, range(readers)))
    return time.perf_counter() - started


# -- one case, in a child process -----------------------------------------------------------------


def run_case(case: str, folder: Path, cache: Path) -> dict:
    """Measure `case` in this process (a fresh child): see the module docstring."""
    import torch

    torch.manual_seed(0)
    files = _weight_files(folder)
    figures: dict[str, object] = {"case": case, "cached_at_start": cached_fraction(files)}
    nbytes = _folder_nbytes(folder)
    if case in ("disk_floor", "page_cache_copy"):
        seconds = read_files(files)
        return {**figures, "seconds": seconds, "read_gb_per_s": nbytes / seconds / 1e9}
    _import_the_libraries()  # their import time is the same for every case: not measured
    before = status_bytes("VmRSS")
    started = time.perf_counter()
    pipe, scheduler = _load(case, folder, cache, nbytes)
    loaded = time.perf_counter() - started
    output = pipe(**_CALL, generator=torch.Generator().manual_seed(0)).frames
    seconds = time.perf_counter() - started
    masters = nbytes if scheduler is None or scheduler.host_options.memory_limit is None \
        else min(nbytes, scheduler.host_options.memory_limit)  # the host tier keeps to its limit
    held = masters + (_device_storage_nbytes(scheduler) if scheduler is not None else 0)
    grown = status_bytes("VmHWM") - before
    if scheduler is not None:
        figures["file_backed_groups"] = sorted(
            name for name in scheduler if scheduler[name].host_master.spill is not None)
        figures["mapped_cache_files"] = _mapped_files_under(cache)
    return {**figures, "seconds": seconds, "loaded_seconds": loaded,
            "peak_rss_growth_bytes": grown,
            "held_bytes": held, "rss_over_held": grown / held,
            "output_sha256": hashlib.sha256(output.contiguous().view(-1).view(
                torch.uint8).numpy().tobytes()).hexdigest()}


def _import_the_libraries() -> None:
    import diffusers
    import transformers

    import residency.adapters.diffusers  # noqa: F401

    for name in ("WanPipeline", "WanTransformer3DModel", "AutoencoderKLWan",
                 "FlowMatchEulerDiscreteScheduler"):
        getattr(diffusers, name)
    getattr(transformers, "UMT5EncoderModel")
    getattr(transformers, "PreTrainedTokenizerFast")


def _load(case: str, folder: Path, cache: Path, nbytes: int):
    from diffusers import DiffusionPipeline

    if case.startswith("diffusers"):
        pipe = DiffusionPipeline.from_pretrained(folder, **load_arguments())
        if case == "diffusers_model_cpu_offload":
            pipe.enable_model_cpu_offload(device="cpu")
        pipe.set_progress_bar_config(disable=True)
        return pipe, None
    from residency.adapters.diffusers import from_pretrained, offload_scheduler

    host = {"residency": None, "residency_reads_at_add": {"background_reads": False},
            "host_tier": {"memory_limit": int(nbytes * 0.7)},
            "residency_cache_write": {"cache_directory": cache},
            "residency_warm_restart": {"cache_directory": cache}}[case]
    pipe = from_pretrained(DiffusionPipeline, folder, None, device="cpu", host=host,
                           **load_arguments())
    pipe.set_progress_bar_config(disable=True)
    return pipe, offload_scheduler(pipe)


def load_arguments() -> dict:
    """As Wan2.2's model card loads it: bf16, the VAE in fp32 (the files' own dtypes, so loading
    converts nothing and the weights stay views of the files)."""
    import torch

    return {"local_files_only": True, "dtype": {"default": torch.bfloat16, "vae": torch.float32}}


def _device_storage_nbytes(scheduler) -> int:
    """On the CPU the device storage is host memory too: the largest exclusive group, and every
    resident-policy group."""
    groups = [scheduler[name] for name in scheduler]
    exclusive = [g.nbytes for g in groups if g.policy.value == "exclusive"]
    return max(exclusive, default=0) + sum(g.nbytes for g in groups
                                           if g.policy.value != "exclusive")


def _mapped_files_under(folder: Path) -> int:
    """How many distinct files under `folder` this process maps now (/proc/self/maps): the
    warm-restart cache files a warm start serves its masters from."""
    inside = os.path.realpath(folder) + os.sep
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    paths = {f[5].strip() for f in fields if len(f) == 6}  # the sixth field: the mapped file
    return sum(1 for path in paths if path.startswith(inside))


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    return proc_number("/proc/self/status", field) * 1024


# -- the whole run --------------------------------------------------------------------------------


def measure(case: str, folder: Path, cache: Path) -> dict:
    """One case in a fresh child process, the page cache dropped first where the case is cold."""
    files = _weight_files(folder)
    if case in COLD:
        drop_page_cache(files)
    else:
        read_files(files)  # warm: every page cached
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "case.json"
        command = [sys.executable, "-m", "benchmarks.cold_start", "--case", case,
                   "--folder", str(folder), "--cache", str(cache), "--case-out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            return {"case": case, "failed": done.stderr[-2000:]}
        return json.loads(out.read_text())


def _table(rows: list[dict], floor: float | None) -> str:
    lines = ["| case | seconds | x disk floor | ready s | cached at start | "
             "peak RSS growth / held |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['case']} | failed | | | | |")
            continue
        ratio = f"{row['seconds'] / floor:.2f}" if floor else ""
        rss = f"{row['rss_over_held']:.2f}" if "rss_over_held" in row else ""
        ready = f"{row['loaded_seconds']:.2f}" if "loaded_seconds" in row else ""
        lines.append(f"| {row['case']} | {row['seconds']:.2f} | {ratio} | {ready} | "
                     f"{row['cached_at_start']:.0%} | {rss} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_start",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="wan",
                        help="the pipeline's size (default: wan, ~3.1 GiB; tiny: a dry run)")
    parser.add_argument("--folder", type=Path, default=None,
                        help="where the pipeline is saved (default: a folder under /var/tmp)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="the cases to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for cpu-cold-start.json (default: benchmarks/results)")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--case-out", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.case is not None:  # a child: one case
        args.case_out.write_text(json.dumps(run_case(args.case, args.folder, args.cache)))
        return 0
    folder = args.folder or Path(tempfile.gettempdir().replace("/tmp", "/var/tmp")) / \
        f"residency-cold-start-{args.scale}"
    args.out.mkdir(parents=True, exist_ok=True)
    nbytes = build_folder(folder, SCALES[args.scale])
    with tempfile.TemporaryDirectory(dir=folder.parent) as cache:
        rows = [measure(case, folder, Path(cache)) for case in args.cases]
    floor = next((r["seconds"] for r in rows if r["case"] == "disk_floor" and "seconds" in r),
                 None)
    digests = {r["output_sha256"] for r in rows if "output_sha256" in r}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "cpus": os.cpu_count(), "scale": args.scale, "weights_bytes": nbytes,
              "outputs_identical": len(digests) <= 1, "rows": rows}
    (args.out / "cpu-cold-start.json").write_text(json.dumps(result, indent=2) + "\n")
    print(_table(rows, floor))
    return 0 if result["outputs_identical"] and not any("failed" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
