"""policies.routing: table-driven picks per policy, the load guard, sessions, and invariants."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import group_routing, prefix_index, prompt, routing
from policies.groups import GroupId
from policies.kv_index import PreciseIndex
from policies.model import (
    AdminState,
    Decision,
    Health,
    NodeId,
    NodeView,
    NodeViews,
    RequestView,
    Telemetry,
)

CONFIG = routing.RoutingConfig()
LOAD_READERS = ("power_of_two", "jsq", "kv_aware", "prefix_aware", "session", "meridian")


def tel(*, waiting: int = 0, kv: float = 0.2) -> Telemetry:
    return Telemetry(
        age_s=0.1, running=0, waiting=waiting, kv_util=kv, prefix_hit_rate=None, block_size=16
    )


def node(node_id: str, *, telemetry: Telemetry | None = None, **kwargs: object) -> NodeView:
    """A node serving model "m", with known, idle telemetry unless told otherwise."""
    return NodeView(
        node_id=NodeId(node_id),
        models=frozenset({"m"}),
        telemetry=tel() if telemetry is None else telemetry,
        **kwargs,  # type: ignore[arg-type]
    )


def unknown(node_id: str, **kwargs: object) -> NodeView:
    return dataclasses.replace(node(node_id, **kwargs), telemetry=None)  # type: ignore[arg-type]


def req(**kwargs: object) -> RequestView:
    fields: dict[str, object] = {"model": "m", "prompt_tokens": 100, "max_tokens": 50}
    fields.update(kwargs)
    return RequestView(**fields)  # type: ignore[arg-type]


def blocks(*tokens: int) -> tuple[int, ...]:
    """Chained hashes of one-token blocks: ``blocks(1, 2)`` is a prefix of ``blocks(1, 2, 3)``."""
    return prompt.block_hashes(tokens, block_size=1)


def choose(
    policy: routing.Policy, request: RequestView, nodes: Sequence[NodeView], *, seed: int = 0
) -> Decision:
    return policy.choose(request, nodes, now=0.0, rng=random.Random(seed))


# --- construction ---------------------------------------------------------------------------


def test_create_makes_every_named_policy() -> None:
    assert len(set(routing.NAMES)) == 11
    for name in routing.NAMES:
        assert routing.create(name, CONFIG).name == name


def test_create_names_the_valid_policies_for_an_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown routing policy 'cache_aware'.*meridian"):
        routing.create("cache_aware", CONFIG)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefix_capacity_blocks", 0),
        ("prefix_ttl_s", -1.0),
        ("balance_rel_threshold", 0.5),
        ("kv_high_watermark", 1.5),
        ("session_load_bound_factor", 0.9),
        ("slow_start_floor", 0.0),
        ("meridian_queue_weight", -1.0),
        ("meridian_prefill_weight", -1.0),
        ("meridian_prefill_norm_tokens", 0),
    ],
)
def test_config_refuses_values_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        routing.RoutingConfig(**{field: value})  # type: ignore[arg-type]


# --- candidates and no-candidate reasons ----------------------------------------------------


def test_candidates_are_routable_serving_and_with_a_slot() -> None:
    nodes = [
        node("ok"),
        node("draining", admin=AdminState.DRAINING),
        node("ejected", health=Health.EJECTED),
        node("down", health=Health.UNHEALTHY),
        node("probation-free", health=Health.PROBATION),
        node("probation-busy", health=Health.PROBATION, in_flight=1),
        node("full", in_flight=4, slots=4),
        NodeView(node_id=NodeId("other"), models=frozenset({"x"})),
    ]
    ids = [n.node_id for n in routing.candidates(req(), nodes)]
    assert ids == ["ok", "probation-free"]


@pytest.mark.parametrize(
    ("nodes", "needle"),
    [
        ([], "no node serves model 'm'"),
        ([NodeView(node_id=NodeId("x"), models=frozenset({"other"}))], "no node serves"),
        (
            [node("a", admin=AdminState.DRAINING), node("b", health=Health.EJECTED)],
            "all 2 nodes serving 'm' are draining or unhealthy",
        ),
        (
            [node("a", in_flight=2, slots=2), node("b", health=Health.PROBATION, in_flight=1)],
            "all 2 routable nodes serving 'm' have full slots",
        ),
    ],
)
@pytest.mark.parametrize("name", routing.NAMES)
def test_no_candidate_gives_none_with_the_reason(
    name: str, nodes: list[NodeView], needle: str
) -> None:
    decision = choose(routing.create(name, CONFIG), req(session_key="s"), nodes)
    assert decision.node is None
    assert needle in decision.reason


# --- table: one fresh policy, one request ---------------------------------------------------

TABLE: list[tuple[object, ...]] = [
    # least_connections: the agent's own in_flight per unit of capacity; no telemetry
    ("least_connections", [node("a", in_flight=3), node("b", in_flight=1)], "b", "least conn"),
    (
        "least_connections",
        [node("a", in_flight=3, weight=2.0), node("b", in_flight=2)],
        "a",  # (3+1)/2 = 2 < (2+1)/1 = 3
        "3 in flight",
    ),
    (
        "least_connections",
        [node("a", in_flight=0, slow_start=0.1), node("b", in_flight=3)],
        "b",  # warming: (0+1)/0.1 = 10 > 4
        "least conn",
    ),
    (
        "least_tokens",
        [node("a", in_flight_tokens=900), node("b", in_flight_tokens=200, in_flight=9)],
        "b",
        "least tokens: 200 tokens",
    ),
    # jsq: in_flight + waiting
    (
        "jsq",
        [node("a", in_flight=1, telemetry=tel(waiting=5)), node("b", in_flight=3)],
        "b",
        "jsq: shortest queue, load 3",
    ),
    # jsq: unknown waiting is the largest known waiting (a: 1 + 4 = 5 > c: 3)
    (
        "jsq",
        [
            unknown("a", in_flight=1),
            node("b", telemetry=tel(waiting=4)),
            node("c", in_flight=3),
        ],
        "c",
        "load 3",
    ),
    # power of two: with two candidates both are sampled
    (
        "power_of_two",
        [node("a", in_flight=6), node("b", in_flight=2, telemetry=tel(waiting=1))],
        "b",
        "power of two: load 3 vs 6",
    ),
    ("power_of_two", [node("a", in_flight=6)], "a", "only candidate"),
    # kv_aware: skip nodes at the watermark while others exist
    (
        "kv_aware",
        [node("a", telemetry=tel(kv=0.95)), node("b", in_flight=5, telemetry=tel(kv=0.5))],
        "b",
        "kv 50% below 90%, 1 fuller or unknown skipped",
    ),
    # ...known below ranks before unknown, even a less loaded unknown
    (
        "kv_aware",
        [unknown("a"), node("b", in_flight=5, telemetry=tel(kv=0.5))],
        "b",
        "below 90%",
    ),
    # ...unknown before known above the watermark
    ("kv_aware", [unknown("a", in_flight=4), node("b", telemetry=tel(kv=0.92))], "a", "unknown"),
    # ...every node above: least load
    (
        "kv_aware",
        [node("a", in_flight=4, telemetry=tel(kv=0.99)), node("b", telemetry=tel(kv=0.91))],
        "b",
        "every node at or above 90% kv",
    ),
    ("session", [node("a", in_flight=2), node("b", in_flight=1)], "b", "session: no key"),
    ("prefix_aware", [node("a", in_flight=2), node("b", in_flight=1)], "b", "no prompt blocks"),
    (
        "prefix_aware",
        [node("a", in_flight=2), node("b", in_flight=1)],
        "b",
        "no cached prefix",
        req(block_hashes=blocks(1, 2)),
    ),
    # meridian: probation costs 0.5, about 8 requests at 64 slots
    (
        "meridian",
        [node("a", health=Health.PROBATION), node("b", in_flight=2)],
        "b",
        "meridian: prefix n/a, in flight 2/64",
    ),
    # meridian: kv at the watermark costs double
    (
        "meridian",
        [node("a", telemetry=tel(kv=0.95)), node("b", in_flight=5, telemetry=tel(kv=0.3))],
        "b",
        "kv 30%",
    ),
    # meridian: a warming node looks 1/warm times fuller
    ("meridian", [node("a", slow_start=0.1), node("b", in_flight=3)], "b", "in flight 3/64"),
    # meridian: waiting counts as load
    (
        "meridian",
        [node("a", telemetry=tel(waiting=12)), node("b", in_flight=4)],
        "b",
        "waiting 0",
    ),
]


@pytest.mark.parametrize(
    ("name", "nodes", "expected", "needle", "request_"),
    [(*case, req()) if len(case) == 4 else case for case in TABLE],
)
def test_pick(
    name: str, nodes: list[NodeView], expected: str, needle: str, request_: RequestView
) -> None:
    """Each case holds for every rng seed: a fresh policy, one request."""
    for seed in range(5):
        decision = choose(routing.create(name, CONFIG), request_, nodes, seed=seed)
        assert decision.node == expected, decision
        assert needle in decision.reason, decision


@pytest.mark.parametrize("name", LOAD_READERS)
def test_unknown_telemetry_is_not_idle(name: str) -> None:
    nodes = [unknown("a"), node("b", telemetry=tel(waiting=0, kv=0.1))]
    for seed in range(20):
        policy = routing.create(name, CONFIG)
        assert choose(policy, req(), nodes, seed=seed).node == "b"


# --- rotations --------------------------------------------------------------------------------


def test_round_robin_cycles_in_node_order_over_candidates() -> None:
    policy = routing.create("round_robin", CONFIG)
    nodes = [node("c"), node("a"), node("b")]
    picks = [choose(policy, req(), nodes).node for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    nodes[0] = node("c", in_flight=64)  # c is full: skipped
    assert [choose(policy, req(), nodes).node for _ in range(4)] == ["a", "b", "a", "b"]


def test_weighted_is_nginx_smooth_round_robin() -> None:
    policy = routing.create("weighted", CONFIG)
    nodes = [node("a", weight=5.0), node("b", weight=1.0), node("c", weight=1.0)]
    picks = [choose(policy, req(), nodes).node for _ in range(7)]
    assert picks == ["a", "a", "b", "a", "c", "a", "a"]  # nginx's documented sequence


def test_weighted_proportions_follow_weight_times_slow_start() -> None:
    policy = routing.create("weighted", CONFIG)
    nodes = [
        node("a", weight=1.0),
        node("b", weight=2.0),
        node("c", weight=4.0, slow_start=0.5),  # counts as 2 while warming
        node("d", weight=3.0),
    ]
    counts = Counter(choose(policy, req(), nodes).node for _ in range(800))
    assert counts == {"a": 100, "b": 200, "c": 200, "d": 300}


def test_random_is_uniform_and_warming_nodes_get_less() -> None:
    policy = routing.create("random", CONFIG)
    nodes = [node("a"), node("b"), node("c", slow_start=0.2)]
    rng = random.Random(7)
    counts = Counter(str(policy.choose(req(), nodes, now=0, rng=rng).node) for _ in range(2200))
    assert 850 <= counts["a"] <= 1150
    assert 850 <= counts["b"] <= 1150
    assert 100 <= counts["c"] <= 300


# --- prefix_aware -----------------------------------------------------------------------------


def routed(policy: routing.Policy, hashes: tuple[int, ...], to: str, *, now: float = 0) -> None:
    policy.observe_routed(req(block_hashes=hashes), NodeId(to), now=now)


def test_prefix_aware_takes_the_longest_prefix_not_the_first_block() -> None:
    policy = routing.create("prefix_aware", routing.RoutingConfig(prefix_stride_blocks=1))
    routed(policy, blocks(0, 1, 2, 3), "a")
    routed(policy, blocks(0, 5, 6), "b")
    nodes = [node("a"), node("b"), node("c")]
    decision = choose(policy, req(block_hashes=blocks(0, 5, 6, 7)), nodes)
    assert decision == Decision(
        node=NodeId("b"), reason="prefix: longest cached prefix, 3 blocks", expected_hit_tokens=48
    )
    assert choose(policy, req(block_hashes=blocks(0, 1, 9)), nodes).node == "a"


def test_the_default_stride_finds_a_conversations_previous_turn_exactly() -> None:
    """At stride 32 a 40-block prompt has entries for blocks 31 and 39 only; the next turn,
    45 blocks, still matches all 40 on the node that took the first."""
    policy = routing.create("meridian", CONFIG)
    assert CONFIG.prefix_stride_blocks == 32
    turn = blocks(*range(40))
    routed(policy, turn, "a")
    routed(policy, blocks(*range(20), *range(100, 120)), "b")  # shares 20 blocks: below a stride
    decision = choose(policy, req(block_hashes=blocks(*range(45))), [node("a"), node("b")])
    assert decision.node == "a"
    assert decision.expected_hit_tokens == 40 * 16


def test_the_dense_head_finds_a_short_shared_system_prompt_exactly() -> None:
    """A 19-block system prompt (304 tokens) followed by different user messages: no routed
    prompt ends on it, so a stride alone (32) never sees it; the dense head (32) matches all
    19 blocks and sends the next conversation to the node that has it."""
    system = tuple(range(19))
    first = blocks(*system, *range(100, 113))  # 32 blocks: its stride block is its own
    second = blocks(*system, *range(200, 214))
    request = req(block_hashes=second, prompt_tokens=len(second) * 16)
    nodes = [node("a", telemetry=tel(waiting=2)), node("b")]  # a miss goes to idle "b"
    assert CONFIG.prefix_dense_head_blocks == 32
    for config, node_id, hit in (
        (CONFIG, "a", 19),
        (routing.RoutingConfig(prefix_dense_head_blocks=0), "b", 0),  # stride only: not found
    ):
        policy = routing.create("meridian", config)
        routed(policy, first, "a")
        decision = choose(policy, request, nodes)
        assert (decision.node, decision.expected_hit_tokens) == (node_id, hit * 16)


def test_config_refuses_a_negative_dense_head() -> None:
    assert routing.RoutingConfig(prefix_dense_head_blocks=0).prefix_dense_head_blocks == 0
    with pytest.raises(ValueError, match="prefix_dense_head_blocks"):
        routing.RoutingConfig(prefix_dense_head_blocks=-1)


@pytest.mark.parametrize(
    ("field", "value"),
    [("meridian_sampled", 0), ("meridian_sampled", 8.0), ("meridian_sampled", True),
     ("meridian_candidates", 2.5)],
)  # fmt: skip
def test_config_refuses_a_bounded_set_that_is_not_a_whole_number_of_nodes(
    field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=field):
        routing.RoutingConfig(**{field: value})  # type: ignore[arg-type]


def test_config_refuses_a_zero_stride() -> None:
    with pytest.raises(ValueError, match="prefix_stride_blocks"):
        routing.RoutingConfig(prefix_stride_blocks=0)


def test_prefix_aware_breaks_equal_matches_by_load() -> None:
    policy = routing.create("prefix_aware", CONFIG)
    routed(policy, blocks(0, 1), "a")
    routed(policy, blocks(0, 1), "b")
    nodes = [node("a", in_flight=5), node("b", in_flight=2), node("c")]
    assert choose(policy, req(block_hashes=blocks(0, 1, 2)), nodes).node == "b"


@pytest.mark.parametrize(
    ("best_load", "least_load", "hit_blocks", "expected", "needle"),
    [
        (30, 2, 2, "b", "load guard, load 30 vs 2; least load"),  # 28 > 16 and 30 > 3
        (30, 2, 128, "a", "kept affinity, 2048 cached tokens worth the wait (load 30 vs 2)"),
        (10, 0, 2, "a", "longest cached prefix"),  # 10 is not > 16 more
        (60, 41, 2, "a", "longest cached prefix"),  # 19 more, but 60 is not > 1.5 x 41
        (63, 41, 2, "b", "load guard"),  # 22 more and 63 > 61.5
    ],
)
def test_prefix_aware_load_guard(
    best_load: int, least_load: int, hit_blocks: int, expected: str, needle: str
) -> None:
    policy = routing.create("prefix_aware", CONFIG)
    hashes = blocks(*range(hit_blocks))
    routed(policy, hashes, "a")
    nodes = [node("a", in_flight=best_load), node("b", in_flight=least_load)]
    decision = choose(policy, req(block_hashes=hashes), nodes)
    assert decision.node == expected
    assert needle in decision.reason
    assert decision.expected_hit_tokens == (hit_blocks * 16 if expected == "a" else 0)


def test_prefix_aware_guard_counts_waiting_and_unknown_pessimistically() -> None:
    policy = routing.create("prefix_aware", CONFIG)
    routed(policy, blocks(0, 1), "a")
    nodes = [node("a", in_flight=5, telemetry=tel(waiting=20)), unknown("b")]
    decision = choose(policy, req(block_hashes=blocks(0, 1)), nodes)
    assert decision.node == "a"  # b's unknown waiting is taken as 20: no imbalance
    nodes = [node("a", in_flight=5, telemetry=tel(waiting=20)), node("b")]
    assert choose(policy, req(block_hashes=blocks(0, 1)), nodes).node == "b"


def test_prefix_aware_forgets_removed_nodes_and_stale_claims() -> None:
    config = routing.RoutingConfig(prefix_ttl_s=10)
    policy = routing.create("prefix_aware", config)
    routed(policy, blocks(0, 1), "a", now=0)
    nodes = [node("a", in_flight=3), node("b")]
    request = req(block_hashes=blocks(0, 1))
    assert policy.choose(request, nodes, now=5, rng=random.Random(0)).node == "a"
    later = policy.choose(request, nodes, now=11, rng=random.Random(0))
    assert later.node == "b"
    assert "no cached prefix" in later.reason
    routed(policy, blocks(0, 1), "a", now=20)
    policy.forget_node(NodeId("a"))
    assert policy.choose(request, nodes, now=21, rng=random.Random(0)).node == "b"


# --- session ----------------------------------------------------------------------------------


def test_session_is_sticky_while_loads_change_below_the_bound() -> None:
    policy = routing.create("session", CONFIG)
    nodes = [node(f"n{i}", in_flight=4) for i in range(4)]
    first = choose(policy, req(session_key="alice"), nodes)
    assert first.reason == "session: sticky node"
    for seed in range(10):  # the others between 3 and 8: the bound stays at 5 or more
        rng = random.Random(seed)
        nodes = [
            n if n.node_id == first.node else dataclasses.replace(n, in_flight=rng.randint(3, 8))
            for n in nodes
        ]
        assert choose(policy, req(session_key="alice"), nodes, seed=seed) == first


def test_session_spreads_keys_and_moves_few_when_a_node_leaves() -> None:
    policy = routing.create("session", CONFIG)
    nodes = [node(f"n{i}") for i in range(5)]
    homes = {k: choose(policy, req(session_key=f"user-{k}"), nodes).node for k in range(500)}
    counts = Counter(homes.values())
    assert len(counts) == 5
    assert min(counts.values()) >= 60  # 100 each on average
    gone = nodes.pop(2)
    policy.forget_node(gone.node_id)
    for k, home in homes.items():
        now_home = choose(policy, req(session_key=f"user-{k}"), nodes).node
        assert now_home == home or home == gone.node_id


def test_session_spills_past_a_node_at_its_bound() -> None:
    policy = routing.create("session", CONFIG)
    nodes = [node(f"n{i}", in_flight=2) for i in range(4)]
    home = choose(policy, req(session_key="bob"), nodes).node
    assert home is not None
    # 4 nodes, 9 in flight: bound = ceil(1.25 * (9 + 1) / 4) = 4; with 10 in flight, still 4
    nodes = [dataclasses.replace(n, in_flight=3 if n.node_id == home else 2) for n in nodes]
    assert choose(policy, req(session_key="bob"), nodes).node == home
    nodes = [dataclasses.replace(n, in_flight=4 if n.node_id == home else 2) for n in nodes]
    spilled = choose(policy, req(session_key="bob"), nodes)
    assert spilled.node not in (None, home)
    assert spilled.reason == f"session: {home} at its load bound, next on the ring"


# --- meridian ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix_load", "expected"),
    [(0, "a"), (8, "a"), (14, "a"), (20, "b"), (30, "b")],
)
def test_meridian_trades_a_whole_cached_prompt_for_about_16_requests(
    prefix_load: int, expected: str
) -> None:
    policy = routing.create("meridian", CONFIG)
    hashes = blocks(*range(8))
    routed(policy, hashes, "a")
    nodes = [node("a", in_flight=prefix_load), node("b")]
    decision = choose(policy, req(block_hashes=hashes), nodes)
    assert decision.node == expected
    assert decision.expected_hit_tokens == (8 * 16 if expected == "a" else 0)
    if expected == "a":
        assert decision.reason.startswith("meridian: prefix 100%")


def test_meridian_prefers_the_longer_partial_prefix() -> None:
    policy = routing.create("meridian", CONFIG)
    routed(policy, blocks(0, 1, 2, 3), "a")
    routed(policy, blocks(0, 9), "b")
    nodes = [node("a", in_flight=1), node("b", in_flight=1), node("c")]
    decision = choose(policy, req(block_hashes=blocks(0, 1, 2, 3, 4, 5, 6, 7)), nodes)
    assert decision.node == "a"
    assert decision.reason.startswith("meridian: prefix 50%")


def test_meridian_weighs_tokens_in_flight_per_unit_of_weight() -> None:
    nodes = [node("a", in_flight_tokens=4000), node("b", in_flight_tokens=1000)]
    assert choose(routing.create("meridian", CONFIG), req(), nodes).node == "b"
    nodes = [node("a", in_flight_tokens=4000, weight=8.0), node("b", in_flight_tokens=1000)]
    assert choose(routing.create("meridian", CONFIG), req(), nodes).node == "a"


@pytest.mark.parametrize(
    ("prefill_ahead", "expected"),
    [(0, "a"), (4_000, "a"), (8_000, "a"), (16_000, "b"), (40_000, "b")],
)
def test_meridian_weighs_the_prefill_queued_ahead_against_a_cached_prefix(
    prefill_ahead: int, expected: str
) -> None:
    # a 4096-token prompt whole in a's cache: a saves 4096 tokens of prefill (0.5 at the
    # default 8192-token norm) and earns the whole-prompt credit (1.0), so a wins until the
    # prefill queued ahead of it there costs more than 1.5, i.e. past about 12k tokens
    policy = routing.create("meridian", CONFIG)
    hashes = blocks(*range(8))
    routed(policy, hashes, "a")
    request = req(prompt_tokens=4096, block_hashes=hashes, block_tokens=512)
    nodes = [node("a", in_flight=1, prefill_tokens=prefill_ahead), node("b", in_flight=1)]
    decision = choose(policy, request, nodes)
    assert decision.node == expected
    if expected == "a":
        assert decision.reason.endswith(f"prefill ahead {prefill_ahead}")


def test_meridian_prefill_term_is_off_at_weight_zero() -> None:
    config = routing.RoutingConfig(meridian_prefill_weight=0.0)
    nodes = [node("a", prefill_tokens=1_000_000), node("b")]
    picks = {
        choose(routing.create("meridian", config), req(), nodes, seed=s).node for s in range(30)
    }
    assert picks == {"a", "b"}
    assert {
        choose(routing.create("meridian", CONFIG), req(), nodes, seed=s).node for s in range(30)
    } == {"b"}


def test_meridian_breaks_exact_ties_with_the_rng() -> None:
    nodes = [node("a"), node("b"), node("c")]
    picks = {
        choose(routing.create("meridian", CONFIG), req(), nodes, seed=s).node for s in range(30)
    }
    assert picks == {"a", "b", "c"}


# --- invariants over random pools -------------------------------------------------------------

_telemetry = st.none() | st.builds(
    Telemetry,
    age_s=st.just(0.5),
    running=st.integers(0, 64),
    waiting=st.integers(0, 40),
    kv_util=st.floats(0.0, 1.0),
    prefix_hit_rate=st.none(),
    block_size=st.just(16),
)


@st.composite
def _pools(draw: st.DrawFn) -> list[NodeView]:
    size = draw(st.integers(0, 7))
    return [
        NodeView(
            node_id=NodeId(f"n{i}"),
            models=draw(
                st.sampled_from([frozenset({"m"}), frozenset({"m", "x"}), frozenset({"x"})])
            ),
            admin=draw(st.sampled_from([AdminState.ACTIVE] * 3 + [AdminState.DRAINING])),
            health=draw(st.sampled_from([Health.HEALTHY] * 3 + list(Health))),
            weight=draw(st.floats(0.1, 10.0)),
            in_flight=draw(st.integers(0, 4)),
            in_flight_tokens=draw(st.integers(0, 20_000)),
            prefill_tokens=draw(st.integers(0, 20_000)),
            slots=draw(st.integers(0, 10)),
            slow_start=draw(st.floats(0.0, 1.0)),
            telemetry=draw(_telemetry),
        )
        for i in range(size)
    ]


_requests = st.builds(
    RequestView,
    model=st.sampled_from(["m", "m", "m", "x", "y"]),
    prompt_tokens=st.integers(1, 4000),
    max_tokens=st.integers(1, 500),
    block_hashes=st.lists(st.integers(0, 2), max_size=6).map(lambda ts: blocks(*ts)),
    session_key=st.none() | st.sampled_from(["s1", "s2", "s3"]),
)


@settings(max_examples=100, deadline=None)
@given(pool=_pools(), requests=st.lists(_requests, min_size=1, max_size=8), seed=st.integers())
def test_no_policy_routes_where_it_must_not(
    pool: list[NodeView], requests: list[RequestView], seed: int
) -> None:
    """For every policy: only ever a candidate; None only when there is none; same inputs and
    rng, same decisions.  Chosen nodes take the request, so slots fill up along the way."""
    for name in routing.NAMES:
        _route_sequence(name, pool, requests, seed)


def _route_sequence(
    name: str, pool: list[NodeView], requests: list[RequestView], seed: int
) -> None:
    policy, twin = routing.create(name, CONFIG), routing.create(name, CONFIG)
    rng, twin_rng = random.Random(seed), random.Random(seed)
    for t, request in enumerate(requests):
        ready = {n.node_id for n in routing.candidates(request, pool)}
        decision = policy.choose(request, pool, now=float(t), rng=rng)
        assert twin.choose(request, pool, now=float(t), rng=twin_rng) == decision, name
        assert decision.reason, name
        if decision.node is None:
            assert not ready, (name, decision)
            continue
        assert decision.node in ready, (name, decision)
        assert 0 <= decision.expected_hit_tokens <= len(request.block_hashes) * 16, name
        policy.observe_routed(request, decision.node, now=float(t))
        twin.observe_routed(request, decision.node, now=float(t))
        pool = [
            dataclasses.replace(n, in_flight=n.in_flight + 1) if n.node_id == decision.node else n
            for n in pool
        ]


@settings(max_examples=100, deadline=None)
@given(pool=_pools(), requests=st.lists(_requests, min_size=1, max_size=12), seed=st.integers())
def test_a_pools_node_views_decide_as_the_same_views_in_a_list(
    pool: list[NodeView], requests: list[RequestView], seed: int
) -> None:
    """``candidates`` and the probation trials read a pool's :class:`NodeViews` by id (its
    routable and probation ids); every policy decides over them as over a plain list of the
    same views, in the same order, request after request, the views replaced in place as the
    pool replaces them when a node takes a request; a trial every other decision."""
    config = dataclasses.replace(CONFIG, probation_every=2)
    for name in routing.NAMES:
        listed, viewed = routing.create(name, config), routing.create(name, config)
        rng, twin_rng = random.Random(seed), random.Random(seed)
        plain, views = list(pool), NodeViews(pool)
        for t, request in enumerate(requests):
            assert routing.candidates(request, views) == routing.candidates(request, plain)
            decision = listed.choose(request, plain, now=float(t), rng=rng)
            assert viewed.choose(request, views, now=float(t), rng=twin_rng) == decision, name
            if decision.node is None:
                continue
            listed.observe_routed(request, decision.node, now=float(t))
            viewed.observe_routed(request, decision.node, now=float(t))
            i = next(i for i, n in enumerate(plain) if n.node_id == decision.node)
            plain[i] = dataclasses.replace(plain[i], in_flight=plain[i].in_flight + 1)
            views.replace(i, plain[i])


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.tuples(st.floats(0.1, 10.0), st.floats(0.0, 1.0)), min_size=1, max_size=8),
    keys=st.lists(st.sampled_from([f"k{i}" for i in range(6)]), max_size=60),
    factor=st.floats(1.0, 2.0),
)
def test_session_never_exceeds_the_bounded_load(
    weights: list[tuple[float, float]], keys: list[str], factor: float
) -> None:
    """After m requests, node i holds at most ceil(c * m * capacity_i / total capacity);
    with equal capacities, ceil(c * m / n)."""
    config = routing.RoutingConfig(session_load_bound_factor=factor)
    policy = routing.create("session", config)
    pool = [node(f"n{i}", weight=w, slow_start=s, slots=10_000) for i, (w, s) in enumerate(weights)]
    capacity = {n.node_id: n.weight * max(n.slow_start, config.slow_start_floor) for n in pool}
    total = sum(capacity.values())
    for m, key in enumerate(keys, start=1):
        decision = choose(policy, req(session_key=key), pool, seed=m)
        pool = [
            dataclasses.replace(n, in_flight=n.in_flight + 1) if n.node_id == decision.node else n
            for n in pool
        ]
        for n in pool:
            assert n.in_flight <= math.ceil(factor * m / total * capacity[n.node_id]), (m, n)


@settings(max_examples=50, deadline=None)
@given(size=st.integers(1, 8), m=st.integers(0, 40), factor=st.floats(1.0, 2.0))
def test_session_bound_with_equal_nodes_is_mirrokni(size: int, m: int, factor: float) -> None:
    """Equal nodes, every one at in_flight b - 1 or b: a key lands on a node under
    ceil(c * (m + 1) / n), and that node is below it."""
    config = routing.RoutingConfig(session_load_bound_factor=factor)
    loads = [m // size + (1 if i < m % size else 0) for i in range(size)]
    pool = [node(f"n{i}", in_flight=load, slots=1000) for i, load in enumerate(loads)]
    bound = math.ceil(factor * (m + 1) / size)
    decision = choose(routing.create("session", config), req(session_key="k"), pool)
    chosen = next(n for n in pool if n.node_id == decision.node)
    assert chosen.in_flight < bound


# --- re-admission: a node on probation gets its trial under every policy ----------------------


def _every_policy(config: routing.RoutingConfig) -> list[routing.Policy]:
    out = [routing.create(name, config) for name in routing.NAMES]
    tables = group_routing.LocalTables({NodeId(f"n{i}"): (GroupId(f"n{i}"), 1.0) for i in range(9)})
    grouped = group_routing.GroupRoutingConfig(
        n_buckets=256, block_tokens=1, probation_every=config.probation_every
    )
    out.append(group_routing.GroupPolicy(tables, grouped))
    return out


@settings(max_examples=60, deadline=None)
@given(
    healthy=st.integers(1, 8),
    busy=st.lists(st.integers(0, 63), min_size=8, max_size=8),
    every=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    sessions=st.booleans(),
)
def test_a_node_on_probation_gets_a_request_within_probation_every_decisions(
    healthy: int, busy: list[int], every: int, seed: int, sessions: bool
) -> None:
    """Whatever the policy, the load and the prompts: the first ``probation_every`` decisions
    after a recovered node is back on probation include one to it (it is a candidate: it serves
    the model and its one slot is free).  Before trials, ``meridian`` never picked it."""
    config = routing.RoutingConfig(probation_every=every)
    rng = random.Random(seed)
    for policy in _every_policy(config):
        nodes = [
            node(f"n{i}", in_flight=busy[i], telemetry=tel(waiting=busy[i] // 8, kv=0.1))
            for i in range(healthy)
        ]
        back = node("n8", health=Health.PROBATION, slow_start=0.1)
        picked_at = None
        for i in range(every):
            key = f"s{rng.randrange(4)}" if sessions else None
            request = req(
                block_hashes=blocks(1, 2, rng.randrange(3)), block_tokens=1, session_key=key
            )
            decision = choose(policy, request, [*nodes, back], seed=rng.randrange(2**32))
            assert decision.node is not None, decision.reason
            if decision.node == back.node_id:
                picked_at = i
                break
            policy.observe_routed(request, decision.node, now=0.0)
            nodes = [
                dataclasses.replace(n, in_flight=min(n.in_flight + 1, 63))
                if n.node_id == decision.node
                else n
                for n in nodes
            ]
        assert picked_at is not None, f"{policy.name}: no trial in {every} decisions"


def test_trials_go_to_the_node_waiting_longest_and_stop_when_none_waits() -> None:
    trials = routing.ProbationTrials(2)
    a, b = node("a", health=Health.PROBATION), node("b", health=Health.PROBATION)
    h = node("h")
    assert trials.pick([h, b]) is None  # b waits from decision 1
    got = trials.pick([h, a, b])
    assert got is not None and got.node == "b" and "probation trial" in got.reason
    assert got.trial  # the dispatcher takes it as it is (no sibling claims)
    assert trials.pick([h, a]) is None
    got = trials.pick([h, a])
    assert got is not None and got.node == "a"
    assert trials.pick([h]) is None and trials.pick([h, a]) is None  # the count starts again
    with pytest.raises(ValueError, match="at least 1"):
        routing.RoutingConfig(probation_every=0)


# -- meridian's bounded candidate set (many nodes) ------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(pool=_pools(), requests=st.lists(_requests, min_size=1, max_size=8), seed=st.integers())
def test_bounded_meridian_routes_only_to_candidates_and_none_only_without_one(
    pool: list[NodeView], requests: list[RequestView], seed: int
) -> None:
    """With a bound below the pool's size, ``meridian`` over the pool's NodeViews still only
    ever picks a candidate, and gives None only when there is none."""
    config = dataclasses.replace(CONFIG, meridian_candidates=2)
    policy = routing.create("meridian", config)
    rng = random.Random(seed)
    for t, request in enumerate(requests):
        views = NodeViews(pool)
        ready = {n.node_id for n in routing.candidates(request, views)}
        decision = policy.choose(request, views, now=float(t), rng=rng)
        if decision.node is None:
            assert not ready, decision
            continue
        assert decision.node in ready, decision
        policy.observe_routed(request, decision.node, now=float(t))
        pool = [
            dataclasses.replace(n, in_flight=n.in_flight + 1) if n.node_id == decision.node else n
            for n in pool
        ]


def test_bounded_meridian_keeps_the_cached_prefix_among_many_nodes() -> None:
    """256 nodes, a bound of 16: the node holding the prompt's blocks is always scored (the
    index's holders join the random sample), so a repeated prompt goes back to it."""
    policy = routing.create("meridian", CONFIG)
    pool = NodeViews(node(f"n{i}", in_flight=1) for i in range(256))
    prompt = req(block_hashes=blocks(*range(12)), prompt_tokens=12 * 16)
    policy.observe_routed(prompt, NodeId("n200"), now=0.0)
    for seed in range(50):
        decision = policy.choose(prompt, pool, now=1.0, rng=random.Random(seed))
        assert decision.node == "n200", decision
        assert decision.expected_hit_tokens == 12 * 16


def test_bounded_meridian_finds_holders_in_the_precise_index_too() -> None:
    """With an engine reporting its blocks (a precise node), the bounded set's holders come
    from both indexes: the precise node that holds the whole prompt is scored and wins over
    the approximate index's holder of its first half, among 256 nodes."""
    policy = routing.create("meridian", CONFIG)
    index = PreciseIndex(capacity_blocks=1000, block_size=16)
    assert routing.attach_precise(policy, index)
    hashes = blocks(*range(12))
    index.set_precise(NodeId("n7"), True)
    index.stored_keys(NodeId("n7"), list(hashes))
    policy.observe_routed(req(block_hashes=hashes[:6]), NodeId("n200"), now=0.0)
    pool = NodeViews(node(f"n{i}", in_flight=1) for i in range(256))
    prompt = req(block_hashes=hashes, prompt_tokens=12 * 16)
    for seed in range(20):
        decision = policy.choose(prompt, pool, now=1.0, rng=random.Random(seed))
        assert decision.node == "n7", decision
        assert decision.expected_hit_tokens == 12 * 16


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 30)), max_size=8),
    limit=st.integers(1, 20),
)
def test_bounded_meridian_takes_the_longest_holders_as_nlargest_does(
    runs: list[tuple[int, int]], limit: int
) -> None:
    """The holders scored: every node of the match when there are no more than
    ``meridian_candidates``, in its order; else the deepest, and among equal depths those first
    in the match's order (``heapq.nlargest`` over the concatenated runs).  The depth of a node
    outside them is its run's."""
    nodes = iter(NodeId(f"n{i}") for i in range(10_000))
    match = [(depth, tuple(itertools.islice(nodes, size))) for depth, size in runs]
    flat = [(n, depth) for depth, run in match for n in run]
    want = flat if len(flat) <= limit else heapq.nlargest(limit, flat, key=lambda item: item[1])
    got = routing._longest(match, limit, len(flat))  # type: ignore[attr-defined]
    assert list(got.items()) == want
    for n, depth in flat:
        assert routing._depth_in(match, n) == depth  # type: ignore[attr-defined]
    assert routing._depth_in(match, NodeId("elsewhere")) == 0  # type: ignore[attr-defined]


def test_bounded_meridian_spreads_load_like_power_of_k_choices() -> None:
    """Without prefixes, 4,096 requests over 256 equal nodes of 64 slots: each decision scores
    the 8 nodes it draws, and no node ends up far above the mean of 16."""
    policy = routing.create("meridian", CONFIG)
    loads = dict.fromkeys((NodeId(f"n{i}") for i in range(256)), 0)
    rng = random.Random(7)
    for _ in range(4096):
        views = NodeViews(node(n, in_flight=k) for n, k in loads.items())
        decision = policy.choose(req(), views, now=0.0, rng=rng)
        assert decision.node is not None
        loads[decision.node] += 1
    assert max(loads.values()) <= 18 and min(loads.values()) >= 14, sorted(loads.values())


def test_bounded_meridian_finds_the_one_node_with_a_free_slot() -> None:
    pool = NodeViews([*(node(f"n{i}", in_flight=64) for i in range(255)), node("free")])
    policy = routing.create("meridian", CONFIG)
    decision = policy.choose(req(), pool, now=0.0, rng=random.Random(1))
    assert decision.node == "free"
    full = NodeViews(node(f"n{i}", in_flight=64) for i in range(256))
    assert policy.choose(req(), full, now=0.0, rng=random.Random(1)).node is None


def test_meridian_scores_each_view_it_is_given_not_the_one_before() -> None:
    """The policy keeps each node's request-free terms with the view they came from: a new
    view of the same node (a dispatch, a completion, a scrape) is scored afresh, and a node
    forgotten leaves nothing behind."""
    policy = routing.create("meridian", CONFIG)
    quiet, busy = tel(waiting=0, kv=0.1), tel(waiting=30, kv=0.95)
    first = [node("a", telemetry=quiet), node("b", telemetry=busy, in_flight=40)]
    assert choose(policy, req(), first).node == "a"
    assert choose(policy, req(), first).node == "a"  # the same views: the terms kept
    second = [node("a", telemetry=busy, in_flight=40), node("b", telemetry=quiet)]
    assert choose(policy, req(), second).node == "b"
    unknown_now = [unknown("a"), node("b", telemetry=busy, in_flight=40)]
    assert choose(policy, req(), unknown_now).node == "a"  # the unknown penalty is the lesser
    policy.forget_node(NodeId("a"))
    assert NodeId("a") not in policy._terms  # type: ignore[attr-defined]


def _reference_meridian_costs(
    request: RequestView, ready: Sequence[NodeView], matches: Sequence[int]
) -> list[float]:
    """The ``meridian`` class docstring's cost, written out plainly (the code before the
    scoring loop was inlined and kept each view's own terms), so that the fast loop is held to
    the same costs, to the last few bits (it adds the view's queue and KV terms, and its two
    penalties, before the request's terms)."""
    cfg = CONFIG
    blocks_ = len(request.block_hashes)
    warm = [min(1.0, max(n.slow_start, cfg.slow_start_floor)) for n in ready]
    tok = [
        (n.in_flight_tokens + request.prompt_tokens + request.max_tokens)
        / (max(n.weight, 1e-6) * w)
        for n, w in zip(ready, warm, strict=True)
    ]
    tok_max = max(max(tok), 1e-12)
    prefill_scale = cfg.meridian_prefill_weight / cfg.meridian_prefill_norm_tokens
    costs = []
    for n, w, matched, t in zip(ready, warm, matches, tok, strict=True):
        telemetry = n.telemetry
        own = max(0, request.prompt_tokens - matched * request.block_tokens)
        waiting = 0 if telemetry is None else telemetry.waiting
        kv = 0.0 if telemetry is None else telemetry.kv_util
        costs.append(
            -cfg.meridian_prefix_weight * (matched / blocks_ if blocks_ else 0.0)
            + cfg.meridian_queue_weight * (n.in_flight + waiting + 1) / (max(n.slots, 1) * w)
            + cfg.meridian_kv_weight * (kv + (1.0 if kv >= cfg.kv_high_watermark else 0.0))
            + cfg.meridian_tokens_weight * t / tok_max
            + prefill_scale * (n.prefill_tokens + own) / (max(n.weight, 1e-6) * w)
            + cfg.meridian_probation_penalty * (n.health is Health.PROBATION)
            + cfg.meridian_unknown_penalty * (telemetry is None)
        )
    return costs


@settings(max_examples=300, deadline=None)
@given(
    pool=_pools(),
    request=_requests,
    matches=st.lists(st.integers(0, 6), min_size=8, max_size=8),
    seed=st.integers(),
)
def test_meridian_scores_each_candidate_by_its_documented_cost(
    pool: list[NodeView], request: RequestView, matches: list[int], seed: int
) -> None:
    """The lowest documented cost wins (ties by ``rng``), whatever the telemetry, warm-up,
    weights, slots and matches; the scores may differ from the plain sum in their last bits
    only, so only a cost that close to the tie bound may count either way."""
    ready = routing.candidates(request, pool)
    if not ready:
        return
    matches = matches[: len(ready)]
    got = routing.create("meridian", CONFIG)
    policy = got._choose  # type: ignore[attr-defined]
    decision = policy(request, ready, now=0.0, rng=random.Random(seed), matches=matches)
    costs = _reference_meridian_costs(request, ready, matches)
    bound, bits = min(costs) + 1e-9, 1e-12
    tied = [i for i, c in enumerate(costs) if c <= bound - bits]
    if tied == [i for i, c in enumerate(costs) if c <= bound + bits]:
        want = tied[0] if len(tied) == 1 else random.Random(seed).choice(tied)
        assert decision.node == ready[want].node_id, (costs, decision)
    else:  # a cost within the last bits of the bound: a tie or not, either is right
        near = {ready[i].node_id for i, c in enumerate(costs) if c <= bound + bits}
        assert decision.node in near, (costs, decision)


class _TailTable:
    """The shared table of prompt tails as a policy sees it (``routing.SiblingTails``): each
    block written names the node its prompt went to and the prompt's length, and a lookup asks
    as the workers' table does (``prefix_index.deepest_written``)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[NodeId, int]] = {}
        self.asked = 0

    def write(self, node_id: NodeId, hashes: Sequence[int], positions: Sequence[int]) -> None:
        self.blocks.update((hashes[p], (node_id, len(hashes))) for p in positions)

    def deepest(self, hashes: Sequence[int], positions: Sequence[int]) -> tuple[NodeId, int] | None:
        self.asked += 1
        return prefix_index.deepest_written(hashes, positions, self.blocks.get)


@pytest.mark.parametrize("name", ["meridian", "prefix_aware"])
@pytest.mark.parametrize("nodes", [4, 40])  # every node scored; a bounded set (meridian)
def test_a_sibling_s_tail_from_the_table_decides_as_the_same_tail_relayed(
    name: str, nodes: int
) -> None:
    """Conversations after one system prompt, their first turns routed by another worker:
    a policy that asks the table for their tails past its own match decides each next turn as
    a policy told every tail (``observe_relayed``), and a policy told neither does not."""
    config = dataclasses.replace(CONFIG, prefix_dense_head_blocks=4, prefix_stride_blocks=4)
    relayed, asking, blind = (routing.create(name, config) for _ in range(3))
    table = _TailTable()
    assert routing.attach_sibling_tails(asking, table.deepest)
    positions = routing.prefix_positions(asking)
    assert positions is not None
    pool = NodeViews(node(f"n{i}", in_flight=i % 3) for i in range(nodes))
    system = list(range(1, 41))  # 40 one-token blocks
    head = blocks(*system)
    for n in ("n0", "n1"):  # the system prompt, told whole (the ring) on two nodes
        for policy in (relayed, asking, blind):
            policy.observe_relayed([(NodeId(n), 0, head)], now=0.0)
    turns = []
    for c in range(12):  # first turns: a sibling sent each to some node, its tail shared
        first = blocks(*system, *range(1000 + 100 * c, 1000 + 100 * c + 13))
        went = NodeId(f"n{(c * 7) % nodes}")
        relayed.observe_relayed([(went, len(head), first[len(head) :])], now=0.0)
        at = positions(len(first))
        table.write(went, first, [p for p in at if p >= len(head)])
        turns.append((first, went))
    for c, (first, went) in enumerate(turns):
        later = req(
            prompt_tokens=len(first) + 9,
            block_hashes=blocks(*system, *range(1000 + 100 * c, 1000 + 100 * c + 13), *range(9)),
            block_tokens=1,
        )
        decision = choose(relayed, later, pool, seed=c)
        assert decision.node == went and decision.expected_hit_tokens == len(first), c
        assert choose(asking, later, pool, seed=c) == decision, c
        assert choose(blind, later, pool, seed=c).expected_hit_tokens == len(head), c
    assert table.asked == len(turns)
