"""The precise index: blocks re-keyed from the engines' token ids, matched like vLLM's own
lookup (the leading run a node holds), bounded in memory."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import kv_index, prompt
from policies.kv_index import PreciseIndex
from policies.model import NodeId

A, B = NodeId("a"), NodeId("b")
BS = 4


def _index(capacity: int = 1000) -> PreciseIndex:
    index = PreciseIndex(capacity_blocks=capacity, block_size=BS)
    index.set_precise(A, True)
    index.set_precise(B, True)
    return index


def _engine(tokens: list[int], tag: str = "") -> list[bytes]:
    """Stand-in engine hashes: anything unique per prefix (vLLM's are salted SHA-256)."""
    return [f"{tag}{tokens[: (i + 1) * BS]}".encode() for i in range(len(tokens) // BS)]


TOKENS = list(range(100, 120))  # 5 blocks


def test_a_stored_prompt_is_found_by_the_agents_own_hashes() -> None:
    index = _index()
    eh = _engine(TOKENS)
    assert index.stored(A, parent=None, hashes=eh[:2], token_ids=TOKENS[:8], block_size=BS) == 2
    assert index.stored(A, parent=eh[1], hashes=eh[2:], token_ids=TOKENS[8:], block_size=BS) == 3
    ours = prompt.block_hashes(TOKENS, block_size=BS)
    assert index.match(ours) == {A: 5}
    assert index.match(ours[:3]) == {A: 3}
    longer = prompt.block_hashes([*TOKENS, 1, 2, 3, 4], block_size=BS)
    assert index.match(longer) == {A: 5}
    other = prompt.block_hashes([*TOKENS[:4], 9, 9, 9, 9], block_size=BS)
    assert index.match(other) == {A: 1}
    assert index.key_of(A, eh[4]) == ours[4]
    assert index.blocks(A) == 5 and len(index) == 5


def test_two_nodes_and_a_removed_block_in_the_middle() -> None:
    index = _index()
    eh = _engine(TOKENS)
    index.stored(A, parent=None, hashes=eh, token_ids=TOKENS, block_size=BS)
    index.stored(B, parent=None, hashes=eh[:2], token_ids=TOKENS[:8], block_size=BS)
    ours = prompt.block_hashes(TOKENS, block_size=BS)
    assert index.match(ours) == {A: 5, B: 2}
    assert index.removed(A, [eh[2], b"never stored"]) == 1
    assert index.match(ours) == {A: 2, B: 2}  # vLLM's lookup stops at the first missing block
    assert index.removed(B, eh) == 2
    assert index.match(ours) == {A: 2}


def test_a_block_whose_parent_was_never_seen_is_unkeyed() -> None:
    index = _index()
    eh = _engine(TOKENS)
    assert index.stored(A, parent=eh[1], hashes=eh[2:], token_ids=TOKENS[8:], block_size=BS) == 0
    assert len(index) == 0
    assert index.match(prompt.block_hashes(TOKENS, block_size=BS)) == {}


def test_clear_and_not_precise() -> None:
    index = _index()
    eh = _engine(TOKENS)
    index.stored(A, parent=None, hashes=eh, token_ids=TOKENS, block_size=BS)
    index.stored(B, parent=None, hashes=eh, token_ids=TOKENS, block_size=BS)
    ours = prompt.block_hashes(TOKENS, block_size=BS)
    index.set_precise(B, False)
    assert index.match(ours) == {A: 5}  # B's blocks kept, not answered for
    index.set_precise(B, True)
    assert index.match(ours) == {A: 5, B: 5}
    assert index.clear(A) == 5
    assert index.match(ours) == {B: 5}
    index.forget(B)
    assert index.match(ours) == {} and len(index) == 0 and index.precise == frozenset({A})


def test_refuses_other_block_sizes_and_bad_lengths() -> None:
    index = _index()
    with pytest.raises(ValueError, match=r"set routing\.prefix_block_tokens to 16"):
        index.stored(A, parent=None, hashes=[b"x"], token_ids=list(range(16)), block_size=16)
    with pytest.raises(ValueError, match="need 8 token ids, the event carries 7"):
        index.stored(A, parent=None, hashes=[b"x", b"y"], token_ids=list(range(7)), block_size=BS)
    with pytest.raises(ValueError, match="capacity_blocks"):
        PreciseIndex(capacity_blocks=0, block_size=BS)


def test_over_capacity_the_biggest_node_loses_its_oldest_blocks() -> None:
    index = _index(capacity=6)
    eh = _engine(TOKENS)
    index.stored(A, parent=None, hashes=eh, token_ids=TOKENS, block_size=BS)
    other = list(range(1, 9))
    index.stored(B, parent=None, hashes=_engine(other, "b"), token_ids=other, block_size=BS)
    assert len(index) == 6 and index.blocks(B) == 2 and index.blocks(A) == 4
    assert not index.holds(A, eh[0])  # the least recently stored went first
    assert index.match(prompt.block_hashes(TOKENS, block_size=BS)) == {}  # block 0 is gone
    assert index.estimated_bytes() == 6 * kv_index.ENTRY_BYTES


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear"]),
            st.sampled_from([A, B]),
            st.lists(st.integers(0, 2), min_size=1, max_size=12),  # tiny alphabet: shared prefixes
            st.integers(0, 3),
        ),
        max_size=30,
    ),
    st.lists(st.integers(0, 2), max_size=16),
)
def test_matches_a_brute_force_model(
    ops: list[tuple[str, NodeId, list[int], int]], query: list[int]
) -> None:
    """Store whole prompts, remove one block, clear: the index answers as the set of prefixes
    each node holds does."""
    index = _index()
    held: dict[NodeId, dict[bytes, int]] = {A: {}, B: {}}  # engine hash -> our hash
    for op, node, raw, pick in ops:
        tokens = [t for t in raw for _ in range(BS)]  # whole blocks, one symbol each
        eh = _engine(tokens)
        ours = prompt.block_hashes(tokens, block_size=BS)
        if op == "store":
            index.stored(node, parent=None, hashes=eh, token_ids=tokens, block_size=BS)
            held[node].update(zip(eh, ours, strict=True))
        elif op == "remove" and eh:
            victim = eh[pick % len(eh)]
            index.removed(node, [victim])
            held[node].pop(victim, None)
        elif op == "clear":
            index.clear(node)
            held[node].clear()
    q = prompt.block_hashes([t for t in query for _ in range(BS)], block_size=BS)
    want: dict[NodeId, int] = {}
    for node, blocks in held.items():
        keys = set(blocks.values())
        depth = 0
        while depth < len(q) and q[depth] in keys:
            depth += 1
        if depth:
            want[node] = depth
    assert index.match(q) == want
    assert len(index) == sum(len(b) for b in held.values())


def test_entry_bytes_is_an_upper_bound() -> None:
    """ENTRY_BYTES against tracemalloc over 10,000 (node, block) entries on 4 nodes, each block
    held by two nodes, the engine hashes made fresh as the wire decodes them (32 bytes each)."""
    index = PreciseIndex(capacity_blocks=10**6, block_size=16)
    prompts = [[p * 1000 + t for t in range(16 * 50)] for p in range(100)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(4):
        node = NodeId(f"n{n}")
        for p in range(n * 25, n * 25 + 50):  # overlapping halves: blocks held by two nodes
            q = p % 100
            hashes = [q.to_bytes(2, "big") + i.to_bytes(30, "big") for i in range(50)]
            index.stored(node, parent=None, hashes=hashes, token_ids=prompts[q], block_size=16)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(index) == 10_000
    print(f"{used / len(index):.0f} bytes an entry")
    assert used / len(index) <= kv_index.ENTRY_BYTES


def test_two_engine_blocks_with_one_key_count_twice() -> None:
    """vLLM's hash covers what token ids do not (a cache salt, an image): two engine blocks of
    the same tokens share the agent's key, and the node holds it until both are gone."""
    index = _index()
    tokens = TOKENS[:4]
    key = prompt.block_hashes(tokens, block_size=BS)
    index.stored(A, parent=None, hashes=[b"salted"], token_ids=tokens, block_size=BS)
    index.stored(A, parent=None, hashes=[b"plain"], token_ids=tokens, block_size=BS)
    assert len(index) == 2 and index.match(key) == {A: 1}
    index.removed(A, [b"salted"])
    assert index.match(key) == {A: 1}  # the other copy is still there
    index.removed(A, [b"plain"])
    assert index.match(key) == {} and len(index) == 0


def test_token_ids_that_are_not_token_ids_are_a_value_error() -> None:
    index = _index()
    with pytest.raises(ValueError, match=r"0\.\.2\*\*32-1"):
        index.stored(A, parent=None, hashes=[b"x"], token_ids=[2**40, 1, 2, 3], block_size=BS)
    with pytest.raises(kv_index.BlockSizeMismatch):
        index.stored(A, parent=None, hashes=[b"x"], token_ids=list(range(8)), block_size=8)
    assert len(index) == 0 and index.blocks(A) == 0
