"""deploy/terraform: the HCL parses, the modules follow the standard structure, every input is
typed, documented and validated, the configs the modules render are accepted by Meridian's
own ``--check-config`` (and BIND's by ``named-checkconf``), every workload is hardened, and
checkov passes.

No Terraform provider can be downloaded here, so ``terraform validate`` and ``plan`` of the
modules with their resources are never run, with or without a binary. What runs:

- always (CI included: Debian has no terraform package): python-hcl2 parses every file;
  :mod:`tests.deploy.hcleval` evaluates the example as Terraform would, less the providers
  (its module blocks' arguments, each module's variables converted to their types, every
  validation block, the provider-free locals of config.tf and the outputs they feed, the
  templates through ``templatefile``); the rendered configs go to the real console scripts'
  ``--check-config`` and ``named-checkconf``; every validation block is shown to refuse an
  out-of-range value with its message, evaluated in Python;
- only where a ``terraform`` binary is on PATH (marked ``needs_terraform``, skipped with that
  reason elsewhere): ``terraform fmt -check``; a provider-free copy of each module (its
  variables.tf and config.tf, the global one's outputs.tf) initialised offline and applied, to
  show that Terraform renders byte for byte what hcleval renders; and ``terraform plan`` of
  the variables alone with each out-of-range value, to show that Terraform refuses it with the
  same message as the Python evaluation.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dns import query as dns_query
from dns import rcode as dns_rcode
from dns import update as dns_update

from tests.deploy import hcleval, tfdocs, tftemplate
from tests.deploy import support as s
from tests.support import BindServer

pytestmark = pytest.mark.deploy

MODULE_DIRS = [s.REGION, s.GLOBAL, s.EXAMPLE]
TLS_DIR = "/etc/meridian/tls"  # the controller's TLS Secret's mount (modules/global/config.tf)
ADVERTISE = (
    "https://meridian-controller-0.meridian-controller-peers.meridian-global.svc.cluster.local:8091"
)
needs_terraform = pytest.mark.skipif(
    s.terraform_binary() is None,
    reason="no terraform binary on PATH (Debian and PyPI have none): Terraform's own rendering "
    "and validation are not compared; the hcleval tests of the same still run",
)

# Variables whose values can be out of range: each must have a validation block.
VALIDATED = {
    s.REGION: [
        "region_id", "geo", "residency", "namespace", "endpoints", "etcd_endpoints",
        "etcd_ca_cert", "etcd_client_cert", "etcd_client_key", "model", "vllm_image",
        "agent_image", "vllm_replicas", "gpus_per_node", "agent_replicas",
        "agent_shutdown_delay_s", "slots_per_node", "vllm_port", "agent_port", "public_port",
        "load_balancer_ip", "admin_token", "model_cache_size",
    ],
    s.GLOBAL: [
        "namespace", "regions", "latency_ms", "etcd_replicas", "etcd_external_endpoints",
        "etcd_ca_cert", "etcd_member_cert", "etcd_member_key", "controller_etcd_cert",
        "controller_etcd_key", "etcd_root_cert", "etcd_root_key",
        "etcd_image", "etcd_storage_size", "etcd_load_balancer_ip", "controller_image",
        "controller_replicas", "read_port", "admin_port", "admin_load_balancer_ip",
        "admin_tls_cert", "admin_tls_key", "admin_tokens", "dns_zone", "dns_views",
        "dns_ttl_s", "tsig_secret", "external_dns_server", "bind_image", "bind_cluster_ip",
        "dns_load_balancer_ip", "dns_nameservers", "hostmaster",
    ],
    s.EXAMPLE: [
        "kube_contexts", "meridian_image", "vllm_image", "etcd_image", "bind_image",
        "agent_etcd_certs", "agent_etcd_keys",
    ],
}  # fmt: skip
# A PEM private key under a passphrase: refused (the processes read keys without one).
ENCRYPTED_KEY = (
    "-----BEGIN ENCRYPTED PRIVATE KEY-----\nZmFrZSBrZXk=\n-----END ENCRYPTED PRIVATE KEY-----\n"
)


@pytest.fixture(scope="module")
def example() -> s.Example:
    return s.Example()


@pytest.fixture(scope="module")
def pki_example(tmp_path_factory: pytest.TempPathFactory) -> s.Example:
    """The example with real certificates and keys (:func:`support.real_pki`): what its
    Secrets hold then loads, as in a pod."""
    return s.Example(s.real_pki(tmp_path_factory.mktemp("pki")))


def _tf_files() -> list[Path]:
    return sorted(s.TERRAFORM.rglob("*.tf"))


# -- HCL and structure -------------------------------------------------------------------------


@pytest.mark.parametrize("path", _tf_files(), ids=lambda p: str(p.relative_to(s.TERRAFORM)))
def test_hcl_parses(path: Path) -> None:
    assert s.load_hcl(path)
    assert hcleval.load_file(path).blocks


@pytest.mark.parametrize("module", MODULE_DIRS, ids=lambda p: p.name)
def test_standard_module_structure(module: Path) -> None:
    """main.tf, variables.tf, outputs.tf and versions.tf; Terraform itself and every provider
    pinned to a range of versions."""
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf"):
        assert (module / name).is_file(), f"{module.name}/{name}"
    terraform = s.load_hcl(module / "versions.tf")["terraform"][0]
    assert re.match(r'^">= 1\.\d+\.\d+, < 2\.0\.0"$', terraform["required_version"])
    providers = terraform["required_providers"][0]
    assert providers
    for name, provider in providers.items():
        if name.startswith("__"):
            continue
        assert re.fullmatch(r"[\w-]+/[\w-]+", s.unquote(provider["source"])), name
        assert re.fullmatch(r"~> \d+\.\d+", s.unquote(provider["version"])), name


@pytest.mark.parametrize("module", MODULE_DIRS, ids=lambda p: p.name)
def test_every_variable_and_output_is_typed_and_described(module: Path) -> None:
    variables = s.blocks(module / "variables.tf", "variable")
    assert variables
    for name, body in variables.items():
        assert "type" in body, f"{module.name}: variable {name} has no type"
        assert len(s.unquote(body.get("description", ""))) > 10, f"{name}: no description"
    outputs = s.blocks(module / "outputs.tf", "output")
    assert outputs
    for name, body in outputs.items():
        assert len(s.unquote(body.get("description", ""))) > 10, f"output {name}: no description"


@pytest.mark.parametrize("module", MODULE_DIRS, ids=lambda p: p.name)
def test_every_input_and_output_is_in_the_readme(module: Path) -> None:
    readme = (module / "README.md").read_text()
    assert "## Inputs" in readme and "## Outputs" in readme
    for kind, file in (("variable", "variables.tf"), ("output", "outputs.tf")):
        for name in s.blocks(module / file, kind):
            assert f"`{name}`" in readme, f"{module.name}/README.md: {kind} {name} not listed"


@pytest.mark.parametrize("module", MODULE_DIRS, ids=lambda p: p.name)
def test_readme_tables_are_made_from_the_tf_files(module: Path) -> None:
    """The Inputs and Outputs tables are what tests/deploy/tfdocs.py makes of variables.tf and
    outputs.tf (`python -m tests.deploy.tfdocs` rewrites them): every row, in file order, with
    its description, type and default as the .tf files say."""
    readme = (module / "README.md").read_text()
    assert tfdocs.inputs_table(module) in readme
    assert tfdocs.outputs_table(module) in readme
    assert tfdocs.render(module) == readme


def test_readme_tables_render_types_and_defaults() -> None:
    """Rows as the .tf files declare them: object types, defaults, required inputs."""
    table = tfdocs.inputs_table(s.REGION)
    assert "| `agent_shutdown_delay_s` |" in table and "| `number` | `5` | no |" in table
    assert "| `etcd_client_key` | Unencrypted PEM private key" in table
    assert '`object({ cpu = string, memory = string })` | `{ cpu = "2", memory = "1Gi" }`' in table
    assert "| `admin_token` |" in table and "| `string` | n/a | yes |" in table


@pytest.mark.parametrize(
    ("module", "name"),
    [(m, n) for m, names in VALIDATED.items() for n in names],
    ids=lambda v: v.name if isinstance(v, Path) else v,
)
def test_validation_blocks(module: Path, name: str) -> None:
    """A condition on the variable itself, and a message that says what to write."""
    body = s.blocks(module / "variables.tf", "variable")[name]
    validations = body.get("validation", [])
    assert validations, f"{module.name}: variable {name} has no validation block"
    for v in validations:
        assert f"var.{name}" in v["condition"], v["condition"]
        message = s.unquote(v["error_message"])
        assert message.endswith((".", ")")) and len(message) > 30, message


@pytest.mark.parametrize("module", MODULE_DIRS, ids=lambda p: p.name)
def test_every_number_is_validated(module: Path) -> None:
    """A number always has a range (ports, replicas, TTLs): a new one without a validation
    block fails here, not in production."""
    for name, body in s.blocks(module / "variables.tf", "variable").items():
        if "number" in body["type"]:
            assert name in VALIDATED[module], f"{module.name}: number {name} is not validated"


# -- the example's values, evaluated -----------------------------------------------------------


def test_the_example_passes_every_validation_block(example: s.Example) -> None:
    assert example.root.invalid() == []
    for name in example.blocks:
        module = example.module(name)
        assert module.invalid() == [], name
        assert module.var  # every variable converted to its type


def test_the_example_wires_the_regions_to_the_global_etcd(example: s.Example) -> None:
    glob = example.module("global")
    urls = glob.output("etcd_client_urls")
    assert urls == ["https://10.30.0.100:2379"]  # the internal balancer (etcd_load_balancer_ip)
    assert glob.output("etcd_tls_ip_addresses") == ["10.30.0.100"]  # so its IP is in the cert
    assert glob.output("etcd_tls_dns_names") == ["*.etcd-peers.meridian-global.svc.cluster.local"]
    users = glob.output("etcd_users")["regions"]
    for name in s.REGION_MODULES:
        region = example.module(name)
        assert region.var["etcd_endpoints"] == urls
        assert region.var["etcd_ca_cert"] == glob.var["etcd_ca_cert"]  # one CA for the fleet
        assert region.output("etcd_user") == users[region.var["region_id"]]
    # each region its own certificate: the module block names its own region's entry
    us_east = example.module("us_east").var["etcd_client_cert"]
    assert example.inputs("us_east")["etcd_client_cert"] == us_east
    assert 'agent_etcd_certs["us-east"]' in (s.EXAMPLE / "main.tf").read_text()


def test_the_examples_etcd_certificates_fit_the_modules(tmp_path: Path) -> None:
    """The `openssl` commands of the example's README, "etcd certificates", run as written:
    their certificates and keys pass every validation block as the example's variables, the
    members' certificate names outputs etcd_tls_dns_names and etcd_tls_ip_addresses, and each
    client certificate's CN is the etcd user output etcd_users gives it."""
    readme = (s.EXAMPLE / "README.md").read_text()
    section = readme[readme.index("## etcd certificates") :]
    script = section[section.index("```sh\n") + 6 : section.index("```\n", 10)]
    assert "mkdir pki" in script and "openssl x509 -req" in script
    done = subprocess.run(["bash", "-euc", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    pki = tmp_path / "pki"

    def pem(name: str) -> str:
        return (pki / name).read_text()

    variables = {
        **s.EXAMPLE_VARS,
        "etcd_ca_cert": pem("etcd-ca.crt"),
        "etcd_member_cert": pem("member.crt"),
        "etcd_member_key": pem("member.key"),
        "controller_etcd_cert": pem("meridian-controller.crt"),
        "controller_etcd_key": pem("meridian-controller.key"),
        "etcd_root_cert": pem("root.crt"),
        "etcd_root_key": pem("root.key"),
        "agent_etcd_certs": {r: pem(f"agent-{r}.crt") for r in s.REGION_IDS},
        "agent_etcd_keys": {r: pem(f"agent-{r}.key") for r in s.REGION_IDS},
    }
    example = s.Example(variables)
    assert example.root.invalid() == []
    for name in example.blocks:
        assert example.module(name).invalid() == [], name
    glob = example.module("global")
    sans = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(pki / "member.crt")],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    for dns in glob.output("etcd_tls_dns_names"):
        assert f"DNS:{dns}" in sans, sans
    for ip in glob.output("etcd_tls_ip_addresses"):
        assert f"IP Address:{ip}" in sans, sans
    users = glob.output("etcd_users")
    assert s.subject_cn(pki / "root.crt") == users["root"]
    assert s.subject_cn(pki / "meridian-controller.crt") == users["controller"]
    for region, user in users["regions"].items():
        assert s.subject_cn(pki / f"agent-{region}.crt") == user


def test_the_admin_certificate_names_what_meridianctl_dials(example: s.Example) -> None:
    """The example's MERIDIAN_URL is the admin balancer's address: the certificate must carry it
    as an IP subjectAltName, and the outputs say so."""
    glob = example.module("global")
    address = glob.var["admin_load_balancer_ip"]
    assert glob.output("admin_tls_ip_addresses") == [address] == ["10.30.0.91"]
    assert example.root.output("admin_tls_ip_addresses") == [address]
    readme = (s.EXAMPLE / "README.md").read_text()
    assert f"MERIDIAN_URL=https://{address}:{glob.var['admin_port']}" in readme
    assert "admin_tls_ip_addresses" in readme
    without = hcleval.Module(s.GLOBAL, {**example.inputs("global"), "admin_load_balancer_ip": None})
    assert without.output("admin_tls_ip_addresses") == []


def test_delegation_records(example: s.Example) -> None:
    expected = [
        "meridian.example. 86400 IN NS ns1.meridian.example.",
        "ns1.meridian.example. 86400 IN A 203.0.113.53",
    ]
    assert example.module("global").output("dns_delegation_records") == expected
    assert example.root.output("dns_delegation_records") == expected


# -- validation blocks refuse out-of-range values (in Python; with Terraform below) ------------


def _regions() -> list[dict[str, Any]]:
    return [
        {"id": "us-east", "geo": "us", "residency": [], "backups": [], "lat": 39, "lon": -77},
        {"id": "eu-west", "geo": "eu", "residency": ["eu"], "backups": ["us-east"], "lat": 53,
         "lon": -6},
    ]  # fmt: skip


def _bad_values() -> list[tuple[Path, str, Any, str, str]]:
    """(module, variable, value, words of the message, the variable whose validation refuses
    it: the variable itself unless a fifth element says which)."""
    rows = _bad_rows()
    return [(*row, row[1]) if len(row) == 4 else row for row in rows]


def _bad_rows() -> list[tuple[Any, ...]]:
    us, eu = _regions()
    r, g = s.REGION, s.GLOBAL
    token = {"name": "a", "role": "admin", "sha256": "0" * 64}
    return [
        (r, "region_id", "EU_West", "region_id must be 1-63 lowercase"),
        (r, "region_id", "-eu", "region_id must be"),
        (r, "geo", "Europe", "geo must be"),
        (r, "residency", ["EU"], "residency tag must be"),
        (r, "namespace", "default", "namespace must be a DNS label"),
        (r, "endpoints", ["ftp://192.0.2.10"], "endpoints must hold"),
        (r, "endpoints", [], "endpoints must hold"),
        (r, "etcd_endpoints", ["http://10.0.0.1:2379"], "plaintext http:// but etcd_ca_cert"),
        (r, "etcd_endpoints", ["https://10.0.0.1:2379", "http://10.0.0.2:2379"], "all of one"),
        (r, "etcd_endpoints", ["https://10.0.0.1:2379/v3"], "etcd_endpoints must hold"),
        (r, "etcd_ca_cert", None, "https:// etcd_endpoints need etcd_ca_cert", "etcd_endpoints"),
        (r, "etcd_ca_cert", "ca.crt", "etcd_ca_cert must be a PEM certificate"),
        (r, "etcd_client_cert", None, "need etcd_client_cert and", "etcd_endpoints"),
        (r, "etcd_client_cert", s.FAKE_KEY, "etcd_client_cert must be a PEM certificate"),
        (r, "etcd_client_key", None, "and etcd_client_key: the region's", "etcd_endpoints"),
        (r, "etcd_client_key", ENCRYPTED_KEY, "must be an unencrypted PEM private key"),
        (r, "etcd_client_key", s.FAKE_CERT, "must be an unencrypted PEM private key"),
        (r, "agent_shutdown_delay_s", 90, "agent_shutdown_delay_s must be"),
        (r, "model", " ", "model must name"),
        (r, "vllm_image", "vllm/vllm-openai:latest", "pinned by digest"),
        (r, "agent_image", "meridian:0.1.0", "pinned by digest"),
        (r, "vllm_replicas", 0, "vllm_replicas must be a whole number of at least 1"),
        (r, "agent_replicas", 1.5, "agent_replicas must be a whole number"),
        (r, "gpus_per_node", 3, "gpus_per_node must be 1, 2, 4 or 8"),
        (r, "slots_per_node", 0, "slots_per_node must be"),
        (r, "vllm_port", 70000, "vllm_port must be"),
        (r, "agent_port", 80, "agent_port must be a whole number from 1024"),
        (r, "public_port", 0, "public_port must be"),
        (r, "load_balancer_ip", "eu-west.example", "load_balancer_ip must be an IPv4 or IPv6"),
        (r, "admin_token", "short", "at least 32 characters"),
        (r, "model_cache_size", "200GB", "model_cache_size must be"),
        (g, "regions", [{**us, "id": "US_East"}], "regions[].id must be"),
        (g, "regions", [{**eu, "residency": ["EU"], "backups": []}], "residency tag"),
        (g, "regions", [{**us, "backups": ["mars"]}], "backups entry must be"),
        (g, "regions", [us, eu], "must meet every residency tag"),
        (g, "regions", [{**us, "lat": 91}], "lat must be within"),
        (g, "latency_ms", {"us-east": {"eu-west": -1}}, "must be >= 0"),
        (g, "etcd_replicas", 4, "etcd_replicas must be 3 or 5"),
        (g, "etcd_external_endpoints", ["http://10.0.0.1:2379"], "over TLS only"),
        (g, "etcd_ca_cert", "-----BEGIN CERTIFICATE-----", "etcd_ca_cert must be a PEM"),
        (g, "etcd_member_cert", None, "unless etcd_external_endpoints is set"),
        (g, "etcd_member_key", ENCRYPTED_KEY, "etcd_member_key must be an unencrypted"),
        (g, "controller_etcd_cert", "meridian-controller.crt", "with CN meridian-controller"),
        (g, "controller_etcd_key", s.FAKE_CERT, "controller_etcd_key must be an unencrypted"),
        (g, "etcd_root_cert", "", "etcd_root_cert must be a PEM certificate"),
        (g, "etcd_root_key", ENCRYPTED_KEY, "etcd_root_key must be an unencrypted"),
        (g, "etcd_image", "etcd:v3.5", "pinned by digest"),
        (g, "etcd_storage_size", "20GB", "etcd_storage_size must be"),
        (g, "etcd_load_balancer_ip", "etcd.example", "etcd_load_balancer_ip must be"),
        (g, "controller_image", "meridian:latest", "pinned by digest"),
        (g, "controller_replicas", 0, "controller_replicas must be"),
        (g, "read_port", 80, "read_port must be"),
        (g, "admin_port", 8090, "other than read_port"),
        (g, "admin_load_balancer_ip", "x", "admin_load_balancer_ip must be"),
        (g, "admin_tls_cert", "cert", "admin_tls_cert must be a PEM certificate"),
        (g, "admin_tls_key", "key", "admin_tls_key must be a PEM private key"),
        (g, "admin_tokens", [{**token, "sha256": "my-token"}], "never the token"),
        (g, "admin_tokens", [{**token, "role": "root"}], "role must be"),
        (g, "admin_tokens", [token, {**token, "role": "viewer", "sha256": "1" * 64}], "unique"),
        (g, "dns_zone", "meridian.example", "ending with a dot"),
        (g, "dns_views", [], "at least one view"),
        (g, "dns_views", [{"name": "eu", "geo": "EU", "match_clients": []}], "geo must be"),
        (g, "dns_ttl_s", -1, "dns_ttl_s must be"),
        (g, "tsig_secret", "not base64!", "tsig_secret must be base64"),
        (g, "tsig_secret", "c2hvcnQ=", "tsig_secret must be base64 of at least 16"),
        (g, "external_dns_server", "ns1.example.", "takes no host name"),
        (g, "bind_image", "bind9:9.18", "pinned by digest"),
        (g, "bind_cluster_ip", "bind", "bind_cluster_ip must be"),
        (g, "dns_load_balancer_ip", "x", "dns_load_balancer_ip must be"),
        (g, "dns_nameservers", [{"name": "ns1.meridian.example", "address": "203.0.113.53"}],
         "ending with a dot"),
        (g, "dns_nameservers", [{"name": "ns1.meridian.example.", "address": "ns1"}],
         "(the glue record)"),
        (g, "hostmaster", "hostmaster@meridian.example", "hostmaster must be"),
    ]  # fmt: skip


def _good_values() -> list[tuple[Path, str, Any]]:
    """In range, other than the example's: a validation block must not refuse these."""
    r, g = s.REGION, s.GLOBAL
    return [
        (r, "load_balancer_ip", "2001:db8::10"),
        (r, "gpus_per_node", 8),
        (r, "residency", ["eu", "de"]),
        (r, "endpoints", ["https://eu.example.com:8443", "http://198.51.100.11"]),
        (r, "etcd_endpoints", ["https://etcd-1.example.internal", "https://[2001:db8::1]:2379"]),
        (r, "etcd_client_key", s.FAKE_KEY.replace("PRIVATE KEY", "EC PRIVATE KEY")),
        (r, "agent_shutdown_delay_s", 0),
        (g, "etcd_external_endpoints", ["https://etcd-1.example.internal:2379"]),
        (g, "etcd_replicas", 3),
        (g, "tsig_secret", "bWVyaWRpYW4tdHNpZy1zZWNyZXQtYnl0ZXM="),  # ASCII bytes, padded
        (g, "external_dns_server", "2001:db8::53"),
        (g, "dns_ttl_s", 0),
        (g, "latency_ms", {}),
    ]


def _ids(rows: list[tuple[Any, ...]]) -> list[str]:
    return [f"{row[0].name}-{row[1]}-{i}" for i, row in enumerate(rows)]


def _baseline(example: s.Example, module: Path) -> dict[str, Any]:
    """The example's inputs of ``module`` (us_east for the region module)."""
    return example.inputs("us_east" if module == s.REGION else "global")


@pytest.mark.parametrize(
    ("module", "name", "value", "message", "refused_on"), _bad_values(), ids=_ids(_bad_values())
)
def test_validation_refuses_an_out_of_range_value(
    example: s.Example, module: Path, name: str, value: Any, message: str, refused_on: str
) -> None:
    """Every validation condition evaluated by hcleval on the example's values with ``name``
    replaced: one refuses it with a message that says what to write, and no other variable
    than ``refused_on`` (``name`` itself, or the one whose validation ties them) is refused."""
    evaluated = hcleval.Module(module, {**_baseline(example, module), name: value})
    refused = evaluated.invalid()
    assert refused, f"{name}={value!r} was accepted"
    assert {r.variable for r in refused} == {refused_on}
    assert any(message in r.message for r in refused), [r.message for r in refused]


@pytest.mark.parametrize(("module", "name", "value"), _good_values(), ids=_ids(_good_values()))
def test_validation_accepts_an_in_range_value(
    example: s.Example, module: Path, name: str, value: Any
) -> None:
    evaluated = hcleval.Module(module, {**_baseline(example, module), name: value})
    assert evaluated.invalid() == []


CYCLIC_VARIABLES = """
variable "a" {
  type    = string
  default = "x"
  validation {
    condition     = var.a != "" || var.b != ""
    error_message = "a or b must be set."
  }
}

variable "b" {
  type    = string
  default = "y"
  validation {
    condition     = var.b == "" || var.a != ""
    error_message = "b needs a."
  }
}
"""


def test_validations_that_refer_to_each_other_are_a_cycle(tmp_path: Path) -> None:
    """Terraform refuses two variables whose validations refer to each other (the region
    module's TLS inputs once did): hcleval refuses them too, so CI, without the binary, sees it;
    one-way references (the modules' own) are fine."""
    (tmp_path / "variables.tf").write_text(CYCLIC_VARIABLES)
    with pytest.raises(hcleval.HclError, match=r"Cycle: var\.a \(validation\), var\.b"):
        hcleval.Module(tmp_path, {})
    (tmp_path / "variables.tf").write_text(
        CYCLIC_VARIABLES.replace('var.b == "" || var.a', "var.b")
    )
    assert hcleval.Module(tmp_path, {}).invalid() == []


@needs_terraform
def test_terraform_refuses_the_same_cycle(tmp_path: Path) -> None:
    work = tmp_path / "module"
    work.mkdir()
    (work / "variables.tf").write_text(CYCLIC_VARIABLES)
    env = s.terraform_env(tmp_path)
    s.terraform(["init", "-input=false", "-backend=false"], cwd=work, env=env)
    proc = s.terraform(["plan", "-input=false", "-lock=false"], cwd=work, env=env, check=False)
    assert proc.returncode != 0 and "Cycle:" in proc.stderr, proc.stdout + proc.stderr
    assert "var.a (validation)" in proc.stderr and "var.b (validation)" in proc.stderr


def test_a_real_tsig_secret_is_accepted(example: s.Example) -> None:
    """tsig-keygen's secret is random bytes: not UTF-8, which base64decode() refuses (so the
    validation must not use it). The example's fake secret is made the same way."""
    with pytest.raises(UnicodeDecodeError):
        base64.b64decode(s.FAKE_TSIG).decode()
    assert example.module("global").var["tsig_secret"] == s.FAKE_TSIG
    assert example.module("global").invalid() == []


def test_a_missing_or_mistyped_input_is_refused(example: s.Example) -> None:
    inputs = example.inputs("global")
    with pytest.raises(hcleval.HclError, match='"tsig_secret" is required'):
        hcleval.Module(s.GLOBAL, {k: v for k, v in inputs.items() if k != "tsig_secret"})
    with pytest.raises(hcleval.HclError, match='attribute "lat" is required'):
        regions = [{k: v for k, v in r.items() if k != "lat"} for r in inputs["regions"]]
        hcleval.Module(s.GLOBAL, {**inputs, "regions": regions})
    with pytest.raises(hcleval.HclError, match="unsupported argument"):
        hcleval.Module(s.GLOBAL, {**inputs, "etcd_replica": 3})


# -- the rendered configs pass Meridian's --check-config ---------------------------------------


def _referenced(rendered: str, directory: str) -> set[str]:
    """The files of ``directory`` a rendered config names (``"<directory>/<file>"``)."""
    return set(re.findall(rf'"{re.escape(directory)}/([^"/]+)"', rendered))


@pytest.mark.parametrize("name", s.REGION_MODULES)
def test_agent_template_passes_check_config(
    pki_example: s.Example, name: str, tmp_path: Path
) -> None:
    """As an agent pod loads it: the rendered agent.toml (the ConfigMap) and the region's
    Secret as the kubelet mounts it (moved to a temporary directory: the only change), no
    MERIDIAN_AGENT_* variable. Every file the settings name is a key of the Secret and every
    key is named; the admin token and the etcd TLS files are read as at a start (the pair
    must be a certificate and its key). The token itself is never printed."""
    module = pki_example.module(name)
    rendered = module.local["agent_config"]
    secrets_dir = module.local["secrets_dir"]
    data = module.local["agent_secret_data"]
    assert _referenced(rendered, secrets_dir) == set(data)
    assert set(data) == {"admin-token", "etcd-ca.crt", "etcd-client.crt", "etcd-client.key"}
    s.write_secret(data, tmp_path)
    path = tmp_path / "agent.toml"
    path.write_text(rendered.replace(f"{secrets_dir}/", f"{tmp_path}/"))
    done = s.check_config("meridian-agent", path)
    assert done.returncode == 0, done.stderr
    assert module.var["admin_token"] not in done.stdout + done.stderr
    assert module.var["etcd_client_key"] not in done.stdout + done.stderr
    printed = tomllib.loads(done.stdout)
    region = printed["region"]
    assert region["id"] == module.var["region_id"] and region["geo"] == module.var["geo"]
    assert region["residency"] == module.var["residency"]
    assert region["endpoints"] == module.var["endpoints"]
    assert region["etcd"] == ["https://10.30.0.100:2379"]
    assert region["etcd_ca_file"] == str(tmp_path / "etcd-ca.crt")
    assert region["etcd_cert_file"] == str(tmp_path / "etcd-client.crt")
    assert region["etcd_key_file"] == str(tmp_path / "etcd-client.key")
    # the region's own certificate: its CN is the etcd user of the region's role
    assert s.subject_cn(tmp_path / "etcd-client.crt") == module.output("etcd_user")
    assert module.output("etcd_user") == f"agent-{module.var['region_id']}"
    assert len(printed["nodes"]) == module.var["vllm_replicas"]
    assert printed["nodes"][0]["url"] == "http://vllm-0.vllm-nodes.meridian.svc.cluster.local:8000"
    assert printed["server"] == {**printed["server"], "host": "0.0.0.0", "port": 8080}
    assert printed["queue"]["slots_per_node"] == module.var["slots_per_node"]
    assert printed["workers"]["count"] == 0  # one per CPU of the pod's limit
    assert printed["admin"]["token_file"] == str(tmp_path / "admin-token")
    # the files are read as at a start: an empty token, a key not the certificate's, refused
    (tmp_path / "admin-token").write_text("")
    done = s.check_config("meridian-agent", path)
    assert done.returncode == 2 and "admin-token is empty" in done.stderr, done.stderr
    (tmp_path / "admin-token").write_text(data["admin-token"])
    (tmp_path / "etcd-client.key").write_text(pki_example.module("global").var["etcd_root_key"])
    done = s.check_config("meridian-agent", path)
    assert done.returncode == 2 and "region.etcd_key_file" in done.stderr, done.stderr


def test_a_plaintext_region_renders_no_etcd_tls(example: s.Example, tmp_path: Path) -> None:
    """http:// etcd endpoints without the TLS inputs (an etcd of yours on a private network):
    valid, and the agent's settings and Secret carry no etcd TLS file, as the agent requires."""
    inputs = {
        **example.inputs("us_east"),
        "etcd_endpoints": ["http://10.30.0.100:2379"],
        "etcd_ca_cert": None,
        "etcd_client_cert": None,
        "etcd_client_key": None,
    }
    module = hcleval.Module(s.REGION, inputs)
    assert module.invalid() == []
    rendered = module.local["agent_config"]
    assert "etcd_ca_file" not in rendered and "etcd_cert_file" not in rendered
    assert set(module.local["agent_secret_data"]) == {"admin-token"}
    s.write_secret(module.local["agent_secret_data"], tmp_path)
    path = tmp_path / "agent.toml"
    path.write_text(rendered.replace(f"{module.local['secrets_dir']}/", f"{tmp_path}/"))
    done = s.check_config("meridian-agent", path)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["region"]["etcd"] == ["http://10.30.0.100:2379"]


def test_the_agents_shutdown_fits_the_grace_period(example: s.Example) -> None:
    """terminationGracePeriodSeconds covers the preStop sleep, the time the agent gives the
    requests in flight at SIGTERM (its runner's shutdown timeout, read from the runner the agent
    serves with) and a margin for the lease revocation; the Deployment uses exactly these."""
    from aiohttp import web

    from meridian_service import hygiene

    runner = hygiene.runner(web.Application(), hygiene.ConnectionLimits())
    region = example.module("us_east")
    assert region.local["agent_shutdown_timeout_s"] == runner._shutdown_timeout
    grace = region.local["agent_termination_grace_s"]
    assert grace == region.var["agent_shutdown_delay_s"] + runner._shutdown_timeout + 10
    main = (s.REGION / "main.tf").read_text()
    assert "termination_grace_period_seconds = local.agent_termination_grace_s" in main
    assert 'command = ["sleep", tostring(var.agent_shutdown_delay_s)]' in main
    agent = next(b for n, b in _workloads() if n.endswith("kubernetes_deployment_v1.agent"))
    rolling = agent["spec"][0]["strategy"][0]["rolling_update"][0]
    # required one-per-host anti-affinity: a rollout that surged would need a spare node
    assert (s.unquote(rolling["max_surge"]), s.unquote(rolling["max_unavailable"])) == ("0", "1")


def _controller_files(example: s.Example, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The rendered controller.toml with the TLS Secret's mount moved to a temporary directory
    holding what the Secret holds (real certificates and keys with ``pki_example``), and the
    environment a replica gets: the TSIG secret from its Secret and its advertised URL. Every
    file the settings name under the mount is a key of the Secret and every key is named."""
    glob = example.module("global")
    data = glob.local["controller_tls_data"]
    rendered = glob.local["controller_config"]
    assert _referenced(rendered, TLS_DIR) == set(data)
    assert set(data) == {
        "admin.crt", "admin.key", "ca.crt",
        "etcd-ca.crt", "meridian-controller.crt", "meridian-controller.key",
    }  # fmt: skip
    tls = s.write_secret(data, tmp_path / "tls")
    path = tmp_path / "controller.toml"
    path.write_text(rendered.replace(f"{TLS_DIR}/", f"{tls}/"))
    env = s.clean_env(
        MERIDIAN_CONTROLLER_DNS__TSIG__SECRET=glob.var["tsig_secret"],
        MERIDIAN_CONTROLLER_API__ADVERTISE_URL=ADVERTISE,
    )
    return path, env


def test_controller_template_passes_check_config(pki_example: s.Example, tmp_path: Path) -> None:
    path, env = _controller_files(pki_example, tmp_path)
    done = s.check_config("meridian-controller", path, env=env)
    assert done.returncode == 0, done.stderr
    assert s.FAKE_TSIG not in done.stdout + done.stderr
    printed = tomllib.loads(done.stdout)
    inputs = pki_example.inputs("global")
    etcd = printed["etcd"]
    assert all(url.startswith("https://") for url in etcd["endpoints"])
    assert etcd["ca_file"] == str(tmp_path / "tls" / "etcd-ca.crt")
    assert etcd["cert_file"] == str(tmp_path / "tls" / "meridian-controller.crt")
    assert etcd["key_file"] == str(tmp_path / "tls" / "meridian-controller.key")
    assert s.subject_cn(tmp_path / "tls" / "meridian-controller.crt") == "meridian-controller"
    assert pki_example.module("global").output("etcd_users")["controller"] == "meridian-controller"
    assert [r["id"] for r in printed["regions"]] == [r["id"] for r in inputs["regions"]]
    assert printed["regions"][1]["residency"] == ["eu"]
    assert printed["regions"][1]["backups"] == ["eu-central"]
    assert printed["latency_ms"]["us-east"]["eu-west"] == 75
    assert len(printed["etcd"]["endpoints"]) == inputs["etcd_replicas"]
    assert printed["api"]["port"] == 8091 and printed["api"]["advertise_url"] == ADVERTISE
    assert [t["name"] for t in printed["api"]["tokens"]] == [
        "dashboards", "oncall", "platform-admin",
    ]  # fmt: skip
    assert printed["dns"]["server"] == inputs["bind_cluster_ip"]
    assert printed["dns"]["zone"] == "meridian.example."
    assert [(v["name"], v["geo"]) for v in printed["dns"]["views"]] == [
        ("eu", "eu"), ("default", "us"),
    ]  # fmt: skip
    assert printed["dns"]["tsig"]["secret"] == "***"


def test_the_controller_template_needs_its_secret(
    pki_example: s.Example, example: s.Example, tmp_path: Path
) -> None:
    """Without the Secret's TSIG variable a replica does not start: --check-config says so;
    nor with the fake (not PEM) etcd CA of the plain example, naming etcd.ca_file."""
    path, env = _controller_files(pki_example, tmp_path)
    done = s.check_config("meridian-controller", path, env={**env})
    assert done.returncode == 0, done.stderr
    del env["MERIDIAN_CONTROLLER_DNS__TSIG__SECRET"]
    done = s.check_config("meridian-controller", path, env=env)
    assert done.returncode == 2
    assert "dns.tsig.secret" in done.stderr, done.stderr
    path, env = _controller_files(example, tmp_path / "fake")
    done = s.check_config("meridian-controller", path, env=env)
    assert done.returncode == 2
    assert "etcd.ca_file" in done.stderr and "holds no PEM CA" in done.stderr, done.stderr


def test_bind_files_pass_named_checkconf(pki_example: s.Example, tmp_path: Path) -> None:
    """What the BIND pod runs with: named.conf (rendered), the keys and views its init
    container writes with the real ``meridian-controller dns bind-config``, and the zone seeds
    (rendered, one per view); the paths moved into a temporary directory. named-checkconf -z
    loads every zone."""
    checkconf = shutil.which("named-checkconf", path=f"{os.environ['PATH']}:/usr/sbin:/sbin")
    assert checkconf, "named-checkconf is missing: run `make setup` (bind9-utils)"
    glob = pki_example.module("global")
    config, env = _controller_files(pki_example, tmp_path)
    zones = tmp_path / "zones"
    zones.mkdir()
    bind_config = subprocess.run(
        [str(s.BIN / "meridian-controller"), "dns", "bind-config", "--config", str(config),
         "--zone-dir", str(zones)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bind_config.returncode == 0, bind_config.stderr
    generated = tmp_path / "meridian.conf"
    generated.write_text(bind_config.stdout)
    zone_files = glob.local["zone_files"]
    assert set(zone_files) == {"eu.meridian.example.db", "default.meridian.example.db"}
    for name, text in zone_files.items():
        (zones / name).write_text(text)
    named_conf = glob.local["named_conf"]
    include = glob.local["named_conf_vars"]["include_file"]
    zone_dir = glob.local["bind_zone_dir"]
    assert f'"{include}"' in named_conf and f'"{zone_dir}"' in named_conf
    named = tmp_path / "named.conf"
    named.write_text(named_conf.replace(include, str(generated)).replace(zone_dir, str(zones)))
    proc = subprocess.run(
        [checkconf, "-z", str(named)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("loaded serial 1") == 2, proc.stdout


def test_the_bind_pods_init_seeds_once_and_sets_aside_a_torn_journal(
    example: s.Example, bind: BindServer, tmp_path: Path
) -> None:
    """The zone-seed init container's script (``local.bind_zone_prepare``) run by ``sh`` over
    a zone directory as a crashed pod leaves it: a zone file BIND has written since its seed
    (kept), a view with no zone yet (seeded), a journal real named wrote (kept) and one a
    SIGKILL left empty (set aside, docs/dns.md "If named crashed")."""
    journalprint = shutil.which("named-journalprint", path=f"{os.environ['PATH']}:/usr/sbin")
    assert journalprint, "named-journalprint is missing: run `make setup` (bind9)"
    glob = example.module("global")
    script = glob.local["bind_zone_prepare"]
    zone_dir = glob.local["bind_zone_dir"]
    update = dns_update.UpdateMessage(bind.zone, keyring=bind.view("default").key.keyring())
    update.add(f"api.{bind.zone}", 30, "A", "192.0.2.10")
    response = dns_query.tcp(update, bind.host, port=bind.port, timeout=5)
    assert response.rcode() == dns_rcode.NOERROR
    bind.process.kill()
    written = bind.work_dir / "zones" / "default.db.jnl"
    seed, zones = tmp_path / "seed", tmp_path / "zones"
    seed.mkdir()
    (seed / "eu.db").write_text("; the eu seed\n")
    (seed / "default.db").write_text("; the default seed\n")
    zones.mkdir()
    (zones / "default.db").write_text("; dumped by named since\n")
    shutil.copy(written, zones / "default.db.jnl")
    (zones / "eu.db.jnl").write_bytes(b"")  # torn by a SIGKILL inside its first write
    mine = script.replace(zone_dir, str(zones)).replace("/seed/", f"{seed}/")
    assert " /seed/" not in mine and zone_dir not in mine
    done = _sh(mine)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (zones / "default.db").read_text() == "; dumped by named since\n"  # not re-seeded
    assert (zones / "eu.db").read_text() == "; the eu seed\n"
    assert (zones / "default.db.jnl").read_bytes() == written.read_bytes()  # sound: kept
    assert not (zones / "eu.db.jnl").exists() and (zones / "eu.db.jnl.torn").exists()
    again = _sh(mine)
    assert again.returncode == 0 and sorted(p.name for p in zones.iterdir()) == [
        "default.db", "default.db.jnl", "eu.db", "eu.db.jnl.torn",
    ]  # fmt: skip


def _sh(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=30, check=False
    )


def test_templates_stay_within_the_tested_subset() -> None:
    for path in sorted(s.TERRAFORM.rglob("*.tftpl")):
        text = path.read_text()
        with pytest.raises(tftemplate.TemplateError, match="no variable"):
            tftemplate.render(text, {})  # parses (else another error), then needs its variables
        assert "%{ if" not in text and "~}" not in text and "%{~" not in text


# -- every workload is hardened ----------------------------------------------------------------


WORKLOADS = ("kubernetes_deployment_v1", "kubernetes_stateful_set_v1", "kubernetes_job_v1")


def _workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    for module in (s.REGION, s.GLOBAL):
        for rtype, name, body in s.resources(module):
            if rtype in WORKLOADS:
                yield f"{module.name}.{rtype}.{name}", body


def test_there_are_workloads() -> None:
    names = [n for n, _ in _workloads()]
    assert len(names) >= 6 and "global.kubernetes_job_v1.etcd_bootstrap" in names


@pytest.mark.parametrize(
    ("name", "body"), list(_workloads()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_workload_security(name: str, body: dict[str, Any]) -> None:
    """What checkov checks on Deployments, also on StatefulSets (which its Terraform checks
    skip): non-root with a high UID, read-only root, no escalation, no capabilities, the
    runtime's seccomp profile, no service account token, resources and probes."""
    pod = body["spec"][0]["template"][0]["spec"][0]
    assert pod["automount_service_account_token"] is False, name
    ctx = pod["security_context"][0]
    assert ctx["run_as_non_root"] in (True, "${local.pod_security.run_as_non_root}"), name
    assert s.unquote(ctx["seccomp_profile"][0]["type"]) == "RuntimeDefault", name
    assert not pod.get("host_network") and not pod.get("host_pid") and not pod.get("host_ipc")
    containers = [("container", c) for c in pod["container"]]
    containers += [("init_container", c) for c in pod.get("init_container", [])]
    for kind, c in containers:
        where = f"{name} {kind} {s.unquote(c['name'])}"
        sc = c["security_context"][0]
        assert sc["allow_privilege_escalation"] is False, where
        assert sc["privileged"] is False, where
        assert sc["read_only_root_filesystem"] is True, where
        assert sc["run_as_non_root"] is True, where
        assert sc["run_as_user"] == "${local.uid}", where
        assert s.unquote(sc["capabilities"][0]["drop"]) == ["ALL"], where
        assert "add" not in sc["capabilities"][0], where
        assert s.unquote(sc["seccomp_profile"][0]["type"]) == "RuntimeDefault", where
        assert c["resources"][0]["limits"] and c["resources"][0]["requests"], where
        assert "@sha256" in s.unquote(c["image"]) or c["image"].startswith("${var."), where
        if kind == "container" and "kubernetes_job_v1" not in name:  # a Job's pod just ends
            assert c.get("liveness_probe") and c.get("readiness_probe"), where


def test_the_agents_token_is_a_file_not_an_environment_variable() -> None:
    agent = next(b for n, b in _workloads() if n.endswith("kubernetes_deployment_v1.agent"))
    pod = agent["spec"][0]["template"][0]["spec"][0]
    container = pod["container"][0]
    assert "env_from" not in container and "env" not in container
    mounts = {s.unquote(m["name"]): m for m in container["volume_mount"]}
    assert mounts["secrets"]["read_only"] is True
    volumes = {s.unquote(v["name"]): v for v in pod["volume"]}
    secret = volumes["secrets"]["secret"][0]
    assert secret["secret_name"] == "${kubernetes_secret_v1.agent.metadata[0].name}"
    assert s.unquote(secret["default_mode"]) == "0440"


def test_uid_is_high() -> None:
    for module in (s.REGION, s.GLOBAL):
        assert s.locals_of(module / "main.tf")["uid"] >= 10000


# -- checkov -----------------------------------------------------------------------------------


def _skip_comments() -> list[tuple[Path, str, str]]:
    """(file, check id, reason) of every ``#checkov:skip=`` comment under deploy/terraform."""
    found = []
    for tf in _tf_files():
        for line in tf.read_text().splitlines():
            if "checkov:skip=" in line:
                match = re.search(r"#checkov:skip=(CKV\w*_\d+):(.*)$", line)
                assert match, f"{tf}: {line.strip()}"
                found.append((tf, match.group(1), match.group(2).strip()))
    return found


def test_checkov_passes() -> None:
    """checkov -d deploy/terraform --framework terraform: zero failed checks, and every skip
    carries its reason in the code (#checkov:skip=CKV_...:reason) and skips a check that checkov
    runs there (a skip of a check that no longer applies is stale). --skip-download: checkov
    would otherwise fetch its guideline links from the vendor's API, which is not reachable."""
    proc = subprocess.run(
        [s.checkov_binary(), "-d", str(s.TERRAFORM), "--framework", "terraform", "--compact",
         "--skip-download", "-o", "json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    summary, results = s.checkov_report(proc.stdout, "terraform")
    assert summary["failed"] == 0, json.dumps(results["failed_checks"], indent=1)
    assert summary["parsing_errors"] == 0, results["parsing_errors"]
    assert summary["passed"] > 100, summary
    assert proc.returncode == 0, proc.stderr[-2000:]
    comments = _skip_comments()
    for _, check, reason in comments:
        assert len(reason) > 30, (check, reason)
    if "skipped_checks" not in results["listed"]:  # --quiet (or another checkov): no list
        assert summary["skipped"] >= len(comments) > 0, summary
        return
    assert summary["skipped"] == len(results["skipped_checks"]), summary
    for skipped in results["skipped_checks"]:
        reason = skipped["check_result"].get("suppress_comment", "")
        assert len(reason) > 30, (skipped["check_id"], skipped["resource"], reason)
    applied = {
        (Path(c["file_abs_path"]).resolve(), c["check_id"]) for c in results["skipped_checks"]
    }
    for tf, check, _ in comments:
        assert (tf.resolve(), check) in applied, f"{tf}: #checkov:skip={check} skips nothing"


def test_checkov_report_without_skipped_checks() -> None:
    """What ``--quiet`` prints (checkov 3.3.30): no passed or skipped lists. Read as empty,
    and said to be missing, rather than a KeyError; a list of reports is searched by type."""
    quiet = json.dumps({
        "check_type": "terraform",
        "results": {"failed_checks": []},
        "summary": {"passed": 130, "failed": 0, "skipped": 9, "parsing_errors": 0},
    })  # fmt: skip
    summary, results = s.checkov_report(quiet, "terraform")
    assert summary["skipped"] == 9 and results["skipped_checks"] == []
    assert results["listed"] == ["failed_checks"]
    several = json.dumps([{"check_type": "dockerfile", "summary": {"failed": 1}},
                          json.loads(quiet)])  # fmt: skip
    assert s.checkov_report(several, "terraform")[0]["passed"] == 130
    with pytest.raises(AssertionError, match="no single kubernetes report"):
        s.checkov_report(quiet, "kubernetes")


# -- with the real Terraform -------------------------------------------------------------------


def _terraform_outputs(
    module: Path, files: list[str], outputs: dict[str, str], tfvars: dict[str, Any], tmp: Path
) -> dict[str, Any]:
    """Terraform evaluates the provider-free files of a module with ``tfvars``; the values of
    ``outputs`` (name -> expression), from ``terraform apply`` of no resource at all."""
    work = s.scratch_module(module, tmp / "module", files)
    (work / "terraform.tfvars.json").write_text(json.dumps(tfvars))
    (work / "compare.tf").write_text(  # sensitive: some values come from sensitive inputs
        "".join(
            f'output "compare_{k}" {{\n  value     = {v}\n  sensitive = true\n}}\n'
            for k, v in outputs.items()
        )
    )
    env = s.terraform_env(tmp)
    s.terraform(["init", "-input=false", "-backend=false"], cwd=work, env=env)
    s.terraform(["apply", "-input=false", "-auto-approve", "-lock=false"], cwd=work, env=env)
    out = s.terraform(["output", "-json"], cwd=work, env=env)
    values = {k: v["value"] for k, v in json.loads(out.stdout).items()}
    return {k.removeprefix("compare_"): v for k, v in values.items()}


@needs_terraform
def test_terraform_fmt(tmp_path: Path) -> None:
    proc = s.terraform(
        ["fmt", "-check", "-recursive", "-diff"], cwd=s.TERRAFORM, env=s.terraform_env(tmp_path),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_terraform
def test_terraform_renders_what_hcleval_renders(example: s.Example, tmp_path: Path) -> None:
    """Terraform's templatefile(), locals and outputs against hcleval's, on the example's
    values, byte for byte."""
    glob = example.module("global")
    wanted = {
        "controller_config": "local.controller_config",
        "named_conf": "local.named_conf",
        "zone_files": "local.zone_files",
        "glue": "local.glue",
        "latency": "local.latency",
        "members": "local.etcd_client_urls",
        "etcd_args": "local.etcd_args",
        "etcd_tls_data": "local.etcd_tls_data",
        "controller_tls_data": "local.controller_tls_data",
        "bootstrap_data": "local.bootstrap_data",
        "bootstrap_command": "local.bootstrap_command",
        "bootstrap_job_name": "local.bootstrap_job_name",
    }
    got = _terraform_outputs(
        s.GLOBAL, ["variables.tf", "config.tf", "outputs.tf"], wanted,
        example.inputs("global"), tmp_path / "global",
    )  # fmt: skip
    for key, expr in wanted.items():
        assert got[key] == glob.evaluate(expr), key
    outputs = [b.labels[0] for b in hcleval.load_file(s.GLOBAL / "outputs.tf").children("output")]
    assert {"etcd_tls_dns_names", "etcd_users", "admin_tls_ip_addresses"} <= set(outputs)
    for name in outputs:
        assert got[name] == glob.output(name), name
    for name in s.REGION_MODULES:
        region = example.module(name)
        wanted = {
            "agent_config": "local.agent_config",
            "node_urls": "local.vllm_node_urls",
            "secret": "local.agent_secret_data",
            "grace": "local.agent_termination_grace_s",
        }
        got = _terraform_outputs(
            s.REGION, ["variables.tf", "config.tf"], wanted, example.inputs(name),
            tmp_path / name,
        )  # fmt: skip
        for key, expr in wanted.items():
            assert got[key] == region.evaluate(expr), (name, key)


@pytest.fixture(scope="module")
def validation_modules(
    tmp_path_factory: pytest.TempPathFactory, example: s.Example
) -> dict[Path, tuple[Path, dict[str, str]]]:
    """Each module's variables.tf alone, initialised (no provider: offline), with the example's
    values as its valid baseline (a plan of it succeeds)."""
    if s.terraform_binary() is None:
        pytest.skip("no terraform binary")
    out = {}
    for module in (s.REGION, s.GLOBAL):
        tmp = tmp_path_factory.mktemp(module.name)
        work = s.scratch_module(module, tmp / "module", ["variables.tf"])
        (work / "terraform.tfvars.json").write_text(json.dumps(_baseline(example, module)))
        env = s.terraform_env(tmp)
        s.terraform(["init", "-input=false", "-backend=false"], cwd=work, env=env)
        s.terraform(["plan", "-input=false", "-lock=false"], cwd=work, env=env)
        out[module] = (work, env)
    return out


def _plan(
    work: Path, env: dict[str, str], name: str, value: Any
) -> subprocess.CompletedProcess[str]:
    bad = work / f"value-{name}.tfvars.json"
    bad.write_text(json.dumps({name: value}))
    try:
        return s.terraform(
            ["plan", "-input=false", "-lock=false", f"-var-file={bad.name}"],
            cwd=work, env=env, check=False,
        )  # fmt: skip
    finally:
        bad.unlink()


def _words(text: str) -> str:
    """Terraform's diagnostics as plain words: its box-drawing margin dropped and every run of
    whitespace one space, since it wraps a long message over several lines."""
    return re.sub(r"\s+", " ", re.sub(r"[│╷╵]", " ", text)).strip()


def test_wrapped_messages_are_compared_as_words() -> None:
    """A message as Terraform 1.11 prints it, wrapped at 80 columns in its margin."""
    printed = (
        "╷\n│ Error: Invalid value for variable\n│\n│   on variables.tf line 59:\n"
        "│ etcd_endpoints must hold at least one https://host:2379 URL (or\n"
        "│ http://host:2379 ones), all of one scheme: the agent never mixes TLS and\n"
        "│ plaintext members.\n╵\n"
    )
    message = (
        "etcd_endpoints must hold at least one https://host:2379 URL (or http://host:2379 "
        "ones), all of one scheme: the agent never mixes TLS and plaintext members."
    )
    assert message not in printed and _words(message) in _words(printed)


@needs_terraform
@pytest.mark.parametrize(
    ("module", "name", "value", "message", "refused_on"), _bad_values(), ids=_ids(_bad_values())
)
def test_terraform_refuses_what_hcleval_refuses(
    example: s.Example,
    module: Path,
    name: str,
    value: Any,
    message: str,
    refused_on: str,
    validation_modules: dict[Path, tuple[Path, dict[str, str]]],
) -> None:
    """The same out-of-range value through ``terraform plan``: refused, with every message
    the Python evaluation gives (compared as words: Terraform wraps long messages)."""
    work, env = validation_modules[module]
    proc = _plan(work, env, name, value)
    assert proc.returncode != 0, f"{name}={value!r} was accepted"
    text = _words(proc.stderr)
    assert "Invalid value for variable" in text, text
    assert _words(message) in text, text
    python = hcleval.Module(module, {**_baseline(example, module), name: value}).invalid()
    for refused in python:
        assert _words(refused.message) in text, (refused.message, text)
    assert text.count("Invalid value for variable") == len(python), text


@needs_terraform
@pytest.mark.parametrize(("module", "name", "value"), _good_values(), ids=_ids(_good_values()))
def test_terraform_accepts_what_hcleval_accepts(
    module: Path,
    name: str,
    value: Any,
    validation_modules: dict[Path, tuple[Path, dict[str, str]]],
) -> None:
    work, env = validation_modules[module]
    proc = _plan(work, env, name, value)
    assert proc.returncode == 0, proc.stderr
