"""Region failover: health windows, region states, backups under data residency, pre-warm
floors, the failback ramp and the "never all off" rule.  Pure: every call takes ``now`` (unix
seconds); nothing here reads a clock, does I/O or logs.

The global controller calls :func:`plan` once per health window (``window_s``, 30 s)::

    result = failover.plan(previous, observations, topology=topology, config=config, now=now)
    # persist result.state, apply weights / floors / DNS, log result.events, raise result.alert

and may call it between windows with ``judge=False`` (an operator's drain or manual failover
takes effect at once, without counting a window).  ``previous`` is the last call's
``result.state`` (``FleetState()`` the first time).

**A window** (:func:`judge_window`) fails when the region's liveness lease is gone, a majority
of the controller replicas that probed its endpoints could not reach it
(``Observation.reach``, :mod:`policies.probing`), its status is missing or older than
``status_stale_s``, fewer than ``min_healthy_fraction`` of its nodes are
healthy (a region with no nodes fails), its error rate is above ``max_error_rate``, or its p99
time to first token is above ``ttft_p99_slo_s`` (an unknown TTFT is not a failure).  Thresholds
are strict: exactly at the limit passes.

**States** (the ``weight`` is the share of its own traffic a region keeps, 0..1)::

    healthy     weight 1
    suspect     1..strikes-1 consecutive failed windows; keeps its weight (1, or the ramp step
                it had reached when recovering: the ramp pauses)
    failed      ``strikes`` consecutive failed windows, or a manual failover; weight 0
    recovering  after ``recovery_windows`` consecutive good windows AND ``min_hold_s`` in
                failed: weight ramp[0], then the next ramp step per good window; the step that
                reaches 1.0 makes it healthy.  A failed window pauses the ramp (suspect); strikes
                make it failed again, and the hold starts over.
    drained     the operator's admin state is draining or drained; weight 0

Strikes (consecutive failed windows, capped at ``strikes``) and good windows (consecutive good
ones) are counted in every state, so a drained or manually held region is judged all along.  A
manual failover holds the region failed until the manual failback; a drain holds it drained
until the undrain.  Neither jumps back to full weight: a region released with
``recovery_windows`` good windows behind it (and, after a manual failover, ``min_hold_s``
served since it went failed) starts the ramp at once; otherwise it is failed until it earns the
ramp (a drained region released without them is failed from that moment, hold included).  A
new region (one ``previous`` does not know) starts healthy and is judged from its first window.

**Backups** (:func:`choose_backup`): every region gets one each window, so it can be kept warm
before it is needed.  Never a failed or drained region, never the region itself, and always one
whose residency tags include all of the region's (``{"eu"}`` traffic stays in ``eu`` regions),
even when an operator configured or requested another: the verdict then says why there is none.
A recovering region is a last resort (it is ramping its own traffic back; a failover's whole
share would defeat the ramp).  Otherwise the preference is an operator's manual failover
target, then the configured list in order, then the nearest compliant region (latency matrix
in ms, else great-circle distance as an estimated round trip of 1 ms per 100 km, else unknown
and last); among regions within ``proximity_tolerance_ms`` of the nearest, the one with the
most headroom (``capacity * (1 - kv_util)`` from a fresh status) wins; then the nearer, then
the id.

**Floors**: a region's ``capacity_floor`` is ``prewarm_fraction`` times the sum of the
``serving_capacity`` of the regions it protects (whose backup it is).  ``serving_capacity`` is a
region's capacity in its last good window as a healthy region: it follows the region up and down
while it is healthy and is kept while it is suspect, failed, recovering or drained, so a backup's
floor does not collapse when the region it protects dies.  The floor stays at that fraction
during a failover too (the autoscaler takes the moved traffic from there).

**Steering** (``FleetState.serving``): per geography (``RegionInfo.geo``), the regions that
answer and their shares, summing to 1.  Each member region has a base share, its
``serving_capacity`` (``shares="capacity"``, the default: a region of 3 nodes takes 60 % against
one of 2; a member not measured yet counts as the mean of those that are) or 1 each
(``shares="equal"``); it keeps ``weight`` of it and the rest goes to its backup (a member
without a backup loses the rest to the other answers).  **Never all off**: when a geography
would have no answer, its previous answer stays in force and the plan carries an ``alert``
(with a reason); ``Verdict.weight`` still tells the truth about the region.  When every region
is failed or drained the alert says so.

Every change comes back as an :class:`Event` with a short ``reason`` for the shell to log and
store: ``strike`` (a failed window counted), ``state``, ``failover`` (traffic moves to a backup,
or to a new one), ``recovery`` (a ramp step), ``floor``, ``residency`` (residency ruled out a
configured or requested backup, or every candidate), ``alert`` (raised, changed or cleared),
``model`` (a model's backup, or a status claiming a model with no capacity) and ``spill`` (a
region's agents started or stopped forwarding requests to other regions, from its status's
``spilled_per_s``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, NewType, get_args

from policies.probing import Reach

RegionId = NewType("RegionId", str)
RegionState = Literal["healthy", "suspect", "failed", "recovering", "drained"]
RegionAdmin = Literal["active", "draining", "drained"]
ShareRule = Literal["capacity", "equal"]
BackupRank = Literal["latency", "proximity"]
EventKind = Literal[
    "strike", "state", "failover", "floor", "recovery", "alert", "residency", "model", "spill"
]
EventValue = str | int | float | bool | None | tuple[str, ...]

STATES: Final[frozenset[str]] = frozenset(get_args(RegionState))
EVENT_KINDS: Final[frozenset[str]] = frozenset(get_args(EventKind))
KM_PER_MS: Final = 100.0  # light in fibre covers ~200 km/ms; there and back: 100 km per ms RTT
EARTH_RADIUS_KM: Final = 6371.0
_EPS: Final = 1e-9
_DOWN: Final[frozenset[str]] = frozenset({"failed", "drained"})


# -- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FailoverConfig:
    """The policy's knobs, with their units.  Out-of-range values raise ValueError naming the
    field.  The controller's ``FailoverSettings`` carries the same names and defaults."""

    window_s: float = 30.0  # length of a health window; also Plan.recheck_after_s
    strikes: int = 3  # consecutive failed windows before failed
    recovery_windows: int = 2  # consecutive good windows before the ramp may start
    ramp: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)  # weight per good window; ends at 1.0
    min_hold_s: float = 60.0  # least time in failed before the ramp may start
    status_stale_s: float = 60.0  # a status older than this fails the window
    min_healthy_fraction: float = 0.5  # a window fails below this share of healthy nodes
    max_error_rate: float = 0.05  # a window fails above this share of failed requests
    ttft_p99_slo_s: float | None = 5.0  # a window fails above this p99 TTFT; None: not checked
    prewarm_fraction: float = 0.5  # backup floor, as a share of the capacity it protects
    proximity_tolerance_ms: float = 5.0  # backups this close to the nearest compete on headroom
    shares: ShareRule = "capacity"  # a member's base share of its geography: capacity or equal
    # how automatic backups rank: round trip + the candidate's published p99 TTFT ("latency"),
    # or the round trip alone ("proximity")
    backup_rank: BackupRank = "latency"
    latency_hysteresis_ms: float = 250.0  # a backup is replaced only by one this much sooner

    def __post_init__(self) -> None:
        _check_config(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionInfo:
    """What the controller's configuration (and the region's status) says of a region."""

    region: RegionId
    geo: str  # the geography it serves: one DNS view per geography
    residency: frozenset[str] = frozenset()  # data-residency tags it meets
    backups: tuple[RegionId, ...] = ()  # configured backups, in order of preference
    coordinates: tuple[float, float] | None = None  # (latitude, longitude), degrees


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Every region the controller knows, and the latency between them."""

    regions: Mapping[RegionId, RegionInfo]
    latency_ms: Mapping[tuple[RegionId, RegionId], float] = field(default_factory=dict)
    """Round-trip latency, ms; (a, b) also answers for (b, a)."""

    @classmethod
    def build(
        cls,
        regions: Iterable[RegionInfo],
        latency_ms: Mapping[tuple[RegionId, RegionId], float] | None = None,
    ) -> Topology:
        by_id: dict[RegionId, RegionInfo] = {}
        for info in regions:
            if info.region in by_id:
                raise ValueError(f"Topology.regions: duplicate region {info.region!r}")
            by_id[info.region] = info
        return cls(regions=by_id, latency_ms=dict(latency_ms or {}))


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusSnapshot:
    """The part of a region's published status (``RegionStatus``) that the policy uses."""

    nodes_healthy: int
    nodes_total: int
    capacity: float  # healthy nodes' weights summed, node-equivalents (H100 = 1.0)
    error_rate: float  # failed share of finished requests, 0..1
    ttft_p99_s: float | None  # p99 time to first token, seconds; None: unknown
    kv_util: float = 0.0  # mean KV-cache use of healthy nodes, 0..1 (load, for headroom)
    queue_depth: int = 0  # requests waiting in the agent's queue
    in_flight: int = 0  # requests on the region's nodes
    models: Mapping[str, float] | None = None  # model -> serving capacity; None: not published
    spilled_per_s: float = 0.0  # requests/s other regions served for it (spill-over)

    @property
    def headroom(self) -> float:
        """Spare capacity, node-equivalents: ``capacity * (1 - kv_util)``."""
        return self.capacity * (1.0 - min(1.0, max(0.0, self.kv_util)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """What the controller saw of one region this window."""

    region: RegionId
    alive: bool  # the liveness key (under the agent's lease) exists
    status: StatusSnapshot | None = None  # None: no (valid) status
    status_age_s: float | None = None  # now - status.updated_at; required with a status
    admin: RegionAdmin = "active"  # the operator's admin state
    manual_failover: bool = False  # an operator's manual failover is in force
    failover_target: RegionId | None = None  # the operator's chosen backup, while manual
    reach: Reach | None = None  # the controller replicas' probes (None: no replica voted)

    def __post_init__(self) -> None:
        if self.status is not None and self.status_age_s is None:
            raise ValueError(f"Observation.status_age_s is required with a status ({self.region})")


# -- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowResult:
    """One region's judgement for one window."""

    ok: bool
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BackupChoice:
    """A region's backup, or ``None`` with the reason there is none."""

    backup: RegionId | None
    reason: str
    residency_limited: bool = False  # residency ruled out a requested, configured or any backup


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The controller's judgement of one region (maps onto ``RegionHealth`` and
    ``RegionDesired``; ``serving_capacity`` onto ``FleetPlan.protected_capacity``)."""

    region: RegionId
    state: RegionState
    since: float  # when it entered ``state``
    reason: str  # why it is in ``state``
    weight: float = 1.0  # share of its own traffic it keeps, 0..1; the rest goes to ``backup``
    strikes: int = 0  # consecutive failed windows, 0..config.strikes
    good_windows: int = 0  # consecutive good windows
    manual: bool = False  # held by an operator's manual failover
    backup: RegionId | None = None
    backup_reason: str = ""
    capacity_floor: float = 0.0  # node-equivalents to keep warm for the regions it protects
    protects: tuple[RegionId, ...] = ()  # regions whose backup it is, sorted
    serving_capacity: float = 0.0  # capacity in its last good window as a healthy region
    # per model (sorted by model): the capacity it served each model with in its last good
    # window as a healthy region; empty: it never published models (assumed to serve any)
    serving_models: tuple[tuple[str, float], ...] = ()
    model_backups: tuple[tuple[str, RegionId | None], ...] = ()  # each of its models' backup
    model_floors: tuple[tuple[str, float], ...] = ()  # per model, the floor of what it protects
    ignored_models: tuple[str, ...] = ()  # models its status claims with no capacity
    spilling: bool = False  # its agents forward requests to other regions (spill-over)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A change, for the shell to log and store (``meridian_wire.models.Event``)."""

    kind: EventKind
    region: RegionId | None
    reason: str
    at: float
    data: Mapping[str, EventValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetState:
    """Everything :func:`plan` remembers between windows.  ``FleetState()`` is the start."""

    verdicts: Mapping[RegionId, Verdict] = field(default_factory=dict)
    window: int = 0  # windows judged so far
    serving: Mapping[str, Mapping[RegionId, float]] = field(default_factory=dict)
    """The plan in force: per geography, region -> share of that geography's traffic (shares sum
    to 1; empty only when there never was an answer).  Always the last good plan."""
    alert: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The result of one :func:`plan` call."""

    state: FleetState
    events: tuple[Event, ...] = ()
    recheck_after_s: float

    @property
    def alert(self) -> str | None:
        """Why the "never all off" rule holds a previous answer, or ``None``."""
        return self.state.alert


# -- configuration -----------------------------------------------------------------------------


def _check_config(config: FailoverConfig) -> None:
    where = "FailoverConfig"
    for name in ("strikes", "recovery_windows"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{name} must be an integer of at least 1, got {value!r}")
    for name in ("window_s", "status_stale_s"):
        value = getattr(config, name)
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{where}.{name} must be a positive number of seconds, got {value!r}")
    for name in ("min_hold_s", "proximity_tolerance_ms"):
        value = getattr(config, name)
        if not value >= 0 or math.isinf(value):
            raise ValueError(f"{where}.{name} must be >= 0, got {value!r}")
    if not config.latency_hysteresis_ms >= 0:
        raise ValueError(
            f"{where}.latency_hysteresis_ms must be >= 0, got {config.latency_hysteresis_ms!r}"
        )
    for name in ("min_healthy_fraction", "max_error_rate", "prewarm_fraction"):
        value = getattr(config, name)
        if not 0 <= value <= 1:
            raise ValueError(f"{where}.{name} must be within 0..1, got {value!r}")
    if config.shares not in get_args(ShareRule):
        raise ValueError(
            f"{where}.shares must be one of {', '.join(get_args(ShareRule))}, got {config.shares!r}"
        )
    if config.backup_rank not in get_args(BackupRank):
        raise ValueError(
            f"{where}.backup_rank must be one of {', '.join(get_args(BackupRank))}, got "
            f"{config.backup_rank!r}"
        )
    slo = config.ttft_p99_slo_s
    if slo is not None and (not slo > 0 or math.isinf(slo)):
        raise ValueError(f"{where}.ttft_p99_slo_s must be positive seconds or None, got {slo!r}")
    ramp = config.ramp
    if not ramp:
        raise ValueError(f"{where}.ramp must not be empty; it must end at 1.0")
    if not all(0 < step <= 1 for step in ramp):
        raise ValueError(f"{where}.ramp steps must be within (0, 1], got {ramp!r}")
    if any(b <= a for a, b in itertools.pairwise(ramp)):
        raise ValueError(f"{where}.ramp must be strictly increasing, got {ramp!r}")
    if ramp[-1] != 1.0:
        raise ValueError(f"{where}.ramp must end at 1.0, got {ramp!r}")


def validate_config(config: FailoverConfig, topology: Topology) -> None:
    """Raise ValueError naming the first bad field of ``config`` or ``topology``: a config out
    of range (also checked when a :class:`FailoverConfig` is made), a region keyed under another
    id or without a geography, coordinates out of range, a backup list naming the region itself,
    an unknown region, a duplicate or a region that breaks residency, or a latency that names an
    unknown region or is negative.  The controller calls it once at start."""
    _check_config(config)
    regions = topology.regions
    for key in sorted(regions):
        info = regions[key]
        where = f"Topology.regions[{key!r}]"
        if info.region != key:
            raise ValueError(f"{where}.region is {info.region!r}; it must equal its key")
        if not info.geo:
            raise ValueError(f"{where}.geo must not be empty")
        if info.coordinates is not None:
            lat, lon = info.coordinates
            if not (-90 <= lat <= 90 and -180 <= lon <= 180):
                raise ValueError(
                    f"{where}.coordinates must be (latitude -90..90, longitude -180..180), "
                    f"got {info.coordinates!r}"
                )
        seen: set[RegionId] = set()
        for i, backup in enumerate(info.backups):
            at = f"{where}.backups[{i}]"
            if backup == key:
                raise ValueError(f"{at}: {key} cannot back itself up")
            if backup not in regions:
                raise ValueError(f"{at}: unknown region {backup!r}")
            if backup in seen:
                raise ValueError(f"{at}: {backup} is listed twice")
            seen.add(backup)
            missing = info.residency - regions[backup].residency
            if missing:
                raise ValueError(
                    f"{at}: {backup} breaks residency: it lacks {_tags(missing)} that {key} "
                    "requires; pick a compliant backup"
                )
    for (a, b), ms in topology.latency_ms.items():
        where = f"Topology.latency_ms[({a!r}, {b!r})]"
        for end in (a, b):
            if end not in regions:
                raise ValueError(f"{where}: unknown region {end!r}")
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"{where} must be a latency >= 0 ms, got {ms!r}")


# -- one window --------------------------------------------------------------------------------


def judge_window(observation: Observation, *, config: FailoverConfig) -> WindowResult:
    """Whether ``observation`` makes a good window; the reason lists every failed check, or
    sums up a good one."""
    problems: list[str] = []
    if not observation.alive:
        problems.append("liveness lease gone")
    if observation.reach is not None and observation.reach.unreachable:
        problems.append(observation.reach.reason)
    status, age_s = observation.status, observation.status_age_s
    if status is None or age_s is None:
        problems.append("no status")
        return WindowResult(ok=False, reason="; ".join(problems))
    if age_s > config.status_stale_s:
        problems.append(f"status stale ({age_s:.0f} s old > {config.status_stale_s:g} s)")
        return WindowResult(ok=False, reason="; ".join(problems))
    nodes = f"{status.nodes_healthy}/{status.nodes_total} nodes healthy"
    if status.nodes_total <= 0:
        problems.append("no nodes")
    else:
        fraction = status.nodes_healthy / status.nodes_total
        if fraction < config.min_healthy_fraction:
            problems.append(f"{nodes} ({fraction:.2f} < {config.min_healthy_fraction:g})")
    if status.error_rate > config.max_error_rate:
        problems.append(f"error rate {status.error_rate:.3g} > {config.max_error_rate:g}")
    slo, ttft = config.ttft_p99_slo_s, status.ttft_p99_s
    if slo is not None and ttft is not None and ttft > slo:
        problems.append(f"ttft p99 {ttft:.3g} s > {slo:g} s")
    if problems:
        return WindowResult(ok=False, reason="; ".join(problems))
    ttft_text = "unknown" if ttft is None else f"{ttft:.3g} s"
    return WindowResult(
        ok=True, reason=f"{nodes}, error rate {status.error_rate:.3g}, ttft p99 {ttft_text}"
    )


# -- backups -----------------------------------------------------------------------------------


def great_circle_km(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Distance between two (latitude, longitude) points in degrees, km (haversine)."""
    lat1, lon1, lat2, lon2 = map(math.radians, (*a, *b))
    h = (
        math.sin((lat2 - lat1) / 2) ** 2
        + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    )
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def proximity_ms(a: RegionId, b: RegionId, *, topology: Topology) -> float:
    """Round trip between two regions, ms: the latency matrix (either order), else the
    great-circle distance at ``KM_PER_MS`` km per ms, else ``inf`` (unknown)."""
    ms = topology.latency_ms.get((a, b))
    if ms is None:
        ms = topology.latency_ms.get((b, a))
    if ms is not None:
        return ms
    ca, cb = topology.regions[a].coordinates, topology.regions[b].coordinates
    if ca is not None and cb is not None:
        return great_circle_km(ca, cb) / KM_PER_MS
    return math.inf


def choose_backup(
    region: RegionId,
    *,
    topology: Topology,
    states: Mapping[RegionId, RegionState],
    statuses: Mapping[RegionId, StatusSnapshot | None],
    config: FailoverConfig,
    prefer: RegionId | None = None,
    serves: Callable[[RegionId], bool] | None = None,
    serving: str = "",
    incumbent: RegionId | None = None,
) -> BackupChoice:
    """The backup of ``region`` (see the module docstring for the order).  ``states``: each
    region's state now (failed and drained regions are never backups; recovering ones only when
    no other compliant region is up; a region missing from it counts as up); ``statuses``: fresh
    statuses for headroom (missing or ``None``: unknown); ``prefer``: an operator's manual
    failover target, tried first; ``serves``: only regions it is true of (they serve the
    models at stake, ``serving`` names them in the reasons); ``incumbent``: the backup it had,
    kept among automatic choices unless another gives a first token ``latency_hysteresis_ms``
    sooner (published TTFTs move with load: no backup flapping)."""
    regions = topology.regions
    needs = regions[region].residency
    wanted: list[tuple[str, RegionId]] = []
    if prefer is not None:
        wanted.append(("operator's failover target", prefer))
    wanted += [(f"configured backup #{i + 1}", b) for i, b in enumerate(regions[region].backups)]
    quick = _wanted_and_up(
        region, wanted, topology=topology, states=states, serves=serves, serving=serving
    )
    if quick is not None:  # a wanted region is up and compliant: no need to look at every other
        return quick
    lacking: dict[RegionId, frozenset[str]] = {}  # up, but missing some of the region's tags
    usable: list[RegionId] = []  # up and compliant
    idle: list[RegionId] = []  # up and compliant, but does not serve what is at stake
    for candidate in sorted(regions):
        if candidate == region or states.get(candidate) in _DOWN:
            continue
        missing = needs - regions[candidate].residency
        if missing:
            lacking[candidate] = missing
        elif serves is not None and not serves(candidate):
            idle.append(candidate)
        else:
            usable.append(candidate)
    full = [c for c in usable if states.get(c) != "recovering"]
    ramping = [c for c in usable if states.get(c) == "recovering"]
    residency_limited = any(c in lacking for _, c in wanted)

    def skipped(tier: list[RegionId]) -> str:
        """Why each wanted region before the one taken from ``tier`` was passed over."""
        notes = []
        for _, candidate in wanted:
            if candidate in tier:
                break
            if candidate == region:
                notes.append(f"{candidate} is the region itself")
            elif candidate not in regions:
                notes.append(f"{candidate} is unknown")
            elif candidate in lacking:
                notes.append(f"{candidate} lacks residency {_tags(lacking[candidate])}")
            elif candidate in idle:
                notes.append(f"{candidate} does not serve {serving}")
            else:
                notes.append(f"{candidate} is {states.get(candidate)}")
        return f" (skipped: {'; '.join(notes)})" if notes else ""

    for tier in (full, ramping):
        if not tier:
            continue
        last_resort = (
            " (recovering itself: no other compliant region is up)" if tier is ramping else ""
        )
        for label, candidate in wanted:
            if candidate in tier:
                reason = f"{label} {candidate}{last_resort}{skipped(tier)}"
                return BackupChoice(
                    backup=candidate, reason=reason, residency_limited=residency_limited
                )
        chosen, reason = _nearest(
            region, tier, topology=topology, statuses=statuses, config=config,
            incumbent=incumbent,
        )  # fmt: skip
        return BackupChoice(
            backup=chosen,
            reason=f"{reason}{last_resort}{skipped(tier)}",
            residency_limited=residency_limited,
        )
    if idle or (serves is not None and lacking):
        why = []
        if idle:
            why.append(f"{', '.join(idle)} {'does' if len(idle) == 1 else 'do'} not serve it")
        if lacking:
            lack = "lacks" if len(lacking) == 1 else "lack"
            why.append(f"{', '.join(lacking)} {lack} residency {_tags(needs)}")
        reason = (
            f"no region that meets residency {_tags(needs)} serves {serving} ({'; '.join(why)})"
        )
    elif lacking:
        reason = f"no backup meets residency {_tags(needs)} ({', '.join(lacking)} lack it)"
    else:
        reason = "no other region is up"
    return BackupChoice(backup=None, reason=reason + skipped([]), residency_limited=bool(lacking))


def _wanted_and_up(
    region: RegionId,
    wanted: Sequence[tuple[str, RegionId]],
    *,
    topology: Topology,
    states: Mapping[RegionId, RegionState],
    serves: Callable[[RegionId], bool] | None = None,
    serving: str = "",
) -> BackupChoice | None:
    """``choose_backup``'s answer when a wanted region (the operator's target, a configured
    backup) is up, compliant, serves what is at stake and is not recovering, in
    O(len(wanted)) instead of a look at every region (a 500-region pass spent a quarter of its
    time here); ``None`` otherwise."""
    regions = topology.regions
    needs = regions[region].residency
    notes: list[str] = []
    chosen: tuple[str, RegionId] | None = None
    limited = False
    for label, candidate in wanted:
        known = candidate in regions and candidate != region
        missing = needs - regions[candidate].residency if known else frozenset()
        up = known and states.get(candidate) not in _DOWN
        limited = limited or (up and bool(missing))
        if chosen is not None:
            continue
        idle = up and not missing and serves is not None and not serves(candidate)
        if up and not missing and not idle and states.get(candidate) != "recovering":
            chosen = (label, candidate)
        elif idle:
            notes.append(f"{candidate} does not serve {serving}")
        elif candidate == region:
            notes.append(f"{candidate} is the region itself")
        elif not known:
            notes.append(f"{candidate} is unknown")
        elif up and missing:
            notes.append(f"{candidate} lacks residency {_tags(missing)}")
        else:
            notes.append(f"{candidate} is {states.get(candidate)}")
    if chosen is None:
        return None
    skipped = f" (skipped: {'; '.join(notes)})" if notes else ""
    return BackupChoice(
        backup=chosen[1], reason=f"{chosen[0]} {chosen[1]}{skipped}", residency_limited=limited
    )


def _nearest(
    region: RegionId,
    candidates: list[RegionId],
    *,
    topology: Topology,
    statuses: Mapping[RegionId, StatusSnapshot | None],
    config: FailoverConfig,
    incumbent: RegionId | None = None,
) -> tuple[RegionId, str]:
    """The candidate its clients would get a first token from soonest: the round trip to it
    (latency matrix, else distance) plus, with ``backup_rank="latency"``, its published p99
    TTFT (a candidate whose TTFT is unknown counts as the mean of those known).  Among those
    within ``proximity_tolerance_ms`` of the best, the most headroom (known headroom first),
    then the lower cost, the id.  The reason names the nearest region too when the TTFT made
    another one win."""
    near = {c: proximity_ms(region, c, topology=topology) for c in candidates}
    chosen, reason = _cheapest(candidates, near, statuses=statuses, config=config)
    if config.backup_rank != "latency":
        return chosen, reason
    known: dict[RegionId, float] = {}
    for c in candidates:
        status = statuses.get(c)
        if status is not None and status.ttft_p99_s is not None:
            known[c] = status.ttft_p99_s * 1000
    if not known:
        return chosen, reason
    mean = sum(known.values()) / len(known)
    cost = {c: near[c] + known.get(c, mean) for c in candidates}
    soonest, _ = _cheapest(candidates, cost, statuses=statuses, config=config)
    if (
        incumbent is not None
        and incumbent in cost
        and incumbent != soonest
        and cost[incumbent] - cost[soonest] <= config.latency_hysteresis_ms
    ):
        soonest = incumbent  # not sooner by enough to move the backup (and its floor)
    if soonest == chosen:
        return chosen, reason

    def seen(c: RegionId) -> str:
        away = "unknown distance" if math.isinf(near[c]) else f"{near[c]:.0f} ms"
        ttft = f"p99 TTFT {known[c] / 1000:.3g} s" if c in known else "p99 TTFT unknown"
        return f"{away}, {ttft}"

    return soonest, (
        f"soonest first token of {len(candidates)} compliant regions ({seen(soonest)}; the "
        f"nearest, {chosen}: {seen(chosen)})"
    )


def _cheapest(
    candidates: list[RegionId],
    cost: Mapping[RegionId, float],
    *,
    statuses: Mapping[RegionId, StatusSnapshot | None],
    config: FailoverConfig,
) -> tuple[RegionId, str]:
    """The lowest ``cost`` (ms); among those within ``proximity_tolerance_ms`` of it, the
    most headroom (known headroom first), then the lower cost, the id."""
    best = min(cost.values())
    close = [c for c in candidates if cost[c] <= best + config.proximity_tolerance_ms]

    def rank(c: RegionId) -> tuple[int, float, float, str]:
        status = statuses.get(c)
        if status is None:
            return (1, 0.0, cost[c], c)
        return (0, -status.headroom, cost[c], c)

    chosen = min(close, key=rank)
    distance = "unknown distance" if math.isinf(cost[chosen]) else f"{cost[chosen]:.0f} ms"
    if len(close) == 1:
        return chosen, f"nearest compliant region ({distance})"
    return chosen, (
        f"most headroom of {len(close)} compliant regions within "
        f"{config.proximity_tolerance_ms:g} ms of the nearest ({distance})"
    )


def _tags(tags: Iterable[str]) -> str:
    return ",".join(sorted(tags)) or "none"


# -- the plan ----------------------------------------------------------------------------------


def plan(
    previous: FleetState,
    observations: Iterable[Observation],
    *,
    topology: Topology,
    config: FailoverConfig,
    now: float,
    judge: bool = True,
) -> Plan:
    """The fleet's next state from ``previous`` and this window's ``observations`` (one per
    region at most; a region of ``topology`` without one counts as lease gone, no status).
    ``judge=False`` counts no window: admin states, manual failovers, backups, floors and
    steering are brought up to date, health evidence is ignored.  Regions that ``topology`` no
    longer has are forgotten; an observation of a region it does not have is a ValueError."""
    seen: dict[RegionId, Observation] = {}
    for observation in observations:
        if observation.region not in topology.regions:
            raise ValueError(f"observation of region {observation.region!r}, not in the topology")
        if observation.region in seen:
            raise ValueError(f"two observations of region {observation.region!r}")
        seen[observation.region] = observation

    events: list[Event] = []
    verdicts: dict[RegionId, Verdict] = {}
    fresh: dict[RegionId, StatusSnapshot | None] = {}
    for region in sorted(topology.regions):
        observation = seen.get(region) or Observation(region=region, alive=False)
        before = previous.verdicts.get(region) or Verdict(
            region=region, state="healthy", since=now, reason="new region: healthy until judged"
        )
        verdicts[region] = _judge_region(
            before, observation, config=config, now=now, judge=judge, events=events
        )
        age_s = observation.status_age_s
        usable = age_s is not None and age_s <= config.status_stale_s
        fresh[region] = observation.status if usable else None

    _assign_backups(
        verdicts,
        seen,
        fresh,
        topology=topology,
        config=config,
        previous=previous,
        now=now,
        events=events,
    )
    _assign_floors(verdicts, config=config, previous=previous, now=now, events=events)
    serving, dark = _steer(verdicts, topology=topology, previous=previous, rule=config.shares)
    alert = _alert(verdicts, dark, serving)
    if alert != previous.alert:
        events.append(
            Event(
                kind="alert",
                region=None,
                reason=alert if alert is not None else f"cleared: {previous.alert}",
                at=now,
                data={"active": alert is not None, "geos": tuple(geo for geo, _ in dark)},
            )
        )
    state = FleetState(
        verdicts=verdicts,
        window=previous.window + (1 if judge else 0),
        serving=serving,
        alert=alert,
    )
    return Plan(state=state, events=tuple(events), recheck_after_s=config.window_s)


def _assign_backups(
    verdicts: dict[RegionId, Verdict],
    seen: Mapping[RegionId, Observation],
    fresh: Mapping[RegionId, StatusSnapshot | None],
    *,
    topology: Topology,
    config: FailoverConfig,
    previous: FleetState,
    now: float,
    events: list[Event],
) -> None:
    states: dict[RegionId, RegionState] = {r: v.state for r, v in verdicts.items()}
    served = {r: _models_of(r, verdicts, fresh) for r in verdicts}
    for region in sorted(verdicts):
        observation = seen.get(region)
        prefer = None
        if observation is not None and observation.manual_failover:
            prefer = observation.failover_target
        before = previous.verdicts.get(region)
        chooser = _Chooser(
            region=region, topology=topology, states=states, fresh=fresh, config=config,
            prefer=prefer, served=served, incumbent=before.backup if before else None,
            incumbents=dict(before.model_backups) if before else {},
        )  # fmt: skip
        models = [m for m, _ in verdicts[region].serving_models]
        choice, backups, reasons = chooser.backups(models)
        after = replace(
            verdicts[region],
            backup=choice.backup,
            backup_reason=choice.reason,
            model_backups=backups,
        )
        verdicts[region] = after
        _backup_events(previous.verdicts.get(region), after, choice, now=now, events=events)
        _model_events(previous.verdicts.get(region), after, reasons, now=now, events=events)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Chooser:
    """``choose_backup`` for one region, by the models at stake."""

    region: RegionId
    topology: Topology
    states: Mapping[RegionId, RegionState]
    fresh: Mapping[RegionId, StatusSnapshot | None]
    config: FailoverConfig
    prefer: RegionId | None
    served: Mapping[RegionId, frozenset[str] | None]  # None: publishes no models, serves any
    incumbent: RegionId | None = None  # the region's backup before this window
    incumbents: Mapping[str, RegionId | None] = field(default_factory=dict)  # per model

    def serves(self, candidate: RegionId, models: Iterable[str], *, every: bool) -> bool:
        offered = self.served[candidate]
        if offered is None:
            return True
        wanted = set(models)
        return wanted <= offered if every else bool(wanted & offered)

    def choose(self, models: Sequence[str], *, every: bool) -> BackupChoice:
        what = ", ".join(models)
        if len(models) > 1:
            what = f"{'all' if every else 'any'} of {what}"
        incumbent = self.incumbents.get(models[0]) if len(models) == 1 else self.incumbent
        return choose_backup(
            self.region, topology=self.topology, states=self.states, statuses=self.fresh,
            config=self.config, prefer=self.prefer,
            serves=lambda c: self.serves(c, models, every=every), serving=what,
            incumbent=incumbent,
        )  # fmt: skip

    def backups(
        self, models: Sequence[str]
    ) -> tuple[BackupChoice, tuple[tuple[str, RegionId | None], ...], dict[str, str]]:
        """The region's backup (residency first, then model coverage: one that serves all its
        models, else one that serves any), then each model's: the region's backup when it
        serves the model, else the best compliant region that does, else none."""
        if not models:  # it publishes no models: any compliant region will do
            return self.choose_any(), (), {}
        choice = self.choose(models, every=True)
        if choice.backup is None and len(models) > 1:
            partial = self.choose(models, every=False)
            if partial.backup is not None:
                choice = partial
        backups: list[tuple[str, RegionId | None]] = []
        reasons: dict[str, str] = {}
        for model in models:
            if choice.backup is not None and self.serves(choice.backup, [model], every=True):
                backups.append((model, choice.backup))
                reasons[model] = f"the region's backup {choice.backup} serves it"
                continue
            own = self.choose([model], every=True)
            backups.append((model, own.backup))
            reasons[model] = own.reason
        return choice, tuple(backups), reasons

    def choose_any(self) -> BackupChoice:
        return choose_backup(
            self.region, topology=self.topology, states=self.states, statuses=self.fresh,
            config=self.config, prefer=self.prefer, incumbent=self.incumbent,
        )  # fmt: skip


def _models_of(
    region: RegionId,
    verdicts: Mapping[RegionId, Verdict],
    fresh: Mapping[RegionId, StatusSnapshot | None],
) -> frozenset[str] | None:
    """The models ``region`` serves now (with capacity): from its fresh status, else from its
    last good window; ``None`` when it never published models (an older agent: it is assumed
    to serve any)."""
    status = fresh.get(region)
    if status is not None and status.models is not None:
        return frozenset(m for m, c in status.models.items() if c > 0)
    remembered = verdicts[region].serving_models
    if remembered or verdicts[region].ignored_models:
        return frozenset(m for m, _ in remembered)
    return None


def _model_events(
    before: Verdict | None,
    after: Verdict,
    reasons: Mapping[str, str],
    *,
    now: float,
    events: list[Event],
) -> None:
    """A ``model`` event for each of the region's models whose backup changed; one that has
    none says so (its traffic cannot fail over anywhere residency allows)."""
    old = dict(before.model_backups) if before is not None else {}
    for model, backup in after.model_backups:
        if model in old and old[model] == backup:
            continue
        if backup is None:
            reason = f"model {model} has no compliant backup: {reasons[model]}"
        else:
            reason = f"model {model}: backup {backup} ({reasons[model]})"
        events.append(
            Event(
                kind="model",
                region=after.region,
                reason=reason,
                at=now,
                data={"model": model, "backup": backup},
            )
        )


def _assign_floors(
    verdicts: dict[RegionId, Verdict],
    *,
    config: FailoverConfig,
    previous: FleetState,
    now: float,
    events: list[Event],
) -> None:
    protected: dict[RegionId, list[RegionId]] = {}
    per_model: dict[RegionId, dict[str, float]] = {}
    for region, verdict in verdicts.items():
        if verdict.backup is not None:
            protected.setdefault(verdict.backup, []).append(region)
        capacities = dict(verdict.serving_models)
        for model, backup in verdict.model_backups:
            if backup is not None:
                floors = per_model.setdefault(backup, {})
                floors[model] = floors.get(model, 0.0) + capacities.get(model, 0.0)
    for region in sorted(verdicts):
        protects = tuple(sorted(protected.get(region, ())))
        floor = config.prewarm_fraction * sum(verdicts[p].serving_capacity for p in protects)
        model_floors = tuple(
            (m, round(config.prewarm_fraction * c, 6))
            for m, c in sorted(per_model.get(region, {}).items())
        )
        verdicts[region] = replace(
            verdicts[region], capacity_floor=floor, protects=protects, model_floors=model_floors
        )
        before = previous.verdicts.get(region)
        old_floor = 0.0 if before is None else before.capacity_floor
        old_protects = () if before is None else before.protects
        old_models = () if before is None else before.model_floors
        if abs(floor - old_floor) <= _EPS and protects == old_protects:
            if model_floors != old_models:
                events.append(
                    Event(
                        kind="floor",
                        region=region,
                        reason=f"model floors: {_model_floors(model_floors)}",
                        at=now,
                        data={"models": _model_floors(model_floors)},
                    )
                )
            continue
        covers = ", ".join(f"{p} {verdicts[p].serving_capacity:g}" for p in protects)
        if model_floors:
            covers += f"; per model {_model_floors(model_floors)}"
        events.append(
            Event(
                kind="floor",
                region=region,
                reason=(
                    f"capacity floor {old_floor:g} -> {floor:g}: {config.prewarm_fraction:g} x "
                    f"the capacity it protects ({covers or 'nothing'})"
                ),
                at=now,
                data={"from": old_floor, "to": floor, "protects": protects},
            )
        )


def _model_floors(floors: Iterable[tuple[str, float]]) -> str:
    return ", ".join(f"{m} {f:g}" for m, f in floors) or "none"


def _judge_region(
    before: Verdict,
    observation: Observation,
    *,
    config: FailoverConfig,
    now: float,
    judge: bool,
    events: list[Event],
) -> Verdict:
    region = before.region
    window = judge_window(observation, config=config) if judge else None
    strikes, good = before.strikes, before.good_windows
    if window is not None and window.ok:
        strikes, good = 0, good + 1
    elif window is not None:
        strikes, good = min(strikes + 1, config.strikes), 0
        if strikes > before.strikes:
            events.append(
                Event(
                    kind="strike",
                    region=region,
                    reason=f"failed window {strikes}/{config.strikes}: {window.reason}",
                    at=now,
                    data={"strikes": strikes},
                )
            )
    state, weight, reason = _transition(
        before, window, observation, strikes=strikes, good=good, config=config, now=now
    )
    capacity, models = before.serving_capacity, before.serving_models
    ignored = before.ignored_models
    status = observation.status
    if window is not None and window.ok and state == "healthy" and status is not None:
        capacity = status.capacity
        if status.models is not None:
            models = tuple(sorted((m, c) for m, c in status.models.items() if c > 0))
    if status is not None and status.models is not None:
        ignored = tuple(sorted(m for m, c in status.models.items() if c <= 0))
        for model in sorted(set(ignored) - set(before.ignored_models)):
            events.append(
                Event(
                    kind="model",
                    region=region,
                    reason=f"its status claims model {model} with no capacity (no healthy node "
                    f"serves it): not counted as serving {model}",
                    at=now,
                    data={"model": model, "ignored": True},
                )
            )
    spilling = before.spilling
    if status is not None and (status.spilled_per_s > 0) != before.spilling:
        spilling = status.spilled_per_s > 0
        events.append(
            Event(
                kind="spill",
                region=region,
                reason=(
                    f"spilling {status.spilled_per_s:g} requests/s to other regions: its queue "
                    "is over spill.queue_depth, full, or lacks the model"
                    if spilling
                    else "stopped spilling to other regions"
                ),
                at=now,
                data={"spilling": spilling, "per_s": status.spilled_per_s},
            )
        )
    after = replace(
        before,
        state=state,
        since=before.since if state == before.state else now,
        reason=reason,
        weight=weight,
        strikes=strikes,
        good_windows=good,
        manual=observation.manual_failover,
        serving_capacity=capacity,
        serving_models=models,
        ignored_models=ignored,
        spilling=spilling,
    )
    if state != before.state:
        events.append(
            Event(
                kind="state",
                region=region,
                reason=f"{before.state} -> {state}: {reason}",
                at=now,
                data={"from": before.state, "to": state, "weight": weight},
            )
        )
    if weight > before.weight + _EPS:
        events.append(
            Event(
                kind="recovery",
                region=region,
                reason=f"weight {before.weight:g} -> {weight:g}: {reason}",
                at=now,
                data={"from": before.weight, "to": weight},
            )
        )
    return after


def _transition(
    before: Verdict,
    window: WindowResult | None,
    observation: Observation,
    *,
    strikes: int,
    good: int,
    config: FailoverConfig,
    now: float,
) -> tuple[RegionState, float, str]:
    """(state, weight, reason) after this call; ``window`` is None when none is judged."""
    ramp = config.ramp
    if observation.admin != "active":
        held = "; manual failover too" if observation.manual_failover else ""
        return "drained", 0.0, f"operator set {observation.admin}{held}"
    if observation.manual_failover:
        return "failed", 0.0, "manual failover: held until a manual failback"
    if before.state == "drained":
        if good >= config.recovery_windows:  # a drain is no failure: no hold to serve
            return _ramp_start(ramp, f"drain lifted after {good} good windows")
        return (
            "failed",
            0.0,
            (
                f"drain lifted with {good}/{config.recovery_windows} good windows: out until it "
                "recovers"
            ),
        )
    if before.state == "failed":  # a manual hold's time counts towards min_hold_s
        state, weight, reason = _from_failed(before, window, good=good, config=config, now=now)
        return state, weight, f"manual failback; {reason}" if before.manual else reason
    if window is None:
        return before.state, before.weight, before.reason
    if not window.ok:
        if strikes >= config.strikes:
            return "failed", 0.0, f"{strikes} consecutive failed windows: {window.reason}"
        paused = f"; ramp paused at weight {before.weight:g}" if before.weight < 1 - _EPS else ""
        return (
            "suspect",
            before.weight,
            (f"{strikes}/{config.strikes} failed windows: {window.reason}{paused}"),
        )
    if before.weight >= 1 - _EPS:
        return "healthy", 1.0, f"good window: {window.reason}"
    step = next((s for s in ramp if s > before.weight + _EPS), 1.0)
    if step >= 1 - _EPS:
        return "healthy", 1.0, "ramp complete: weight 1"
    return "recovering", step, f"good window: ramp to weight {step:g}"


def _from_failed(
    before: Verdict,
    window: WindowResult | None,
    *,
    good: int,
    config: FailoverConfig,
    now: float,
) -> tuple[RegionState, float, str]:
    held_s = now - before.since
    if good >= config.recovery_windows:
        if held_s >= config.min_hold_s:
            return _ramp_start(config.ramp, f"{good} good windows after {held_s:.0f} s failed")
        left_s = config.min_hold_s - held_s
        return (
            "failed",
            0.0,
            (
                f"{good} good windows; held in failed {left_s:.0f} s more (min_hold_s "
                f"{config.min_hold_s:g})"
            ),
        )
    if window is None:
        if before.manual:
            return "failed", 0.0, f"{good}/{config.recovery_windows} good windows towards recovery"
        return "failed", 0.0, before.reason
    if window.ok:
        return "failed", 0.0, f"{good}/{config.recovery_windows} good windows towards recovery"
    return "failed", 0.0, f"still failing: {window.reason}"


def _ramp_start(ramp: tuple[float, ...], why: str) -> tuple[RegionState, float, str]:
    if ramp[0] >= 1 - _EPS:
        return "healthy", 1.0, f"{why}: back at full weight"
    return "recovering", ramp[0], f"{why}: ramp starts at weight {ramp[0]:g}"


def _backup_events(
    before: Verdict | None,
    after: Verdict,
    choice: BackupChoice,
    *,
    now: float,
    events: list[Event],
) -> None:
    region = after.region
    target = "no backup" if after.backup is None else f"backup {after.backup}"
    went_down = after.weight <= 0 and (before is None or before.weight > 0)
    moved = before is not None and after.weight < 1 and before.backup != after.backup
    if went_down or moved:
        if after.backup is None:
            what = f"{region} serves nothing and has no backup ({choice.reason})"
        elif went_down:
            what = f"{region}'s traffic moves to {target} ({choice.reason})"
        else:
            what = (
                f"{region}'s traffic moves from {before.backup if before else None} to "
                f"{target} ({choice.reason})"
            )
        events.append(
            Event(
                kind="failover",
                region=region,
                reason=f"{after.state}: {what}",
                at=now,
                data={"backup": after.backup, "weight": after.weight},
            )
        )
    if choice.residency_limited and (before is None or before.backup_reason != choice.reason):
        events.append(
            Event(
                kind="residency",
                region=region,
                reason=f"{target}: {choice.reason}",
                at=now,
                data={"backup": after.backup},
            )
        )


def base_shares(
    members: Iterable[RegionId], verdicts: Mapping[RegionId, Verdict], *, rule: ShareRule
) -> dict[RegionId, float]:
    """Each member region's base share of its geography, before its weight and failover: 1
    each (``equal``), or its ``serving_capacity`` (``capacity``), where a member whose capacity
    is not known yet (0: never judged healthy with nodes) counts as the mean of those that are
    known, and a geography with none known is equal."""
    regions = list(members)
    if rule == "equal":
        return dict.fromkeys(regions, 1.0)
    known = [verdicts[r].serving_capacity for r in regions if verdicts[r].serving_capacity > 0]
    if not known:
        return dict.fromkeys(regions, 1.0)
    mean = sum(known) / len(known)
    return {
        r: verdicts[r].serving_capacity if verdicts[r].serving_capacity > 0 else mean
        for r in regions
    }


def _steer(
    verdicts: Mapping[RegionId, Verdict],
    *,
    topology: Topology,
    previous: FleetState,
    rule: ShareRule,
) -> tuple[dict[str, dict[RegionId, float]], list[tuple[str, str]]]:
    """Per geography, region -> share; and the geographies left dark, with why."""
    serving: dict[str, dict[RegionId, float]] = {}
    dark: list[tuple[str, str]] = []
    for geo in sorted({info.geo for info in topology.regions.values()}):
        members = sorted(r for r, info in topology.regions.items() if info.geo == geo)
        base = base_shares(members, verdicts, rule=rule)
        shares: dict[RegionId, float] = {}
        for region in members:
            verdict = verdicts[region]
            if verdict.weight > 0:
                shares[region] = shares.get(region, 0.0) + base[region] * verdict.weight
            if verdict.weight < 1 and verdict.backup is not None:
                moved = base[region] * (1.0 - verdict.weight)
                shares[verdict.backup] = shares.get(verdict.backup, 0.0) + moved
        if sum(shares.values()) <= _EPS:
            shares = {
                r: s for r, s in previous.serving.get(geo, {}).items() if r in topology.regions
            }
            why = ", ".join(
                f"{r} {verdicts[r].state}"
                + ("" if verdicts[r].backup is not None else " without a backup")
                for r in members
            )
            dark.append((geo, why))
        total = sum(shares.values())
        serving[geo] = {r: shares[r] / total for r in sorted(shares)} if total > 0 else {}
    return serving, dark


def _alert(
    verdicts: Mapping[RegionId, Verdict],
    dark: list[tuple[str, str]],
    serving: Mapping[str, Mapping[RegionId, float]],
) -> str | None:
    if not dark:
        return None
    parts = []
    for geo, why in dark:
        kept = ", ".join(serving[geo]) or "nothing: there is no earlier answer"
        parts.append(f"geography {geo} has no region to serve it ({why}); keeping {kept}")
    prefix = "never all off: "
    if verdicts and all(v.weight <= 0 for v in verdicts.values()):
        prefix += "every region is failed or drained; "
    return prefix + "; ".join(parts)
