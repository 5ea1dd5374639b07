"""``make demo`` end to end (1 s windows): a region fails, the leader dies, it comes back."""

from __future__ import annotations

import re

import pytest

from controlplane import demo


def test_the_fleet_demo_fails_over_survives_the_leader_and_recovers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo.main(["--window-s", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"eu-west +failed +strikes 3 +weight +0\.0 %", out)
    assert "eu-west's traffic moves to backup eu-north" in out
    assert "DNS answers  eu: eu-north 100%" in out
    leaders = re.findall(r"leader (ctl-[ab])", out)
    assert len(set(leaders)) == 2  # the second replica took over
    assert "failed -> recovering" in out and "recovering -> healthy" in out
    floors = [float(f) for f in re.findall(r"eu-north .* floor +([\d.]+)", out)]
    assert max(floors) >= 2.0  # half of eu-west's 4 nodes
    capacities = [float(c) for c in re.findall(r"eu-north .* capacity +([\d.]+)", out)]
    assert max(capacities) >= 2.0  # pre-warmed by the simulator actuator from 1 node
