"""meridian_service.cpus: the CPUs a process may use, its cgroup's CPU quota included.

The kernel's own cgroups where this machine lets a test make them (root, cgroup v1's ``cpu``
controller: the development VM has both), and the files of the layouts it cannot make here
(cgroup v2 in a container's namespace, a Kubernetes pod's ancestors, Docker on v1), written as
the kernel writes them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meridian_service import cpus

# -- the kernel's file formats ---------------------------------------------------------------


def _proc(tmp_path: Path, mountinfo: str, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "cgroup").write_text(cgroup)
    return proc


def _write(path: Path, cpu_max: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cpu.max").write_text(cpu_max + "\n")


def test_a_container_s_v2_quota_is_read_where_its_namespace_mounts_it(tmp_path: Path) -> None:
    """In a container with its own cgroup namespace the process is in ``/`` and the mount is
    its cgroup: ``cpu.max`` there is the pod's limit, rounded up to whole processes."""
    point = tmp_path / "sys" / "fs" / "cgroup"
    _write(point, "150000 100000")
    proc = _proc(
        tmp_path,
        f"25 1 0:23 / / rw - overlay overlay rw\n"
        f"30 25 0:26 / {point} ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n",
        "0::/\n",
    )
    assert cpus.cpu_quota(proc) == 1.5
    assert cpus.usable(proc) == min(2, len(os.sched_getaffinity(0)))


def test_the_lowest_quota_on_the_way_to_the_root_counts(tmp_path: Path) -> None:
    """Without a namespace the process's cgroup is a path under the mount; a pod's limit sits on
    the pod's cgroup, above the container's (no quota: ``max``)."""
    point = tmp_path / "cgroup"
    pod = point / "kubepods.slice" / "kubepods-pod1.slice"
    container = pod / "cri-containerd-abc.scope"
    _write(point / "kubepods.slice", "max 100000")
    _write(pod, "200000 100000")
    _write(container, "max 100000")
    mountinfo = f"30 25 0:26 / {point} rw,nosuid - cgroup2 cgroup2 rw\n"
    membership = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n"
    proc = _proc(tmp_path, mountinfo, membership)
    assert cpus.cpu_quota(proc) == 2.0
    (container / "cpu.max").write_text("50000 100000\n")
    assert cpus.cpu_quota(proc) == 0.5
    assert cpus.usable(proc) == 1


def test_docker_on_v1_reads_the_cpu_controller_s_mount(tmp_path: Path) -> None:
    """cgroup v1 (``cpu,cpuacct`` mounted together, the mount showing the container's cgroup):
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``; ``-1`` is no quota; other controllers and
    a mount point with a space (``\\040``) are read as the kernel writes them."""
    point = tmp_path / "cpu acct"
    point.mkdir()
    (point / "cpu.cfs_quota_us").write_text("300000\n")
    (point / "cpu.cfs_period_us").write_text("100000\n")
    escaped = str(point).replace(" ", "\\040")
    mountinfo = (
        f"34 30 0:30 /docker/abc {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
        f"35 30 0:31 /docker/abc {escaped} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    )
    proc = _proc(tmp_path, mountinfo, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cpus.cpu_quota(proc) == 3.0
    (point / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.cpu_quota(proc) is None
    assert cpus.usable(proc) == len(os.sched_getaffinity(0))


def test_what_cannot_be_read_is_no_quota(tmp_path: Path) -> None:
    assert cpus.cpu_quota(tmp_path / "no-such-proc") is None
    proc = _proc(tmp_path, "30 25 0:26 / /nowhere rw - cgroup2 cgroup2 rw\n", "0::/x\n")
    assert cpus.cpu_quota(proc) is None
    (tmp_path / "garbled").mkdir()
    _write(tmp_path / "garbled", "lots 100000")
    proc = tmp_path / "proc"
    (proc / "mountinfo").write_text(f"30 25 0:26 / {tmp_path / 'garbled'} rw - cgroup2 c rw\n")
    assert cpus.cpu_quota(proc) is None


# -- the kernel's cgroups --------------------------------------------------------------------


@pytest.fixture
def cpu_cgroup() -> Iterator[Callable[[str, int], Path]]:
    """``make(name, quota_us)``: a cgroup v1 ``cpu`` cgroup of this test (nested names with
    ``/``), removed afterwards with whatever ran in it."""
    mounts = cpus.cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    v1 = [m for m in mounts if m.version == 1 and os.access(m.point, os.W_OK)]
    if os.geteuid() != 0 or not v1:
        pytest.skip("needs root and cgroup v1's cpu controller (the development VM has both)")
    base = v1[0].point / f"meridian-test-{os.getpid()}"
    made: list[Path] = []

    def make(name: str, quota_us: int) -> Path:
        path = base / name
        missing = [p for p in (path, *path.parents) if p.is_relative_to(base) and not p.exists()]
        for directory in reversed(missing):
            directory.mkdir()
            made.append(directory)
        (path / "cpu.cfs_period_us").write_text("100000")
        (path / "cpu.cfs_quota_us").write_text(str(quota_us))
        return path

    yield make
    for path in reversed(made):
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _in(cgroup: Path, *argv: str) -> list[str]:
    """``argv`` run in ``cgroup`` (the shell joins it, then becomes the command)."""
    procs = cgroup / "cgroup.procs"
    return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]


def test_a_real_cgroup_s_quota_and_its_parent_s_cap_the_cpus(
    cpu_cgroup: Callable[[str, int], Path],
) -> None:
    """Half a CPU on the parent, none on the child the process runs in: the parent's counts."""
    cpu_cgroup("pod", 50_000)
    child = cpu_cgroup("pod/container", -1)
    code = "from meridian_service import cpus; print(cpus.cpu_quota(), cpus.usable())"
    out = subprocess.run(
        _in(child, sys.executable, "-c", code), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["0.5", "1"]


def test_workers_0_in_a_one_cpu_cgroup_runs_one_process(
    cpu_cgroup: Callable[[str, int], Path], tmp_path: Path
) -> None:
    """``meridian-agent --workers 0`` (one per CPU) under a 1-CPU quota runs one process, no
    supervisor; on this machine's cores without the quota, one worker per core."""
    one_cpu = cpu_cgroup("agent", 100_000)
    argv = [sys.executable, "-m", "regional_agent.cli", "--port", "0", "--workers", "0"]
    argv += ["--node", "http://127.0.0.1:9", "--log-level", "WARNING"]

    def processes(command: list[str]) -> int:
        log = (tmp_path / "agent.log").open("w")
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("READY "), (line, (tmp_path / "agent.log").read_text())
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            return len(children) or 1  # a supervisor's workers, else the one process
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            proc.stdout.close()  # type: ignore[union-attr]
            log.close()

    assert processes(_in(one_cpu, *argv)) == 1
    cores = len(os.sched_getaffinity(0))
    if cores > 1 and cpus.cpu_quota() is None:
        assert processes(argv) == cores
