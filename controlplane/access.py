"""Least privilege in etcd: which etcd user may touch which keys, and the bootstrap that makes
etcd enforce it (``meridian-controller etcd bootstrap``; docs/security.md#etcd-tls-users-and-roles).

===========================  ===========================  =========================================
user                         role                         keys (``/meridian/v1/`` …)
===========================  ===========================  =========================================
``agent-<r>``                ``meridian-agent-<r>``       readwrite ``regions/<r>/agents/*`` (its
                                                          replicas' alive and status keys),
                                                          readwrite ``routing/<r>/*`` (the group
                                                          tables), read ``regions/<r>/desired``
                                                          and ``controller/plan`` (spill-over)
``meridian-controller``      ``meridian-controller``      readwrite ``/meridian/v1/*``
``root``                     ``root`` (etcd's own)        everything; etcd requires it for auth
===========================  ===========================  =========================================

:func:`roles` and :func:`users` compute that from the region ids alone (pure); :func:`bootstrap`
compares it with what etcd holds and changes only what differs — roles and users added,
missing permissions and roles granted, permissions and roles beyond these revoked from
Meridian's own roles and users (``root``'s other roles are left alone), auth enabled last — so a
second run changes nothing and says so.  A user is added without a password (etcd then only
takes it from a client certificate whose CN is its name, under ``--client-cert-auth``) unless a
password is given for it; an existing user's password is never changed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

import meridian_etcd
from meridian_etcd import Permission
from meridian_wire import keys
from meridian_wire.models import REGION_ID

ROOT = "root"  # etcd's: the user and role that auth enabling requires
CONTROLLER = "meridian-controller"


def agent_role(region: str) -> str:
    return f"meridian-agent-{region}"


def agent_user(region: str) -> str:
    """The etcd user of a region's agents: the CN of their client certificates."""
    return f"agent-{region}"


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    permissions: tuple[Permission, ...]  # sorted


@dataclass(frozen=True, slots=True)
class User:
    name: str
    roles: tuple[str, ...]  # sorted


def roles(regions: Iterable[str]) -> list[Role]:
    """Every role Meridian needs for ``regions``, with its key ranges: one per region for its
    agents (what ``regional_agent.publisher`` and ``group_routing.sync`` read and write), and
    the controller's.  ``root`` is etcd's own and needs no permissions."""
    out = []
    for region in _regions(regions):
        granted = (
            Permission.under("readwrite", keys.agents(region)),
            Permission.under("readwrite", f"{keys.ROUTING}{region}/"),
            Permission.on("read", keys.desired(region)),
            Permission.on("read", keys.PLAN),  # spill-over: which regions serve what, where
        )
        out.append(Role(name=agent_role(region), permissions=tuple(sorted(granted))))
    out.append(Role(name=CONTROLLER, permissions=(Permission.under("readwrite", keys.PREFIX),)))
    return out


def users(regions: Iterable[str]) -> list[User]:
    """Every user Meridian needs for ``regions`` and the roles each holds, ``root`` last."""
    out = [User(name=agent_user(r), roles=(agent_role(r),)) for r in _regions(regions)]
    out.append(User(name=CONTROLLER, roles=(CONTROLLER,)))
    out.append(User(name=ROOT, roles=(ROOT,)))
    return out


def _regions(regions: Iterable[str]) -> list[str]:
    out = sorted(set(regions))
    for region in out:
        if not REGION_ID.match(region):
            raise ValueError(f"region id {region!r}: lowercase letters, digits and dashes")
    return out


@dataclass
class Report:
    """What a bootstrap changed (or, in a dry run, would change), one line each."""

    endpoint: str
    dry_run: bool
    auth_was_enabled: bool = False
    changes: list[str] = field(default_factory=list)
    roles: int = 0
    users: int = 0

    def lines(self) -> list[str]:
        verb = "would change" if self.dry_run else "changed"
        head = f"etcd {self.endpoint}: auth {'on' if self.auth_was_enabled else 'off'} before"
        if not self.changes:
            return [
                head,
                f"nothing to change: {self.roles} roles, {self.users} users and auth are as "
                "they should be",
            ]
        return [head, *(f"  {c}" for c in self.changes), f"{verb}: {len(self.changes)}"]


async def bootstrap(
    admin: meridian_etcd.Admin,
    *,
    regions: Iterable[str],
    passwords: Mapping[str, str] | None = None,
    root_password: str | None = None,
    dry_run: bool = False,
) -> Report:
    """Make etcd's roles, users and auth match :func:`roles` and :func:`users` for
    ``regions``.  ``passwords``: by user, for users to add with a password (others get none:
    client certificates); ``root_password``: root's, when root is added.  Raises the etcd
    layer's errors (``Refused`` when the credentials may not manage auth)."""
    wanted_roles = roles(regions)
    wanted_users = users(regions)
    report = Report(
        endpoint=admin.endpoint,
        dry_run=dry_run,
        roles=len(wanted_roles),
        users=len(wanted_users),
    )
    report.auth_was_enabled = await admin.auth_enabled()

    async def change(text: str, act: Callable[[], Awaitable[None]]) -> None:
        report.changes.append(text)
        if not dry_run:
            await act()

    have_roles = set(await admin.roles())
    for role in wanted_roles:
        current: set[Permission] = set()
        if role.name in have_roles:
            current = set(await admin.permissions(role.name))
        else:
            await change(f"+ role {role.name}", partial(admin.add_role, role.name))
        for p in role.permissions:
            if p not in current:
                await change(f"+ {role.name}: {p}", partial(admin.grant, role.name, p))
        for p in sorted(current - set(role.permissions)):
            await change(
                f"- {role.name}: {p} (beyond least privilege)", partial(admin.revoke, role.name, p)
            )

    have_users = set(await admin.users())
    for user in wanted_users:
        held: set[str] = set()
        if user.name in have_users:
            held = set(await admin.user_roles(user.name))
        else:
            password = root_password if user.name == ROOT else (passwords or {}).get(user.name)
            how = (
                "with a password"
                if password is not None
                else f"no password: only a client certificate with CN {user.name}"
            )
            await change(
                f"+ user {user.name} ({how})",
                partial(admin.add_user, user.name, password=password),
            )
        for role_name in user.roles:
            if role_name not in held:
                await change(
                    f"+ {user.name}: role {role_name}",
                    partial(admin.grant_role, user.name, role_name),
                )
        if user.name != ROOT:
            for role_name in sorted(held - set(user.roles)):
                await change(
                    f"- {user.name}: role {role_name} (beyond least privilege)",
                    partial(admin.revoke_role, user.name, role_name),
                )

    if not report.auth_was_enabled:
        await change("+ auth enabled", admin.enable_auth)
        if not dry_run:
            # the next call authenticates: proves these credentials still manage etcd
            await admin.user_roles(ROOT)
    return report
