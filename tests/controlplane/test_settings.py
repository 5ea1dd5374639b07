"""meridian-controller refuses bad settings at start, naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CONTROLLER = [sys.executable, "-m", "controlplane.cli"]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CONTROLLER, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--strikes", "0"], "failover.strikes"),
        (["--window-s", "-5"], "failover.window_s"),
        (["--prewarm-fraction", "1.5"], "failover.prewarm_fraction"),
        (["--etcd", "localhost"], "http://host:2379"),
        (["--config", "/nonexistent.toml"], "does not exist"),
    ],
)
def test_bad_flags(args: list[str], needle: str) -> None:
    done = _run(args)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        (
            '[[regions]]\nid = "eu-west"\ngeo = "eu"\nresidency = ["eu"]\nbackups = ["us-east"]\n'
            '[[regions]]\nid = "us-east"\ngeo = "us"\n',
            "us-east lacks residency ['eu'] that eu-west requires",
        ),
        (
            '[[regions]]\nid = "eu-west"\ngeo = "eu"\nbackups = ["mars-1"]\n',
            "unknown region 'mars-1'",
        ),
        ('[[regions]]\nid = "EU West"\ngeo = "eu"\n', "regions[0].id"),
        ("[failover]\nramp = [0.5, 0.25, 1.0]\n", "increasing"),
        ("[failover]\nramp = [0.5, 0.9]\n", "end at 1.0"),
        ("[api]\nbody_timeout_s = 0\n", "api.body_timeout_s"),
        ("[server]\nmax_connections_per_ip = -1\n", "server.max_connections_per_ip"),
        (  # the fault probe's flapping geography: stale before two heartbeats
            "[failover]\nstatus_stale_s = 10\n",
            "failover.status_stale_s (10 s) must be at least twice failover.agent_heartbeat_s",
        ),
    ],
)
def test_bad_files(tmp_path: Path, toml: str, needle: str) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(toml)
    done = _run(["--config", str(config)])
    assert done.returncode == 2
    assert needle in done.stderr
