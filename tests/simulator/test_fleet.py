"""The fleet simulator: conservation, determinism, staleness, the central queue, the oracle."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies.model import NodeId
from simulator import fleet, profile, workloads
from simulator.fleet.sim import Fleet

H100 = profile.load("h100-llama3-8b")


def _sessions(
    seed: int = 1, duration_s: float = 30.0, rate: float = 3.0
) -> list[workloads.TraceRequest]:
    return workloads.synthetic(
        duration_s=duration_s,
        sessions_per_s=rate,
        rng=random.Random(seed),
        num_system_prompts=6,
        system_prompt_tokens=(1024, 3072),
        mean_think_s=3.0,
        mean_output_tokens=60,
    )


def _run(requests: list[workloads.TraceRequest], **kw: object) -> fleet.FleetResult:
    return fleet.simulate(H100, requests, fleet.FleetConfig(**kw))  # type: ignore[arg-type]


def test_every_request_ends_exactly_once_across_regions() -> None:
    requests = workloads.scale_to_rate(_sessions(), rate_per_s=20.0)
    result = _run(requests, nodes=6, regions=2, policy="meridian", scrape_interval_s=0.25)
    outcomes = result.outcomes
    assert [o.index for o in outcomes] == list(range(len(requests)))
    for o in outcomes:
        assert (o.finished_s is None) != (o.refused is None)
        if o.finished_s is not None:
            assert o.node is not None
            assert o.output_tokens == requests[o.index].output_length
            assert o.arrival_s <= o.dispatched_s <= o.first_token_s <= o.finished_s  # type: ignore[operator]
    s = result.summary
    assert s["completed"] == len(requests)
    assert {o.region for o in outcomes} == {0, 1}
    # a request stays in its region: nodes are named after it
    assert all(o.node is not None and o.node.startswith(f"r{o.region}-") for o in outcomes)
    # sessions stick to one region
    by_session: dict[str | None, set[int]] = {}
    for o in outcomes:
        by_session.setdefault(requests[o.index].session, set()).add(o.region)
    assert all(len(v) == 1 for v in by_session.values())


def test_same_seed_same_run_and_the_seed_matters() -> None:
    requests = workloads.scale_to_rate(_sessions(), rate_per_s=15.0)
    a = _run(requests, nodes=4, policy="random", seed=3)
    b = _run(requests, nodes=4, policy="random", seed=3)
    c = _run(requests, nodes=4, policy="random", seed=4)
    assert a.outcomes == b.outcomes
    timing = ("wall_s", "cpu_s")
    assert {k: v for k, v in a.summary.items() if k not in timing} == {
        k: v for k, v in b.summary.items() if k not in timing
    }
    assert [o.node for o in a.outcomes] != [o.node for o in c.outcomes]


def test_stale_telemetry_changes_jsq_decisions() -> None:
    # overloaded nodes queue in their engines, so 'waiting' matters to jsq
    requests = workloads.scale_to_rate(_sessions(rate=4.0), rate_per_s=60.0)
    fresh = _run(requests, nodes=4, policy="jsq", scrape_interval_s=0.0)
    stale = _run(requests, nodes=4, policy="jsq", scrape_interval_s=2.0)
    assert [o.node for o in fresh.outcomes] != [o.node for o in stale.outcomes]
    # the control: least connections reads no telemetry, so staleness changes nothing
    lc_fresh = _run(requests, nodes=4, policy="least_connections", scrape_interval_s=0.0)
    lc_stale = _run(requests, nodes=4, policy="least_connections", scrape_interval_s=2.0)
    assert [o.node for o in lc_fresh.outcomes] == [o.node for o in lc_stale.outcomes]


def test_policies_see_the_last_scrape_not_the_live_engine() -> None:
    requests = workloads.scale_to_rate(_sessions(), rate_per_s=10.0)[:5]
    sim = Fleet(H100, requests, fleet.FleetConfig(nodes=2, scrape_interval_s=1.0))
    region = sim._regions[0]
    assert all(v.telemetry is None for v in sim._node_views(region, 0.0))  # never scraped
    node = region.nodes[0]
    node.scrape = (10.0, 3, 7, 0.5)
    node.view = None
    view = sim._node_views(region, 10.5)[0]
    assert view.telemetry is not None
    assert (view.telemetry.waiting, view.telemetry.kv_util) == (7, 0.5)
    assert view.telemetry.age_s == pytest.approx(0.5)
    # older than stale_after_s (default max(1, 4 x 1 s) = 4 s): unknown, never idle
    assert sim._node_views(region, 14.5)[0].telemetry is None


def test_prefill_ahead_is_counted_until_the_first_token() -> None:
    requests = workloads.scale_to_rate(_sessions(), rate_per_s=10.0)[:40]
    sim = Fleet(H100, requests, fleet.FleetConfig(nodes=2, scrape_interval_s=0))
    region = sim._regions[0]
    assert sim._try_route(region, 0, 0.0)
    routed = next(n for n in region.nodes if n.in_flight == 1)
    assert routed.prefill_tokens == requests[0].input_length  # nothing cached yet
    assert sim._node_views(region, 0.0)[routed.index].prefill_tokens == requests[0].input_length
    done = Fleet(H100, requests, fleet.FleetConfig(nodes=2, scrape_interval_s=0))
    result = done.run()
    assert result.summary["completed"] == len(requests)
    assert all(n.prefill_tokens == 0 and not n.prefill for n in done._nodes)


def test_full_queue_and_deadline_refuse_with_reasons() -> None:
    burst = [
        workloads.TraceRequest(
            timestamp_s=0.0, input_length=2000, output_length=400, hash_ids=(10_000 + i,) * 4
        )
        for i in range(12)
    ]
    full = _run(burst, nodes=1, policy="round_robin", slots_per_node=2, max_depth=3)
    reasons = Counter(o.refused for o in full.outcomes)
    assert reasons == {None: 5, "queue_full": 7}
    late = _run(burst, nodes=1, policy="round_robin", slots_per_node=2, deadline_s=0.5)
    assert Counter(o.refused for o in late.outcomes) == {None: 2, "deadline": 10}
    assert late.summary["refused_deadline"] == 10


def test_too_large_requests_are_refused() -> None:
    big = workloads.TraceRequest(
        timestamp_s=0.0, input_length=9000, output_length=10, hash_ids=tuple(range(18))
    )
    result = _run([big], nodes=1, policy="jsq")
    assert result.outcomes[0].refused == "too_large"
    longer = fleet.with_context(H100, 131_072)
    ok = fleet.simulate(longer, [big], fleet.FleetConfig(nodes=1, policy="jsq"))
    assert ok.outcomes[0].finished_s is not None


def test_oracle_reads_the_engines_caches_and_beats_random_on_hits() -> None:
    requests = workloads.scale_to_rate(_sessions(seed=5, duration_s=60), rate_per_s=12.0)
    oracle = _run(requests, nodes=8, policy="oracle")
    rand = _run(requests, nodes=8, policy="random")
    oracle_hits, random_hits = (float(r.summary["prefix_hit_rate"]) for r in (oracle, rand))
    assert oracle_hits > random_hits + 0.1
    sim = Fleet(H100, requests[:1], fleet.FleetConfig(nodes=2, policy="oracle"))
    result = sim.run()
    node = result.outcomes[0].node
    assert node is not None
    view = sim._request_view(0)
    expected = (requests[0].input_length - 1) // 16
    assert sim._cached_blocks(NodeId(node), view) == expected
    other = next(n.node_id for n in sim._nodes if n.node_id != node)
    assert sim._cached_blocks(other, view) == 0


def test_at_load_scales_to_the_fleet_capacity() -> None:
    requests = _sessions(duration_s=60)
    work = fleet.at_load(requests, H100, nodes=10, load=0.5, node_capacity_rps=2.0)
    assert work.rate_per_s == pytest.approx(10.0)
    assert workloads.mean_rate_per_s(list(work.requests)) == pytest.approx(10.0)
    cut = fleet.at_load(requests, H100, nodes=10, load=0.5, node_capacity_rps=2.0, duration_s=5.0)
    assert all(r.timestamp_s < 5.0 for r in cut.requests)
    assert 30 <= len(cut.requests) <= 70


def test_bad_config_names_the_field() -> None:
    with pytest.raises(fleet.FleetError, match="unknown policy 'fastest'"):
        fleet.FleetConfig(nodes=2, policy="fastest")
    with pytest.raises(fleet.FleetError, match="regions must be"):
        fleet.FleetConfig(nodes=2, regions=3)
