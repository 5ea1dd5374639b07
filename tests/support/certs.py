"""Certificates for TLS tests, made with Debian's ``openssl`` in a test's directory.

``ca = CertAuthority.create(tmp_path)`` makes a CA; ``ca.issue("agent", serial=1001)`` a server
certificate for 127.0.0.1 signed by it (``.crt`` and ``.key``), each with the serial given so a
test can tell which one a handshake saw (:func:`serial` of ``getpeercert()``).
Keys are P-256: quick to make.
"""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True, slots=True)
class Pair:
    cert: Path
    key: Path
    serial: int


@dataclass(frozen=True, slots=True)
class CertAuthority:
    cert: Path
    key: Path
    directory: Path

    @classmethod
    def create(cls, directory: Path, name: str = "test-ca") -> CertAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        _openssl(
            "req", "-x509", *_EC, "-days", "1", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", str(key), "-out", str(cert),
        )  # fmt: skip
        return cls(cert=cert, key=key, directory=directory)

    def issue(self, name: str, *, serial: int, host: str = "127.0.0.1") -> Pair:
        """A server certificate for ``host`` (an IP address) and its key: ``<name>.crt/.key``."""
        cert, key = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        csr, ext = self.directory / f"{name}.csr", self.directory / f"{name}.ext"
        ext.write_text(
            f"subjectAltName=IP:{host}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        )
        _openssl("req", "-new", *_EC, "-subj", f"/CN={host}", "-keyout", str(key), "-out", str(csr))
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-set_serial", str(serial), "-days", "1", "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        return Pair(cert=cert, key=key, serial=serial)

    def client(self) -> ssl.SSLContext:
        """A client context that trusts this CA only."""
        return ssl.create_default_context(cafile=str(self.cert))


def serial(peercert: object) -> int:
    """The serial number of a certificate as ``getpeercert()`` gives it (a hex string)."""
    assert isinstance(peercert, dict), peercert
    return int(peercert["serialNumber"], 16)
