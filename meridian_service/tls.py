"""TLS for our servers: one certificate and key, reloaded on SIGHUP without a restart.

Both daemons serve HTTPS through :class:`ServerTls`: the agent's listener
(``server.tls_cert_file``, ``server.tls_key_file``) and the controller's admin port
(``api.tls``).  ``ServerTls(cert, key).context`` is the ``ssl.SSLContext`` a site is started
with; :meth:`ServerTls.reload` reads the pair from the same files again.

**How a reload takes effect.**  The context a site listens with is never changed after start;
it carries an SNI callback (OpenSSL calls it for every ClientHello, with ``None`` as the name
when the client sent none, as for an IP address) that hands each new handshake the newest good
context.  A reload builds a whole new context from the files and, only when that succeeds,
makes it the newest.  So new handshakes see the new certificate, connections already open keep
the one they were made with (nothing is dropped), and a bad new pair (a key that does not match
the certificate, a half-written file, no file) changes nothing: the old pair stays in force and
the log says why.  Loading a new pair *into* the live context (``load_cert_chain`` on it) would
be the other way, but a failed load leaves that context with a certificate and no key, and every
later handshake fails (OpenSSL 3.0: ``no shared cipher``) — a typo would take the listener down.

:func:`reload_all` reloads every live :class:`ServerTls` of the process:
``meridian_service.serving.serve`` calls it on SIGHUP.
"""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

_PEM_CERT = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL
)
_LIVE: weakref.WeakSet[ServerTls] = weakref.WeakSet()


class TlsError(ValueError):
    """A certificate or key that cannot be used; the message names the setting and the file."""


class ServerTls:
    """A server's certificate and key from two PEM files, reloadable (see the module).

    ``cert_setting`` and ``key_setting`` name the settings the files came from, for messages
    (``server.tls_cert_file``; ``api.tls.cert_file``).  Raises :class:`TlsError` when the pair
    cannot be loaded at start.
    """

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        *,
        cert_setting: str = "cert_file",
        key_setting: str = "key_file",
    ) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.cert_setting = cert_setting
        self.key_setting = key_setting
        self._current, self.fingerprint = self._load()
        self._listening = self._current
        self._listening.sni_callback = self._select
        self.reloads = 0
        self.failed_reloads = 0
        _LIVE.add(self)

    @property
    def context(self) -> ssl.SSLContext:
        """The context to start a site with (it stays the same across reloads)."""
        return self._listening

    def reload(self) -> bool:
        """Read the certificate and key again; new handshakes use them.  A pair that cannot be
        loaded keeps the one in force, logs why and returns False."""
        try:
            context, fingerprint = self._load()
        except TlsError as exc:
            self.failed_reloads += 1
            log.warning(
                "TLS certificate not reloaded, the one in force stays (sha256 %s): %s",
                self.fingerprint, exc,
            )  # fmt: skip
            return False
        previous, self.fingerprint = self.fingerprint, fingerprint
        self._current = context
        self.reloads += 1
        log.info(
            "TLS certificate reloaded cert=%s sha256=%s%s",
            self.cert_file, fingerprint, " (unchanged)" if fingerprint == previous else "",
        )  # fmt: skip
        return True

    def _load(self) -> tuple[ssl.SSLContext, str]:
        try:
            pem = self.cert_file.read_bytes()
        except OSError as exc:
            raise TlsError(
                f"{self.cert_setting}: cannot read {self.cert_file}: {exc.strerror}"
            ) from None
        first = _PEM_CERT.search(pem)
        if first is None:
            raise TlsError(f"{self.cert_setting}: {self.cert_file} holds no PEM certificate")
        try:
            der = ssl.PEM_cert_to_DER_cert(first.group().decode("ascii"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise TlsError(f"{self.cert_setting}: {self.cert_file}: not PEM ({exc})") from None
        if not self.key_file.is_file():
            raise TlsError(f"{self.key_setting}: {self.key_file} does not exist")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        except ssl.SSLError as exc:
            raise TlsError(
                f"{self.cert_setting}, {self.key_setting}: cannot load {self.cert_file} with "
                f"{self.key_file}: {exc.reason or exc}"
            ) from None
        except OSError as exc:
            raise TlsError(
                f"{self.cert_setting}, {self.key_setting}: cannot read {self.cert_file} or "
                f"{self.key_file}: {exc.strerror}"
            ) from None
        return context, hashlib.sha256(der).hexdigest()

    def _select(
        self, connection: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        """Every ClientHello: the newest good context serves this handshake."""
        current = self._current
        if current is not self._listening:
            connection.context = current


def reload_all() -> int:
    """Reload every live :class:`ServerTls` of this process (SIGHUP); how many were loaded."""
    return sum(1 for tls in list(_LIVE) if tls.reload())


def live() -> int:
    """How many :class:`ServerTls` this process holds (whether SIGHUP has anything to do)."""
    return len(_LIVE)


def client_context(ca_file: Path | None) -> ssl.SSLContext:
    """A client context that verifies the server's certificate (and name) against ``ca_file``,
    or against the system's CAs when it is None."""
    if ca_file is None:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=str(ca_file))
