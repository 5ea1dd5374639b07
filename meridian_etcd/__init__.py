"""The one etcd layer under both shells: the only package that imports aetcd or grpc.

``client``     :class:`Store` (built from a :class:`ClientConfig`): keys, leases, transactions
               guarded by revisions or fenced by a leader key, watches; member failover
``errors``     the layer's errors and the table that translates every aetcd/grpc exception
``endpoints``  the etcd URL parser both shells' settings use

The agent (``regional_agent.publisher``, ``regional_agent.group_routing``) and the controller
(``controlplane.election``, ``reconcile``, ``dns``, ``api``) call it; ``policies`` and
``meridian_wire`` may not (import-linter contracts).
"""

from meridian_etcd.client import (
    Change,
    ClientConfig,
    Deleted,
    Entry,
    Fence,
    Lease,
    Snapshot,
    Store,
)
from meridian_etcd.errors import EtcdError, Fenced, LeaseLost, Refused, Unavailable

__all__ = [
    "Change",
    "ClientConfig",
    "Deleted",
    "Entry",
    "EtcdError",
    "Fence",
    "Fenced",
    "Lease",
    "LeaseLost",
    "Refused",
    "Snapshot",
    "Store",
    "Unavailable",
]
