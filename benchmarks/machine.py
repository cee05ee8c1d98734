"""The facts every figure is quoted with: CPU model, cores, torch version, accelerator, date.

    describe_machine()   # {"cpu_model": "...", "cores": 2, "torch": "2.13.0+cpu", "date": "2026-11-30", ...}
"""

from __future__ import annotations

import datetime
import os
import platform

import torch

__all__ = ["describe_machine", "proc_number"]


def describe_machine() -> dict:
    """CPU model, usable cores, torch and Python versions, accelerator name, today's date (UTC)."""
    info = {
        "cpu_model": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "accelerator": None,
    }
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        info["accelerator"] = accelerator.type
        if accelerator.type == "cuda":
            info["accelerator_name"] = torch.cuda.get_device_name()
    return info


def proc_number(path: str, field: str) -> int:
    """The number after ``field:`` in the /proc file `path`, in that file's unit (kB in
    ``/proc/meminfo``, ``/proc/self/status`` and ``smaps_rollup``; bytes in ``/proc/self/io``).

        proc_number("/proc/self/status", "VmHWM") * 1024     # peak resident set, bytes
    """
    with open(path) as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in {path}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
