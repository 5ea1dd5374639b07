"""Bearer tokens and roles.

A token is checked by hashing it (SHA-256) and comparing the digest with every configured hash
in constant time (``hmac.compare_digest``, all of them, no early exit).  Roles are ordered:
``viewer`` < ``operator`` < ``admin``; each may do what the ones before it may.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from aiohttp import web

from controlplane.api.problems import Forbidden, Unauthenticated
from controlplane.settings.api import ROLES, Role, TokenEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    name: str
    role: Role


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def identify(request: web.Request, tokens: list[TokenEntry]) -> Caller:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise Unauthenticated(
            "no bearer token",
            fix="send 'Authorization: Bearer <token>' (meridianctl: set MERIDIAN_TOKEN)",
        )
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated(
            "the Authorization header is not 'Bearer <token>'",
            fix="send 'Authorization: Bearer <token>'",
        )
    presented = digest(token.strip()).encode()
    found: TokenEntry | None = None
    for entry in tokens:  # compare against every hash: the time does not tell which matched
        if hmac.compare_digest(presented, entry.sha256.encode()):
            found = entry
    if found is None:
        raise Unauthenticated(
            "this token is not valid here",
            fix="check MERIDIAN_TOKEN; ask an admin for a token of this controller",
        )
    return Caller(name=found.name, role=found.role)


def require(caller: Caller, role: Role, what: str) -> None:
    if ROLES.index(caller.role) < ROLES.index(role):
        raise Forbidden(
            f"{caller.name} has role {caller.role}; {what} needs role {role}",
            fix=f"use a token with role {role} or higher, or ask someone who has one",
        )
