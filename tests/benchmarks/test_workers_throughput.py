"""benchmarks/workers_throughput.py's routing measure for static nodes: the prompt affinity,
from the request ids each node logged (``g<prompt>-<n>``; the agent's own requests log none);
and ``--core-share``'s cgroups, which hold each worker process to its share of a core (one
group each, also over several agents: ``--independent``); and how ``--independent`` sums its wrk
processes' results."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import workers_throughput


def test_every_prompt_on_one_node_is_an_affinity_of_one() -> None:
    logs = [["g0-1", "g0-3", "-", "g2-5"], ["g1-2", "g1-4", "-"]]
    assert workers_throughput.prompt_affinity(logs) == 1.0


def test_a_prompt_split_over_two_nodes_counts_its_larger_share() -> None:
    # g0: 3 on node 0, 1 on node 1 -> 3 of 4; g1: 2 of 2 -> 5 of 6 in all
    logs = [["g0-1", "g0-3", "g0-5"], ["g0-7", "g1-2", "g1-4"]]
    assert workers_throughput.prompt_affinity(logs) == pytest.approx(5 / 6)


def test_requests_sent_to_either_node_at_random_are_about_one_half() -> None:
    rng = random.Random(7)
    logs: list[list[str]] = [[], []]
    for n in range(1, 8001):
        logs[rng.randrange(2)].append(f"g{n % 8}-{n}")
    assert workers_throughput.prompt_affinity(logs) == pytest.approx(0.5, abs=0.02)


def test_no_request_of_the_load_is_no_measure() -> None:
    assert workers_throughput.prompt_affinity([["-", "-"], []]) is None


_CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(
    not os.access(_CPU_CGROUP / "cgroup.procs", os.W_OK),
    reason="needs a writable cgroup v1 cpu controller (root)",
)
def test_core_share_holds_each_worker_process_to_its_quota() -> None:
    # a parent that forks two children spinning on the CPU, as the supervisor forks workers
    spin = (
        "import os, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        while True: pass\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", spin])
    share = workers_throughput.CoreShare(0.2, period_ms=10)
    try:
        deadline = time.monotonic() + 10
        while len(children := workers_throughput._children(parent.pid)) < 2:
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.05)
        share.apply(parent.pid, 2)
        before = [_cpu_s(pid) for pid in children]
        t0 = time.monotonic()
        time.sleep(1.0)
        used = [_cpu_s(pid) - b for pid, b in zip(children, before, strict=True)]
        elapsed = time.monotonic() - t0
        # unthrottled, each would take a whole core (or half of one on a 1-core host)
        assert all(u / elapsed < 0.3 for u in used), used
        assert share.throttled()[0] > 0
    finally:
        for pid in workers_throughput._children(parent.pid):
            os.kill(pid, signal.SIGKILL)  # orphans once the parent is gone: init reaps them
        parent.kill()
        parent.wait()
        time.sleep(0.2)
        share.remove()
    assert not list(_CPU_CGROUP.glob(f"meridian-bench-{os.getpid()}-w*"))


def test_core_share_refuses_a_quota_below_a_millisecond() -> None:
    if not (_CPU_CGROUP / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 cpu controller here")
    with pytest.raises(SystemExit, match="1 ms or more"):
        workers_throughput.CoreShare(0.05, period_ms=10)


def test_several_wrk_results_sum_as_one() -> None:
    a = {"requests": 1000, "duration_us": 10_000_000, "status_errors": 1, "socket_errors": 0,
         "p50_us": 2_000, "p99_us": 9_000}  # fmt: skip
    b = {"requests": 600, "duration_us": 12_000_000, "status_errors": 0, "socket_errors": 2,
         "p50_us": 3_000, "p99_us": 7_000}  # fmt: skip
    total = workers_throughput.sum_wrk([a, b])
    assert total["requests"] == 1600
    assert total["requests_per_s"] == pytest.approx(100 + 50)  # each over its own duration
    assert total["duration_us"] == 12_000_000
    assert (total["status_errors"], total["socket_errors"]) == (1, 2)
    assert (total["p50_us"], total["p99_us"]) == (3_000, 9_000)


@pytest.mark.skipif(
    not os.access(_CPU_CGROUP / "cgroup.procs", os.W_OK),
    reason="needs a writable cgroup v1 cpu controller (root)",
)
def test_core_share_gives_each_of_several_agents_a_group_of_its_own() -> None:
    # --independent applies the share once an agent: each process gets its whole quota (one
    # group shared by both would hold them to half of it each)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    share = workers_throughput.CoreShare(0.3, period_ms=10)
    try:
        for p in spinners:
            share.apply(p.pid, 1)
        time.sleep(0.3)
        before = [_cpu_s(p.pid) for p in spinners]
        t0 = time.monotonic()
        time.sleep(1.0)
        used = [_cpu_s(p.pid) - b for p, b in zip(spinners, before, strict=True)]
        elapsed = time.monotonic() - t0
        assert all(0.2 < u / elapsed < 0.4 for u in used), used
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        time.sleep(0.2)
        share.remove()
    assert not list(_CPU_CGROUP.glob(f"meridian-bench-{os.getpid()}-w*"))
