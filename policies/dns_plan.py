"""DNS steering: the record sets each geography's view should serve.  Pure: no I/O, no clocks.

The controller calls :func:`plan` after every health window with the fleet plan's ``serving``
shares, each region's state and client-facing endpoints, and each geography's ordered
preference list (its own regions, then their backups)::

    dns = dns_plan.plan(views, fleet=fleet, names=names, ttl_s=30, window=w, previous=gen)
    for view in dns.views.values():
        changes = dns_plan.diff(view.records, what_the_server_serves, names=names,
                                zone=view.zone, targets=view.targets)

Per view (one per geography), under its zone, with ``names`` relative to the zone:

``<service>`` A / AAAA
    the addresses (IP-literal endpoints) of every region that serves the geography now
    (share > 0).  A plain RRset is a set: resolvers rotate it, so every address gets an equal
    share; it cannot say 5 % / 95 %.
``<srv>`` SRV
    the regions that serve it at priority :data:`PRIORITY_SERVING` (10), weight = their share
    in percent (at least 1) split among the region's SRV records (one per port for its IP
    endpoints, one per host name and port for the others), so a region's records sum to its
    share however many endpoints it has (:func:`split_weight`); then, one priority step (10)
    apart in preference order, the regions that could take over (not failed, not drained)
    with weight 0: a standby.  A client that honours SRV (RFC 2782) splits by weight within
    the lowest priority it can reach and falls back through the priorities by itself.
``<region>.<service>`` A / AAAA
    each SRV target's addresses; a region whose endpoints are host names is targeted by name
    and gets no address records of ours.  These target names (``ViewPlan.targets``: one per
    region the controller knows, less any name a region's endpoint uses as its host name) are
    the only names below the service whose addresses the controller writes or deletes; a
    host-name endpoint, even one inside that space (``eu-west.api.<zone>``), is the
    operator's: referenced by SRV only, never touched.
``<txt>`` TXT
    ``"generation=<n>" "geo=<g>"``: the plan generation a resolver is seeing.

The **generation** changes only when the records change: it is the controller window that
first produced the current content (``previous`` carries the last generation and its
fingerprint), so a steady fleet produces identical plans and no DNS update at all.  It starts
at 1 and only grows (one more than the previous when the window counter is behind it).

A view is **held** (``hold=True``, no records; the shell must not touch the zone) when its
geography has no region with an endpoint to serve it: never all off — whatever the server
answers now stays, and the ``reason`` says why.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit

RecordType = Literal["A", "AAAA", "SRV", "TXT"]
MANAGED_TYPES: Final[frozenset[str]] = frozenset({"A", "AAAA", "SRV", "TXT"})
PRIORITY_SERVING: Final = 10
PRIORITY_STEP: Final = 10
DEFAULT_TTL_S: Final = 30
_DEFAULT_PORTS: Final = {"https": 443, "http": 80, "grpc": 443, "grpcs": 443}
_ADDRESS_TYPES: Final[tuple[RecordType, RecordType]] = ("A", "AAAA")
_DOWN: Final[frozenset[str]] = frozenset({"failed", "drained"})


# -- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Names:
    """Record names relative to each view's zone (no trailing dot)."""

    service: str = "api"
    srv: str = "_https._tcp.api"
    txt: str = "_meridian.api"


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewSpec:
    """One view of the authoritative server: its name, its zone and the geography it serves."""

    view: str
    zone: str  # absolute, e.g. "meridian.example."
    geo: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetDns:
    """What the controller knows of the fleet, as far as DNS is concerned."""

    serving: Mapping[str, Mapping[str, float]]  # geography -> region -> share (sum 1)
    states: Mapping[str, str] = field(default_factory=dict)  # region -> healthy, failed, ...
    endpoints: Mapping[str, Sequence[str]] = field(default_factory=dict)  # region -> URLs
    preferences: Mapping[str, Sequence[str]] = field(default_factory=dict)  # geo -> regions


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """The last plan's generation and the fingerprint of its records."""

    number: int
    fingerprint: str


# -- outputs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class RecordSet:
    """One RRset: an absolute lowercase name, a type, a TTL and rdata in presentation form."""

    name: str
    rdtype: RecordType
    ttl_s: int
    values: tuple[str, ...]  # sorted, deduplicated

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.rdtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewPlan:
    view: str
    zone: str
    geo: str
    records: tuple[RecordSet, ...]  # sorted by (name, type)
    hold: bool = False  # leave the zone as it is (no answer to give)
    reason: str = ""
    # the region target names whose A/AAAA are the controller's (see ``managed``)
    targets: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class DnsPlan:
    generation: int
    fingerprint: str  # of every view's records but the generation TXT
    views: Mapping[str, ViewPlan]
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One step of an RFC 2136 update: replace an RRset, or delete it (``rrset.values`` empty)."""

    op: Literal["replace", "delete"]
    rrset: RecordSet

    def describe(self) -> str:
        if self.op == "delete":
            return f"delete {self.rrset.name} {self.rrset.rdtype}"
        values = " | ".join(self.rrset.values)
        return f"replace {self.rrset.name} {self.rrset.ttl_s} {self.rrset.rdtype} {values}"


# -- endpoints ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    host: str  # an IP literal, or a lowercase absolute host name (trailing dot)
    port: int
    ip: bool


def parse_endpoint(url: str) -> Endpoint | None:
    """``https://192.0.2.10:8443`` → 192.0.2.10 port 8443; ``[2001:db8::1]``, host names and
    bare ``host:port`` too.  ``None`` when there is no host or the port is not a number."""
    text = url.strip()
    parts = urlsplit(text if "://" in text else f"//{text}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    port = port or _DEFAULT_PORTS.get(parts.scheme.lower(), 443)
    try:
        return Endpoint(host=ipaddress.ip_address(host).compressed, port=port, ip=True)
    except ValueError:
        return Endpoint(host=host.lower().rstrip(".") + ".", port=port, ip=False)


# -- the plan ----------------------------------------------------------------------------------


def absolute(name: str, zone: str) -> str:
    """``api`` in ``meridian.test.`` → ``api.meridian.test.``; ``@`` or empty is the apex."""
    zone = zone.lower().rstrip(".") + "."
    name = name.lower().strip()
    if name in ("", "@"):
        return zone
    return name if name.endswith(".") else f"{name}.{zone}"


def plan(
    views: Iterable[ViewSpec],
    *,
    fleet: FleetDns,
    names: Names,
    ttl_s: int = DEFAULT_TTL_S,
    window: int,
    previous: Generation | None = None,
) -> DnsPlan:
    """The desired records of every view; see the module docstring."""
    if ttl_s < 0:
        raise ValueError(f"ttl_s must be >= 0, not {ttl_s}")
    drafts = {spec.view: _view(spec, fleet=fleet, names=names, ttl_s=ttl_s) for spec in views}
    fingerprint = _fingerprint(drafts.values())
    if previous is not None and previous.fingerprint == fingerprint:
        generation = previous.number
        reason = f"unchanged since generation {generation}"
    else:
        generation = max(1, window if previous is None else max(window, previous.number + 1))
        reason = "first plan" if previous is None else "records changed"
    out: dict[str, ViewPlan] = {}
    for name, draft in drafts.items():
        if draft.hold:
            out[name] = draft
            continue
        txt = RecordSet(
            name=absolute(names.txt, draft.zone),
            rdtype="TXT",
            ttl_s=ttl_s,
            values=(f'"generation={generation}" "geo={draft.geo}"',),
        )
        records = tuple(sorted((*draft.records, txt), key=lambda r: r.key))
        out[name] = ViewPlan(
            view=draft.view,
            zone=draft.zone,
            geo=draft.geo,
            records=records,
            reason=draft.reason,
            targets=draft.targets,
        )
    return DnsPlan(generation=generation, fingerprint=fingerprint, views=out, reason=reason)


def _view(spec: ViewSpec, *, fleet: FleetDns, names: Names, ttl_s: int) -> ViewPlan:
    zone = spec.zone.lower().rstrip(".") + "."
    service = absolute(names.service, zone)
    shares = {r: s for r, s in fleet.serving.get(spec.geo, {}).items() if s > 0}
    endpoints = {
        region: [e for e in (parse_endpoint(u) for u in urls) if e is not None]
        for region, urls in fleet.endpoints.items()
    }
    targets = region_targets(fleet, names=names, zone=zone)
    serving = sorted(r for r in shares if endpoints.get(r))
    if not serving:
        missing = sorted(shares)
        why = (
            f"no region serves geography {spec.geo!r}"
            if not missing
            else f"no endpoint known for {', '.join(missing)} serving {spec.geo!r}"
        )
        return ViewPlan(
            view=spec.view,
            zone=zone,
            geo=spec.geo,
            records=(),
            hold=True,
            reason=f"{why}: keeping what the server answers",
            targets=targets,
        )
    standby: list[str] = []
    for region in fleet.preferences.get(spec.geo, ()):
        if region in shares or region in standby or not endpoints.get(region):
            continue
        if fleet.states.get(region, "healthy") in _DOWN:
            continue
        standby.append(region)
    total = sum(shares[r] for r in serving)
    addresses: dict[str, set[str]] = {"A": set(), "AAAA": set()}
    srv: set[str] = set()
    records: list[RecordSet] = []
    tiers = [(r, PRIORITY_SERVING, region_weight(shares[r] / total)) for r in serving]
    tiers += [(r, PRIORITY_SERVING + PRIORITY_STEP * (i + 1), 0) for i, r in enumerate(standby)]
    for region, priority, weight in tiers:
        host = absolute(f"{region}.{names.service}", zone)
        own: dict[str, set[str]] = {"A": set(), "AAAA": set()}
        targets_of_region: set[tuple[int, str]] = set()
        for endpoint in endpoints[region]:
            if endpoint.ip:
                rdtype = "AAAA" if ":" in endpoint.host else "A"
                own[rdtype].add(endpoint.host)
                targets_of_region.add((endpoint.port, host))
                if priority == PRIORITY_SERVING:
                    addresses[rdtype].add(endpoint.host)
            else:
                targets_of_region.add((endpoint.port, endpoint.host))
        ordered = sorted(targets_of_region, key=lambda t: (t[1], t[0]))
        for (port, target), part in zip(ordered, split_weight(weight, len(ordered)), strict=True):
            srv.add(f"{priority} {part} {port} {target}")
        for family in _ADDRESS_TYPES:
            if own[family] and host in targets:  # never over an operator's host name
                records.append(_rrset(host, family, ttl_s, own[family]))
    for family in _ADDRESS_TYPES:
        if addresses[family]:
            records.append(_rrset(service, family, ttl_s, addresses[family]))
    records.append(_rrset(absolute(names.srv, zone), "SRV", ttl_s, srv))
    reason = "serving " + ", ".join(f"{r} {100 * shares[r] / total:.0f}%" for r in serving)
    if standby:
        reason += "; standby " + ", ".join(standby)
    return ViewPlan(
        view=spec.view,
        zone=zone,
        geo=spec.geo,
        records=tuple(sorted(records, key=lambda r: r.key)),
        reason=reason,
        targets=targets,
    )


def region_weight(share: float) -> int:
    """A serving region's SRV weight for its ``share`` (0..1] of the geography: percent,
    at least 1 (weight 0 would make it a last resort among the serving)."""
    return max(1, round(100 * share))


def split_weight(weight: int, parts: int) -> list[int]:
    """``weight`` split among a region's ``parts`` SRV records, as equal as integers allow,
    the larger parts first, summing to ``weight`` (a client picks a record by its weight
    over the sum, so a region's share must not repeat per endpoint); each serving record
    gets at least 1, so with more records than weight the sum is ``parts``.  A standby's 0
    stays 0."""
    if parts <= 0:
        return []
    if weight <= 0:
        return [0] * parts
    if weight < parts:
        return [1] * parts
    base, extra = divmod(weight, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def region_targets(fleet: FleetDns, *, names: Names, zone: str) -> frozenset[str]:
    """The names ``<region>.<service>`` of every region the controller knows, less those that
    some region's endpoint uses as its host name: the names whose A/AAAA are ours."""
    known: set[str] = set(fleet.endpoints) | set(fleet.states)
    known.update(r for shares in fleet.serving.values() for r in shares)
    known.update(r for ranked in fleet.preferences.values() for r in ranked)
    foreign = {
        e.host
        for urls in fleet.endpoints.values()
        for e in (parse_endpoint(u) for u in urls)
        if e is not None and not e.ip
    }
    service = names.service
    return frozenset(absolute(f"{r}.{service}", zone) for r in known) - foreign


def _rrset(name: str, rdtype: RecordType, ttl_s: int, values: Iterable[str]) -> RecordSet:
    return RecordSet(name=name, rdtype=rdtype, ttl_s=ttl_s, values=tuple(sorted(set(values))))


def _fingerprint(views: Iterable[ViewPlan]) -> str:
    digest = hashlib.sha256()
    for view in sorted(views, key=lambda v: v.view):
        digest.update(f"view {view.view} {view.zone} {view.geo} hold={view.hold}\n".encode())
        for r in view.records:
            digest.update(f"{r.name} {r.ttl_s} {r.rdtype} {'|'.join(r.values)}\n".encode())
    return digest.hexdigest()[:16]


# -- what to send ------------------------------------------------------------------------------


def managed(name: str, rdtype: str, *, names: Names, zone: str, targets: Collection[str]) -> bool:
    """Whether (name, type) is the controller's to write: the service's A/AAAA and those of
    ``targets`` (the region target names it writes, ``ViewPlan.targets``), the SRV name's SRV,
    the TXT name's TXT.  Any other name, even one below the service, is not."""
    name = name.lower()
    service = absolute(names.service, zone)
    if rdtype in ("A", "AAAA"):
        return name == service or name in targets
    if rdtype == "SRV":
        return name == absolute(names.srv, zone)
    if rdtype == "TXT":
        return name == absolute(names.txt, zone)
    return False


def diff(
    desired: Iterable[RecordSet],
    current: Iterable[RecordSet],
    *,
    names: Names,
    zone: str,
    targets: Collection[str],
) -> tuple[Change, ...]:
    """The changes that make ``current`` (what the server serves) into ``desired``: a replace
    for every RRset that is missing or differs (values or TTL), a delete for every managed
    RRset that is no longer wanted.  Empty when they already agree; other records are never
    touched."""
    want = {r.key: r for r in desired}
    have = {
        r.key: r
        for r in current
        if managed(r.name, r.rdtype, names=names, zone=zone, targets=targets)
    }
    changes = [
        Change(op="replace", rrset=r)
        for key, r in sorted(want.items())
        if key not in have or (have[key].ttl_s, set(have[key].values)) != (r.ttl_s, set(r.values))
    ]
    changes += [
        Change(op="delete", rrset=RecordSet(name=r.name, rdtype=r.rdtype, ttl_s=0, values=()))
        for key, r in sorted(have.items())
        if key not in want
    ]
    return tuple(changes)
