"""The fleet simulator: many engines, regional agents and their policies, in virtual time.

One event loop (a heap of timed events, ties in the order they were scheduled) drives:

- **Nodes.**  One :class:`meridian_sim.engine.Engine` per GPU, the same engine and profile as
  ``meridian-sim node``.  A busy node's step is computed when it starts (the batch is fixed
  then) and its results — tokens, finished requests — land when it ends; the next step starts
  at once while work remains, as in the offline replay.  An idle node starts a step as soon as
  a request reaches it.
- **Regional agents.**  Each region has ``agents_per_region`` agent replicas (default one).
  Each agent has its own routing policy from ``policies.routing.create`` (or
  :class:`~meridian_sim.fleet.oracle.Oracle`) with its own rotation, prefix index and rng, its own
  central queue, its own accounting and its own telemetry.  What an agent knows of a node is
  what ``regional_agent.nodes.NodePool.view`` gives the policy: ``in_flight`` and
  ``in_flight_tokens`` (prompt plus ``max_tokens``), counted when *this agent* sends a request
  and released when its last token arrives; ``prefill_tokens`` (the prompt less the policy's
  ``expected_hit_tokens``), released when its first token arrives; ``slots`` per node, a cap on
  this agent's own ``in_flight``; and the agent's last scrape of the node's ``running``,
  ``waiting`` and ``kv_util``, or ``None`` before its first scrape and once older than
  ``stale_after_s``.  Replicas share no counts: a node's requests from the other agents of its
  region show only in the engine's own figures, through a scrape.  Each agent scrapes all of
  its region's nodes together every ``scrape_interval_s`` (its scraper's tick), at its own
  random phase; with ``scrape_interval_s = 0`` every decision sees the live engine state
  ("fresh").
- **Workers** (``workers``): the agents of a region are instead the workers of one agent
  (``regional_agent.workers``).  A view's ``in_flight``, ``in_flight_tokens`` and
  ``prefill_tokens`` are summed over them, so ``slots`` caps the node's requests from all of
  them; a routed prompt reaches the siblings' policies as the agent's prefix relay sends it
  (:class:`_SiblingTails`): whole (``observe_relayed``) when nothing of it matched or its
  worker has not sent that head whole for that node within ``FULL_EVERY_S``, else its tail to
  the region's table of tails, which each sibling's policy asks past its own match
  (``routing.attach_sibling_tails``); and a request goes to a worker by a hash of its index,
  not its session, as the kernel spreads connections.  The sharing is instant here, as it
  nearly is in the agent, whose workers read each other's counts, prefix records and tails at
  every decision.
- **The central queue**, one per agent, as ``regional_agent.queue.dispatcher``: a request is
  routed when it arrives if nobody waits ahead of it; otherwise, or when the policy finds no
  free slot, it waits, first come first served (traces carry one priority class), until a slot
  frees on a node of its region (every agent of the region with a queue is woken) or its agent's
  scrape lands; past ``max_depth`` waiting it is refused (the agent's 429), and after
  ``deadline_s`` in the queue it is dropped (504).  Prefix routing learns from
  ``observe_routed`` exactly as the agent does.

Requests go to a region by a stable hash of their session (the trace's session key, else the
conversation's first own block id), as DNS steering keeps a client in one region, and within it
to an agent by another, independent hash of the same key, as a load balancer with session
stickiness in front of the replicas would.  Nothing crosses regions, but with ``spill``: a
request that finds ``spill.queue_depth`` waiting in its agent's queue, or the queue full, goes
to the region ``policies.spill.rank`` picks from the last plan (each region's queue and finishing
rate, refreshed every ``spill.plan_interval_s``), arriving there half of ``spill.rtt_s`` later and
answered half of it later again; it is never spilled twice, and its prompt's cache is whatever
that region's nodes hold (usually nothing: the re-prefill is paid in full).  Not modelled:
network and proxy latency (zero, but for spill-over's round trip), health, failures, drains, slow
start, retries, the scrape's own latency,
per-request output-length sampling (every request generates exactly its trace
``output_length``).

- **Autoscaling** (``autoscaling``, one region): ``nodes`` is the most the region may have, and
  ``initial_nodes`` serve at the start.  Every ``interval_s`` the region's autoscaler hands
  ``policies.autoscaling.decide`` what the agent's autoscaler measures — serving and pending
  nodes, the serving nodes' mean KV-cache use, the requests waiting (the agents' queues and the
  engines'), the arrival rate since the last tick — and moves towards its target: a node
  ordered arrives ``provision_delay_s`` later with an empty cache; fewer nodes cancel pending
  orders first, then drain the serving node with the least work (no new requests; it stops
  when its last one finishes).  A node costs GPU time from its order to its stop.

Every request ends exactly once: finished by its node, or refused (``queue_full``,
``deadline``, ``too_large``) with the reason.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TextIO

from meridian_sim import workloads
from meridian_sim.engine import (
    CacheEvent,
    CacheRemoved,
    CacheStored,
    Engine,
    RequestRecord,
    StepResult,
)
from meridian_sim.fleet.oracle import Oracle
from meridian_sim.offline import percentile
from meridian_sim.profile import Profile
from meridian_sim.workloads import BlockHasher, TraceRequest, prompt_of
from policies import admission, autoscaling, group_routing, prefix_index, routing
from policies import spill as spill_policy
from policies.groups import GroupId
from policies.kv_index import PreciseIndex
from policies.model import NodeId, NodeView, NodeViews, RequestView, Telemetry

POLICIES: Final[tuple[str, ...]] = (*routing.NAMES, group_routing.NAME, "oracle")
MODEL: Final = "model"
_GROUP_KEY_TOKENS: Final = 1024

_ARRIVE: Final = 0
_STEP_END: Final = 1
_SCRAPE: Final = 2
_DEADLINE: Final = 3
_ENGINE_ADD: Final = 4
_KV_EVENTS: Final = 5
_AUTOSCALE: Final = 6
_NODE_READY: Final = 7
_SPILL_ARRIVE: Final = 8  # a spilled request reaches the other region's agent
_PLAN: Final = 9  # the controller's plan: every region's queue and rate, for spill-over

# a node's state, with autoscaling (without it every node serves throughout)
_OFF: Final = 0
_PENDING: Final = 1
_SERVING: Final = 2
_DRAINING: Final = 3


class FleetError(ValueError):
    """A fleet configuration that cannot run (the message names the field)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scaling:
    """The region's autoscaler (``FleetConfig.autoscaling``)."""

    policy: autoscaling.Config
    initial_nodes: int
    provision_delay_s: float = 120.0
    """From an order to a ready node: about 2 minutes for a warm standby, 8-15 for a cold one."""
    interval_s: float = 10.0
    node_capacity_rps: float | None = None
    """One node's measured capacity, for the forecast (None: the predictive demand is unknown)."""
    floor_nodes: int = 0
    """The controller's pre-warm floor, in nodes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Spill:
    """Spill-over between regions (``FleetConfig.spill``), as the agent's ``spill.*``."""

    queue_depth: int = 32
    """A request that finds this many waiting in its agent's queue looks for another region."""
    rtt_s: float = 0.02
    """The round trip between any two regions: half on the way there, half on the way back."""
    budget_s: float = 0.1
    """``spill.latency_budget_ms``: no region further than this is a target."""
    plan_interval_s: float = 5.0
    """What an agent knows of the other regions' queues and rates is the controller's plan,
    rewritten once a window: this old at most."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    nodes: int
    policy: str = "meridian"
    regions: int = 1
    agents_per_region: int = 1
    """Agent replicas per region, each with its own policy, queue, counts and scrapes."""
    workers: bool = False
    """The agents of a region are the workers of one ``meridian-agent --workers N``: they route
    on their summed counts and each one's prefix records, and requests reach them at random."""
    scrape_interval_s: float = 1.0
    """Seconds between telemetry scrapes (the agent's default); 0: fresh, live state."""
    stale_after_s: float | None = None
    """A scrape older than this is unknown; default ``max(1.0, 4 * scrape_interval_s)``."""
    slots_per_node: int = 64
    max_depth: int = 1024
    deadline_s: float = 120.0
    prefix_block_tokens: int = 16
    routing: routing.RoutingConfig = field(default_factory=routing.RoutingConfig)
    seed: int = 0
    kv_events: bool = False
    """The engines publish their KV-cache events and the agents' precise index follows them
    (``policies.kv_index``), ``kv_event_delay_s`` after the step that changed the cache; the
    agents of a region see the same events at the same time."""
    kv_event_delay_s: float = 0.05
    """From a step's end to the agents' index: vLLM's publisher thread, ZeroMQ, the agent's
    decode (milliseconds on one host; more across a network)."""
    kv_capacity_blocks: int | None = None
    """The precise index's bound, (node, block) entries; default: every GPU block of the
    region (nodes x the profile's ``num_gpu_blocks``)."""
    autoscaling: Scaling | None = None
    """The region's node count follows ``policies.autoscaling``; ``nodes`` is its maximum."""
    region_nodes: tuple[int, ...] | None = None
    """Nodes of each region (they sum to ``nodes``); default: as even as they go."""
    spill: Spill | None = None
    """Requests a region would queue long or refuse go to another region (``policies.spill``)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise FleetError(f"nodes must be at least 1, got {self.nodes}")
        if not 1 <= self.regions <= self.nodes:
            raise FleetError(f"regions must be 1..nodes ({self.nodes}), got {self.regions}")
        if self.agents_per_region < 1:
            raise FleetError(f"agents_per_region must be at least 1, got {self.agents_per_region}")
        if self.policy not in POLICIES:
            raise FleetError(f"unknown policy {self.policy!r}; valid: {', '.join(POLICIES)}")
        if self.scrape_interval_s < 0:
            raise FleetError("scrape_interval_s must be >= 0")
        if self.stale_after_s is not None and self.stale_after_s <= 0:
            raise FleetError("stale_after_s must be > 0")
        if self.kv_events and self.policy not in ("prefix_aware", "meridian"):
            raise FleetError(
                f"kv_events needs a policy with a prefix index (prefix_aware, meridian), "
                f"not {self.policy!r}"
            )
        if self.kv_event_delay_s < 0:
            raise FleetError("kv_event_delay_s must be >= 0")
        if self.region_nodes is not None and (
            len(self.region_nodes) != self.regions
            or sum(self.region_nodes) != self.nodes
            or min(self.region_nodes) < 1
        ):
            raise FleetError(
                f"region_nodes must give each of the {self.regions} regions at least one node, "
                f"{self.nodes} in all, got {self.region_nodes}"
            )
        if self.spill is not None:
            if self.regions < 2 or self.agents_per_region != 1:
                raise FleetError("spill needs two regions or more, with one agent each")
            sp = self.spill
            if sp.queue_depth < 1 or sp.rtt_s < 0 or sp.plan_interval_s <= 0:
                raise FleetError(
                    "spill.queue_depth must be >= 1, rtt_s >= 0 and plan_interval_s > 0"
                )
        a = self.autoscaling
        if a is not None:
            if self.regions != 1:
                raise FleetError(f"autoscaling needs one region, got regions={self.regions}")
            if self.kv_events:
                raise FleetError("autoscaling and kv_events cannot be combined yet")
            if not 0 <= a.initial_nodes <= self.nodes:
                raise FleetError(
                    f"autoscaling.initial_nodes must be 0..nodes ({self.nodes}), got "
                    f"{a.initial_nodes}"
                )
            if a.policy.max_nodes > self.nodes:
                raise FleetError(
                    f"autoscaling.policy.max_nodes ({a.policy.max_nodes}) must be at most nodes "
                    f"({self.nodes}): the fleet builds that many"
                )
            if a.provision_delay_s < 0 or a.interval_s <= 0:
                raise FleetError("autoscaling.provision_delay_s must be >= 0 and interval_s > 0")

    @property
    def fresh(self) -> bool:
        return self.scrape_interval_s == 0 or self.policy == "oracle"

    @property
    def stale_limit_s(self) -> float:
        if self.stale_after_s is not None:
            return self.stale_after_s
        return max(1.0, 4 * self.scrape_interval_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What happened to one request of the trace."""

    index: int
    region: int
    agent: int  # the agent of its region that took it, 0..agents_per_region-1
    node: str | None  # None: refused
    refused: str | None  # queue_full, deadline, too_large
    arrival_s: float
    dispatched_s: float | None
    queued_s: float | None  # entered the node's engine queue
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    spilled_to: int | None = None  # the region that served it, when it was spilled there


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """One autoscaler tick: what it measured and what it decided."""

    t: float
    serving: int
    pending: int
    draining: int
    kv_util: float | None
    queue: int
    arrival_rps: float
    target: int
    kind: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetResult:
    outcomes: tuple[Outcome, ...]
    summary: dict[str, float | int | str]
    timeline: tuple[Tick, ...] = ()  # with autoscaling: every tick
    node_events: tuple[tuple[float, str, str], ...] = ()
    """With autoscaling: (t, node, what) for ordered, ready, cancelled, draining, undrained and
    stopped, in time order."""


class _Node:
    __slots__ = (
        "busy", "engine", "generation", "index", "node_id", "pos", "region", "result", "since",
        "state",
    )  # fmt: skip

    def __init__(
        self, *, index: int, pos: int, node_id: NodeId, region: int, engine: Engine
    ) -> None:
        self.index = index  # in the fleet
        self.pos = pos  # in its region
        self.node_id = node_id
        self.region = region
        self.engine = engine
        self.busy = False
        self.result: StepResult | None = None  # the step in progress, landing at its end
        self.state = _SERVING
        self.since = 0.0  # when its GPU time began (its order)
        self.generation = 0  # of its orders: a cancelled order's ready event is stale


FULL_EVERY_S: Final = 1.0  # the relay's (regional_agent.workers.siblings.FULL_EVERY_S)
_TOLD_KEPT: Final = 16_384


class _SiblingTails:
    """The table of prompt tails a region's workers share, in virtual time, as
    ``regional_agent.workers.shared.LoadShare`` keeps it (``share_tail``, ``deepest_tail``):
    each block written names the node its prompt went to and the prompt's length (the last
    writer's); a lookup bisects the positions it is given for the deepest one written within
    ``ttl_s``, then goes on to that prompt's last block when the query holds it too.  Unbounded
    here (the agent's keeps its newest 262,144 entries)."""

    __slots__ = ("_blocks", "_ttl_s", "now")

    def __init__(self, ttl_s: float) -> None:
        self._blocks: dict[int, tuple[NodeId, int, float]] = {}
        self._ttl_s = ttl_s
        self.now = 0.0  # the simulator's, set before each decision

    def write(self, node: NodeId, hashes: Sequence[int], positions: Sequence[int]) -> None:
        end, now = len(hashes), self.now
        self._blocks.update((hashes[p], (node, end, now)) for p in positions)

    def _held(self, block: int) -> tuple[NodeId, int] | None:
        found = self._blocks.get(block)
        if found is None or found[2] < self.now - self._ttl_s:
            return None
        return found[0], found[1]

    def deepest(self, hashes: Sequence[int], positions: Sequence[int]) -> tuple[NodeId, int] | None:
        return prefix_index.deepest_written(hashes, positions, self._held)


class _Region:
    __slots__ = (
        "agents",
        "arrivals",
        "by_id",
        "finished",
        "kv_index",
        "nodes",
        "scaling",
        "tails",
    )

    def __init__(self, *, nodes: list[_Node]) -> None:
        self.nodes = nodes
        self.by_id = {n.node_id: n for n in nodes}
        self.agents: list[_Agent] = []
        # with kv_events: what every agent of the region knows from the engines' events (one
        # object: each agent subscribes to the same engines and sees the same events)
        self.kv_index: PreciseIndex | None = None
        self.arrivals = 0  # since the autoscaler's last tick
        self.finished = 0  # requests its nodes finished, all the run (spill-over's rates)
        self.scaling = autoscaling.State()
        self.tails: _SiblingTails | None = None  # with workers: the tails they share


class _Agent:
    """One agent replica: its policy and queue, and what it counts and scrapes of each node of
    its region (lists by the node's ``pos``).  The counts are of its own requests only."""

    __slots__ = (
        "in_flight",
        "in_flight_tokens",
        "index",
        "policy",
        "prefill",
        "prefill_tokens",
        "queue",
        "region",
        "rng",
        "scrape",
        "told",
        "views",
    )

    def __init__(
        self, *, index: int, region: _Region, policy: routing.Policy, rng: random.Random
    ) -> None:
        n = len(region.nodes)
        self.index = index  # in the fleet
        self.region = region
        self.policy = policy
        self.rng = rng
        self.queue: deque[int] = deque()
        self.in_flight = [0] * n
        self.in_flight_tokens = [0] * n
        self.prefill_tokens = [0] * n  # uncached prompt tokens sent, not yet at a first token
        self.prefill: dict[str, int] = {}  # request id -> its share of its node's prefill_tokens
        # the last scrape of each node: taken_s, running, waiting, kv_util
        self.scrape: list[tuple[float, int, int, float] | None] = [None] * n
        self.views: list[NodeView | None] = [None] * n  # cached; None: rebuild
        # with workers: (node, a head's last hash) -> when this worker last sent it whole
        self.told: dict[tuple[NodeId, int], float] = {}


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _session_key(request: TraceRequest, index: int) -> str:
    if request.session is not None:
        return request.session
    if len(request.hash_ids) > 1:
        return f"b{request.hash_ids[1]}"
    return f"i{index}"


def region_of(request: TraceRequest, index: int, regions: int) -> int:
    """The region a request's client is steered to: stable per session."""
    if regions == 1:
        return 0
    return _stable_hash(_session_key(request, index)) % regions


def agent_of(request: TraceRequest, index: int, agents: int, *, workers: bool = False) -> int:
    """The agent of its region a request goes to: stable per session, independent of
    :func:`region_of` (another hash of the same key); with ``workers``, per request."""
    if agents == 1:
        return 0
    if workers:
        return _stable_hash(f"worker:{index}") % agents
    return _stable_hash(f"agent:{_session_key(request, index)}") % agents


class Fleet:
    """One run: build it, call :meth:`run` once."""

    def __init__(
        self,
        profile: Profile,
        requests: Sequence[TraceRequest],
        config: FleetConfig,
        *,
        progress: TextIO | None = None,
        hasher: BlockHasher | None = None,
    ) -> None:
        for what, needs in (
            ("the oracle", config.policy == "oracle"),
            ("kv_events", config.kv_events),
        ):
            if needs and config.prefix_block_tokens != profile.block_size:
                raise FleetError(
                    f"{what} needs prefix_block_tokens equal to the profile's block_size "
                    f"({profile.block_size})"
                )
        self.profile = profile
        self.requests = requests
        self.config = config
        self._progress = progress
        self._agent_hasher = (
            hasher
            if hasher is not None and hasher.block_size == config.prefix_block_tokens
            else BlockHasher(block_size=config.prefix_block_tokens)
        )
        self._engine_hasher = (
            self._agent_hasher
            if profile.block_size == config.prefix_block_tokens
            else BlockHasher(block_size=profile.block_size)
        )
        self._overhead_s = profile.timing.request_overhead_ms / 1000.0
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._kv_pending: dict[int, tuple[_Node, list[CacheEvent]]] = {}  # seq -> in flight
        self._nodes: list[_Node] = []
        self._regions: list[_Region] = []
        self._agents: list[_Agent] = []  # region by region
        self._build()
        self._by_id = {n.node_id: n for n in self._nodes}
        n = len(requests)
        self._views: list[RequestView | None] = [None] * n
        self._region_of = [region_of(r, i, config.regions) for i, r in enumerate(requests)]
        k = config.agents_per_region
        self._agent_of = [  # index into self._agents
            self._region_of[i] * k + agent_of(r, i, k, workers=config.workers)
            for i, r in enumerate(requests)
        ]
        self._dispatched: list[float | None] = [None] * n
        self._node_of: list[int | None] = [None] * n
        self._refused: list[str | None] = [None] * n
        self._records: list[RequestRecord | None] = [None] * n
        self.num_steps = 0
        self.num_decisions = 0
        self._cpu_s = 0.0
        self._timeline: list[Tick] = []
        self._node_events: list[tuple[float, str, str]] = []
        self._ready_at: dict[int, tuple[int, int]] = {}  # event seq -> (node, its order)
        self._gpu_s = 0.0  # GPU time of nodes that have stopped (the rest is added at the end)
        self._end_s = 0.0
        self._fresh_engines = random.Random(config.seed + 3)  # the engines of ordered nodes
        self._spilled_to: list[int | None] = [None] * n
        # spill-over's view of every region, as of the last plan: (queue depth, finished/s)
        self._plan: list[tuple[int, float]] | None = None  # None: no plan yet, no spill-over
        self._plan_finished = [0] * config.regions

    # -- setup -------------------------------------------------------------------------------

    def _build(self) -> None:
        cfg = self.config
        master = random.Random(cfg.seed)  # engines, and each region's first agent
        phases = random.Random(cfg.seed + 1)  # scrape phases
        replicas = random.Random(cfg.seed + 2)  # the other agents (none drawn with one agent)
        per = list(cfg.region_nodes or ())
        if not per:
            per = [cfg.nodes // cfg.regions + (1 if r < cfg.nodes % cfg.regions else 0)
                   for r in range(cfg.regions)]  # fmt: skip
        for r, count in enumerate(per):
            nodes = []
            for i in range(count):
                node = _Node(
                    index=len(self._nodes),
                    pos=i,
                    node_id=NodeId(f"r{r}-n{i:03d}"),
                    region=r,
                    engine=Engine(
                        self.profile,
                        rng=random.Random(master.getrandbits(64)),
                        record_events=cfg.kv_events,
                        event_token_ids=False,
                    ),
                )
                nodes.append(node)
                self._nodes.append(node)
            region = _Region(nodes=nodes)
            self._regions.append(region)
            if cfg.autoscaling is not None:
                for n in nodes[cfg.autoscaling.initial_nodes :]:
                    n.state = _OFF
                self._push(cfg.autoscaling.interval_s, _AUTOSCALE, r)
            if cfg.kv_events:
                region.kv_index = PreciseIndex(
                    capacity_blocks=cfg.kv_capacity_blocks or count * self.profile.num_gpu_blocks,
                    block_size=cfg.prefix_block_tokens,
                )
                for n in nodes:
                    region.kv_index.set_precise(n.node_id, True)
            # groups: one table per region that its agents share (an instant etcd sync); each
            # node its own group, as the agent's default
            tables = group_routing.LocalTables(
                {n.node_id: (GroupId(n.node_id), 1.0) for n in nodes}
            )
            for a in range(cfg.agents_per_region):
                seeds = master if a == 0 else replicas
                agent = _Agent(
                    index=len(self._agents),
                    region=region,
                    policy=self._make_policy(tables),
                    rng=random.Random(seeds.getrandbits(64)),
                )
                if region.kv_index is not None:
                    routing.attach_precise(agent.policy, region.kv_index)
                if cfg.workers and routing.learns_prefixes(agent.policy):
                    if region.tails is None:
                        region.tails = _SiblingTails(cfg.routing.prefix_ttl_s)
                    routing.attach_sibling_tails(agent.policy, region.tails.deepest)
                region.agents.append(agent)
                self._agents.append(agent)
                if not cfg.fresh:  # its own generator: staleness must not reseed routing
                    phase = phases.uniform(0, cfg.scrape_interval_s)
                    self._push(phase, _SCRAPE, agent.index)

    def _make_policy(self, tables: group_routing.LocalTables) -> routing.Policy:
        cfg = self.config
        if cfg.policy == group_routing.NAME:
            # a prefix key over the prompt's first 1,024 tokens, as the agent's default
            # (group_tables.key_blocks 64 of routing.prefix_block_tokens 16)
            config = group_routing.GroupRoutingConfig(
                block_tokens=cfg.prefix_block_tokens,
                key_blocks=max(1, _GROUP_KEY_TOKENS // cfg.prefix_block_tokens),
                probation_every=cfg.routing.probation_every,
            )
            return group_routing.GroupPolicy(tables, config)
        if cfg.policy != "oracle":
            return routing.create(cfg.policy, cfg.routing)
        return Oracle(cfg.routing, cached_blocks=self._cached_blocks)

    def _cached_blocks(self, node_id: NodeId, request: RequestView) -> int:
        kv = self._by_id[node_id].engine.kv
        max_blocks = (request.prompt_tokens - 1) // kv.block_size
        return len(kv.lookup(list(request.block_hashes), max_blocks=max_blocks))

    # -- events ------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, arg: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, arg))

    def run(self) -> FleetResult:
        started = time.monotonic()
        cpu_started = time.process_time()
        for i, r in enumerate(self.requests):
            self._push(r.timestamp_s, _ARRIVE, i)
        if self.config.spill is not None:
            self._push(self.config.spill.plan_interval_s, _PLAN, 0)
        total = len(self.requests)
        last_arrival = self.requests[-1].timestamp_s if self.requests else 0.0
        done = 0
        next_report = started + 2.0
        now = 0.0
        end: float | None = None  # when the last request ended
        events = self._events
        while events:
            now, _, kind, arg = heapq.heappop(events)
            if kind == _STEP_END:
                node = self._nodes[arg]
                result = node.result
                assert result is not None
                node.result = None
                done += self._step_end(node, result, now)
            elif kind == _ARRIVE:
                done += self._arrive(arg, now)
            elif kind == _SCRAPE:
                self._scrape(arg, now)
                if done < total:
                    self._push(now + self.config.scrape_interval_s, _SCRAPE, arg)
            elif kind == _DEADLINE:
                done += self._deadline(arg, now)
            elif kind == _KV_EVENTS:
                self._kv_deliver(arg)
            elif kind == _AUTOSCALE:
                self._autoscale(arg, now)
                if done < total and self.config.autoscaling is not None:
                    self._push(now + self.config.autoscaling.interval_s, _AUTOSCALE, arg)
            elif kind == _NODE_READY:
                index, generation = self._ready_at.pop(arg)
                self._node_ready(self._nodes[index], now, generation)
            elif kind == _SPILL_ARRIVE:
                done += self._arrive(arg, now, forwarded=True)
            elif kind == _PLAN:
                spill = self.config.spill
                assert spill is not None
                self._snapshot(spill.plan_interval_s)
                if done < total:
                    self._push(now + spill.plan_interval_s, _PLAN, 0)
            else:
                self._engine_add(arg, now)
            if end is None and done >= total:
                end = now
            if self._progress is not None and self._seq % 256 == 0:
                wall = time.monotonic()
                if wall >= next_report:
                    next_report = wall + 2.0
                    print(
                        f"fleet {self.config.policy} n={self.config.nodes}: "
                        f"t={now:.0f}/{last_arrival:.0f} s virtual, {done}/{total} done, "
                        f"{wall - started:.0f} s wall",
                        file=self._progress,
                        flush=True,
                    )
        wall_s = time.monotonic() - started
        self._cpu_s = time.process_time() - cpu_started
        # GPU time ends with the last request (nodes still on their way then do not count on)
        self._end_s = now if end is None else end
        outcomes = self._outcomes()
        if any(o.finished_s is None and o.refused is None for o in outcomes):
            raise RuntimeError("fleet simulation ended with unfinished requests")
        return FleetResult(
            outcomes=outcomes,
            summary=self._summary(outcomes, wall_s),
            timeline=tuple(self._timeline),
            node_events=tuple(self._node_events),
        )

    # -- agent -------------------------------------------------------------------------------

    def _request_view(self, i: int) -> RequestView:
        view = self._views[i]
        if view is None:
            r = self.requests[i]
            view = RequestView(
                model=MODEL,
                prompt_tokens=r.input_length,
                max_tokens=r.output_length,
                block_hashes=self._agent_hasher.hashes(r),
                block_tokens=self.config.prefix_block_tokens,
                session_key=r.session,
            )
            self._views[i] = view
        return view

    def _arrive(self, i: int, now: float, *, forwarded: bool = False) -> int:
        r = self.requests[i]
        total = r.input_length + r.output_length
        if total > self.profile.max_model_len or total > self.profile.kv_cache_tokens:
            self._refused[i] = "too_large"
            return 1
        agent = self._agents[self._agent_of[i]]
        spill = self.config.spill
        if spill is not None and not forwarded:
            depth = len(agent.queue)
            full = not admission.admit(depth, max_depth=self.config.max_depth)
            if full or depth >= spill.queue_depth:
                target = self._spill_target(self._region_of[i], depth)
                if target is not None:  # one hop, half the round trip on the way there
                    self._spilled_to[i] = target
                    self._agent_of[i] = target  # one agent per region
                    self._push(now + spill.rtt_s / 2, _SPILL_ARRIVE, i)
                    return 0
        agent.region.arrivals += 1
        if not agent.queue and self._try_route(agent, i, now):
            return 0
        if not admission.admit(len(agent.queue), max_depth=self.config.max_depth):
            self._refused[i] = "queue_full"
            return 1
        agent.queue.append(i)
        self._push(now + self.config.deadline_s, _DEADLINE, i)
        return 0

    def _snapshot(self, interval_s: float) -> None:
        """The controller's plan: each region's queue now and its finishing rate since the last."""
        plan = []
        for r, region in enumerate(self._regions):
            rate = (region.finished - self._plan_finished[r]) / interval_s
            self._plan_finished[r] = region.finished
            plan.append((sum(len(a.queue) for a in region.agents), rate))
        self._plan = plan

    def _spill_target(self, home: int, depth: int) -> int | None:
        """The region ``policies.spill.rank`` picks from the last plan, as the agent would."""
        spill = self.config.spill
        plan = self._plan
        assert spill is not None
        if plan is None:
            return None  # before the first plan the agent knows of no other region
        regions = [
            spill_policy.Region(
                name=str(r),
                residency=frozenset(),
                endpoints=("sim",),
                models={MODEL: float(len(region.nodes))},
                in_service=True,
                queue_depth=plan[r][0],
                requests_per_s=plan[r][1],
            )
            for r, region in enumerate(self._regions)
        ]
        rate = plan[home][1]
        # full or not: a region whose queue is as long is no better
        home_wait_ms = 1000.0 * depth / rate if rate > 0 else depth * spill_policy.UNKNOWN_WAIT_MS
        choice = spill_policy.rank(
            regions,
            home=str(home),
            model=MODEL,
            needs=frozenset(),
            latency_ms={str(r): spill.rtt_s * 1000.0 for r in range(len(regions)) if r != home},
            budget_ms=spill.budget_s * 1000.0,
            max_age_s=float("inf"),
            home_wait_ms=home_wait_ms,
        )
        return int(choice.targets[0].region) if choice.targets else None

    def _deadline(self, i: int, now: float) -> int:
        if self._dispatched[i] is not None or self._refused[i] is not None:
            return 0
        self._agents[self._agent_of[i]].queue.remove(i)
        self._refused[i] = "deadline"
        return 1

    def _pump(self, agent: _Agent, now: float) -> None:
        queue = agent.queue
        while queue and self._try_route(agent, queue[0], now):
            queue.popleft()

    def _node_views(self, agent: _Agent, now: float) -> NodeViews:
        """What ``agent`` knows of its region's nodes now, in ``pos`` order, as the agent's pool
        hands them to its policy (so ``meridian`` bounds its candidates as it does there)."""
        cfg = self.config
        out = []
        stale_limit = cfg.stale_limit_s
        views = agent.views
        for pos, node in enumerate(agent.region.nodes):
            if node.state != _SERVING:
                continue
            view = views[pos]
            if view is not None and not cfg.fresh:
                scrape = agent.scrape[pos]
                if (
                    scrape is not None
                    and view.telemetry is not None
                    and now - scrape[0] > stale_limit
                ):
                    view = None  # went stale
            if view is None or cfg.fresh:
                view = self._node_view(agent, node, now)
                views[pos] = view
            out.append(view)
        return NodeViews(out)

    def _node_view(self, agent: _Agent, node: _Node, now: float) -> NodeView:
        cfg = self.config
        telemetry: Telemetry | None = None
        scrape = agent.scrape[node.pos]
        if cfg.fresh:
            e = node.engine
            telemetry = Telemetry(
                age_s=0.0,
                running=e.num_running,
                waiting=e.num_waiting,
                kv_util=e.kv_usage,
                prefix_hit_rate=None,
                block_size=self.profile.block_size,
            )
        elif scrape is not None and now - scrape[0] <= cfg.stale_limit_s:
            taken, running, waiting, kv = scrape
            telemetry = Telemetry(
                age_s=now - taken,
                running=running,
                waiting=waiting,
                kv_util=kv,
                prefix_hit_rate=None,
                block_size=self.profile.block_size,
            )
        pos = node.pos
        if cfg.workers:
            siblings = agent.region.agents
            in_flight = sum(a.in_flight[pos] for a in siblings)
            tokens = sum(a.in_flight_tokens[pos] for a in siblings)
            prefill = sum(a.prefill_tokens[pos] for a in siblings)
        else:
            in_flight = agent.in_flight[pos]
            tokens = agent.in_flight_tokens[pos]
            prefill = agent.prefill_tokens[pos]
        return NodeView(
            node_id=node.node_id,
            models=frozenset((MODEL,)),
            in_flight=in_flight,
            in_flight_tokens=tokens,
            prefill_tokens=prefill,
            slots=cfg.slots_per_node,
            telemetry=telemetry,
        )

    def _counted(self, agent: _Agent, pos: int) -> None:
        """``agent``'s counts of the node at ``pos`` moved: the views that show them go."""
        if self.config.workers:
            for sibling in agent.region.agents:
                sibling.views[pos] = None
        else:
            agent.views[pos] = None

    def _try_route(self, agent: _Agent, i: int, now: float) -> bool:
        request = self._request_view(i)
        views = self._node_views(agent, now)
        self.num_decisions += 1
        if agent.region.tails is not None:
            agent.region.tails.now = now
        decision = agent.policy.choose(request, views, now=now, rng=agent.rng)
        if decision.node is None:
            return False
        node = agent.region.by_id[decision.node]
        pos = node.pos
        agent.in_flight[pos] += 1
        agent.in_flight_tokens[pos] += request.prompt_tokens + request.max_tokens
        pending = max(0, request.prompt_tokens - decision.expected_hit_tokens)
        agent.prefill[str(i)] = pending
        agent.prefill_tokens[pos] += pending
        self._counted(agent, pos)
        agent.policy.observe_routed(request, decision.node, now=now)
        if self.config.workers and request.block_hashes:
            self._relay(agent, request, decision.node, decision.expected_hit_tokens, now)
        self._dispatched[i] = now
        self._node_of[i] = node.index
        if self._overhead_s > 0:
            self._push(now + self._overhead_s, _ENGINE_ADD, i)
        else:
            self._engine_add(i, now)
        return True

    def _relay(
        self, agent: _Agent, request: RequestView, node: NodeId, hit_tokens: int, now: float
    ) -> None:
        """Tell ``agent``'s siblings where the prompt went, as the agent's prefix relay does
        (``regional_agent.workers.siblings.PrefixRelay.send``): whole, or its tail past the head
        the policy matched on the node when this worker sent that head whole for that node less
        than ``FULL_EVERY_S`` ago, to the region's table."""
        hashes = request.block_hashes
        matched = hit_tokens // request.block_tokens
        start = 0
        if matched > 0:
            key = (node, hashes[min(matched, len(hashes)) - 1])
            if now - agent.told.get(key, -math.inf) < FULL_EVERY_S:
                start = matched
            else:
                if len(agent.told) >= _TOLD_KEPT:
                    agent.told.clear()
                agent.told[key] = now
        if start >= len(hashes):
            return
        tails = agent.region.tails
        positions = routing.prefix_positions(agent.policy)
        if start and tails is not None and positions is not None:
            at = positions(len(hashes))
            tails.write(node, hashes, at[bisect.bisect_left(at, start) :])
            return
        for sibling in agent.region.agents:
            if sibling is not agent:
                sibling.policy.observe_relayed([(node, 0, hashes)], now=now)

    def _scrape(self, a: int, now: float) -> None:
        """Agent ``a`` scrapes every node of its region (the engines all its peers share)."""
        agent = self._agents[a]
        for node in agent.region.nodes:
            e = node.engine
            agent.scrape[node.pos] = (now, e.num_running, e.num_waiting, e.kv_usage)
            agent.views[node.pos] = None
        self._pump(agent, now)

    # -- nodes -------------------------------------------------------------------------------

    def _engine_add(self, i: int, now: float) -> None:
        node_i = self._node_of[i]
        assert node_i is not None
        node = self._nodes[node_i]
        r = self.requests[i]
        node.engine.add(
            str(i),
            prompt_of(r),
            max_tokens=r.output_length,
            ignore_eos=True,
            now=now,
            arrival_s=r.timestamp_s,
            block_hashes=self._engine_hasher.hashes(r),
        )
        if not node.busy:
            self._start_step(node, now)

    def _start_step(self, node: _Node, now: float) -> None:
        result = node.engine.step(now=now)
        self.num_steps += 1
        if result.num_scheduled_tokens == 0:
            if node.engine.has_unfinished:
                raise RuntimeError(f"node {node.node_id}: engine stalled with work queued")
            node.busy = False
            return
        node.busy = True
        node.result = result
        self._push(now + result.duration_s, _STEP_END, node.index)

    def _kv_deliver(self, key: int) -> None:
        """A step's KV events reach the agents of its node's region."""
        node, events = self._kv_pending.pop(key)
        index = self._regions[node.region].kv_index
        assert index is not None
        for event in events:
            if isinstance(event, CacheStored):
                index.stored_keys(node.node_id, event.block_hashes)
            elif isinstance(event, CacheRemoved):
                index.removed(node.node_id, event.block_hashes)
            else:
                index.clear(node.node_id)

    def _step_end(self, node: _Node, result: StepResult, now: float) -> int:
        pos = node.pos
        if self.config.kv_events:
            events = node.engine.take_events()
            if events:
                key = self._seq + 1  # the sequence number _push gives the event
                self._kv_pending[key] = (node, events)
                self._push(now + self.config.kv_event_delay_s, _KV_EVENTS, key)
        for event in result.tokens:
            if event.index == 0:  # a first token: its prefill is no longer ahead
                agent = self._agents[self._agent_of[int(event.request_id)]]
                agent.prefill_tokens[pos] -= agent.prefill.pop(event.request_id, 0)
                self._counted(agent, pos)
        for rec in result.finished:
            i = int(rec.request_id)
            self._records[i] = rec
            self._regions[node.region].finished += 1
            r = self.requests[i]
            agent = self._agents[self._agent_of[i]]
            agent.in_flight[pos] -= 1
            agent.in_flight_tokens[pos] -= r.input_length + r.output_length
            self._counted(agent, pos)
        if node.engine.has_unfinished:
            self._start_step(node, now)
        else:
            node.busy = False
            if node.state == _DRAINING and self._idle(node):
                self._stop(node, now)
        if result.finished:  # a slot freed: wake every agent of the region that has a queue
            for agent in self._regions[node.region].agents:
                if agent.queue:
                    self._pump(agent, now)
        return len(result.finished)

    # -- autoscaling -------------------------------------------------------------------------

    def _autoscale(self, r: int, now: float) -> None:
        """The region's autoscaler ticks: measure, decide, act."""
        scaling = self.config.autoscaling
        assert scaling is not None
        region = self._regions[r]
        serving = [n for n in region.nodes if n.state == _SERVING]
        pending = sum(1 for n in region.nodes if n.state == _PENDING)
        draining = [n for n in region.nodes if n.state == _DRAINING]
        kv = sum(n.engine.kv_usage for n in serving) / len(serving) if serving else None
        queue = sum(len(a.queue) for a in region.agents) + sum(
            n.engine.num_waiting for n in (*serving, *draining)
        )
        rate = region.arrivals / scaling.interval_s
        region.arrivals = 0
        decision, region.scaling = autoscaling.decide(
            scaling.policy,
            region.scaling,
            autoscaling.Signals(
                now=now,
                serving=len(serving),
                pending=pending,
                kv_util=kv,
                queue=queue,
                arrival_rps=rate,
                node_capacity_rps=scaling.node_capacity_rps,
                floor_nodes=scaling.floor_nodes,
                horizon_s=scaling.provision_delay_s + scaling.interval_s,
            ),
        )
        self._timeline.append(
            Tick(
                t=now,
                serving=len(serving),
                pending=pending,
                draining=len(draining),
                kv_util=kv,
                queue=queue,
                arrival_rps=rate,
                target=decision.target,
                kind=decision.kind,
                reason=decision.reason,
            )
        )
        self._scale_to(region, decision.target, now)

    def _scale_to(self, region: _Region, target: int, now: float) -> None:
        scaling = self.config.autoscaling
        assert scaling is not None
        nodes = region.nodes
        supply = sum(1 for n in nodes if n.state in (_SERVING, _PENDING))
        # more: a draining node serves again at once; then nodes are ordered
        for n in nodes:
            if supply >= target:
                break
            if n.state == _DRAINING:
                n.state = _SERVING
                supply += 1
                self._node_events.append((now, n.node_id, "undrained"))
                self._node_changed(region, n, now)
        for n in nodes:
            if supply >= target:
                break
            if n.state == _OFF:
                n.state = _PENDING
                n.since = now
                n.generation += 1
                supply += 1
                self._node_events.append((now, n.node_id, "ordered"))
                key = self._seq + 1  # the sequence number _push gives the event
                self._ready_at[key] = (n.index, n.generation)
                self._push(now + scaling.provision_delay_s, _NODE_READY, key)
        # fewer: the newest orders are cancelled, then the node with the least work drains
        for n in reversed(nodes):
            if supply <= target:
                break
            if n.state == _PENDING:
                self._node_events.append((now, n.node_id, "cancelled"))
                self._stop(n, now)
                supply -= 1
        while supply > target:
            serving = [n for n in nodes if n.state == _SERVING]
            victim = min(
                serving, key=lambda n: (n.engine.num_running + n.engine.num_waiting, -n.pos)
            )
            victim.state = _DRAINING
            supply -= 1
            self._node_events.append((now, victim.node_id, "draining"))
            if self._idle(victim):
                self._stop(victim, now)

    def _idle(self, node: _Node) -> bool:
        """No step running, nothing in its engine and nothing on its way to it."""
        if node.busy or node.engine.has_unfinished:
            return False
        return all(a.in_flight[node.pos] == 0 for a in self._regions[node.region].agents)

    def _node_ready(self, node: _Node, now: float, generation: int) -> None:
        if node.state != _PENDING or generation != node.generation:
            return  # cancelled while on its way (and perhaps ordered again since)
        node.state = _SERVING
        self._node_events.append((now, node.node_id, "ready"))
        node.engine = Engine(
            self.profile,
            rng=random.Random(self._fresh_engines.getrandbits(64)),
            record_events=False,
            event_token_ids=False,
        )
        region = self._regions[node.region]
        self._node_changed(region, node, now)

    def _node_changed(self, region: _Region, node: _Node, now: float) -> None:
        """``node`` serves (again): the agents forget what they scraped and route to it."""
        for agent in region.agents:
            agent.views[node.pos] = None
            agent.scrape[node.pos] = None
        for agent in region.agents:
            if agent.queue:
                self._pump(agent, now)

    def _stop(self, node: _Node, now: float) -> None:
        if node.state != _PENDING:
            self._node_events.append((now, node.node_id, "stopped"))
            for agent in self._regions[node.region].agents:  # what it held is gone with it
                agent.policy.forget_node(node.node_id)
        self._gpu_s += now - node.since
        node.state = _OFF

    # -- results -----------------------------------------------------------------------------

    def _outcomes(self) -> tuple[Outcome, ...]:
        out = []
        spill = self.config.spill
        for i, r in enumerate(self.requests):
            rec = self._records[i]
            node_i = self._node_of[i]
            spilled = self._spilled_to[i]
            # a spilled answer travels back to the home region: the client sees it half a
            # round trip later (the way there is in its arrival at the other region)
            back = 0.0 if spilled is None or spill is None else spill.rtt_s / 2
            out.append(
                Outcome(
                    index=i,
                    region=self._region_of[i],
                    agent=self._agent_of[i] % self.config.agents_per_region,
                    spilled_to=spilled,
                    node=None if node_i is None else self._nodes[node_i].node_id,
                    refused=self._refused[i],
                    arrival_s=r.timestamp_s,
                    dispatched_s=self._dispatched[i],
                    queued_s=None if rec is None else rec.queued_s,
                    first_scheduled_s=None if rec is None else rec.first_scheduled_s,
                    first_token_s=(
                        None
                        if rec is None or rec.first_token_s is None
                        else rec.first_token_s + back
                    ),
                    finished_s=None if rec is None else rec.finished_s + back,
                    prompt_tokens=r.input_length,
                    cached_prompt_tokens=0 if rec is None else rec.cached_prompt_tokens,
                    output_tokens=0 if rec is None else rec.generation_tokens,
                )
            )
        return tuple(out)

    def _summary(self, outcomes: Sequence[Outcome], wall_s: float) -> dict[str, float | int | str]:
        done = [o for o in outcomes if o.finished_s is not None]
        ttft = [o.first_token_s - o.arrival_s for o in done if o.first_token_s is not None]
        e2e = [o.finished_s - o.arrival_s for o in done if o.finished_s is not None]
        queue = [
            (o.dispatched_s - o.arrival_s) + (o.first_scheduled_s - o.queued_s)
            for o in done
            if o.dispatched_s is not None
            and o.first_scheduled_s is not None
            and o.queued_s is not None
        ]
        agent_queue = [o.dispatched_s - o.arrival_s for o in done if o.dispatched_s is not None]
        prompt_tokens = sum(o.prompt_tokens for o in done)
        cached = sum(o.cached_prompt_tokens for o in done)
        output = sum(o.output_tokens for o in done)
        start = min((o.arrival_s for o in outcomes), default=0.0)
        end = max((o.finished_s for o in done if o.finished_s is not None), default=start)
        span = max(end - start, 1e-9)
        refused: dict[str, int] = {}
        for o in outcomes:
            if o.refused is not None:
                refused[o.refused] = refused.get(o.refused, 0) + 1
        preemptions = sum(n.engine.stats.num_preemptions for n in self._nodes)
        spilled = [o for o in done if o.spilled_to is not None]
        stayed = [o for o in done if o.spilled_to is None]

        def ttft_of(group: Sequence[Outcome], q: float) -> float:
            return percentile(
                [o.first_token_s - o.arrival_s for o in group if o.first_token_s is not None], q
            )

        def hit_rate(group: Sequence[Outcome]) -> float:
            tokens = sum(o.prompt_tokens for o in group)
            return sum(o.cached_prompt_tokens for o in group) / tokens if tokens else 0.0

        index_bytes = [routing.prefix_index_bytes(a.policy) for a in self._agents]
        cfg = self.config
        gpu_s = self._gpu_s + sum(self._end_s - n.since for n in self._nodes if n.state != _OFF)
        summary: dict[str, float | int | str] = {
            "policy": cfg.policy,
            "nodes": cfg.nodes,
            "regions": cfg.regions,
            "agents_per_region": cfg.agents_per_region,
            "scrape_interval_s": cfg.scrape_interval_s,
            "requests": len(outcomes),
            "completed": len(done),
            "refused_queue_full": refused.get("queue_full", 0),
            "refused_deadline": refused.get("deadline", 0),
            "refused_too_large": refused.get("too_large", 0),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99),
            "e2e_p50_s": percentile(e2e, 0.5),
            "e2e_p99_s": percentile(e2e, 0.99),
            "queue_wait_p50_s": percentile(queue, 0.5),
            "queue_wait_p99_s": percentile(queue, 0.99),
            "agent_queue_wait_p99_s": percentile(agent_queue, 0.99),
            "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
            "throughput_tok_s": output / span,
            "preemptions": preemptions,
            "spilled": sum(1 for o in outcomes if o.spilled_to is not None),
            # the agents' prefix indexes at the end, all agents, by the index's own estimate
            "prefix_index_mib": sum(b or 0 for b in index_bytes) / 2**20,
            # with kv_events: the precise index of each agent (one region's is every agent's)
            "kv_index_mib": sum(
                r.kv_index.estimated_bytes() * len(r.agents)
                for r in self._regions
                if r.kv_index is not None
            )
            / 2**20,
            "kv_events": cfg.kv_events,
            "virtual_s": span,
            "wall_s": wall_s,
            "cpu_s": self._cpu_s,
            "engine_steps": self.num_steps,
            "decisions": self.num_decisions,
            # GPU time from each node's order to its stop (without autoscaling: every node, all
            # the run), and the nodes that time averages to
            "gpu_hours": gpu_s / 3600.0,
            "nodes_mean": gpu_s / self._end_s if self._end_s > 0 else float(cfg.nodes),
        }
        if cfg.spill is not None:  # what the spilled requests and the others saw
            summary.update(
                {
                    "ttft_spilled_p50_s": ttft_of(spilled, 0.5),
                    "ttft_spilled_p99_s": ttft_of(spilled, 0.99),
                    "ttft_stayed_p50_s": ttft_of(stayed, 0.5),
                    "ttft_stayed_p99_s": ttft_of(stayed, 0.99),
                    "hit_rate_spilled": hit_rate(spilled),
                    "hit_rate_stayed": hit_rate(stayed),
                }
            )
        return summary


def simulate(
    profile: Profile,
    requests: Sequence[TraceRequest],
    config: FleetConfig,
    *,
    progress: TextIO | None = None,
    hasher: BlockHasher | None = None,
) -> FleetResult:
    """Run ``requests`` (sorted by ``timestamp_s``) through a fleet; see the module docstring."""
    return Fleet(profile, requests, config, progress=progress, hasher=hasher).run()


def with_context(profile: Profile, max_model_len: int | None) -> Profile:
    """The profile with a longer context (same timing and KV cache), e.g. Llama-3.1's 128k."""
    if max_model_len is None or max_model_len == profile.max_model_len:
        return profile
    return dataclasses.replace(profile, max_model_len=max_model_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A trace prepared for one fleet size and load."""

    requests: tuple[TraceRequest, ...]
    node_capacity_rps: float  # one node's capacity on this length mix (no prefix reuse)
    rate_per_s: float  # the arrival rate the trace was scaled to
    load: float


def at_load(
    requests: Sequence[TraceRequest],
    profile: Profile,
    *,
    nodes: int,
    load: float,
    slots_per_node: int = 64,
    duration_s: float | None = None,
    min_requests: int = 0,
    node_capacity_rps: float | None = None,
) -> Workload:
    """Scale ``requests`` to ``load`` times the fleet's capacity, then keep the first
    ``duration_s`` seconds of arrivals (at least ``min_requests`` requests, when the trace has
    them).  Capacity is ``nodes * workloads.node_capacity_rps(...)`` unless given."""
    if load <= 0:
        raise FleetError(f"load must be > 0, got {load}")
    cap = (
        node_capacity_rps
        if node_capacity_rps is not None
        else workloads.node_capacity_rps(profile, requests, slots=slots_per_node)
    )
    rate = load * nodes * cap
    scaled = workloads.scale_to_rate(requests, rate_per_s=rate)
    if duration_s is not None:
        keep = sum(1 for r in scaled if r.timestamp_s < duration_s)
        scaled = scaled[: max(keep, min(min_requests, len(scaled)))]
    return Workload(requests=tuple(scaled), node_capacity_rps=cap, rate_per_s=rate, load=load)
