"""meridian-agent's settings: flags over environment over the TOML file; bad ones stop it."""

from __future__ import annotations

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
        (["--node", "localhost:8000"], {}, "nodes.0.url"),
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
