"""Every fenced ``meridianctl`` line of docs/runbooks/*.md, run in order against a live local
stack (real etcd, a real controller, simulated regions): each must exit 0."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.meridianctl.conftest import Ctl
from tests.meridianctl.stack import Stack

RUNBOOKS = Path(__file__).resolve().parents[2] / "docs" / "runbooks"
_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
# what must hold before a runbook starts (the situation it is written for)
SETUP: dict[str, list[str]] = {
    "failback.md": ["failover", "--from", "eu-west", "--reason", "INC-1234", "--yes"],
}


def commands(page: Path) -> list[list[str]]:
    out = []
    for block in _FENCE.findall(page.read_text()):
        for line in block.splitlines():
            if line.strip().startswith("meridianctl "):
                out.append(shlex.split(line, comments=True)[1:])
    return out


PAGES = sorted(p.name for p in RUNBOOKS.glob("*.md") if p.name != "README.md")


def test_every_runbook_is_tested_and_every_step_is_a_meridianctl_command() -> None:
    assert set(PAGES) == {
        "regional-outage.md",
        "planned-maintenance.md",
        "failback.md",
        "dns-not-updating.md",
        "etcd-degraded.md",
        "no-leader.md",
        "agent-down.md",
        "node-ejections.md",
        "prefix-relay.md",
        "worker-exits.md",
        "ttft-slo.md",
        "geo-last-region.md",
    }
    for name in PAGES:
        page = RUNBOOKS / name
        assert len(commands(page)) >= 3, name
        for block in _FENCE.findall(page.read_text()):
            for line in block.splitlines():
                assert not line.strip() or line.startswith("meridianctl "), (name, line)


@pytest.mark.parametrize("name", PAGES)
async def test_runbook_commands_run_against_a_live_stack(name: str, stack: Stack, ctl: Ctl) -> None:
    if name in SETUP:
        ran = await ctl(*SETUP[name], role="admin")
        assert ran.code == 0, ran.err
    for args in commands(RUNBOOKS / name):
        ran = await ctl(*args, role="admin")
        assert ran.code == 0, f"{name}: meridianctl {shlex.join(args)}\n{ran.out}\n{ran.err}"
