"""A real single-member etcd on loopback, for tests.

    with start_etcd(tmp_dir) as etcd:
        async with aetcd.Client(host=etcd.host, port=etcd.port) as client: ...

The member listens for clients and peers on free 127.0.0.1 ports, keeps its data in
`tmp_dir`, and is ready when `/health` answers `{"health": "true"}`. `wipe()` deletes every
key through the v3 JSON gateway, so a shared server can hand each test an empty keyspace
without needing an event loop.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import meridian_etcd
from tests.support.ports import free_port
from tests.support.process import ServerProcess, find_binary, serve

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
# Loopback never goes through the HTTP proxy that the environment may name.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdServer:
    """Where a running test etcd listens. `url` is the client URL (`http://host:port`)."""

    host: str
    port: int
    peer_port: int
    name: str
    data_dir: Path
    process: ServerProcess

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def healthy(self) -> bool:
        try:
            with _HTTP.open(f"{self.url}/health", timeout=1.0) as response:
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
        with _HTTP.open(request, timeout=5.0) as response:
            body = json.loads(response.read())
        return int(body.get("deleted", 0))


@contextmanager
def start_etcd(tmp_dir: Path) -> Iterator[EtcdServer]:
    """Start etcd in a new directory under `tmp_dir`, wait until healthy, stop it on exit.

    The data directory (over 100 MB: etcd preallocates its WAL) is deleted after the stop;
    the log, etcd.log, stays next to it.
    """
    binary = find_binary("etcd")
    launched: list[EtcdServer] = []

    def launch() -> EtcdServer:
        launched.append(_launch(binary, Path(tempfile.mkdtemp(prefix="etcd-", dir=tmp_dir))))
        return launched[-1]

    try:
        with serve(launch, _wait_ready) as server:
            yield server
    finally:
        for each in launched:  # every attempt, stopped by now
            shutil.rmtree(each.data_dir, ignore_errors=True)


def _launch(binary: str, work_dir: Path) -> EtcdServer:
    data_dir = work_dir / "data"
    port = free_port()
    peer_port = free_port()
    while peer_port == port:
        peer_port = free_port()
    name = f"meridian-test-{uuid.uuid4().hex[:8]}"
    client_url = f"http://{HOST}:{port}"
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


def relaunch(server: EtcdServer) -> EtcdServer:
    """Start a stopped member again: same name, ports and data. The caller stops it."""
    log_path = server.process.log_path.with_name(f"etcd-{uuid.uuid4().hex[:6]}.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    process = ServerProcess(server.process.argv, log_path=log_path, env=env)
    again = EtcdServer(
        host=server.host,
        port=server.port,
        peer_port=server.peer_port,
        name=server.name,
        data_dir=server.data_dir,
        process=process,
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


def client(*urls: str, timeout_s: float = 3.0) -> meridian_etcd.Store:
    """The etcd layer's client for ``urls`` (``meridian_etcd.Store``), as the shells build it."""
    return meridian_etcd.Store(
        meridian_etcd.ClientConfig(endpoints=list(urls), timeout_s=timeout_s)
    )
