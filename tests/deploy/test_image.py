"""The container image, built and run (``make test-image``; marked ``image``, not ``deploy``).

scripts/build_image.sh builds deploy/container/Containerfile from Debian's packages and PyPI
alone: a debootstrapped bookworm imported as the base, buildah for the build, no registry.
These tests run what it made with podman: every console script's ``--version``, the image's
user and labels, a ``meridian-sim`` node and a ``meridian-agent`` in front of it (read-only root
filesystems, as the Terraform modules run them) answering a chat completion, and
``meridian-controller --check-config`` on deploy/examples/controller.toml mounted read-only.

Without MERIDIAN_TEST_IMAGE the image is built by the script, which needs root (debootstrap,
podman's system storage). MERIDIAN_TEST_IMAGE=<name> tests an image already built instead, in
the podman storage of whoever runs the tests. STORAGE_DRIVER, if set, is given to podman as
--storage-driver, as the script gives it to buildah and podman.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from meridian_sim import profile
from tests.deploy.support import DEPLOY, FAKE_TSIG, ROOT
from tests.support.certs import CertAuthority
from tests.support.etcd import make_certs

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

SCRIPT = ROOT / "scripts" / "build_image.sh"
CONTROLLER = DEPLOY / "examples" / "controller.toml"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
UID = "10001"
SCRIPTS = ("meridian-agent", "meridian-controller", "meridian-sim", "meridianctl")
AGENT_TOKEN = "image-test-agent-admin-token-0123456789abcdef"
ADVERTISE = "https://ctl-a.meridian.internal:8091"
# runc, not crun (Debian podman's default), which refuses a hybrid cgroup hierarchy (cgroup v1
# with a controller left on v2, as on the development VM): the build script uses runc too.
RUNTIME = "runc"


def _ulimits() -> list[str]:
    """Limits no higher than this process's: podman's defaults for root (nofile 1048576, nproc
    4194304) need CAP_SYS_RESOURCE, which root lacks on the development VM."""
    out = []
    for name, limit, wanted in (
        ("nofile", resource.RLIMIT_NOFILE, 8192),
        ("nproc", resource.RLIMIT_NPROC, 4096),
    ):
        hard = resource.getrlimit(limit)[1]
        value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        out.append(f"--ulimit={name}={value}:{value}")
    return out


@dataclass(frozen=True, slots=True)
class Image:
    name: str
    storage_driver: str | None
    base: str | None  # the base the script built on; None for an image given by name

    def podman(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        driver = ["--storage-driver", self.storage_driver] if self.storage_driver else []
        return subprocess.run(
            ["podman", "--runtime", RUNTIME, *driver, *args],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def run(self, *command: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        """``podman run --rm`` of the image, without a network unless ``options`` give one."""
        return self.podman(
            "run", "--rm", "--network", "none", *_ulimits(), *options, self.name, *command
        )  # fmt: skip

    def inspect(self) -> dict[str, Any]:
        done = self.podman("image", "inspect", self.name)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        assert len(found) == 1, found
        config: dict[str, Any] = found[0]["Config"]
        return config


def _git_revision() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else "unknown"


@pytest.fixture(scope="module")
def image() -> Image:
    for tool in ("podman", RUNTIME):
        assert shutil.which(tool), f"{tool} is missing: run `make test-image` (it installs it)"
    # podman remembers the driver of its storage; the script is given one only as STORAGE_DRIVER
    driver = os.environ.get("STORAGE_DRIVER") or None
    given = os.environ.get("MERIDIAN_TEST_IMAGE")
    if given:
        return Image(given, driver, base=None)
    if os.geteuid() != 0:
        pytest.fail(
            "building the image needs root (debootstrap, podman's system storage): run "
            "`make test-image` as root (CI does), or give MERIDIAN_TEST_IMAGE=<a built image>"
        )
    started = time.monotonic()
    built = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=1500, check=False)
    assert built.returncode == 0, f"{SCRIPT} failed:\n{built.stderr[-8000:]}"
    name = built.stdout.strip().splitlines()[-1]
    print(f"\n{name} built in {time.monotonic() - started:.0f} s")
    base = os.environ.get("MERIDIAN_BASE_IMAGE", "localhost/meridian-base:bookworm")
    return Image(name, driver, base=base)


def test_build_script_is_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: run `make test-image` (it installs Debian's)"
    done = subprocess.run(
        [shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_answers_version(image: Image, script: str) -> None:
    done = image.run(script, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{script} {VERSION}"


def test_runs_as_uid_10001_without_pip(image: Image) -> None:
    assert image.inspect()["User"] == f"{UID}:{UID}"
    done = image.run("sh", "-c", "id -u; id -g; test ! -e /opt/meridian/bin/pip && echo no-pip")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [UID, UID, "no-pip"]


def test_labels(image: Image) -> None:
    labels = image.inspect()["Labels"]
    oci = "org.opencontainers.image."
    assert labels[oci + "version"] == VERSION
    assert labels[oci + "licenses"] == "Apache-2.0"
    base = labels.get(oci + "base.name", "")
    assert base, "org.opencontainers.image.base.name is empty: PYTHON_IMAGE not seen in the stage"
    if image.base is not None:  # built here by the script: on its base, from this checkout
        assert base == image.base
        assert labels[oci + "revision"] == _git_revision()


class Containers:
    """Detached containers of the test, removed at the end whatever happened."""

    def __init__(self, image: Image) -> None:
        self.image = image
        self.names: list[str] = []

    def start(self, label: str, *command: str, env: dict[str, str] | None = None) -> str:
        name = f"meridian-test-{label}-{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
        done = self.image.podman(
            "run", "--detach", "--name", name, "--network", "host", "--read-only",
            *_ulimits(), *flags, self.image.name, *command,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return name

    def ready_url(self, name: str, timeout: float = 60) -> str:
        """The URL of the container's ``READY <url>`` line, waiting for it."""
        deadline = time.monotonic() + timeout
        logs = ""
        while time.monotonic() < deadline:
            done = self.image.podman("logs", name)
            logs = done.stdout + done.stderr
            for line in logs.splitlines():
                if line.startswith("READY "):
                    return line.removeprefix("READY ").strip()
            state = self.image.podman("inspect", "--format", "{{.State.Status}}", name)
            assert state.stdout.strip() in ("created", "running"), f"{name} stopped:\n{logs}"
            time.sleep(0.3)
        raise AssertionError(f"{name} printed no READY line in {timeout} s:\n{logs}")

    def remove(self) -> None:
        for name in self.names:
            self.image.podman("rm", "--force", "--time", "5", name, timeout=60)


@pytest.fixture
def containers(image: Image) -> Iterator[Containers]:
    started = Containers(image)
    try:
        yield started
    finally:
        started.remove()


def test_agent_in_front_of_a_sim_answers_a_chat_completion(containers: Containers) -> None:
    model = profile.load("cpu-tiny").model
    sim = containers.start(
        "sim", "meridian-sim", "node", "--host", "127.0.0.1", "--port", "0",
        "--profile", "cpu-tiny", "--time-scale", "20",
    )  # fmt: skip
    node = containers.ready_url(sim)
    agent = containers.start(
        "agent", "meridian-agent", "--host", "127.0.0.1", "--port", "0", "--node", node,
        env={"MERIDIAN_AGENT_ADMIN__TOKEN": AGENT_TOKEN},
    )  # fmt: skip
    url = containers.ready_url(agent)
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        answer = client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 8},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == model
        assert body["choices"][0]["message"]["content"]
        # The admin token came from the container's environment.
        assert client.get("/admin/nodes").status_code == 401
        nodes = client.get("/admin/nodes", headers={"Authorization": f"Bearer {AGENT_TOKEN}"})
        assert nodes.status_code == 200, nodes.text
        assert node.removeprefix("http://") in nodes.text
    for name in (sim, agent):  # both still up: neither wrote to its read-only root
        state = containers.image.podman("inspect", "--format", "{{.State.Status}}", name)
        assert state.stdout.strip() == "running", name


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the example names under /etc/meridian/tls/, readable by the image's user: the admin
    API's CA, certificate and key, the etcd CA and the controller's etcd client pair (CN
    meridian-controller). The example itself is mounted unchanged."""
    tmp = tmp_path_factory.mktemp("controller-pki")
    admin_ca = CertAuthority.create(tmp / "admin", name="ca")
    admin = admin_ca.issue("admin", serial=31)
    etcd = make_certs(tmp / "etcd", clients=["meridian-controller"])
    files = {
        "admin.crt": admin.cert,
        "admin.key": admin.key,
        "ca.crt": admin_ca.cert,
        "etcd-ca.crt": etcd.ca,
        "meridian-controller.crt": etcd.cert("meridian-controller"),
        "meridian-controller.key": etcd.key("meridian-controller"),
    }
    text = CONTROLLER.read_text()
    named = set(re.findall(r'^[a-z_]+ = "/etc/meridian/tls/([^"]+)"', text, re.MULTILINE))
    assert named == set(files), named  # every file the example's settings name, and no other
    tls = tmp / "tls"
    tls.mkdir(mode=0o755)
    tls.chmod(0o755)
    for name, source in files.items():
        (tls / name).write_bytes(source.read_bytes())
        (tls / name).chmod(0o644)
    return tls


def _check_controller(image: Image, tls: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return image.run(
        "meridian-controller", "--check-config", "/etc/meridian/controller.toml",
        options=(
            f"--volume={CONTROLLER}:/etc/meridian/controller.toml:ro",
            f"--volume={tls}:/etc/meridian/tls:ro",
            *(f"--env={k}={v}" for k, v in env.items()),
        ),
    )  # fmt: skip


def test_controller_checks_the_example_config(image: Image, tls_dir: Path) -> None:
    """/etc/meridian/controller.env as the example's header describes it: the TSIG secret and
    the replica's advertised URL."""
    done = _check_controller(
        image, tls_dir,
        MERIDIAN_CONTROLLER_DNS__TSIG__SECRET=FAKE_TSIG,
        MERIDIAN_CONTROLLER_API__ADVERTISE_URL=ADVERTISE,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert FAKE_TSIG not in done.stdout + done.stderr
    printed = tomllib.loads(done.stdout)
    assert [r["id"] for r in printed["regions"]] == ["us-east", "eu-west", "eu-central"]
    assert printed["api"]["advertise_url"] == ADVERTISE
    assert printed["dns"]["tsig"]["secret"] == "***"


def test_controller_check_config_refuses_a_missing_secret(image: Image, tls_dir: Path) -> None:
    done = _check_controller(image, tls_dir, MERIDIAN_CONTROLLER_API__ADVERTISE_URL=ADVERTISE)
    assert done.returncode == 2
    assert "dns.tsig.secret: Field required" in done.stderr, done.stderr
