"""The servers' event loop (meridian_service.loops): uvloop by default, asyncio on request, and
a real agent that says which it runs on and serves on either."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from meridian_service import loops
from tests.support import free_port
from tests.support.process import ServerProcess


async def _kind() -> str:
    await asyncio.sleep(0)
    return loops.running()


def test_run_uses_uvloop_by_default_and_asyncio_when_asked() -> None:
    assert loops.run(_kind()) == "uvloop"
    assert loops.run(_kind(), choice="asyncio") == "asyncio"
    assert loops.factory("asyncio") is None


def _until(what: str, process: ServerProcess, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in process.log_tail(100_000):
        if process.exit_code() is not None or time.monotonic() > deadline:
            raise process.failure(f"{what} did not start")
        time.sleep(0.1)


@pytest.mark.parametrize("choice", ["uvloop", "asyncio"])
def test_the_agent_serves_on_the_loop_its_settings_name(choice: str, tmp_path: Path) -> None:
    node_port, port = free_port(), free_port()
    node_argv = [sys.executable, "-m", "meridian_sim.cli", "node", "--port", str(node_port),
                 "--profile", "cpu-tiny", "--time-scale", "50"]  # fmt: skip
    node = ServerProcess(node_argv, log_path=tmp_path / "node.log")
    node_url = f"http://127.0.0.1:{node_port}"
    argv = [sys.executable, "-m", "regional_agent.cli", "--host", "127.0.0.1", "--port",
            str(port), "--node", node_url, "--log-level", "INFO"]  # fmt: skip
    env = {**os.environ, "MERIDIAN_AGENT_SERVER__EVENT_LOOP": choice}
    agent = ServerProcess(argv, log_path=tmp_path / "agent.log", env=env)
    try:
        _until("meridian-sim", node, "READY")
        _until("meridian-agent", agent, "listening")
        assert f"loop={choice}" in agent.log_tail(100_000)
        body = {
            "model": "tiny-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
        for _ in range(100):  # until the agent's first probe found the node healthy
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as r:
                    assert json.load(r)["usage"]["completion_tokens"] == 2
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code in (404, 503), exc.read()
                time.sleep(0.1)
        else:
            raise agent.failure("no chat completion was answered")
    finally:
        agent.stop()
        node.stop()


def test_a_loop_that_is_neither_is_refused_naming_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[server]\nevent_loop = "trio"\n')
    argv = [sys.executable, "-m", "regional_agent.cli", "--config", str(config)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "server.event_loop" in out.stderr and "uvloop" in out.stderr, out.stderr
