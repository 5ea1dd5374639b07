"""Smoke test of the BIND9 fixture: TSIG-signed RFC 2136 updates to each view, read back."""

from __future__ import annotations

import base64
import secrets

import dns.asyncquery
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.tsig
import dns.update
import pytest

from tests.support import BindServer, DnsView, TsigKey

NAME = "api.meridian.test."


async def update_a(
    bind: BindServer, *, key: TsigKey | None, address: str, source: str | None = None
) -> dns.message.Message:
    """Replace NAME's A record; the key (if any) picks the view."""
    update = dns.update.UpdateMessage(bind.zone, keyring=None if key is None else key.tsig_key())
    update.replace(NAME, 30, dns.rdatatype.A, address)
    return await dns.asyncquery.tcp(update, bind.host, port=bind.port, source=source, timeout=5)


async def query_a(bind: BindServer, view: DnsView) -> set[tuple[int, str]]:
    """NAME's A records as (ttl, address) seen by a client of `view`."""
    query = dns.message.make_query(NAME, dns.rdatatype.A)
    response = await dns.asyncquery.udp(
        query, bind.host, port=bind.port, source=view.source, timeout=5
    )
    rrset = response.get_rrset(
        response.answer, dns.name.from_text(NAME), dns.rdataclass.IN, dns.rdatatype.A
    )
    return set() if rrset is None else {(rrset.ttl, rdata.to_text()) for rdata in rrset}


async def test_each_view_serves_its_own_updates(bind: BindServer) -> None:
    geo_a, default = bind.view("geo-a"), bind.view("default")

    # Each update comes from the other view's client address: the key, not the source, counts.
    to_geo_a = await update_a(bind, key=geo_a.key, address="192.0.2.10", source=default.source)
    to_default = await update_a(bind, key=default.key, address="198.51.100.20", source=geo_a.source)

    assert to_geo_a.rcode() == dns.rcode.NOERROR
    assert to_default.rcode() == dns.rcode.NOERROR
    assert await query_a(bind, geo_a) == {(30, "192.0.2.10")}
    assert await query_a(bind, default) == {(30, "198.51.100.20")}


async def test_unsigned_update_is_refused(bind: BindServer) -> None:
    response = await update_a(bind, key=None, address="192.0.2.66")

    assert response.rcode() == dns.rcode.REFUSED
    for view in bind.views:
        assert await query_a(bind, view) == set()


async def test_update_with_wrong_secret_fails_tsig(bind: BindServer) -> None:
    real = bind.view("geo-a").key
    forged = TsigKey(name=real.name, secret=base64.b64encode(secrets.token_bytes(32)).decode())

    with pytest.raises(dns.tsig.PeerBadSignature):
        await update_a(bind, key=forged, address="192.0.2.66")

    for view in bind.views:
        assert await query_a(bind, view) == set()
