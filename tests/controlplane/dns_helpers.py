"""Shared by the DNS steering tests: settings for the BIND fixture, queries from a view's
client address, the stand-in regions' statuses."""

from __future__ import annotations

from typing import Any

import dns.asyncquery
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype

from controlplane.settings.dns import DnsSettings
from tests.support import BindServer, DnsView

EU_ADDRESS = "192.0.2.10"
US_ADDRESS = "198.51.100.20"
ENDPOINTS = {"eu-west": f"https://{EU_ADDRESS}", "us-east": f"https://{US_ADDRESS}:8443"}
GEO = {"eu-west": "eu", "us-east": "us"}
REGIONS: list[dict[str, Any]] = [
    {"id": "eu-west", "geo": "eu", "backups": ["us-east"]},
    {"id": "us-east", "geo": "us", "backups": ["eu-west"]},
]
API = "api.meridian.test."
SRV = "_https._tcp.api.meridian.test."
TXT = "_meridian.api.meridian.test."


def view_settings(view: DnsView, geo: str, *, secret: str | None = None) -> dict[str, Any]:
    key = view.key
    return {
        "name": view.name,
        "geo": geo,
        "tsig": {"name": key.name, "secret": secret or key.secret, "algorithm": key.algorithm},
        "match_clients": [view.source] if view.name != "default" else [],
    }


def dns_settings(bind: BindServer, **extra: Any) -> dict[str, Any]:
    """``[dns]`` for the fixture: geo-a (clients from 127.0.0.2) serves eu, default serves us."""
    views = extra.pop("views", None) or [
        view_settings(bind.view("geo-a"), "eu"),
        view_settings(bind.view("default"), "us"),
    ]
    return {
        "backend": "rfc2136",
        "server": bind.host,
        "port": bind.port,
        "zone": bind.zone,
        "views": views,
        "timeout_s": 0.5,
        "retry_initial_s": 0.1,
        "retry_max_s": 0.5,
        **extra,
    }


def parsed(bind: BindServer, **extra: Any) -> DnsSettings:
    return DnsSettings.model_validate(dns_settings(bind, **extra))


async def answer(bind: BindServer, source: str, name: str, rdtype: str) -> set[str]:
    """What a client at ``source`` is told for ``name``/``rdtype`` (rdata as text)."""
    query = dns.message.make_query(name, rdtype)
    response = await dns.asyncquery.udp(query, bind.host, port=bind.port, source=source, timeout=2)
    assert response.rcode() in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN), response
    rrset = response.get_rrset(
        response.answer,
        dns.name.from_text(name),
        dns.rdataclass.IN,
        dns.rdatatype.from_text(rdtype),
    )
    return set() if rrset is None else {r.to_text() for r in rrset}


async def serial(bind: BindServer, source: str) -> int:
    """The zone's SOA serial in the view of ``source``: every accepted update bumps it."""
    (soa,) = await answer(bind, source, bind.zone, "SOA")
    return int(soa.split()[2])


def srv_weights(values: set[str]) -> dict[str, tuple[int, int]]:
    """SRV rdata → region -> (priority, weight)."""
    out = {}
    for value in values:
        priority, weight, _port, target = value.split()
        out[target.split(".")[0]] = (int(priority), int(weight))
    return out
