"""The ``groups`` routing policy: a request's bucket → its GPU group in a shared table → a GPU.

The tables themselves (:mod:`policies.groups`: buckets, ranges, assignment, the load guard) are
shared by a region's agents; the agent keeps them in sync with etcd
(``regional_agent.group_routing``) and the fleet simulator keeps one :class:`LocalTables` per
region.  Either way, the policy sees them through the small :class:`Tables` protocol:

* the request's routing key is its session id, else its prompt's prefix key
  (``groups.prefix_key`` over the first ``key_blocks`` block hashes); a request with neither
  goes to the least-loaded node;
* the key's bucket names its home group in the table; ``groups.choose`` keeps it there unless
  the group is far busier per GPU than the least-loaded one, in which case the bucket moves
  (``Tables.move``: the move is published to the other agents);
* inside the group, ``groups.choose_member`` picks a GPU with no shared state: the GPU this
  agent last sent the key to, else rendezvous order under the load guard;
* a node on probation gets its trial request as under every policy
  (``routing.ProbationTrials``).

Pure like every policy: no I/O, no clock (``now`` is passed), no global random (``rng``).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from policies import groups, routing
from policies.groups import GroupId, Kind, Range, Table
from policies.model import Decision, NodeId, NodeView, RequestView
from policies.prefix_index import Tail

NAME: Final = "groups"
KINDS: Final[tuple[Kind, ...]] = ("prefix", "session")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRoutingConfig:
    """The policy's knobs (the agent's ``group_tables`` settings)."""

    n_buckets: int = groups.DEFAULT_BUCKETS
    key_blocks: int = 64  # as the agent's group_tables.key_blocks
    move_abs_threshold: float = 16.0
    move_rel_threshold: float = 1.5
    memory_keys: int = 100_000  # keys whose last GPU the policy remembers (LRU)
    block_tokens: int = 16  # tokens per block of the request's block hashes
    probation_every: int = 16  # as routing.RoutingConfig.probation_every


class Tables(Protocol):
    """What the policy needs of the shared tables."""

    @property
    def group_of(self) -> Mapping[NodeId, GroupId]: ...

    @property
    def weights(self) -> Mapping[GroupId, float]: ...

    def sync(self) -> bool:
        """Follow the pool's groups (nodes come and go); True if they changed."""
        ...

    def table(self, kind: Kind) -> Table: ...

    def move(self, kind: Kind, bucket: int, owner: GroupId) -> None:
        """``bucket`` now belongs to ``owner``: in this agent's view at once, for the others
        when it is published."""
        ...


def load(node: NodeView) -> float:
    """Requests on a node: this agent's in flight, or the engine's running count when other
    agents put more there, plus what waits in the engine.  Unknown telemetry: ours only."""
    if node.telemetry is None:
        return float(node.in_flight)
    return float(max(node.in_flight, node.telemetry.running) + node.telemetry.waiting)


class GroupPolicy:
    """``groups``: see the module docstring."""

    name = NAME

    def __init__(self, tables: Tables, config: GroupRoutingConfig) -> None:
        self.tables = tables
        self.config = config
        self._guard = groups.Guard(
            abs_threshold=config.move_abs_threshold, rel_threshold=config.move_rel_threshold
        )
        self._memory: collections.OrderedDict[int, NodeId] = collections.OrderedDict()
        self._trials = routing.ProbationTrials(config.probation_every)

    def key_of(self, request: RequestView) -> tuple[Kind, int] | None:
        if request.session_key:
            return "session", groups.session_key(request.session_key)
        blocks = request.block_hashes
        if request.block_tokens != self.config.block_tokens or not blocks:
            return None
        key = groups.prefix_key(blocks, key_blocks=self.config.key_blocks)
        return None if key is None else ("prefix", key)

    def choose(
        self,
        request: RequestView,
        nodes: Sequence[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        ready = routing.candidates(request, nodes)
        if not ready:
            return Decision(node=None, reason="groups: no node can take it now")
        trial = self._trials.pick(ready)
        if trial is not None:
            return trial
        tables = self.tables
        tables.sync()
        keyed = self.key_of(request)
        if keyed is None:
            pick = min(ready, key=lambda n: (load(n) + 1) / max(n.weight, 1e-6))
            return Decision(node=pick.node_id, reason="groups: no routing key, least loaded")
        kind, key = keyed
        bucket = groups.bucket_of(key, n_buckets=self.config.n_buckets)
        group_of = tables.group_of
        # group loads over every routable node serving the model, slots full or not: a group
        # whose slots are full waits for them rather than losing its buckets
        per_group: dict[GroupId, list[float]] = {}
        for n in nodes:
            if n.routable and request.model in n.models:
                grp = group_of.get(n.node_id, GroupId(n.node_id))
                per_group.setdefault(grp, []).append(load(n))
        loads = {g: sum(v) / len(v) for g, v in per_group.items()}
        home = tables.table(kind).lookup(bucket)
        choice = groups.choose(home, loads, guard=self._guard, rng=rng)
        grp = GroupId(choice.owner)
        members = {n.node_id: load(n) for n in ready if group_of.get(n.node_id, n.node_id) == grp}
        if not members:
            return Decision(
                node=None, reason=f"groups: {kind} bucket {bucket} -> {grp}, slots full"
            )
        if choice.changed and grp in tables.weights:
            tables.move(kind, bucket, grp)
        remembered = self._memory.get(key)
        member = groups.choose_member(key, members, remembered=remembered, guard=self._guard)
        node = NodeId(member.owner)
        self._memory[key] = node
        self._memory.move_to_end(key)
        while len(self._memory) > self.config.memory_keys:
            self._memory.popitem(last=False)
        return Decision(
            node=node,
            reason=f"groups: {kind} bucket {bucket} -> {grp} ({choice.reason}); {member.reason}",
        )

    def observe_routed(self, request: RequestView, node: NodeId, *, now: float) -> None:
        return None

    def observe_relayed(self, tails: Sequence[Tail], *, now: float) -> None:
        return None

    def forget_node(self, node: NodeId) -> None:
        for key in [k for k, v in self._memory.items() if v == node]:
            del self._memory[key]
        self.tables.sync()


class LocalTables:
    """Tables that one process keeps alone (the fleet simulator; tests): the assignment of the
    groups ``membership()`` names, with every move applied at once.  Nothing is published, so
    agents that share one instance share its moves instantly (an idealised etcd sync)."""

    def __init__(
        self,
        membership: Mapping[NodeId, tuple[GroupId, float]] | None = None,
        *,
        n_buckets: int = groups.DEFAULT_BUCKETS,
        vnodes: int = groups.DEFAULT_VNODES,
        load_factor: float = groups.DEFAULT_LOAD_FACTOR,
    ) -> None:
        self._n_buckets = n_buckets
        self._vnodes = vnodes
        self._load_factor = load_factor
        self._membership: dict[NodeId, tuple[GroupId, float]] = dict(membership or {})
        self.group_of: dict[NodeId, GroupId] = {}
        self.weights: dict[GroupId, float] = {}
        self._tables: dict[Kind, Table] = {}
        self.moves = 0
        self._rebuild()

    def set_membership(self, membership: Mapping[NodeId, tuple[GroupId, float]]) -> None:
        """Nodes joined or left: recompute the assignment (own moves are dropped)."""
        self._membership = dict(membership)
        self._rebuild()

    def sync(self) -> bool:
        return False

    def table(self, kind: Kind) -> Table:
        return self._tables[kind]

    def move(self, kind: Kind, bucket: int, owner: GroupId) -> None:
        self._tables[kind] = self._tables[kind].reassign(bucket, bucket + 1, owner)
        self.moves += 1

    def _rebuild(self) -> None:
        self.group_of = {n: g for n, (g, _) in self._membership.items()}
        weights: dict[GroupId, float] = {}
        for grp, weight in self._membership.values():
            weights[grp] = weights.get(grp, 0.0) + weight
        self.weights = {g: round(w, 6) for g, w in sorted(weights.items())}
        for kind in KINDS:
            if not self.weights:
                self._tables[kind] = Table(
                    kind=kind,
                    n_buckets=self._n_buckets,
                    ranges=(Range(first=0, end=self._n_buckets, owner=""),),
                )
            else:
                self._tables[kind] = groups.assign(
                    self.weights,
                    n_buckets=self._n_buckets,
                    kind=kind,
                    vnodes=self._vnodes,
                    load_factor=self._load_factor,
                )
