"""The only code that speaks DNS: reads a view's records and sends RFC 2136 updates, each
signed with the view's TSIG key (which is also how the server picks the view).

Reads are ordinary queries for the names the controller manages (the service's A/AAAA, the
SRV, the TXT, then the A/AAAA of every SRV target below the service name), signed with the
view's key when it has one, else sent from the view's ``source`` address.  An update carries
every change of one view in one message, which the server applies atomically.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import dns.asyncquery
import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.tsig
import dns.update

from controlplane.dns.errors import DnsError, DnsFailed, DnsRefused, DnsUnavailable
from controlplane.settings.dns import DnsSettings
from policies import dns_plan
from policies.dns_plan import Change, Names, RecordSet

log = logging.getLogger(__name__)

_TSIG_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (dns.tsig.PeerBadSignature, "BADSIG: the server does not accept the key's secret"),
    (dns.tsig.PeerBadKey, "BADKEY: the server does not know the key name"),
    (dns.tsig.PeerBadTime, "BADTIME: the clocks differ by more than the TSIG fudge"),
    (dns.tsig.PeerBadTruncation, "BADTRUNC: the server rejected the truncated MAC"),
    (dns.tsig.BadSignature, "the server's answer does not verify with our key"),
)


def normalize(rrset: RecordSet) -> RecordSet:
    """The same RRset with its values in dnspython's canonical presentation form."""
    values = sorted(
        {dns.rdata.from_text(dns.rdataclass.IN, rrset.rdtype, v).to_text() for v in rrset.values}
    )
    return RecordSet(name=rrset.name.lower(), rdtype=rrset.rdtype, ttl_s=rrset.ttl_s,
                     values=tuple(values))  # fmt: skip


class Client:
    def __init__(self, settings: DnsSettings) -> None:
        self.settings = settings
        self.names = Names(service=settings.service, srv=settings.srv, txt=settings.txt)

    def _key(self, view: str) -> dns.tsig.Key | None:
        key = self.settings.key(view)
        if key is None:
            return None
        return dns.tsig.Key(key.name, key.secret.get_secret_value(), key.algorithm)

    # -- reading ---------------------------------------------------------------------------------

    async def read(self, view: str, *, targets: Iterable[str] = ()) -> list[RecordSet]:
        """What the server serves in ``view`` for the names the controller manages: the
        service's A/AAAA, the SRV, the TXT and the A/AAAA of ``targets`` (the region target
        names that are the controller's, ``ViewPlan.targets``); nothing else."""
        zone = self.settings.zone_of(view)
        service = dns_plan.absolute(self.names.service, zone)
        out: list[RecordSet] = []
        for name, rdtype in (
            (service, "A"),
            (service, "AAAA"),
            (dns_plan.absolute(self.names.srv, zone), "SRV"),
            (dns_plan.absolute(self.names.txt, zone), "TXT"),
        ):
            found = await self._query(view, name, rdtype)
            if found is not None:
                out.append(found)
        for target in sorted(set(targets)):
            for rdtype in ("A", "AAAA"):
                found = await self._query(view, target, rdtype)
                if found is not None:
                    out.append(found)
        return out

    async def _query(self, view: str, name: str, rdtype: str) -> RecordSet | None:
        query = dns.message.make_query(name, rdtype)
        key = self._key(view)
        if key is not None:
            query.use_tsig(key, keyname=key.name, algorithm=key.algorithm)
        source = self.settings.view(view).source
        try:
            response, _ = await dns.asyncquery.udp_with_fallback(
                query, self.settings.server, port=self.settings.port,
                timeout=self.settings.timeout_s, source=source if key is None else None,
            )  # fmt: skip
        except (dns.exception.DNSException, OSError) as exc:  # translated in one place
            raise _translate(view, f"query {name} {rdtype}", exc) from exc
        rcode = response.rcode()
        if rcode == dns.rcode.NXDOMAIN:
            return None
        if rcode != dns.rcode.NOERROR:
            raise _refusal(view, f"query {name} {rdtype}", rcode, zone=self.settings.zone_of(view))
        rrset = response.get_rrset(
            response.answer, dns.name.from_text(name), dns.rdataclass.IN,
            dns.rdatatype.from_text(rdtype),
        )  # fmt: skip
        if rrset is None:
            return None
        return RecordSet(
            name=name,
            rdtype=rdtype,  # type: ignore[arg-type]
            ttl_s=rrset.ttl,
            values=tuple(sorted(r.to_text() for r in rrset)),
        )

    # -- writing ---------------------------------------------------------------------------------

    async def update(self, view: str, changes: Sequence[Change]) -> None:
        """Send every change of ``view`` in one signed update; raise a ``DnsError`` unless the
        server answers NOERROR."""
        zone = self.settings.zone_of(view)
        key = self._key(view)
        message = dns.update.UpdateMessage(
            zone,
            keyring=key,
            keyname=key.name if key is not None else None,
            keyalgorithm=key.algorithm if key is not None else dns.tsig.HMAC_SHA256,
        )
        for change in changes:
            rrset = change.rrset
            if change.op == "delete":
                message.delete(rrset.name, rrset.rdtype)
            else:
                message.replace(rrset.name, rrset.ttl_s, rrset.rdtype, *rrset.values)
        source = self.settings.view(view).source
        try:
            response = await dns.asyncquery.tcp(
                message, self.settings.server, port=self.settings.port,
                timeout=self.settings.timeout_s, source=source if key is None else None,
            )  # fmt: skip
        except (dns.exception.DNSException, OSError) as exc:  # translated in one place
            raise _translate(view, "update", exc) from exc
        rcode = response.rcode()
        if rcode != dns.rcode.NOERROR:
            raise _refusal(view, "update", rcode, signed=key is not None)


def _refusal(
    view: str, what: str, rcode: dns.rcode.Rcode, *, signed: bool = True, zone: str | None = None
) -> DnsError:
    """``zone``: a read of that zone was refused (else an update was)."""
    text = dns.rcode.to_text(rcode)
    if zone is not None and rcode in (dns.rcode.REFUSED, dns.rcode.NOTAUTH):
        return DnsRefused(
            view, f"{what} {text} by the server: the view this key (or source address) selects "
            f"does not serve zone {zone}; check the view's zone and its match-clients "
            "(`meridian-controller dns bind-config` prints what the server needs)",
        )  # fmt: skip
    if rcode == dns.rcode.REFUSED:
        hint = (
            "the update-policy does not grant this key"
            if signed
            else "the update is unsigned: give the view a TSIG key (dns.tsig or views[].tsig)"
        )
        return DnsRefused(view, f"{what} REFUSED by the server: {hint}")
    if rcode == dns.rcode.NOTAUTH:
        return DnsRefused(
            view, f"{what} NOTAUTH: the server is not authoritative for the zone in this view, "
            "or does not accept the key",
        )  # fmt: skip
    return DnsFailed(view, f"{what} answered {text}")


def _translate(view: str, what: str, exc: dns.exception.DNSException | OSError) -> DnsError:
    for kind, text in _TSIG_ERRORS:
        if isinstance(exc, kind):
            return DnsRefused(view, f"{what} refused, TSIG {text}")
    if isinstance(exc, dns.exception.Timeout):
        return DnsUnavailable(view, f"{what}: no answer within the timeout (server down?)")
    if isinstance(exc, OSError):
        return DnsUnavailable(view, f"{what}: {exc.strerror or exc} (server down?)")
    return DnsFailed(view, f"{what}: {exc}")
