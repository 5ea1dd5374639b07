"""The fleet simulator's spill-over: a saturated region sends work to an idle one (never further
than the budget, never before the first plan), the client pays the round trip, and the settings
are checked."""

from __future__ import annotations

import random

import pytest

from meridian_sim import fleet, profile, workloads

H100 = profile.load("h100-llama3-8b")


def _requests(rate_per_s: float) -> list[workloads.TraceRequest]:
    sessions = workloads.synthetic(
        duration_s=40.0,
        sessions_per_s=3.0,
        rng=random.Random(5),
        num_system_prompts=4,
        system_prompt_tokens=(1024, 3072),
        mean_think_s=3.0,
        mean_output_tokens=80,
    )
    return workloads.scale_to_rate(sessions, rate_per_s=rate_per_s)


def _run(requests: list[workloads.TraceRequest], **kw: object) -> fleet.FleetResult:
    base: dict[str, object] = {
        "nodes": 5, "regions": 2, "region_nodes": (1, 4), "policy": "meridian",
        "scrape_interval_s": 0.5, "slots_per_node": 16, "max_depth": 64,
    }  # fmt: skip
    base.update(kw)
    return fleet.simulate(H100, requests, fleet.FleetConfig(**base))  # type: ignore[arg-type]


def test_a_saturated_region_spills_to_the_idle_one_and_queues_less() -> None:
    requests = _requests(40.0)  # half of it on region 0's single node: far over its capacity
    spill = fleet.Spill(queue_depth=4, rtt_s=0.05, budget_s=0.1, plan_interval_s=1.0)
    off = _run(requests)
    on = _run(requests, spill=spill)
    assert off.summary["spilled"] == 0
    assert all(o.spilled_to is None for o in off.outcomes)
    spilled = [o for o in on.outcomes if o.spilled_to is not None]
    assert spilled and all(o.region == 0 and o.spilled_to == 1 for o in spilled)
    for o in spilled:  # served in the other region, and the client waited the round trip
        assert o.node is not None and o.node.startswith("r1-")
        if o.first_token_s is not None:
            assert o.first_token_s - o.arrival_s >= spill.rtt_s
    refused_off = off.summary["refused_queue_full"] + off.summary["refused_deadline"]
    refused_on = on.summary["refused_queue_full"] + on.summary["refused_deadline"]
    assert refused_on <= refused_off
    assert on.summary["ttft_p99_s"] < off.summary["ttft_p99_s"]
    assert on.summary["completed"] >= off.summary["completed"]
    assert on.summary["spilled"] == len(spilled)


def test_nothing_spills_over_the_latency_budget_or_before_the_first_plan() -> None:
    requests = _requests(40.0)
    far = fleet.Spill(queue_depth=4, rtt_s=0.25, budget_s=0.1, plan_interval_s=1.0)
    assert _run(requests, spill=far).summary["spilled"] == 0  # over the latency budget
    late = fleet.Spill(queue_depth=4, rtt_s=0.05, plan_interval_s=4.0)
    outcomes = _run(requests, spill=late).outcomes
    assert any(o.spilled_to is not None for o in outcomes)
    assert all(o.spilled_to is None for o in outcomes if o.arrival_s < 4.0)


def test_the_settings_are_checked() -> None:
    with pytest.raises(fleet.FleetError, match="region_nodes"):
        fleet.FleetConfig(nodes=4, regions=2, region_nodes=(1, 2))
    with pytest.raises(fleet.FleetError, match="spill needs two regions"):
        fleet.FleetConfig(nodes=4, regions=1, spill=fleet.Spill())
    with pytest.raises(fleet.FleetError, match=r"spill\.queue_depth"):
        fleet.FleetConfig(nodes=4, regions=2, spill=fleet.Spill(queue_depth=0))
