"""``meridian-agent --check-config FILE``, run as an operator runs it: the installed console
script in a subprocess, with the environment it is given and nothing else of the developer's.

It loads the file as a start does (the same loader, environment and flags applied, the TLS pair
and the node list checked), prints the effective settings with every secret masked and exits 0,
or names the file (or environment variable), the key and the fix and exits 2."""

from __future__ import annotations

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

from regional_agent import settings as agent_settings
from tests.support.certs import CertAuthority

AGENT = Path(sys.executable).parent / "meridian-agent"
GOOD = """\
[server]
port = 9180

[routing]
policy = "prefix_aware"

[queue]
max_depth = 50
tenant_priority = { batch = "low" }

[stall.models."meta-llama/Llama-3.1-70B-Instruct"]
first_token_s = 180.0

[[nodes]]
url = "http://127.0.0.1:8001"
weight = 2.0

[[nodes]]
url = "http://127.0.0.1:8002"
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    return {**env, **extra}


def _check(
    tmp_path: Path, text: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``meridian-agent --check-config agent.toml ARGS`` in ``tmp_path`` (so that messages
    name the file as the operator gave it: ``agent.toml``)."""
    (tmp_path / "agent.toml").write_text(text)
    return subprocess.run(
        [str(AGENT), "--check-config", "agent.toml", *args],
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


def test_a_good_file_prints_the_effective_settings(tmp_path: Path) -> None:
    done = _check(tmp_path, GOOD)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("# meridian-agent ")
    printed = tomllib.loads(done.stdout)
    assert printed["routing"]["policy"] == "prefix_aware"
    assert printed["queue"]["max_depth"] == 50
    assert printed["queue"]["tenant_priority"] == {"batch": "low"}
    assert printed["queue"]["slots_per_node"] == 64  # a default, shown too
    assert [n["url"] for n in printed["nodes"]] == [
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
    ]
    assert printed["nodes"][0]["weight"] == 2.0
    stall = printed["stall"]["models"]["meta-llama/Llama-3.1-70B-Instruct"]
    assert stall == {"first_token_s": 180.0, "inter_token_s": 15.0}
    assert printed["server"]["port"] == 9180
    assert "# tls_cert_file: unset" in done.stdout


def test_the_environment_and_flags_apply_as_at_a_start(tmp_path: Path) -> None:
    done = _check(
        tmp_path, GOOD, "--port", "9999", "--policy", "weighted",
        env=_env(MERIDIAN_AGENT_QUEUE__MAX_DEPTH="77", MERIDIAN_AGENT_SERVER__PORT="9001"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    assert printed["queue"]["max_depth"] == 77  # environment over the file
    assert printed["server"]["port"] == 9999  # the flag over the environment
    assert printed["routing"]["policy"] == "weighted"


def test_json_output_is_the_same_settings(tmp_path: Path) -> None:
    """TOML and JSON print one thing: the TOML read back is the JSON without its nulls (TOML
    has none: they are ``# key: unset`` comments)."""
    as_toml = _check(tmp_path, GOOD)
    as_json = _check(tmp_path, GOOD, "--output", "json")
    assert as_toml.returncode == as_json.returncode == 0, as_toml.stderr + as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["nodes"][1]["id"] is None
    assert tomllib.loads(as_toml.stdout) == _drop_none(data)


def test_the_printed_settings_load_back_to_the_same_settings(tmp_path: Path) -> None:
    first = _check(tmp_path, GOOD)
    assert first.returncode == 0, first.stderr
    again = _check(tmp_path, first.stdout)
    assert again.returncode == 0, again.stderr
    assert tomllib.loads(again.stdout) == tomllib.loads(first.stdout)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            GOOD.replace('policy = "prefix_aware"', 'polcy = "prefix_aware"'),
            'agent.toml: unknown key "routing.polcy" — did you mean "routing.policy"?',
        ),
        (
            GOOD.replace("weight = 2.0", "wieght = 2.0"),
            'agent.toml: unknown key "nodes[0].wieght" — did you mean "nodes[0].weight"?',
        ),
        (
            GOOD.replace("first_token_s = 180.0", "first_tokn_s = 180.0"),
            'agent.toml: unknown key "stall.models."meta-llama/Llama-3.1-70B-Instruct".'
            'first_tokn_s" — did you mean "stall.models."meta-llama/Llama-3.1-70B-Instruct".'
            'first_token_s"?',
        ),
        (
            GOOD.replace("[routing]", "[routnig]"),
            'agent.toml: unknown key "routnig" — did you mean "routing"?',
        ),
        (
            GOOD.replace("[queue]", "[queue]\nzzz = 1"),
            'agent.toml: unknown key "queue.zzz" — the keys of [queue] are: deadline_s, '
            "max_depth, max_wait_low_s, retry_after_s, slots_per_node, tenant_priority",
        ),
    ],
    ids=["routing.polcy", "nodes-item", "dict-of-models", "group", "no-near-key"],
)
def test_a_typo_names_the_file_the_key_and_the_nearest_key(
    tmp_path: Path, text: str, line: str
) -> None:
    done = _check(tmp_path, text)
    assert done.returncode == 2, done.stdout
    assert done.stdout == ""
    assert f"  {line}\n" in done.stderr, done.stderr


def test_a_typo_in_the_environment_names_the_variable(tmp_path: Path) -> None:
    done = _check(tmp_path, GOOD, env=_env(MERIDIAN_AGENT_QUEUE__MAX_DEPHT="3"))
    assert done.returncode == 2, done.stdout
    assert (
        'environment MERIDIAN_AGENT_QUEUE__MAX_DEPHT: unknown key "queue.max_depht" — '
        "did you mean MERIDIAN_AGENT_QUEUE__MAX_DEPTH?"
    ) in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("max_depth = 50", "max_depth = -1",
         "agent.toml: queue.max_depth: Input should be greater than or equal to 0 (got -1)"),
        ('policy = "prefix_aware"', 'policy = "fastest"',
         "agent.toml: routing.policy: unknown policy 'fastest'; choose one of"),
        ('url = "http://127.0.0.1:8002"', 'url = "ftp://127.0.0.1:8002"',
         "agent.toml: nodes[1].url: must be an http(s) URL with a host, got 'ftp://127.0.0.1:8002'"),
        ("[server]", '[region]\nid = "eu-west"\n\n[server]',
         "agent.toml: region: region.geo is required when region.id is set"),
        ('batch = "low"', 'batch = "lowest"',
         "agent.toml: queue.tenant_priority.batch: Input should be 'high', 'normal' or 'low' "
         '(got "lowest")'),
        ("port = 9180", 'port = "eighty"',
         "agent.toml: server.port: Input should be a valid integer"),
    ],
    ids=["range", "choice", "url", "cross-field", "class", "type"],
)  # fmt: skip
def test_a_bad_value_names_the_file_the_key_and_what_to_write(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert old in GOOD
    done = _check(tmp_path, GOOD.replace(old, new))
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith("meridian-agent: agent.toml: invalid settings:\n")
    assert expected in done.stderr, done.stderr


def test_a_bad_value_names_where_it_came_from(tmp_path: Path) -> None:
    """In the loader's order: a flag, else the environment (over the file), else the file."""
    done = _check(tmp_path, GOOD, "--port", "70000")
    assert done.returncode == 2
    assert (
        "  command line: server.port: Input should be less than or equal to 65535 (got 70000)\n"
    ) in done.stderr, done.stderr
    done = _check(tmp_path, GOOD, env=_env(MERIDIAN_AGENT_QUEUE__MAX_DEPTH="-1"))
    assert done.returncode == 2
    assert (
        "  environment MERIDIAN_AGENT_QUEUE__MAX_DEPTH: queue.max_depth: Input should be greater "
        'than or equal to 0 (got "-1")\n'
    ) in done.stderr, done.stderr


def test_what_a_start_checks_after_loading_is_checked_too(tmp_path: Path) -> None:
    no_nodes = GOOD.split("[[nodes]]")[0]
    done = _check(tmp_path, no_nodes)
    assert done.returncode == 2
    assert "no nodes: pass --node URL" in done.stderr, done.stderr
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    (tmp_path / "key.pem").write_text("not a key\n")
    bad_tls = GOOD.replace(
        "[server]", '[server]\ntls_cert_file = "cert.pem"\ntls_key_file = "key.pem"'
    )
    done = _check(tmp_path, bad_tls)
    assert done.returncode == 2
    assert "server.tls_cert_file: cert.pem holds no PEM certificate" in done.stderr, done.stderr


def test_nodes_from_dns_alone_are_enough_and_bad_flags_are_named(tmp_path: Path) -> None:
    no_nodes = GOOD.split("[[nodes]]")[0]
    done = _check(tmp_path, no_nodes, "--discover-dns", "vllm.llm.svc.cluster.local.:8000",
                  "--output", "json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (found,) = json.loads(done.stdout)["discovery"]["dns"]
    assert (found["name"], found["record"], found["port"]) == (
        "vllm.llm.svc.cluster.local", "A", 8000)  # fmt: skip
    done = _check(tmp_path, no_nodes, "--discover-srv", "_http._tcp.vllm.llm.svc.")
    assert done.returncode == 0, done.stderr
    done = _check(tmp_path, no_nodes, "--discover-dns", "vllm.llm.svc.")
    assert done.returncode == 2
    assert "--discover-dns 'vllm.llm.svc.': write NAME:PORT" in done.stderr, done.stderr


def test_a_real_tls_pair_passes(tmp_path: Path) -> None:
    pair = CertAuthority.create(tmp_path / "ca").issue("agent", serial=7)
    text = GOOD.replace(
        "[server]", f'[server]\ntls_cert_file = "{pair.cert}"\ntls_key_file = "{pair.key}"'
    )
    done = _check(tmp_path, text)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["server"]["tls_cert_file"] == str(pair.cert)
    other = CertAuthority.create(tmp_path / "other").issue("other", serial=8)
    mismatched = text.replace(str(pair.key), str(other.key))
    done = _check(tmp_path, mismatched)
    assert done.returncode == 2
    assert "server.tls_key_file" in done.stderr, done.stderr


def test_secrets_are_never_printed(tmp_path: Path) -> None:
    """The admin token from the environment (shown as its hash, which is what the agent keeps),
    etcd's password (its file's path only) and the API keys file (its path only): none of the
    secret strings is in the output or the errors."""
    token = "agent-admin-token-from-env-3f9c1e7a"
    password = "etcd-password-in-a-file-77d1c0"
    (tmp_path / "etcd.password").write_text(password + "\n")
    (tmp_path / "keys.toml").write_text(
        '[[tenants]]\nname = "chat"\n[[tenants.keys]]\n'
        f'sha256 = "{hashlib.sha256(b"api-key").hexdigest()}"\n'
    )
    text = GOOD.replace(
        "[server]",
        '[region]\nid = "eu-west"\ngeo = "eu"\netcd = ["http://127.0.0.1:2379"]\n'
        'etcd_user = "agent-eu-west"\netcd_password_file = "etcd.password"\n\n'
        '[tenants]\nkeys_file = "keys.toml"\n\n[server]',
    )
    env = _env(MERIDIAN_AGENT_ADMIN__TOKEN=token)
    for output in ("toml", "json"):
        done = _check(tmp_path, text, "--output", output, env=env)
        assert done.returncode == 0, done.stderr
        assert token not in done.stdout + done.stderr
        assert password not in done.stdout + done.stderr
        assert "api-key" not in done.stdout + done.stderr
    printed = tomllib.loads(_check(tmp_path, text, env=env).stdout)
    assert printed["admin"]["token_sha256"] == hashlib.sha256(token.encode()).hexdigest()
    assert printed["region"]["etcd_password_file"] == "etcd.password"
    assert printed["tenants"]["keys_file"] == "keys.toml"


def test_a_secret_in_a_file_is_masked(tmp_path: Path) -> None:
    token = "agent-admin-token-in-the-file-a8b2"
    done = _check(tmp_path, f'{GOOD}\n[admin]\ntoken = "{token}"\n')
    assert done.returncode == 0, done.stderr
    assert token not in done.stdout + done.stderr


def test_a_bad_secret_is_refused_without_being_printed(tmp_path: Path) -> None:
    token = "agent-admin-token-bad-with-hash-c41d"
    done = _check(tmp_path, f'{GOOD}\n[admin]\ntoken = "{token}"\ntoken_sha256 = "{"0" * 64}"\n')
    assert done.returncode == 2, done.stdout
    assert "admin" in done.stderr and "not several" in done.stderr, done.stderr
    assert token not in done.stdout + done.stderr


def test_no_file_and_not_toml(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(AGENT), "--check-config", "missing.toml"], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.toml does not exist" in done.stderr, done.stderr
    done = _check(tmp_path, "[server\nport = 1\n")
    assert done.returncode == 2
    assert "agent.toml: not valid TOML" in done.stderr, done.stderr


def test_config_and_check_config_must_name_one_file(tmp_path: Path) -> None:
    (tmp_path / "other.toml").write_text(GOOD)
    done = _check(tmp_path, GOOD, "--config", "other.toml")
    assert done.returncode == 2
    assert "name two files" in done.stderr
    assert _check(tmp_path, GOOD, "--config", "agent.toml").returncode == 0


def test_a_start_says_what_the_check_says(tmp_path: Path) -> None:
    """The same file given to a start: the same lines, exit 2, nothing served."""
    text = GOOD.replace('policy = "prefix_aware"', 'polcy = "prefix_aware"')
    (tmp_path / "agent.toml").write_text(text)
    done = subprocess.run(
        [str(AGENT), "--config", "agent.toml", "--port", "0"], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert 'agent.toml: unknown key "routing.polcy" — did you mean "routing.policy"?' in done.stderr


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        stack: list[Any] = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                _models(tp, seen)
            stack.extend(typing.get_args(tp))


def test_every_settings_group_forbids_unknown_keys() -> None:
    """Else a typo in that group is silently ignored, and --check-config cannot catch it."""
    seen: set[type[BaseModel]] = set()
    _models(agent_settings.Settings, seen)
    assert len(seen) > 10
    for model in seen:
        assert model.model_config.get("extra") == "forbid", model.__name__


def test_a_tokenizer_that_does_not_load_or_render_is_named_at_start(tmp_path: Path) -> None:
    """[tokenizer]: a model directory without tokenizer.json is a settings error naming the
    field; a chat template that does not render is named, file and reason, by the start
    checks (the tokenizer is loaded as a start loads it); a good one is shown."""
    model = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"
    done = _check(tmp_path, GOOD + f'\n[tokenizer]\nmodel_dir = "{tmp_path}"\n')
    assert done.returncode == 2
    assert f"tokenizer: model_dir: {tmp_path} has no tokenizer.json" in done.stderr, done.stderr
    (tmp_path / "bad.jinja").write_text("{{ raise_exception('no chat for this model') }}")
    bad = f'\n[tokenizer.models."m"]\nmodel_dir = "{model}"\nchat_template_file = "bad.jinja"\n'
    done = _check(tmp_path, GOOD + bad)
    assert done.returncode == 2
    assert (
        'tokenizer.models."m": the chat template in bad.jinja does not render a one-message '
        "conversation: no chat for this model\n"
    ) in done.stderr, done.stderr
    done = _check(tmp_path, GOOD + f'\n[tokenizer]\nmodel_dir = "{model}"\n')
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["tokenizer"]["model_dir"] == str(model)
