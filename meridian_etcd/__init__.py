"""The one etcd layer under both shells: the only package that imports aetcd or grpc.

``client``     :class:`Store` (built from a :class:`ClientConfig`): keys, leases, transactions
               guarded by revisions or fenced by a leader key, watches; member failover
``errors``     the layer's errors and the table that translates every aetcd/grpc exception
``endpoints``  the etcd URL parser both shells' settings use
``security``   TLS and auth settings: which go together, their files, a connection's credentials
``admin``      :class:`Admin`: users, roles, permissions and enabling auth (the bootstrap's)

The agent (``regional_agent.publisher``, ``regional_agent.group_routing``) and the controller
(``controlplane.election``, ``reconcile``, ``dns``, ``api``) call it; ``policies`` and
``meridian_wire`` may not (import-linter contracts).
"""

from meridian_etcd.admin import Admin, Permission
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
from meridian_etcd.errors import (
    EtcdError,
    Fenced,
    LeaseLost,
    Refused,
    TokenExpired,
    Unavailable,
)
from meridian_etcd.security import check as check_settings

__all__ = [
    "Admin",
    "Change",
    "ClientConfig",
    "Deleted",
    "Entry",
    "EtcdError",
    "Fence",
    "Fenced",
    "Lease",
    "LeaseLost",
    "Permission",
    "Refused",
    "Snapshot",
    "Store",
    "TokenExpired",
    "Unavailable",
    "check_settings",
]
