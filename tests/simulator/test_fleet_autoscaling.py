"""The fleet simulator with an autoscaler: provisioning delays, drains, GPU time, and the shaped
arrivals of the autoscaling benchmark."""

from __future__ import annotations

import itertools
import random

import pytest

from meridian_sim import fleet, profile, workloads
from policies import autoscaling

H100 = profile.load("h100-llama3-8b")
SPIKE = [(0.0, 1.0), (60.0, 1.0), (70.0, 3.0), (200.0, 3.0), (210.0, 1.0)]


def _trace(duration_s: float = 600.0) -> list[workloads.TraceRequest]:
    rng = random.Random(3)
    t, out = 0.0, []
    while t < duration_s:
        t += rng.expovariate(20.0)
        n = rng.randint(200, 1200)
        out.append(
            workloads.TraceRequest(
                timestamp_s=t,
                input_length=n,
                output_length=rng.randint(40, 200),
                hash_ids=tuple(range(len(out) * 100, len(out) * 100 + -(-n // 512))),
            )
        )
    return out


def _serving_spans(result: fleet.FleetResult, initial: set[str]) -> dict[str, list[list[float]]]:
    """Each node's [from, to) spans of taking new requests, from the node events."""
    spans: dict[str, list[list[float]]] = {n: [[0.0, float("inf")]] for n in initial}
    for t, node, what in result.node_events:
        if what in ("ready", "undrained"):
            spans.setdefault(node, []).append([t, float("inf")])
        elif what == "draining":
            spans[node][-1][1] = t
    return spans


@pytest.fixture(scope="module")
def spiked() -> tuple[list[workloads.TraceRequest], fleet.FleetResult, fleet.Scaling]:
    requests = workloads.shaped(_trace(), base_rps=4.0, shape=SPIKE, duration_s=900.0)
    scaling = fleet.Scaling(
        policy=autoscaling.Config(mode="combined", max_nodes=8),
        initial_nodes=2,
        provision_delay_s=120.0,
        node_capacity_rps=5.0,
    )
    config = fleet.FleetConfig(nodes=8, policy="meridian", autoscaling=scaling)
    return requests, fleet.simulate(H100, requests, config), scaling


def test_shaped_arrivals_follow_the_multiplier_and_repeat_the_trace_with_fresh_ids() -> None:
    base = _trace(60.0)
    requests = workloads.shaped(base, base_rps=10.0, shape=SPIKE, duration_s=400.0)
    times = [r.timestamp_s for r in requests]
    assert times == sorted(times) and times[-1] < 400.0

    def rate(a: float, b: float) -> float:
        return sum(1 for t in times if a <= t < b) / (b - a)

    assert rate(0, 60) == pytest.approx(10.0, rel=0.2)
    assert rate(80, 200) == pytest.approx(30.0, rel=0.2)
    assert rate(220, 400) == pytest.approx(10.0, rel=0.2)
    # the 60 s trace is used about 13 times; every repeat has its own blocks
    ids = [h for r in requests for h in r.hash_ids]
    assert len(ids) == len(set(ids))
    with pytest.raises(ValueError, match="t = 0"):
        workloads.shaped(base, base_rps=1.0, shape=[(5.0, 1.0)], duration_s=10.0)
    with pytest.raises(ValueError, match="increase strictly"):
        workloads.shaped(base, base_rps=1.0, shape=[(0.0, 2.0), (9.0, 2.0), (9.0, 1.0)],
                         duration_s=10.0)  # fmt: skip


def test_ordered_nodes_serve_only_after_the_delay_and_nothing_reaches_a_node_not_serving(
    spiked: tuple[list[workloads.TraceRequest], fleet.FleetResult, fleet.Scaling],
) -> None:
    requests, result, scaling = spiked
    assert result.summary["completed"] == len(requests)
    ordered: dict[str, float] = {}
    for t, node, what in result.node_events:
        if what == "ordered":
            ordered[node] = t
        elif what == "ready":
            assert t == pytest.approx(ordered.pop(node) + scaling.provision_delay_s)
    spans = _serving_spans(result, {"r0-n000", "r0-n001"})
    for o in result.outcomes:
        assert o.node is not None and o.dispatched_s is not None
        assert any(a <= o.dispatched_s < b for a, b in spans[o.node]), (o, spans[o.node])
    # a drained node takes nothing new and stops once its last request is done
    for t, node, what in result.node_events:
        if what == "stopped":
            assert all(
                o.finished_s is not None and o.finished_s <= t
                for o in result.outcomes
                if o.node == node and o.dispatched_s is not None and o.dispatched_s < t
            )


def test_a_spike_scales_up_ahead_and_down_slowly_and_gpu_time_counts_from_the_order(
    spiked: tuple[list[workloads.TraceRequest], fleet.FleetResult, fleet.Scaling],
) -> None:
    _, result, scaling = spiked
    ticks = result.timeline
    assert [t.t for t in ticks[:3]] == [10.0, 20.0, 30.0]
    peak = max(t.serving for t in ticks)
    assert peak > scaling.initial_nodes
    ups = [t for t in ticks if t.kind == "up"]
    downs = [t.t for t in ticks if t.kind == "down"]
    assert ups and downs and min(downs) > max(u.t for u in ups if u.t < 300.0)
    assert all(b - a >= 300.0 for a, b in itertools.pairwise(downs))
    assert all(t.reason for t in ticks)
    # GPU time: every node from its order (or the start) to its stop (or the end)
    events = result.node_events
    end = result.summary["virtual_s"]
    assert isinstance(end, float)
    life: dict[str, float] = {"r0-n000": 0.0, "r0-n001": 0.0}
    gpu_s = 0.0
    for t, node, what in events:
        if what == "ordered":
            life[node] = t
        elif what in ("stopped", "cancelled"):
            gpu_s += t - life.pop(node)
    gpu_s += sum(end - t for t in life.values())
    assert result.summary["gpu_hours"] == pytest.approx(gpu_s / 3600.0, rel=0.01)
    assert 2.0 < result.summary["nodes_mean"] < 8.0  # type: ignore[operator]


def test_a_static_fleet_costs_every_node_all_the_run() -> None:
    requests = workloads.scale_to_rate(_trace(60.0), rate_per_s=10.0)
    result = fleet.simulate(H100, requests, fleet.FleetConfig(nodes=3, policy="meridian"))
    assert result.timeline == () and result.node_events == ()
    assert result.summary["nodes_mean"] == pytest.approx(3.0)


def test_autoscaling_settings_the_fleet_cannot_run_are_refused_naming_the_field() -> None:
    policy = autoscaling.Config(max_nodes=8)
    with pytest.raises(fleet.FleetError, match="max_nodes"):
        fleet.FleetConfig(nodes=4, autoscaling=fleet.Scaling(policy=policy, initial_nodes=2))
    with pytest.raises(fleet.FleetError, match="initial_nodes"):
        fleet.FleetConfig(nodes=8, autoscaling=fleet.Scaling(policy=policy, initial_nodes=9))
    with pytest.raises(fleet.FleetError, match="one region"):
        fleet.FleetConfig(
            nodes=8, regions=2, autoscaling=fleet.Scaling(policy=policy, initial_nodes=2)
        )
