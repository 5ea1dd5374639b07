"""What the deploy tests share: paths, the fake values given to the example's variables, HCL read
with python-hcl2, the example evaluated by :mod:`tests.deploy.hcleval` (its module blocks'
arguments, the modules' variables, locals and outputs, as Terraform would evaluate them), the
console scripts run as an operator runs them, and the real Terraform binary when there is one.

The example's own variables (images, secrets) get the fake values of :data:`EXAMPLE_VARS`; every
other value comes from the .tf files themselves.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import hcl2

from tests.deploy import hcleval

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TERRAFORM = DEPLOY / "terraform"
REGION = TERRAFORM / "modules" / "region"
GLOBAL = TERRAFORM / "modules" / "global"
EXAMPLE = TERRAFORM / "examples" / "three-regions"
REGION_MODULES = ("us_east", "eu_west", "eu_central")
REGION_IDS = ("us-east", "eu-west", "eu-central")
BIN = Path(sys.executable).parent

FAKE_DIGEST = "0" * 64
FAKE_CERT = "-----BEGIN CERTIFICATE-----\nZmFrZSBjZXJ0aWZpY2F0ZQ==\n-----END CERTIFICATE-----\n"
FAKE_KEY = "-----BEGIN PRIVATE KEY-----\nZmFrZSBrZXk=\n-----END PRIVATE KEY-----\n"
# As tsig-keygen makes one: 32 random bytes (not UTF-8), base64.
FAKE_TSIG = base64.b64encode(bytes(range(200, 232))).decode()

# The example's variables (deploy/terraform/examples/three-regions/variables.tf) with fake values.
EXAMPLE_VARS: dict[str, Any] = {
    "meridian_image": f"registry.example.com/meridian@sha256:{FAKE_DIGEST}",
    "vllm_image": f"docker.io/vllm/vllm-openai@sha256:{FAKE_DIGEST}",
    "etcd_image": f"gcr.io/etcd-development/etcd@sha256:{FAKE_DIGEST}",
    "bind_image": f"docker.io/internetsystemsconsortium/bind9@sha256:{FAKE_DIGEST}",
    "admin_tls_cert": FAKE_CERT,
    "admin_tls_key": FAKE_KEY,
    "tsig_secret": FAKE_TSIG,
    "hf_token": "",
    "agent_admin_tokens": {r: f"fake-agent-admin-token-for-{r}-tests-only" for r in REGION_IDS},
    "etcd_ca_cert": FAKE_CERT,
    "etcd_member_cert": FAKE_CERT,
    "etcd_member_key": FAKE_KEY,
    "controller_etcd_cert": FAKE_CERT,
    "controller_etcd_key": FAKE_KEY,
    "etcd_root_cert": FAKE_CERT,
    "etcd_root_key": FAKE_KEY,
    "agent_etcd_certs": {r: FAKE_CERT for r in REGION_IDS},
    "agent_etcd_keys": {r: FAKE_KEY for r in REGION_IDS},
}


ETCD_CLIENTS = ("root", "meridian-controller", "agent-us-east", "agent-eu-west", "agent-eu-central")


def real_pki(directory: Path) -> dict[str, Any]:
    """:data:`EXAMPLE_VARS` with real certificates and keys (Debian's ``openssl``) in place of
    the fake ones: an etcd CA, the members' certificate (serverAuth and clientAuth, SAN
    127.0.0.1, so that members on loopback can run with it), a client certificate per etcd user
    (CN root, meridian-controller, agent-<region>), and the admin API's pair. What the modules'
    Secrets then hold loads where the rendered settings name it, as in a pod."""
    from tests.support.certs import CertAuthority
    from tests.support.etcd import make_certs

    etcd = make_certs(directory / "etcd", clients=ETCD_CLIENTS, host="127.0.0.1")
    admin = CertAuthority.create(directory / "admin", name="ca").issue("admin", serial=41)

    def pem(path: Path) -> str:
        return path.read_text()

    return {
        **EXAMPLE_VARS,
        "admin_tls_cert": pem(admin.cert),
        "admin_tls_key": pem(admin.key),
        "etcd_ca_cert": pem(etcd.ca),
        "etcd_member_cert": pem(etcd.server_cert),
        "etcd_member_key": pem(etcd.server_key),
        "controller_etcd_cert": pem(etcd.cert("meridian-controller")),
        "controller_etcd_key": pem(etcd.key("meridian-controller")),
        "etcd_root_cert": pem(etcd.cert("root")),
        "etcd_root_key": pem(etcd.key("root")),
        "agent_etcd_certs": {r: pem(etcd.cert(f"agent-{r}")) for r in REGION_IDS},
        "agent_etcd_keys": {r: pem(etcd.key(f"agent-{r}")) for r in REGION_IDS},
    }


def subject_cn(pem_file: Path) -> str:
    """The CN of a PEM certificate's subject, as ``openssl x509 -subject`` reads it."""
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in", str(pem_file)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    fields = dict(part.split("=", 1) for part in out.strip().removeprefix("subject=").split(","))
    return fields["CN"]


def write_secret(data: Mapping[str, str], directory: Path) -> Path:
    """A Secret's ``data`` as the kubelet mounts it: one file per key (0600 here)."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in data.items():
        assert "/" not in key and value is not None, key
        path = directory / key
        path.write_text(value)
        path.chmod(0o600)
    return directory


def tls_copy(example: Path, tls: Path, files: Mapping[str, Path]) -> str:
    """An example file's text with /etc/meridian/tls/ moved to ``tls``, which gets ``files``
    (name in the example -> a real file): the only change made to it. A start reads them."""
    tls.mkdir(parents=True, exist_ok=True)
    text = example.read_text()
    named = set(re.findall(r'^[a-z_]+ = "/etc/meridian/tls/([^"]+)"', text, re.MULTILINE))
    assert named == set(files), named  # every file the example's settings name, and no other
    for name, source in files.items():
        (tls / name).write_bytes(source.read_bytes())
    return text.replace("/etc/meridian/tls/", f"{tls}/")


# -- HCL ---------------------------------------------------------------------------------------


def load_hcl(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return dict(hcl2.load(f))


def unquote(value: Any) -> Any:
    """python-hcl2 keeps quotes on strings and labels: ``'"eu"'`` -> ``'eu'``, recursively;
    its ``__is_block__``/``__comments__`` bookkeeping is dropped."""
    if isinstance(value, str):
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return json.loads(value)
        return value
    if isinstance(value, list):
        return [unquote(v) for v in value]
    if isinstance(value, dict):
        return {
            unquote(k): unquote(v)
            for k, v in value.items()
            if k not in ("__is_block__", "__comments__")
        }
    return value


def blocks(path: Path, kind: str) -> dict[str, dict[str, Any]]:
    """Every ``kind "label" { ... }`` block of one file (variable, output, module), by label."""
    out: dict[str, dict[str, Any]] = {}
    for entry in load_hcl(path).get(kind, []):
        for label, body in entry.items():
            out[unquote(label)] = body
    return out


def locals_of(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for entry in load_hcl(path).get("locals", []):
        out.update({k: v for k, v in entry.items() if k != "__is_block__"})
    return out


def resources(directory: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(type, name, body) of every resource in a module's .tf files."""
    found = []
    for tf in sorted(directory.glob("*.tf")):
        for entry in load_hcl(tf).get("resource", []):
            for rtype, named in entry.items():
                for name, body in named.items():
                    found.append((unquote(rtype), unquote(name), body))
    return found


# -- the example, evaluated -------------------------------------------------------------------


class _Outputs(Mapping[str, Any]):
    """``module.<name>``: a module's outputs, each evaluated when it is read."""

    def __init__(self, module: hcleval.Module) -> None:
        self._module = module
        self._names = [b.labels[0] for b in module.root.children("output")]

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._module.output(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class Example(Mapping[str, Any]):
    """deploy/terraform/examples/three-regions as Terraform evaluates it, less the providers:
    its variables (:data:`EXAMPLE_VARS`), its locals, each module block's arguments, and each
    module with those arguments as its inputs (``example.module("eu_west")``). As a mapping it
    is the ``module`` of the example's scope (``module.global.etcd_client_urls``)."""

    def __init__(self, variables: Mapping[str, Any] = EXAMPLE_VARS) -> None:
        files = [p.name for p in sorted(EXAMPLE.glob("*.tf")) if p.name != "providers.tf"]
        self.root = hcleval.Module(EXAMPLE, variables, files=files)
        self.blocks = {b.labels[0]: b for b in self.root.root.children("module")}
        self._modules: dict[str, hcleval.Module] = {}
        self.root.scope.names["module"] = self

    def source(self, name: str) -> Path:
        source = hcleval.evaluate(self.blocks[name].attributes["source"], hcleval.Scope())
        return (EXAMPLE / source).resolve()

    def inputs(self, name: str) -> dict[str, Any]:
        skip = ("source", "providers")
        body = self.blocks[name].attributes
        return {k: hcleval.evaluate(v, self.root.scope) for k, v in body.items() if k not in skip}

    def module(self, name: str) -> hcleval.Module:
        if name not in self._modules:
            self._modules[name] = hcleval.Module(self.source(name), self.inputs(name))
        return self._modules[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self.blocks:
            raise KeyError(name)
        return _Outputs(self.module(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)


# -- the console scripts -----------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the developer's MERIDIAN_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN")}
    return {**env, **extra}


def check_config(
    script: str, path: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``<script> --check-config PATH ARGS``: the real console script of this venv."""
    return subprocess.run(
        [str(BIN / script), "--check-config", str(path), *args],
        env=dict(env) if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- checkov -----------------------------------------------------------------------------------


def checkov_binary() -> str:
    checkov = os.environ.get("CHECKOV") or shutil.which("checkov")
    assert checkov, "checkov is missing: run `make test-deploy` (it installs it in .venv-deploy)"
    return checkov


def checkov_report(stdout: str, check_type: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The summary and the result lists of one framework in checkov's ``-o json`` output.

    checkov prints one object for one framework and a list of them for several; a framework
    with nothing to scan is an object without results; ``--quiet`` leaves out passed and
    skipped checks (checkov 3.3.30: ``results`` holds ``failed_checks`` alone). Every list is
    here, empty when checkov left it out; whether skips were listed is
    ``"skipped_checks" in results`` of the raw report, which callers check before relying on
    the list."""
    report = json.loads(stdout)
    reports = report if isinstance(report, list) else [report]
    found = [r for r in reports if isinstance(r, dict) and r.get("check_type") == check_type]
    assert len(found) == 1, f"no single {check_type} report in checkov's output: {stdout[:2000]}"
    raw = found[0].get("results", {})
    lists = {
        key: list(raw.get(key, []))
        for key in ("passed_checks", "failed_checks", "skipped_checks", "parsing_errors")
    }
    lists["listed"] = [key for key in raw if key.endswith("_checks")]
    return dict(found[0]["summary"]), lists


# -- the real Terraform, where there is one ----------------------------------------------------


def terraform_binary() -> str | None:
    return shutil.which("terraform")


def terraform_env(home: Path) -> dict[str, str]:
    """No CLI config, no checkpoint calls, no colours: offline and quiet."""
    env = dict(os.environ)
    empty = home / "terraformrc"
    empty.write_text("")
    env.update(
        TF_CLI_CONFIG_FILE=str(empty),
        CHECKPOINT_DISABLE="1",
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        TF_DATA_DIR=str(home / ".terraform"),
    )
    return env


def scratch_module(source: Path, dest: Path, files: list[str]) -> Path:
    """A provider-free copy of the parts of a module that need no provider (its variables,
    config.tf's locals, its templates): Terraform evaluates those offline."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copy(source / name, dest / name)
    if (source / "templates").is_dir():
        shutil.copytree(source / "templates", dest / "templates", dirs_exist_ok=True)
    return dest


def terraform(
    args: list[str], *, cwd: Path, env: Mapping[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    binary = terraform_binary()
    assert binary is not None
    proc = subprocess.run(
        [binary, *args, "-no-color"] if args[0] != "output" else [binary, *args],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"terraform {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc
