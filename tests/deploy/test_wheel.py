"""The release artefacts: ``python -m build`` makes an sdist and, from it, a wheel; the wheel
installs into a fresh virtual environment (not editable, not the dev venv: its own interpreter,
no system site-packages, its dependencies from the package index) and every console script of
pyproject.toml's [project.scripts] runs from there.

Run from a temporary directory, so nothing of the source tree is on ``sys.path``: what the
installed scripts find, the wheel brought (the simulator's GPU profiles, for one). The build
and the install need the package index (PyPI): ``make test-deploy`` runs these, ``make test``
does not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.support import DEPLOY, ROOT, tls_copy
from tests.support.etcd import make_certs

pytestmark = pytest.mark.deploy

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
SCRIPTS = sorted(PROJECT["scripts"])
# Meridian's own packages: the only top-level names the wheel may install. A new package is
# added here on purpose; a generic name (tests, scripts, benchmarks, data, docs, ...) in
# site-packages would clash with other distributions' and is refused.
PACKAGES = {
    "controlplane", "meridian_demo", "meridian_etcd", "meridian_service", "meridian_sim",
    "meridian_wire", "meridianctl", "policies", "regional_agent",
}  # fmt: skip
GENERIC = {"tests", "test", "scripts", "benchmarks", "data", "docs", "deploy", "build", "src"}


@dataclass(frozen=True, slots=True)
class Installed:
    wheel: Path
    sdist: Path
    venv: Path
    work: Path  # an empty directory to run the scripts from

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name


def _run(args: list[str | Path], *, cwd: Path, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # The sdist from the tree, then the wheel from the sdist (python -m build's default), each
    # in an isolated build environment, as a release is built.
    _run([sys.executable, "-m", "build", "--outdir", dist, ROOT], cwd=ROOT)
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"meridian-{VERSION}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"meridian-{VERSION}.tar.gz"]
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheels[0]], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return Installed(wheel=wheels[0], sdist=sdists[0], venv=venv, work=work)


def _top_level(names: list[str]) -> set[str]:
    return {n.split("/")[0].removesuffix(".py") for n in names if "/" in n or n.endswith(".py")}


def test_the_wheel_installs_only_meridians_packages(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
        top = {t for t in _top_level(names) if not t.endswith((".dist-info", ".data"))}
        declared = whl.read(f"meridian-{VERSION}.dist-info/top_level.txt").decode().split()
    assert not top & GENERIC, f"generic top-level names in the wheel: {sorted(top & GENERIC)}"
    assert top == PACKAGES, f"new: {sorted(top - PACKAGES)}, gone: {sorted(PACKAGES - top)}"
    assert set(declared) == PACKAGES
    assert not [n for n in names if n.startswith(f"meridian-{VERSION}.data/")], "no data files"


def test_every_data_file_of_the_packages_is_in_the_wheel(installed: Installed) -> None:
    """What a package reads at run time besides its modules (the simulator's profiles, the
    fleet page's static files, py.typed) must be package data: a file in a package directory
    that the wheel lacks fails here."""
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
    data = [
        path.relative_to(ROOT).as_posix()
        for package in sorted(PACKAGES)
        for path in sorted((ROOT / package).rglob("*"))
        if path.is_file()
        and path.suffix not in (".py", ".pyc")
        and "__pycache__" not in path.parts
        and not path.name.startswith(".")
    ]
    assert "meridian_sim/profiles/h100-llama3-8b.toml" in data
    missing = [name for name in data if name not in names]
    assert not missing, f"not in the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_the_sdist_holds_the_sources_and_no_tests(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    top = {n.split("/")[0] for n in names}
    assert top >= PACKAGES
    assert {"pyproject.toml", "README.md", "LICENSE"} <= top
    assert not top & GENERIC, sorted(top & GENERIC)


def test_the_venv_is_not_the_dev_venv_nor_editable(installed: Installed) -> None:
    out = _run(
        [installed.bin("python"), "-c",
         "import json, sys, regional_agent, meridian_sim; "
         "print(json.dumps([sys.prefix, regional_agent.__file__, meridian_sim.__file__]))"],
        cwd=installed.work,
    )  # fmt: skip
    prefix, agent, sim = json.loads(out)
    assert Path(prefix) == installed.venv
    for module in (agent, sim):
        assert Path(module).is_relative_to(installed.venv / "lib"), module
        assert not Path(module).is_relative_to(ROOT), module
    site = next((installed.venv / "lib").glob("python3*/site-packages"))
    assert not list(site.glob("__editable__*")), "an editable install"
    for pth in site.glob("*.pth"):
        assert str(ROOT) not in pth.read_text(), pth
    assert "include-system-site-packages = false" in (installed.venv / "pyvenv.cfg").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_prints_its_version(installed: Installed, script: str) -> None:
    assert _run([installed.bin(script), "--version"], cwd=installed.work) == f"{script} {VERSION}\n"


def test_the_installed_scripts_are_those_of_pyproject(installed: Installed) -> None:
    site = next((installed.venv / "lib").glob("python3*/site-packages"))
    entry_points = (site / f"meridian-{VERSION}.dist-info" / "entry_points.txt").read_text()
    listed = re.findall(r"^([\w-]+) = ", entry_points.split("[console_scripts]")[1], re.M)
    assert sorted(listed) == SCRIPTS
    for script in SCRIPTS:
        assert installed.bin(script).is_file(), script


@pytest.fixture
def simulated_node(installed: Installed) -> Iterator[str]:
    """``meridian-sim node --profile h100-llama3-8b --port 0`` from the clean venv, in an empty
    directory: the profile can only come from the installed wheel."""
    log = installed.work / "meridian-sim.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [installed.bin("meridian-sim"), "node", "--host", "127.0.0.1", "--port", "0",
             "--profile", "h100-llama3-8b"],
            cwd=installed.work, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()  # READY http://127.0.0.1:<port>, or "" if it died
        assert line.startswith("READY "), f"no READY line: {line!r}\n{log.read_text()}"
        yield line.split()[1]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_the_simulator_finds_its_profile_in_the_wheel(simulated_node: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{simulated_node}/health", timeout=5) as response:
                assert response.status == 200
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with urllib.request.urlopen(f"{simulated_node}/v1/models", timeout=5) as response:
        models = json.load(response)
    assert [m["id"] for m in models["data"]] == ["meta-llama/Meta-Llama-3-8B-Instruct"]


def test_the_installed_agent_checks_the_example(installed: Installed, tmp_path: Path) -> None:
    """The example agent.toml through the installed wheel's --check-config: the imports the
    check needs at run time are all declared dependencies, loading the etcd CA and client pair
    (grpc, ssl) included. Its /etc/meridian/tls/ files are moved to real ones (openssl)."""
    certs = make_certs(tmp_path / "pki", clients=["agent-eu-west"])
    copy = tmp_path / "agent.toml"
    copy.write_text(tls_copy(DEPLOY / "examples" / "agent.toml", tmp_path / "tls", {
        "etcd-ca.crt": certs.ca,
        "agent-eu-west.crt": certs.cert("agent-eu-west"),
        "agent-eu-west.key": certs.key("agent-eu-west"),
    }))  # fmt: skip
    out = _run([installed.bin("meridian-agent"), "--check-config", copy], cwd=installed.work)
    region = tomllib.loads(out)["region"]
    assert region["id"] == "eu-west"
    assert region["etcd_cert_file"] == str(tmp_path / "tls" / "agent-eu-west.crt")
