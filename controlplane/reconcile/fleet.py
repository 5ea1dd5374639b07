"""Read the fleet's whole state from etcd, validating every value.

A value that does not validate (written by hand or by an older agent) is reported with its key
and left out for this window — it never crashes the controller.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TypeVar

import pydantic

from controlplane.errors import BadValue
from controlplane.store import Entry, Store
from wire import keys
from wire.models import FleetPlan, RegionDesired, RegionHealth, RegionOverride, RegionStatus

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass(slots=True, kw_only=True)
class RegionRecord:
    region: str
    alive: bool = False
    status: RegionStatus | None = None
    status_bad: bool = False  # a status exists but does not validate
    desired: RegionDesired | None = None
    health: RegionHealth | None = None
    override: RegionOverride | None = None


@dataclass(slots=True, kw_only=True)
class FleetView:
    regions: dict[str, RegionRecord] = field(default_factory=dict)
    plan: FleetPlan = field(default_factory=FleetPlan)
    bad: list[BadValue] = field(default_factory=list)


def _parse(entry: Entry, model: type[M], bad: list[BadValue]) -> M | None:
    try:
        return model.model_validate(json.loads(entry.value))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        bad.append(BadValue(entry.key, f"not JSON: {exc}"))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
        )
        bad.append(BadValue(entry.key, f"invalid {model.__name__}: {problems}"))
    return None


async def read(store: Store) -> FleetView:
    view = FleetView()
    for entry in await store.get_prefix(keys.REGIONS):
        parsed = keys.parse_region_key(entry.key)
        if parsed is None:
            continue
        region, leaf = parsed
        record = view.regions.setdefault(region, RegionRecord(region=region))
        if leaf == "alive":
            record.alive = True
        elif leaf == "status":
            record.status = _parse(entry, RegionStatus, view.bad)
            record.status_bad = record.status is None
            if record.status is not None and record.status.region != region:
                view.bad.append(
                    BadValue(entry.key, f"names region {record.status.region!r}, not {region!r}")
                )
                record.status, record.status_bad = None, True
        elif leaf == "desired":
            record.desired = _parse(entry, RegionDesired, view.bad)
        elif leaf == "health":
            record.health = _parse(entry, RegionHealth, view.bad)
        elif leaf == "override":
            record.override = _parse(entry, RegionOverride, view.bad)
    plan = await store.get(keys.PLAN)
    if plan is not None:
        view.plan = _parse(plan, FleetPlan, view.bad) or FleetPlan()
    for problem in view.bad:
        log.warning(
            "ignoring a bad value in etcd this window key=%s problem=%s",
            problem.key,
            problem.problem,
        )
    return view
