"""A real single-member etcd on loopback, for tests.

    with start_etcd(tmp_dir) as etcd:
        async with aetcd.Client(host=etcd.host, port=etcd.port) as client: ...

The member listens for clients and peers on free 127.0.0.1 ports, keeps its data in
`tmp_dir`, and is ready when `/health` answers `{"health": "true"}`. `wipe()` deletes every
key through the v3 JSON gateway, so a shared server can hand each test an empty keyspace
without needing an event loop.

    certs = make_certs(tmp_dir / "pki", clients=["agent-eu-west", "meridian-controller"])
    with start_etcd_tls(tmp_dir, certs) as etcd:   # https://, --client-cert-auth
        store = client(etcd.url, **certs.access("agent-eu-west"))

`make_certs` makes a CA, the member's certificate (SAN 127.0.0.1) and client certificates by
CN with Debian's `openssl`, the commands docs/security.md#etcd-tls-users-and-roles gives.
`start_etcd(..., extra_args=["--auth-token-ttl=2"])` passes etcd more flags.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import meridian_etcd
from tests.support.ports import free_port
from tests.support.process import ServerProcess, find_binary, serve

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
# Loopback never goes through the HTTP proxy that the environment may name.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdCerts:
    """A CA, the member's certificate and key, and client certificates by CN, in `directory`."""

    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    clients: Mapping[str, tuple[Path, Path]] = field(default_factory=dict)

    def cert(self, cn: str) -> Path:
        return self.clients[cn][0]

    def key(self, cn: str) -> Path:
        return self.clients[cn][1]

    def access(self, cn: str | None = None) -> dict[str, Any]:
        """`ClientConfig` arguments: the CA, and the client certificate of `cn` if given."""
        out: dict[str, Any] = {"ca_file": self.ca}
        if cn is not None:
            out |= {"cert_file": self.cert(cn), "key_file": self.key(cn)}
        return out

    def context(self, cn: str) -> ssl.SSLContext:
        """An HTTPS client context trusting the CA and presenting `cn`'s certificate."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.cert(cn)), str(self.key(cn)))
        return context


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=cwd)


def make_certs(
    directory: Path, *, clients: Sequence[str], host: str = "127.0.0.1", days: int = 1
) -> EtcdCerts:
    """A CA (`ca.crt`), the member's certificate for `host` (`member.crt`: server and client
    use, as etcd's gateway dials the member with it) and one client certificate per CN
    (`<cn>.crt`), each with its key: P-256, quick to make."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", *_EC, "-days", str(days), "-subj", "/CN=meridian-etcd-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", "ca.key", "-out", "ca.crt", cwd=directory,
    )  # fmt: skip
    (directory / "member.ext").write_text(
        f"subjectAltName=IP:{host}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    (directory / "client.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=clientAuth\n"
    )
    issued: dict[str, tuple[Path, Path]] = {}
    for name, cn, ext in [("member", "etcd-member", "member.ext"),
                          *((c, c, "client.ext") for c in clients)]:  # fmt: skip
        _openssl("req", "-new", *_EC, "-subj", f"/CN={cn}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=directory)  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", str(days), "-extfile", ext, "-out", f"{name}.crt",
            cwd=directory,
        )  # fmt: skip
        issued[name] = (directory / f"{name}.crt", directory / f"{name}.key")
    member = issued.pop("member")
    return EtcdCerts(
        directory=directory,
        ca=directory / "ca.crt",
        server_cert=member[0],
        server_key=member[1],
        clients=issued,
    )


def revoke(certs: EtcdCerts, *cns: str) -> Path:
    """A CRL, signed by the CA, that revokes the client certificates of ``cns``: the file
    etcd's ``--client-crl-file`` takes (``openssl ca``, as a small CA would do it)."""
    directory = certs.directory
    (directory / "ca.cnf").write_text(
        "[ca]\ndefault_ca = meridian\n[meridian]\ndatabase = index.txt\n"
        "crlnumber = crlnumber\ndefault_md = sha256\ndefault_crl_days = 1\n"
        "certificate = ca.crt\nprivate_key = ca.key\n"
    )
    (directory / "index.txt").touch()
    if not (directory / "crlnumber").exists():
        (directory / "crlnumber").write_text("01\n")
    for cn in cns:
        _openssl("ca", "-config", "ca.cnf", "-revoke", certs.cert(cn).name, cwd=directory)
    _openssl("ca", "-config", "ca.cnf", "-gencrl", "-out", "crl.pem", cwd=directory)
    return directory / "crl.pem"


def expired(certs: EtcdCerts, cn: str) -> tuple[Path, Path]:
    """A client certificate for ``cn`` from the CA that expired on 2 January 2025, and its key
    (``openssl ca -startdate/-enddate``: ``x509 -days`` cannot date one in the past)."""
    directory = certs.directory
    (directory / "newcerts").mkdir(exist_ok=True)
    (directory / "index.txt").touch()
    (directory / "expired.cnf").write_text(
        "[ca]\ndefault_ca = meridian\n[meridian]\ndatabase = index.txt\n"
        "new_certs_dir = newcerts\nserial = expired.srl\ndefault_md = sha256\n"
        "certificate = ca.crt\nprivate_key = ca.key\npolicy = any\n[any]\n"
        "commonName = supplied\n"
    )
    (directory / "expired.srl").write_text(uuid.uuid4().hex + "\n")
    name = f"{cn}-expired"
    _openssl("req", "-new", *_EC, "-subj", f"/CN={cn}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)  # fmt: skip
    _openssl("ca", "-batch", "-config", "expired.cnf", "-startdate", "20250101000000Z",
             "-enddate", "20250102000000Z", "-extfile", "client.ext", "-in", f"{name}.csr",
             "-out", f"{name}.crt", cwd=directory)  # fmt: skip
    return directory / f"{name}.crt", directory / f"{name}.key"


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdServer:
    """Where a running test etcd listens. `url` is the client URL (`http://host:port`, or
    `https://` with `certs`: then `/health` is asked with the client certificate `health_cn`)."""

    host: str
    port: int
    peer_port: int
    name: str
    data_dir: Path
    process: ServerProcess
    certs: EtcdCerts | None = None
    health_cn: str | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.certs else 'http'}://{self.host}:{self.port}"

    def _open(self, request: str | urllib.request.Request, timeout: float) -> Any:
        if self.certs is None:
            return _HTTP.open(request, timeout=timeout)
        assert self.health_cn is not None, "a TLS etcd needs a client certificate for /health"
        https = urllib.request.HTTPSHandler(context=self.certs.context(self.health_cn))
        return urllib.request.build_opener(urllib.request.ProxyHandler({}), https).open(
            request, timeout=timeout
        )

    def healthy(self) -> bool:
        try:
            with self._open(f"{self.url}/health", timeout=1.0) as response:
                body = json.loads(response.read())
        except (OSError, ValueError):
            return False
        return bool(body.get("health") == "true")

    def wipe(self) -> int:
        """Delete every key; return how many were deleted. Leases are left alone."""
        everything = base64.b64encode(b"\0").decode()
        request = urllib.request.Request(
            f"{self.url}/v3/kv/deleterange",
            data=json.dumps({"key": everything, "range_end": everything}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with self._open(request, timeout=5.0) as response:
            body = json.loads(response.read())
        return int(body.get("deleted", 0))


@contextmanager
def start_etcd(
    tmp_dir: Path,
    *,
    certs: EtcdCerts | None = None,
    health_cn: str | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[EtcdServer]:
    """Start etcd in a new directory under `tmp_dir`, wait until healthy, stop it on exit.

    With `certs`, it serves clients over TLS only (https:// URLs, its certificate, the CA)
    and asks for client certificates (`--client-cert-auth`); `/health` is then asked with
    `health_cn`'s. `extra_args` go to etcd as they are (`--auth-token-ttl=2`).

    The data directory (over 100 MB: etcd preallocates its WAL) is deleted after the stop;
    the log, etcd.log, stays next to it.
    """
    binary = find_binary("etcd")
    launched: list[EtcdServer] = []

    def launch() -> EtcdServer:
        work_dir = Path(tempfile.mkdtemp(prefix="etcd-", dir=tmp_dir))
        launched.append(
            _launch(binary, work_dir, certs=certs, health_cn=health_cn, extra_args=extra_args)
        )
        return launched[-1]

    try:
        with serve(launch, _wait_ready) as server:
            yield server
    finally:
        for each in launched:  # every attempt, stopped by now
            shutil.rmtree(each.data_dir, ignore_errors=True)


@contextmanager
def start_etcd_tls(
    tmp_dir: Path, certs: EtcdCerts, *, health_cn: str, extra_args: Sequence[str] = ()
) -> Iterator[EtcdServer]:
    """`start_etcd` over TLS with client certificates required: see there."""
    with start_etcd(tmp_dir, certs=certs, health_cn=health_cn, extra_args=extra_args) as server:
        yield server


def _launch(
    binary: str,
    work_dir: Path,
    *,
    certs: EtcdCerts | None = None,
    health_cn: str | None = None,
    extra_args: Sequence[str] = (),
) -> EtcdServer:
    data_dir = work_dir / "data"
    port = free_port()
    peer_port = free_port()
    while peer_port == port:
        peer_port = free_port()
    name = f"meridian-test-{uuid.uuid4().hex[:8]}"
    client_url = f"{'https' if certs else 'http'}://{HOST}:{port}"
    peer_url = f"http://{HOST}:{peer_port}"
    argv = [
        binary,
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={name}={peer_url}",
        f"--initial-cluster-token={name}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=warn",
    ]
    if certs is not None:
        argv += [
            f"--cert-file={certs.server_cert}",
            f"--key-file={certs.server_key}",
            f"--trusted-ca-file={certs.ca}",
            "--client-cert-auth",
        ]
    argv += list(extra_args)
    # etcd also reads ETCD_* variables and refuses a flag that one of them shadows.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    if "ETCD_UNSUPPORTED_ARCH" in os.environ:
        env["ETCD_UNSUPPORTED_ARCH"] = os.environ["ETCD_UNSUPPORTED_ARCH"]
    process = ServerProcess(argv, log_path=work_dir / "etcd.log", env=env)
    return EtcdServer(
        host=HOST,
        port=port,
        peer_port=peer_port,
        name=name,
        data_dir=data_dir,
        process=process,
        certs=certs,
        health_cn=health_cn,
    )


def _wait_ready(server: EtcdServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.exit_code() is not None:
            raise server.process.failure("etcd exited during start")
        if server.healthy():
            return
        time.sleep(0.05)
    raise server.process.failure(f"etcd not healthy after {START_TIMEOUT_S:.0f} s")


def relaunch(server: EtcdServer, *, extra_args: Sequence[str] = ()) -> EtcdServer:
    """Start a stopped member again: same name, ports and data, ``extra_args`` added to its
    flags (``--client-crl-file=...``). The caller stops it."""
    log_path = server.process.log_path.with_name(f"etcd-{uuid.uuid4().hex[:6]}.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    process = ServerProcess([*server.process.argv, *extra_args], log_path=log_path, env=env)
    again = EtcdServer(
        host=server.host,
        port=server.port,
        peer_port=server.peer_port,
        name=server.name,
        data_dir=server.data_dir,
        process=process,
        certs=server.certs,
        health_cn=server.health_cn,
    )
    _wait_ready(again)
    return again


@contextmanager
def start_etcd_cluster(tmp_dir: Path, *, size: int = 3) -> Iterator[list[EtcdServer]]:
    """A ``size``-member etcd cluster on loopback; every member stopped and removed on exit."""
    binary = find_binary("etcd")
    token = f"meridian-cluster-{uuid.uuid4().hex[:8]}"
    names = [f"{token}-{i}" for i in range(size)]
    ports: list[tuple[int, int]] = []
    while len(ports) < size:
        pair = (free_port(), free_port())
        if len({pair[0], pair[1], *(p for q in ports for p in q)}) == 2 * (len(ports) + 1):
            ports.append(pair)
    initial = ",".join(
        f"{n}=http://{HOST}:{peer}" for n, (_, peer) in zip(names, ports, strict=True)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    members: list[EtcdServer] = []
    try:
        for name, (port, peer) in zip(names, ports, strict=True):
            work_dir = Path(tempfile.mkdtemp(prefix="etcd-member-", dir=tmp_dir))
            argv = [
                binary,
                f"--name={name}",
                f"--data-dir={work_dir / 'data'}",
                f"--listen-client-urls=http://{HOST}:{port}",
                f"--advertise-client-urls=http://{HOST}:{port}",
                f"--listen-peer-urls=http://{HOST}:{peer}",
                f"--initial-advertise-peer-urls=http://{HOST}:{peer}",
                f"--initial-cluster={initial}",
                f"--initial-cluster-token={token}",
                "--initial-cluster-state=new",
                "--logger=zap",
                "--log-outputs=stderr",
                "--log-level=warn",
            ]
            process = ServerProcess(argv, log_path=work_dir / "etcd.log", env=env)
            members.append(
                EtcdServer(
                    host=HOST,
                    port=port,
                    peer_port=peer,
                    name=name,
                    data_dir=work_dir / "data",
                    process=process,
                )
            )
        for member in members:
            _wait_ready(member)
        yield members
    finally:
        for member in members:
            member.process.stop()
            shutil.rmtree(member.data_dir, ignore_errors=True)


def client(*urls: str, timeout_s: float = 3.0, **access: Any) -> meridian_etcd.Store:
    """The etcd layer's client for ``urls`` (``meridian_etcd.Store``), as the shells build it;
    ``access``: TLS and auth (``ca_file=``, ``cert_file=``, ``user=``, ...)."""
    return meridian_etcd.Store(
        meridian_etcd.ClientConfig(endpoints=list(urls), timeout_s=timeout_s, **access)
    )
