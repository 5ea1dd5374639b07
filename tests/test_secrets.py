"""Secrets never appear in logs, ``ps``, ``/admin`` responses or error bodies.

A real ``meridian-agent`` (HTTPS, its admin token from the environment, publishing to etcd)
in front of a real ``meridian-sim`` node, and a real ``meridian-controller`` (admin API over
HTTPS with hashed tokens, TSIG-signed DNS updates to a real BIND, one view's key wrong so the
failures are logged too) run at DEBUG.  The test uses every credential, with good and bad
values, runs the settings-error paths with secrets in them, then looks for each secret — as it
is, base64, URL-safe base64, unpadded, and for a TSIG secret its raw bytes and their hex — in:

* every process's output (stdout and stderr: the logs, DEBUG included),
* every process's ``/proc/<pid>/cmdline`` while it runs,
* every response of the run, status line, headers and body, success and error alike,
* every value the controller and the agent wrote to etcd (audit, events, status).

**One response is excluded, on purpose:** ``GET /v1/dns/bind-config`` (admin role only) exists
to hand an operator the ``named.conf`` fragments BIND needs, TSIG secrets included
(docs/api.md).  The test asserts that it does hold the secret — which also proves the scan
finds a secret where there is one — and leaves it out of the scan.

Secrets covered: the agent's admin token (right and wrong ones), the controller's viewer,
operator and admin tokens (and a wrong one), the TSIG secrets (the right one and a wrong one),
the private key of each TLS listener, and, when these settings exist in this tree, data-plane
API keys (``tenants.keys_file``) and any etcd password field (used in the settings-error
paths; the etcd layer's own tests run an etcd with auth).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from controlplane.settings import ControllerSettings
from meridian_wire import keys
from regional_agent import settings as agent_settings
from tests.controlplane.dns_helpers import EU_ADDRESS
from tests.faults.harness import MODEL, NodeProc, wait_http
from tests.support import BindServer, EtcdServer
from tests.support.certs import CertAuthority
from tests.support.etcd import client as etcd_client
from tests.support.ports import free_port
from tests.support.process import ServerProcess

EXCLUDED = "/v1/dns/bind-config"  # returns TSIG secrets to an admin by design (see above)


def _token(label: str) -> str:
    return f"{label}-{secrets.token_urlsafe(24)}"


# -- what the run saw ---------------------------------------------------------------------------


@dataclass
class Seen:
    """Everything the run produced that a secret must not be in, by where it came from."""

    texts: dict[str, bytes] = field(default_factory=dict)

    def add(self, where: str, data: bytes | str) -> None:
        raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
        self.texts[f"{len(self.texts):04d} {where}"] = raw

    def response(self, r: httpx.Response) -> httpx.Response:
        where = f"{r.request.method} {r.request.url}"
        if EXCLUDED in str(r.request.url):  # its refusals are scanned, never its answer
            assert r.status_code >= 400, "the excluded route's answer must not be scanned"
        head = f"HTTP {r.status_code} {r.reason_phrase}\n" + "".join(
            f"{k}: {v}\n" for k, v in r.headers.items()
        )
        self.add(f"response {where}", head.encode() + b"\n" + r.content)
        return r


def forms(secret: str | bytes) -> set[bytes]:
    """A secret as it is and in the encodings a leak would likely take."""
    raw = secret.encode() if isinstance(secret, str) else secret
    out = {raw}
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        out |= {encoded, encoded.rstrip(b"=")}
    if isinstance(secret, str):  # a base64 secret (TSIG): its raw bytes, hex and base64 again
        try:
            decoded = base64.b64decode(secret, validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        if len(decoded) >= 16:
            out |= {decoded, decoded.hex().encode(), decoded.hex().upper().encode()}
    return {f for f in out if len(f) >= 12}


def pem_secrets(key_file: Path) -> list[str]:
    """The base64 lines of a PEM private key (each is unique to it)."""
    lines = key_file.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("-----") and len(line) >= 40]


# -- settings that may or may not exist in this tree ------------------------------------------


def _password_fields(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the settings whose name says they hold a password (etcd auth, when present)."""
    out: list[tuple[str, ...]] = []
    for name, f in model.model_fields.items():
        annotation = f.annotation
        candidates = getattr(annotation, "__args__", None) or (annotation,)
        sub = next(
            (a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
        if sub is not None:
            out += _password_fields(sub, (*path, name))
        elif "password" in name:
            out.append((*path, name))
    return out


def _keys_file(directory: Path) -> tuple[Path, str] | None:
    """A data-plane keys file with one tenant and one key, and the key; None when this tree's
    agent has no ``tenants.keys_file``."""
    tenants = agent_settings.Settings.model_fields.get("tenants")
    load = getattr(agent_settings, "load_keys_file", None)
    if tenants is None or load is None:
        return None
    key = "mk-" + secrets.token_urlsafe(32)
    path = directory / "keys.toml"
    digest = hashlib.sha256(key.encode()).hexdigest()
    path.write_text(
        f'[[tenants]]\nname = "acme"\n[[tenants.keys]]\nname = "2026-01"\nsha256 = "{digest}"\n'
    )
    load(path)  # the format as this tree reads it, or the test says why not
    return path, key


# -- the processes ------------------------------------------------------------------------------


def _toml(table: dict[str, Any], prefix: str = "") -> str:
    """Just enough TOML for these settings: scalars, lists of scalars, tables, arrays of tables."""
    lines: list[str] = []
    nested: list[str] = []
    for k, v in table.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            nested.append(f"\n[{name}]\n" + _toml(v, name))
        elif isinstance(v, list) and v and all(isinstance(i, dict) for i in v):
            nested += [f"\n[[{name}]]\n" + _toml(i, name) for i in v]
        else:
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "".join(nested) + "\n"


@dataclass
class Run:
    tmp: Path
    seen: Seen
    secrets: dict[str, str | bytes]
    ca: CertAuthority
    procs: list[ServerProcess] = field(default_factory=list)

    def secret(self, name: str, value: str | bytes) -> str | bytes:
        self.secrets[name] = value
        return value

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        p = ServerProcess(
            argv, log_path=self.tmp / f"{name}.log", env={**os.environ, **(env or {})}
        )
        self.procs.append(p)
        return p

    def cmdline(self, name: str, process: ServerProcess) -> None:
        assert process.exit_code() is None, process.failure(f"{name} exited")
        self.seen.add(f"/proc/{name}/cmdline", Path(f"/proc/{process.pid}/cmdline").read_bytes())

    def settle(self) -> None:
        """Stop every process and take its whole output."""
        for p in self.procs:
            p.stop()
            self.seen.add(f"output of {p.log_path.name}", p.log_path.read_bytes())


def _run_once(run: Run, name: str, argv: list[str], env: dict[str, str]) -> str:
    """A process expected to refuse its settings: its output goes to the scan."""
    done = subprocess.run(
        argv, capture_output=True, timeout=60, env={**os.environ, **env}, stdin=subprocess.DEVNULL
    )
    run.seen.add(f"{name} stdout", done.stdout)
    run.seen.add(f"{name} stderr", done.stderr)
    assert done.returncode == 2, (name, done.stdout, done.stderr)
    return done.stderr.decode()


AGENT = [sys.executable, "-m", "regional_agent.cli"]
CONTROLLER = [sys.executable, "-m", "controlplane.cli"]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp=tmp_path, seen=Seen(), secrets={}, ca=CertAuthority.create(tmp_path / "pki"))
    try:
        yield r
    finally:
        for p in r.procs:
            p.stop()


@pytest.fixture
async def client(run: Run) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=run.ca.client(), timeout=30) as c:
        yield c


# -- the test -----------------------------------------------------------------------------------


@dataclass
class Credentials:
    agent: str
    wrong_agent: str
    tokens: dict[str, str]  # the controller's, by role
    wrong_controller: str
    tsig_good: str
    tsig_wrong: str
    data_key: str | None
    wrong_key: str


def _agent_config(run: Run, etcd: EtcdServer, node: NodeProc, keys_file: Path | None) -> Path:
    pair = run.ca.issue("agent", serial=11)
    for i, line in enumerate(pem_secrets(pair.key)):
        run.secret(f"agent TLS private key, line {i}", line)
    config: dict[str, Any] = {
        "server": {"tls_cert_file": str(pair.cert), "tls_key_file": str(pair.key)},
        "telemetry": {"scrape_interval_s": 0.2, "models_refresh_s": 0.5},
        "health": {"probe_interval_s": 0.2},
        "region": {
            "id": "eu-west",
            "geo": "eu",
            "etcd": [etcd.url],
            "lease_ttl_s": 2,
            "window_s": 1.0,
            "endpoints": [f"https://{EU_ADDRESS}"],
        },
        "nodes": [{"url": node.url}],
    }
    if keys_file is not None:
        config["tenants"] = {"keys_file": str(keys_file)}
    path = run.tmp / "agent.toml"
    path.write_text(_toml(config))
    return path


def _controller_config(
    run: Run, etcd: EtcdServer, bind: BindServer, creds: Credentials, ports: tuple[int, int]
) -> dict[str, Any]:
    pair = run.ca.issue("controller-admin", serial=12)
    for i, line in enumerate(pem_secrets(pair.key)):
        run.secret(f"controller TLS private key, line {i}", line)
    geo_a, default = bind.view("geo-a"), bind.view("default")
    tokens = [
        {"name": f"{role}-user", "role": role, "sha256": hashlib.sha256(t.encode()).hexdigest()}
        for role, t in creds.tokens.items()
    ]
    views = [
        {
            "name": geo_a.name,
            "geo": "eu",
            "match_clients": [geo_a.source],
            "tsig": {"name": geo_a.key.name, "secret": creds.tsig_good},
        },
        {
            "name": default.name,
            "geo": "us",
            "tsig": {"name": default.key.name, "secret": creds.tsig_wrong},
        },
    ]
    config = {
        "etcd": {"endpoints": [etcd.url], "timeout_s": 1.0},
        "election": {"id": "ctl-secrets", "lease_ttl_s": 2},
        "failover": {
            "window_s": 0.5,
            "status_stale_s": 5.0,
            "agent_heartbeat_s": 1.0,
            "min_hold_s": 0.0,
        },
        "server": {"port": ports[0]},
        "api": {
            "port": ports[1],
            "tls": {
                "cert_file": str(pair.cert),
                "key_file": str(pair.key),
                "ca_file": str(run.ca.cert),
            },
            "tokens": tokens,
        },
        "dns": {
            "backend": "rfc2136",
            "server": bind.host,
            "port": bind.port,
            "zone": bind.zone,
            "timeout_s": 0.5,
            "retry_initial_s": 0.1,
            "retry_max_s": 0.5,
            "views": views,
        },
        "regions": [
            {"id": "eu-west", "geo": "eu", "backups": ["us-east"]},
            {"id": "us-east", "geo": "us", "backups": ["eu-west"]},
        ],
    }
    ControllerSettings.model_validate(config)  # what the file will say, checked here
    return config


async def _use_agent(seen: Seen, client: httpx.AsyncClient, url: str, creds: Credentials) -> None:
    good = {"Authorization": f"Bearer {creds.agent}"}
    bad = {"Authorization": f"Bearer {creds.wrong_agent}"}
    data = {"Authorization": f"Bearer {creds.data_key}"} if creds.data_key else {}
    end = time.monotonic() + 30
    while seen.response(await client.get(f"{url}/ready")).status_code != 200:
        assert time.monotonic() < end, "the agent never became ready"
        await asyncio.sleep(0.2)
    for path in ("/health", "/metrics", "/v1/models"):
        seen.response(await client.get(f"{url}{path}", headers=data))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    completions = f"{url}/v1/chat/completions"
    for body in (chat, {**chat, "stream": True}):
        r = seen.response(await client.post(completions, json=body, headers=data))
        assert r.status_code == 200, r.text
    for headers in ({"Authorization": f"Bearer {creds.wrong_key}"}, {}):
        r = seen.response(await client.post(completions, json=chat, headers=headers))
        assert r.status_code == (401 if creds.data_key else 200), r.text
    garbage = {**data, "content-type": "application/json"}
    seen.response(await client.post(completions, content=b"{not json", headers=garbage))
    wrongs = [
        bad,
        {},
        {"Authorization": f"Basic {creds.agent}"},
        {"Authorization": creds.agent},
        {"Authorization": f"Bearer {creds.agent}x"},
    ]
    for path in ("/admin/nodes", "/admin/queue", "/admin/policy"):
        assert seen.response(await client.get(f"{url}{path}", headers=good)).status_code == 200
        for wrong in wrongs:
            r = seen.response(await client.get(f"{url}{path}", headers=wrong))
            assert r.status_code == 401
    listing = seen.response(await client.get(f"{url}/admin/nodes", headers=good)).json()
    node_id = listing["nodes"][0]["id"]
    # (a 400 names the bad value it was sent, as it should: no secret goes in these bodies)
    calls: list[tuple[str, str, Any]] = [
        ("POST", "/admin/nodes", {"url": "not a url", "weight": -1}),
        ("PUT", "/admin/policy", {"policy": "fastest"}),
        ("PUT", f"/admin/nodes/{node_id}/weight", {"weight": "heavy"}),
        ("POST", f"/admin/nodes/{node_id}/drain", None),
        ("POST", f"/admin/nodes/{node_id}/undrain", None),
        ("DELETE", "/admin/nodes/no-such-node", None),
    ]
    for method, path, body in calls:
        for headers in (good, bad):
            r = await client.request(method, f"{url}{path}", json=body, headers=headers)
            seen.response(r)


async def _use_controller(
    seen: Seen, client: httpx.AsyncClient, urls: tuple[str, str], creds: Credentials
) -> None:
    admin_url, read_url = urls
    auth = {role: {"Authorization": f"Bearer {t}"} for role, t in creds.tokens.items()}
    wrong = {"Authorization": f"Bearer {creds.wrong_controller}"}
    end = time.monotonic() + 30
    while not seen.response(await client.get(f"{admin_url}/v1/health")).json().get("leading"):
        assert time.monotonic() < end, "the controller never led"
        await asyncio.sleep(0.2)
    reads = [
        "/v1/health",
        "/v1/regions",
        "/v1/regions/eu-west",
        "/v1/regions/nowhere",
        "/v1/dns",
        "/v1/events",
        "/v1/policies",
        "/v1/openapi.json",
        "/v1/audit",
        "/health",
    ]
    for path in reads:
        for base in urls:
            for headers in (auth["viewer"], auth["operator"], wrong, {}):
                seen.response(await client.get(f"{base}{path}", headers=headers))
    for base in urls:  # the excluded route's refusals are scanned like any other
        seen.response(await client.get(f"{base}{EXCLUDED}", headers=wrong))
        seen.response(await client.get(f"{base}{EXCLUDED}", headers=auth["viewer"]))
    writes: list[tuple[str, str, Any]] = [
        ("POST", "/v1/regions/us-east/drain?dry_run=true", {"reason": "secrets test"}),
        ("POST", "/v1/regions/us-east/drain", {"reason": "secrets test"}),
        ("POST", "/v1/regions/us-east/undrain", {"reason": "secrets test"}),
        ("POST", "/v1/regions/eu-west/failover", {"reason": "x", "target": "mars"}),
        ("PUT", "/v1/policies?dry_run=true", {"reason": "what if", "strikes": 4}),
        ("PUT", "/v1/policies", {"reason": "bad", "strikes": "many"}),
    ]
    for method, path, body in writes:
        for base in urls:
            for headers in (auth["operator"], auth["admin"], auth["viewer"], wrong):
                r = await client.request(method, f"{base}{path}", json=body, headers=headers)
                seen.response(r)
    garbage = {**auth["operator"], "content-type": "application/json"}
    drain = f"{admin_url}/v1/regions/eu-west/drain"
    seen.response(await client.post(drain, content=b"[[[", headers=garbage))
    seen.response(await client.post(f"{read_url}/v1/regions/eu-west/drain", headers=wrong))


def _password(run: Run, name: str, path: tuple[str, ...]) -> str:
    """A new password secret for the setting at ``path``: the value, or for a ``*_file``
    setting a file that holds it (its path is the value)."""
    password = str(run.secret(name, _token("password")))
    if not path[-1].endswith("_file"):
        return password
    where = run.tmp / f"password-{len(run.secrets)}"
    where.write_text(password + "\n")
    return str(where)


def _refused_settings(run: Run, node: NodeProc, creds: Credentials, config: dict[str, Any]) -> None:
    """Settings the daemons refuse, with secrets in them: the errors name fields, not values."""
    token_file = run.tmp / "admin-token"
    token_file.write_text(creds.agent + "\n")
    flag = str(run.secret("a token given as a flag", _token("flag")))
    agent = [*AGENT, "--node", node.url]
    stderr = _run_once(run, "agent --admin-token", [*agent, "--admin-token", flag], {})
    assert "MERIDIAN_AGENT_ADMIN__TOKEN" in stderr
    bad = {"MERIDIAN_AGENT_QUEUE__MAX_DEPTH": "-1"}
    token = "MERIDIAN_AGENT_ADMIN__TOKEN"
    cases: list[tuple[str, dict[str, str]]] = [
        ("env token, bad setting", {**bad, token: creds.agent}),
        ("token and a hash", {token: creds.agent, f"{token}_SHA256": creds.agent}),
        ("token given as its hash", {f"{token}_SHA256": creds.agent}),
        ("token file, bad setting", {**bad, f"{token}_FILE": str(token_file)}),
        ("empty token", {token: " "}),
    ]
    for path in _password_fields(agent_settings.Settings):  # etcd auth, when this tree has it
        value = _password(run, f"agent {'.'.join(path)}", path)
        cases.append((".".join(path), {**bad, "MERIDIAN_AGENT_" + "__".join(path).upper(): value}))
    for name, env in cases:
        _run_once(run, f"agent, {name}", agent, env)

    controller = [*CONTROLLER, "--config"]
    good = run.tmp / "controller.toml"
    for path in _password_fields(ControllerSettings):
        env = {
            "MERIDIAN_CONTROLLER_" + "__".join(path).upper(): _password(
                run, f"controller {'.'.join(path)}", path
            ),
            "MERIDIAN_CONTROLLER_FAILOVER__STRIKES": "0",
        }
        _run_once(run, f"controller, {'.'.join(path)}", [*controller, str(good)], env)
    short = str(run.secret("a TSIG secret too short", base64.b64encode(b"0123456789").decode()))
    broken = dict(config)
    broken["dns"] = {
        **config["dns"],
        "port": 0,
        "views": [
            {"name": "geo-a", "geo": "eu", "tsig": {"name": "k", "secret": short}},
            {"name": "default", "geo": "us", "tsig": {"name": "k2", "secret": creds.tsig_good}},
        ],
    }
    pasted = {"name": "pasted", "role": "admin", "sha256": creds.tokens["admin"]}  # not a hash
    broken["api"] = {**config["api"], "tokens": [pasted]}
    (run.tmp / "broken.toml").write_text(_toml(broken))
    stderr = _run_once(
        run, "controller, bad settings", [*controller, str(run.tmp / "broken.toml")], {}
    )
    assert "api.tokens" in stderr and "dns" in stderr


async def test_no_secret_appears_in_logs_ps_responses_or_etcd(
    run: Run, client: httpx.AsyncClient, etcd: EtcdServer, bind: BindServer
) -> None:
    seen = run.seen
    keys_file = _keys_file(run.tmp)
    creds = Credentials(
        agent=str(run.secret("agent admin token", _token("agent-admin"))),
        wrong_agent=str(run.secret("a wrong agent token", _token("wrong-agent"))),
        tokens={
            role: str(run.secret(f"controller {role} token", _token(role)))
            for role in ("viewer", "operator", "admin")
        },
        wrong_controller=str(run.secret("a wrong controller token", _token("wrong-ctl"))),
        tsig_good=str(run.secret("TSIG secret (geo-a)", bind.view("geo-a").key.secret)),
        tsig_wrong=str(
            run.secret("TSIG secret, wrong (default)", base64.b64encode(os.urandom(32)).decode())
        ),
        data_key=str(run.secret("data-plane API key", keys_file[1])) if keys_file else None,
        wrong_key=str(run.secret("a wrong data-plane key", "mk-" + secrets.token_urlsafe(32))),
    )

    node = NodeProc(port=free_port(), log_dir=run.tmp).start()
    assert node.process is not None
    run.procs.append(node.process)
    agent_port = free_port()
    agent_config = _agent_config(run, etcd, node, keys_file[0] if keys_file else None)
    argv = [*AGENT, "--config", str(agent_config), "--host", "127.0.0.1"]
    argv += ["--port", str(agent_port), "--log-level", "DEBUG"]
    agent = run.start("agent", argv, env={"MERIDIAN_AGENT_ADMIN__TOKEN": creds.agent})
    agent_url = f"https://127.0.0.1:{agent_port}"
    wait_http(f"{agent_url}/health", what="agent", process=agent, context=run.ca.client())

    read_port, admin_port = free_port(), free_port()
    config = _controller_config(run, etcd, bind, creds, (read_port, admin_port))
    (run.tmp / "controller.toml").write_text(_toml(config))
    argv = [*CONTROLLER, "--config", str(run.tmp / "controller.toml"), "--log-level", "DEBUG"]
    controller = run.start("controller", argv)
    urls = (f"https://127.0.0.1:{admin_port}", f"http://127.0.0.1:{read_port}")
    context = run.ca.client()
    wait_http(f"{urls[0]}/v1/health", what="controller", process=controller, context=context)
    for name, process in (("agent", agent), ("controller", controller), ("node", node.process)):
        run.cmdline(name, process)

    await _use_agent(seen, client, agent_url, creds)
    os.kill(agent.pid, signal.SIGHUP)  # the certificate (and keys file) read again, and logged
    await _use_controller(seen, client, urls, creds)
    # DNS: the geo-a view takes the updates, the default view refuses the wrong key (logged)
    end = time.monotonic() + 30
    while "dns: updated view=geo-a" not in controller.log_tail(200_000):
        assert time.monotonic() < end, controller.log_tail()
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # a few more tries of the default view
    # the excluded route holds the secret, as it should; the scan would find it there
    admin = {"Authorization": f"Bearer {creds.tokens['admin']}"}
    answer = await client.get(f"{urls[0]}{EXCLUDED}", headers=admin)
    assert answer.status_code == 200
    assert any(needle in answer.content for needle in forms(creds.tsig_good))
    for name, process in (("agent", agent), ("controller", controller)):
        run.cmdline(name, process)

    _refused_settings(run, node, creds, config)

    store = etcd_client(etcd.url, timeout_s=2.0)
    try:
        for entry in (await store.get_prefix(keys.PREFIX)).entries:
            seen.add(f"etcd {entry.key}", entry.value)
    finally:
        await store.close()
    run.settle()
    logs = b"".join(t for w, t in seen.texts.items() if w.split(" ", 1)[1].startswith("output"))
    assert b"TLS certificate reloaded" in logs, "the agent never logged the SIGHUP reload"
    assert b"dns: updated view=geo-a" in logs

    leaks = [
        f"{name} ({needle[:6]!r}...) in {where}"
        for name, secret in run.secrets.items()
        for needle in forms(secret)
        for where, text in seen.texts.items()
        if needle in text
    ]
    assert not leaks, "\n".join(leaks[:50])
    assert len(seen.texts) > 150, len(seen.texts)
