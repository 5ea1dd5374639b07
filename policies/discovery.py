"""Node discovery's decisions, pure: which nodes a DNS answer adds, drains, takes back and
removes.  The agent's ``regional_agent.discovery`` asks DNS and applies the :class:`Plan`.

A discovery source (one ``[[discovery.dns]]`` entry) *holds* the nodes it added; nothing else
is ever touched by it.  Each answer is the set of endpoints the name points at now
(:func:`endpoint` turns an address and a port into the node's id and URL).  :func:`plan` compares
it with what the source holds:

* an endpoint not in the pool is **added**; one whose id another source already holds (a static
  node, one added through the admin API, another DNS name's) is **skipped**: first come, and a
  static node always wins;
* a held node that left the answer is **drained** (no new requests, in-flight ones finish);
  once it is draining and has nothing in flight it is **removed**; if another DNS source's
  last answer has it, it is **handed over** to that source instead (no drain, no re-add);
* a node the source drained that is back in the answer is **undrained**; one an admin drained
  stays drained (discovery never undoes an operator's drain).

An *empty* answer (NXDOMAIN, or a name without records of the type) is not applied at once:
:func:`apply_empty` says whether ``empty_after`` such answers in a row have been seen (0: never
apply one, keep the last good set).  A failed query (SERVFAIL, timeout, refused) never gets
here: the shell keeps what it holds.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from policies.model import NodeId

SCHEMES = ("http", "https")


@dataclass(frozen=True, slots=True, kw_only=True)
class Held:
    """A node a source holds, as :func:`plan` needs to see it."""

    node_id: NodeId
    draining: bool  # its admin state is draining (whoever asked)
    drained_by_discovery: bool  # ... and it was discovery that drained it
    in_flight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    add: tuple[tuple[NodeId, str], ...] = ()  # (id, url), in id order
    drain: tuple[NodeId, ...] = ()
    undrain: tuple[NodeId, ...] = ()
    remove: tuple[NodeId, ...] = ()
    handover: tuple[NodeId, ...] = ()  # left this source's answer, held on by another's
    skipped: tuple[NodeId, ...] = ()  # in the answer, but another source holds the id

    @property
    def changes(self) -> bool:
        return bool(self.add or self.drain or self.undrain or self.remove or self.handover)


def endpoint(scheme: str, address: str, port: int) -> tuple[NodeId, str]:
    """The node id and base URL of ``address:port``: the id is ``address:port`` as a static
    node's default id is (``NodeSettings.node_id``: the URL's host without brackets), so one
    address given both ways is one node."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1-65535, got {port}")
    ip = ipaddress.ip_address(address)
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return NodeId(f"{ip}:{port}"), f"{scheme}://{host}:{port}"


def plan(
    answer: Mapping[NodeId, str],
    held: Sequence[Held],
    *,
    taken: Collection[NodeId],
    elsewhere: Collection[NodeId] = (),
) -> Plan:
    """What to do with one answer (``answer``: id → URL).  ``held``: the source's nodes;
    ``taken``: every id in the pool that the source does not hold; ``elsewhere``: the ids in the
    other DNS sources' last answers."""
    held_ids = {h.node_id for h in held}
    add = tuple(
        (node_id, answer[node_id])
        for node_id in sorted(answer)
        if node_id not in held_ids and node_id not in taken
    )
    skipped = tuple(sorted(n for n in answer if n not in held_ids and n in taken))
    drain: list[NodeId] = []
    undrain: list[NodeId] = []
    remove: list[NodeId] = []
    handover: list[NodeId] = []
    for h in sorted(held, key=lambda h: h.node_id):
        if h.node_id in answer:
            if h.draining and h.drained_by_discovery:
                undrain.append(h.node_id)
        elif h.node_id in elsewhere:
            handover.append(h.node_id)
        elif not h.draining:
            drain.append(h.node_id)
        elif h.in_flight <= 0:
            remove.append(h.node_id)
    return Plan(
        add=add,
        drain=tuple(drain),
        undrain=tuple(undrain),
        remove=tuple(remove),
        handover=tuple(handover),
        skipped=skipped,
    )


def apply_empty(consecutive: int, *, empty_after: int) -> bool:
    """Whether an empty answer, the ``consecutive``-th in a row (1 for the first), is to be
    applied as the name's set of nodes: only after ``empty_after`` of them; never when
    ``empty_after`` is 0."""
    return empty_after > 0 and consecutive >= empty_after
