"""TLS and authentication to etcd: which settings go together, the files they name, and the
credentials a connection is made with.

**TLS.**  ``https://`` members are dialled with ``grpc.ssl_channel_credentials``: the members'
certificates are verified against ``ca_file`` (never the system's store, never skipped), and
``cert_file``/``key_file``, when given, are the client certificate that etcd started with
``--client-cert-auth`` asks for.  With auth enabled, etcd takes the certificate's common name
(CN) as the user when a request carries no token.

**Users.**  ``user`` with ``password_file`` (or a ``password`` given as a secret) authenticates
as that user on every new connection; etcd answers with a token that the calls carry.  The
password is never logged nor shown in a repr.

**Files.**  :func:`check` says, naming the setting, what is wrong with a combination of settings
or a file (unreadable, no PEM CA, a key that is not the certificate's, an empty password file):
both shells' settings call it at start.  :func:`load` reads the files for a connection; the
client reads them again for each new connection, so a rotated certificate takes effect at the
next reconnect (a restart at the latest).

**Why a member refuses a client.**  gRPC reports a refused client certificate as a reset
connection, the same words as a member that is down.  :func:`probe` opens one TLS connection
to a member as gRPC would (the same CA, certificate and key, ALPN ``h2``) and says which it is:
the member's certificate does not verify, the member refused the client certificate with an
alert, or it closed the connection after the handshake, as etcd does with a certificate that is
revoked (``--client-crl-file``) or that it cannot verify.  It has no answer when the member
cannot be reached at all or speaks HTTP/2 back: then the trouble is not TLS.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from meridian_etcd import endpoints as endpoints_

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class Credentials:
    """What one connection is made with: channel credentials (``None``: plaintext) and the
    user and password to authenticate as (``None``: no token; a client certificate, if any,
    names the user)."""

    channel: grpc.ChannelCredentials | None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


def check(
    *,
    endpoints: list[str] | tuple[str, ...],
    ca_file: PathLike | None = None,
    cert_file: PathLike | None = None,
    key_file: PathLike | None = None,
    user: str | None = None,
    password_file: PathLike | None = None,
    password: str | None = None,
    prefix: str = "",
    files: bool = True,
) -> None:
    """``ValueError`` naming the setting (``prefix`` + the field name: ``etcd.ca_file``,
    ``region.etcd_ca_file``) when the settings do not go together or, with ``files``, when a
    file they name cannot be used."""
    name = {f: f"{prefix}{f}" for f in ("ca_file", "cert_file", "key_file", "user")}
    name["password_file"] = f"{prefix}password_file"
    endpoints_.parse_all(
        endpoints,
        tls={name["ca_file"]: ca_file, name["cert_file"]: cert_file, name["key_file"]: key_file},
        ca_setting=name["ca_file"],
    )
    if (cert_file is None) != (key_file is None):
        missing = name["key_file"] if key_file is None else name["cert_file"]
        raise ValueError(
            f"{name['cert_file']} and {name['key_file']} go together (the client certificate "
            f"and its private key): set {missing} too"
        )
    if password_file is not None and password is not None:
        raise ValueError(f"give {name['password_file']} or a password, not both")
    has_password = password_file is not None or password is not None
    if user is not None and not user.strip():
        raise ValueError(f"{name['user']} must not be empty")
    if user is not None and not has_password:
        raise ValueError(
            f"{name['user']} is set but {name['password_file']} is not: etcd authenticates a "
            "user by its password (for a client certificate, leave the user unset: etcd takes "
            "the certificate's CN)"
        )
    if user is None and has_password:
        raise ValueError(f"{name['password_file']} is set but {name['user']} is not")
    if files:
        if ca_file is not None:
            _ca(Path(ca_file), name["ca_file"])
        if cert_file is not None and key_file is not None:
            _pair(Path(cert_file), Path(key_file), name["cert_file"], name["key_file"])
        if password_file is not None:
            read_password(Path(password_file), name["password_file"])


def load(
    *,
    tls: bool,
    ca_file: PathLike | None = None,
    cert_file: PathLike | None = None,
    key_file: PathLike | None = None,
    user: str | None = None,
    password_file: PathLike | None = None,
    password: str | None = None,
) -> Credentials:
    """The credentials for one connection, read from the files now; ``ValueError`` naming the
    file when one cannot be read."""
    channel = None
    if tls:
        channel = grpc.ssl_channel_credentials(
            root_certificates=None if ca_file is None else _read(Path(ca_file), "ca_file"),
            private_key=None if key_file is None else _read(Path(key_file), "key_file"),
            certificate_chain=None if cert_file is None else _read(Path(cert_file), "cert_file"),
        )
    if password_file is not None:
        password = read_password(Path(password_file), "password_file")
    return Credentials(channel=channel, user=user, password=password if user else None)


def read_password(path: Path, setting: str) -> str:
    """The password in ``path``: its content less a trailing newline; never empty."""
    text = _read(path, setting).decode("utf-8", errors="strict")
    password = text.removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"{setting}: {path} is empty")
    return password


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from exc


def _ca(path: Path, setting: str) -> None:
    _read(path, setting)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise ValueError(
            f"{setting}: {path} holds no PEM CA certificate ({exc.reason or exc})"
        ) from exc


def _pair(cert: Path, key: Path, cert_setting: str, key_setting: str) -> None:
    _read(cert, cert_setting)
    _read(key, key_setting)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # an encrypted key gets an empty passphrase (and fails) rather than a prompt
        context.load_cert_chain(str(cert), str(key), password=lambda: b"")
    except ssl.SSLError as exc:
        raise ValueError(
            f"{key_setting}: {key} and {cert_setting}: {cert} are not a PEM certificate and "
            f"its unencrypted private key ({exc.reason or exc})"
        ) from exc


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def probe(
    host: str,
    port: int,
    *,
    ca_file: PathLike | None,
    cert_file: PathLike | None = None,
    key_file: PathLike | None = None,
    timeout_s: float = 3.0,
) -> str | None:
    """Why the member at ``host:port`` refuses a TLS client with these files, or ``None``: it
    cannot be reached (not TLS's fault) or answers HTTP/2 (TLS is fine).  The words name the
    settings' roles (``ca_file``, ``cert_file``), not the files' contents."""
    context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    if cert_file is not None and key_file is not None:
        try:
            context.load_cert_chain(str(cert_file), str(key_file), password=lambda: b"")
        except (OSError, ssl.SSLError) as exc:
            return f"cert_file and key_file do not load: {exc}"
    context.set_alpn_protocols(["h2"])
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            try:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=context, server_hostname=host
                )
            except ssl.SSLCertVerificationError as exc:
                return (
                    f"the member's certificate does not verify against ca_file: "
                    f"{exc.verify_message}"
                )
            except ssl.SSLError as exc:
                return f"the member refused the TLS handshake: {exc.reason or exc}"
            except OSError:
                return None  # refused, unreachable: the network or the member, not TLS
            writer.write(_H2_PREFACE)
            try:
                await writer.drain()
                head = await reader.read(9)
            except ssl.SSLError as exc:
                return f"the member refused the client certificate: {exc.reason or exc}"
            except OSError:
                head = b""
            if head:
                return None  # an HTTP/2 frame: TLS and the certificate are fine
            return (
                "the member closed the connection after the TLS handshake: it does not accept "
                "the client certificate in cert_file (expired, revoked, or not signed by a CA "
                "the member trusts)"
                if cert_file is not None
                else "the member closed the connection after the TLS handshake (does it want a "
                "client certificate? set cert_file and key_file)"
            )
    except TimeoutError:
        return None
    finally:
        if writer is not None:
            writer.close()
