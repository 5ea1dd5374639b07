"""Which node holds which prompt block, as the nodes' own engines report it (vLLM KV events).

The approximate :class:`~policies.prefix_index.PrefixIndex` guesses from where the agent sent
prompts.  This index knows: it is fed the blocks each engine says it stored and removed.  An
engine names a block by its own hash (vLLM's, salted and versioned, which the agent does not
reproduce), so the index re-keys every stored block with the agent's chained hash of the block's
token ids (:func:`policies.prompt.block_hashes`, continuing from the re-keyed parent block).  A
request's block hashes, computed by the agent from the same tokenizer's token ids, then find the
engine's blocks directly: no re-implementation of vLLM's hash, and one key space for every node.

A block whose parent the index never saw (stored before the agent subscribed, and outside the
engine's replay buffer) cannot be re-keyed: it is counted as *unkeyed* and skipped; the next
time the engine stores that prefix it is keyed.  A block of a different size than the agent
hashes with (``block_size``) is refused with :class:`ValueError`, naming both sizes.

Nodes are *precise* while their event stream is in sync (:meth:`set_precise`); the shell asks
:meth:`match` for them and the approximate index for the rest, so the two mix per node.

Memory: at most ``capacity_blocks`` (node, block) entries, about :data:`ENTRY_BYTES` each.  When
an insert goes over, the node holding the most entries loses its least recently stored ones
(an engine caches at most its GPU blocks; a node that reports more is the one to trim).

Not thread-safe, no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Final

from policies import prompt
from policies.model import NodeId

ENTRY_BYTES: Final = 300
"""About what one (node, block) entry costs in CPython 3.11: its slot in the node's ordered
dict with the engine's 32-byte hash and the agent's hash, and the node's count in the block's
holders (281 bytes measured with tracemalloc, tests/policies/test_kv_index.py)."""


class BlockSizeMismatch(ValueError):
    """The engine's blocks are of another size than the agent hashes; the message names the
    setting to change."""


class PreciseIndex:
    """Agent block hash → the nodes whose engines hold that block, from their KV events."""

    __slots__ = ("_block_size", "_by_node", "_capacity", "_holders", "_precise", "_size")

    def __init__(self, *, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1; got {capacity_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1; got {block_size}")
        self._capacity = capacity_blocks
        self._block_size = block_size
        # per node: engine hash -> agent hash, least recently stored first
        self._by_node: dict[NodeId, OrderedDict[Hashable, int]] = {}
        # agent hash -> node -> how many of the node's engine blocks have that key (two engine
        # hashes can share one: vLLM's also cover what the token ids do not, e.g. a salt)
        self._holders: dict[int, dict[NodeId, int]] = {}
        self._precise: set[NodeId] = set()
        self._size = 0

    # -- what it holds ---------------------------------------------------------------------

    def __len__(self) -> int:
        """(node, block) entries held."""
        return self._size

    @property
    def block_size(self) -> int:
        return self._block_size

    def blocks(self, node: NodeId) -> int:
        """Blocks ``node``'s engine holds, as far as the index knows."""
        return len(self._by_node.get(node, ()))

    def holds(self, node: NodeId, engine_hash: Hashable) -> bool:
        """Whether the index has ``node`` holding the block its engine calls ``engine_hash``."""
        return engine_hash in self._by_node.get(node, ())

    def engine_hashes(self, node: NodeId) -> set[Hashable]:
        """The engine's own hashes of every block ``node`` holds, as far as the index knows."""
        return set(self._by_node.get(node, ()))

    def keys(self, node: NodeId) -> set[int]:
        """The agent's hashes of every block ``node``'s engine holds."""
        return set(self._by_node.get(node, {}).values())

    def key_of(self, node: NodeId, engine_hash: Hashable) -> int | None:
        """The agent's hash of the block ``node``'s engine calls ``engine_hash``, if held."""
        mine = self._by_node.get(node)
        return None if mine is None else mine.get(engine_hash)

    def estimated_bytes(self) -> int:
        return self._size * ENTRY_BYTES

    def capacity_bytes(self) -> int:
        return self._capacity * ENTRY_BYTES

    @property
    def precise(self) -> frozenset[NodeId]:
        """Nodes whose events are in sync: their matches come from here."""
        return frozenset(self._precise)

    @property
    def any_precise(self) -> bool:
        return bool(self._precise)

    def is_precise(self, node: NodeId) -> bool:
        return node in self._precise

    def set_precise(self, node: NodeId, precise: bool) -> None:
        """Mark ``node``'s event stream in sync (or not: the approximate index answers for it
        then; what is held here is kept for when it is in sync again)."""
        if precise:
            self._precise.add(node)
        else:
            self._precise.discard(node)

    # -- events ----------------------------------------------------------------------------

    def stored(
        self,
        node: NodeId,
        *,
        parent: Hashable | None,
        hashes: Sequence[Hashable],
        token_ids: Sequence[int],
        block_size: int,
    ) -> int:
        """``node``'s engine stored the blocks ``hashes`` (its hashes, in prompt order) holding
        ``token_ids``, after its block ``parent`` (``None``: from the prompt's start).  Returns
        how many blocks were keyed: 0 when the parent is unknown (the blocks are unkeyed).

        Raises :class:`ValueError` for a block size other than the index's or token ids that are
        not ``len(hashes) * block_size`` long.
        """
        if block_size != self._block_size:
            raise BlockSizeMismatch(
                f"the engine's blocks are {block_size} tokens, the agent hashes "
                f"{self._block_size}-token blocks: set routing.prefix_block_tokens to {block_size}"
            )
        if len(token_ids) != len(hashes) * block_size:
            raise ValueError(
                f"{len(hashes)} blocks of {block_size} tokens need {len(hashes) * block_size} "
                f"token ids, the event carries {len(token_ids)}"
            )
        if not hashes:
            return 0
        mine = self._by_node.get(node)
        if mine is None:
            mine = self._by_node[node] = OrderedDict()
        our_parent: int | None = None
        if parent is not None:
            our_parent = mine.get(parent)
            if our_parent is None:
                return 0
        try:
            keys = prompt.block_hashes(token_ids, block_size=block_size, parent=our_parent)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in 0..2**32-1: {exc}") from exc
        for engine_hash, key in zip(hashes, keys, strict=True):
            old = mine.get(engine_hash)
            if old is not None:
                mine.move_to_end(engine_hash)
                if old == key:
                    continue
                self._drop_holder(old, node)  # the engine reused a hash: it names this now
            else:
                self._size += 1
            mine[engine_hash] = key
            self._hold(key, node)
        if self._size > self._capacity:
            self._trim()
        return len(keys)

    def stored_keys(self, node: NodeId, keys: Sequence[int]) -> int:
        """``node``'s engine stored blocks it names by the agent's own hashes (an engine that
        hashes as the agent does: the fleet simulator's); returns how many."""
        mine = self._by_node.get(node)
        if mine is None:
            mine = self._by_node[node] = OrderedDict()
        for key in keys:
            if key in mine:
                mine.move_to_end(key)
                continue
            self._size += 1
            mine[key] = key
            self._hold(key, node)
        if self._size > self._capacity:
            self._trim()
        return len(keys)

    def removed(self, node: NodeId, hashes: Iterable[Hashable]) -> int:
        """``node``'s engine evicted ``hashes``; returns how many of them were held here."""
        mine = self._by_node.get(node)
        if not mine:
            return 0
        gone = 0
        for engine_hash in hashes:
            key = mine.pop(engine_hash, None)
            if key is not None:
                gone += 1
                self._drop_holder(key, node)
        self._size -= gone
        return gone

    def clear(self, node: NodeId) -> int:
        """Forget every block of ``node`` (its cache was reset, its engine restarted, or its
        stream lost events it cannot replay); returns how many were held."""
        mine = self._by_node.pop(node, None)
        if not mine:
            return 0
        for key in mine.values():
            self._drop_holder(key, node)
        self._size -= len(mine)
        return len(mine)

    def forget(self, node: NodeId) -> None:
        """``node`` left the pool."""
        self.clear(node)
        self._precise.discard(node)

    # -- queries ---------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[NodeId, int]:
        """Leading blocks of ``hashes`` (the agent's chained hashes of a request's prompt) each
        precise node holds; nodes holding none, and nodes not precise, are left out."""
        if not hashes or not self._precise:
            return {}
        holders = self._holders
        first = holders.get(hashes[0])
        if first is None:
            return {}
        alive = first.keys() & self._precise
        matched: dict[NodeId, int] = {}
        depth = 1  # leading blocks every node in alive holds
        while depth < len(hashes):
            found = holders.get(hashes[depth])
            if found is None:
                break
            if not alive <= found.keys():
                for n in alive - found.keys():
                    matched[n] = depth
                alive &= found.keys()
                if not alive:
                    break
            depth += 1
        for n in alive:
            matched[n] = depth
        return matched

    # -- inside ----------------------------------------------------------------------------

    def _hold(self, key: int, node: NodeId) -> None:
        found = self._holders.get(key)
        if found is None:
            self._holders[key] = {node: 1}
        else:
            found[node] = found.get(node, 0) + 1

    def _drop_holder(self, key: int, node: NodeId) -> None:
        found = self._holders.get(key)
        if found is None:
            return
        left = found.get(node, 0) - 1
        if left > 0:
            found[node] = left
            return
        found.pop(node, None)
        if not found:
            del self._holders[key]

    def _trim(self) -> None:
        """Over capacity: the biggest node gives up its least recently stored blocks."""
        excess = self._size - self._capacity
        node = max(self._by_node, key=lambda n: len(self._by_node[n]))
        mine = self._by_node[node]
        for _ in range(min(excess, len(mine))):
            _engine_hash, key = mine.popitem(last=False)
            self._drop_holder(key, node)
            self._size -= 1
        if self._size > self._capacity:  # the biggest node was smaller than the excess
            self._trim()
