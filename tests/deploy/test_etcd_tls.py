"""Module global's etcd, run: members started with exactly the flags its StatefulSet gives them
(``local.etcd_args``: TLS for clients and peers, each asked for a certificate from the CA), the
files of its Secrets where those flags and the rendered controller.toml name them, and the
bootstrap Job's command (``local.bootstrap_command``) run twice against them as root.

What is changed, and only that: the members' in-cluster names and ports become loopback ports
of their own (three members on one host), ``$(POD_NAME)`` is expanded as Kubernetes expands it,
and the mounts (``/etc/etcd/tls``, ``/var/lib/etcd``, ``/etc/meridian``,
``/run/secrets/etcd-root``) are temporary directories. Three members rather than the example's
five: the same flags, less of the two shared cores. The members' certificate names 127.0.0.1 (the
module's names the in-cluster ones: outputs ``etcd_tls_dns_names``, ``etcd_tls_ip_addresses``).

The etcd here is Debian's (3.4); the module asks for 3.5.1 or later, whose flags these are too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import meridian_etcd
from meridian_wire import keys
from tests.deploy import hcleval
from tests.deploy import support as s
from tests.support.etcd import client
from tests.support.ports import free_port
from tests.support.process import ServerProcess, find_binary

pytestmark = pytest.mark.deploy

MEMBERS = 3
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Plane:
    glob: hcleval.Module
    region_files: Path  # eu-west's agent Secret, as mounted
    client_urls: list[str]
    metrics_urls: list[str]
    peer_ports: list[int]
    member_args: list[list[str]]
    first: subprocess.CompletedProcess[str]
    second: subprocess.CompletedProcess[str]


def _ports(n: int) -> list[int]:
    out: set[int] = set()
    while len(out) < n:
        out.add(free_port())
    return sorted(out)


def _healthy(url: str) -> bool:
    try:
        with _HTTP.open(f"{url}/health", timeout=1.0) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("etcd-plane")
    example = s.Example(s.real_pki(tmp / "pki"))
    glob = hcleval.Module(s.GLOBAL, {**example.inputs("global"), "etcd_replicas": MEMBERS})
    assert glob.invalid() == []
    names = glob.local["etcd_member_names"]
    hosts = glob.local["etcd_member_host"]
    ports = _ports(3 * MEMBERS)
    client_ports, peer_ports, metrics_ports = (ports[i::3] for i in range(3))
    metrics = glob.local["etcd_metrics_port"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    binary = find_binary("etcd")

    def loopback(text: str) -> str:
        for i, name in enumerate(names):
            text = text.replace(f"{hosts[name]}:2379", f"127.0.0.1:{client_ports[i]}")
            text = text.replace(f"{hosts[name]}:2380", f"127.0.0.1:{peer_ports[i]}")
        return text

    processes: list[ServerProcess] = []
    member_args: list[list[str]] = []
    try:
        for i, name in enumerate(names):
            work = tmp / name
            tls = s.write_secret(glob.local["etcd_tls_data"], work / "tls")
            args = []
            for arg in glob.local["etcd_args"]:
                arg = loopback(arg.replace("$(POD_NAME)", name))
                arg = arg.replace("0.0.0.0:2379", f"127.0.0.1:{client_ports[i]}")
                arg = arg.replace("0.0.0.0:2380", f"127.0.0.1:{peer_ports[i]}")
                arg = arg.replace(f"0.0.0.0:{metrics}", f"127.0.0.1:{metrics_ports[i]}")
                arg = arg.replace(glob.local["etcd_tls_dir"], str(tls))
                args.append(arg.replace("/var/lib/etcd/", f"{work}/"))
            leftover = [a for a in args if "cluster.local" in a or "0.0.0.0" in a or "$(" in a]
            assert not leftover, leftover
            member_args.append(args)
            processes.append(ServerProcess([binary, *args], log_path=tmp / f"{name}.log", env=env))
        metrics_urls = [f"http://127.0.0.1:{p}" for p in metrics_ports]
        deadline = time.monotonic() + 60
        while not all(_healthy(u) for u in metrics_urls):
            for p in processes:
                if p.exit_code() is not None:
                    raise p.failure("an etcd member exited")
            if time.monotonic() > deadline:
                raise processes[0].failure("the members did not form a healthy cluster in 60 s")
            time.sleep(0.2)

        # the controllers' settings and Secret, and the bootstrap Job's command and Secret
        config_dir = tmp / "meridian"
        tls = s.write_secret(glob.local["controller_tls_data"], config_dir / "tls")
        config = config_dir / "controller.toml"
        config.write_text(
            loopback(glob.local["controller_config"]).replace(
                f"{glob.local['tls_dir']}/", f"{tls}/"
            )
        )
        root = s.write_secret(glob.local["bootstrap_data"], tmp / "etcd-root")
        command = [
            part.replace(glob.local["controller_config_file"], str(config)).replace(
                glob.local["bootstrap_dir"], str(root)
            )
            for part in glob.local["bootstrap_command"]
        ]
        assert command[0] == "meridian-controller"
        command[0] = str(s.BIN / "meridian-controller")
        job_env = s.clean_env(
            MERIDIAN_CONTROLLER_DNS__TSIG__SECRET=glob.var["tsig_secret"],
            MERIDIAN_CONTROLLER_API__ADVERTISE_URL="https://meridian-controller-admin:8091",
        )

        def bootstrap() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                command, env=job_env, capture_output=True, text=True, timeout=120, check=False
            )

        first = bootstrap()
        second = bootstrap()
        region = example.module("eu_west")
        region_files = s.write_secret(region.local["agent_secret_data"], tmp / "eu-west")
        yield Plane(
            glob=glob,
            region_files=region_files,
            client_urls=[f"https://127.0.0.1:{p}" for p in client_ports],
            metrics_urls=metrics_urls,
            peer_ports=list(peer_ports),
            member_args=member_args,
            first=first,
            second=second,
        )
    finally:
        for p in processes:
            p.stop()
        for name in names:
            shutil.rmtree(tmp / name / "data", ignore_errors=True)


def test_the_members_run_with_the_modules_flags(plane: Plane) -> None:
    """Three members formed one cluster over peer TLS with the module's flags; the kubelet's
    readiness probe (GET /health on the plain metrics port) answers healthy."""
    flags = " ".join(plane.member_args[0])
    for flag in ("--client-cert-auth=true", "--peer-client-cert-auth=true", "--trusted-ca-file=",
                 "--peer-trusted-ca-file=", "--peer-cert-file=", "--cert-file="):  # fmt: skip
        assert flag in flags, flag
    assert all(_healthy(url) for url in plane.metrics_urls)


def test_the_peer_port_refuses_a_member_without_a_certificate(plane: Plane) -> None:
    """The peer port speaks TLS and refuses a client that presents no certificate, with a
    certificate alert (etcd asks for one whenever a trusted CA is given; the module says so
    outright with --peer-client-cert-auth): not a plaintext port, not an open one."""
    ca = plane.region_files / "etcd-ca.crt"
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", plane.peer_ports[0]), timeout=5) as raw,
        pytest.raises(ssl.SSLError, match="CERTIFICATE") as refused,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        tls.recv(1)  # TLS 1.3: the alert arrives after the handshake
    assert "ALERT" in str(refused.value), refused.value


def test_the_bootstrap_job_sets_up_users_and_auth_then_changes_nothing(plane: Plane) -> None:
    first, second = plane.first, plane.second
    assert first.returncode == 0, first.stdout + first.stderr
    assert "auth off before" in first.stdout, first.stdout
    for user in plane.glob.output("etcd_users")["regions"].values():
        assert f"+ user {user} (no password: only a client certificate with CN {user})" in (
            first.stdout
        ), first.stdout
    assert "+ user meridian-controller" in first.stdout and "+ auth enabled" in first.stdout
    # idempotent: run again on the next apply, it finds everything right
    assert second.returncode == 0, second.stdout + second.stderr
    assert "auth on before" in second.stdout and "nothing to change" in second.stdout
    assert all(_healthy(url) for url in plane.metrics_urls)  # the probe, with auth on


async def test_a_region_writes_its_own_keys_only(plane: Plane) -> None:
    """eu-west's agent, with the files of its module's Secret: its own keys, nothing else."""
    files = plane.region_files
    store = client(
        *plane.client_urls,
        ca_file=files / "etcd-ca.crt",
        cert_file=files / "etcd-client.crt",
        key_file=files / "etcd-client.key",
    )
    try:
        await store.put(keys.agent_status("eu-west", "deploy-test"), b"{}")
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            await store.put(keys.agent_status("us-east", "deploy-test"), b"{}")
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            await store.put(keys.PLAN, b"{}")
    finally:
        await store.close()
