"""What the admin API needs of the controller replica that serves it.

``app.Controller`` is the replica; the admin API (``api``) depends on this protocol only, so the
API never imports the app that mounts it.
"""

from __future__ import annotations

from typing import Protocol

import meridian_etcd as etcd
from controlplane.election import Election
from controlplane.reconcile import windows
from controlplane.settings import ControllerSettings
from meridian_service.clock import Clock


class Replica(Protocol):
    settings: ControllerSettings
    clock: Clock
    store: etcd.Store
    election: Election
    last_pass: windows.PassResult | None
    last_pass_s: float | None

    @property
    def etcd_ok(self) -> bool:
        """Whether etcd answers this replica now (each replica tracks its own)."""
        ...
