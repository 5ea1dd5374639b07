"""Which nodes likely hold which prompt prefixes: a bounded, time-limited index of block hashes.

An entry maps one chained block hash (see :func:`policies.prompt.block_hashes`) to the nodes
believed to hold that block, each with the time it was last seen there.  Because hashes chain,
a node that holds block ``i`` of a prompt held blocks ``0..i-1`` with it, so the useful question
is *how many leading blocks* of a prompt each node holds, which is what :meth:`PrefixIndex.match`
answers.  Matching only the first block is wrong: in real traces (Mooncake) every request shares
block 0, so every node would look like a hit.

The index is approximate.  It is fed by routing decisions ("this prompt went to node A, so A
caches it now") and may be fed by a node's KV-cache events; the node may evict a block without
telling anyone.  Two bounds keep it honest and small:

* ``capacity_blocks``: at most that many entries; the least recently touched entry goes first.
  A prompt's blocks are touched deepest first, so the blocks shared by many prompts (the root of
  the tree) stay longer than the tails that belong to one conversation, as in vLLM's own cache.
* ``ttl_s``: a node's claim on a block older than this is ignored, and dropped when met.

A stride makes the same entries cover more cache.  With ``stride_blocks`` k, :meth:`insert` keeps
only blocks ``k-1, 2k-1, ...`` of a prompt and its last full block; a chained hash stands for
every block before it, so nothing is lost but resolution.  :meth:`match` walks the query's stride
blocks (and its last block); where a node drops out, it probes the at most k-1 blocks in between
for the last blocks of shorter prompts, so a conversation's next turn still finds the whole of
its previous prompt.  A reported depth is never deeper than the true one (the node held that
block) and at most k-1 blocks shallower (the stride block at or below the true depth is indexed).

A stride alone never sees a shared prefix shorter than k blocks that no routed prompt ended on:
a short system prompt followed by different user messages.  So the first ``dense_head_blocks``
blocks of every prompt are indexed densely (every block), and the stride applies after them
(at blocks ``k-1, 2k-1, ...`` past the head).  Within the head a match is exact; beyond it the
bound above holds.  The head costs at most ``dense_head_blocks`` entries per distinct prompt
head, and prompts that share their head share those entries.

An entry costs the agent about :data:`ENTRY_BYTES` (a node or two per entry, CPython 3.11), so
the default 200,000 entries at stride 32 cover up to 6.4M blocks, in about 65 MiB.

The hashes must chain (as :func:`policies.prompt.block_hashes` makes them): :meth:`match` finds
where holders drop out by bisection, which is exact only because a chained block is held with
every block before it.

An insert may leave a prompt's leading blocks out (:meth:`PrefixIndex.insert_tails`: a sibling
worker said where the prompt went moments ago, and said its head at most a second before;
``regional_agent.workers``).
Their claims then stay up to that long older than the tail's, and may expire (or be evicted,
which takes the least recently touched first) before it.  A match then finds less of the prompt
on the node (none of it, once block 0's claim has gone), or, where a shallower block's claim is
fresher than the rest of the head's, may still count the node through the tail.  Either stays
true to what the index records: the tail's claim says the whole prompt was sent there within
``ttl_s``.

Not thread-safe, no I/O, no clock: every call takes ``now`` in seconds on the caller's clock.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final, TypeVar

from policies.model import NodeId

ENTRY_BYTES: Final = 340
"""About what one entry costs in CPython 3.11: its ordered-dict slot and int key, and the inner
dict with one node's float (measured with tracemalloc on 200k entries: 340-400 bytes)."""


_POSITIONS_KEPT: Final = 4096  # prompt lengths whose indexed positions are kept
_FLOOR_MIN_HOLDERS: Final = 4  # entries this widely held keep a floor (see match)
_FLOORS_KEPT: Final = 4096  # floors kept at most (then forgotten, to be found again)
# nodes that hold a prompt's leading blocks to one depth: the depth, and the nodes (iterated in
# the answer's order; ``in`` answers whether a node is one of them)
Run = tuple[int, Collection[NodeId]]
# a prompt sent to a node: the node, its first block given, the hashes from that block on
Tail = tuple[NodeId, int, Sequence[int]]
_H = TypeVar("_H")


def deepest_written(
    hashes: Sequence[int],
    positions: Sequence[int],
    written: Callable[[int], tuple[_H, int] | None],
) -> tuple[_H, int] | None:
    """The deepest of ``positions`` (ascending) whose block of ``hashes`` a table of prompt
    tails holds, and how many leading blocks of ``hashes`` that covers; None when it holds
    none.  ``written(block)`` is the table's entry for a block hash: who holds it and the
    length of the prompt written there.  Because hashes chain, the positions held form a run
    that ends somewhere, and a bisection finds its end; where the prompt written there ended
    before the next of ``positions``, its last block (written too: an index keeps a prompt's
    last block) says whether ``hashes`` go on as far.  The workers' shared table
    (``regional_agent.workers.shared.LoadShare.deepest_tail``) and the fleet simulator's model
    of it both ask this way."""
    found: tuple[_H, int] | None = None
    lo, hi = -1, len(positions)  # held at lo (or before the first), not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        entry = written(hashes[positions[mid]])
        if entry is None:
            hi = mid
        else:
            lo, found = mid, entry
    if found is None:
        return None
    holder, end = found
    depth = positions[lo] + 1
    if depth < end <= len(hashes) and (hi == len(positions) or end <= positions[hi]):
        last = written(hashes[end - 1])
        if last is not None:
            return last[0], end
    return holder, depth


class PrefixIndex:
    """Chained block hash → {node: last seen}, LRU-bounded to ``capacity_blocks`` entries,
    one entry per block of a prompt's first ``dense_head_blocks``, then one per
    ``stride_blocks`` blocks (and its last block)."""

    __slots__ = (
        "_by_length",
        "_capacity_blocks",
        "_entries",
        "_floors",
        "_head",
        "_latest",
        "_stride",
        "_ttl_s",
    )

    def __init__(
        self,
        *,
        capacity_blocks: int,
        ttl_s: float,
        stride_blocks: int = 1,
        dense_head_blocks: int = 0,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1; got {capacity_blocks}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive; got {ttl_s}")
        if stride_blocks < 1:
            raise ValueError(f"stride_blocks must be at least 1; got {stride_blocks}")
        if dense_head_blocks < 0:
            raise ValueError(f"dense_head_blocks must not be negative; got {dense_head_blocks}")
        self._capacity_blocks = capacity_blocks
        self._ttl_s = ttl_s
        self._stride = stride_blocks
        self._head = dense_head_blocks
        # Oldest touch first.  The inner dicts hold one timestamp per node (a handful of nodes).
        self._entries: OrderedDict[int, dict[NodeId, float]] = OrderedDict()
        self._by_length: dict[int, tuple[int, ...]] = {}
        # block hash -> a time no claim on it is older than: see match
        self._floors: dict[int, float] = {}
        self._latest = -math.inf  # the latest ``now`` given to insert or match

    def __len__(self) -> int:
        """Entries (distinct block hashes) held now, expired ones not yet met included."""
        return len(self._entries)

    def estimated_bytes(self) -> int:
        """About what the entries held now cost (``len(self) * ENTRY_BYTES``)."""
        return len(self._entries) * ENTRY_BYTES

    def capacity_bytes(self) -> int:
        """About what the index costs when full (``capacity_blocks * ENTRY_BYTES``)."""
        return self._capacity_blocks * ENTRY_BYTES

    def positions(self, length: int) -> tuple[int, ...]:
        """The block positions of a prompt of ``length`` blocks that the index keeps, ascending
        (the class docstring's)."""
        return self._positions(length)

    def _positions(self, length: int) -> tuple[int, ...]:
        """Indexed block positions of a prompt of ``length`` blocks: every one in the dense
        head, then every stride-th past it, and the last (kept by length: prompts repeat their
        lengths, and this runs twice a request)."""
        positions = self._by_length.get(length)
        if positions is None:
            head, k = min(self._head, length), self._stride
            found = list(range(head))
            found += range(head + k - 1, length, k)
            if length and (not found or found[-1] != length - 1):
                found.append(length - 1)
            if len(self._by_length) >= _POSITIONS_KEPT:
                self._by_length.clear()
            positions = self._by_length[length] = tuple(found)
        return positions

    def insert(self, hashes: Sequence[int], node: NodeId, *, now: float) -> None:
        """Record that ``node`` holds the prompt whose chained block hashes are ``hashes``.

        Only the first ``capacity_blocks`` indexed blocks are kept: a longer prompt cannot fit
        anyway, and its head is what other prompts share.  A claim is stamped with the latest
        ``now`` given to the index so far (here or to :meth:`match`), so a clock that steps
        back cannot make a block look older than the blocks after it (:meth:`match` relies on
        that).
        """
        self.insert_tails(((node, 0, hashes),), now=now)

    def insert_tails(self, tails: Iterable[Tail], *, now: float) -> None:
        """:meth:`insert` each ``(node, first, hashes)``: a prompt whose blocks from ``first`` on
        are ``hashes`` went to ``node``; its leading ``first`` blocks are left as they are (the
        module docstring says what that may do to a match).  Cheaper than an insert a prompt
        (one clock check, one bound and expiry pass): a worker takes its siblings' records in
        so, several at a time."""
        if now < self._latest:
            now = self._latest
        self._latest = now
        entries = self._entries
        capacity = self._capacity_blocks
        for node, first, hashes in tails:
            positions = self._positions(first + len(hashes))[:capacity]
            if first > 0:
                positions = positions[bisect.bisect_left(positions, first) :]
            for i in reversed(positions):
                h = hashes[i - first]
                holders = entries.get(h)
                if holders is None:
                    entries[h] = {node: now}
                else:
                    holders[node] = now
                    entries.move_to_end(h)
        while len(entries) > capacity:
            entries.popitem(last=False)
        self._expire(now)

    def match(self, hashes: Sequence[int], *, now: float) -> dict[NodeId, int]:
        """Leading blocks of ``hashes`` each node holds; nodes holding none are left out.

        A node counts for block ``i`` only if it holds every indexed block up to ``i`` within
        ``ttl_s``.  With a stride, a node that drops out between two stride blocks is matched to
        the deepest block in between that it holds (the last block of a shorter prompt), else to
        the last stride block it held.  Claims found expired on the way are dropped.

        A block held by many nodes (a system prompt every node has) keeps a floor: the oldest
        of its claims when last checked.  Claims are only ever stamped with the latest time the
        index was given, and only removed otherwise, so no claim on that block is older than
        its floor from then on, even through an eviction and a new entry; while the floor is
        within ``ttl_s`` none has expired and the claims need not be read.

        Cost: because hashes chain, the live holders of the prompt's indexed blocks are nested
        (a node holding one holds every one before it, with a claim at least as recent: an
        insert stamps a prompt's every indexed block at once, and the eviction order keeps the
        shallower), so where two indexed blocks have as many live holders they have the same,
        and so has every block between them.  The blocks where a holder drops out are found by
        bisection: a few lookups per distinct depth instead of one per indexed block.
        """
        matched: dict[NodeId, int] = {}
        for depth, nodes in self.match_runs(hashes, now=now):
            matched.update(dict.fromkeys(nodes, depth))
        return matched

    def match_runs(self, hashes: Sequence[int], *, now: float) -> list[Run]:
        """:meth:`match`'s answer as runs of nodes at one depth, in its order: :meth:`match` is
        their concatenation, and no node is in two runs.  Nothing is built per node for a run
        whose nodes leave together: a prompt on every node is one run, the index's own holders
        of its last shared block, so read the runs before the index changes (the next
        :meth:`insert` or match)."""
        positions = self._positions(len(hashes))
        count = len(positions)
        runs: list[Run] = []
        if not count:
            return runs
        if now < self._latest:
            now = self._latest  # a claim dropped as expired at a later time stays dropped
        self._latest = now
        oldest = now - self._ttl_s
        entries = self._entries
        floors = self._floors

        def holders_at(j: int) -> dict[NodeId, float] | None:
            """The live holders of the ``j``-th indexed block (``None``: none)."""
            h = hashes[positions[j]]
            found = entries.get(h)
            if found is None:
                return None
            floor = floors.get(h)
            if floor is not None and floor >= oldest:
                return found  # no claim is older than the floor: none has expired
            least = min(found.values())
            if least < oldest:
                return self._holders(h, oldest)  # drops the expired claims
            if len(found) >= _FLOOR_MIN_HOLDERS:
                if len(floors) >= _FLOORS_KEPT:
                    floors.clear()
                floors[h] = least
            return found

        first = holders_at(0)
        if positions[0] > 0:  # a stride before any indexed block: shorter prompts' last blocks
            probed: dict[NodeId, int] = {}
            self._probe(hashes, 0, positions[0], None, first, oldest, probed)
            runs += [(d, (n,)) for n, d in probed.items()]
        if first is None:
            return runs
        # (lo, hi, holders at lo, at hi; past the end: none), holders at lo more than at hi: a
        # node drops out in between
        pending: list[tuple[int, int, dict[NodeId, float], dict[NodeId, float] | None]] = [
            (0, count, first, None)
        ]
        while pending:
            lo, hi, at_lo, at_hi = pending.pop()
            if hi - lo > 1:
                # The first split is at the last indexed block but one, later ones halve: a
                # prompt's new part is most often its last block (a new message after a system
                # prompt or a conversation's earlier turns), and then one lookup finds the rest
                # held alike, where halving takes one lookup a halving.
                mid = hi - 2 if hi == count and lo == 0 and hi > 2 else (lo + hi) // 2
                at_mid = holders_at(mid)
                size = 0 if at_mid is None else len(at_mid)
                if size != len(at_lo):  # else the same holders from lo to mid
                    pending.append((lo, mid, at_lo, at_mid))
                if at_mid is not None and size != (0 if at_hi is None else len(at_hi)):
                    pending.append((mid, hi, at_mid, at_hi))
                continue
            # the holders at lo that leave (past the end: all of them, the index's own dict)
            leaving: Mapping[NodeId, object] = (
                at_lo if at_hi is None else dict.fromkeys([n for n in at_lo if n not in at_hi])
            )
            depth = positions[lo] + 1  # held every indexed block up to lo
            stop = positions[hi] if hi < count else depth
            if stop > depth:  # between two indexed blocks: the deepest one each node holds
                probed = {}
                self._probe(hashes, depth, stop, leaving, at_hi, oldest, probed)
                if probed:  # these first, one by one, as found; the others at depth
                    runs += [(d, (n,)) for n, d in probed.items()]
                    leaving = dict.fromkeys([n for n in leaving if n not in probed])
            if leaving:
                runs.append((depth, leaving))
        return runs

    def _probe(
        self,
        hashes: Sequence[int],
        start: int,
        stop: int,
        leaving: Mapping[NodeId, object] | None,
        holders: dict[NodeId, float] | None,
        oldest: float,
        matched: dict[NodeId, int],
    ) -> None:
        """Match the nodes in ``leaving`` (``None``: any node not in ``holders``) to the deepest
        block in ``start..stop-1`` they hold: the last block of a shorter prompt."""
        entries = self._entries
        for position in range(start, stop):
            if hashes[position] not in entries:  # most often: a block no prompt ended on
                continue
            found = self._holders(hashes[position], oldest)
            if found is None:
                continue
            for n in found:
                if (n in leaving) if leaving is not None else (holders is None or n not in holders):
                    matched[n] = position + 1

    def _holders(self, h: int, oldest: float) -> dict[NodeId, float] | None:
        """The live claims on ``h``, expired ones dropped; ``None`` when there are none."""
        holders = self._entries.get(h)
        if holders is None:
            return None
        expired = [n for n, seen in holders.items() if seen < oldest]
        for n in expired:
            del holders[n]
        if not holders:
            del self._entries[h]
            return None
        return holders

    def remove_node(self, node: NodeId) -> None:
        """Forget every claim of ``node`` (it left the pool, or its cache was reset)."""
        emptied = []
        for h, holders in self._entries.items():
            if holders.pop(node, None) is not None and not holders:
                emptied.append(h)
        for h in emptied:
            del self._entries[h]

    def _expire(self, now: float) -> None:
        """Drop entries from the old end whose every claim is older than ``ttl_s``."""
        oldest = now - self._ttl_s
        entries = self._entries
        while entries:
            h, holders = next(iter(entries.items()))
            if max(holders.values()) >= oldest:
                return
            del entries[h]
