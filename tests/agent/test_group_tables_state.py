"""The agent's group-table state (regional_agent/group_routing/tables.py) and the ``groups``
routing policy over it (policies/group_routing.py), without I/O."""

from __future__ import annotations

import random

import pytest

from policies import groups
from policies.group_routing import GroupPolicy
from policies.groups import GroupId, Range
from policies.model import NodeId, NodeView, RequestView, Telemetry
from regional_agent.group_routing.tables import GroupTables, Stored
from regional_agent.settings import GroupTableSettings, NodeSettings, Settings

NODES = {NodeId(f"n{i}"): GroupId(f"g{i // 2}") for i in range(6)}  # 3 groups of 2


def _tables(**kw: object) -> GroupTables:
    settings = GroupTableSettings.model_validate({"n_buckets": 1024, "debounce_s": 1.0, **kw})
    return GroupTables(settings, membership=lambda: {n: (g, 1.0) for n, g in NODES.items()})


def test_groups_come_from_the_nodes_and_the_base_is_the_assignment() -> None:
    t = _tables()
    assert t.weights == {"g0": 2.0, "g1": 2.0, "g2": 2.0}
    assert t.table("prefix") == groups.assign(t.weights, n_buckets=1024)
    assert t.layout().groups == t.weights and t.layout().n_buckets == 1024


def test_a_move_is_published_once_per_window_with_compares() -> None:
    t = _tables()
    home = t.table("prefix").lookup(100)
    other = GroupId(next(g for g in t.weights if g != home))
    t.move("prefix", 100, other)
    assert t.table("prefix").lookup(100) == other  # routing sees it at once
    publish = t.flush("prefix", now=10.0)
    assert publish is not None and publish.moves == 1
    assert all(rev == 0 for rev in publish.expect.values())  # nothing stored: keys absent
    t.published(publish, revision=42)
    assert t.known("prefix")[100] == Stored(range=Range(first=100, end=101, owner=other),
                                            mod_revision=42)  # fmt: skip
    # a second move within the window waits for its end
    t.move("prefix", 200, other)
    assert t.flush("prefix", now=10.5) is None
    later = t.flush("prefix", now=11.0)
    assert later is not None and later.moves == 1


def test_watched_changes_rebuild_the_view_with_own_moves_on_top() -> None:
    t = _tables()
    base = t.base("prefix")
    own = GroupId(next(g for g in t.weights if g != base.lookup(100)))
    t.move("prefix", 100, own)
    theirs = GroupId(next(g for g in t.weights if g != base.lookup(700)))
    assert t.changed("prefix", 700, Range(first=700, end=701, owner=theirs), 5)
    t.rebuild("prefix")
    assert t.table("prefix").lookup(700) == theirs and t.table("prefix").lookup(100) == own
    # old news (a revision already seen) and deletes
    assert not t.changed("prefix", 700, None, 5)
    assert t.changed("prefix", 700, None, 6)
    t.rebuild("prefix")
    assert t.table("prefix").lookup(700) == base.lookup(700)
    assert not t.changed("prefix", 700, Range(first=700, end=701, owner=theirs), 5)
    # a range of a group this agent does not know is skipped
    t.load("prefix", {300: Stored(range=Range(first=300, end=301, owner="elsewhere"),
                                  mod_revision=9)})  # fmt: skip
    assert t.table("prefix").lookup(300) == base.lookup(300)


def _view(node: str, *, in_flight: int = 0, running: int = 0) -> NodeView:
    return NodeView(
        node_id=NodeId(node),
        models=frozenset({"m"}),
        in_flight=in_flight,
        telemetry=Telemetry(
            age_s=0.1, running=running, waiting=0, kv_util=0.1, prefix_hit_rate=None,
            block_size=16,
        ),
    )  # fmt: skip


def _request(session: str) -> RequestView:
    return RequestView(model="m", prompt_tokens=10, max_tokens=10, session_key=session)


def test_the_policy_follows_the_table_then_picks_a_member_by_rendezvous() -> None:
    t = _tables()
    policy = GroupPolicy(t, t.config(block_tokens=16))
    rng = random.Random(0)
    views = [_view(n) for n in NODES]
    d = policy.choose(_request("conv-1"), views, now=0.0, rng=rng)
    bucket = groups.bucket_of(groups.session_key("conv-1"), n_buckets=1024)
    home = t.table("session").lookup(bucket)
    assert d.node is not None and NODES[d.node] == home and "(table: home)" in d.reason
    again = policy.choose(_request("conv-1"), views, now=0.0, rng=rng)
    assert again.node == d.node and "remembered GPU" in again.reason
    assert t.moves == 0


def test_a_far_busier_group_loses_the_bucket_and_the_move_is_published() -> None:
    t = _tables(move_abs_threshold=4, move_rel_threshold=1.5)
    policy = GroupPolicy(t, t.config(block_tokens=16))
    bucket = groups.bucket_of(groups.session_key("conv-1"), n_buckets=1024)
    home = t.table("session").lookup(bucket)
    # other agents keep the home group busy: the engines report it running
    views = [_view(n, running=20 if g == home else 0) for n, g in NODES.items()]
    d = policy.choose(_request("conv-1"), views, now=0.0, rng=random.Random(0))
    assert d.node is not None and NODES[d.node] != home and "table: moved" in d.reason
    assert t.moves == 1 and t.table("session").lookup(bucket) == NODES[d.node]
    assert t.due_at() is not None  # waiting to be published


def test_settings_name_the_groups_policy_and_check_group_ids() -> None:
    s = Settings(routing={"policy": "groups"}, nodes=[{"url": "http://h:1", "group": "rack-1"}])
    assert s.nodes[0].group == "rack-1"
    with pytest.raises(ValueError, match="group"):
        NodeSettings(url="http://h:1", group="bad group")
    with pytest.raises(ValueError, match="unknown policy"):
        Settings(routing={"policy": "nope"})
