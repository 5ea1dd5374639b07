"""Settings of the admin API (``ControllerSettings.api``): where it listens, TLS, tokens.

Tokens are never stored: only the SHA-256 of each (hex).  Tokens are long random strings
(``python -m controlplane.api.tokens new``), so a fast hash is enough; comparison is constant
time (``hmac.compare_digest``).

.. code-block:: toml

    [api]
    port = 8091                 # unset: this replica serves no admin API
    [api.tls]
    cert_file = "/etc/meridian/admin.crt"
    key_file = "/etc/meridian/admin.key"
    [[api.tokens]]
    name = "alice"
    role = "operator"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meridian_service import hygiene

Role = Literal["viewer", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "operator", "admin")  # each can do all the ones before
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenEntry(_Group):
    name: str = Field(min_length=1, max_length=64, description="who holds it (written to audit)")
    role: Role = Field(description="viewer reads; operator also acts; admin also sets policies")
    sha256: str = Field(description="hex SHA-256 of the token; the token itself is never stored")

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        value = value.strip().lower()
        if not _HEX64.match(value):
            raise ValueError("must be 64 hex digits: the SHA-256 of the token, not the token")
        return value


class TlsSettings(_Group):
    cert_file: Path = Field(description="PEM certificate (chain) the admin API presents")
    key_file: Path = Field(description="PEM private key of cert_file")
    ca_file: Path | None = Field(
        None,
        description="CA bundle a replica trusts when forwarding a write to the leader; "
        "default: cert_file itself (one self-signed certificate shared by the replicas)",
    )

    @model_validator(mode="after")
    def _exist(self) -> TlsSettings:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path} does not exist")
        return self


class ConnectionSettings(_Group):
    """Connection hygiene of one of the controller's ports (``[server]``, the read port, and
    ``[api]``, the admin port), enforced by ``meridian_service.hygiene``.  Their clients are
    operators, meridianctl, dashboards, health checkers and the other replicas: few
    connections, small bodies (64 KiB at most), so the limits are tighter than the agent's."""

    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's line and headers must arrive within this many seconds of the "
        "connection's accept (or of the request's first byte on a kept-alive connection), else "
        "408 and the connection is closed; default 10",
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the whole request body must arrive within this many seconds of its headers "
        "(a deadline, not a gap between chunks), else 408 and the connection is closed; "
        "default 10 (bodies are at most 64 KiB)",
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="an idle kept-alive connection is closed this many seconds after its last "
        "response; default 75 (longer than a balancer's usual 60 s idle timeout)",
    )
    max_requests_per_connection: int = Field(
        1000,
        ge=0,
        description="the response to a connection's request number N says Connection: close; "
        "0: no limit; default 1000",
    )
    max_connections_per_ip: int = Field(
        64,
        ge=0,
        description="connections one client address may hold at once; more are closed at once; "
        "0: no cap; default 64 (a health checker holds one, meridianctl one per command)",
    )

    def limits(self) -> hygiene.ConnectionLimits:
        """What ``meridian_service.hygiene`` enforces on this port."""
        return hygiene.ConnectionLimits(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            max_requests_per_connection=self.max_requests_per_connection,
            max_connections_per_ip=self.max_connections_per_ip,
        )


class ApiSettings(ConnectionSettings):
    host: str = Field("127.0.0.1", description="address of the admin API")
    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="port of the admin API (8091 is customary); 0 picks one; unset: not served",
    )
    advertise_url: str | None = Field(
        None,
        description="URL other replicas use to forward writes here; default "
        "http(s)://host:port as bound",
    )
    tls: TlsSettings | None = Field(None, description="serve HTTPS with this certificate")
    tokens: list[TokenEntry] = Field(
        default_factory=list, description="bearer tokens, as hashes; none: every call is 401"
    )
    idempotency_ttl_s: float = Field(
        86400.0, gt=0, description="how long an Idempotency-Key's answer is kept, seconds"
    )
    audit_retention: int = Field(10000, ge=100, description="audit entries kept in etcd")
    forward_timeout_s: float = Field(
        15.0, gt=0, description="timeout of a write forwarded to the leader, seconds"
    )

    @model_validator(mode="after")
    def _advertised_scheme(self) -> ApiSettings:
        url = (self.advertise_url or "").strip().lower()
        if self.tls is not None and url and not url.startswith("https://"):
            raise ValueError(
                f"api.advertise_url {self.advertise_url!r} is not https but api.tls is set: the "
                "replicas would forward bearer tokens to it in the clear (a replica with TLS "
                "refuses to); advertise the https URL"
            )
        return self

    @field_validator("tokens")
    @classmethod
    def _unique(cls, value: list[TokenEntry]) -> list[TokenEntry]:
        names = [t.name for t in value]
        if len(set(names)) != len(names):
            raise ValueError("token names must be unique (they name the caller in audit)")
        hashes = [t.sha256 for t in value]
        if len(set(hashes)) != len(hashes):
            raise ValueError("two tokens have the same hash")
        return value
