"""Node discovery from DNS: every ``[[discovery.dns]]`` name is resolved every ``interval_s``
and the pool follows its records (docs/agent.md, "Node discovery").

* **A / AAAA**: every address is a node ``scheme://address:port``.  **SRV**: every record's
  target and port is a node, at the target's addresses taken from the answer's additional
  section, else asked for (A; AAAA only when the target has no A).  A target of ``.`` (RFC 2782:
  no service) is none.  SRV priorities and weights are not used: every target is a node with
  the entry's ``weight``.  Node ids are ``address:port``, as a static node's default id, so they
  stay the same from one answer to the next and an address given both ways is one node.
* **Reconciling** (``policies.discovery.plan``): a new endpoint goes in through
  ``Roster.add`` with slow start (the source's first answer is the fleet as it was serving and
  goes in warm, as static nodes do at start); one that left the answer is drained as
  ``POST /admin/nodes/{id}/drain`` drains (no new requests, in-flight ones finish, cut after
  ``health.drain_timeout_s``) and removed once nothing is in flight; one that comes back while
  draining is undrained.  Static nodes, admin-added ones and other sources' nodes are never
  touched; nodes show their source (``dns:<name>``) in ``GET /admin/nodes``.
* **Fail static**: a failed resolution (timeout, SERVFAIL, REFUSED, no resolver) changes
  nothing.  An empty answer (NXDOMAIN, or the name has no such records) changes nothing either
  unless ``empty_after`` of them came in a row (0, the default: never).  Either is counted in
  ``meridian_agent_discovery_failures_total{source, cause}`` and logged as a WARNING at most
  once a minute per name, with the count since the last line; the first answer after failures
  is logged at INFO.

Only this module (besides the controller's RFC 2136 client) imports dnspython.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rdataclass
import dns.rdatatype
import dns.resolver

from meridian_service.clock import Clock
from policies import discovery as policy
from policies.model import AdminState, NodeId
from regional_agent.nodes import NodePool
from regional_agent.observability import Instruments
from regional_agent.roster import Roster
from regional_agent.settings import DnsDiscoverySettings, NodeSettings

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 60.0  # the most often one name's failures are logged at WARNING
_EMPTY = ("nxdomain", "nodata")


class Failed(Exception):
    """A resolution that gave no usable answer; ``cause`` is the metric's label."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail

    @property
    def empty(self) -> bool:
        """An authoritative "no such records" rather than a failure to get an answer."""
        return self.cause in _EMPTY


@dataclass(slots=True)
class _State:
    """What one source remembers between rounds."""

    settings: DnsDiscoverySettings
    resolver: dns.asyncresolver.Resolver | None = None
    last_good: dict[NodeId, str] | None = None  # None: no answer applied yet
    empty_in_a_row: int = 0
    skipped: tuple[NodeId, ...] = ()  # in the answer, held by another source (logged on change)
    resolutions: int = 0  # rounds done, whatever their outcome
    failing_since_log: int = 0  # failures not yet in a log line
    failing: int = 0  # failures since the last answer applied
    warned_at: float | None = None

    @property
    def label(self) -> str:
        return self.settings.source


class Discovery:
    """The DNS sources of one agent; ``run(name)`` is one source's loop (app.py supervises
    one task per name)."""

    def __init__(
        self,
        sources: Sequence[DnsDiscoverySettings],
        *,
        pool: NodePool,
        roster: Roster,
        instruments: Instruments,
        clock: Clock,
    ) -> None:
        self._pool = pool
        self._roster = roster
        self._instruments = instruments
        self._clock = clock
        self._states = {s.name: _State(settings=s) for s in sources}
        self._drained: set[NodeId] = set()  # nodes discovery drained (never an admin's drain)

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def resolutions(self, name: str) -> int:
        """Rounds the source ``name`` has done (each a resolution and its reconciling)."""
        return self._states[name].resolutions

    async def run(self, name: str) -> None:
        state = self._states[name]
        interval_s = state.settings.interval_s
        while True:
            began = self._clock.now()
            await self.resolve_once(name)
            await asyncio.sleep(max(0.0, interval_s - (self._clock.now() - began)))

    async def resolve_once(self, name: str) -> None:
        """One round: resolve the name, then reconcile the pool with the answer (or, when
        there is none to apply, with the last good one: draining nodes still leave)."""
        state = self._states[name]
        try:
            await self._round(state)
        finally:
            state.resolutions += 1

    async def _round(self, state: _State) -> None:
        try:
            answer = await self._resolve(state)
        except Failed as exc:
            applied = False
            if exc.empty:
                state.empty_in_a_row += 1
                applied = policy.apply_empty(
                    state.empty_in_a_row, empty_after=state.settings.empty_after
                )
            self._failed(state, exc, applied=applied)
            await self._apply(state, {} if applied else None)
            return
        state.empty_in_a_row = 0
        if state.failing:
            log.info(
                "dns discovery answering again source=%s failures=%d", state.label, state.failing
            )
        state.failing = state.failing_since_log = 0
        state.warned_at = None
        await self._apply(state, answer)

    # -- resolving -------------------------------------------------------------------------------

    def _resolver(self, state: _State) -> dns.asyncresolver.Resolver:
        if state.resolver is None:
            servers = state.settings.servers()
            try:
                resolver = dns.asyncresolver.Resolver(configure=not servers)
            except dns.exception.DNSException as exc:  # no /etc/resolv.conf, or no nameserver
                raise Failed("error", f"no resolver: {exc}") from exc
            if servers:
                resolver.nameservers = [dns.nameserver.Do53Nameserver(a, p) for a, p in servers]
            resolver.timeout = resolver.lifetime = state.settings.timeout_s
            resolver.cache = None  # every round asks the server: interval_s sets the pace
            state.resolver = resolver
        return state.resolver

    async def _resolve(self, state: _State) -> dict[NodeId, str]:
        s = state.settings
        resolver = self._resolver(state)
        limit_s = s.timeout_s * 3 + 1.0
        try:
            # a bound on the round, whatever the resolver does: SRV, then A, then AAAA
            async with asyncio.timeout(limit_s):
                if s.record == "SRV":
                    found = await _srv(resolver, s.name)
                else:
                    assert s.port is not None  # the settings require it
                    found = [(a, s.port) for a in await _addresses(resolver, s.name, s.record)]
        except TimeoutError as exc:
            raise Failed("timeout", f"{s.name}: no answer within {limit_s:g} s") from exc
        answer = dict(policy.endpoint(s.scheme, address, port) for address, port in found)
        if not answer:
            raise Failed("nodata", f"{s.name}: SRV targets without addresses")
        return answer

    # -- reconciling -----------------------------------------------------------------------------

    async def _apply(self, state: _State, answer: dict[NodeId, str] | None) -> None:
        first = state.last_good is None  # the source's first answer: the fleet as it serves
        if answer is not None:
            state.last_good = answer
        wanted = state.last_good or {}
        label = state.label
        self._drained &= {n.node_id for n in self._pool}
        held = [
            policy.Held(
                node_id=n.node_id,
                draining=n.admin is AdminState.DRAINING,
                drained_by_discovery=n.node_id in self._drained,
                in_flight=n.in_flight,
            )
            for n in self._pool
            if n.source == label
        ]
        taken = {n.node_id for n in self._pool if n.source != label}
        elsewhere = {
            node_id
            for other in self._states.values()
            if other is not state
            for node_id in other.last_good or {}
        }
        plan = policy.plan(wanted, held, taken=taken, elsewhere=elsewhere)
        if plan.skipped != state.skipped:
            state.skipped = plan.skipped
            if plan.skipped:
                log.info(
                    "dns discovery: nodes held by another source left alone source=%s nodes=%s",
                    label, ",".join(plan.skipped),
                )  # fmt: skip
        now = self._clock.now()
        for node_id in plan.drain:
            node = self._pool.get(node_id)
            if node is not None:
                node.admin = AdminState.DRAINING
                node.drain_started_s = now
                self._drained.add(node_id)
                log.info(
                    "node draining node=%s source=%s reason=left-dns in_flight=%d",
                    node_id, label, node.in_flight,
                )  # fmt: skip
        for node_id in plan.undrain:
            node = self._pool.get(node_id)
            if node is not None:
                node.admin = AdminState.ACTIVE
                node.drain_started_s = None
                self._drained.discard(node_id)
                log.info("node active again node=%s source=%s reason=back-in-dns", node_id, label)
        for node_id in plan.handover:
            node = self._pool.get(node_id)
            owner = self._owner(node_id, besides=state)
            if node is not None and owner is not None:
                node.source = owner
                log.info("node handed over node=%s from=%s to=%s", node_id, label, owner)
        for node_id in plan.remove:
            gone = self._roster.remove(node_id)
            self._drained.discard(node_id)
            if gone is not None:
                log.info("node removed node=%s source=%s reason=left-dns", node_id, label)
        if plan.drain or plan.undrain or plan.handover:
            self._pool.notify()
        if plan.add:
            await asyncio.gather(*(self._add(state, n, url, warm=first) for n, url in plan.add))

    async def _add(self, state: _State, node_id: NodeId, url: str, *, warm: bool) -> None:
        s = state.settings
        node = self._roster.make(
            NodeSettings(url=url, id=node_id, weight=s.weight, slots=s.slots), source=state.label
        )
        with contextlib.suppress(ValueError):  # taken while another add was awaited: next round
            await self._roster.add(node, warm=warm)
            log.info(
                "node discovered node=%s url=%s source=%s slow_start=%s models=%s",
                node_id, url, state.label, "no" if warm else "yes",
                ",".join(sorted(node.models)) or "-",
            )  # fmt: skip

    def _owner(self, node_id: NodeId, *, besides: _State) -> str | None:
        for other in self._states.values():
            if other is not besides and node_id in (other.last_good or {}):
                return other.label
        return None

    def _failed(self, state: _State, exc: Failed, *, applied: bool) -> None:
        self._instruments.count_discovery_failure(source=state.label, cause=exc.cause)
        state.failing += 1
        state.failing_since_log += 1
        now = self._clock.now()
        if state.warned_at is not None and now - state.warned_at < WARN_INTERVAL_S and not applied:
            return
        kept = sum(1 for n in self._pool if n.source == state.label)
        if applied:
            what = f"applied after {state.empty_in_a_row} in a row (empty_after), draining all"
        elif exc.empty:
            what = "the last good set stays (empty_after)"
        else:
            what = "the last good set stays"
        log.warning(
            'dns discovery failed source=%s cause=%s failures=%d nodes=%d detail="%s": %s',
            state.label, exc.cause, state.failing_since_log, kept, exc.detail, what,
        )  # fmt: skip
        state.warned_at = now
        state.failing_since_log = 0


# -- queries --------------------------------------------------------------------------------------


async def _query(
    resolver: dns.asyncresolver.Resolver, name: str, rdtype: str
) -> dns.resolver.Answer:
    """One query; every outcome but an answer with records is a :class:`Failed`."""
    try:
        return await resolver.resolve(name, rdtype, search=False)
    except dns.resolver.NXDOMAIN as exc:
        raise Failed("nxdomain", f"{name} does not exist (NXDOMAIN)") from exc
    except dns.resolver.NoAnswer as exc:
        raise Failed("nodata", f"{name} has no {rdtype} records") from exc
    except dns.exception.Timeout as exc:
        raise Failed("timeout", f"{name} {rdtype}: {exc}") from exc
    except dns.resolver.NoNameservers as exc:
        errors = " ".join(str(e[3]) for e in exc.kwargs.get("errors") or [])
        cause = (
            "servfail" if "SERVFAIL" in errors else "refused" if "REFUSED" in errors else "error"
        )
        raise Failed(cause, f"{name} {rdtype}: {exc}") from exc
    except (dns.exception.DNSException, OSError) as exc:
        raise Failed("error", f"{name} {rdtype}: {type(exc).__name__}: {exc}") from exc


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str, rdtype: str) -> list[str]:
    answer = await _query(resolver, name, rdtype)
    return sorted({rdata.to_text() for rdata in answer})


async def _srv(resolver: dns.asyncresolver.Resolver, name: str) -> list[tuple[str, int]]:
    """(address, port) of every SRV target; a target that does not exist, or has no address,
    is left out, as are a target of ``.`` and port 0; any other failure fails the whole
    answer."""
    answer = await _query(resolver, name, "SRV")
    targets = sorted(
        {(r.target, r.port) for r in answer if r.target != dns.name.root and r.port > 0}
    )
    known = _glue(answer.response)
    missing = sorted({target for target, _ in targets if target not in known})
    asked = await asyncio.gather(*(_target_addresses(resolver, t.to_text()) for t in missing))
    known.update(zip(missing, asked, strict=True))
    return [(address, port) for target, port in targets for address in known[target]]


def _glue(response: dns.message.Message) -> dict[dns.name.Name, list[str]]:
    """The additional section's addresses by name: A when a name has them, else AAAA."""
    v4: dict[dns.name.Name, list[str]] = {}
    v6: dict[dns.name.Name, list[str]] = {}
    for rrset in response.additional:
        if rrset.rdclass != dns.rdataclass.IN:
            continue
        table = {dns.rdatatype.A: v4, dns.rdatatype.AAAA: v6}.get(rrset.rdtype)
        if table is not None:
            table.setdefault(rrset.name, []).extend(sorted(r.to_text() for r in rrset))
    return {name: v4.get(name) or v6[name] for name in {*v4, *v6}}


async def _target_addresses(resolver: dns.asyncresolver.Resolver, target: str) -> list[str]:
    for rdtype in ("A", "AAAA"):
        try:
            return await _addresses(resolver, target, rdtype)
        except Failed as exc:
            if not exc.empty:
                raise
            if exc.cause == "nxdomain":
                return []  # no such target: no AAAA either
    return []


__all__ = ["Discovery", "Failed"]
