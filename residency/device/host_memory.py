"""How much host memory this process can still take: the kernel's figure and its cgroup's limit.

    memory = host_memory()
    memory.available     # bytes: the smaller of MemAvailable and the cgroup's room, or None
    memory.describe()    # "1.1 GiB (MemAvailable 20.3 GiB; cgroup /job limit 1.2 GiB, 96.0 MiB used)"

[Note: the limit that kills]
Inside a container the host's ``MemAvailable`` is not what the process may use: its memory
cgroup's limit is (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and past it the
kernel's OOM killer ends the process - no `MemoryError` is raised, since Linux overcommits.  So
the room this process has is the smallest, over its cgroup and each ancestor with a limit, of
the limit less what the cgroup uses, its inactive file cache counted as free (the kernel
reclaims it before it kills); and ``MemAvailable`` where that is smaller.  A cgroup whose path the
process cannot see (another cgroup namespace) is read at the root of the mount it can see.
Anything unreadable counts as no limit: the figure only ever refuses work, never allows more.
The packer asks before it builds a master (`residency.host.packing`), and the main job's size
check and the CPU's "free device memory" read the same figure.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs

__all__ = ["HostMemory", "host_memory"]

#: A cgroup v1 limit at or above this is "no limit" (the kernel writes 2**63 rounded to a page).
_UNLIMITED = 2**62
#: /proc/self/cgroup: the unified (v2) hierarchy's line, and a v1 line naming the memory
#: controller; the group's path is captured.
_V2_MEMBER = re.compile(r"^0::(.*)$", re.M)
_V1_MEMBER = re.compile(r"^\d+:(?:[^:\n]*,)?memory(?:,[^:\n]*)?:(.*)$", re.M)
#: /proc/self/mountinfo: the root and mount point of a cgroup2 mount, and of a v1 cgroup mount
#: of the memory controller (named in its super options).
_V2_MOUNT = re.compile(r"^\S+ \S+ \S+ (\S+) (\S+) [^\n]*? - cgroup2 \S+ \S+$", re.M)
_V1_MOUNT = re.compile(
    r"^\S+ \S+ \S+ (\S+) (\S+) [^\n]*? - cgroup \S+ (?:\S*,)?memory(?:,\S*)?$", re.M)


@attrs.frozen(kw_only=True)
class HostMemory:
    """What the host and the process's memory cgroup say about memory (bytes; None: not said)."""

    #: ``MemAvailable`` of /proc/meminfo.
    meminfo_available: int | None
    #: The cgroup whose limit leaves the least room, its limit and its use (file cache that the
    #: kernel can reclaim not counted as used); all None when no cgroup sets a limit.
    cgroup: str | None = None
    limit: int | None = None
    usage: int | None = None

    @property
    def cgroup_room(self) -> int | None:
        """Bytes the limiting cgroup has left, or None (no limit)."""
        return None if self.limit is None else max(0, self.limit - (self.usage or 0))

    @property
    def available(self) -> int | None:
        """Bytes this process can still take: the smaller of the two figures (None: neither)."""
        figures = [f for f in (self.meminfo_available, self.cgroup_room) if f is not None]
        return min(figures) if figures else None

    def room(self) -> tuple[int | None, str]:
        """(bytes the process can still take, what says so: "the memory cgroup <path>" or
        "MemAvailable"), the smaller figure; (None, "") when neither is known."""
        cgroup, available = self.cgroup_room, self.meminfo_available
        if cgroup is not None and (available is None or cgroup <= available):
            return cgroup, f"the memory cgroup {self.cgroup}"
        return (available, "MemAvailable") if available is not None else (None, "")

    def describe(self) -> str:
        """The figures, as a refusal names them."""
        parts = []
        if self.meminfo_available is not None:
            parts.append(f"MemAvailable {_gib(self.meminfo_available)}")
        if self.limit is not None:
            parts.append(f"cgroup {self.cgroup} limit {_gib(self.limit)}, "
                         f"{_gib(self.usage or 0)} used")
        shown = "unknown" if self.available is None else _gib(self.available)
        return f"{shown} ({'; '.join(parts) or 'the kernel says nothing'})"


def host_memory(root: Path = Path("/")) -> HostMemory:
    """What this process can still take now (see [Note: the limit that kills]); `root` is where
    /proc and /sys are read from (a test's copy of them)."""
    available = _meminfo_available(root / "proc" / "meminfo")
    tightest = None
    for directory, limit, usage in _limited_cgroups(root):
        if tightest is None or limit - usage < tightest[1] - tightest[2]:
            tightest = (directory, limit, usage)
    if tightest is None:
        return HostMemory(meminfo_available=available)
    directory, limit, usage = tightest
    return HostMemory(meminfo_available=available, cgroup=directory, limit=limit, usage=usage)


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _limited_cgroups(root: Path):
    """(directory, limit, usage) of the process's memory cgroup and each ancestor with a limit."""
    for directory, version in _cgroup_directories(root):
        while True:
            figures = _v2_figures(directory) if version == 2 else _v1_figures(directory)
            if figures is not None:
                yield (str(directory), *figures)
            if directory.parent == directory or not (directory.parent / "cgroup.procs").exists():
                break
            directory = directory.parent


def _cgroup_directories(root: Path):
    """The process's memory cgroup directory in each hierarchy that can limit memory.  The two
    files are matched in C (regular expressions): every registration reads them, and the
    interrupt sweeps count each Python line it runs."""
    try:
        memberships = (root / "proc" / "self" / "cgroup").read_text()
        mounts = (root / "proc" / "self" / "mountinfo").read_text()
    except OSError:
        return
    paths = {version: found[-1] for version, found in (
        (2, _V2_MEMBER.findall(memberships)), (1, _V1_MEMBER.findall(memberships))) if found}
    found = [(2, mount) for mount in _V2_MOUNT.findall(mounts) if 2 in paths] + \
        [(1, mount) for mount in _V1_MOUNT.findall(mounts) if 1 in paths]
    for version, (mounted_root, mount_point) in found:
        mount_point = root / mount_point.lstrip("/")
        inside = os.path.relpath(paths[version], mounted_root)
        directory = mount_point / inside if not inside.startswith("..") else mount_point
        yield (directory if directory.is_dir() else mount_point), version


def _v2_figures(directory: Path) -> tuple[int, int] | None:
    limit = _read(directory / "memory.max")
    if limit is None or limit == "max":
        return None
    return int(limit), _used(directory, "memory.current", "inactive_file")


def _v1_figures(directory: Path) -> tuple[int, int] | None:
    limit = _read(directory / "memory.limit_in_bytes")
    if limit is None or int(limit) >= _UNLIMITED:
        return None
    return int(limit), _used(directory, "memory.usage_in_bytes", "total_inactive_file")


def _used(directory: Path, usage_file: str, reclaimable: str) -> int:
    """What the cgroup uses, less the file cache the kernel reclaims before it kills."""
    usage = int(_read(directory / usage_file) or 0)
    stat = _read(directory / "memory.stat") or ""
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key == reclaimable and value.strip().isdigit():
            return max(0, usage - int(value))
    return usage


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
