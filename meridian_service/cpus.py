"""How many CPUs this process may use: the cores it may run on, capped by its cgroup's CPU quota.

A container's CPU limit (Kubernetes ``resources.limits.cpu``, ``docker run --cpus``) is a CFS
quota, not an affinity: a pod limited to 2 CPUs on a 64-core node still sees 64 cores in
``os.sched_getaffinity``.  One worker per core would start 64 workers there, each with its own
prefix index (about 65 MiB at its default size) and event loop, in a pod of 2 CPUs and 1 GiB
(deploy/terraform's default agent pod): throttled, then killed for memory.  The JVM and Go
(since 1.25) read the quota for the same reason.

The quota is the lowest along the process's cgroup and its ancestors, read from the mounts the
process sees (``/proc/self/mountinfo``, ``/proc/self/cgroup``):

* cgroup v2: ``cpu.max``, ``"<quota> <period>"`` or ``"max <period>"`` (none);
* cgroup v1: the ``cpu`` controller's ``cpu.cfs_quota_us`` (``-1``: none) over
  ``cpu.cfs_period_us``.

A quota of 1.5 CPUs allows 2 processes (rounded up: each may use what the others leave).  What
cannot be read counts as no quota.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import NamedTuple

_OCTAL = re.compile(r"\\([0-7]{3})")


class Mount(NamedTuple):
    """A cgroup hierarchy as mounted: its version, the cgroup path at the mount's root, where."""

    version: int  # 1 or 2
    root: str  # the cgroup path the mount point shows (not "/" inside a cgroup namespace)
    point: Path


def usable(proc: Path = Path("/proc/self")) -> int:
    """The CPUs this process may use: its affinity's cores, at most the quota rounded up; 1 at
    least."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cpu_quota(proc)
    if quota is None:
        return max(1, cores or 1)
    return max(1, min(cores or 1, math.ceil(quota - 1e-9)))


def cpu_quota(proc: Path = Path("/proc/self")) -> float | None:
    """The lowest CPU quota (in CPUs) on the process's cgroup and its ancestors; None when there
    is none, or none could be read."""
    try:
        mountinfo = (proc / "mountinfo").read_text()
        membership = (proc / "cgroup").read_text()
    except OSError:
        return None
    paths = cgroup_paths(membership)
    found: list[float] = []
    for mount in cgroup_mounts(mountinfo):
        path = paths.get(mount.version if mount.version == 2 else "cpu")
        if path is None:
            continue
        for directory in _up_to_mount(mount, path):
            quota = _read_quota(directory, mount.version)
            if quota is not None:
                found.append(quota)
    return min(found) if found else None


def cgroup_mounts(mountinfo: str) -> list[Mount]:
    """The cgroup v2 mounts and the v1 mounts of the ``cpu`` controller in a mountinfo text."""
    out = []
    for line in mountinfo.splitlines():
        # id parent major:minor root point options [optional...] - fstype source super-options
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        if fstype == "cgroup2":
            out.append(Mount(2, root, point))
        elif fstype == "cgroup" and "cpu" in options:
            out.append(Mount(1, root, point))
    return out


def cgroup_paths(membership: str) -> dict[int | str, str]:
    """``/proc/<pid>/cgroup``: the v2 path (key 2) and the v1 ``cpu`` controller's (key "cpu")."""
    out: dict[int | str, str] = {}
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            out[2] = path
        elif "cpu" in controllers.split(","):
            out["cpu"] = path
    return out


def _up_to_mount(mount: Mount, path: str) -> list[Path]:
    """The directories of ``path``'s cgroup and of its ancestors, within the mount."""
    root = mount.root.rstrip("/")
    if path == mount.root or path.startswith(root + "/"):
        relative = path[len(root) :].strip("/")
    else:  # not under the mount's root (another namespace's view): the mount's own cgroup
        relative = ""
    here = mount.point / relative if relative else mount.point
    out = [here]
    while here != mount.point and here.parent != here:
        here = here.parent
        out.append(here)
    return out


def _read_quota(directory: Path, version: int) -> float | None:
    try:
        if version == 2:
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or "100000")
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        if quota_us <= 0:
            return None
        return quota_us / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)
