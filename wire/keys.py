"""Keys under ``/meridian/v1/`` (../shared/DESIGN.md, "etcd keyspace").

=============================================  ==========  ======================================
key                                            writer      value
=============================================  ==========  ======================================
regions/<r>/alive                              agent       empty, under a short lease: liveness
regions/<r>/status                             agent       ``RegionStatus`` JSON, on change or
                                                           at most once per window
regions/<r>/desired                            controller  ``RegionDesired`` JSON
regions/<r>/health                             controller  ``RegionHealth`` JSON (judged state)
regions/<r>/override                           operator    ``RegionOverride`` JSON: manual
                                                           failover or drain, until cleared
routing/<r>/groups/<bucket>                    agent       ``GroupTable`` JSON, under a lease
controller/leader                              controller  leader id, under the election lease
controller/plan                                controller  ``FleetPlan`` JSON: the last good plan
dns/applied                                    controller  last DNS plan applied, its generation
events/<time>-<id>                             controller  ``Event`` JSON (retention applies)
audit/<time>-<id>                              controller  who did what, when, why
=============================================  ==========  ======================================
"""

from __future__ import annotations

from typing import Final

PREFIX: Final = "/meridian/v1/"
REGIONS: Final = PREFIX + "regions/"
ROUTING: Final = PREFIX + "routing/"
LEADER: Final = PREFIX + "controller/leader"
PLAN: Final = PREFIX + "controller/plan"
DNS_APPLIED: Final = PREFIX + "dns/applied"
EVENTS: Final = PREFIX + "events/"
AUDIT: Final = PREFIX + "audit/"


def alive(region: str) -> str:
    return f"{REGIONS}{region}/alive"


def status(region: str) -> str:
    return f"{REGIONS}{region}/status"


def desired(region: str) -> str:
    return f"{REGIONS}{region}/desired"


def health(region: str) -> str:
    return f"{REGIONS}{region}/health"


def override(region: str) -> str:
    return f"{REGIONS}{region}/override"


def groups(region: str) -> str:
    return f"{ROUTING}{region}/groups/"


def group(region: str, bucket: str) -> str:
    return f"{ROUTING}{region}/groups/{bucket}"


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
