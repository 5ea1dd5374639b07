"""Routing policies: which node takes a request, and why.

The agent's shell builds a :class:`~policies.model.RequestView` and one
:class:`~policies.model.NodeView` per node, and asks the configured policy::

    policy = routing.create(settings.routing.policy, config)
    decision = policy.choose(request, nodes, now=clock.now(), rng=rng)
    if decision.node is not None:
        send(...)
        policy.observe_routed(request, decision.node, now=clock.now())

Every policy first narrows the pool to :func:`candidates` (routable, serves the model, has a free
slot) and returns ``Decision(node=None, reason=...)`` when none is left, so no policy can route
to a draining, ejected or unhealthy node, to one that does not serve the model or to a full one.

**Probation trials** (every policy, :class:`ProbationTrials`): a node back from an ejection is on
PROBATION with one slot until a request succeeds there, and a policy's own preferences (a
probation penalty, a tiny share, a cached prefix elsewhere) may never pick it, so it would stay
out for good.  So a candidate on probation is given the request whenever ``probation_every``
decisions have passed since the last trial (or since it became a candidate): each such node gets
a trial within that many requests whatever the policy and the load, as Envoy's half-open hosts
do.  A success makes it HEALTHY, and slow start ramps it up from there.

Shared definitions (the docs call them by these names):

``load``
    The agent's own ``in_flight`` plus the engine's ``waiting`` from telemetry.  When a node's
    telemetry is unknown (``None``), its ``waiting`` is taken to be the largest ``waiting`` among
    the candidates whose telemetry is known (0 when none is known): an unscraped node is never
    assumed idle, and on equal load a node with known telemetry wins.
``warm``
    ``slow_start`` clamped to ``[slow_start_floor, 1]``: the share of full traffic a node that
    is warming up should get.
``share``
    ``warm``, times ``probation_share`` for a node on probation (half-open after an ejection).
    Probation nodes also have one slot only (:attr:`NodeView.has_slot`).
``capacity``
    ``weight * share``: the node's relative share of traffic.
``effective load``
    ``(load + 1) / capacity``: the load the node would have after taking this request, per unit
    of capacity (as Envoy's and nginx's least-request balancers do with weights).  Ties go to a
    healthy node over a probation node, then to known telemetry over unknown, then to ``rng``.

Policies keep small state (a rotation, a hash ring, a prefix index) and are deterministic given
the sequence of calls, their inputs and ``rng``.  ``choose`` advances rotations; the prefix index
learns only from ``observe_routed``.  Policies do not log: the shell logs ``Decision.reason``.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Final, Protocol

from policies.kv_index import PreciseIndex
from policies.model import (
    Decision,
    Health,
    NodeId,
    NodeView,
    NodeViews,
    RequestView,
    decision_later,
)
from policies.prefix_index import PrefixIndex, Run, Tail

NAMES: Final[tuple[str, ...]] = (
    "round_robin",
    "random",
    "least_connections",
    "least_tokens",
    "power_of_two",
    "jsq",
    "kv_aware",
    "prefix_aware",
    "session",
    "weighted",
    "meridian",
)

_MIN_WEIGHT: Final = 1e-6  # NodeView.weight must be > 0; a bad one must not divide by zero
_TIE: Final = 1e-9  # meridian scores closer than this are ties


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    """Every routing tunable, with its unit and default.  Out-of-range values raise ValueError."""

    # prefix index (prefix_aware, meridian)
    prefix_capacity_blocks: int = 200_000
    """Most block hashes the prefix index keeps (LRU); each entry costs the agent about 0.33
    KiB (``prefix_index.ENTRY_BYTES``; 65 MiB at this default).  With ``prefix_stride_blocks``
    k the entries cover k times as many cached blocks: an H100 with Llama-3-8B caches about
    28k 16-token blocks, so 200k entries cover about seven such nodes' caches at stride 1 and
    about 228 at stride 32."""
    prefix_stride_blocks: int = 32
    """Index every this-many-th block of a prompt, and its last one (``PrefixIndex``): a
    match is then found to within this many blocks (512 tokens at 16-token blocks), never
    deeper than the truth, and exact for a prompt that extends a routed one."""
    prefix_dense_head_blocks: int = 32
    """Index every one of a prompt's first this-many blocks before the stride starts, so that a
    shared prefix this short (512 tokens at 16-token blocks: a system prompt) is matched exactly
    even when no routed prompt ended on it; 0 strides from the first block.  Costs at most this
    many entries per distinct prompt head."""
    prefix_ttl_s: float = 120.0
    """A node's claim on a block older than this is ignored (peers evict every 60-120 s)."""
    precise_pending_s: float = 2.0
    """On a node whose KV events feed the precise index (:func:`attach_precise`), a prompt the
    agent routed there counts as cached for this long before the engine's events say so: the
    events of a prompt come when its prefill is done, and a second request for the same prefix
    in between should follow the first, not miss it.  0: only the events count."""

    # load guard (prefix_aware)
    balance_abs_threshold_requests: int = 16
    """The guard fires only when the prefix node's load exceeds the least-loaded node's by more
    than this many requests (a quarter of a node's default 64 slots; peers use 64, but they
    cap nothing per node, and 64 would never fire under a 64-slot cap)."""
    balance_rel_threshold: float = 1.5
    """...and by more than this factor (the peers' default)."""
    affinity_keep_tokens: int = 2048
    """A matched prefix at least this long keeps affinity even when the guard would fire:
    2k tokens are about 40-50 ms of H100 prefill for an 8B model, several decode steps, and
    the conversation's next turns will hit the same node again.  A starting point; tune it
    with the routing benchmark."""

    # kv_aware, meridian
    kv_high_watermark: float = 0.9
    """KV-cache use (0..1) at and above which a node risks preemption and prefix eviction."""

    # session
    session_vnodes_per_node: int = 100
    """Points per node on the consistent-hash ring; a node's share of keys varies by about
    ``1 / sqrt(points)``, so ±10 % at 100."""
    session_load_bound_factor: float = 1.25
    """``c = 1 + epsilon`` of consistent hashing with bounded loads (Mirrokni et al. 2016): a
    key moves on from a node holding ``ceil(c * (in-flight + 1) * capacity / total capacity)``
    requests, so no node holds more than 125 % of its fair share, rounded up."""

    # slow start and probation (every policy)
    slow_start_floor: float = 0.05
    """Least ``warm`` a node gets, so a node admitted at ``slow_start`` 0 still takes a trickle."""
    probation_share: float = 0.5
    """Traffic share of a node on probation relative to a healthy one (it has one slot too)."""
    probation_every: int = 16
    """A candidate on probation gets the request once this many decisions have passed without a
    trial: re-admission within a bounded number of requests, whatever the policy."""

    # meridian: cost = sum of weighted terms, lowest wins (see docs/agent.md)
    meridian_prefix_weight: float = 1.0
    """Credit for a whole prompt cached on the node (scaled by the fraction cached)."""
    meridian_queue_weight: float = 4.0
    """Cost of a node full to its slots; with the prefix weight 1.0, a whole cached prompt is
    worth a quarter of a node's slots, the same balance as the load guard."""
    meridian_kv_weight: float = 0.5
    """Cost per unit of ``kv_util``; doubled at and above ``kv_high_watermark``."""
    meridian_prefill_weight: float = 1.0
    """Cost of ``meridian_prefill_norm_tokens`` prompt tokens to prefill on a node before the
    request's first token: those of requests sent there that have no first token yet, plus
    the request's own uncached ones.  A node's first token waits behind the prefills queued
    ahead of it, which request counts do not see (one 8k-token prompt counts as one request);
    on the Mooncake slice of the routing benchmark this term took the fleet simulator's TTFT
    p99 from 0.69 s to 0.40 s at the same hit rate (docs/benchmarks.md)."""
    meridian_prefill_norm_tokens: int = 8192
    """Prefill tokens that cost ``meridian_prefill_weight``: with the defaults 8k tokens queued
    ahead (about half a second of H100 prefill for an 8B model) cost as much as a whole cached
    prompt is worth, or 16 requests in flight."""
    meridian_tokens_weight: float = 0.5
    """Cost of the node with the most tokens in flight per unit of capacity."""
    meridian_probation_penalty: float = 0.5
    """Cost of being on probation: worth about 8 requests in flight at 64 slots."""
    meridian_unknown_penalty: float = 0.5
    """Cost of unknown telemetry, standing in for the unknown queue and KV terms."""
    meridian_candidates: int = 16
    """Above this many routable nodes for the model, ``meridian`` scores a bounded set instead
    of every node: the nodes the prefix index holds the prompt's blocks on (this many of the
    longest matches at most), plus ``meridian_sampled`` drawn at random (the cost then picks
    the least loaded of them, as power-of-k-choices does), so a decision costs the same at
    1,024 nodes as at 16.  0: always score every node."""
    meridian_sampled: int = 4
    """Nodes drawn at random (with replacement: a repeat counts once) into ``meridian``'s
    bounded set, beside the prefix index's holders; at least 1.  (8 until 2026-12-06: 4 route
    alike on the fleet tables, at 10 % less a decision; docs/benchmarks.md.)"""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float | int) and value < 0:
                raise ValueError(f"RoutingConfig.{f.name} must not be negative; got {value}")
        if self.prefix_capacity_blocks < 1:
            raise ValueError("RoutingConfig.prefix_capacity_blocks must be at least 1")
        if self.prefix_stride_blocks < 1:
            raise ValueError("RoutingConfig.prefix_stride_blocks must be at least 1")
        if self.prefix_ttl_s <= 0:
            raise ValueError("RoutingConfig.prefix_ttl_s must be positive")
        if self.meridian_prefill_norm_tokens < 1:
            raise ValueError("RoutingConfig.meridian_prefill_norm_tokens must be at least 1")
        for name in ("meridian_candidates", "meridian_sampled"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"RoutingConfig.{name} must be a whole number; got {value!r}")
        if self.meridian_sampled < 1:
            raise ValueError("RoutingConfig.meridian_sampled must be at least 1")
        if self.balance_rel_threshold < 1:
            raise ValueError("RoutingConfig.balance_rel_threshold must be at least 1")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError("RoutingConfig.kv_high_watermark must be in (0, 1]")
        if self.session_vnodes_per_node < 1:
            raise ValueError("RoutingConfig.session_vnodes_per_node must be at least 1")
        if self.session_load_bound_factor < 1:
            raise ValueError("RoutingConfig.session_load_bound_factor must be at least 1")
        if not 0 < self.slow_start_floor <= 1:
            raise ValueError("RoutingConfig.slow_start_floor must be in (0, 1]")
        if not 0 < self.probation_share <= 1:
            raise ValueError("RoutingConfig.probation_share must be in (0, 1]")
        if self.probation_every < 1:
            raise ValueError("RoutingConfig.probation_every must be at least 1")


class Policy(Protocol):
    """A routing policy; :func:`create` makes one by name."""

    name: str

    def choose(
        self,
        request: RequestView,
        nodes: Sequence[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        """The node for ``request`` among ``nodes``, or ``node=None`` with the reason."""
        ...

    def observe_routed(self, request: RequestView, node: NodeId, *, now: float) -> None:
        """``request`` was sent to ``node`` (feeds the prefix index)."""
        ...

    def observe_relayed(self, tails: Sequence[Tail], *, now: float) -> None:
        """Prompts another worker of this agent sent, each ``(node, first, hashes)``: the
        prompt's block hashes from block ``first`` on (``PrefixIndex.insert_tails``; the
        blocks before went to the node moments ago, and the policy was told so then)."""
        ...

    def forget_node(self, node: NodeId) -> None:
        """``node`` left the pool: drop what the policy knows of it."""
        ...


SiblingTails = Callable[[Sequence[int], Sequence[int]], "tuple[NodeId, int] | None"]
"""Given a prompt's block hashes and the indexed positions past the policy's own deepest match
(ascending), the node of the deepest tail another worker of this agent sent there, and how many
leading blocks it covers; None when none (``regional_agent.workers.shared.LoadShare``'s
``deepest_tail``)."""


def attach_sibling_tails(policy: Policy, lookup: SiblingTails) -> bool:
    """Let ``policy`` ask ``lookup`` for what the other workers sent past its own index's
    deepest match of a prompt, instead of being told every tail (``observe_relayed``); False
    when the policy keeps no prefix index."""
    if isinstance(policy, _Indexed):
        policy.attach_sibling_tails(lookup)
        return True
    return False


def prefix_positions(policy: Policy) -> Callable[[int], tuple[int, ...]] | None:
    """The block positions ``policy``'s prefix index keeps of a prompt of a given length
    (``PrefixIndex.positions``); None for a policy without one."""
    return policy._index.positions if isinstance(policy, _Indexed) else None


def attach_precise(policy: Policy, index: PreciseIndex) -> bool:
    """Let ``policy`` match prefixes in ``index`` for the nodes whose KV events feed it; False
    when the policy keeps no prefix index (it routes as before)."""
    if isinstance(policy, _Indexed):
        policy.attach_precise(index)
        return True
    return False


def create(name: str, config: RoutingConfig) -> Policy:
    """A fresh policy called ``name`` (one of :data:`NAMES`)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(NAMES)}")
    return factory(config)


def learns_prefixes(policy: Policy) -> bool:
    """Whether ``policy`` routes by what :meth:`Policy.observe_routed` taught it."""
    return isinstance(policy, _Indexed)


def prefix_index_bytes(policy: Policy) -> int | None:
    """About what ``policy``'s prefix index holds now, in bytes; ``None`` for a policy without
    one (``PrefixIndex.estimated_bytes``)."""
    return policy._index.estimated_bytes() if isinstance(policy, _Indexed) else None


def candidates(request: RequestView, nodes: Sequence[NodeView]) -> list[NodeView]:
    """The nodes that may take ``request`` now, in the given order (from a pool's
    :class:`~policies.model.NodeViews`, its routable nodes for the model, read by id)."""
    if isinstance(nodes, NodeViews):
        by_id, probation = nodes.by_id, Health.PROBATION
        ready = []
        for node_id in nodes.routable(request.model):  # NodeView.has_slot, inline
            view = by_id[node_id]
            if view.in_flight < (1 if view.health is probation else view.slots):
                ready.append(view)
        return ready
    return [n for n in nodes if n.routable and request.model in n.models and n.has_slot]


def _trial_candidates(
    request: RequestView, nodes: Sequence[NodeView], ready: Sequence[NodeView]
) -> Sequence[NodeView]:
    """What :meth:`ProbationTrials.pick` is shown of the candidates ``ready``: from a pool's
    :class:`~policies.model.NodeViews`, its nodes on probation that have a slot (most often
    none); else ``ready`` itself (``pick`` keeps those on probation)."""
    if not isinstance(nodes, NodeViews):
        return ready
    on_probation = nodes.probation(request.model)
    if not on_probation:
        return ()
    by_id = nodes.by_id
    return [by_id[i] for i in on_probation if by_id[i].has_slot]


# --- shared helpers -------------------------------------------------------------------------


def _no_candidates(request: RequestView, nodes: Sequence[NodeView]) -> Decision:
    serving = [n for n in nodes if request.model in n.models]
    if not serving:
        return Decision(node=None, reason=f"no node serves model {request.model!r}")
    routable = [n for n in serving if n.routable]
    if not routable:
        return Decision(
            node=None,
            reason=f"all {len(serving)} nodes serving {request.model!r} are draining or unhealthy",
        )
    return Decision(
        node=None,
        reason=f"all {len(routable)} routable nodes serving {request.model!r} have full slots",
    )


def _warm(node: NodeView, config: RoutingConfig) -> float:
    return min(1.0, max(node.slow_start, config.slow_start_floor))


def _share(node: NodeView, config: RoutingConfig) -> float:
    probation = config.probation_share if node.health is Health.PROBATION else 1.0
    return _warm(node, config) * probation


def _capacity(node: NodeView, config: RoutingConfig) -> float:
    return max(node.weight, _MIN_WEIGHT) * _share(node, config)


def _loads(nodes: Sequence[NodeView]) -> list[int]:
    """``load`` of each node (see the module docstring for unknown telemetry)."""
    known = [n.telemetry.waiting for n in nodes if n.telemetry is not None]
    unknown_waiting = max(known, default=0)
    return [
        n.in_flight + (unknown_waiting if n.telemetry is None else n.telemetry.waiting)
        for n in nodes
    ]


def _argmin(keys: Sequence[tuple[float, ...]], rng: random.Random) -> int:
    """Index of the smallest key; equal smallest keys are broken by ``rng``."""
    best = min(keys)
    tied = [i for i, k in enumerate(keys) if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _load_keys(
    nodes: Sequence[NodeView], loads: Sequence[int], config: RoutingConfig
) -> list[tuple[float, ...]]:
    return [
        (
            (load + 1) / _capacity(n, config),
            float(n.health is Health.PROBATION),
            float(n.telemetry is None),
        )
        for n, load in zip(nodes, loads, strict=True)
    ]


def _least_loaded(
    nodes: Sequence[NodeView], config: RoutingConfig, rng: random.Random
) -> tuple[NodeView, int]:
    """The node of least effective load among ``nodes``, and its ``load``."""
    loads = _loads(nodes)
    i = _argmin(_load_keys(nodes, loads, config), rng)
    return nodes[i], loads[i]


def _kv(node: NodeView) -> str:
    return "?" if node.telemetry is None else f"{node.telemetry.kv_util:.0%}"


class ProbationTrials:
    """Every ``every`` decisions with a candidate on probation, one goes to such a candidate
    (the one waiting longest, then by id): see the module docstring."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"probation trials every {every} decisions: must be at least 1")
        self._every = every
        self._waited = 0  # decisions since the last trial while a candidate was on probation
        self._first_seen: dict[NodeId, int] = {}  # candidate on probation -> decision number
        self._decisions = 0

    def pick(self, ready: Sequence[NodeView]) -> Decision | None:
        """The trial this decision makes, or ``None``; call once per decision with the
        candidates."""
        self._decisions += 1
        waiting = [n for n in ready if n.health is Health.PROBATION] if ready else ready
        if not waiting:
            self._waited = 0
            self._first_seen.clear()
            return None
        seen = {n.node_id for n in waiting}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in seen}
        for n in waiting:
            self._first_seen.setdefault(n.node_id, self._decisions)
        self._waited += 1
        if self._waited < self._every:
            return None
        self._waited = 0
        pick = min(waiting, key=lambda n: (self._first_seen[n.node_id], n.node_id))
        return Decision(
            node=pick.node_id,
            reason=f"probation trial: one request in {self._every} goes to a node on probation",
            trial=True,
        )


# --- policies -------------------------------------------------------------------------------


class _Base:
    """Narrows to candidates, gives a probation trial its turn, then asks :meth:`_choose`."""

    name: str = ""

    def __init__(self, config: RoutingConfig) -> None:
        self._config = config
        self._trials = ProbationTrials(config.probation_every)

    def choose(
        self,
        request: RequestView,
        nodes: Sequence[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        ready = candidates(request, nodes)
        if not ready:
            return _no_candidates(request, nodes)
        trial = self._trials.pick(_trial_candidates(request, nodes, ready))
        if trial is not None:
            return trial
        return self._choose(request, ready, now=now, rng=rng)

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        raise NotImplementedError

    def observe_routed(self, request: RequestView, node: NodeId, *, now: float) -> None:
        return None

    def observe_relayed(self, tails: Sequence[Tail], *, now: float) -> None:
        return None

    def forget_node(self, node: NodeId) -> None:
        return None


class _Rotation(_Base):
    """Smooth weighted round robin, as nginx does it (``round_robin``: every weight 1).

    Each pick adds every candidate's weight to its running score, takes the highest score
    (ties in ``node_id`` order) and subtracts the candidates' total weight from the winner.
    Weights are ``weight * share`` (``weighted``) or ``share`` (``round_robin``), so warming and
    probation nodes take their turn less often.  Nodes that are not candidates keep their score.
    """

    def __init__(self, config: RoutingConfig, *, use_weight: bool) -> None:
        super().__init__(config)
        self.name = "weighted" if use_weight else "round_robin"
        self._use_weight = use_weight
        self._scores: dict[NodeId, float] = {}

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        ordered = sorted(ready, key=lambda n: n.node_id)
        get = _capacity if self._use_weight else _share
        weights = [get(n, self._config) for n in ordered]
        scores = self._scores
        best_i, best_score = 0, -math.inf
        for i, (n, w) in enumerate(zip(ordered, weights, strict=True)):
            score = scores.get(n.node_id, 0.0) + w
            scores[n.node_id] = score
            if score > best_score:
                best_i, best_score = i, score
        best = ordered[best_i]
        scores[best.node_id] = best_score - sum(weights)
        if self._use_weight:
            reason = f"weighted: share {weights[best_i] / sum(weights):.0%}"
        else:
            reason = "round robin"
        return Decision(node=best.node_id, reason=reason)

    def forget_node(self, node: NodeId) -> None:
        self._scores.pop(node, None)


class _Random(_Base):
    """Uniform over candidates, each weighted by its ``share`` (warming nodes less often)."""

    name = "random"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        (pick,) = rng.choices(ready, weights=[_share(n, self._config) for n in ready])
        return Decision(node=pick.node_id, reason="random")


class _LeastConnections(_Base):
    """Least ``(in_flight + 1) / capacity``: the agent's own count, no telemetry."""

    name = "least_connections"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        keys = [
            ((n.in_flight + 1) / _capacity(n, self._config), float(n.health is Health.PROBATION))
            for n in ready
        ]
        pick = ready[_argmin(keys, rng)]
        return Decision(node=pick.node_id, reason=f"least connections: {pick.in_flight} in flight")


class _LeastTokens(_Base):
    """Least ``(in_flight_tokens + this request's tokens) / capacity``; no telemetry."""

    name = "least_tokens"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        tokens = request.prompt_tokens + request.max_tokens
        keys = [
            (
                (n.in_flight_tokens + tokens) / _capacity(n, self._config),
                float(n.health is Health.PROBATION),
            )
            for n in ready
        ]
        pick = ready[_argmin(keys, rng)]
        return Decision(
            node=pick.node_id, reason=f"least tokens: {pick.in_flight_tokens} tokens in flight"
        )


class _PowerOfTwo(_Base):
    """Two candidates sampled with ``rng``; the lower effective load wins (the first on a tie)."""

    name = "power_of_two"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        if len(ready) == 1:
            return Decision(node=ready[0].node_id, reason="power of two: only candidate")
        loads = _loads(ready)
        keys = _load_keys(ready, loads, self._config)
        a, b = rng.sample(range(len(ready)), 2)
        win, lose = (b, a) if keys[b] < keys[a] else (a, b)
        return Decision(
            node=ready[win].node_id,
            reason=f"power of two: load {loads[win]} vs {loads[lose]}",
        )


class _JoinShortestQueue(_Base):
    """Least effective load over every candidate; ties by ``rng``."""

    name = "jsq"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        pick, load = _least_loaded(ready, self._config, rng)
        return Decision(node=pick.node_id, reason=f"jsq: shortest queue, load {load}")


class _KvAware(_Base):
    """Least effective load in the best tier of KV use.

    Tiers: known ``kv_util`` below ``kv_high_watermark``; then unknown telemetry; then at or above
    the watermark (only when every candidate is).  ``load`` is computed over all candidates.
    """

    name = "kv_aware"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        watermark = self._config.kv_high_watermark

        def tier(n: NodeView) -> int:
            if n.telemetry is None:
                return 1
            return 0 if n.telemetry.kv_util < watermark else 2

        tiers = [tier(n) for n in ready]
        top = min(tiers)
        loads = _loads(ready)
        keys = _load_keys(ready, loads, self._config)
        idx = [i for i, t in enumerate(tiers) if t == top]
        i = idx[_argmin([keys[i] for i in idx], rng)]
        pick = ready[i]
        if top == 0:
            skipped = sum(1 for t in tiers if t > 0)
            why = f"kv {_kv(pick)} below {watermark:.0%}"
            if skipped:
                why += f", {skipped} fuller or unknown skipped"
        elif top == 1:
            why = "kv unknown; none known below watermark"
        else:
            why = f"every node at or above {watermark:.0%} kv"
        return Decision(node=pick.node_id, reason=f"kv aware: {why}, load {loads[i]}")


class _Session(_Base):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016).

    The ring holds ``session_vnodes_per_node`` points per node of the pool, at
    ``blake2b(f"{node_id}#{i}")``.  A request walks clockwise from ``blake2b(session_key)`` to
    the first candidate whose ``in_flight`` is below its bound
    ``ceil(c * (m + 1) * capacity / total capacity)``, where ``m`` is the candidates' total
    ``in_flight`` and ``c`` is ``session_load_bound_factor``: with equal capacities this is
    ``ceil(c * (m + 1) / n)``.  The bounds add up to more than ``m``, so some candidate is always
    below its own.  A request without a key goes to the least effective load.
    """

    name = "session"

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self._ring_for: frozenset[NodeId] = frozenset()
        self._points: list[int] = []
        self._owners: list[NodeId] = []

    def choose(
        self,
        request: RequestView,
        nodes: Sequence[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        ready = candidates(request, nodes)
        if not ready:
            return _no_candidates(request, nodes)
        trial = self._trials.pick(ready)
        if trial is not None:
            return trial
        if request.session_key is None:
            pick, load = _least_loaded(ready, self._config, rng)
            return Decision(node=pick.node_id, reason=f"session: no key, least load {load}")
        self._build_ring(nodes)
        by_id = {n.node_id: n for n in ready}
        total_in_flight = sum(n.in_flight for n in ready)
        total_capacity = sum(_capacity(n, self._config) for n in ready)
        factor = self._config.session_load_bound_factor * (total_in_flight + 1) / total_capacity
        start = bisect.bisect_left(self._points, _hash64(request.session_key))
        home: NodeId | None = None
        seen: set[NodeId] = set()
        size = len(self._owners)
        for step in range(size):
            owner = self._owners[(start + step) % size]
            node = by_id.get(owner)
            if node is None or owner in seen:
                continue
            seen.add(owner)
            if home is None:
                home = owner
            bound = math.ceil(factor * _capacity(node, self._config))
            if node.in_flight < bound:
                if owner == home:
                    reason = "session: sticky node"
                else:
                    reason = f"session: {home} at its load bound, next on the ring"
                return Decision(node=owner, reason=reason)
        # Unreachable while c >= 1 (the bounds exceed m); kept so a float slip cannot fail.
        pick, load = _least_loaded(ready, self._config, rng)
        return Decision(node=pick.node_id, reason=f"session: all at bound, least load {load}")

    def _build_ring(self, nodes: Sequence[NodeView]) -> None:
        ids = frozenset(n.node_id for n in nodes)
        if ids == self._ring_for:
            return
        points = sorted(
            (_hash64(f"{node_id}#{i}"), node_id)
            for node_id in ids
            for i in range(self._config.session_vnodes_per_node)
        )
        self._ring_for = ids
        self._points = [p for p, _ in points]
        self._owners = [o for _, o in points]

    def forget_node(self, node: NodeId) -> None:
        if node in self._ring_for:
            self._ring_for = frozenset()  # rebuilt on the next request


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class _Indexed(_Base):
    """A policy that learns where prompts went in a :class:`PrefixIndex`, and with a
    :class:`PreciseIndex` attached asks it for the nodes whose engines report their blocks."""

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self._index = PrefixIndex(
            capacity_blocks=config.prefix_capacity_blocks,
            ttl_s=config.prefix_ttl_s,
            stride_blocks=config.prefix_stride_blocks,
            dense_head_blocks=config.prefix_dense_head_blocks,
        )
        self._precise: PreciseIndex | None = None
        self._pending: PrefixIndex | None = None
        self._sibling_tails: SiblingTails | None = None

    def attach_sibling_tails(self, lookup: SiblingTails) -> None:
        """Extend each match past its deepest node with ``lookup``'s answer
        (:func:`attach_sibling_tails`)."""
        self._sibling_tails = lookup

    def _sibling_tail(self, hashes: Sequence[int], deepest: int) -> tuple[NodeId, int] | None:
        """The node a sibling sent the prompt of ``hashes`` to deeper than ``deepest`` blocks,
        and how deep; None when none did (or no lookup is attached)."""
        lookup = self._sibling_tails
        if lookup is None:
            return None
        positions = self._index.positions(len(hashes))
        beyond = positions[bisect.bisect_left(positions, deepest) :]
        if not beyond:
            return None
        found = lookup(hashes, beyond)
        return found if found is not None and found[1] > deepest else None

    def attach_precise(self, index: PreciseIndex) -> None:
        """Match the nodes ``index`` calls precise there (their engines' KV events), and every
        other node in the approximate index."""
        self._precise = index
        if self._config.precise_pending_s > 0:
            self._pending = PrefixIndex(
                capacity_blocks=self._config.prefix_capacity_blocks,
                ttl_s=self._config.precise_pending_s,
                stride_blocks=self._config.prefix_stride_blocks,
                dense_head_blocks=self._config.prefix_dense_head_blocks,
            )

    def observe_routed(self, request: RequestView, node: NodeId, *, now: float) -> None:
        self._index.insert(request.block_hashes, node, now=now)
        if self._pending is not None:
            self._pending.insert(request.block_hashes, node, now=now)

    def observe_relayed(self, tails: Sequence[Tail], *, now: float) -> None:
        self._index.insert_tails(tails, now=now)
        if self._pending is not None:
            self._pending.insert_tails(tails, now=now)

    def forget_node(self, node: NodeId) -> None:
        self._index.remove_node(node)
        if self._pending is not None:
            self._pending.remove_node(node)

    def _match(self, hashes: Sequence[int], now: float) -> dict[NodeId, int]:
        """Leading blocks of ``hashes`` each node holds: from the precise index for its precise
        nodes (or the prompts routed there within ``precise_pending_s``, whichever is deeper),
        from the approximate index for the others."""
        matched = self._index.match(hashes, now=now)
        if self._sibling_tails is not None:
            found = self._sibling_tail(hashes, max(matched.values(), default=0))
            if found is not None:
                matched[found[0]] = found[1]
        precise = self._precise
        if precise is None or not precise.any_precise:
            return matched
        mixed = {n: d for n, d in matched.items() if not precise.is_precise(n)}
        exact = precise.match(hashes)
        if self._pending is not None:
            for n, d in self._pending.match(hashes, now=now).items():
                if precise.is_precise(n) and d > exact.get(n, 0):
                    exact[n] = d
        mixed.update(exact)
        return mixed

    def _match_runs(self, hashes: Sequence[int], now: float) -> list[Run]:
        """:meth:`_match` as runs (:meth:`PrefixIndex.match_runs`): the approximate index's own
        without a precise one, else one run a node."""
        precise = self._precise
        if precise is None or not precise.any_precise:
            runs = self._index.match_runs(hashes, now=now)
            if self._sibling_tails is None:
                return runs
            found = self._sibling_tail(hashes, max([d for d, _ in runs], default=0))
            if found is None:
                return runs
            node = found[0]  # deepest now: its run first, and in no other
            out: list[Run] = [(found[1], (node,))]
            for depth, nodes in runs:
                if node in nodes:
                    nodes = tuple([n for n in nodes if n != node])
                if nodes:
                    out.append((depth, nodes))
            return out
        return [(d, (n,)) for n, d in self._match(hashes, now).items()]

    def _matches(self, request: RequestView, ready: Sequence[NodeView], now: float) -> list[int]:
        """Leading cached blocks of the request's prompt on each candidate."""
        if not request.block_hashes:
            return [0] * len(ready)
        matched = self._match(request.block_hashes, now)
        return [matched.get(n.node_id, 0) for n in ready]


class _PrefixAware(_Indexed):
    """Longest cached prefix, with a load guard that never drops long affinity.

    The node matching the most leading blocks wins (least effective load among equals).  The
    guard: when that node's ``load`` exceeds the least-loaded candidate's by more than
    ``balance_abs_threshold_requests`` *and* by more than ``balance_rel_threshold`` times, the
    request goes to the least-loaded candidate instead, unless the match is at least
    ``affinity_keep_tokens`` long.  The guard decides request by request; it never switches the
    whole router to shortest-queue as sglang's cache_aware does.
    """

    name = "prefix_aware"

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        cfg = self._config
        matches = self._matches(request, ready, now)
        longest = max(matches)
        loads = _loads(ready)
        keys = _load_keys(ready, loads, cfg)
        least = _argmin(keys, rng)
        if longest == 0:
            why = "no prompt blocks" if not request.block_hashes else "no cached prefix"
            return Decision(
                node=ready[least].node_id, reason=f"prefix: {why}, least load {loads[least]}"
            )
        longest_idx = [i for i, m in enumerate(matches) if m == longest]
        best = longest_idx[_argmin([keys[i] for i in longest_idx], rng)]
        hit_tokens = longest * request.block_tokens
        imbalanced = (
            loads[best] - loads[least] > cfg.balance_abs_threshold_requests
            and loads[best] > cfg.balance_rel_threshold * loads[least]
        )
        if not imbalanced:
            return Decision(
                node=ready[best].node_id,
                reason=f"prefix: longest cached prefix, {longest} blocks",
                expected_hit_tokens=hit_tokens,
            )
        if hit_tokens >= cfg.affinity_keep_tokens:
            return Decision(
                node=ready[best].node_id,
                reason=(
                    f"prefix: kept affinity, {hit_tokens} cached tokens worth the wait"
                    f" (load {loads[best]} vs {loads[least]})"
                ),
                expected_hit_tokens=hit_tokens,
            )
        return Decision(
            node=ready[least].node_id,
            reason=f"prefix: load guard, load {loads[best]} vs {loads[least]}; least load",
            expected_hit_tokens=matches[least] * request.block_tokens,
        )


_DEPTH_OF_RUN: Final = operator.itemgetter(0)  # of a (depth, nodes) run
# a view; 1 / its capacity; its queue, KV, probation and unknown terms with the prefill term of
# what it has ahead; the prefill weight a token over its capacity; its tokens in flight over its
# capacity
_Terms = tuple[NodeView, float, float, float, float]


def _longest(runs: Sequence[Run], limit: int, matched: int) -> dict[NodeId, int]:
    """The ``limit`` deepest of a match's ``matched`` nodes, in the match's order among equal
    depths (``heapq.nlargest`` over the concatenated runs, which is a stable sort); every one,
    in that order, when there are no more than ``limit``.  The runs are sorted, not the nodes:
    a stable sort of runs of one depth each keeps every node's place among its equals, and a
    prompt on every node (one run of them all) costs no more than its first ``limit``."""
    if matched <= limit:
        if len(runs) == 1:  # the most common answer: one depth
            depth, nodes = runs[0]
            return dict.fromkeys(nodes, depth)
        everyone: dict[NodeId, int] = {}
        for depth, nodes in runs:
            everyone.update(dict.fromkeys(nodes, depth))
        return everyone
    out: dict[NodeId, int] = {}
    for depth, nodes in sorted(runs, key=_DEPTH_OF_RUN, reverse=True):
        out.update(dict.fromkeys(itertools.islice(nodes, limit - len(out)), depth))
        if len(out) >= limit:
            break
    return out


def _depth_in(runs: Sequence[Run], node: NodeId) -> int:
    """The depth of ``node``'s run, 0 when it is in none."""
    for depth, nodes in runs:
        if node in nodes:
            return depth
    return 0


class _Meridian(_Indexed):
    """The default: the candidate of lowest cost wins; equal costs are broken by ``rng``.

    For a candidate ``n``, with ``warm`` as in the module docstring, and ``waiting`` and
    ``kv_util`` taken as 0 when telemetry is unknown (the unknown penalty stands in for them)::

        cost(n) = - W_prefix    * matched_blocks(n) / len(block_hashes)   (0 without blocks)
                  + W_queue     * (in_flight(n) + waiting(n) + 1) / (slots(n) * warm(n))
                  + W_kv        * (kv_util(n) + [kv_util(n) >= kv_high_watermark])
                  + W_tokens    * tok(n) / max(tok(k) for every candidate k)
                  + W_prefill   * pre(n) / (prefill_norm_tokens * weight(n) * warm(n))
                  + W_probation * [health(n) is PROBATION]
                  + W_unknown   * [telemetry(n) is None]

        tok(n) = (in_flight_tokens(n) + prompt_tokens + max_tokens) / (weight(n) * warm(n))
        pre(n) = prefill_tokens(n) + max(0, prompt_tokens - matched_blocks(n) * block_tokens)

    ``[x]`` is 1 when ``x`` holds, else 0; ``matched_blocks`` is the node's leading match in the
    prefix index.  ``pre`` estimates the prefill ahead of the request's first token on ``n``:
    what the agent sent there and has seen no first token of, plus the request's own uncached
    prompt.

    The weights are ``RoutingConfig.meridian_*``; docs/agent.md says why the defaults.
    """

    name = "meridian"

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self._terms: dict[NodeId, _Terms] = {}  # by node: the last view scored, its terms

    def forget_node(self, node: NodeId) -> None:
        super().forget_node(node)
        self._terms.pop(node, None)

    def choose(
        self,
        request: RequestView,
        nodes: Sequence[NodeView],
        *,
        now: float,
        rng: random.Random,
    ) -> Decision:
        """Every candidate scored, or with many nodes a bounded set (``meridian_candidates``):
        the prefix index's holders of the prompt (the ``meridian_candidates`` longest matches)
        plus ``meridian_sampled`` drawn at random, from the pool's
        :class:`~policies.model.NodeViews` without a pass over every node."""
        limit = self._config.meridian_candidates
        if limit < 1 or not isinstance(nodes, NodeViews) or len(nodes) <= limit:
            return super().choose(request, nodes, now=now, rng=rng)
        ids = nodes.routable(request.model)
        if len(ids) <= limit:
            return super().choose(request, nodes, now=now, rng=rng)
        by_id = nodes.by_id
        trial = self._trials.pick(_trial_candidates(request, nodes, ()))
        if trial is not None:
            return trial
        runs = self._match_runs(request.block_hashes, now) if request.block_hashes else []
        matched = sum([len(nodes) for _, nodes in runs])
        holders = _longest(runs, limit, matched)
        # the bounded set, as lists the cost reads (views and their depths): the holders with
        # a slot, then the drawn nodes that are not holders, each once, in the order drawn
        ready: list[NodeView] = []
        depths: list[int] = []
        serving = nodes.routable_set(request.model)
        probation = Health.PROBATION
        for node_id, depth in holders.items():  # NodeView.has_slot, inline
            if node_id in serving:
                view = by_id[node_id]
                if view.in_flight < (1 if view.health is probation else view.slots):
                    ready.append(view)
                    depths.append(depth)
        # ``rng.choices(ids, k=meridian_sampled)``, inline: the same draws from ``rng``.  A
        # drawn holder is skipped: it is in the set already, or it is full (drawn nodes are
        # routable, so serving)
        draw, span = rng.random, float(len(ids))
        drawn: set[NodeId] = set()
        for _ in range(self._config.meridian_sampled):
            node_id = ids[int(draw() * span)]
            if node_id in holders or node_id in drawn:
                continue
            drawn.add(node_id)
            view = by_id[node_id]
            if view.in_flight < (1 if view.health is probation else view.slots):
                ready.append(view)
                # every node matched is a holder, or this one may be matched less deeply
                depths.append(0 if matched <= limit else _depth_in(runs, node_id))
        if not ready:  # the sample drew full nodes only: look at every one
            everyone = candidates(request, nodes)
            if not everyone:
                return _no_candidates(request, nodes)
            return self._choose(request, everyone, now=now, rng=rng)
        return self._choose(request, ready, now=now, rng=rng, matches=depths)

    def _node_terms(self, n: NodeView) -> _Terms:
        """What ``n``'s cost owes to ``n`` alone, for as long as the pool keeps this view: the
        inverse of its capacity ``weight * warm``; the sum of its queue, KV, probation and
        unknown terms and of the prefill term of the prefill it has ahead; the prefill term's
        weight per token over its capacity; and its tokens in flight over its capacity."""
        cfg = self._config
        w = n.slow_start if n.slow_start > cfg.slow_start_floor else cfg.slow_start_floor
        if w > 1.0:  # _warm, inline
            w = 1.0
        telemetry = n.telemetry
        waiting, kv = (0, 0.0) if telemetry is None else (telemetry.waiting, telemetry.kv_util)
        slots = n.slots if n.slots > 1 else 1
        cap = (n.weight if n.weight > _MIN_WEIGHT else _MIN_WEIGHT) * w
        per_cap = 1.0 / cap
        prefill_per_token = cfg.meridian_prefill_weight / cfg.meridian_prefill_norm_tokens / cap
        return (
            n,
            per_cap,
            cfg.meridian_queue_weight * (n.in_flight + waiting + 1) / (slots * w)
            + cfg.meridian_kv_weight * (kv + (1.0 if kv >= cfg.kv_high_watermark else 0.0))
            + cfg.meridian_probation_penalty * (n.health is Health.PROBATION)
            + cfg.meridian_unknown_penalty * (telemetry is None)
            + n.prefill_tokens * prefill_per_token,
            prefill_per_token,
            n.in_flight_tokens * per_cap,
        )

    def _choose(
        self,
        request: RequestView,
        ready: list[NodeView],
        *,
        now: float,
        rng: random.Random,
        matches: list[int] | None = None,
    ) -> Decision:
        # The class docstring's cost.  What does not depend on the request is kept per node
        # with the view it came from (``_node_terms``): the pool hands out the same view
        # object until the node's accounting, telemetry or health moves, so most candidates of
        # a decision are scored from kept terms (9 in 10 at 256 nodes,
        # benchmarks/decision_cost.py).  One pass over the candidates: every term but the
        # tokens term, and the tokens ratio; then, once the largest ratio is known, the tokens
        # term is added.  Sums and products are the docstring's, in another order: costs can
        # differ from its plain sum in their last bits.
        cfg = self._config
        if matches is None:
            matches = self._matches(request, ready, now)
        blocks = len(request.block_hashes)
        request_tokens = request.prompt_tokens + request.max_tokens
        prefix_unit = -cfg.meridian_prefix_weight / blocks if blocks else 0.0
        prompt_tokens = request.prompt_tokens
        block_tokens = request.block_tokens
        terms = self._terms
        bases: list[float] = []
        ratios: list[float] = []
        tok_max = 1e-12
        for n, matched in zip(ready, matches, strict=True):
            kept = terms.get(n.node_id)
            if kept is None or kept[0] is not n:
                kept = terms[n.node_id] = self._node_terms(n)
            _, per_cap, own_terms, prefill_per_token, tokens_ahead = kept
            t = tokens_ahead + request_tokens * per_cap
            if t > tok_max:
                tok_max = t
            own = prompt_tokens - matched * block_tokens
            if own < 0:
                own = 0
            bases.append(prefix_unit * matched + own_terms + own * prefill_per_token)
            ratios.append(t)
        costs = list(
            map(operator.add, bases, map((cfg.meridian_tokens_weight / tok_max).__mul__, ratios))
        )
        lowest = min(costs)
        bound = lowest + _TIE
        i = costs.index(lowest)
        costs[i] = math.inf  # the next lowest: is it a tie?
        if min(costs) <= bound:
            costs[i] = lowest
            i = rng.choice([i for i, c in enumerate(costs) if c <= bound])
        pick = ready[i]
        return decision_later(
            pick.node_id,
            "meridian",
            _meridian_reason,
            pick,
            matches[i],
            blocks,
            expected_hit_tokens=matches[i] * request.block_tokens,
        )


def _meridian_reason(pick: NodeView, matched: int, blocks: int) -> str:
    """The ``meridian`` policy's reason for sending a request of ``blocks`` blocks to ``pick``,
    which holds ``matched`` of them: written when read (``decision_later``)."""
    queued = "?" if pick.telemetry is None else str(pick.telemetry.waiting)
    hit = f"{matched / blocks:.0%}" if blocks else "n/a"
    return (
        f"meridian: prefix {hit}, in flight {pick.in_flight}/{pick.slots},"
        f" waiting {queued}, kv {_kv(pick)}, prefill ahead {pick.prefill_tokens}"
    )


_FACTORIES: Final[dict[str, Callable[[RoutingConfig], Policy]]] = {
    "round_robin": lambda c: _Rotation(c, use_weight=False),
    "random": _Random,
    "least_connections": _LeastConnections,
    "least_tokens": _LeastTokens,
    "power_of_two": _PowerOfTwo,
    "jsq": _JoinShortestQueue,
    "kv_aware": _KvAware,
    "prefix_aware": _PrefixAware,
    "session": _Session,
    "weighted": lambda c: _Rotation(c, use_weight=True),
    "meridian": _Meridian,
}
