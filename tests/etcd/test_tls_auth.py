"""etcd over TLS with client certificates, etcd users and least privilege, against real etcd.

One TLS etcd for the module (``--client-cert-auth``, certificates made with ``openssl``) is set
up by the real ``meridian-controller etcd bootstrap`` process, acting as root by a client
certificate with CN root; then each region's agent credentials reach only its own keys, the
controller's reach everything, plaintext is refused, and a real agent and controller work end to
end over TLS.  A second, plaintext etcd with short-lived tokens covers users with passwords and
the re-authentication when a token expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import meridian_etcd
from controlplane import access
from controlplane.app import CONTROLLER, create_app
from controlplane.settings import ControllerSettings
from meridian_etcd import Permission
from meridian_wire import keys
from meridian_wire.models import RegionHealth, RegionStatus
from regional_agent.settings import Settings
from tests.support import until
from tests.support.agent import AgentFactory
from tests.support.etcd import EtcdCerts, EtcdServer, make_certs, start_etcd, start_etcd_tls
from tests.support.etcd import client as etcd_client

CLIENTS = ["agent-eu-west", "agent-us-east", "meridian-controller", "root"]
REGIONS = [{"id": "eu-west", "geo": "eu", "residency": ["eu"]},
           {"id": "us-east", "geo": "us", "residency": ["us"]}]  # fmt: skip
CONTROLLER_BIN = Path(sys.executable).with_name("meridian-controller")
TOKEN_TTL_S = 2


@dataclass(frozen=True, slots=True)
class TlsEtcd:
    server: EtcdServer
    certs: EtcdCerts
    config: Path
    first_run: str  # what the bootstrap said the first time

    def store(self, cn: str | None, **extra: Any) -> meridian_etcd.Store:
        return etcd_client(self.server.url, **{"timeout_s": 2.0, **self.certs.access(cn), **extra})


def _bootstrap(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CONTROLLER_BIN), "etcd", "bootstrap", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _toml_regions() -> str:
    return "".join(
        f'[[regions]]\nid = "{r["id"]}"\ngeo = "{r["geo"]}"\nresidency = {r["residency"]!r}\n'
        for r in REGIONS
    ).replace("'", '"')


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    tmp = tmp_path_factory.mktemp("etcd-tls")
    certs = make_certs(tmp / "pki", clients=CLIENTS)
    with start_etcd_tls(tmp, certs, health_cn="root") as server:
        config = tmp / "bootstrap.toml"
        config.write_text(
            f'[etcd]\nendpoints = ["{server.url}"]\nca_file = "{certs.ca}"\n'
            f'cert_file = "{certs.cert("root")}"\nkey_file = "{certs.key("root")}"\n'
            + _toml_regions()
        )
        done = _bootstrap(config)
        assert done.returncode == 0, done.stderr
        yield TlsEtcd(server=server, certs=certs, config=config, first_run=done.stdout)


# -- the roles, computed -----------------------------------------------------------------------


def test_each_region_gets_a_role_for_its_own_keys_and_the_controller_one_for_all() -> None:
    by_name = {r.name: set(r.permissions) for r in access.roles(["us-east", "eu-west"])}
    assert by_name == {
        "meridian-agent-eu-west": {
            Permission.under("readwrite", "/meridian/v1/regions/eu-west/agents/"),
            Permission.under("readwrite", "/meridian/v1/routing/eu-west/"),
            Permission.on("read", "/meridian/v1/regions/eu-west/desired"),
            Permission.on("read", "/meridian/v1/controller/plan"),
        },
        "meridian-agent-us-east": {
            Permission.under("readwrite", "/meridian/v1/regions/us-east/agents/"),
            Permission.under("readwrite", "/meridian/v1/routing/us-east/"),
            Permission.on("read", "/meridian/v1/regions/us-east/desired"),
            Permission.on("read", "/meridian/v1/controller/plan"),
        },
        "meridian-controller": {Permission.under("readwrite", "/meridian/v1/")},
    }
    # a region's prefixes end with "/": eu does not reach eu-west
    eu = next(r for r in access.roles(["eu"]) if r.name == "meridian-agent-eu")
    assert all(p.key.endswith(("/", "/desired", "controller/plan")) for p in eu.permissions)
    assert sorted(map(str, eu.permissions)) == [
        "read /meridian/v1/controller/plan",
        "read /meridian/v1/regions/eu/desired",
        "readwrite /meridian/v1/regions/eu/agents/*",
        "readwrite /meridian/v1/routing/eu/*",
    ]
    assert [(u.name, u.roles) for u in access.users(["eu-west"])] == [
        ("agent-eu-west", ("meridian-agent-eu-west",)),
        ("meridian-controller", ("meridian-controller",)),
        ("root", ("root",)),
    ]
    with pytest.raises(ValueError, match="region id"):
        access.roles(["EU West"])


# -- bootstrap ---------------------------------------------------------------------------------


def test_the_bootstrap_creates_roles_users_and_auth_then_changes_nothing(
    tls_etcd: TlsEtcd,
) -> None:
    first = tls_etcd.first_run
    assert "auth off before" in first
    for line in (
        "+ role meridian-agent-eu-west",
        "+ meridian-agent-eu-west: readwrite /meridian/v1/regions/eu-west/agents/*",
        "+ meridian-agent-us-east: read /meridian/v1/regions/us-east/desired",
        "+ meridian-controller: readwrite /meridian/v1/*",
        "+ user agent-eu-west (no password: only a client certificate with CN agent-eu-west)",
        "+ root: role root",
        "+ auth enabled",
    ):
        assert line in first, first
    again = _bootstrap(tls_etcd.config)
    assert again.returncode == 0, again.stderr
    assert "auth on before" in again.stdout
    assert "nothing to change: 3 roles, 4 users and auth are as they should be" in again.stdout
    dry = _bootstrap(tls_etcd.config, "--region", "ap-south", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "+ role meridian-agent-ap-south" in dry.stdout and "would change: 7" in dry.stdout


async def test_the_bootstrap_puts_back_what_was_taken_and_takes_what_was_added(
    tls_etcd: TlsEtcd,
) -> None:
    admin = meridian_etcd.Admin(
        meridian_etcd.ClientConfig(endpoints=[tls_etcd.server.url], **tls_etcd.certs.access("root"))
    )
    try:
        extra = Permission.under("readwrite", "/meridian/v1/controller/")
        await admin.grant("meridian-agent-eu-west", extra)
        desired = Permission.on("read", "/meridian/v1/regions/eu-west/desired")
        await admin.revoke("meridian-agent-eu-west", desired)
        await admin.grant_role("agent-eu-west", "meridian-agent-us-east")
        report = await access.bootstrap(admin, regions=["eu-west", "us-east"])
        assert report.changes == [
            "+ meridian-agent-eu-west: read /meridian/v1/regions/eu-west/desired",
            "- meridian-agent-eu-west: readwrite /meridian/v1/controller/* (beyond least "
            "privilege)",
            "- agent-eu-west: role meridian-agent-us-east (beyond least privilege)",
        ]
        assert (await access.bootstrap(admin, regions=["eu-west", "us-east"])).changes == []
    finally:
        await admin.close()


# -- (a) an agent's credentials: its own keys only -----------------------------------------


async def test_an_agent_certificate_writes_its_region_and_nothing_else(tls_etcd: TlsEtcd) -> None:
    agent = tls_etcd.store("agent-eu-west")
    try:
        lease = await agent.grant(ttl_s=5)
        await agent.put(keys.agent_alive("eu-west", "a1"), b"", lease=lease)
        await agent.put(keys.agent_status("eu-west", "a1"), b"{}", lease=lease)
        await agent.commit(puts={keys.group("eu-west", "prefix", 0): b"{}"}, lease=lease)
        assert await agent.get(keys.desired("eu-west")) is None  # read, and nothing there yet
        assert await agent.get(keys.PLAN) is None  # read (spill-over), and nothing there yet
        for key in (
            keys.agent_alive("us-east", "a1"),
            keys.PLAN,
            keys.LEADER,
            keys.desired("eu-west"),  # read only
            keys.health("eu-west"),
        ):
            with pytest.raises(meridian_etcd.Refused, match="permission denied"):
                await agent.put(key, b"x")
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            await agent.get(keys.desired("us-east"))
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            await agent.get_prefix(keys.PREFIX)
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            async with contextlib.aclosing(agent.follow(keys.desired("us-east"))) as changes:
                await anext(changes)
        await agent.revoke(lease)  # its keys are its own: the revoke is allowed
    finally:
        await agent.close()


# -- (b) the controller's credentials: everything under /meridian/v1/ ------------------------


async def test_the_controller_certificate_writes_the_plan_and_reads_the_agents(
    tls_etcd: TlsEtcd,
) -> None:
    controller = tls_etcd.store("meridian-controller")
    agent = tls_etcd.store("agent-us-east")
    try:
        await agent.put(keys.agent_status("us-east", "b1"), b"{}")
        await controller.put(keys.PLAN, b'{"plan": 1}')
        await controller.put(keys.desired("us-east"), b"{}")
        entry = await controller.get(keys.agent_status("us-east", "b1"))
        assert entry is not None and entry.value == b"{}"
        assert (await agent.get(keys.desired("us-east"))) is not None
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            await controller.put("/elsewhere", b"x")  # not Meridian's keyspace
    finally:
        await controller.close()
        await agent.close()


# -- (c) plaintext, or TLS without the right credentials, is refused ---------------------------


async def test_plaintext_and_credential_less_clients_are_refused_with_a_clear_error(
    tls_etcd: TlsEtcd,
) -> None:
    plaintext_url = tls_etcd.server.url.replace("https://", "http://")
    plaintext = etcd_client(plaintext_url, timeout_s=1.0)
    try:
        with pytest.raises(meridian_etcd.Unavailable, match="closes plaintext connections"):
            await plaintext.get(keys.PLAN)
    finally:
        await plaintext.close()
    with pytest.raises(ValueError, match="TLS to etcd is not set up: set ca_file"):
        meridian_etcd.ClientConfig(endpoints=[tls_etcd.server.url])
    no_certificate = tls_etcd.store(None, timeout_s=1.0)  # the CA only
    try:
        with pytest.raises(meridian_etcd.Unavailable, match="TLS handshake failed"):
            await no_certificate.get(keys.PLAN)
    finally:
        await no_certificate.close()
    other = make_certs(tls_etcd.certs.directory.parent / "other-pki", clients=["agent-eu-west"])
    untrusted = etcd_client(tls_etcd.server.url, timeout_s=1.0, **other.access("agent-eu-west"))
    try:  # a CA that did not sign the member: the member is not believed
        with pytest.raises(meridian_etcd.Unavailable, match="TLS handshake failed"):
            await untrusted.get(keys.PLAN)
    finally:
        await untrusted.close()


def test_settings_name_the_tls_field_that_is_wrong(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    url = tls_etcd.server.url
    certs = tls_etcd.certs
    region = {"id": "eu-west", "geo": "eu", "etcd": [url], "etcd_ca_file": certs.ca}
    ok = Settings(region={**region, "etcd_cert_file": certs.cert("agent-eu-west"),
                          "etcd_key_file": certs.key("agent-eu-west")})  # fmt: skip
    assert ok.region.etcd_client().tls
    bad: list[tuple[dict[str, Any], str]] = [
        ({"etcd_ca_file": tmp_path / "missing.pem"}, "region.etcd_ca_file: cannot read"),
        ({"etcd_ca_file": certs.key("root")}, "region.etcd_ca_file: .* holds no PEM CA"),
        ({"etcd_cert_file": certs.cert("agent-eu-west"), "etcd_key_file": certs.key("root")},
         "region.etcd_key_file: .* are not a PEM certificate and its"),
        ({"etcd_cert_file": certs.cert("agent-eu-west")}, "set region.etcd_key_file too"),
        ({"etcd_ca_file": None}, "set region.etcd_ca_file"),
        ({"etcd": [url.replace("https", "http")]}, "plaintext http:// but region.etcd_ca_file"),
        ({"etcd_user": "agent-eu-west"}, "region.etcd_user is set but region.etcd_password_file"),
    ]  # fmt: skip
    for change, says in bad:
        with pytest.raises(ValueError, match=says):
            Settings(region={**region, **change})
    controller = ControllerSettings(
        etcd={"endpoints": [url], "ca_file": certs.ca,
              "cert_file": certs.cert("meridian-controller"),
              "key_file": certs.key("meridian-controller")},
    )  # fmt: skip
    assert controller.etcd.client_config().cert_file == certs.cert("meridian-controller")
    with pytest.raises(ValueError, match=r"etcd\.password_file: cannot read"):
        ControllerSettings(etcd={"endpoints": ["http://127.0.0.1:2379"], "user": "u",
                                 "password_file": tmp_path / "none"})  # fmt: skip


# -- (d) a real agent and a real controller, over TLS ----------------------------------------


@pytest.fixture
async def controller_runner() -> AsyncIterator[list[web.AppRunner]]:
    runners: list[web.AppRunner] = []
    yield runners
    for runner in runners:
        await runner.cleanup()


async def test_an_agent_and_a_controller_work_end_to_end_over_tls(
    tls_etcd: TlsEtcd,
    sim_node: Any,
    start_agent: AgentFactory,
    controller_runner: list[web.AppRunner],
) -> None:
    certs = tls_etcd.certs
    node = await sim_node()
    agent = await start_agent(
        [node],
        region={
            "id": "eu-west", "geo": "eu", "residency": ["eu"], "agent_id": "tls-a1",
            "etcd": [tls_etcd.server.url], "etcd_ca_file": certs.ca,
            "etcd_cert_file": certs.cert("agent-eu-west"),
            "etcd_key_file": certs.key("agent-eu-west"),
            "lease_ttl_s": 2, "window_s": 1.0, "min_interval_s": 0.2, "etcd_timeout_s": 2.0,
            "retry_base_s": 0.1, "retry_max_s": 0.5,
        },
    )  # fmt: skip
    settings = ControllerSettings(
        etcd={"endpoints": [tls_etcd.server.url], "timeout_s": 2.0, "ca_file": certs.ca,
              "cert_file": certs.cert("meridian-controller"),
              "key_file": certs.key("meridian-controller")},
        election={"id": "ctl-tls", "lease_ttl_s": 2},
        failover={"window_s": 0.4, "status_stale_s": 5.0, "agent_heartbeat_s": 1.0,
                  "min_hold_s": 0.0},
        regions=REGIONS[:1],
        server={"port": 0},
    )  # fmt: skip
    app = create_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    controller_runner.append(runner)
    controller = app[CONTROLLER]
    await until(lambda: controller.election.leading, 10, "the controller to lead over TLS")
    reader = tls_etcd.store("meridian-controller")
    try:
        deadline = time.monotonic() + 20

        async def judged_after(revision: int) -> RegionHealth | None:
            entry = await reader.get(keys.health("eu-west"))
            if entry is None or entry.mod_revision <= revision:
                return None
            return RegionHealth.model_validate_json(entry.value)

        # the agent publishes its status over TLS, with its node healthy ...
        while True:
            status = await reader.get(keys.agent_status("eu-west", "tls-a1"))
            if status and RegionStatus.model_validate_json(status.value).nodes_healthy == 1:
                break
            assert time.monotonic() < deadline, "no status from the agent over TLS"
            await asyncio.sleep(0.1)
        alive = await reader.get(keys.agent_alive("eu-west", "tls-a1"))
        assert alive is not None and alive.lease == status.lease != 0  # under its lease
        # ... and the leading controller judges the region on it: healthy
        while (health := await judged_after(status.mod_revision)) is None:
            assert time.monotonic() < deadline, "eu-west not judged over TLS"
            await asyncio.sleep(0.1)
        assert health.state == "healthy", health
        assert controller.election.leading and controller.etcd_ok
        assert agent.publisher is not None and agent.publisher.region == "eu-west"
    finally:
        await reader.close()


# -- (e) users with passwords, and tokens that expire ------------------------------------------


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """Plaintext etcd whose tokens lapse after TOKEN_TTL_S of disuse, bootstrapped by the
    command with a password for every user (files in the fixture's directory)."""
    tmp = tmp_path_factory.mktemp("etcd-auth")
    with start_etcd(tmp, extra_args=[f"--auth-token-ttl={TOKEN_TTL_S}"]) as server:
        for user in ("root", "agent-eu-west", "meridian-controller"):
            (tmp / user).write_text(f"{user}-pw\n")
        config = tmp / "bootstrap.toml"
        config.write_text(f'[etcd]\nendpoints = ["{server.url}"]\n')  # regions: --region
        args = ["--region", "eu-west", "--root-password-file", str(tmp / "root")]
        done = _bootstrap(config, *args, "--password-dir", str(tmp))
        assert done.returncode == 0, done.stderr
        assert "+ user agent-eu-west (with a password)" in done.stdout, done.stdout
        # auth is on now: root acts by its password
        again = _bootstrap(config, *args)
        assert again.returncode == 0, again.stderr
        assert "nothing to change" in again.stdout, again.stdout
        yield server


def _password_store(server: EtcdServer, user: str, **extra: Any) -> meridian_etcd.Store:
    directory = server.data_dir.parent.parent  # where the fixture wrote the password files
    return etcd_client(
        server.url, timeout_s=2.0, user=user, password_file=directory / user, **extra
    )


async def test_users_with_passwords_get_their_roles_and_no_more(auth_etcd: EtcdServer) -> None:
    agent = _password_store(auth_etcd, "agent-eu-west")
    controller = _password_store(auth_etcd, "meridian-controller")
    nobody = etcd_client(auth_etcd.url, timeout_s=2.0)
    wrong = etcd_client(auth_etcd.url, timeout_s=2.0, user="agent-eu-west", password="nope")
    try:
        await agent.put(keys.agent_alive("eu-west", "p1"), b"")
        with pytest.raises(meridian_etcd.Refused, match="permission denied"):
            await agent.put(keys.PLAN, b"x")
        await controller.put(keys.PLAN, b"x")
        with pytest.raises(meridian_etcd.Refused, match="etcd has auth enabled: give a user"):
            await nobody.get(keys.PLAN)
        with pytest.raises(meridian_etcd.Refused, match="authentication failed"):
            await wrong.get(keys.PLAN)
    finally:
        for store in (agent, controller, nobody, wrong):
            await store.close()


async def test_an_expired_token_is_renewed_by_authenticating_again(
    auth_etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="meridian_etcd.client")
    agent = _password_store(auth_etcd, "agent-eu-west")
    try:
        await agent.put(keys.agent_status("eu-west", "p1"), b"1")
        await asyncio.sleep(TOKEN_TTL_S + 1.5)  # the token lapses unused
        await agent.put(keys.agent_status("eu-west", "p1"), b"2")  # authenticates again
        assert any("invalid auth token" in r.getMessage() for r in caplog.records)
        caplog.clear()
        await asyncio.sleep(TOKEN_TTL_S + 1.5)
        # a watch started on a connection whose token lapsed: etcd refuses it quietly (no
        # watch id); the client authenticates again and watches
        async with contextlib.aclosing(agent.follow(keys.desired("eu-west"))) as changes:
            first = await asyncio.wait_for(anext(changes), 5)
        assert first.value is None
        assert any("watch refused" in r.getMessage() for r in caplog.records)
        entry = await agent.get(keys.agent_status("eu-west", "p1"))
        assert entry is not None and entry.value == b"2"
    finally:
        await agent.close()
