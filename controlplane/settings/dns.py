"""``[dns]`` of the controller's settings: where the authoritative server is, its views and
keys, and what to call the records.  ``backend = "off"`` (the default) leaves DNS alone.

```toml
[dns]
backend = "rfc2136"             # rfc2136 | dry-run | off
server = "10.0.0.53"
port = 53
zone = "meridian.example."      # the zone of every view that does not name its own
ttl_s = 30

[dns.tsig]                      # shared: each view's key is "<name>-<view>" with this secret
name = "meridian"
secret = "base64..."

[[dns.views]]                   # in BIND's match order; the last one usually matches any
name = "eu"
geo = "eu"
match_clients = ["geoip country DE", "geoip country FR"]

[[dns.views]]
name = "default"
geo = "us"
```
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

Backend = Literal["rfc2136", "dry-run", "off"]
Algorithm = Literal["hmac-sha256", "hmac-sha384", "hmac-sha512", "hmac-sha224"]
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_VIEW = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_name(value: str, *, absolute: bool) -> str:
    text = value.strip().lower()
    if absolute and not text.endswith("."):
        text += "."
    labels = text.rstrip(".").split(".")
    if not text.rstrip(".") or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{value!r} is not a DNS name (labels of letters, digits, - and _)")
    return text


class TsigSettings(_Group):
    name: str = Field(description="TSIG key name as the DNS server knows it")
    secret: SecretStr = Field(description="the key's secret, base64 (never logged)")
    algorithm: Algorithm = Field("hmac-sha256", description="TSIG algorithm")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value, absolute=False)

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: SecretStr) -> SecretStr:
        try:
            raw = base64.b64decode(value.get_secret_value(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("the TSIG secret must be base64") from exc
        if len(raw) < 16:
            raise ValueError("the TSIG secret is too short: use at least 16 random bytes")
        return value


class DnsViewSettings(_Group):
    name: str = Field(description="the view's name in the DNS server (BIND `view`)")
    geo: str = Field(description="the geography whose answer this view serves")
    zone: str | None = Field(None, description="this view's zone; default dns.zone")
    tsig: TsigSettings | None = Field(
        None, description="this view's key; default the shared dns.tsig as <name>-<view>"
    )
    match_clients: list[str] = Field(
        default_factory=list,
        description="BIND match-clients elements for bind-config (addresses, prefixes, "
        "`geoip country DE`); empty in the last view: any",
    )
    source: str | None = Field(
        None, description="source address for reading the view without a key (tests: 127.0.0.2)"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _VIEW.match(value):
            raise ValueError(f"view name {value!r}: letters, digits, '.', '_' and '-'")
        return value

    @field_validator("zone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        return None if value is None else _check_name(value, absolute=True)

    @field_validator("source")
    @classmethod
    def _source(cls, value: str | None) -> str | None:
        if value is not None:
            ipaddress.ip_address(value)
        return value


class DnsSettings(_Group):
    backend: Backend = Field(
        "off", description="rfc2136: send updates; dry-run: log the difference; off: no DNS"
    )
    server: str = Field("127.0.0.1", description="address of the authoritative server")
    port: int = Field(53, ge=1, le=65535, description="its DNS port")
    zone: str = Field("meridian.example.", description="zone of every view without its own")
    views: list[DnsViewSettings] = Field(
        default_factory=list, description="one view per geography, in the server's match order"
    )
    tsig: TsigSettings | None = Field(
        None, description="shared key: each view uses <name>-<view> with this secret"
    )
    ttl_s: int = Field(30, ge=0, le=86400, description="TTL of every record, seconds")
    service: str = Field("api", description="name of the A/AAAA records, relative to the zone")
    srv: str = Field("_https._tcp.api", description="name of the SRV records, relative")
    txt: str = Field("_meridian.api", description="name of the generation TXT record, relative")
    timeout_s: float = Field(2.0, gt=0, description="timeout of one DNS query or update, s")
    retry_initial_s: float = Field(0.5, gt=0, description="first retry delay after a failure")
    retry_max_s: float = Field(30.0, gt=0, description="longest retry delay (doubling, jitter)")

    @field_validator("server")
    @classmethod
    def _server(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise ValueError(f"{value!r}: the DNS server must be an IP address") from exc
        return value

    @field_validator("zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        return _check_name(value, absolute=True)

    @field_validator("service", "srv", "txt")
    @classmethod
    def _relative(cls, value: str) -> str:
        if value.endswith("."):
            raise ValueError(f"{value!r}: give the name relative to the zone (no trailing dot)")
        return _check_name(value, absolute=False)

    @model_validator(mode="after")
    def _views(self) -> DnsSettings:
        seen: dict[str, int] = {}
        keys: dict[str, str] = {}
        for i, view in enumerate(self.views):
            if view.name in seen:
                raise ValueError(f"views[{i}].name: duplicate view {view.name!r}")
            seen[view.name] = i
            key = self.key(view.name)
            if key is not None:
                if key.name in keys:
                    raise ValueError(
                        f"views[{i}].tsig: key {key.name!r} is also {keys[key.name]!r}'s; the "
                        "server picks a view by its key, so each view needs its own key name"
                    )
                keys[key.name] = view.name
        if self.backend != "off" and not self.views:
            raise ValueError(f"views: backend {self.backend!r} needs at least one view")
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError("retry_max_s: must be >= retry_initial_s")
        return self

    def view(self, name: str) -> DnsViewSettings:
        for view in self.views:
            if view.name == name:
                return view
        raise KeyError(name)

    def zone_of(self, view: str) -> str:
        return self.view(view).zone or self.zone

    def key(self, view: str) -> TsigSettings | None:
        """The view's own key, else the shared key named ``<shared>-<view>``, else None."""
        own = self.view(view).tsig
        if own is not None or self.tsig is None:
            return own
        name = _check_name(f"{self.tsig.name}-{view}", absolute=False)
        return TsigSettings(name=name, secret=self.tsig.secret, algorithm=self.tsig.algorithm)

    @property
    def address(self) -> str:
        host = f"[{self.server}]" if ":" in self.server else self.server
        return f"{host}:{self.port}"
