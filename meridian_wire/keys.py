"""Keys under ``/meridian/v1/`` (docs/architecture.md, "etcd keyspace").

=============================================  ==========  ======================================
key                                            writer      value
=============================================  ==========  ======================================
regions/<r>/agents/<a>/alive                   agent <a>   empty, under the agent's lease:
                                                           liveness of one agent replica
regions/<r>/agents/<a>/status                  agent <a>   ``RegionStatus`` JSON under the same
                                                           lease, on change or once per window
regions/<r>/alive, regions/<r>/status          (legacy)    the single-agent keys of older agents;
                                                           read by the controller, never written
regions/<r>/desired                            controller  ``RegionDesired`` JSON
regions/<r>/health                             controller  ``RegionHealth`` JSON (judged state)
regions/<r>/override                           operator    ``RegionOverride`` JSON: manual
                                                           failover or drain, until cleared
regions/<r>/agents/_autoscaler                agent <a>   ``<a>``, under its lease: the one
                                                           replica whose autoscaler acts
routing/<r>/groups/<kind>-<first>             agent       ``GroupTable`` JSON, under the writer's
                                                           lease: buckets [first, end) -> group
controller/leader                              controller  leader id, under the election lease
controller/plan                                controller  ``FleetPlan`` JSON: the last good plan
controller/probes/<c>                          controller  ``ProbeReport`` JSON under replica
                                               replica <c> <c>'s probe lease: what it reached
dns/applied                                    controller  last DNS plan applied, its generation
events/<time>-<id>                             controller  ``Event`` JSON (retention applies)
audit/<time>-<id>                              controller  who did what, when, why
=============================================  ==========  ======================================
"""

from __future__ import annotations

import re
from typing import Final

PREFIX: Final = "/meridian/v1/"
REGIONS: Final = PREFIX + "regions/"
ROUTING: Final = PREFIX + "routing/"
LEADER: Final = PREFIX + "controller/leader"
PLAN: Final = PREFIX + "controller/plan"
PROBES: Final = PREFIX + "controller/probes/"
DNS_APPLIED: Final = PREFIX + "dns/applied"
EVENTS: Final = PREFIX + "events/"
AUDIT: Final = PREFIX + "audit/"


AGENT_ID: Final = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
GROUP_KINDS: Final = ("prefix", "session")


def alive(region: str) -> str:
    """Legacy single-agent liveness key (agents before per-agent keys); read, not written."""
    return f"{REGIONS}{region}/alive"


def status(region: str) -> str:
    """Legacy single-agent status key (agents before per-agent keys); read, not written."""
    return f"{REGIONS}{region}/status"


def agents(region: str) -> str:
    """The prefix of every agent replica's keys in ``region``."""
    return f"{REGIONS}{region}/agents/"


def agent_alive(region: str, agent: str) -> str:
    return f"{agents(region)}{_agent(agent)}/alive"


def agent_status(region: str, agent: str) -> str:
    return f"{agents(region)}{_agent(agent)}/status"


def autoscaler_actor(region: str) -> str:
    """The replica whose autoscaler acts for ``region`` (``_`` starts no agent id, so it is no
    agent's key; it is under ``agents/`` so the agent's etcd role may write it)."""
    return f"{agents(region)}_autoscaler"


def _agent(agent: str) -> str:
    if not AGENT_ID.match(agent):
        raise ValueError(
            f"agent id {agent!r} must be 1-63 lowercase letters, digits, dots, dashes, underscores"
        )
    return agent


def desired(region: str) -> str:
    return f"{REGIONS}{region}/desired"


def health(region: str) -> str:
    return f"{REGIONS}{region}/health"


def override(region: str) -> str:
    return f"{REGIONS}{region}/override"


def groups(region: str) -> str:
    return f"{ROUTING}{region}/groups/"


def group(region: str, kind: str, first: int) -> str:
    """``routing/<r>/groups/prefix-00042``: the range of ``kind`` buckets that starts at
    ``first`` (zero-padded to five digits so that keys sort by bucket)."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"group table kind must be one of {GROUP_KINDS}; got {kind!r}")
    if first < 0:
        raise ValueError(f"first bucket must not be negative; got {first}")
    return f"{ROUTING}{region}/groups/{kind}-{first:05d}"


def probes(replica: str) -> str:
    """``controller/probes/<replica>``: the last probe round of one controller replica."""
    if not AGENT_ID.match(replica):
        raise ValueError(
            f"replica id {replica!r} must be 1-63 lowercase letters, digits, dots, dashes, "
            "underscores (election.id)"
        )
    return f"{PROBES}{replica}"


def event(at_ms: int, event_id: str) -> str:
    return f"{EVENTS}{at_ms:015d}-{event_id}"


def audit(at_ms: int, entry_id: str) -> str:
    return f"{AUDIT}{at_ms:015d}-{entry_id}"


def parse_region_key(key: str) -> tuple[str, str] | None:
    """``/meridian/v1/regions/eu-west/status`` → ``("eu-west", "status")``; else ``None``."""
    if not key.startswith(REGIONS):
        return None
    rest = key[len(REGIONS) :]
    region, _, leaf = rest.partition("/")
    if not region or not leaf or "/" in leaf:
        return None
    return region, leaf


def parse_agent_key(key: str) -> tuple[str, str, str] | None:
    """``/meridian/v1/regions/eu-west/agents/a1/status`` → ``("eu-west", "a1", "status")``;
    else ``None``."""
    if not key.startswith(REGIONS):
        return None
    parts = key[len(REGIONS) :].split("/")
    if len(parts) != 4 or parts[1] != "agents" or not parts[0] or not parts[2] or not parts[3]:
        return None
    return parts[0], parts[2], parts[3]


def parse_group_key(key: str) -> tuple[str, str, int] | None:
    """``/meridian/v1/routing/eu-west/groups/prefix-00042`` → ``("eu-west", "prefix", 42)``;
    ``None`` for a key that is not a group-table key of that shape."""
    if not key.startswith(ROUTING):
        return None
    parts = key[len(ROUTING) :].split("/")
    if len(parts) != 3 or parts[1] != "groups" or not parts[0]:
        return None
    kind, _, first = parts[2].partition("-")
    if kind not in GROUP_KINDS or not first.isdigit():
        return None
    return parts[0], kind, int(first)
