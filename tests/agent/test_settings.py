"""meridian-agent's settings: flags over environment over the TOML file; bad ones stop it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from meridian_service import hygiene
from regional_agent import settings
from tests.agent.conftest import SimProcess

AGENT = [sys.executable, "-m", "regional_agent.cli"]


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*AGENT, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_flags_override_environment_override_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        """
[server]
port = 9100

[routing]
policy = "session"
prefix_block_tokens = 32

[queue]
max_depth = 50
tenant_priority = { batch = "low" }

[[nodes]]
url = "http://10.0.0.5:8000"
weight = 2.0
"""
    )
    monkeypatch.setenv("MERIDIAN_AGENT_QUEUE__MAX_DEPTH", "70")
    loaded = settings.load(config_file=config, overrides={"routing": {"policy": "jsq"}})
    assert loaded.server.port == 9100
    assert loaded.routing.policy == "jsq"  # flag
    assert loaded.routing.prefix_block_tokens == 32  # file, merged with the flag's group
    assert loaded.queue.max_depth == 70  # environment over file
    assert loaded.queue.tenant_priority == {"batch": "low"}
    assert loaded.nodes[0].node_id == "10.0.0.5:8000" and loaded.nodes[0].weight == 2.0


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--node", "http://127.0.0.1:1", "--policy", "fastest"], {}, "routing.policy"),
        (["--node", "localhost:8000"], {}, "nodes[0].url"),
        (
            ["--node", "http://127.0.0.1:1"],
            {"MERIDIAN_AGENT_QUEUE__MAX_DEPTH": "-1"},
            "queue.max_depth",
        ),
        (
            ["--node", "http://127.0.0.1:1"],
            {"MERIDIAN_AGENT_SERVER__HEADER_TIMEOUT_S": "0"},
            "server.header_timeout_s",
        ),
        (
            ["--node", "http://127.0.0.1:1"],
            {"MERIDIAN_AGENT_SERVER__MAX_CONNECTIONS_PER_IP": "-1"},
            "server.max_connections_per_ip",
        ),
        (["--node", "http://127.0.0.1:1", "--node", "http://127.0.0.1:1"], {}, "duplicate node id"),
        ([], {}, "no nodes"),
        (["--config", "/nonexistent/agent.toml"], {}, "does not exist"),
    ],
)
def test_invalid_settings_stop_the_agent_naming_the_field(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    done = _run(args, env)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr


def test_unknown_field_in_the_file_is_named(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[queue]\nmax_dept = 5\n[[nodes]]\nurl = "http://127.0.0.1:1"\n')
    done = _run(["--config", str(config)])
    assert done.returncode == 2
    assert "queue.max_dept" in done.stderr


def test_connection_limits_come_from_the_server_group() -> None:
    """What meridian-agent hands meridian_service.hygiene: its defaults are the agent's."""
    assert settings.ServerSettings().limits() == hygiene.ConnectionLimits()
    server = settings.ServerSettings(header_timeout_s=2, max_connections_per_ip=8)
    assert server.limits().header_timeout_s == 2
    assert server.limits().max_connections_per_ip == 8


def test_bad_routing_tuning_is_named() -> None:
    with pytest.raises(ValueError, match="tuning"):
        settings.Settings(routing={"tuning": {"no_such_knob": 1}})  # type: ignore[arg-type]


def test_agent_process_serves_and_stops_cleanly(
    sim_processes: Callable[..., list[SimProcess]],
) -> None:
    sims = sim_processes(2, time_scale=20)
    proc = subprocess.Popen(
        [
            *AGENT,
            "--port",
            "0",
            "--log-level",
            "WARNING",
            *[a for s in sims for a in ("--node", s.url)],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY "), line
        url = line.split()[1]
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            reply = client.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.choices[0].message.content
        proc.terminate()
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_the_prefix_stride_is_a_routing_tuning_and_is_checked() -> None:
    tuned = settings.Settings(routing={"tuning": {"prefix_stride_blocks": 8}})  # type: ignore[arg-type]
    assert tuned.routing.config().prefix_stride_blocks == 8
    assert settings.Settings().routing.config().prefix_stride_blocks == 32
    with pytest.raises(ValueError, match="prefix_stride_blocks"):
        settings.Settings(routing={"tuning": {"prefix_stride_blocks": 0}})  # type: ignore[arg-type]


def test_the_prefix_dense_head_is_a_routing_tuning_and_is_checked() -> None:
    tuned = settings.Settings(routing={"tuning": {"prefix_dense_head_blocks": 0}})
    assert tuned.routing.config().prefix_dense_head_blocks == 0
    assert settings.Settings().routing.config().prefix_dense_head_blocks == 32
    with pytest.raises(ValueError, match="prefix_dense_head_blocks"):
        settings.Settings(routing={"tuning": {"prefix_dense_head_blocks": -1}})


# -- TLS and the admin token -------------------------------------------------------------------


NODE = ["--node", "http://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MERIDIAN_AGENT_SERVER__TLS_CERT_FILE": "/nonexistent/agent.crt",
          "MERIDIAN_AGENT_SERVER__TLS_KEY_FILE": __file__}, "server.tls_cert_file"),
        ({"MERIDIAN_AGENT_SERVER__TLS_CERT_FILE": __file__}, "server.tls_key_file is not"),
        ({"MERIDIAN_AGENT_SERVER__TLS_KEY_FILE": __file__}, "server.tls_cert_file is not"),
        ({"MERIDIAN_AGENT_ADMIN__TOKEN_FILE": "/nonexistent/token"}, "admin.token_file"),
        ({"MERIDIAN_AGENT_ADMIN__TOKEN_SHA256": "not-a-hash"}, "admin.token_sha256"),
        ({"MERIDIAN_AGENT_ADMIN__TOKEN": "t", "MERIDIAN_AGENT_ADMIN__TOKEN_SHA256": "0" * 64},
         "set one of admin.token"),
    ],
)  # fmt: skip
def test_bad_tls_and_token_settings_stop_the_agent_naming_the_field(
    env: dict[str, str], needle: str
) -> None:
    done = _run(NODE, env)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr


def test_a_certificate_that_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    cert, key = tmp_path / "agent.crt", tmp_path / "agent.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    env = {"MERIDIAN_AGENT_SERVER__TLS_CERT_FILE": str(cert),
           "MERIDIAN_AGENT_SERVER__TLS_KEY_FILE": str(key)}  # fmt: skip
    done = _run(NODE, env)
    assert done.returncode == 2 and "server.tls_cert_file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_admin_token_is_refused_on_the_command_line_without_echoing_it() -> None:
    done = _run([*NODE, "--admin-token", "hunter2-on-the-command-line"])
    assert done.returncode == 2
    assert "MERIDIAN_AGENT_ADMIN__TOKEN" in done.stderr and "admin.token_file" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    assert "--admin-token" not in _run(["--help"]).stdout


def test_the_admin_token_is_kept_only_as_its_hash(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"s3cret-token").hexdigest()
    given = settings.Settings(admin={"token": "s3cret-token"})
    assert given.admin.token is None and given.admin.token_sha256 == digest
    assert given.admin.verify("s3cret-token") and not given.admin.verify("s3cret")
    assert "s3cret-token" not in repr(given) + given.model_dump_json()
    hashed = settings.Settings(admin={"token_sha256": digest.upper()})
    assert hashed.admin.verify("s3cret-token") and hashed.admin.enabled
    path = tmp_path / "admin-token"
    path.write_text("s3cret-token\n")
    from_file = settings.Settings(admin={"token_file": path})
    assert from_file.admin.verify("s3cret-token") and from_file.admin.token is None
    assert "s3cret-token" not in repr(from_file)
    assert not settings.Settings().admin.enabled and not settings.Settings().admin.verify("")
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"admin.token_file: .* is empty"):
        settings.Settings(admin={"token_file": path})


def test_the_admin_token_from_the_environment_is_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_AGENT_ADMIN__TOKEN", "from-the-environment")
    loaded = settings.load()
    assert loaded.admin.token is None and loaded.admin.verify("from-the-environment")
