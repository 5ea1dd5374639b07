"""deploy/examples/: each example file goes through what an operator runs before a start, the
real console scripts' ``--check-config`` (in a subprocess, with the environment the systemd
unit's EnvironmentFile= would give and nothing of the developer's), so the examples stay valid
as the settings change.

meridianctl has no ``--check-config``: its example is read with meridianctl's own loader
(``meridianctl.config.load``, what every command calls first), and every key in it must change
what the loader returns, so that a misspelt key (which that loader ignores) fails here."""

from __future__ import annotations

import hashlib
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from meridianctl import config as ctl_config
from tests.deploy import support as s
from tests.support.certs import CertAuthority
from tests.support.etcd import EtcdCerts, make_certs

pytestmark = pytest.mark.deploy

EXAMPLES = s.DEPLOY / "examples"
AGENT = EXAMPLES / "agent.toml"
CONTROLLER = EXAMPLES / "controller.toml"
MERIDIANCTL = EXAMPLES / "meridianctl.toml"
ADVERTISE = "https://ctl-a.meridian.internal:8091"
AGENT_TOKEN = "an-agent-admin-token-from-agent-env-0123456789"
FAKE_TOKENS = {
    "dashboards": ("viewer", "example-viewer-token-do-not-use"),
    "oncall": ("operator", "example-operator-token-do-not-use"),
    "platform-admin": ("admin", "example-admin-token-do-not-use"),
}


@pytest.fixture(scope="module")
def etcd_pki(tmp_path_factory: pytest.TempPathFactory) -> EtcdCerts:
    """An etcd CA and the client certificates the examples name (CN agent-eu-west and
    meridian-controller), made with openssl."""
    return make_certs(
        tmp_path_factory.mktemp("etcd-pki"), clients=["agent-eu-west", "meridian-controller"]
    )


@pytest.fixture(scope="module")
def agent_copy(tmp_path_factory: pytest.TempPathFactory, etcd_pki: EtcdCerts) -> Path:
    """The agent example with its etcd CA and client certificate (CN agent-eu-west) and key."""
    tmp = tmp_path_factory.mktemp("agent")
    copy = tmp / "agent.toml"
    copy.write_text(s.tls_copy(AGENT, tmp / "tls", {
        "etcd-ca.crt": etcd_pki.ca,
        "agent-eu-west.crt": etcd_pki.cert("agent-eu-west"),
        "agent-eu-west.key": etcd_pki.key("agent-eu-west"),
    }))  # fmt: skip
    return copy


def _agent(copy: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return s.check_config("meridian-agent", copy, env=s.clean_env(**env))


@pytest.fixture(scope="module")
def controller_copy(tmp_path_factory: pytest.TempPathFactory, etcd_pki: EtcdCerts) -> Path:
    """The controller example with the admin API's CA, certificate and key and the etcd CA and
    the controller's etcd client certificate (CN meridian-controller) and key."""
    tmp = tmp_path_factory.mktemp("controller")
    admin_ca = CertAuthority.create(tmp / "admin", name="ca")
    admin = admin_ca.issue("admin", serial=31)
    copy = tmp / "controller.toml"
    copy.write_text(s.tls_copy(CONTROLLER, tmp / "tls", {
        "admin.crt": admin.cert,
        "admin.key": admin.key,
        "ca.crt": admin_ca.cert,
        "etcd-ca.crt": etcd_pki.ca,
        "meridian-controller.crt": etcd_pki.cert("meridian-controller"),
        "meridian-controller.key": etcd_pki.key("meridian-controller"),
    }))  # fmt: skip
    return copy


def _controller_env(**extra: str) -> dict[str, str]:
    """/etc/meridian/controller.env, as the example's header describes it."""
    return s.clean_env(
        MERIDIAN_CONTROLLER_DNS__TSIG__SECRET=s.FAKE_TSIG,
        MERIDIAN_CONTROLLER_API__ADVERTISE_URL=ADVERTISE,
        **extra,
    )


def _controller(copy: Path, **env: str) -> dict[str, Any]:
    done = s.check_config("meridian-controller", copy, env=_controller_env(**env))
    assert done.returncode == 0, done.stderr
    assert s.FAKE_TSIG not in done.stdout + done.stderr
    return tomllib.loads(done.stdout)


def test_agent_example_passes_check_config(agent_copy: Path) -> None:
    done = _agent(agent_copy, MERIDIAN_AGENT_ADMIN__TOKEN=AGENT_TOKEN)
    assert done.returncode == 0, done.stderr
    assert AGENT_TOKEN not in done.stdout + done.stderr
    printed = tomllib.loads(done.stdout)
    region = printed["region"]
    assert (region["id"], region["geo"], region["residency"]) == ("eu-west", "eu", ["eu"])
    assert len(printed["nodes"]) == 4 and len(region["etcd"]) == 5
    assert all(url.startswith("https://") for url in region["etcd"])
    tls = agent_copy.parent / "tls"
    assert region["etcd_ca_file"] == str(tls / "etcd-ca.crt")
    # the region's own certificate, named after its etcd user (the certificate's CN)
    assert region["etcd_cert_file"] == str(tls / f"agent-{region['id']}.crt")
    assert region["etcd_key_file"] == str(tls / f"agent-{region['id']}.key")
    assert s.subject_cn(tls / f"agent-{region['id']}.crt") == f"agent-{region['id']}"
    assert printed["server"]["host"] == "0.0.0.0"
    assert printed["admin"]["token_sha256"] == hashlib.sha256(AGENT_TOKEN.encode()).hexdigest()
    models = printed["stall"]["models"]["meta-llama/Llama-3.1-70B-Instruct"]
    assert models == {"first_token_s": 180.0, "inter_token_s": 30.0}


def test_agent_example_without_a_token_still_passes_but_has_none(agent_copy: Path) -> None:
    """The file holds no token: without the environment's, /admin/* answers 401 to everyone."""
    done = _agent(agent_copy)
    assert done.returncode == 0, done.stderr
    admin = tomllib.loads(done.stdout)["admin"]
    assert "token_sha256" not in admin and "token_file" not in admin


def test_a_typo_in_the_agent_example_is_caught(agent_copy: Path, tmp_path: Path) -> None:
    """What an operator's edit of the example could get wrong: named with the key and the fix."""
    copy = tmp_path / "agent.toml"
    copy.write_text(agent_copy.read_text().replace("max_depth = 1024", "max_dpeth = 1024"))
    done = s.check_config("meridian-agent", copy)
    assert done.returncode == 2
    assert f'{copy}: unknown key "queue.max_dpeth" — did you mean "queue.max_depth"?' in done.stderr


def test_agent_example_reads_its_etcd_tls_files(agent_copy: Path, tmp_path: Path) -> None:
    """As shipped, the example names /etc/meridian/tls/, which does not exist here: the check
    refuses it as a start would, naming the setting. A key that is not the certificate's is
    refused too: the files are read, not just named."""
    done = _agent(AGENT)
    assert done.returncode == 2
    assert "region.etcd_ca_file" in done.stderr and "/etc/meridian/tls/etcd-ca.crt" in done.stderr
    tls = agent_copy.parent / "tls"
    wrong = tmp_path / "agent.toml"
    other = CertAuthority.create(tmp_path / "other", name="other").issue("x", serial=7).key
    wrong.write_text(agent_copy.read_text().replace(str(tls / "agent-eu-west.key"), str(other)))
    done = _agent(wrong)
    assert done.returncode == 2 and "region.etcd_key_file" in done.stderr, done.stderr


def test_controller_example_passes_check_config(controller_copy: Path) -> None:
    printed = _controller(controller_copy)
    regions = {r["id"]: r for r in printed["regions"]}
    assert list(regions) == ["us-east", "eu-west", "eu-central"]
    for region in regions.values():  # residency: every backup meets every tag of what it backs
        for backup in region["backups"]:
            assert set(region["residency"]) <= set(regions[backup]["residency"])
    assert "us-east" not in regions["eu-west"]["backups"] + regions["eu-central"]["backups"]
    etcd = printed["etcd"]
    assert len(etcd["endpoints"]) == 5 and all(u.startswith("https://") for u in etcd["endpoints"])
    tls = controller_copy.parent / "tls"
    assert etcd["ca_file"] == str(tls / "etcd-ca.crt")
    assert etcd["cert_file"] == str(tls / "meridian-controller.crt")
    assert s.subject_cn(tls / "meridian-controller.crt") == "meridian-controller"
    assert printed["api"]["port"] == 8091 and printed["api"]["advertise_url"] == ADVERTISE
    assert printed["dns"]["backend"] == "rfc2136"
    assert [v["name"] for v in printed["dns"]["views"]] == ["eu", "default"]
    assert printed["dns"]["tsig"]["secret"] == "***"


def test_controller_example_needs_its_secret_from_the_environment(controller_copy: Path) -> None:
    """The TSIG secret is not in the file: without MERIDIAN_CONTROLLER_DNS__TSIG__SECRET the
    replica would not start, and the check names the field."""
    env = {k: v for k, v in _controller_env().items() if "TSIG" not in k}
    done = s.check_config("meridian-controller", controller_copy, env=env)
    assert done.returncode == 2
    assert "dns.tsig.secret: Field required" in done.stderr, done.stderr


def test_controller_example_reads_its_tls_files() -> None:
    """As shipped, the example names /etc/meridian/tls/, which does not exist here: the check
    refuses it as a start would, naming the setting."""
    done = s.check_config("meridian-controller", CONTROLLER, env=_controller_env())
    assert done.returncode == 2
    assert "api.tls" in done.stderr and "/etc/meridian/tls/admin.crt" in done.stderr


def test_controller_example_tokens_are_hashes_of_fake_tokens(controller_copy: Path) -> None:
    tokens = _controller(controller_copy)["api"]["tokens"]
    assert {t["name"] for t in tokens} == set(FAKE_TOKENS)
    text = CONTROLLER.read_text()
    for entry in tokens:
        role, token = FAKE_TOKENS[entry["name"]]
        assert entry["role"] == role
        assert entry["sha256"] == hashlib.sha256(token.encode()).hexdigest()
        assert token in text  # the comment names the fake token
    assert "meridianctl token new" in text


def test_controller_example_renders_a_bind_config(controller_copy: Path) -> None:
    done = subprocess.run(
        [str(s.BIN / "meridian-controller"), "dns", "bind-config", "--config",
         str(controller_copy)],
        env=_controller_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert 'view "eu"' in done.stdout and 'view "default"' in done.stdout
    assert 'key "meridian-eu"' in done.stdout


def test_agent_and_controller_examples_agree(agent_copy: Path, controller_copy: Path) -> None:
    agent = tomllib.loads(_agent(agent_copy).stdout)
    ctl = _controller(controller_copy)
    assert agent["region"]["etcd"] == ctl["etcd"]["endpoints"]
    region = {r["id"]: r for r in ctl["regions"]}[agent["region"]["id"]]
    assert (region["geo"], region["residency"]) == (
        agent["region"]["geo"],
        agent["region"]["residency"],
    )
    assert ctl["failover"]["agent_heartbeat_s"] == agent["region"]["window_s"]
    # one etcd CA: the same file name on both (the members' CA)
    assert Path(agent["region"]["etcd_ca_file"]).name == Path(ctl["etcd"]["ca_file"]).name
    assert agent["region"]["geo"] in [v["geo"] for v in ctl["dns"]["views"]]


def test_meridianctl_example_is_read_key_by_key(tmp_path: Path) -> None:
    """Every key of the example changes what ``meridianctl.config.load`` returns (the file's
    token_file moved to a temporary file: the only change)."""
    data = tomllib.loads(MERIDIANCTL.read_text())
    assert set(data) == {"url", "token_file", "ca_file", "timeout_s", "retry_s"}
    token = tmp_path / "token"
    token.write_text("an-operator-token-0123456789\n")
    copy = tmp_path / "meridianctl.toml"
    copy.write_text(MERIDIANCTL.read_text().replace(data["token_file"], str(token)))
    defaults = ctl_config.load(env={})
    loaded = ctl_config.load(config_file=str(copy), env={})
    assert loaded.url == data["url"] != defaults.url
    assert loaded.token == "an-operator-token-0123456789" != defaults.token
    assert loaded.ca_file == data["ca_file"] != defaults.ca_file
    assert loaded.timeout_s == float(data["timeout_s"])
    assert loaded.retry_s == float(data["retry_s"])
    # timeout_s and retry_s are the defaults' values: shown for editing; a bad one is refused
    bad = tmp_path / "bad.toml"
    bad.write_text(copy.read_text().replace("timeout_s = 10", "timeout_s = 0"))
    with pytest.raises(ctl_config.CtlError, match="timeout_s"):
        ctl_config.load(config_file=str(bad), env={})


def _meridianctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(s.BIN / "meridianctl"), "--config", str(config), *args],
        env=s.clean_env(MERIDIAN_RETRY_S="0"), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


def test_meridianctl_reads_the_example_from_its_console_script(tmp_path: Path) -> None:
    """The installed meridianctl with the example: as shipped, its ca_file does not exist here,
    a usage error naming the key (exit 2: nothing sent). With a real CA, the token file in a
    temporary directory and url pointed at a closed loopback port: the config is read and the
    error is the unreachable URL (exit 3)."""
    done = _meridianctl(MERIDIANCTL, "health")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "token_file" in done.stderr or "ca_file" in done.stderr, done.stderr
    ca = CertAuthority.create(tmp_path / "tls", name="ca")
    token = tmp_path / "token"
    token.write_text("an-operator-token-0123456789\n")
    data = tomllib.loads(MERIDIANCTL.read_text())
    text = MERIDIANCTL.read_text().replace(data["token_file"], str(token))
    copy = tmp_path / "meridianctl.toml"
    copy.write_text(text.replace(data["ca_file"], str(tmp_path / "missing.crt")))
    done = _meridianctl(copy, "health")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"ca_file {tmp_path / 'missing.crt'}" in done.stderr, done.stderr
    text = text.replace(data["ca_file"], str(ca.cert))
    copy.write_text(text.replace(data["url"], "http://127.0.0.1:9"))
    done = _meridianctl(copy, "health")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "127.0.0.1:9" in done.stderr


@pytest.mark.parametrize("path", [AGENT, CONTROLLER, MERIDIANCTL], ids=lambda p: p.name)
def test_examples_hold_no_secret(path: Path) -> None:
    """No token, password or TSIG secret in the files: they come from the environment or from
    files of their own."""
    data = tomllib.loads(path.read_text())

    def walk(value: object, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                assert key not in ("token", "secret", "password"), f"{where}.{key} in {path.name}"
                walk(item, f"{where}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")

    walk(data, path.stem)
    assert not re.search(r"BEGIN [A-Z ]*PRIVATE KEY", path.read_text())
