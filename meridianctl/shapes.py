"""What each admin API answer holds, as far as meridianctl reads it.

An answer that departs from its shape did not come from the controller's admin API (an agent,
a node, etcd, a proxy's error page): the client reports it as such (exit code 3) instead of
failing on a missing key.  A shape is

- a type, or a tuple of types: the value is one of them (``OPT_STR``: a string or null);
- a ``dict``: a JSON object with these keys (a key ending in ``?`` may be absent), each
  value of its shape; other keys are allowed (a newer controller may add some);
- a one-element ``list``: a JSON array whose every item has that shape;
- ``Map(shape)``: a JSON object with any keys, every value of that shape;
- ``Opt(shape)``: null, or a value of that shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NONE = type(None)
NUM = (int, float)
OPT_NUM = (int, float, NONE)
OPT_STR = (str, NONE)


@dataclass(frozen=True, slots=True)
class Map:
    """A JSON object with any keys, each value of shape ``value``."""

    value: Any


@dataclass(frozen=True, slots=True)
class Opt:
    """null, or a value of shape ``value``."""

    value: Any


Shape = Any  # type | tuple[type, ...] | dict[str, Shape] | list[Shape] | Map | Opt

SERVING = Map(Map(NUM))
ROW: Shape = {
    "region": str,
    "state": OPT_STR,
    "strikes": int,
    "capacity": OPT_NUM,
    "load": Opt({"requests_per_s?": NUM, "kv_util?": NUM}),
    "weight": OPT_NUM,
    "backup": OPT_STR,
    "floor": OPT_NUM,
    "alive": bool,
    "admin?": OPT_STR,
    "manual_failover?": bool,
    "unreachable?": bool,
    "models?": Opt(Map(NUM)),
    "model_backups?": Map(OPT_STR),
    "model_floors?": Map(NUM),
}
REGIONS: Shape = {"regions": [ROW], "window": int, "serving": SERVING, "alert?": OPT_STR}
REGION: Shape = {
    "row": {**ROW, "geo": OPT_STR, "residency": [str], "reason": str},
    "override": Opt({"failover?": bool, "admin?": str, "reason": str, "by?": OPT_STR}),
    "probes?": Map({"age_s": NUM, "probes": [{"endpoint": str, "ok": bool, "error?": str}]}),
    "reach?": Opt({"reason": str, "unreachable": bool}),
    "measured_latency_ms?": Map(NUM),
}
RECORD: Shape = {"name": str, "ttl_s": int, "type": str, "values": [str]}
DNS_VIEW: Shape = {"geo": str, "zone": str, "reason": str, "records?": [RECORD], "hold?": bool}
DNS_APPLIED: Shape = {
    "backend": str,
    "server": str,
    "generation": int,
    "desired_generation": int,
    "window": int,
    "applied_at?": OPT_NUM,
    "error?": OPT_STR,
    "views?": Map(DNS_VIEW),
}
DNS: Shape = {"applied": Opt(DNS_APPLIED), "problem?": OPT_STR}
EVENTS: Shape = {
    "events": [{"at": NUM, "kind": str, "region?": OPT_STR, "reason": str}],
    "cursor": OPT_STR,
}
AUDIT: Shape = {
    "entries": [
        {"at": NUM, "who": str, "action": str, "region?": OPT_STR, "result": str, "reason": str}
    ]
}
HEALTH: Shape = {
    "id": str,
    "leading": bool,
    "leader": OPT_STR,
    "etcd": str,
    "window": (int, NONE),
    "alert?": OPT_STR,
    "pass_s?": (int, float, NONE),
    "pass_writes?": (int, NONE),
}
POLICY_VALUE = (int, float, str, NONE, list)
POLICIES: Shape = {
    "values": Map(POLICY_VALUE),
    "source": str,
    "reason?": str,
    "by?": str,
}
PROBLEM: Shape = {"title": str, "status": int, "detail": str, "fix?": str, "errors?": [str]}
CHANGE: Shape = {
    "region": str,
    "state_before": OPT_STR,
    "state_after": str,
    "weight_before": OPT_NUM,
    "weight_after": NUM,
    "backup_after": OPT_STR,
    "floor_after": NUM,
}
ACTION: Shape = {
    "action": str,
    "region": OPT_STR,
    "dry_run": bool,
    "audit_id": str,
    "changes": [CHANGE],
    "serving_before": SERVING,
    "serving_after": SERVING,
    "alert?": OPT_STR,
}


def mismatch(data: Any, shape: Shape, where: str = "") -> str | None:
    """Where ``data`` departs from ``shape`` (``regions[0].state: missing``), or None."""
    here = where or "the answer"
    if isinstance(shape, Opt):
        return None if data is None else mismatch(data, shape.value, where)
    if isinstance(shape, Map):
        if not isinstance(data, dict):
            return f"{here}: {_kind(data)}, not an object"
        for key, value in data.items():
            found = mismatch(value, shape.value, f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(shape, dict):
        if not isinstance(data, dict):
            return f"{here}: {_kind(data)}, not an object"
        for name, sub in shape.items():
            key = name.removesuffix("?")
            path = f"{where}.{key}" if where else key
            if key not in data:
                if name.endswith("?"):
                    continue
                return f"{path}: missing"
            found = mismatch(data[key], sub, path)
            if found:
                return found
        return None
    if isinstance(shape, list):
        if not isinstance(data, list):
            return f"{here}: {_kind(data)}, not an array"
        for i, item in enumerate(data):
            found = mismatch(item, shape[0], f"{where}[{i}]")
            if found:
                return found
        return None
    kinds = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(data, bool) and bool not in kinds:  # JSON true is not a number here
        return f"{here}: {_kind(data)}, not {_names(kinds)}"
    if not isinstance(data, kinds):
        return f"{here}: {_kind(data)}, not {_names(kinds)}"
    return None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            NONE: "null"}.get(type(value), "a number")  # fmt: skip


def _names(kinds: tuple[type, ...]) -> str:
    names = {int: "a number", float: "a number", str: "a string", bool: "a boolean",
             dict: "an object", list: "an array", NONE: "null"}  # fmt: skip
    return " or ".join(dict.fromkeys(names[k] for k in kinds))
