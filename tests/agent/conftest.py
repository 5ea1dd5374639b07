"""Fixtures for agent tests: simulated nodes as separate processes (for tests that kill one).

``start_agent`` (an in-process agent in front of any nodes) lives in tests/conftest.py, shared
with the real-vLLM tests; its helpers are re-exported here for the tests that import them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.support.agent import ADMIN, ADMIN_TOKEN, FAST, AgentFactory, AgentHandle

__all__ = [
    "ADMIN",
    "ADMIN_TOKEN",
    "FAST",
    "AgentFactory",
    "AgentHandle",
    "SimProcess",
    "stop_process",
]


@dataclass
class SimProcess:
    url: str
    proc: subprocess.Popen[str]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def sim_processes() -> Iterator[Callable[..., list[SimProcess]]]:
    """``nodes = sim_processes(4, profile="cpu-tiny")``: real meridian-sim processes."""
    started: list[SimProcess] = []

    def start(n: int, *, profile: str = "cpu-tiny", time_scale: float = 5.0) -> list[SimProcess]:
        out = []
        for i in range(n):
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meridian_sim.cli",
                    "node",
                    "--port",
                    "0",
                    "--profile",
                    profile,
                    "--time-scale",
                    str(time_scale),
                    "--seed",
                    str(i),
                    "--log-level",
                    "WARNING",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                proc.kill()
                raise RuntimeError(f"meridian-sim did not start: {line!r}")
            sim = SimProcess(url=line.split()[1], proc=proc)
            started.append(sim)
            out.append(sim)
        return out

    yield start
    for sim in started:
        stop_process(sim.proc, timeout_s=10)


def stop_process(proc: subprocess.Popen[str], *, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL past ``timeout_s``; and its stdout closed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
