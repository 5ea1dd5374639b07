"""meridianctl against a real controller and real etcd: every command, its output, its exit
codes, confirmation (on a real terminal: a pty), servers that are not the admin API, and the
'done when' of issue 7."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from controlplane.settings.api import TokenEntry
from meridian_wire import keys
from meridian_wire.models import DnsApplied, DnsRecord, DnsViewApplied, RegionHealth
from meridianctl import config as ctl_config
from meridianctl.cli import cli
from meridianctl.errors import CtlError, Exit
from tests.conftest import NodeFactory
from tests.meridianctl.conftest import Ctl, Ran
from tests.meridianctl.stack import REGIONS, TOKENS, Stack, leading, token_settings
from tests.support import EtcdServer, free_port
from tests.support.agent import AgentFactory

MERIDIANCTL = str(Path(sys.executable).parent / "meridianctl")


async def _state(stack: Stack, region: str) -> str:
    entry = await stack.store.get(keys.health(region))
    assert entry is not None
    return RegionHealth.model_validate_json(entry.value).state


async def test_status_shows_every_region(ctl: Ctl) -> None:
    ran = await ctl("status", role="viewer")
    assert ran.code == 0, ran.err
    header = ran.out.splitlines()[0].split()
    assert header == ["REGION", "STATE", "STRIKES", "CAPACITY", "LOAD", "WEIGHT", "BACKUP",
                      "FLOOR"]  # fmt: skip
    for region in ("eu-west", "eu-north", "us-east"):
        assert region in ran.out
    assert "healthy" in ran.out and "geography eu:" in ran.out
    as_json = await ctl("status", "--output", "json", role="viewer")
    data = json.loads(as_json.out)
    assert {r["region"] for r in data["regions"]} == {"eu-west", "eu-north", "us-east"}


async def test_failover_dry_run_apply_and_failback(stack: Stack, ctl: Ctl) -> None:
    before = await stack.snapshot()
    dry = await ctl("failover", "--from", "eu-west", "--reason", "test", "--dry-run")
    assert dry.code == 0, dry.err
    assert "eu-west: healthy -> failed" in dry.out and "dry run: nothing changed" in dry.out
    assert await stack.snapshot() == before

    done = await ctl("failover", "--from", "eu-west", "--reason", "test", "--yes")
    assert done.code == 0, done.err
    assert "did change" in done.out
    assert await _state(stack, "eu-west") == "failed"
    shown = await ctl("regions", "show", "eu-west", role="viewer")
    assert "manual failover by operator-user: test" in shown.out

    audit = await ctl("audit")
    assert audit.code == 0 and "failover" in audit.out and "applied" in audit.out

    back = await ctl("failback", "eu-west", "--reason", "fixed", "--yes")
    assert back.code == 0, back.err
    for _ in range(100):
        if await _state(stack, "eu-west") == "healthy":
            break
        await asyncio.sleep(0.1)
    assert await _state(stack, "eu-west") == "healthy"


async def _audit(stack: Stack) -> list[dict[str, Any]]:
    """The audit log, oldest first: every action, dry runs too, lands in it."""
    snapshot = await stack.store.get_prefix(keys.AUDIT)
    return [json.loads(e.value) for e in sorted(snapshot.entries, key=lambda e: e.key)]


def _applied(audit: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in audit if a["result"] == "applied"]


def _env(stack: Stack, role: str) -> dict[str, str]:
    env = {**os.environ, "MERIDIAN_URL": stack.url("ctl-a"), "MERIDIAN_TOKEN": TOKENS[role],
           "MERIDIAN_RETRY_S": "0"}  # fmt: skip
    env.pop("MERIDIANCTL_CONFIG", None)
    return env


def _on_a_terminal(args: list[str], env: dict[str, str], typed: str) -> Ran:
    """meridianctl as a process whose standard input is a terminal (a pty) on which ``typed``
    is typed, as an operator at a shell runs it."""
    main, tty = pty.openpty()
    try:
        proc = subprocess.Popen([MERIDIANCTL, *args], stdin=tty, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    finally:
        os.close(tty)
    try:
        os.write(main, typed.encode())
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        os.close(main)
    return Ran(proc.returncode, out, err)


# every action, in an order in which each applies to the state the one before left
ACTIONS: tuple[tuple[list[str], str, str], ...] = (
    (["drain", "us-east", "--reason", "maintenance"], "operator", "drain"),
    (["undrain", "us-east", "--reason", "maintenance done"], "operator", "undrain"),
    (["failover", "--from", "eu-west", "--reason", "INC-1"], "operator", "failover"),
    (["failback", "eu-west", "--reason", "INC-1 fixed"], "operator", "failback"),
    (["policies", "set", "strikes=4", "--reason", "tuning"], "admin", "policies"),
)


async def test_every_action_asks_on_a_terminal_and_no_changes_nothing(stack: Stack) -> None:
    for args, role, action in ACTIONS:
        applied = _applied(await _audit(stack))
        no = await asyncio.to_thread(_on_a_terminal, args, _env(stack, role), "n\n")
        assert no.code == 9, (args, no.out, no.err)
        assert "would change" in no.out and "apply this? [y/N]" in no.out, (args, no.out)
        assert "aborted: nothing was changed" in no.err
        assert _applied(await _audit(stack)) == applied, args
        yes = await asyncio.to_thread(_on_a_terminal, args, _env(stack, role), "y\n")
        assert yes.code == 0, (args, yes.out, yes.err)
        assert "apply this? [y/N]" in yes.out and "did change" in yes.out, (args, yes.out)
        now = _applied(await _audit(stack))
        assert len(now) == len(applied) + 1 and now[-1]["action"] == action, (args, now[-1])


async def test_without_a_terminal_no_action_runs_without_yes_and_nothing_is_sent(
    stack: Stack, ctl: Ctl
) -> None:
    audit = await _audit(stack)
    for args, role, _ in ACTIONS:
        # a piped answer is not a confirmation: nobody saw the plan
        ran = await ctl(*args, role=role, input="y\n")
        assert ran.code == 9, (args, ran.out, ran.err)
        command = " ".join(args[:2]) if args[0] == "policies" else args[0]
        assert ran.err.splitlines()[0] == (
            f"meridianctl: {command} asks for confirmation, but standard input is not a "
            "terminal; nothing was sent"
        )
        assert "--dry-run" in ran.err and "--yes (-y)" in ran.err and ran.out == ""
    # not even the dry run that shows the plan was sent: each one is audited
    assert await _audit(stack) == audit
    # a process whose standard input is a pipe that stays open does not wait on it
    proc = await asyncio.to_thread(
        subprocess.Popen, [MERIDIANCTL, "failover", "--from", "eu-west", "--reason", "x"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(stack, "operator"), text=True,
    )  # fmt: skip
    try:
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = await asyncio.to_thread(proc.communicate)
    assert code == 9 and "not a terminal" in err
    assert await _audit(stack) == audit
    for args, role, _ in ACTIONS:
        done = await ctl(*args, "--yes", role=role)
        assert done.code == 0 and "did change" in done.out, (args, done.out, done.err)


async def test_exit_codes(stack: Stack, ctl: Ctl) -> None:
    before = await stack.snapshot()
    viewer = await ctl("failover", "--from", "eu-west", "--reason", "x", "--yes", role="viewer")
    assert viewer.code == 5 and "needs role operator" in viewer.err
    nobody = await ctl("status", role="not-a-token")
    assert nobody.code == 4 and "what to do" in nobody.err
    unknown = await ctl("drain", "mars-1", "--reason", "x", "--yes")
    assert unknown.code == 6 and "known regions" in unknown.err
    residency = await ctl("failover", "--from", "eu-west", "--to", "us-east", "--reason", "x",
                          "--yes")  # fmt: skip
    assert residency.code == 7 and "residency" in residency.err and "eu-north" in residency.err
    usage = await ctl("failover", "--reason", "x")
    assert usage.code == 2
    bad_key = await ctl("policies", "set", "nonsense=1", "--reason", "x", role="admin")
    assert bad_key.code == 2 and "window_s" in bad_key.err
    out_of_range = await ctl("policies", "set", "strikes=0", "--reason", "x", "--yes",
                             role="admin")  # fmt: skip
    assert out_of_range.code == 7 and "strikes" in out_of_range.err
    bad_rule = await ctl("policies", "set", "shares=biggest", "--reason", "x", role="admin")
    assert bad_rule.code == 2 and "capacity" in bad_rule.err and "equal" in bad_rule.err
    not_admin = await ctl("policies", "set", "strikes=4", "--reason", "x", "--yes")
    assert not_admin.code == 5
    assert await stack.snapshot() == before


async def test_unreachable_api_exits_3(ctl: Ctl) -> None:
    env = {**os.environ, "MERIDIAN_URL": f"http://127.0.0.1:{free_port()}", "MERIDIAN_TOKEN": "x",
           "MERIDIAN_RETRY_S": "0.5"}  # fmt: skip
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "meridianctl", "status"], env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "cannot reach the admin API" in done.stderr


async def test_policies_dns_events_health(stack: Stack, ctl: Ctl) -> None:
    got = await ctl("policies", "get", role="viewer")
    assert got.code == 0 and "strikes" in got.out and "settings" in got.out
    before = await stack.snapshot()
    dry = await ctl("policies", "set", "strikes=4", "ramp=0.1,0.5,1", "--reason", "tuning",
                    "--dry-run", role="admin")  # fmt: skip
    assert dry.code == 0, dry.err
    assert dry.out.splitlines()[0] == "policies: would change"
    assert re.search(r"^  strikes\s+3 -> 4$", dry.out, re.M), dry.out
    assert re.search(r"^  ramp\s+0.05,0.25,0.5,1 -> 0.1,0.5,1$", dry.out, re.M), dry.out
    assert "window_s" not in dry.out and "(dry run: nothing changed)" in dry.out
    assert await stack.snapshot() == before
    done = await ctl("policies", "set", "strikes=4", "ramp=0.1,0.5,1", "ttft_p99_slo_s=off",
                     "shares=equal", "--reason", "tuning", "--yes", role="admin")  # fmt: skip
    assert done.code == 0, done.err
    assert "policies: did change" in done.out and "next window" in done.out
    data = json.loads((await ctl("policies", "get", "-o", "json", role="viewer")).out)
    assert data["values"]["strikes"] == 4 and data["values"]["ramp"] == [0.1, 0.5, 1.0]
    assert data["values"]["ttft_p99_slo_s"] is None and data["by"] == "admin-user"
    assert data["values"]["shares"] == "equal"
    dns = await ctl("dns", "show", role="viewer")
    assert dns.code == 0 and "no DNS plan applied yet" in dns.out
    bind = await ctl("dns", "bind-config", role="admin")
    assert bind.code == 0 and "Meridian DNS steering" in bind.out
    assert (await ctl("dns", "bind-config", role="operator")).code == 5
    await ctl("drain", "us-east", "--reason", "for events", "--yes")
    ev = await ctl("events", "--region", "us-east", role="viewer")
    assert ev.code == 0 and "operator set draining" in ev.out
    followed = await ctl("events", "--follow", "--count", "1", "--interval", "0.2", role="viewer")
    assert followed.code == 0 and followed.out.strip()
    health = await ctl("health", role="viewer")
    assert health.code == 0 and "ctl-a: leading" in health.out
    assert re.search(r"window \d+ \(last pass \d+ ms, \d+ keys\)", health.out), health.out


async def test_shell_completion_script(ctl: Ctl) -> None:
    ran = await ctl("completion", "bash")
    assert ran.code == 0 and "_MERIDIANCTL_COMPLETE" in ran.out


async def test_against_a_meridian_controller_process_with_admin_port_flag(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """The console scripts as an operator runs them: a controller process, meridianctl."""
    config = tmp_path / "controller.toml"
    lines = [f'[etcd]\nendpoints = ["{etcd.url}"]\n', "[failover]\nwindow_s = 0.5\n"]
    lines.append("[api]\n")
    for t in token_settings():
        lines.append(f'[[api.tokens]]\nname = "{t["name"]}"\nrole = "{t["role"]}"\n'
                     f'sha256 = "{t["sha256"]}"\n')  # fmt: skip
    for r in REGIONS:
        lines.append(f'[[regions]]\nid = "{r["id"]}"\ngeo = "{r["geo"]}"\n'
                     f"residency = {json.dumps(r['residency'])}\n")  # fmt: skip
    config.write_text("\n".join(lines))
    port = free_port()
    stack = Stack(etcd.url)
    stack.start_agents()
    bin_dir = Path(sys.executable).parent
    proc = await asyncio.create_subprocess_exec(
        str(bin_dir / "meridian-controller"), "--config", str(config), "--port", "0",
        "--admin-port", str(port), "--id", "ctl-proc",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = b""
        async with asyncio.timeout(30):
            while not line.startswith(b"ADMIN "):
                line = await proc.stdout.readline()
                assert line, "the controller exited before serving its admin API"
        assert line.decode().strip() == f"ADMIN http://127.0.0.1:{port}"
        env = {**os.environ, "MERIDIAN_URL": f"http://127.0.0.1:{port}",
               "MERIDIAN_TOKEN": "viewer-secret-token"}  # fmt: skip
        for _ in range(50):
            done = await asyncio.to_thread(
                subprocess.run, [str(bin_dir / "meridianctl"), "status"], env=env,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if done.returncode == 0 and "healthy" in done.stdout:
                break
            await asyncio.sleep(0.3)
        assert done.returncode == 0, done.stderr
        assert all(r["id"] in done.stdout for r in REGIONS), done.stdout
    finally:
        proc.terminate()
        await proc.wait()
        await stack.close()


async def test_token_new_prints_a_token_and_the_hash_to_configure(ctl: Ctl) -> None:
    ran = await ctl("token", "new", "--name", "alice", "--role", "operator")
    assert ran.code == 0
    token = ran.out.splitlines()[0].rsplit(" ", 1)[1]
    digest = ran.out.split('sha256 = "')[1].split('"')[0]
    assert hashlib.sha256(token.encode()).hexdigest() == digest
    assert TokenEntry(name="alice", role="operator", sha256=digest).sha256 == digest


async def test_dns_show_prints_what_was_applied(stack: Stack, ctl: Ctl) -> None:
    applied = DnsApplied(
        backend="rfc2136", server="127.0.0.1:53", generation=7, desired_generation=8, window=3,
        applied_at=1_800_000_000.0, error="server refused the key",
        views={"eu": DnsViewApplied(
            view="eu", zone="meridian.example.", geo="eu", reason="serving eu-north 100%",
            records=[DnsRecord(name="api.meridian.example.", type="A", ttl_s=30,
                               values=["192.0.2.7"])],
        )},
    )  # fmt: skip
    await stack.store.put(keys.DNS_APPLIED, applied.model_dump_json().encode())
    shown = await ctl("dns", "show", role="viewer")
    assert shown.code == 0, shown.err
    assert "generation 7 (newest plan 8)" in shown.out and "server refused the key" in shown.out
    assert "api.meridian.example. 30 A 192.0.2.7" in shown.out
    data = json.loads((await ctl("dns", "show", "-o", "json", role="viewer")).out)
    assert data["applied"]["generation"] == 7
    await stack.store.put(keys.DNS_APPLIED, b'{"backend": "carrier-pigeon"}')
    bad = await ctl("dns", "show", role="viewer")
    assert bad.code == 0 and "does not validate" in bad.out


async def test_etcd_down_every_command_exits_8_and_nothing_changes(
    fresh_etcd: EtcdServer,
) -> None:
    stack = Stack(fresh_etcd.url)
    stack.start_agents()
    try:
        await stack.controller("ctl-a")
        await stack.leader()
        env = {"MERIDIAN_URL": stack.url("ctl-a"), "MERIDIAN_TOKEN": "operator-secret-token",
               "MERIDIANCTL_CONFIG": None, "MERIDIAN_RETRY_S": "1"}  # fmt: skip
        runner = CliRunner()
        fresh_etcd.process.kill()
        for args in (["status"], ["failover", "--from", "eu-west", "--reason", "x", "--yes"]):
            ran = await asyncio.to_thread(runner.invoke, cli, args, env=env)
            assert ran.exit_code == 8, (args, ran.stdout, ran.stderr)
            assert "etcd unavailable" in ran.stderr and "what to do" in ran.stderr
        health = await asyncio.to_thread(runner.invoke, cli, ["health"], env=env)
        assert health.exit_code == 0 and "etcd" in health.stdout
    finally:
        await stack.close()


async def test_a_drain_during_a_leader_handover_is_retried_and_applied_once(
    etcd: EtcdServer,
) -> None:
    """A leader that died holds the leader key until its lease expires: meanwhile the replica
    answers 503, and meridianctl retries (same key) until the new leader applies it."""
    stack = Stack(etcd.url)
    stack.start_agents()
    dead = await stack.store.grant(ttl_s=3)
    await stack.store.claim(keys.LEADER, b"ctl-dead", lease=dead)
    try:
        await stack.controller("ctl-b")
        env = {"MERIDIAN_URL": stack.url("ctl-b"), "MERIDIAN_TOKEN": "operator-secret-token",
               "MERIDIANCTL_CONFIG": None, "MERIDIAN_RETRY_S": "20"}  # fmt: skip
        args = ["drain", "eu-west", "--reason", "handover", "--yes"]
        ran = await asyncio.to_thread(CliRunner().invoke, cli, args, env=env)
        assert ran.exit_code == 0, (ran.stdout, ran.stderr)
        assert "retrying in" in ran.stderr and "ctl-dead" in ran.stderr
        audit = [e for e in await _audit(stack) if e["action"] == "drain"]
        assert len(audit) == 1 and audit[0]["result"] == "applied"
    finally:
        await stack.close()


def test_a_bad_token_hash_stops_the_controller_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[api]\nport = 0\n[[api.tokens]]\nname = "a"\nrole = "viewer"\n'
                      'sha256 = "my-secret-token"\n')  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "api.tokens[0].sha256" in done.stderr and "64 hex digits" in done.stderr


def test_a_timeout_that_is_not_positive_is_a_usage_error() -> None:
    for bad in ("0", "-5", "nan"):
        with pytest.raises(CtlError, match="MERIDIAN_TIMEOUT_S") as caught:
            ctl_config.load(env={"MERIDIAN_TIMEOUT_S": bad})
        assert caught.value.code == Exit.USAGE


# a read, a region, the text route, an action and the PUT: each asks another route
NOT_ADMIN_COMMANDS: tuple[list[str], ...] = (
    ["status"],
    ["regions", "show", "eu-west"],
    ["health"],
    ["dns", "bind-config"],
    ["drain", "eu-west", "--reason", "x", "--yes"],
    ["policies", "set", "strikes=4", "--reason", "x", "--yes"],
)


async def _ctl_at(url: str, *args: str) -> Ran:
    env = {"MERIDIAN_URL": url, "MERIDIAN_TOKEN": TOKENS["admin"], "MERIDIANCTL_CONFIG": None,
           "MERIDIAN_RETRY_S": "0"}  # fmt: skip

    def invoke() -> Ran:
        result = CliRunner().invoke(cli, list(args), env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception  # a traceback: what this test is about
        return Ran(result.exit_code, result.stdout, result.stderr)

    return await asyncio.to_thread(invoke)


async def test_a_server_that_is_not_the_admin_api_is_named_with_what_it_answered(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """meridianctl pointed at a real node, a real agent and etcd's client port: one message
    that names the URL, the status and content type, and the admin port; exit code 3."""
    node = await sim_node()
    agent = await start_agent([node])
    servers = {
        "a meridian-sim node": (node, "404 Not Found (application/json"),
        "an agent": (agent.url, "404 Not Found (application/json"),
        "etcd's client port": (etcd.url, "404 Not Found (text/plain"),
    }
    for what, (url, answered) in servers.items():
        for args in NOT_ADMIN_COMMANDS:
            ran = await _ctl_at(url, *args)
            assert ran.code == 3, (what, args, ran.out, ran.err)
            first = ran.err.splitlines()[0]
            assert first.startswith(f"meridianctl: {url}/v1/"), (what, args, first)
            assert "is not the controller's admin API" in first and answered in first, first
            assert "what to do: point MERIDIAN_URL (or --url) at the controller's admin API" in (
                ran.err
            )
            assert "--admin-port" in ran.err and ran.out == ""
    # the process an operator runs: the same message, no traceback
    env = {**os.environ, "MERIDIAN_URL": etcd.url, "MERIDIAN_TOKEN": "x", "MERIDIAN_RETRY_S": "0"}
    done = await asyncio.to_thread(
        subprocess.run, [MERIDIANCTL, "status"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"meridianctl: {etcd.url}/v1/regions is not the controller's")
    assert "404 page not found" in done.stderr


async def test_status_marks_a_region_the_probes_cannot_reach_and_regions_show_says_why(
    etcd: EtcdServer, sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """ctl-a probes (``probe.enabled``): eu-west and us-east publish a real agent's address,
    eu-north a closed port.  eu-north is failed with the probe's reason, ``status`` marks it
    unreachable, and ``regions show`` prints the vote and the probe of each endpoint."""
    agent = await start_agent([await sim_node()])
    endpoints = {
        "eu-west": agent.url,
        "us-east": agent.url,
        "eu-north": f"http://127.0.0.1:{free_port()}",
    }
    probe = {"enabled": True, "interval_s": 0.5, "timeout_s": 0.4}
    async with leading(etcd.url, endpoints=endpoints, probe=probe) as stack:
        for _ in range(300):  # 15 s
            if await _state(stack, "eu-north") == "failed":
                break
            await asyncio.sleep(0.05)
        assert await _state(stack, "eu-north") == "failed", "eu-north not failed by the probes"
        assert await _state(stack, "eu-west") == "healthy"
        status = await _ctl_at(stack.url("ctl-a"), "status")
        assert status.code == 0, status.err
        north_row = next(line for line in status.out.splitlines() if line.startswith("eu-north"))
        assert "failed [unreachable]" in north_row
        west_row = next(line for line in status.out.splitlines() if line.startswith("eu-west"))
        assert "unreachable" not in west_row

        shown = await _ctl_at(stack.url("ctl-a"), "regions", "show", "eu-north")
        assert shown.code == 0, shown.err
        lines = {
            k.strip(): v.strip()
            for k, _, v in (line.partition("  ") for line in shown.out.splitlines())
        }
        assert lines["probes"].startswith("unreachable from 1 of 1 controller replicas")
        assert re.search(r"ctl-a\s+http://127\.0\.0\.1:\d+ FAILED: cannot connect", shown.out)
        west = await _ctl_at(stack.url("ctl-a"), "regions", "show", "eu-west")
        assert "reached by 1 of 1 controller replicas" in west.out
        assert re.search(rf"ctl-a\s+{re.escape(agent.url)} ok: [\d.]+ ms", west.out)
        as_json = json.loads(
            (await _ctl_at(stack.url("ctl-a"), "regions", "show", "eu-north", "-o", "json")).out
        )
        assert as_json["reach"]["failed"] == ["ctl-a"] and as_json["row"]["unreachable"] is True
        (probed,) = as_json["probes"]["ctl-a"]["probes"]
        assert probed["ok"] is False and probed["status"] is None


async def test_regions_show_prints_each_models_capacity_and_backup(etcd: EtcdServer) -> None:
    models = {
        "eu-west": {"A": 2.0, "B": 2.0},
        "eu-north": {"A": 4.0},
        "us-east": {"A": 2.0, "B": 2.0},
    }
    async with leading(etcd.url, models=models) as stack:
        for _ in range(100):
            west = await _ctl_at(stack.url("ctl-a"), "regions", "show", "eu-west")
            if "model B" in west.out and "backup not chosen" not in west.out:
                break
            await asyncio.sleep(0.1)
        lines = {
            k.strip(): v.strip()
            for k, _, v in (line.partition("  ") for line in west.out.splitlines())
        }
        # eu-west keeps half of eu-north's A (4) and of us-east's A (2) warm: floor 3
        assert lines["model A"] == "capacity 2, backup eu-north, floor 3 for others"
        assert lines["model B"] == "capacity 2, NO compliant backup, floor 1 for others"
        north = await _ctl_at(stack.url("ctl-a"), "regions", "show", "eu-north")
        assert re.search(r"model A\s+capacity 4, backup eu-west, floor 1 for others", north.out)
        data = json.loads(
            (await _ctl_at(stack.url("ctl-a"), "regions", "show", "eu-west", "-o", "json")).out
        )
        assert data["row"]["model_backups"] == {"A": "eu-north", "B": None}
