"""policies.groups: bucketing, assignment, range tables, diffs, the debouncer and choices."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import groups
from policies.groups import Debouncer, Diff, GroupId, Guard, Range, Table
from policies.model import NodeId

G = [GroupId(f"g{i}") for i in range(8)]
FAST = settings(max_examples=40, deadline=None)


def owners_of(*spans: tuple[int, str]) -> list[str]:
    """``owners_of((3, "a"), (2, "b"))`` → ``["a", "a", "a", "b", "b"]``."""
    return [owner for count, owner in spans for _ in range(count)]


def table(*spans: tuple[int, str]) -> Table:
    return Table.from_owners(owners_of(*spans))


# -- keys and buckets ---------------------------------------------------------------------------


def test_prefix_key_covers_the_first_blocks_only() -> None:
    key = groups.prefix_key((0, 11, 12), key_blocks=2)
    assert key == groups.prefix_key((0, 11, 99, 100), key_blocks=2)
    assert key != groups.prefix_key((0, 21, 12), key_blocks=2)
    assert key != groups.prefix_key((0, 11, 12), key_blocks=3)


def test_prefix_key_of_a_short_prompt_uses_what_it_has() -> None:
    assert groups.prefix_key((), key_blocks=2) is None
    assert groups.prefix_key((0,), key_blocks=2) == groups.prefix_key((0,), key_blocks=1)
    assert groups.prefix_key((0,), key_blocks=2) != groups.prefix_key((0, 1), key_blocks=2)
    with pytest.raises(ValueError, match="key_blocks"):
        groups.prefix_key((0,), key_blocks=0)


def test_block_zero_alone_is_one_bucket_for_everyone() -> None:
    """Why key_blocks defaults to 2: every Mooncake request starts with block 0."""
    one = {groups.prefix_key((0, i), key_blocks=1) for i in range(100)}
    two = {groups.prefix_key((0, i), key_blocks=2) for i in range(100)}
    assert len(one) == 1
    assert len(two) == 100


def test_session_and_prefix_keys_differ_and_buckets_stay_in_range() -> None:
    assert groups.session_key("abc") == groups.session_key("abc")
    assert groups.session_key("abc") != groups.session_key("abd")
    for i in range(200):
        assert 0 <= groups.bucket_of(groups.session_key(str(i)), n_buckets=7) < 7
    with pytest.raises(ValueError, match="n_buckets"):
        groups.bucket_of(1, n_buckets=0)


# -- tables -------------------------------------------------------------------------------------


def test_from_owners_merges_runs_into_ranges() -> None:
    t = table((3, "a"), (2, "b"), (1, "a"))
    assert t.ranges == (
        Range(first=0, end=3, owner="a"),
        Range(first=3, end=5, owner="b"),
        Range(first=5, end=6, owner="a"),
    )
    assert [t.lookup(b) for b in range(6)] == ["a", "a", "a", "b", "b", "a"]
    assert t.shares() == {"a": 4, "b": 2}
    assert t.entries() == {0: t.ranges[0], 3: t.ranges[1], 5: t.ranges[2]}
    with pytest.raises(ValueError, match="outside"):
        t.lookup(6)


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ((Range(first=0, end=2, owner="a"), Range(first=3, end=4, owner="b")), "cover"),
        ((Range(first=0, end=3, owner="a"), Range(first=2, end=4, owner="b")), "cover"),
        ((Range(first=0, end=2, owner="a"), Range(first=2, end=4, owner="a")), "merged"),
        ((Range(first=0, end=2, owner="a"),), "end at 2"),
        ((Range(first=0, end=0, owner="a"), Range(first=0, end=4, owner="b")), "cover"),
    ],
)
def test_a_table_that_does_not_partition_its_buckets_is_refused(
    ranges: tuple[Range, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Table(kind="prefix", n_buckets=4, ranges=ranges)


@pytest.mark.parametrize(
    ("before", "first", "end", "owner", "after"),
    [
        # a move inside a range splits it in three
        (((10, "a"),), 4, 5, "b", ((4, "a"), (1, "b"), (5, "a"))),
        # at either edge, in two
        (((10, "a"),), 0, 2, "b", ((2, "b"), (8, "a"))),
        (((10, "a"),), 8, 10, "b", ((8, "a"), (2, "b"))),
        # next to a range of the new owner: merged with it
        (((4, "a"), (6, "b")), 3, 4, "b", ((3, "a"), (7, "b"))),
        # filling a gap between two ranges of one owner: all three merge
        (((4, "a"), (1, "b"), (5, "a")), 4, 5, "a", ((10, "a"),)),
        # across several ranges
        (((2, "a"), (2, "b"), (2, "c"), (2, "d")), 1, 7, "e", ((1, "a"), (6, "e"), (1, "d"))),
        # to the owner it already has: no change
        (((4, "a"), (6, "b")), 5, 7, "b", ((4, "a"), (6, "b"))),
    ],
)
def test_reassign(
    before: tuple[tuple[int, str], ...],
    first: int,
    end: int,
    owner: str,
    after: tuple[tuple[int, str], ...],
) -> None:
    assert table(*before).reassign(first, end, owner) == table(*after)


def test_reassign_refuses_an_empty_or_outside_span() -> None:
    t = table((4, "a"))
    for first, end in ((2, 2), (-1, 2), (3, 5)):
        with pytest.raises(ValueError, match="span"):
            t.reassign(first, end, "b")


def test_paint_later_ranges_win_and_unknown_owners_are_skipped() -> None:
    base = table((8, "a"))
    painted = base.paint(
        [
            Range(first=2, end=6, owner="b"),
            Range(first=4, end=12, owner="c"),  # clipped to the table
            Range(first=0, end=1, owner="gone"),
        ],
        allowed={"a", "b", "c"},
    )
    assert painted == table((2, "a"), (2, "b"), (4, "c"))


# -- assignment ---------------------------------------------------------------------------------


def test_assign_is_deterministic_compact_and_bounded() -> None:
    t = groups.assign(G, n_buckets=4096)
    assert t == groups.assign(list(reversed(G)), n_buckets=4096)
    assert set(t.shares()) == set(G)
    assert max(t.shares().values()) <= math.ceil(1.25 * 4096 / len(G))
    assert len(t.ranges) <= 2 * groups.DEFAULT_VNODES * len(G)  # arcs, plus bounded spills


def test_assign_weights_groups() -> None:
    t = groups.assign({G[0]: 3.0, G[1]: 1.0}, n_buckets=4000, load_factor=1.1)
    shares = t.shares()
    assert shares[G[1]] <= math.ceil(1.1 * 4000 / 4)
    assert shares[G[0]] > 2 * shares[G[1]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"groups": []}, "at least one group"),
        ({"groups": {G[0]: 0.0}}, "positive"),
        ({"groups": G, "vnodes": 0}, "vnodes"),
        ({"groups": G, "load_factor": 0.9}, "load_factor"),
        ({"groups": G, "n_buckets": 0}, "n_buckets"),
    ],
)
def test_assign_refuses_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        groups.assign(**kwargs)  # type: ignore[arg-type]


def test_partition_cuts_sorted_gpus_into_named_groups() -> None:
    gpus = [NodeId(f"gpu{i}") for i in (3, 1, 2, 0, 4)]
    assert groups.partition(gpus, group_size=2) == {
        "g000": ("gpu0", "gpu1"),
        "g001": ("gpu2", "gpu3"),
        "g002": ("gpu4",),
    }
    with pytest.raises(ValueError, match="group_size"):
        groups.partition(gpus, group_size=0)


group_names = st.lists(
    st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=6),
    min_size=1,
    max_size=24,
    unique=True,
).map(lambda names: [GroupId(n) for n in names])


@FAST
@given(names=group_names, n_buckets=st.integers(1, 2048), vnodes=st.integers(1, 16))
def test_every_bucket_maps_to_exactly_one_group(
    names: list[GroupId], n_buckets: int, vnodes: int
) -> None:
    t = groups.assign(names, n_buckets=n_buckets, vnodes=vnodes)
    # ranges cover [0, n_buckets) in order, without gaps or overlaps
    assert t.ranges[0].first == 0 and t.ranges[-1].end == n_buckets
    assert all(a.end == b.first for a, b in itertools.pairwise(t.ranges))
    owners = t.owners()
    assert len(owners) == n_buckets
    assert set(owners) <= set(names)
    assert [t.lookup(b) for b in range(n_buckets)] == owners
    assert max(t.shares().values()) <= math.ceil(1.25 * n_buckets / len(names))


@FAST
@given(names=group_names, n_buckets=st.integers(1, 2048))
def test_without_a_load_bound_only_the_changed_groups_buckets_move(
    names: list[GroupId], n_buckets: int
) -> None:
    """Plain consistent hashing: adding a group moves exactly the buckets it takes."""
    unbounded = float(len(names) + 1)  # a bound no group can reach
    before = groups.assign(names[:-1] or names, n_buckets=n_buckets, load_factor=unbounded)
    after = groups.assign(names, n_buckets=n_buckets, load_factor=unbounded)
    if len(names) == 1:
        return
    for a, b in zip(before.owners(), after.owners(), strict=True):
        assert a == b or b == names[-1]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    names=group_names.filter(lambda n: len(n) >= 2),
    n_buckets=st.sampled_from([1024, 4096]),
    vnodes=st.sampled_from([8, 16]),
)
def test_a_membership_change_moves_a_bounded_share(
    names: list[GroupId], n_buckets: int, vnodes: int
) -> None:
    """With loads bounded, spills add to the minimum; measured over 1,200 random cases (up to
    48 groups, 1,024-4,096 buckets) the most that moved was 2.8 fair shares: the bound is 4."""
    before = groups.assign(names[:-1], n_buckets=n_buckets, vnodes=vnodes).owners()
    after = groups.assign(names, n_buckets=n_buckets, vnodes=vnodes).owners()
    moved = sum(a != b for a, b in zip(before, after, strict=True))
    assert moved <= 4 * n_buckets / len(names)


# -- diffs --------------------------------------------------------------------------------------

owner_lists = st.integers(1, 64).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from("abc"), min_size=n, max_size=n),
        st.lists(st.sampled_from("abc"), min_size=n, max_size=n),
    )
)


def test_diff_names_puts_and_deletes() -> None:
    old = table((4, "a"), (4, "b"))
    new = table((2, "a"), (6, "b"))
    change = groups.diff(old.entries(), new.entries())
    assert change == Diff(
        puts=(Range(first=0, end=2, owner="a"), Range(first=2, end=8, owner="b")), deletes=(4,)
    )
    assert change.keys == 3 and not change.empty
    assert groups.diff(new.entries(), new.entries()).empty


@FAST
@given(lists=owner_lists)
def test_diff_then_apply_reproduces_the_target(lists: tuple[list[str], list[str]]) -> None:
    old, new = (Table.from_owners(o).entries() for o in lists)
    assert groups.apply(old, groups.diff(old, new)) == new


@FAST
@given(
    owners=st.lists(st.sampled_from("abcd"), min_size=1, max_size=64),
    data=st.data(),
)
def test_reassign_matches_the_owner_list_and_touches_every_changed_key(
    owners: list[str], data: st.DataObject
) -> None:
    t = Table.from_owners(owners)
    first = data.draw(st.integers(0, len(owners) - 1))
    end = data.draw(st.integers(first + 1, len(owners)))
    owner = data.draw(st.sampled_from("abcde"))
    moved = t.reassign(first, end, owner)
    expected = owners[:first] + [owner] * (end - first) + owners[end:]
    assert moved == Table.from_owners(expected)
    touched = t.keys_around(first, end) | moved.keys_around(first, end)
    full = groups.diff(t.entries(), moved.entries())
    assert groups.diff(t.entries(), moved.entries(), among=touched) == full


def test_flat_entries_are_one_key_per_bucket() -> None:
    old = {3: groups.flat_entry(3, NodeId("gpu1"))}
    new = {**old, 9: groups.flat_entry(9, NodeId("gpu2"))}
    assert groups.diff(old, new) == Diff(puts=(Range(first=9, end=10, owner="gpu2"),))


# -- the debouncer ------------------------------------------------------------------------------


def test_debouncer_leading_edge_then_once_per_window() -> None:
    published: dict[int, Range] = {}
    view = {1: groups.flat_entry(1, NodeId("a"))}
    d = Debouncer(window_s=1.0)
    assert d.due_at() is None
    d = d.touch([1])
    assert d.due_at() == -math.inf  # nothing published yet: go at once
    d, change = d.flush(published, view, now=10.0)
    assert change.puts == (view[1],)
    published = groups.apply(published, change)
    view = {**view, 2: groups.flat_entry(2, NodeId("b"))}
    d = d.touch([2])
    assert d.due_at() == 11.0
    d, change = d.flush(published, view, now=10.5)
    assert change.empty and d.dirty == {2}  # too early: kept for later
    d, change = d.flush(published, view, now=11.0)
    assert change.puts == (view[2],) and d.last_at == 11.0


def test_debouncer_touch_without_a_change_publishes_nothing() -> None:
    view = {1: groups.flat_entry(1, NodeId("a"))}
    d = Debouncer(window_s=1.0, last_at=0.0).touch([1])
    d, change = d.flush(view, view, now=5.0)
    assert change.empty and d.due_at() is None and d.last_at == 0.0
    with pytest.raises(ValueError, match="window_s"):
        Debouncer(window_s=-1.0)


@FAST
@given(
    window_s=st.sampled_from([0.0, 0.1, 1.0]),
    steps=st.lists(
        st.tuples(
            st.floats(0.0, 0.7),  # time since the previous step
            st.booleans(),  # True: a change; False: a flush attempt
            st.integers(0, 5),  # the bucket changed
            st.sampled_from("xyz"),  # its new owner
        ),
        max_size=40,
    ),
)
def test_debouncer_keeps_to_its_window_and_never_loses_the_latest_change(
    window_s: float, steps: list[tuple[float, bool, int, str]]
) -> None:
    now = 0.0
    view: dict[int, Range] = {}
    published: dict[int, Range] = {}
    d = Debouncer(window_s=window_s)
    sent_at: list[float] = []
    for gap, is_change, bucket, owner in steps:
        now += gap
        if is_change:
            view[bucket] = groups.flat_entry(bucket, NodeId(owner))
            d = d.touch([bucket])
        else:
            d, change = d.flush(published, view, now=now)
            if not change.empty:
                sent_at.append(now)
                published = groups.apply(published, change)
    assert all(b - a >= window_s for a, b in itertools.pairwise(sent_at))
    due = d.due_at()
    if due is not None:
        d, change = d.flush(published, view, now=max(now, due))
        published = groups.apply(published, change)
    assert published == view
    assert d.due_at() is None


# -- choices ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "loads", "owner", "changed"),
    [
        ("a", {"a": 10.0, "b": 0.0}, "a", False),  # 10 over: under the 16 threshold
        ("a", {"a": 20.0, "b": 10.0}, "a", False),  # 10 over and 2x: not 16 over
        ("a", {"a": 40.0, "b": 20.0}, "b", True),  # 20 over and 2x: moved
        ("a", {"a": 60.0, "b": 42.0}, "a", False),  # 18 over but 1.43x: not 1.5x
        (None, {"a": 3.0, "b": 1.0}, "b", True),  # a new bucket: least loaded
        ("gone", {"a": 3.0, "b": 1.0}, "b", True),  # its owner left
    ],
)
def test_choose(current: str | None, loads: dict[str, float], owner: str, changed: bool) -> None:
    guard = Guard(abs_threshold=16, rel_threshold=1.5)
    choice = groups.choose(current, loads, guard=guard, rng=random.Random(0))
    assert (choice.owner, choice.changed) == (owner, changed)
    assert choice.reason.startswith("table: ")


def test_choose_needs_owners_and_guard_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="no owners"):
        groups.choose("a", {}, guard=Guard(), rng=random.Random(0))
    with pytest.raises(ValueError, match="rel_threshold"):
        Guard(rel_threshold=0.5)
    with pytest.raises(ValueError, match="abs_threshold"):
        Guard(abs_threshold=-1)


def test_choose_member_prefers_memory_then_rendezvous() -> None:
    loads = {NodeId(f"gpu{i}"): 0.0 for i in range(8)}
    guard = Guard(abs_threshold=4, rel_threshold=1.5)
    first = groups.rendezvous(42, loads)[0]
    pick = groups.choose_member(42, loads, remembered=None, guard=guard)
    assert (pick.owner, pick.changed) == (first, True)
    other = next(n for n in loads if n != first)
    kept = groups.choose_member(42, loads, remembered=other, guard=guard)
    assert (kept.owner, kept.changed) == (other, False)
    busy = {**loads, first: 10.0}
    second = groups.rendezvous(42, loads)[1]
    assert groups.choose_member(42, busy, remembered=None, guard=guard).owner == second
    with pytest.raises(ValueError, match="no members"):
        groups.choose_member(42, {}, remembered=None, guard=guard)


@FAST
@given(
    key=st.integers(0, 2**64 - 1),
    loads=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    remembered=st.integers(-1, 7),
)
def test_choose_member_never_picks_a_gpu_the_guard_finds_too_busy(
    key: int, loads: list[int], remembered: int
) -> None:
    by_gpu = {NodeId(f"gpu{i}"): float(v) for i, v in enumerate(loads)}
    guard = Guard(abs_threshold=4, rel_threshold=1.5)
    mem = NodeId(f"gpu{remembered}") if remembered >= 0 else None
    pick = groups.choose_member(key, by_gpu, remembered=mem, guard=guard)
    assert not guard.too_busy(by_gpu[NodeId(pick.owner)], min(by_gpu.values()))


@FAST
@given(key=st.integers(0, 2**64 - 1), n=st.integers(2, 12), gone=st.integers(0, 11))
def test_rendezvous_moves_only_the_keys_of_a_member_that_leaves(
    key: int, n: int, gone: int
) -> None:
    members = [f"gpu{i}" for i in range(n)]
    leaving = members[gone % n]
    before = groups.rendezvous(key, members)[0]
    after = groups.rendezvous(key, [m for m in members if m != leaving])[0]
    assert after == before or before == leaving
