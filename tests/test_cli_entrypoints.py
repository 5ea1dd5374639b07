"""The installed console scripts as an operator runs them: real processes, ``--version`` on
each, and the controller's help, which must list its ``dns bind-config`` command."""

from __future__ import annotations

import base64
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
EXECUTABLES = ("meridian-agent", "meridian-controller", "meridian-sim", "meridianctl")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", EXECUTABLES)
def test_version_prints_the_installed_version_and_exits_0(name: str) -> None:
    done = _run(name, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{name} {metadata.version('meridian')}\n"


def test_controller_help_lists_the_dns_bind_config_command() -> None:
    done = _run("meridian-controller", "--help")
    assert done.returncode == 0, done.stderr
    assert "--admin-port" in done.stdout and "--version" in done.stdout
    assert "meridian-controller dns bind-config [--config FILE] [--zone-dir DIR]" in done.stdout
    assert "meridian-controller dns --help" in done.stdout


def test_controller_dns_help_shows_its_options() -> None:
    done = _run("meridian-controller", "dns", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: meridian-controller dns ")
    for shown in ("bind-config", "--config", "--zone-dir", "/var/lib/bind", "named.conf"):
        assert shown in done.stdout, shown


def test_controller_dns_bind_config_still_renders(tmp_path: Path) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(
        "[dns]\nbackend = 'dry-run'\nzone = 'meridian.test.'\n"
        f"[dns.tsig]\nname = 'meridian'\nsecret = '{base64.b64encode(b'k' * 32).decode()}'\n"
        "[[dns.views]]\nname = 'eu'\ngeo = 'eu'\n"
    )
    done = _run("meridian-controller", "dns", "bind-config", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert 'key "meridian-eu"' in done.stdout and "meridian.test" in done.stdout


def test_controller_without_a_command_still_takes_its_options(tmp_path: Path) -> None:
    """No subcommand: the flags go to the replica as before (a bad one is a usage error, and
    bad settings stop it naming the field)."""
    bad_flag = _run("meridian-controller", "--strikes", "many")
    assert bad_flag.returncode == 2 and "--strikes" in bad_flag.stderr
    config = tmp_path / "c.toml"
    config.write_text("[failover]\nstrikes = 0\n")
    bad = _run("meridian-controller", "--etcd", "http://127.0.0.1:1", "--config", str(config))
    assert bad.returncode == 2 and "failover.strikes" in bad.stderr, bad.stderr
