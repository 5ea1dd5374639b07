"""etcd client URLs: the one parser both shells' settings and the client use.

``http://`` members are dialled in plaintext, ``https://`` members over TLS, never one for the
other: :func:`parse_all` refuses an ``https://`` URL without a CA file to verify the members by,
an ``http://`` URL when TLS files are given (they would be silently ignored), and a list that
mixes the two (one member would be plaintext).  Nothing is ever downgraded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORT = 2379


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One etcd member's client URL, e.g. ``http://10.0.0.1:2379`` or ``https://...``."""

    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.target}"

    @property
    def target(self) -> str:
        """``host:port`` as gRPC dials it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse(url: str) -> Endpoint:
    """``http://host[:port]`` or ``https://host[:port]`` (port 2379 by default); ``ValueError``
    saying what to write.  Whether an ``https://`` URL can be dialled depends on the TLS
    settings beside it: :func:`parse_all` checks that."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"etcd endpoint {url!r} is not a URL ({exc}); write http://host:2379"
        ) from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"etcd endpoint {url!r} must look like http://host:2379 (or https://host:2379)"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"etcd endpoint {url!r} must be http://host:port, with no path")
    return Endpoint(host=parts.hostname, port=port or DEFAULT_PORT, tls=parts.scheme == "https")


def parse_all(
    urls: Sequence[str],
    *,
    tls: Mapping[str, object | None] | None = None,
    ca_setting: str = "ca_file",
) -> tuple[Endpoint, ...]:
    """Every URL parsed; at least one, all of one scheme, and that scheme consistent with the
    TLS settings.

    ``tls``: the TLS settings by the names the caller's settings give them (for the messages),
    ``None`` where not set, e.g. ``{"etcd.ca_file": path, "etcd.cert_file": None, ...}``;
    ``ca_setting`` names the CA file among them.  Without ``tls`` (a client whose settings were
    checked), only the URLs and the one scheme are."""
    if not urls:
        raise ValueError("at least one etcd endpoint is required, e.g. http://127.0.0.1:2379")
    parsed = tuple(parse(u) for u in urls)
    if len({e.tls for e in parsed}) > 1:
        raise ValueError(
            f"etcd endpoints mix http:// and https:// ({', '.join(e.url for e in parsed)}): "
            "every member must be reached the same way; Meridian never falls back to plaintext"
        )
    if tls is None:  # the caller checked the TLS settings already
        return parsed
    given = [name for name, value in tls.items() if value is not None]
    if parsed[0].tls and tls.get(ca_setting) is None:
        raise ValueError(
            f"etcd endpoint {parsed[0].url!r} is https:// but TLS to etcd is not set up: set "
            f"{ca_setting} to the CA that signed the members' certificates (and a client "
            "certificate and key where etcd runs with --client-cert-auth); Meridian never "
            "falls back to plaintext"
        )
    if not parsed[0].tls and given:
        raise ValueError(
            f"etcd endpoint {parsed[0].url!r} is plaintext http:// but {', '.join(given)} "
            f"{'is' if len(given) == 1 else 'are'} set: write https:// URLs to use TLS "
            "(TLS settings are never ignored)"
        )
    return parsed
