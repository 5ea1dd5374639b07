"""The fleet simulator: conservation, determinism, staleness, the central queue, the oracle,
agent replicas."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from meridian_sim import fleet, profile, workloads
from meridian_sim.fleet.sim import Fleet, _Agent
from policies import group_routing
from policies.model import NodeId, NodeView

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
    agent = sim._agents[0]
    assert all(v.telemetry is None for v in sim._node_views(agent, 0.0))  # never scraped
    agent.scrape[0] = (10.0, 3, 7, 0.5)
    agent.views[0] = None
    view = sim._node_views(agent, 10.5)[0]
    assert view.telemetry is not None
    assert (view.telemetry.waiting, view.telemetry.kv_util) == (7, 0.5)
    assert view.telemetry.age_s == pytest.approx(0.5)
    # older than stale_after_s (default max(1, 4 x 1 s) = 4 s): unknown, never idle
    assert sim._node_views(agent, 14.5)[0].telemetry is None


def test_prefill_ahead_is_counted_until_the_first_token() -> None:
    requests = workloads.scale_to_rate(_sessions(), rate_per_s=10.0)[:40]
    sim = Fleet(H100, requests, fleet.FleetConfig(nodes=2, scrape_interval_s=0))
    agent = sim._agents[0]
    assert sim._try_route(agent, 0, 0.0)
    routed = agent.in_flight.index(1)
    assert agent.prefill_tokens[routed] == requests[0].input_length  # nothing cached yet
    assert sim._node_views(agent, 0.0)[routed].prefill_tokens == requests[0].input_length
    done = Fleet(H100, requests, fleet.FleetConfig(nodes=2, scrape_interval_s=0))
    result = done.run()
    assert result.summary["completed"] == len(requests)
    assert all(not any(a.prefill_tokens) and not a.prefill for a in done._agents)


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


def test_the_groups_policy_runs_with_tables_the_region_s_agents_share() -> None:
    """``groups`` in the fleet simulator (``policies.group_routing`` over ``LocalTables``): a
    session's turns stay on one GPU, so its later turns hit what the first one cached, better
    than random; the region's agent replicas share one table (an instant etcd sync)."""
    requests = workloads.scale_to_rate(_sessions(seed=5, duration_s=60), rate_per_s=12.0)
    grouped = _run(requests, nodes=8, policy="groups")
    rand = _run(requests, nodes=8, policy="random")
    assert grouped.summary["completed"] == len(requests)
    assert float(grouped.summary["prefix_hit_rate"]) > float(rand.summary["prefix_hit_rate"]) + 0.1
    sim = Fleet(H100, requests[:50], fleet.FleetConfig(nodes=4, policy="groups",
                                                       agents_per_region=2))  # fmt: skip
    sim.run()
    first, second = (a.policy for a in sim._agents)
    assert isinstance(first, group_routing.GroupPolicy)
    assert isinstance(second, group_routing.GroupPolicy)
    assert first.tables is second.tables and len(first.tables.weights) == 4


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
    with pytest.raises(fleet.FleetError, match="agents_per_region must be at least 1, got 0"):
        fleet.FleetConfig(nodes=2, agents_per_region=0)


# -- agent replicas ----------------------------------------------------------------------------


def test_one_agent_per_region_is_the_default_run_exactly() -> None:
    requests = workloads.scale_to_rate(_sessions(), rate_per_s=20.0)
    timing = ("wall_s", "cpu_s")
    for kw in (
        {"policy": "meridian", "scrape_interval_s": 0.25, "regions": 2},
        {"policy": "power_of_two", "scrape_interval_s": 1.0, "seed": 5},
        {"policy": "least_connections", "scrape_interval_s": 0.0, "slots_per_node": 4},
    ):
        default = _run(requests, nodes=6, **kw)
        one = _run(requests, nodes=6, agents_per_region=1, **kw)
        assert one.outcomes == default.outcomes
        assert {k: v for k, v in one.summary.items() if k not in timing} == {
            k: v for k, v in default.summary.items() if k not in timing
        }
        assert one.summary["agents_per_region"] == 1
        assert {o.agent for o in one.outcomes} == {0}


class _Watched(Fleet):
    """A fleet that records, at every decision, what the deciding agent's policy is shown next
    to its own counts and the node's total over every agent of the region."""

    def __init__(self, requests: list[workloads.TraceRequest], config: fleet.FleetConfig) -> None:
        super().__init__(H100, requests, config)
        self.seen: list[tuple[list[int], list[int], list[int]]] = []

    def _node_views(self, agent: _Agent, now: float) -> list[NodeView]:
        views = super()._node_views(agent, now)
        peers = agent.region.agents
        totals = [sum(a.in_flight[pos] for a in peers) for pos in range(len(views))]
        self.seen.append(([v.in_flight for v in views], list(agent.in_flight), totals))
        return views


def test_agent_replicas_count_only_their_own_requests_and_every_request_ends_once() -> None:
    requests = workloads.scale_to_rate(_sessions(rate=4.0), rate_per_s=40.0)
    config = fleet.FleetConfig(
        nodes=6, regions=2, agents_per_region=4, policy="meridian", scrape_interval_s=0.5
    )
    sim = _Watched(requests, config)
    result = sim.run()
    outcomes = result.outcomes
    assert [o.index for o in outcomes] == list(range(len(requests)))
    assert all((o.finished_s is None) != (o.refused is None) for o in outcomes)
    assert result.summary["completed"] == len(requests)
    assert result.summary["agents_per_region"] == 4
    # sessions stick to one agent, and the agent does not follow from the region
    by_session: dict[str | None, set[tuple[int, int]]] = {}
    for o in outcomes:
        by_session.setdefault(requests[o.index].session, set()).add((o.region, o.agent))
    assert all(len(v) == 1 for v in by_session.values())
    assert {(o.region, o.agent) for o in outcomes} == {(r, a) for r in (0, 1) for a in range(4)}
    # each agent's accounting is back to zero at the end, its queue empty
    assert len(sim._agents) == 8
    for agent in sim._agents:
        assert not any(agent.in_flight) and not any(agent.in_flight_tokens)
        assert not any(agent.prefill_tokens) and not agent.prefill and not agent.queue
    # each agent scraped on its own timer: phases (times mod the interval) all differ
    phases = {round(a.scrape[0][0] % 0.5, 9) for a in sim._agents if a.scrape[0] is not None}
    assert len(phases) == 8
    # the policy saw its agent's own counts, and a node held more than one agent saw
    assert all(shown == own for shown, own, _ in sim.seen)
    assert any(t > o for _, own, totals in sim.seen for o, t in zip(own, totals, strict=True))
    again = fleet.simulate(H100, requests, config)
    assert again.outcomes == outcomes


def test_least_connections_replicas_herd_on_what_they_cannot_see() -> None:
    # one region of 4 nodes, 4 least-connections replicas, fresh telemetry (which lc ignores)
    requests = workloads.scale_to_rate(_sessions(rate=4.0), rate_per_s=40.0)
    config = fleet.FleetConfig(
        nodes=4, agents_per_region=4, policy="least_connections", scrape_interval_s=0.0
    )
    sim = _Watched(requests, config)
    sim.run()
    assert sim.seen
    for shown, own, totals in sim.seen:
        assert shown == own  # in_flight is the deciding agent's count, never the node's total
        assert all(o <= t for o, t in zip(own, totals, strict=True))
    # at some decision the agent's least-loaded node was not the region's least loaded
    assert any(
        totals[own.index(min(own))] > min(totals) for _, own, totals in sim.seen if any(totals)
    )


def test_slots_cap_each_agents_own_in_flight_not_the_node_total() -> None:
    burst = [
        workloads.TraceRequest(
            timestamp_s=0.0, input_length=900, output_length=400, hash_ids=(0, 10_000 + i)
        )
        for i in range(24)
    ]
    one = _run(burst, nodes=1, policy="round_robin", slots_per_node=2)
    assert sum(o.dispatched_s == 0.0 for o in one.outcomes) == 2
    four = _run(burst, nodes=1, agents_per_region=4, policy="round_robin", slots_per_node=2)
    at_once = Counter(o.agent for o in four.outcomes if o.dispatched_s == 0.0)
    assert set(at_once) == {0, 1, 2, 3} and set(at_once.values()) == {2}  # 8 on one node
    assert four.summary["completed"] == len(burst)


# -- workers of one agent (FleetConfig.workers) ------------------------------------------------


def test_workers_see_the_node_total_and_share_one_slot_cap() -> None:
    requests = workloads.scale_to_rate(_sessions(rate=4.0), rate_per_s=40.0)
    config = fleet.FleetConfig(
        nodes=4, agents_per_region=3, workers=True, policy="meridian", scrape_interval_s=0.5
    )
    sim = _Watched(requests, config)
    result = sim.run()
    assert result.summary["completed"] == len(requests)
    assert all(shown == totals for shown, _, totals in sim.seen)  # every worker's, summed
    assert any(t > o for _, own, totals in sim.seen for o, t in zip(own, totals, strict=True))
    # connections, not sessions, are spread: a session's requests reach several workers
    by_session: dict[str | None, set[int]] = {}
    for o in result.outcomes:
        by_session.setdefault(requests[o.index].session, set()).add(o.agent)
    assert any(len(v) > 1 for v in by_session.values())
    burst = [
        workloads.TraceRequest(
            timestamp_s=0.0, input_length=900, output_length=400, hash_ids=(0, 10_000 + i)
        )
        for i in range(24)
    ]
    four = _run(burst, nodes=1, agents_per_region=4, workers=True, policy="round_robin",
                slots_per_node=2)  # fmt: skip
    assert sum(o.dispatched_s == 0.0 for o in four.outcomes) == 2  # the node's 2, not 4 x 2
    assert four.summary["completed"] == len(burst)


def test_every_worker_learns_where_each_prompt_went() -> None:
    requests = workloads.scale_to_rate(_sessions(seed=3, rate=4.0), rate_per_s=30.0)
    shared = Fleet(H100, requests, fleet.FleetConfig(nodes=4, agents_per_region=3, workers=True,
                                                      policy="prefix_aware"))  # fmt: skip
    shared.run()
    apart = Fleet(H100, requests, fleet.FleetConfig(nodes=4, agents_per_region=3,
                                                     policy="prefix_aware"))  # fmt: skip
    apart.run()

    def known(sim: Fleet, i: int) -> list[dict[NodeId, int]]:
        """What each agent's policy matches of request ``i``'s prompt: node -> blocks (its
        prefix index's, and with workers the deepest tail of the region's table past it)."""
        view = sim._request_view(i)
        return [a.policy._match(view.block_hashes, 0.0) for a in sim._agents]  # type: ignore[attr-defined]

    # in the shared run the workers' indexes agree on every prompt; apart they do not
    assert all(all(k == known(shared, i)[0] for k in known(shared, i)) for i in range(40))
    assert all(known(shared, i)[0] for i in range(40))
    assert any(any(k != known(apart, i)[0] for k in known(apart, i)) for i in range(40))


def test_kv_events_feed_an_index_that_ends_equal_to_the_engines_caches() -> None:
    """Under cache pressure (a small cache: evictions), the precise index follows every store
    and eviction; once the last events land it holds exactly what each engine caches."""
    small = dataclasses.replace(H100, num_gpu_blocks=600)
    requests = workloads.scale_to_rate(_sessions(seed=9, duration_s=40), rate_per_s=6.0)
    sim = Fleet(small, requests, fleet.FleetConfig(nodes=3, kv_events=True, kv_event_delay_s=0.2))
    result = sim.run()
    assert all(o.refused is None for o in result.outcomes)
    (region,) = sim._regions
    index = region.kv_index
    assert index is not None
    for n in sim._nodes:
        assert index.keys(n.node_id) == set(n.engine.kv._by_hash)
    assert result.summary["kv_index_mib"] > 0 and result.summary["kv_events"] is True
    # the same run without events routes differently: the index matters
    plain = fleet.simulate(small, requests, fleet.FleetConfig(nodes=3))
    assert [o.node for o in plain.outcomes] != [o.node for o in result.outcomes]


def test_kv_events_refuse_what_cannot_use_them() -> None:
    requests = _sessions()[:5]
    with pytest.raises(fleet.FleetError, match="kv_events needs a policy with a prefix index"):
        fleet.FleetConfig(nodes=2, policy="round_robin", kv_events=True)
    with pytest.raises(fleet.FleetError, match="kv_events needs prefix_block_tokens equal"):
        Fleet(H100, requests, fleet.FleetConfig(nodes=2, kv_events=True, prefix_block_tokens=32))
    with pytest.raises(fleet.FleetError, match="kv_event_delay_s"):
        fleet.FleetConfig(nodes=2, kv_events=True, kv_event_delay_s=-1)


def test_the_oracle_scores_every_node_above_the_bounded_set() -> None:
    """Past meridian_candidates (16) nodes meridian scores its prefix index's holders and a
    sample; the oracle keeps no index, so it must score every node to see the caches at all."""
    requests = workloads.scale_to_rate(_sessions(seed=5, duration_s=60), rate_per_s=12.0)
    sim = Fleet(H100, requests, fleet.FleetConfig(nodes=32, policy="oracle"))
    result = sim.run()
    assert sim._agents[0].policy._config.meridian_candidates == 0  # type: ignore[attr-defined]
    rand = fleet.simulate(H100, requests, fleet.FleetConfig(nodes=32, policy="random"))
    assert float(result.summary["prefix_hit_rate"]) > float(rand.summary["prefix_hit_rate"]) + 0.1
