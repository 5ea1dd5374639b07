"""etcd's users, roles and permissions, and turning auth on: what a bootstrap needs.

``Admin(ClientConfig(endpoints=[...], user="root", password_file=...))`` (or a client
certificate whose CN is ``root``); ``await admin.close()`` when done.  Every call goes through
the :class:`~meridian_etcd.client.Store` the admin holds — the same members, time limits,
error table and re-authentication as every other call — on etcd's ``Auth`` service.  Before
auth is enabled etcd lets anyone manage users and roles, and the credentials are not used;
once :meth:`Admin.enable_auth` has run, the next call authenticates with them.

A :class:`Permission` is a range of keys and what it allows: one key, or every key under a
prefix (``Permission.under("readwrite", "/meridian/v1/")``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aetcd.utils
from aetcd import rpc

from meridian_etcd.client import ClientConfig, Store
from meridian_etcd.errors import EtcdError

T = TypeVar("T")
Access = Literal["read", "write", "readwrite"]

_TYPE: dict[str, int] = {
    "read": rpc.Permission.READ,
    "write": rpc.Permission.WRITE,
    "readwrite": rpc.Permission.READWRITE,
}
_ACCESS: dict[int, Access] = {
    rpc.Permission.READ: "read",
    rpc.Permission.WRITE: "write",
    rpc.Permission.READWRITE: "readwrite",
}


@dataclass(frozen=True, slots=True, order=True)
class Permission:
    """``access`` to ``key`` alone (``range_end`` empty) or to ``[key, range_end)``."""

    access: Access
    key: str
    range_end: str = ""

    @classmethod
    def on(cls, access: Access, key: str) -> Permission:
        """``access`` to one key."""
        return cls(access=access, key=key)

    @classmethod
    def under(cls, access: Access, prefix: str) -> Permission:
        """``access`` to every key that starts with ``prefix``."""
        end = aetcd.utils.prefix_range_end(prefix.encode()).decode()
        return cls(access=access, key=prefix, range_end=end)

    @property
    def is_prefix(self) -> bool:
        return bool(self.range_end) and self == Permission.under(self.access, self.key)

    def __str__(self) -> str:
        if not self.range_end:
            where = self.key
        elif self.is_prefix:
            where = f"{self.key}*"
        else:
            where = f"[{self.key}, {self.range_end})"
        return f"{self.access} {where}"


class Admin:
    """etcd's users and roles (its ``Auth`` service), through the layer's client."""

    def __init__(self, config: ClientConfig) -> None:
        self._store = Store(config)
        self._timeout_s = config.timeout_s

    @property
    def endpoint(self) -> str:
        return self._store.endpoint

    async def auth_enabled(self) -> bool:
        """Whether etcd enforces auth.  etcd 3.4 has no ``AuthStatus``; an ``Authenticate``
        with no name answers "authentication is not enabled" only when it is not."""
        try:
            await self._auth("ask whether auth is enabled", "Authenticate",
                             rpc.AuthenticateRequest(name="", password=""))  # fmt: skip
        except EtcdError as exc:
            if "authentication is not enabled" in exc.message:
                return False
            if "authentication failed" in exc.message:
                return True
            raise
        return True  # pragma: no cover - etcd never authenticates an empty name

    async def enable_auth(self) -> None:
        """Turn auth on (etcd requires the ``root`` user with the ``root`` role first).  The
        connection is made again, so that the next call authenticates."""
        await self._auth("enable auth", "AuthEnable", rpc.AuthEnableRequest())
        await self._store._reconnect("auth enabled: authenticate from now on")

    # -- roles -----------------------------------------------------------------------------------

    async def roles(self) -> tuple[str, ...]:
        reply = await self._auth("list roles", "RoleList", rpc.AuthRoleListRequest())
        return tuple(str(r) for r in reply.roles)

    async def permissions(self, role: str) -> tuple[Permission, ...]:
        reply = await self._auth(f"get role {role}", "RoleGet", rpc.AuthRoleGetRequest(role=role))
        return tuple(
            sorted(
                Permission(
                    access=_ACCESS[int(p.permType)],
                    key=bytes(p.key).decode(),
                    range_end=bytes(p.range_end).decode(),
                )
                for p in reply.perm
            )
        )

    async def add_role(self, role: str) -> None:
        await self._auth(f"add role {role}", "RoleAdd", rpc.AuthRoleAddRequest(name=role))

    async def grant(self, role: str, permission: Permission) -> None:
        perm = rpc.Permission(
            permType=_TYPE[permission.access],
            key=permission.key.encode(),
            range_end=permission.range_end.encode(),
        )
        await self._auth(
            f"grant {role} {permission}",
            "RoleGrantPermission",
            rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
        )

    async def revoke(self, role: str, permission: Permission) -> None:
        await self._auth(
            f"revoke {permission} from {role}",
            "RoleRevokePermission",
            rpc.AuthRoleRevokePermissionRequest(
                role=role, key=permission.key.encode(), range_end=permission.range_end.encode()
            ),
        )

    # -- users -----------------------------------------------------------------------------------

    async def users(self) -> tuple[str, ...]:
        reply = await self._auth("list users", "UserList", rpc.AuthUserListRequest())
        return tuple(str(u) for u in reply.users)

    async def user_roles(self, user: str) -> tuple[str, ...]:
        reply = await self._auth(f"get user {user}", "UserGet", rpc.AuthUserGetRequest(name=user))
        return tuple(sorted(str(r) for r in reply.roles))

    async def add_user(self, user: str, *, password: str | None) -> None:
        """Add ``user`` with ``password``, or with none (``None``): such a user is only ever
        authenticated by a client certificate whose CN is its name."""
        if password is None:
            request = rpc.AuthUserAddRequest(
                name=user, options=rpc.UserAddOptions(no_password=True)
            )
        else:
            request = rpc.AuthUserAddRequest(name=user, password=password)
        await self._auth(f"add user {user}", "UserAdd", request)

    async def grant_role(self, user: str, role: str) -> None:
        await self._auth(
            f"grant role {role} to {user}",
            "UserGrantRole",
            rpc.AuthUserGrantRoleRequest(user=user, role=role),
        )

    async def revoke_role(self, user: str, role: str) -> None:
        await self._auth(
            f"revoke role {role} from {user}",
            "UserRevokeRole",
            rpc.AuthUserRevokeRoleRequest(name=user, role=role),
        )

    async def close(self) -> None:
        await self._store.close()

    # -- internals -------------------------------------------------------------------------------

    async def _auth(self, what: str, method: str, request: Any) -> Any:
        """``method`` of etcd's Auth service, with the connection's token; the layer's errors."""

        async def op(client: aetcd.Client) -> Any:
            await client.connect()
            call: Callable[..., Awaitable[Any]] = getattr(client.auth_stub, method)
            return await call(request, timeout=self._timeout_s, metadata=client.metadata)

        return await self._store._call(what, op)
