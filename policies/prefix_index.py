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

Not thread-safe, no I/O, no clock: every call takes ``now`` in seconds on the caller's clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.model import NodeId


class PrefixIndex:
    """Chained block hash → {node: last seen}, LRU-bounded to ``capacity_blocks`` entries."""

    __slots__ = ("_capacity_blocks", "_entries", "_ttl_s")

    def __init__(self, *, capacity_blocks: int, ttl_s: float) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1; got {capacity_blocks}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive; got {ttl_s}")
        self._capacity_blocks = capacity_blocks
        self._ttl_s = ttl_s
        # Oldest touch first.  The inner dicts hold one timestamp per node (a handful of nodes).
        self._entries: OrderedDict[int, dict[NodeId, float]] = OrderedDict()

    def __len__(self) -> int:
        """Entries (distinct block hashes) held now, expired ones not yet met included."""
        return len(self._entries)

    def insert(self, hashes: Sequence[int], node: NodeId, *, now: float) -> None:
        """Record that ``node`` holds the prompt whose chained block hashes are ``hashes``.

        Only the first ``capacity_blocks`` hashes are kept: a longer prompt cannot fit anyway,
        and its head is what other prompts share.
        """
        entries = self._entries
        for h in reversed(hashes[: self._capacity_blocks]):
            holders = entries.get(h)
            if holders is None:
                entries[h] = {node: now}
            else:
                holders[node] = now
                entries.move_to_end(h)
        while len(entries) > self._capacity_blocks:
            entries.popitem(last=False)
        self._expire(now)

    def match(self, hashes: Sequence[int], *, now: float) -> dict[NodeId, int]:
        """Leading blocks of ``hashes`` each node holds; nodes holding none are left out.

        A node counts for block ``i`` only if it holds blocks ``0..i`` all within ``ttl_s``.
        Claims found expired on the way are dropped.
        """
        oldest = now - self._ttl_s
        matched: dict[NodeId, int] = {}
        alive: dict[NodeId, None] | None = None  # nodes holding every block so far
        for depth, h in enumerate(hashes):
            holders = self._entries.get(h)
            if holders is None:
                break
            expired = [n for n, seen in holders.items() if seen < oldest]
            for n in expired:
                del holders[n]
            if not holders:
                del self._entries[h]
                break
            if alive is None:
                alive = dict.fromkeys(holders)
            else:
                for n in [n for n in alive if n not in holders]:
                    del alive[n]
                if not alive:
                    break
            for n in alive:
                matched[n] = depth + 1
        return matched

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
