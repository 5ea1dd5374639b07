"""The ``oracle`` routing policy: Meridian's cost with perfect knowledge, for comparison only.

It scores nodes with exactly the default policy's cost function (``policies.routing``'s
``meridian``), but the prefix term uses the number of leading prompt blocks each node's KV
cache holds *right now*, read from the simulated engines, instead of the agent's approximate
prefix index; and the fleet simulator gives it fresh telemetry whatever the scrape interval.
The gap between ``meridian`` and ``oracle`` is what approximate, stale knowledge costs.  It
lives in the simulator because no real agent can see inside the nodes' caches.

It scores every node, however many (``meridian_candidates`` 0): the bounded set ``meridian``
scores above 16 nodes is drawn from its prefix index, which the oracle does not keep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from policies import routing
from policies.model import NodeId, NodeView, RequestView
from policies.prefix_index import Tail

CachedBlocks = Callable[[NodeId, RequestView], int]
"""Leading blocks of ``request.block_hashes`` that ``node`` holds in its KV cache now."""


class Oracle(routing._Meridian):
    name = "oracle"

    def __init__(self, config: routing.RoutingConfig, *, cached_blocks: CachedBlocks) -> None:
        super().__init__(dataclasses.replace(config, meridian_candidates=0))
        self._cached_blocks = cached_blocks

    def observe_routed(self, request: RequestView, node: NodeId, *, now: float) -> None:
        return None  # it needs no index: it reads the caches

    def observe_relayed(self, tails: Sequence[Tail], *, now: float) -> None:
        return None

    def _matches(self, request: RequestView, ready: Sequence[NodeView], now: float) -> list[int]:
        if not request.block_hashes:
            return [0] * len(ready)
        return [self._cached_blocks(n.node_id, request) for n in ready]
