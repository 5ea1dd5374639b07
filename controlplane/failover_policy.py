"""The failover policy's knobs in force: the controller's settings, overridden by what an admin
stored under ``controller/policies`` through the admin API (applied by the leader from its next
window).

The window loop (``reconcile.windows``) reads them every pass and the admin API
(``api.actions``) shows and changes them; both import this module, which sits beside the
settings, below both.
"""

from __future__ import annotations

import logging
from typing import Final

import pydantic
from pydantic import BaseModel, ConfigDict, Field

import meridian_etcd as etcd
from controlplane.settings import ControllerSettings
from meridian_wire.keys import PREFIX
from policies import failover
from policies.failover import BackupRank, ShareRule

log = logging.getLogger(__name__)

KEY: Final = PREFIX + "controller/policies"
"""``controller/policies``: a :class:`StoredPolicies`, written by the admin API (fenced)."""


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True)


class PolicyValues(_Value):
    """The failover policy's knobs in force (the controller's settings, overridden by PUT)."""

    window_s: float = Field(gt=0, description="length of a health window, seconds")
    strikes: int = Field(ge=1, description="consecutive failed windows before failed")
    recovery_windows: int = Field(ge=1, description="good windows before the ramp")
    ramp: list[float] = Field(min_length=1, description="weight per good window while recovering")
    min_hold_s: float = Field(ge=0, description="least time in failed, seconds")
    status_stale_s: float = Field(gt=0, description="status older than this fails")
    min_healthy_fraction: float = Field(ge=0, le=1, description="healthy node share needed")
    max_error_rate: float = Field(ge=0, le=1, description="a window fails above this")
    ttft_p99_slo_s: float | None = Field(
        gt=0, description="a window fails above this p99 TTFT; null: not checked"
    )
    prewarm_fraction: float = Field(ge=0, le=1, description="backup floor share, 0..1")
    shares: ShareRule = Field(
        "capacity", description="a region's base share of its geography: capacity or equal"
    )
    backup_rank: BackupRank = Field(
        "latency", description="automatic backups by round trip + p99 TTFT, or round trip alone"
    )
    latency_hysteresis_ms: float = Field(
        250.0, ge=0, description="a backup is replaced only by one this much sooner, ms"
    )


class StoredPolicies(_Value):
    """``controller/policies``: what an admin set, applied by the leader from its next window."""

    values: PolicyValues
    reason: str
    by: str
    at: float


def configured(settings: ControllerSettings) -> PolicyValues:
    """The policy knobs as configured (before any admin override)."""
    return PolicyValues.model_validate(settings.failover, from_attributes=True)


def config_of(values: PolicyValues) -> failover.FailoverConfig:
    """The policy's config from these knobs; ValueError names a bad one."""
    return failover.FailoverConfig(**{**values.model_dump(), "ramp": tuple(values.ramp)})


def config_from(
    settings: ControllerSettings, policies: PolicyValues | None = None
) -> failover.FailoverConfig:
    return config_of(policies or configured(settings))


async def stored(store: etcd.Store) -> StoredPolicies | None:
    """The admin's policies from etcd; ``None`` when unset or invalid (logged, settings used)."""
    entry = await store.get(KEY)
    if entry is None:
        return None
    try:
        value = StoredPolicies.model_validate_json(entry.value)
        config_of(value.values)  # the policy's own checks
    except (pydantic.ValidationError, ValueError) as exc:
        log.warning("ignoring invalid policies key=%s problem=%s", entry.key, exc)
        return None
    return value
