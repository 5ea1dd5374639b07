"""deploy/systemd/*.service: `systemd-analyze verify` accepts them and they are hardened.

`systemd-analyze verify` checks that ExecStart's binary exists, and /opt/meridian (the install
path the units document) does not exist here: each test verifies a temporary copy of the unit
whose ExecStart (and ExecReload, kept as is) points at the console script of the venv running
these tests instead. Nothing else is changed. systemd-analyze comes from Debian's systemd
package (`make test-deploy` installs it when missing), so its absence fails the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.support import DEPLOY

pytestmark = pytest.mark.deploy

UNITS = DEPLOY / "systemd"
INSTALLED = "/opt/meridian/bin/"
VENV_BIN = Path(sys.executable).parent
NAMES = ("meridian-agent", "meridian-controller")

# Directive: the value it must have (each unit).
REQUIRED = {
    "Type": "exec",  # the daemons print READY http://... but do not speak sd_notify
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "NoNewPrivileges": "yes",
    "PrivateTmp": "yes",
    "CapabilityBoundingSet": "",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "SystemCallFilter": "@system-service",
    "Restart": "on-failure",
    "RestartPreventExitStatus": "2",  # a settings error: a restart loop cannot fix it
    "LimitNOFILE": "65536",
}


def _analyze() -> str:
    found = shutil.which("systemd-analyze", path="/usr/bin:/bin:/usr/sbin:/sbin")
    assert found, "systemd-analyze is missing: run `make test-deploy` (it installs systemd)"
    return found


def _directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _runnable_copy(name: str, tmp_path: Path) -> Path:
    unit = (UNITS / f"{name}.service").read_text()
    assert f"ExecStart={INSTALLED}{name} " in unit
    script = VENV_BIN / name
    assert script.is_file(), f"{script}: install the project (make setup)"
    copy = tmp_path / f"{name}.service"
    copy.write_text(unit.replace(f"ExecStart={INSTALLED}{name} ", f"ExecStart={script} "))
    return copy


@pytest.mark.parametrize("name", NAMES)
def test_unit_verifies(name: str, tmp_path: Path) -> None:
    copy = _runnable_copy(name, tmp_path)
    proc = subprocess.run(
        [_analyze(), "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # verify prints problems of the unit itself with its file name; other noise (the host's
    # own units) is not ours.
    ours = [line for line in proc.stderr.splitlines() if copy.name in line]
    assert not ours, "\n".join(ours)


@pytest.mark.parametrize("name", NAMES)
def test_unit_is_hardened(name: str) -> None:
    d = _directives(UNITS / f"{name}.service")
    for key, value in REQUIRED.items():
        assert value in d.get(key, []), f"{name}: {key}={value} missing (has {d.get(key)})"
    assert d.get("DynamicUser") == ["yes"] or (d.get("User", ["root"])[-1] not in ("root", "0"))
    assert d["RestartSec"] and re.fullmatch(r"\d+s?", d["RestartSec"][-1])
    assert d["ExecStart"] == [f"{INSTALLED}{name} --config /etc/meridian/{name[9:]}.toml"]
    assert d["EnvironmentFile"] == [f"/etc/meridian/{name[9:]}.env"]


@pytest.mark.parametrize("name", NAMES)
def test_unit_holds_no_secret(name: str) -> None:
    """Secrets come through EnvironmentFile=, never Environment= or the command line."""
    d = _directives(UNITS / f"{name}.service")
    assert "Environment" not in d
    for line in d["ExecStart"]:
        assert not re.search(r"token|secret|password", line, re.IGNORECASE), line


def test_agent_reloads_with_sighup() -> None:
    """The agent handles SIGHUP (keys file, TLS pair) and keeps serving: reload sends it."""
    d = _directives(UNITS / "meridian-agent.service")
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    text = (UNITS / "meridian-agent.service").read_text()
    assert "SIGHUP ends the process" not in text and "keys file again" in text


@pytest.mark.parametrize("name", NAMES)
def test_documentation_links_resolve(name: str) -> None:
    """Documentation= takes URLs (systemd.unit(5)); a file:// one must name a file that an
    install puts there. The wheel installs no documents, so none may point into /opt."""
    for url in _directives(UNITS / f"{name}.service").get("Documentation", []):
        for link in url.split():
            assert re.match(r"^(https?://|man:|info:)", link), f"{name}: dead link {link}"


def test_agent_stop_timeout_covers_its_shutdown() -> None:
    """TimeoutStopSec= leaves the agent its HTTP server's shutdown timeout for the requests in
    flight (read from the runner it serves with) plus 10 s to revoke its etcd lease."""
    from aiohttp import web

    from meridian_service import hygiene

    runner = hygiene.runner(web.Application(), hygiene.ConnectionLimits())
    stop = _directives(UNITS / "meridian-agent.service")["TimeoutStopSec"][-1]
    assert int(stop.removesuffix("s")) >= runner._shutdown_timeout + 10


@pytest.mark.parametrize("name", NAMES)
def test_unit_exposure_is_low(name: str, tmp_path: Path) -> None:
    """`systemd-analyze security` (offline, from the file) rates what the sandbox leaves open:
    below 2.0 is its "OK"."""
    copy = _runnable_copy(name, tmp_path)
    proc = subprocess.run(
        [_analyze(), "security", "--offline=true", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", proc.stdout + proc.stderr)
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) < 2.0, proc.stdout
