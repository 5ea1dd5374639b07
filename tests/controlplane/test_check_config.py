"""``meridian-controller --check-config FILE``, run as an operator runs it: the installed console
script in a subprocess, with the environment it is given and nothing else of the developer's.

It loads the file as a start does (the same loader, environment and flags applied, the admin
port's TLS pair and CA read), prints the effective settings with every secret masked and exits
0, or names the file (or environment variable), the key and the fix and exits 2."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from controlplane import settings as controller_settings
from tests.support.certs import CertAuthority

CONTROLLER = Path(sys.executable).parent / "meridian-controller"
TSIG = base64.b64encode(b"controller-tsig-secret-for-tests").decode()


def _good(tls: Path) -> str:
    return f"""\
[etcd]
endpoints = ["http://127.0.0.1:2379", "http://127.0.0.2:2379"]

[failover]
window_s = 10.0
strikes = 4
status_stale_s = 60.0

[[regions]]
id = "eu-west"
geo = "eu"
residency = ["eu"]
backups = ["eu-central"]

[[regions]]
id = "eu-central"
geo = "eu"
residency = ["eu"]

[latency_ms.eu-west]
eu-central = 25.0

[api]
port = 8091

[api.tls]
cert_file = "{tls}/admin.crt"
key_file = "{tls}/admin.key"
ca_file = "{tls}/ca.crt"

[[api.tokens]]
name = "oncall"
role = "operator"
sha256 = "{hashlib.sha256(b"oncall-token").hexdigest()}"

[dns]
backend = "dry-run"
server = "127.0.0.1"
zone = "meridian.test."

[dns.tsig]
name = "meridian"

[[dns.views]]
name = "eu"
geo = "eu"
match_clients = ["10.0.0.0/8"]
"""


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and the admin port's certificate signed by it, as ``admin.crt``/``admin.key``."""
    directory = tmp_path_factory.mktemp("tls")
    ca = CertAuthority.create(directory, name="ca")
    pair = ca.issue("admin", serial=11)
    assert pair.cert == directory / "admin.crt" and ca.cert == directory / "ca.crt"
    return directory


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    return {**env, "MERIDIAN_CONTROLLER_DNS__TSIG__SECRET": TSIG, **extra}


def _check(
    tmp_path: Path, text: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "controller.toml").write_text(text)
    return subprocess.run(
        [str(CONTROLLER), "--check-config", "controller.toml", *args],
        cwd=tmp_path,
        env=env if env is not None else _env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def test_a_good_file_prints_the_effective_settings(tmp_path: Path, tls: Path) -> None:
    done = _check(tmp_path, _good(tls), env=_env(MERIDIAN_CONTROLLER_ELECTION__ID="ctl-a"))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    printed = tomllib.loads(done.stdout)
    assert printed["etcd"]["endpoints"] == ["http://127.0.0.1:2379", "http://127.0.0.2:2379"]
    assert printed["failover"]["strikes"] == 4
    assert printed["failover"]["recovery_windows"] == 2  # a default, shown too
    assert [r["id"] for r in printed["regions"]] == ["eu-west", "eu-central"]
    assert printed["latency_ms"] == {"eu-west": {"eu-central": 25.0}}
    assert printed["api"]["tls"]["cert_file"] == f"{tls}/admin.crt"
    assert printed["api"]["tokens"] == [
        {
            "name": "oncall",
            "role": "operator",
            "sha256": hashlib.sha256(b"oncall-token").hexdigest(),
        }
    ]
    assert printed["dns"]["views"][0]["match_clients"] == ["10.0.0.0/8"]
    assert printed["election"]["id"] == "ctl-a"  # from the environment


def test_flags_apply_as_at_a_start(tmp_path: Path, tls: Path) -> None:
    done = _check(tmp_path, _good(tls), "--strikes", "5", "--admin-port", "9443", "--id", "x")
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    assert printed["failover"]["strikes"] == 5
    assert printed["api"]["port"] == 9443
    assert printed["election"]["id"] == "x"


def test_json_output_is_the_same_settings(tmp_path: Path, tls: Path) -> None:
    as_toml = _check(tmp_path, _good(tls), "--id", "ctl-a")
    as_json = _check(tmp_path, _good(tls), "--id", "ctl-a", "--output", "json")
    assert as_toml.returncode == as_json.returncode == 0, as_toml.stderr + as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["dns"]["tsig"]["secret"] == "***"
    assert tomllib.loads(as_toml.stdout) == _drop_none(data)


def test_the_printed_settings_load_back_to_the_same_settings(tmp_path: Path, tls: Path) -> None:
    """The masked TSIG secret in the printed file is overridden by the environment's again."""
    first = _check(tmp_path, _good(tls), "--id", "ctl-a")
    assert first.returncode == 0, first.stderr
    again = _check(tmp_path, first.stdout, "--id", "ctl-a")
    assert again.returncode == 0, again.stderr
    assert tomllib.loads(again.stdout) == tomllib.loads(first.stdout)


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        ("strikes = 4", "strikse = 4",
         'controller.toml: unknown key "failover.strikse" — did you mean "failover.strikes"?'),
        ('role = "operator"', 'rol = "operator"',
         'controller.toml: unknown key "api.tokens[0].rol" — did you mean "api.tokens[0].role"?'),
        ('backups = ["eu-central"]', 'backup = ["eu-central"]',
         'controller.toml: unknown key "regions[0].backup" — did you mean "regions[0].backups"?'),
        ("[dns.tsig]", "[dns.tisg]",
         'controller.toml: unknown key "dns.tisg" — did you mean "dns.tsig"?'),
    ],
    ids=["failover.strikse", "list-item", "regions", "group"],
)  # fmt: skip
def test_a_typo_names_the_file_the_key_and_the_nearest_key(
    tmp_path: Path, tls: Path, old: str, new: str, line: str
) -> None:
    good = _good(tls)
    assert old in good
    done = _check(tmp_path, good.replace(old, new))
    assert done.returncode == 2, done.stdout
    assert done.stdout == ""
    assert f"  {line}\n" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("status_stale_s = 60.0", "status_stale_s = 30.0",
         "controller.toml: failover: failover.status_stale_s (30 s) must be at least twice "
         "failover.agent_heartbeat_s (30 s, the agents' region.window_s): raise status_stale_s "
         "to 60 or more"),
        ("strikes = 4", "strikes = 0",
         "controller.toml: failover.strikes: Input should be greater than or equal to 1 (got 0)"),
        ('backups = ["eu-central"]', 'backups = ["us-east"]',
         "controller.toml: settings: regions[0].backups[0]: unknown region 'us-east'"),
        ('"http://127.0.0.2:2379"', '"etcd.example:2379"', "controller.toml: etcd.endpoints"),
        ('role = "operator"', 'role = "root"', "controller.toml: api.tokens[0].role: Input should "
         "be 'viewer', 'operator' or 'admin' (got \"root\")"),
    ],
    ids=["cross-field", "range", "backup", "etcd-url", "choice"],
)  # fmt: skip
def test_a_bad_value_names_the_file_the_key_and_what_to_write(
    tmp_path: Path, tls: Path, old: str, new: str, expected: str
) -> None:
    good = _good(tls)
    assert old in good
    done = _check(tmp_path, good.replace(old, new))
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith("meridian-controller: controller.toml: invalid settings:\n")
    assert expected in done.stderr, done.stderr


def test_the_admin_tls_files_are_read_as_at_a_start(tmp_path: Path, tls: Path) -> None:
    other = CertAuthority.create(tmp_path / "other", name="other").issue("x", serial=12)
    mismatched = _good(tls).replace(f"{tls}/admin.key", str(other.key))
    done = _check(tmp_path, mismatched)
    assert done.returncode == 2, done.stdout
    assert "api.tls.key_file" in done.stderr, done.stderr
    (tmp_path / "ca.crt").write_text("not a CA\n")
    bad_ca = _good(tls).replace(f"{tls}/ca.crt", str(tmp_path / "ca.crt"))
    done = _check(tmp_path, bad_ca)
    assert done.returncode == 2, done.stdout
    assert "api.tls.ca_file" in done.stderr, done.stderr
    missing = _good(tls).replace(f"{tls}/ca.crt", str(tmp_path / "nowhere.crt"))
    done = _check(tmp_path, missing)
    assert done.returncode == 2
    assert "nowhere.crt" in done.stderr and "api.tls" in done.stderr, done.stderr


def test_the_tsig_secret_is_never_printed(tmp_path: Path, tls: Path) -> None:
    """From the environment and from the file: shown as ***, never as itself."""
    done = _check(tmp_path, _good(tls))
    assert done.returncode == 0, done.stderr
    assert TSIG not in done.stdout + done.stderr
    assert tomllib.loads(done.stdout)["dns"]["tsig"]["secret"] == "***"
    in_file = base64.b64encode(b"a-tsig-secret-written-in-the-file").decode()
    text = _good(tls).replace("[dns.tsig]\n", f'[dns.tsig]\nsecret = "{in_file}"\n')
    env = {k: v for k, v in _env().items() if k != "MERIDIAN_CONTROLLER_DNS__TSIG__SECRET"}
    done = _check(tmp_path, text, "--output", "json", env=env)
    assert done.returncode == 0, done.stderr
    assert in_file not in done.stdout + done.stderr
    assert json.loads(done.stdout)["dns"]["tsig"]["secret"] == "***"


def test_a_bad_secret_is_refused_without_being_printed(tmp_path: Path, tls: Path) -> None:
    bad = "not base64: controller-tsig-3c1f"
    done = _check(tmp_path, _good(tls), env=_env(MERIDIAN_CONTROLLER_DNS__TSIG__SECRET=bad))
    assert done.returncode == 2, done.stdout
    assert "dns.tsig.secret: the TSIG secret must be base64" in done.stderr, done.stderr
    assert bad not in done.stdout + done.stderr
    assert "controller-tsig-3c1f" not in done.stderr


def test_an_etcd_password_is_never_printed(tmp_path: Path, tls: Path) -> None:
    password = "controller-etcd-password-5e2a"
    (tmp_path / "etcd.password").write_text(password + "\n")
    text = _good(tls).replace(
        "[failover]", 'user = "meridian-controller"\npassword_file = "etcd.password"\n\n[failover]'
    )
    done = _check(tmp_path, text)
    assert done.returncode == 0, done.stderr
    assert password not in done.stdout + done.stderr
    assert tomllib.loads(done.stdout)["etcd"]["password_file"] == "etcd.password"


def test_a_start_says_what_the_check_says(tmp_path: Path, tls: Path) -> None:
    (tmp_path / "controller.toml").write_text(_good(tls).replace("strikes = 4", "strikse = 4"))
    done = subprocess.run(
        [str(CONTROLLER), "--config", "controller.toml", "--port", "0"], cwd=tmp_path,
        env=_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        'controller.toml: unknown key "failover.strikse" — did you mean "failover.strikes"?'
        in done.stderr
    )


def test_no_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(CONTROLLER), "--check-config", "missing.toml"], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.toml does not exist" in done.stderr, done.stderr


def test_every_settings_group_forbids_unknown_keys() -> None:
    seen: set[type[BaseModel]] = set()
    stack: list[Any] = [controller_settings.ControllerSettings]
    while stack:
        tp = stack.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                continue
            seen.add(tp)
            stack.extend(f.annotation for f in tp.model_fields.values())
        else:
            stack.extend(typing.get_args(tp))
    assert len(seen) > 10
    for model in seen:
        assert model.model_config.get("extra") == "forbid", model.__name__
