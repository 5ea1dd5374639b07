"""etcd client URLs: the one parser both shells' settings and the client use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORT = 2379


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One etcd member's client URL, e.g. ``http://10.0.0.1:2379``."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def target(self) -> str:
        """``host:port`` as gRPC dials it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse(url: str) -> Endpoint:
    """``http://host[:port]`` (port 2379 by default); ``ValueError`` saying what to write.

    ``https://`` is refused rather than dialled in plaintext: this layer does not speak TLS to
    etcd yet."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"etcd endpoint {url!r} is not a URL ({exc}); write http://host:2379"
        ) from exc
    if parts.scheme == "https":
        raise ValueError(
            f"etcd endpoint {url!r}: TLS to etcd is not supported yet, and Meridian never "
            "falls back to plaintext; use an http:// URL on a trusted network"
        )
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"etcd endpoint {url!r} must look like http://host:2379")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"etcd endpoint {url!r} must be http://host:port, with no path")
    return Endpoint(host=parts.hostname, port=port or DEFAULT_PORT)


def parse_all(urls: Sequence[str]) -> tuple[Endpoint, ...]:
    """Every URL parsed; at least one."""
    if not urls:
        raise ValueError("at least one etcd endpoint is required, e.g. http://127.0.0.1:2379")
    return tuple(parse(u) for u in urls)
