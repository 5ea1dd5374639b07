"""deploy/container/Containerfile, read statically: its stages and instructions, and checkov's
Dockerfile checks.

The image itself is built and run by ``make test-image`` (tests/deploy/test_image.py): on a base
made from Debian's packages alone (scripts/build_image.sh: debootstrap, then buildah), since no
container registry is reachable to pull ``python:3.11-slim-bookworm`` from. What the image
installs, the wheel, is also built and installed into a clean venv by test_wheel.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.deploy.support import DEPLOY, ROOT, checkov_binary, checkov_report

pytestmark = pytest.mark.deploy

CONTAINERFILE = DEPLOY / "container" / "Containerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending += (" " if pending else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, "a continued line never ends"
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def test_two_stages_build_then_runtime() -> None:
    stages = _stages()
    assert [s[0][1].split()[-1] for s in stages] == ["build", "runtime"]
    build, runtime = stages
    assert any("-m build --wheel" in args for op, args in build if op == "RUN")
    run = " ".join(args for op, args in runtime if op == "RUN")
    assert "--no-index" in run and "meridian" in run  # only the wheels made in the build stage
    assert "from=build" in run
    assert not any(op == "COPY" and "--from=build" not in args for op, args in runtime)


def test_base_is_pinned_by_digest() -> None:
    args = [a for op, a in _instructions() if op == "ARG" and a.startswith("PYTHON_IMAGE=")]
    assert len(args) == 1
    assert re.search(r"@sha256:[0-9a-f]{64}$", args[0])
    text = CONTAINERFILE.read_text()
    assert "placeholder" in text and "skopeo inspect" in text  # how to get the real digest
    for stage in _stages():
        assert stage[0][1].startswith("${PYTHON_IMAGE}")


def test_runs_as_a_fixed_non_root_uid() -> None:
    users = [args for op, args in _stages()[-1] if op == "USER"]
    assert users, "the runtime stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) >= 10000, users[-1]
    assert gid.isdigit() and int(gid) != 0


def test_entrypoint_and_ports() -> None:
    runtime = dict(_stages()[-1])
    assert runtime["ENTRYPOINT"] == "[]"  # the command is given at run time
    assert json.loads(runtime["CMD"])[0] in (
        "meridian-agent",
        "meridian-controller",
        "meridian-sim",
    )
    assert set(runtime["EXPOSE"].split()) >= {"8080", "8090", "8091"}
    assert "HEALTHCHECK" not in runtime  # Kubernetes probes the processes


def _referenced_args(text: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


def test_every_build_arg_used_in_a_stage_is_declared_in_it() -> None:
    """An ARG declared before the first FROM is in scope only for FROM lines: a stage that uses
    it (``LABEL ...="${PYTHON_IMAGE}"``) must declare it again after its FROM, or it expands to
    an empty string. Every ``${NAME}`` in a stage's instructions is an ARG or ENV of that stage
    (shell variables of RUN lines aside)."""
    instructions = _instructions()
    global_args = {
        a.split("=", 1)[0]
        for op, a in instructions[: [op for op, _ in instructions].index("FROM")]
        if op == "ARG"
    }
    assert "PYTHON_IMAGE" in global_args
    for stage in _stages():
        declared = {a.split("=", 1)[0] for op, a in stage if op == "ARG"}
        for op, args in stage:
            if op == "ENV":
                declared |= set(re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", args))
        for op, args in stage[1:]:
            if op in ("LABEL", "ENV", "COPY", "WORKDIR", "USER", "EXPOSE"):
                missing = _referenced_args(args) - declared
                assert not missing, f"{stage[0][1]}: {op} uses {missing}, not declared in the stage"
    runtime = _stages()[-1]
    labels = " ".join(args for op, args in runtime if op == "LABEL")
    assert 'base.name="${PYTHON_IMAGE}"' in labels
    assert "PYTHON_IMAGE" in {a.split("=", 1)[0] for op, a in runtime if op == "ARG"}


def test_oci_labels() -> None:
    labels = " ".join(args for op, args in _stages()[-1] if op == "LABEL")
    for key in ("title", "description", "version", "revision", "licenses", "source", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'licenses="Apache-2.0"' in labels


def test_no_secrets() -> None:
    for op, args in _instructions():
        if op in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"(TOKEN|SECRET|PASSWORD|API_KEY)\w*=", args, re.IGNORECASE), args
        if op in ("COPY", "ADD"):
            assert not re.search(r"\.env\b|\.key\b|\.pem\b|id_rsa|\.netrc", args), args
    assert "ADD" not in dict(_instructions())


def test_copies_every_package_of_the_wheel() -> None:
    """The build stage copies exactly what pyproject.toml packages (a new package must be
    added there too, or the wheel silently lacks it)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {args.split()[0].rstrip("/") for op, args in _stages()[0] if op == "COPY"}
    assert packages <= copied, packages - copied


def test_checkov_dockerfile_checks(tmp_path: Path) -> None:
    """checkov's Dockerfile checks pass or are skipped with a reason in the file. checkov only
    recognises files named Dockerfile, so it reads a copy under that name."""
    shutil.copy(CONTAINERFILE, tmp_path / "Dockerfile")
    proc = subprocess.run(
        [checkov_binary(), "-f", "Dockerfile", "--framework", "dockerfile", "-o", "json",
         "--skip-download"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    summary, results = checkov_report(proc.stdout, "dockerfile")
    assert summary["failed"] == 0, json.dumps(results["failed_checks"], indent=1)
    assert summary["passed"] > 50, summary
    skips = re.findall(r"^# checkov:skip=(CKV\w*_\d+):(.{20,})$", CONTAINERFILE.read_text(), re.M)
    assert summary["skipped"] == len(skips) > 0, (summary, skips)
    for skipped in results["skipped_checks"]:
        assert len(skipped["check_result"].get("suppress_comment", "")) > 20, skipped["check_id"]
    if "skipped_checks" in results["listed"]:
        assert {c["check_id"] for c in results["skipped_checks"]} == {c for c, _ in skips}
