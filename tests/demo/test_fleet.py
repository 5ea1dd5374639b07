"""``make demo`` end to end (1 s windows): every channel secured, a region fails and its backup
scales from the floor to its load, the leader dies, it comes back."""

from __future__ import annotations

import re

import pytest

from meridian_demo import fleet as demo


def test_the_fleet_demo_fails_over_survives_the_leader_and_recovers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo.main(["--window-s", "1"]) == 0
    out = capsys.readouterr().out
    # the fleet page of each replica, and the token to paste there
    page = r"https?://127\.0\.0\.1:\d+/ui/"
    assert re.search(rf"fleet page: {page} \(ctl-a\), {page} \(ctl-b\)", out), out[:3000]
    assert f"paste the operator token {demo.OPERATOR_TOKEN}" in out
    # step 0: every channel secured (real etcd with TLS, client certificates and auth)
    assert "+ auth enabled" in out
    step0 = out.split("== 0.", 1)[1].split("== 1.", 1)[0]
    for what in ("us-east's status", "the controller's plan", "the leader key"):
        assert (
            f"eu-west's agent certificate {'takes' if 'leader' in what else 'writes'} {what}: "
            "refused (permission denied)" in step0
        ), step0
    assert "writes its own status: allowed" in step0
    assert re.search(r"without a key: 401\n.*with a wrong key: 401\n.*tenant's key: 200", step0)
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
    # eu-north's autoscaler (GET /admin/autoscaler): the floor, then its own load above it
    scaler = re.compile(
        r"eu-north autoscaler  floor ([\d.]+) \(controller\)  target ([\d.]+) nodes  serving "
        r"(\d+) .*?(?:last (up|down) \d+ s ago: (.*))?$"
    )
    rows = [m.groups() for line in out.splitlines() if (m := scaler.search(line))]
    step1 = out.split("== 1.", 1)[1].split("== 2.", 1)[0]
    assert re.search(r"eu-north autoscaler  floor 2 \(controller\)  target 2 nodes", step1)
    failover = out.split("== 2.", 1)[1].split("== 4.", 1)[0]
    above = [r for r in (scaler.search(x) for x in failover.splitlines()) if r]
    assert any(
        float(m[2]) >= 4 > float(m[1]) and m[4] == "up" and "forecast" in m[5] for m in above
    ), failover  # eu's whole load: nodes above the floor, ordered by the forecast
    assert any(int(m[3]) >= 4 for m in above)  # and they serve
    assert any(kind == "down" for *_, kind, _ in rows)  # back towards the floor afterwards
    assert "Done. Requests served:" in out and "went to the next DNS answer" in out
    # DNS steering through a real BIND9: what `dig -b 127.0.0.2` (the eu view) is told
    before_operator = out.split("== 5.", 1)[0]
    eu = [line for line in before_operator.splitlines() if "dig -b 127.0.0.2" in line]
    both = "A 192.0.2.11 (eu-west), 192.0.2.12 (eu-north)"
    assert both in eu[0]  # steady: both eu regions, SRV weights by capacity
    for line in eu:  # a region's weight is its share, never repeated: they sum to 100
        assert sum(int(w) for w in re.findall(r"eu-\w+ 10 (\d+)", line)) == 100, line
    steady = [line for line in eu if line in step1]
    assert any("SRV eu-north 10 33, eu-west 10 67" in line for line in steady), steady  # 2 : 4
    failed_over = [i for i, line in enumerate(eu) if "A 192.0.2.12 (eu-north)   SRV" in line]
    assert failed_over, "the eu answer never moved to eu-north alone"
    assert "SRV eu-north 10 100" in eu[failed_over[0]]
    ramp = [int(w) for line in eu[failed_over[0] :] for w in re.findall(r"eu-west 10 (\d+)", line)]
    assert any(0 < w < 25 for w in ramp), ramp  # eu-west's SRV weight ramps back ...
    assert ramp[-1] > 25 and ramp == sorted(ramp)  # ... to its capacity share
    us = [line for line in out.splitlines() if "dig -b 127.0.0.1" in line]
    assert all("A 198.51.100.13 (us-east)" in line for line in us)  # the us view: us-east
    # step 5: an operator with meridianctl against the admin API
    step5 = out.split("== 5.", 1)[1]
    assert "[viewer] $ meridianctl status" in step5
    assert re.search(r"eu-west +healthy +0 ", step5)  # the status table
    assert "(dry run: nothing changed)" in step5
    assert "failover eu-west: did change" in step5
    refused = step5.split('failback eu-west --reason "a viewer tries"', 1)[1]
    assert "needs role operator" in refused.split("(exit", 1)[0] and "(exit 5)" in refused
    assert "failback eu-west: did change" in step5
    assert re.search(r"event state +eu-west +recovering -> healthy", step5)  # ramped back
    audit = step5.split("meridianctl audit", 1)[1]
    assert re.search(r"demo-operator +failover +eu-west +applied", audit)
    assert re.search(r"demo-operator +failback +eu-west +applied", audit)


def test_the_demo_waits_for_dns_to_answer_the_plan() -> None:
    """The controller writes its plan before it applies it to BIND9: a window that reads the
    new plan while DNS still answers the old one has not ramped back yet (a CI run once
    printed eu-west's SRV weight at 25 for a plan of 50)."""
    plan = {"eu-west": 0.5, "eu-north": 0.5}
    assert demo._answers_plan({"eu-west": 50.0, "eu-north": 50.0}, plan)
    assert not demo._answers_plan({"eu-west": 25.0, "eu-north": 75.0}, plan)
    assert not demo._answers_plan({"eu-north": 100.0}, plan)
    assert not demo._answers_plan(None, plan)
    two_to_one = {"eu-west": 2 / 3, "eu-north": 1 / 3}  # the zone holds whole percents
    assert demo._answers_plan({"eu-west": 67.0, "eu-north": 33.0}, two_to_one)
    assert demo._answers_plan({"eu-north": 100.0}, {"eu-north": 1.0, "eu-west": 0.0})
    assert demo._answers_plan(None, {})  # nothing planned for the view
    healthy = {"regions": {"eu-west": {"state": "healthy", "weight": 1.0}}}
    assert demo._ramped_back({**healthy, "dns_current": True}, "eu-west")
    assert not demo._ramped_back({**healthy, "dns_current": False}, "eu-west")
    assert not demo._ramped_back({}, "eu-west")  # no controller answered
