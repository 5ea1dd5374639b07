"""policies.prefix_index: longest leading match, LRU bound, ttl, node removal."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Sequence
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import prefix_index, prompt
from policies.model import NodeId
from policies.prefix_index import ENTRY_BYTES, PrefixIndex

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")


def chain(*tokens: int) -> tuple[int, ...]:
    """Chained hashes of one-token blocks, so ``chain(1, 2)`` is a prefix of ``chain(1, 2, 3)``."""
    return prompt.block_hashes(tokens, block_size=1)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_match_counts_leading_blocks_per_node() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=60)
    index.insert(chain(0, 1, 2, 3), A, now=0)
    index.insert(chain(0, 1, 7), B, now=0)
    assert index.match(chain(0, 1, 2, 9), now=1) == {A: 3, B: 2}
    assert index.match(chain(0, 1, 7, 8), now=1) == {A: 2, B: 3}
    assert index.match(chain(5, 1), now=1) == {}
    assert index.match((), now=1) == {}


def test_sharing_block_zero_is_not_a_hit_on_the_rest() -> None:
    """Every Mooncake request shares block 0: a first-block router sees every node as a hit."""
    index = PrefixIndex(capacity_blocks=100, ttl_s=60)
    index.insert(chain(0, 1, 2, 3, 4), A, now=0)
    index.insert(chain(0, 5), B, now=0)
    matched = index.match(chain(0, 5, 6), now=1)
    assert matched == {A: 1, B: 2}
    assert max(matched, key=matched.__getitem__) == B


def test_a_clock_that_steps_back_cannot_age_a_prompts_head() -> None:
    """A claim is stamped with the latest time seen, so the head of a prompt is never older
    than its tail (the bisection in match relies on it)."""
    index = PrefixIndex(capacity_blocks=100, ttl_s=6)
    index.insert(chain(0, 1, 2), A, now=10)
    index.insert(chain(0), A, now=5)  # stamped 10, not 5
    assert index.match(chain(0, 1, 2), now=14) == {A: 3}
    assert index.match(chain(0, 1, 2), now=17) == {}


def test_lru_evicts_the_least_recently_touched_and_keeps_shared_roots() -> None:
    index = PrefixIndex(capacity_blocks=4, ttl_s=60)
    first, second = chain(0, 1, 2), chain(0, 3, 4)
    index.insert(first, A, now=0)
    index.insert(second, B, now=1)  # 5 distinct blocks: the oldest tail (first's last) goes
    assert len(index) == 4
    assert index.match(first, now=2) == {A: 2, B: 1}
    assert index.match(second, now=2) == {A: 1, B: 3}
    index.insert(chain(9, 8), C, now=3)  # two more: first's block 1 and second's deepest go
    assert len(index) == 4
    assert index.match(first, now=4) == {A: 1, B: 1}
    assert index.match(second, now=4) == {A: 1, B: 2}


def test_a_prompt_longer_than_the_capacity_keeps_its_head() -> None:
    index = PrefixIndex(capacity_blocks=3, ttl_s=60)
    index.insert(chain(*range(10)), A, now=0)
    assert len(index) == 3
    assert index.match(chain(*range(10)), now=1) == {A: 3}


def test_claims_older_than_the_ttl_are_ignored_and_evicted() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=10)
    index.insert(chain(0, 1), A, now=0)
    index.insert(chain(0, 2), B, now=5)
    assert index.match(chain(0, 1), now=10) == {A: 2, B: 1}  # exactly ttl_s old still counts
    assert index.match(chain(0, 1), now=12) == {B: 1}  # A's claims expired
    assert index.match(chain(0, 2), now=16) == {}
    index.insert(chain(7), C, now=16)
    assert len(index) == 1  # what the match did not meet went on insert, oldest first


def test_insert_refreshes_the_claim_and_expires_old_entries() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=10)
    index.insert(chain(5), B, now=0)
    index.insert(chain(0, 1), A, now=0)
    index.insert(chain(0, 1), A, now=8)
    assert index.match(chain(0, 1), now=15) == {A: 2}
    index.insert(chain(6), C, now=15)  # B's block is the oldest and expired: dropped
    assert len(index) == 3


def test_a_tail_insert_stamps_only_the_blocks_past_its_first() -> None:
    """A sibling worker's record of a prompt whose head it sent whole moments ago: the head's
    hashes are not read (stand-ins here), its claims keep their time, and the whole prompt
    matches; once the head's claims expire, the node holds none of it, though the tail's claims
    live on (module docstring)."""
    index = PrefixIndex(capacity_blocks=100, ttl_s=10, stride_blocks=2, dense_head_blocks=2)
    whole = chain(0, 1, 2, 3, 4)
    index.insert(whole, A, now=0)
    longer = chain(0, 1, 2, 3, 4, 5, 6, 7)
    index.insert_tails([(A, 5, longer[5:])], now=1)
    assert len(index) == 6  # blocks 0, 1, 2, 4 (whole's last), 5, 7 (longer's stride and last)
    assert index.match(longer, now=2) == {A: 8}
    assert index.match(longer, now=10) == {A: 8}
    assert index.match(longer, now=10.5) == {}  # the head's claims, from 0, expired


def test_tails_inserted_together_match_as_prompts_inserted_one_by_one() -> None:
    """What a worker takes in from its siblings in one go (``insert_tails``) leaves the index
    as the same prompts inserted one at a time would, heads left out or not."""
    rng = random.Random(3)
    heads = [[rng.randrange(1 << 30) for _ in range(6)] for _ in range(3)]
    prompts = [
        (rng.choice((A, B, C)), chain(*rng.choice(heads), *(rng.randrange(9) for _ in range(3))))
        for _ in range(40)
    ]
    together = PrefixIndex(capacity_blocks=1000, ttl_s=10, stride_blocks=2, dense_head_blocks=3)
    alone = PrefixIndex(capacity_blocks=1000, ttl_s=10, stride_blocks=2, dense_head_blocks=3)
    for node in (A, B, C):  # every head sent whole to every node first
        for head in heads:
            together.insert(chain(*head), node, now=0)
            alone.insert(chain(*head), node, now=0)
    tails = [(node, i % 2 * 6, sent[i % 2 * 6 :]) for i, (node, sent) in enumerate(prompts)]
    together.insert_tails(tails, now=1)
    for node, sent in prompts:
        alone.insert(sent, node, now=1)
    for _, sent in prompts:
        assert together.match(sent, now=2) == alone.match(sent, now=2)
    assert len(together) == len(alone)


def test_remove_node_forgets_its_claims_only() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=60)
    index.insert(chain(0, 1), A, now=0)
    index.insert(chain(0, 2), B, now=0)
    index.remove_node(A)
    assert len(index) == 2  # block 0 (B still holds it) and B's block 1
    assert index.match(chain(0, 1), now=1) == {B: 1}
    index.remove_node(NodeId("never-seen"))
    assert len(index) == 2


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capacity_blocks": 0, "ttl_s": 1}, "capacity_blocks"),
        ({"capacity_blocks": 1, "ttl_s": 0}, "ttl_s"),
    ],
)
def test_bad_bounds_are_refused(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        PrefixIndex(**kwargs)  # type: ignore[arg-type]


_prompts = st.lists(st.integers(min_value=0, max_value=2), max_size=8)


@settings(max_examples=100)
@given(
    inserts=st.lists(st.tuples(st.sampled_from([A, B, C]), _prompts), max_size=12),
    query=_prompts,
    capacity=st.integers(min_value=1, max_value=20),
)
def test_match_agrees_with_a_plain_model(
    inserts: list[tuple[NodeId, list[int]]], query: list[int], capacity: int
) -> None:
    """Without eviction, a node matches the longest common prefix of the query with a prompt
    routed to it; with eviction, never more than that, and the index never exceeds its
    capacity."""
    bounded = PrefixIndex(capacity_blocks=capacity, ttl_s=1e9)
    unbounded = PrefixIndex(capacity_blocks=10_000, ttl_s=1e9)
    expected: dict[NodeId, int] = {}
    for t, (node, tokens) in enumerate(inserts):
        bounded.insert(chain(*tokens), node, now=t)
        unbounded.insert(chain(*tokens), node, now=t)
        depth = _common(tokens, query)
        if depth:
            expected[node] = max(expected.get(node, 0), depth)
        assert len(bounded) <= capacity
    now = len(inserts)
    assert unbounded.match(chain(*query), now=now) == expected
    for node, depth in bounded.match(chain(*query), now=now).items():
        assert 0 < depth <= expected[node]


def _walk(index: PrefixIndex, hashes: Sequence[int], now: float) -> dict[NodeId, int]:
    """PrefixIndex.match as it was before the bisection: every indexed block walked in order
    (the reference the bisection must agree with), on the index's clock (never back)."""
    oldest = max(now, index._latest) - index._ttl_s
    matched: dict[NodeId, int] = {}
    alive: dict[NodeId, None] | None = None
    previous = -1
    entries = index._entries
    for position in index._positions(len(hashes)):
        holders = entries.get(hashes[position])
        if holders is not None and min(holders.values()) < oldest:
            holders = index._holders(hashes[position], oldest)
        if alive is not None and holders is not None and alive.keys() <= holders.keys():
            previous = position
            continue
        leaving: list[NodeId] | None
        if alive is None:
            leaving = [] if holders is None else None
        else:
            leaving = [n for n in alive if holders is None or n not in holders]
        if position - previous > 1 and (leaving is None or leaving):
            index._probe(hashes, previous + 1, position, leaving, holders, oldest, matched)
        if holders is None:
            if alive is None:
                index._probe(hashes, previous + 1, position, None, None, oldest, matched)
            break
        if alive is None:
            alive = dict.fromkeys(holders)
        else:
            for n in leaving or ():
                del alive[n]
                if matched.get(n, 0) < previous + 1:
                    matched[n] = previous + 1
            if not alive:
                break
        previous = position
    for n in alive or ():
        if matched.get(n, 0) < previous + 1:
            matched[n] = previous + 1
    return matched


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from([A, B, C]), _prompts, st.integers(0, 3)),
        st.tuples(st.just("remove"), st.sampled_from([A, B, C]), st.just([]), st.integers(0, 3)),
    ),
    max_size=16,
)


@pytest.mark.parametrize("floors", [False, True], ids=["as-used", "floors-everywhere"])
@settings(max_examples=300)
@given(
    ops=_ops,
    queries=st.lists(_prompts, min_size=1, max_size=4),
    stride=st.integers(min_value=1, max_value=4),
    head=st.integers(min_value=0, max_value=4),
    capacity=st.integers(min_value=1, max_value=30),
    ttl=st.integers(min_value=1, max_value=12),
    later=st.integers(min_value=0, max_value=12),
)
def test_the_bisection_agrees_with_walking_every_block(
    floors: bool,
    ops: list[tuple[str, NodeId, list[int], int]],
    queries: list[list[int]],
    stride: int,
    head: int,
    capacity: int,
    ttl: int,
    later: int,
) -> None:
    """On chained prompts, with claims expiring, evictions and removed nodes, match finds what
    walking every indexed block in order finds.  ``floors``: every block keeps a floor (in use,
    only blocks held by 4 nodes or more do), and the floors are forgotten every third one."""
    with contextlib.ExitStack() as patches:
        if floors:
            patches.enter_context(mock.patch.object(prefix_index, "_FLOOR_MIN_HOLDERS", 1))
            patches.enter_context(mock.patch.object(prefix_index, "_FLOORS_KEPT", 3))
        index = PrefixIndex(
            capacity_blocks=capacity, ttl_s=ttl, stride_blocks=stride, dense_head_blocks=head
        )
        now = 0
        for op, node, tokens, step in ops:
            now += step - 1  # the clock may step back
            if op == "insert":
                index.insert(chain(*tokens), node, now=now)
            else:
                index.remove_node(node)
            if op == "insert" and step % 2:  # matches between inserts drop what they meet
                index.match(chain(*tokens[:-1]), now=now)
        for query, back in zip(queries, (0, later, 1, 0), strict=False):
            hashes = chain(*query)
            reference = copy.deepcopy(index)  # a walk drops the expired claims it meets
            at = now + later - back
            runs = copy.deepcopy(index).match_runs(hashes, now=at)
            assert index.match(hashes, now=at) == _walk(reference, hashes, at)
            in_runs = [n for _, nodes in runs for n in nodes]
            assert len(in_runs) == len(set(in_runs))  # no node in two runs: match concatenates
            assert all(nodes for _, nodes in runs)


# --- stride -----------------------------------------------------------------------------------


def test_a_stride_indexes_every_kth_block_and_the_last() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=60, stride_blocks=4)
    index.insert(chain(*range(10)), A, now=0)  # blocks 3, 7 and 9
    assert len(index) == 3
    assert index.match(chain(*range(10)), now=1) == {A: 10}
    assert index.match(chain(*range(9), 99), now=1) == {A: 8}  # true 9: one block lost
    assert index.match(chain(*range(12)), now=1) == {A: 10}  # extends it: exact
    assert index.match(chain(*range(3), 99), now=1) == {}  # true 3, below the first stride
    assert index.match(chain(0, 1, 2, 3), now=1) == {A: 4}


def test_a_stride_finds_the_last_block_of_a_shorter_prompt_between_strides() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=60, stride_blocks=8)
    index.insert(chain(*range(20)), A, now=0)  # blocks 7, 15, 19
    index.insert(chain(*range(10)), B, now=0)  # blocks 7, 9
    index.insert(chain(*range(5)), C, now=0)  # block 4
    assert index.match(chain(*range(30)), now=1) == {A: 20, B: 10, C: 5}


def test_a_stride_reports_the_estimated_memory() -> None:
    index = PrefixIndex(capacity_blocks=1000, ttl_s=60, stride_blocks=32)
    index.insert(chain(*range(750)), A, now=0)
    assert len(index) == 24  # 23 stride blocks and the last, not 750
    assert index.estimated_bytes() == 24 * ENTRY_BYTES
    assert index.capacity_bytes() == 1000 * ENTRY_BYTES


def test_a_dense_head_indexes_every_block_then_strides() -> None:
    index = PrefixIndex(capacity_blocks=100, ttl_s=60, stride_blocks=8, dense_head_blocks=4)
    index.insert(chain(*range(20)), A, now=0)  # blocks 0-3, 11, 19
    assert len(index) == 6
    assert index.match(chain(*range(3), 99), now=1) == {A: 3}  # in the head: exact
    assert index.match(chain(*range(10), 99), now=1) == {A: 4}  # true 10: the head's 4
    assert index.match(chain(*range(13), 99), now=1) == {A: 12}  # true 13: one block lost
    assert index.match(chain(*range(25)), now=1) == {A: 20}


def test_a_dense_head_finds_a_short_shared_system_prompt() -> None:
    """A 19-block system prompt, then different user messages: no prompt ends on it."""
    system = tuple(range(19))
    for head, found in ((32, {A: 19}), (0, {})):
        index = PrefixIndex(capacity_blocks=100, ttl_s=60, stride_blocks=32, dense_head_blocks=head)
        index.insert(chain(*system, *range(100, 113)), A, now=0)
        index.insert(chain(*range(50, 90)), B, now=0)
        assert index.match(chain(*system, *range(200, 214)), now=1) == found


def test_a_negative_dense_head_is_refused() -> None:
    with pytest.raises(ValueError, match="dense_head_blocks"):
        PrefixIndex(capacity_blocks=1, ttl_s=1, dense_head_blocks=-1)


def test_a_zero_stride_is_refused() -> None:
    with pytest.raises(ValueError, match="stride_blocks"):
        PrefixIndex(capacity_blocks=1, ttl_s=1, stride_blocks=0)


_tokens = st.lists(st.integers(min_value=0, max_value=2), max_size=14)


@settings(max_examples=200)
@given(
    inserts=st.lists(st.tuples(st.sampled_from([A, B, C]), _tokens), max_size=10),
    query=_tokens,
    stride=st.integers(min_value=1, max_value=6),
    head=st.integers(min_value=0, max_value=8),
    capacity=st.integers(min_value=1, max_value=40),
)
def test_a_stride_is_never_deeper_than_the_truth_and_loses_under_a_stride(
    inserts: list[tuple[NodeId, list[int]]],
    query: list[int],
    stride: int,
    head: int,
    capacity: int,
) -> None:
    """With chained hashes, a node's true depth is the longest common prefix of the query with
    a prompt routed to it.  The strided index never reports more; without eviction it reports
    the true depth itself when that is within the dense head or the query extends a routed
    prompt, and otherwise at least the true depth less ``stride - 1``."""
    strided = PrefixIndex(
        capacity_blocks=10_000, ttl_s=1e9, stride_blocks=stride, dense_head_blocks=head
    )
    bounded = PrefixIndex(
        capacity_blocks=capacity, ttl_s=1e9, stride_blocks=stride, dense_head_blocks=head
    )
    for t, (node, tokens) in enumerate(inserts):
        strided.insert(chain(*tokens), node, now=t)
        bounded.insert(chain(*tokens), node, now=t)
        assert len(bounded) <= capacity
    truth: dict[NodeId, int] = {}
    exact: set[NodeId] = set()
    for node, tokens in inserts:
        depth = _common(tokens, query)
        truth[node] = max(truth.get(node, 0), depth)
        if tokens and depth == len(tokens):
            exact.add(node)
    hashes = chain(*query)
    matched = strided.match(hashes, now=len(inserts))
    for node, depth in truth.items():
        got = matched.get(node, 0)
        assert depth - (stride - 1) <= got <= depth
        if depth <= head:
            assert got == depth
        if node in exact and depth == max(
            len(t) for n, t in inserts if n == node and _common(t, query) == len(t)
        ):
            assert got == depth
    for node, depth in bounded.match(hashes, now=len(inserts)).items():
        assert 0 < depth <= truth[node]


def test_a_widely_held_blocks_floor_never_hides_an_expired_claim() -> None:
    """20 nodes hold a prompt; its blocks keep a floor.  Within the TTL of the floor the claims
    are not read; past it they are, and exactly the expired ones are dropped."""
    index = PrefixIndex(capacity_blocks=100, ttl_s=10)
    hashes = chain(1, 2, 3)
    nodes = [NodeId(f"n{i}") for i in range(20)]
    for n in nodes:
        index.insert(hashes, n, now=0)
    assert set(index.match(hashes, now=5)) == set(nodes)  # the floor: 0
    for n in nodes[:-1]:
        index.insert(hashes, n, now=8)  # n19's claim stays at 0
    assert set(index.match(hashes, now=9)) == set(nodes)  # within the floor's TTL
    assert set(index.match(hashes, now=11)) == set(nodes[:-1])  # n19 expired, dropped
    assert index.match(hashes, now=17) == dict.fromkeys(nodes[:-1], 3)  # the floor: 8
    assert index.match(hashes, now=19) == {}  # every claim of 8 expired
