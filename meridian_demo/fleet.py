"""``make demo``: a whole Meridian fleet on one machine, and a regional failover you can watch.

Starts, as separate processes on loopback: etcd; three regions — ``eu-west`` (4 simulated H100
nodes), ``eu-north`` (1 node, with the simulator actuator so it can pre-warm) and ``us-east``
(2 nodes) — each a set of ``meridian-sim`` nodes behind a ``meridian-agent`` that publishes to
etcd; and two ``meridian-controller`` replicas.  Clients send 16 req/s from eu and 4 from us,
each to the regions DNS gives them, by SRV weight (a refused connection tries the next answer).
With short windows (2 s instead of 30 s) it then:

1. shows eu-north pre-warming: its backup floor is half of eu-west's capacity, so its agent
   starts simulated nodes until it meets it;
2. kills eu-west's agent: three failed windows later eu-west is ``failed`` and the plan sends
   the eu geography to eu-north (never to us-east: residency).  eu-north, already at its floor,
   then follows its own load: its autoscaler (``[autoscaler.load]``, the combined policy)
   forecasts the doubled arrival rate and starts nodes above the floor, and steps back down
   towards the floor once eu-west has its traffic again (each window prints its
   ``GET /admin/autoscaler``);
3. kills the leading controller: the other replica leads within the lease TTL and nothing that
   was decided changes;
4. restarts eu-west's agent: two good windows, then the ramp 5 → 25 → 50 → 100 %;
5. hands over to an operator with ``meridianctl`` against the controllers' admin API:
   ``status``, a dry-run manual failover of eu-west that changes nothing, the
   same failover applied, a viewer token refused, the failback and its ramp, and the audit.

Every channel is secured as docs/security.md says: etcd serves TLS and asks for client
certificates (a CA and one certificate per region, per controller and for root, made with
``openssl``), ``meridian-controller etcd bootstrap`` gives each region a role that writes only
its own keys (the demo shows eu-west's certificate refused on us-east's status), and the agents
take only API keys (a tenant per region, keys stored as hashes).

A real BIND9 (when installed; ``make setup`` installs it) serves ``meridian.example.`` in two
views, configured by ``bindconf.render`` — ``eu`` for clients from 127.0.0.2, ``default`` (us)
for everyone else — and the controllers steer it with TSIG-signed RFC 2136 updates.

Every window it prints each region's judged state, strikes, weight, capacity and floor, the
leader, the plan's eu/us shares, and what ``dig -b 127.0.0.2`` (eu) and ``dig -b 127.0.0.1``
(us) are told: A records and SRV priority/weight; events as the controller records them.

At start it prints the URL of each replica's fleet page (``/ui/`` on its admin port) and the
tokens to paste there, to watch the same in a browser; ``--keep-open`` keeps the fleet running
after the script, traffic and all, until Ctrl-C, to look around and try the actions.

    python -m meridian_demo.fleet [--window-s 2] [--keep-open]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import dns.asyncquery
import dns.exception
import dns.message
import dns.query
import dns.rdatatype

from controlplane.dns import bindconf
from controlplane.settings.dns import DnsSettings

ADMIN_TOKEN = "demo-admin-token"
OPERATOR_TOKEN = "demo-operator-token"  # meridianctl: failover, failback
VIEWER_TOKEN = "demo-viewer-token"  # meridianctl: reads only
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
REGIONS = {
    "eu-west": {"geo": "eu", "residency": "eu", "nodes": 4, "lat": 53.3, "lon": -6.3},
    "eu-north": {"geo": "eu", "residency": "eu", "nodes": 1, "lat": 59.3, "lon": 18.1},
    "us-east": {"geo": "us", "residency": "", "nodes": 2, "lat": 39.0, "lon": -77.5},
}
# client-facing addresses (documentation ranges) the agents publish and DNS hands out
ADDRESSES = {"eu-west": "192.0.2.11", "eu-north": "192.0.2.12", "us-east": "198.51.100.13"}
DNS_ZONE = "meridian.example."
DNS_VIEWS = (("eu", "eu", "127.0.0.2"), ("default", "us", "127.0.0.1"))  # view, geo, clients
API_NAME = "api." + DNS_ZONE
SRV_NAME = "_https._tcp.api." + DNS_ZONE


# the clients' open-loop rates by geography (req/s); eu's clients follow DNS between eu-west and
# eu-north, us's go to us-east
RATES = {"eu": 16, "us": 4}
NODE_CAPACITY_RPS = 6.0  # eu-north's autoscaler counts a simulated node as this much

DEMO_KEY = "demo-data-plane-key"  # the traffic's API key: the agents keep only its hash
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_pki(directory: Path, clients: Sequence[str]) -> None:
    """A CA, etcd's member certificate for 127.0.0.1 and a client certificate per CN, with
    Debian's ``openssl`` (the commands of docs/security.md)."""
    directory.mkdir(parents=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", *_EC, "-days", "1", "-subj", "/CN=meridian-demo-etcd-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (directory / "member.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, ext in [("member", "member.ext"), *((c, "client.ext") for c in clients)]:
        openssl("req", "-new", *_EC, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", ext,
                "-out", f"{name}.crt")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[str]
    log: IO[str]
    url: str = ""
    admin_url: str = ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


@dataclass
class Fleet:
    work: Path
    window_s: float
    procs: list[Proc] = field(default_factory=list)
    etcd_url: str = ""
    agents: dict[str, Proc] = field(default_factory=dict)
    agent_args: dict[str, list[str]] = field(default_factory=dict)
    controllers: dict[str, Proc] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    moved_on: int = 0  # requests that went to the next answer after a refused connection
    errors: dict[str, int] = field(default_factory=dict)  # "<region> <status or error>": count
    dns: DnsSettings | None = None
    # what each geography's clients were last told (DNS, else the plan): region -> weight
    answers: dict[str, dict[str, float]] = field(
        default_factory=lambda: {
            geo: {r: 1.0 for r, i in REGIONS.items() if i["geo"] == geo} for geo in RATES
        }
    )

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> Proc:
        log = (self.work / f"{name}.log").open("w")
        base = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True,
            env={**base, **(env or {})}, start_new_session=True,
        )  # fmt: skip
        p = Proc(name=name, proc=proc, log=log)
        self.procs.append(p)
        return p

    def ready(self, p: Proc, timeout_s: float = 60.0) -> Proc:
        assert p.proc.stdout is not None
        line = p.proc.stdout.readline()
        while line and not line.startswith("READY "):  # e.g. ADMIN <url> before it
            if line.startswith("ADMIN "):
                p.admin_url = line.split()[1]
            line = p.proc.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"demo: {p.name} did not start; see {self.work / (p.name + '.log')}")
        p.url = line.split()[1]
        return p

    @property
    def pki(self) -> Path:
        return self.work / "pki"

    def etcd_files(self, cn: str) -> dict[str, str]:
        """The CA and ``cn``'s client certificate and key."""
        return {"ca_file": str(self.pki / "ca.crt"), "cert_file": str(self.pki / f"{cn}.crt"),
                "key_file": str(self.pki / f"{cn}.key")}  # fmt: skip

    def start_etcd(self) -> None:
        """etcd over TLS, client certificates required (``--client-cert-auth``)."""
        make_pki(self.pki, ["root", "meridian-controller", *(f"agent-{r}" for r in REGIONS)])
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        port, peer = _free_port(), _free_port()
        self.etcd_url = f"https://127.0.0.1:{port}"
        p = self.spawn(
            "etcd",
            [binary, "--name=demo", f"--data-dir={self.work / 'etcd'}",
             f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
             f"--listen-peer-urls=http://127.0.0.1:{peer}",
             f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
             f"--initial-cluster=demo=http://127.0.0.1:{peer}", "--log-level=error",
             f"--cert-file={self.pki / 'member.crt'}", f"--key-file={self.pki / 'member.key'}",
             f"--trusted-ca-file={self.pki / 'ca.crt'}", "--client-cert-auth"],
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                p.url = self.etcd_url
                return
            time.sleep(0.1)
        raise SystemExit("demo: etcd did not start")

    def bootstrap_etcd(self) -> list[str]:
        """``meridian-controller etcd bootstrap`` as root: the roles, users and auth."""
        config = self.work / "bootstrap.toml"
        files = self.etcd_files("root")
        config.write_text(
            f'[etcd]\nendpoints = ["{self.etcd_url}"]\n'
            + "".join(f'{k} = "{v}"\n' for k, v in files.items())
            + "".join(f'[[regions]]\nid = "{r}"\ngeo = "{i["geo"]}"\n' for r, i in REGIONS.items())
        )
        done = subprocess.run(
            [sys.executable, "-m", "controlplane.cli", "etcd", "bootstrap", "--config",
             str(config)], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"demo: etcd bootstrap failed: {done.stderr.strip()}")
        return done.stdout.splitlines()

    def write_keys(self) -> Path:
        """The agents' keys file: one tenant, the traffic's key as its SHA-256."""
        path = self.work / "tenants.toml"
        digest = hashlib.sha256(DEMO_KEY.encode()).hexdigest()
        path.write_text(
            '[[tenants]]\nname = "demo-traffic"\npriority = "normal"\nrpm = 100000\n\n'
            f'[[tenants.keys]]\nname = "demo"\nsha256 = "{digest}"\n'
        )
        return path

    def start_region(self, region: str) -> None:
        info = REGIONS[region]
        nodes = []
        for i in range(int(info["nodes"])):  # type: ignore[call-overload]
            p = self.spawn(
                f"{region}-node{i}",
                [sys.executable, "-m", "meridian_sim.cli", "node", "--port", "0",
                 "--profile", "h100-llama3-8b", "--seed", str(i), "--log-level", "WARNING"],
            )  # fmt: skip
            nodes.append(self.ready(p).url)
        args = [
            sys.executable, "-m", "regional_agent.cli", "--port", "0",
            "--region", region, "--geo", str(info["geo"]), "--etcd", self.etcd_url,
            "--endpoint", f"https://{ADDRESSES[region]}", "--log-level", "WARNING",
            *[a for n in nodes for a in ("--node", n)],
        ]  # fmt: skip
        if info["residency"]:
            args += ["--residency", str(info["residency"])]
        if region == "eu-north":
            args += ["--actuator", "simulator"]
        self.agent_args[region] = args
        self.start_agent(region)

    def start_agent(self, region: str) -> None:
        files = self.etcd_files(f"agent-{region}")  # the region's own etcd user
        env = {
            **(self.load_policy() if region == "eu-north" else {}),
            "MERIDIAN_AGENT_REGION__ETCD_CA_FILE": files["ca_file"],
            "MERIDIAN_AGENT_REGION__ETCD_CERT_FILE": files["cert_file"],
            "MERIDIAN_AGENT_REGION__ETCD_KEY_FILE": files["key_file"],
            "MERIDIAN_AGENT_TENANTS__KEYS_FILE": str(self.work / "tenants.toml"),
            "MERIDIAN_AGENT_REGION__LEASE_TTL_S": "2",
            "MERIDIAN_AGENT_REGION__WINDOW_S": str(self.window_s),
            "MERIDIAN_AGENT_REGION__MIN_INTERVAL_S": "0.5",
            "MERIDIAN_AGENT_AUTOSCALER__INTERVAL_S": "1",
            "MERIDIAN_AGENT_ADMIN__TOKEN": ADMIN_TOKEN,  # never on the command line
        }
        self.agents[region] = self.ready(
            self.spawn(f"{region}-agent", self.agent_args[region], env=env)
        )

    def load_policy(self) -> dict[str, str]:
        """eu-north's ``[autoscaler.load]``: the combined policy, sized for the demo's traffic
        (a simulated node is counted as 6 req/s, so eu's 16 req/s need 4 nodes at 80 %; the
        simulated nodes start in about a second, so the forecast looks 2 s ahead, with a calm trend
        for its one-second samples, and a quiet
        region steps down one node every 3 windows)."""
        w = self.window_s
        return {
            "MERIDIAN_AGENT_AUTOSCALER__LOAD__POLICY": "combined",
            "MERIDIAN_AGENT_AUTOSCALER__LOAD__NODE_CAPACITY_RPS": str(NODE_CAPACITY_RPS),
            "MERIDIAN_AGENT_AUTOSCALER__LOAD__PROVISION_DELAY_S": "2",
            "MERIDIAN_AGENT_AUTOSCALER__LOAD__TREND_SMOOTHING": "0.1",  # 1 s samples are noisy
            "MERIDIAN_AGENT_AUTOSCALER__LOAD__MAX_NODES": "5",
            "MERIDIAN_AGENT_AUTOSCALER__LOAD__SCALE_DOWN_FOR_S": str(3 * w),
            "MERIDIAN_AGENT_AUTOSCALER__SCALE_DOWN_DELAY_S": str(w),
        }

    def start_bind(self) -> None:
        """named with two views, from the operator's generator (``bindconf.render``)."""
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        named = shutil.which("named", path=path)
        if named is None:
            print("  BIND9 (named) is not installed: `make setup` installs it; no DNS this time")
            return
        work = self.work / "bind"
        (work / "zones").mkdir(parents=True)
        port = _free_port()
        views = [
            {
                "name": view,
                "geo": geo,
                "match_clients": [] if view == "default" else [clients],
                "tsig": {"name": f"meridian-{view}", "secret": _secret()},
            }
            for view, geo, clients in DNS_VIEWS
        ]
        self.dns = DnsSettings.model_validate(
            {"backend": "rfc2136", "server": "127.0.0.1", "port": port, "zone": DNS_ZONE,
             "views": views}
        )  # fmt: skip
        options = (
            f'options {{ directory "{work}"; pid-file "{work}/named.pid";\n'
            f'  session-keyfile "{work}/session.key"; managed-keys-directory "{work}";\n'
            f"  listen-on port {port} {{ 127.0.0.1; }}; listen-on-v6 {{ none; }};\n"
            "  recursion no; dnssec-validation no; notify no; };\ncontrols { };\n"
        )
        conf = work / "named.conf"
        conf.write_text(options + bindconf.render(self.dns, zone_dir=str(work / "zones")))
        for view, _, _ in DNS_VIEWS:
            (work / "zones" / f"{view}.{DNS_ZONE}db").write_text(
                f"$TTL 300\n@ IN SOA ns1.{DNS_ZONE} hostmaster.{DNS_ZONE} 1 3600 600 86400 30\n"
                f"@ IN NS ns1.{DNS_ZONE}\nns1.{DNS_ZONE} IN A 127.0.0.1\n"
            )
        with contextlib.suppress(OSError):  # AppArmor confines /usr/sbin/named to /etc/bind
            if Path("/sys/module/apparmor/parameters/enabled").read_text().strip() == "Y":
                named = str(shutil.copy2(named, work / "named"))
        self.spawn("named", [named, "-g", "-4", "-n", "1", "-c", str(conf)])
        deadline = time.monotonic() + 30
        pending = [clients for _, _, clients in DNS_VIEWS]
        while pending and time.monotonic() < deadline:
            query = dns.message.make_query(DNS_ZONE, dns.rdatatype.SOA)
            for source in list(pending):
                with contextlib.suppress(OSError, dns.exception.DNSException):
                    r = dns.query.udp(query, "127.0.0.1", port=port, source=source, timeout=0.5)
                    if r.answer:
                        pending.remove(source)
            time.sleep(0.1)
        if pending:
            raise SystemExit(f"demo: named did not start; see {work / 'named.conf'} and logs")

    def dns_toml(self) -> list[str]:
        if self.dns is None:
            return []
        lines = [
            "[dns]",
            'backend = "rfc2136"',
            f'server = "{self.dns.server}"',
            f"port = {self.dns.port}",
            f'zone = "{self.dns.zone}"',
            "",
        ]
        for view in self.dns.views:
            assert view.tsig is not None
            lines += [
                "[[dns.views]]",
                f'name = "{view.name}"',
                f'geo = "{view.geo}"',
                "[dns.views.tsig]",
                f'name = "{view.tsig.name}"',
                f'secret = "{view.tsig.secret.get_secret_value()}"',
                "",
            ]
        return lines

    def start_controller(self, name: str) -> None:
        config = self.work / "controller.toml"
        if not config.exists():
            lines = [
                "[failover]",
                f"window_s = {self.window_s}",
                "strikes = 3",
                "recovery_windows = 2",
                f"min_hold_s = {2 * self.window_s}",
                f"status_stale_s = {3 * self.window_s}",
                f"agent_heartbeat_s = {self.window_s}",  # MERIDIAN_AGENT_REGION__WINDOW_S
                "",
                *self.dns_toml(),
                "[api]",
                "port = 0",
            ]
            for holder, role, token in (
                ("demo-operator", "operator", OPERATOR_TOKEN),
                ("demo-viewer", "viewer", VIEWER_TOKEN),
            ):
                digest = hashlib.sha256(token.encode()).hexdigest()
                lines += ["[[api.tokens]]", f'name = "{holder}"', f'role = "{role}"',
                          f'sha256 = "{digest}"', ""]  # fmt: skip
            for region, info in REGIONS.items():
                residency = f'["{info["residency"]}"]' if info["residency"] else "[]"
                lines += [
                    "[[regions]]",
                    f'id = "{region}"',
                    f'geo = "{info["geo"]}"',
                    f"residency = {residency}",
                    f"lat = {info['lat']}",
                    f"lon = {info['lon']}",
                    "",
                ]
            config.write_text("\n".join(lines))
        p = self.spawn(
            name,
            [sys.executable, "-m", "controlplane.cli", "--etcd", self.etcd_url, "--config",
             str(config), "--id", name, "--port", "0", "--log-level", "WARNING"],
            env={"MERIDIAN_CONTROLLER_ELECTION__LEASE_TTL_S": "3",
                 **{f"MERIDIAN_CONTROLLER_ETCD__{k.upper()}": v
                    for k, v in self.etcd_files("meridian-controller").items()}},
        )  # fmt: skip
        self.controllers[name] = self.ready(p)

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=10)
            if p.proc.poll() is None:
                p.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(timeout=5)
            if p.proc.stdout is not None:
                p.proc.stdout.close()
            p.log.close()


async def _traffic(fleet: Fleet, stop: asyncio.Event) -> None:
    """Clients at a steady rate per geography (``RATES``, open loop: a request every 1/rate s
    whatever the answers take), spread over the regions DNS last gave them by their SRV
    weights (a smooth weighted round robin, as many clients do together).  A client whose
    connection is refused tries the next answer, as SRV clients do."""
    headers = {"Authorization": f"Bearer {DEMO_KEY}"}  # the tenant's API key
    credit: dict[str, dict[str, float]] = {geo: {} for geo in RATES}
    inflight: set[asyncio.Task[None]] = set()

    def order(geo: str) -> list[str]:
        answers = {r: w for r, w in fleet.answers[geo].items() if w > 0}
        if not answers:
            return []
        total, c = sum(answers.values()), credit[geo]
        for region, weight in answers.items():
            c[region] = c.get(region, 0.0) + weight
        first = max(answers, key=lambda r: c[r])
        c[first] -= total
        return [first, *sorted((r for r in answers if r != first), key=lambda r: -answers[r])]

    async with aiohttp.ClientSession(headers=headers) as session:

        async def one(geo: str) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"hello from the {geo} clients"}],
                "max_tokens": 16,
            }
            tried = order(geo)
            for i, region in enumerate(tried):
                agent = fleet.agents.get(region)
                if agent is None:
                    continue
                try:
                    async with session.post(f"{agent.url}/v1/chat/completions", json=body) as r:
                        await r.read()
                        key = fleet.ok if r.status == 200 else fleet.failed
                        what = str(r.status)
                except aiohttp.ClientConnectorError:  # refused: the next answer
                    if i + 1 < len(tried):
                        fleet.moved_on += 1
                    continue
                except aiohttp.ClientError as exc:
                    key, what = fleet.failed, type(exc).__name__
                key[region] = key.get(region, 0) + 1
                if key is fleet.failed:
                    fleet.errors[f"{region} {what}"] = fleet.errors.get(f"{region} {what}", 0) + 1
                return
            fleet.failed[geo] = fleet.failed.get(geo, 0) + 1
            fleet.errors[f"{geo} no answer"] = fleet.errors.get(f"{geo} no answer", 0) + 1

        due = {geo: 0.0 for geo in RATES}
        last = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            for geo, rate in RATES.items():
                due[geo] += rate * (now - last)
                while due[geo] >= 1:
                    due[geo] -= 1
                    task = asyncio.create_task(one(geo))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
            last = now
            await asyncio.sleep(0.05)
        if inflight:
            await asyncio.wait(inflight)


def _secret() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


async def _dig(fleet: Fleet, source: str) -> tuple[str, dict[str, float] | None]:
    """What ``dig -b <source> api.meridian.example`` (A and SRV) is told, on one line, and the
    SRV answer's first-priority targets by region with their weights (``None``: no answer)."""
    assert fleet.dns is not None
    by_address = {a: r for r, a in ADDRESSES.items()}
    parts = []
    weights: dict[str, float] | None = None
    for name, rdtype in ((API_NAME, "A"), (SRV_NAME, "SRV")):
        query = dns.message.make_query(name, rdtype)
        try:
            r = await dns.asyncquery.udp(
                query, fleet.dns.server, port=fleet.dns.port, source=source, timeout=1
            )
        except (OSError, dns.exception.DNSException) as exc:
            return f"no answer ({type(exc).__name__})", None
        values = sorted(v.to_text() for rrset in r.answer for v in rrset)
        if rdtype == "A":
            parts.append("A " + (", ".join(f"{v} ({by_address.get(v, '?')})" for v in values)
                                 or "-"))  # fmt: skip
        else:
            srv = sorted(v.split() for v in values)
            parts.append("SRV " + (", ".join(f"{t.split('.')[0]} {p} {w}" for p, w, _, t in srv)
                                   or "-"))  # fmt: skip
            if srv:
                first = min(int(p) for p, _, _, _ in srv)
                weights = {t.split(".")[0]: float(w) for p, w, _, t in srv if int(p) == first}
    return "   ".join(parts), weights


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    headers = {"Authorization": f"Bearer {VIEWER_TOKEN}"}  # the admin API's reads: a viewer
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=3)) as r:
        return await r.json()


async def _show(
    fleet: Fleet, session: aiohttp.ClientSession, seen: set[str], t0: float
) -> dict[str, Any]:
    """One window as the controller's read port shows it (the admin API's reads)."""
    live = [c for c in fleet.controllers.values() if c.proc.poll() is None]
    if not live:
        return {}
    base = live[0].url
    listing = await _get(session, f"{base}/v1/regions")
    rows = {row["region"]: row for row in listing["regions"]}
    leader = (await _get(session, f"{base}/v1/health"))["leader"]
    events = (await _get(session, f"{base}/v1/events"))["events"]
    print(f"[{time.monotonic() - t0:5.1f}s] window {listing.get('window', 0):>3}  leader {leader}")
    for region in REGIONS:
        r = rows.get(region) or {}
        print(
            f"   {region:9} {r.get('state') or '-':>10}  strikes {r.get('strikes', 0)}  "
            f"weight {(r.get('weight') or 0) * 100:5.1f} %  "
            f"capacity {r.get('capacity') or 0:4.1f}  "
            f"floor {r.get('floor') or 0:4.1f}  served {fleet.ok.get(region, 0):>4}"
        )
    answers = "  ".join(
        f"{geo}: " + ", ".join(f"{r} {w * 100:.0f}%" for r, w in sorted(shares.items()))
        for geo, shares in sorted(listing.get("serving", {}).items())
    )
    alert = listing.get("alert")
    print(f"   DNS answers  {answers}" + (f"   ALERT {alert}" if alert else ""))
    dns_current = True  # whether every view already answers what the plan says
    if fleet.dns is not None:  # the clients follow what DNS tells them
        for _, geo, source in DNS_VIEWS:
            text, weights = await _dig(fleet, source)
            print(f"   dig -b {source} {API_NAME:22} ({geo})  {text}")
            if weights:
                fleet.answers[geo] = weights
            dns_current &= _answers_plan(weights, listing.get("serving", {}).get(geo))
    else:  # no BIND9: the plan's shares, which DNS would have said
        for geo, shares in listing.get("serving", {}).items():
            if geo in fleet.answers and shares:
                fleet.answers[geo] = {r: float(w) for r, w in shares.items()}
    await _show_autoscaler(fleet, session, "eu-north")
    for event in events:
        key = json.dumps(event, sort_keys=True)
        if key not in seen:
            seen.add(key)
            if event["kind"] in ("state", "failover", "floor", "recovery", "alert", "residency"):
                print(
                    f"   event {event['kind']:9} {event.get('region') or '-':9} {event['reason']}"
                )
    return {"regions": rows, "leader": leader, "dns_current": dns_current}


def _answers_plan(weights: dict[str, float] | None, shares: dict[str, float] | None) -> bool:
    """Whether an SRV answer's weights are the plan's shares (to the percent the zone holds):
    the controller writes its plan first and applies it to BIND9 after, so a window can read
    the new plan while DNS still answers the one before."""
    planned = {r: float(w) for r, w in (shares or {}).items() if float(w) > 0}
    answered = weights or {}
    total = sum(answered.values())
    if not planned:
        return True  # nothing planned for this view
    return (
        bool(total)
        and set(answered) == set(planned)
        and all(abs(answered[r] / total - w) <= 0.01 for r, w in planned.items())
    )


def _ramped_back(state: dict[str, Any], region: str) -> bool:
    """The region is healthy at full weight and DNS already answers so."""
    row = state.get("regions", {}).get(region) or {}
    full = row.get("state") == "healthy" and row.get("weight") == 1.0
    return full and bool(state.get("dns_current"))


async def _show_autoscaler(fleet: Fleet, session: aiohttp.ClientSession, region: str) -> None:
    """One line of the region's ``GET /admin/autoscaler`` (the agent's admin API)."""
    agent = fleet.agents.get(region)
    if agent is None or agent.proc.poll() is not None:
        return
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        async with session.get(
            f"{agent.url}/admin/autoscaler", headers=headers, timeout=aiohttp.ClientTimeout(total=3)
        ) as r:
            a = await r.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"   {region} autoscaler: no answer ({type(exc).__name__})")
        return
    signals = a.get("signals") or {}
    rate = signals.get("arrival_rps")
    forecast = (a.get("forecast_rps") or {}).get("ahead")
    change = a.get("last_change") or {}
    print(
        f"   {region} autoscaler  floor {a['floor']:g} (controller)  target "
        f"{a['target'] if a['target'] is not None else 0:g} nodes  serving "
        f"{signals.get('serving', 0)} + {signals.get('pending', 0)} on the way  arrivals "
        + ("-" if rate is None else f"{rate:4.1f}")
        + " req/s  forecast "
        + ("-" if forecast is None else f"{forecast:4.1f}")
        + (
            f"   last {change['kind']} {change['age_s']:.0f} s ago: {change['reason']}"
            if change
            else ""
        )
    )


async def _security(fleet: Fleet, session: aiohttp.ClientSession) -> None:
    """What each credential may do: eu-west's etcd certificate on another region's key, a
    plaintext etcd client, a data-plane request without a key and with one."""
    import meridian_etcd  # the demo's one direct etcd client
    from meridian_wire import keys

    tries = [
        ("eu-west's agent certificate writes us-east's status", "agent-eu-west",
         keys.agent_status("us-east", "forged")),
        ("eu-west's agent certificate writes the controller's plan", "agent-eu-west", keys.PLAN),
        ("eu-west's agent certificate takes the leader key", "agent-eu-west", keys.LEADER),
        ("eu-west's agent certificate writes its own status", "agent-eu-west",
         keys.agent_status("eu-west", "demo-probe")),
    ]  # fmt: skip
    for what, cn, key in tries:
        store = meridian_etcd.Store(
            meridian_etcd.ClientConfig(
                endpoints=[fleet.etcd_url],
                ca_file=fleet.etcd_files(cn)["ca_file"],
                cert_file=fleet.etcd_files(cn)["cert_file"],
                key_file=fleet.etcd_files(cn)["key_file"],
            )
        )
        try:
            await store.put(key, b"{}")
            await store.delete(key)
            print(f"   {what}: allowed")
        except meridian_etcd.EtcdError as exc:
            print(f"   {what}: refused ({exc.message.rsplit(': ', 1)[-1]})")
        finally:
            await store.close()
    agent = fleet.agents["eu-west"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tries_http = [
        ("without a key", {}),
        ("with a wrong key", {"Authorization": "Bearer not-a-key"}),
        ("with the tenant's key", {"Authorization": f"Bearer {DEMO_KEY}"}),
    ]
    for label, headers in tries_http:
        async with session.post(
            f"{agent.url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            print(f"   POST {agent.url}/v1/chat/completions {label}: {r.status}")


async def _ctl(fleet: Fleet, token: str, *args: str) -> int:
    """Run ``meridianctl ARGS`` against a live replica's admin API, print it, return its code."""
    live = [c for c in fleet.controllers.values() if c.proc.poll() is None and c.admin_url]
    if not live:
        print("   (no controller serves the admin API)")
        return -1
    who = {OPERATOR_TOKEN: "operator", VIEWER_TOKEN: "viewer"}.get(token, "?")
    print(f"\n   [{who}] $ meridianctl {' '.join(_quote(a) for a in args)}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meridianctl", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "MERIDIAN_URL": live[0].admin_url, "MERIDIAN_TOKEN": token},
    )  # fmt: skip
    out, _ = await proc.communicate()
    for line in out.decode(errors="replace").rstrip().splitlines():
        print(f"     {line}")
    code = proc.returncode if proc.returncode is not None else -1
    print(f"     (exit {code})")
    return code


def _pages(fleet: Fleet) -> None:
    """Where the fleet page is, and which token to paste there."""
    pages = [f"{c.admin_url}/ui/ ({name})" for name, c in fleet.controllers.items() if c.admin_url]
    if not pages:
        return
    print(f"  fleet page: {', '.join(pages)}")
    print(
        f"    paste the operator token {OPERATOR_TOKEN} (the actions) or the viewer token "
        f"{VIEWER_TOKEN} (watch only); step 3 kills the leading replica, whose page then says "
        "it has no answer: the other's goes on"
    )


async def _until_interrupted() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _quote(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg


async def _run(fleet: Fleet, *, keep_open: bool = False) -> int:
    w = fleet.window_s
    stop = asyncio.Event()
    traffic = asyncio.create_task(_traffic(fleet, stop))
    seen: set[str] = set()
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:

        async def windows(n: int) -> dict[str, Any]:
            state: dict[str, Any] = {}
            for _ in range(n):
                await asyncio.sleep(w)
                state = await _show(fleet, session, seen, t0)
            return state

        print("\n== 0. every channel secured: etcd's roles, API keys on the data plane\n")
        await _security(fleet, session)
        print("\n== 1. steady state: eu-north pre-warms to half of eu-west's capacity\n")
        await windows(5)
        print("\n== 2. eu-west's agent dies (SIGKILL)\n")
        fleet.agents["eu-west"].stop(signal.SIGKILL)
        state: dict[str, Any] = {}
        for _ in range(12):
            state = await windows(1)
            row = state.get("regions", {}).get("eu-west") or {}
            if row.get("state") == "failed":
                break
        print("\n== 3. the leading controller dies (SIGKILL); eu-north follows eu's whole load\n")
        leader = state.get("leader")
        if leader in fleet.controllers:
            fleet.controllers[leader].stop(signal.SIGKILL)
        await windows(4)
        print("\n== 4. eu-west's agent comes back: two good windows, then the ramp\n")
        await asyncio.to_thread(fleet.start_agent, "eu-west")  # the clients go on meanwhile
        for _ in range(15):
            state = await windows(1)
            if _ramped_back(state, "eu-west"):
                break
        print("\n== 5. an operator takes over with meridianctl (the admin API, tokens, audit)\n")
        await _ctl(fleet, VIEWER_TOKEN, "status")
        why = "demo: planned network work in eu-west"
        await _ctl(fleet, OPERATOR_TOKEN, "failover", "--from", "eu-west", "--reason", why,
                   "--dry-run")  # fmt: skip
        await windows(1)
        await _ctl(fleet, OPERATOR_TOKEN, "failover", "--from", "eu-west", "--reason", why,
                   "--yes")  # fmt: skip
        await windows(3)
        await _ctl(
            fleet, VIEWER_TOKEN, "failback", "eu-west", "--reason", "a viewer tries", "--yes"
        )
        await _ctl(fleet, OPERATOR_TOKEN, "failback", "eu-west", "--reason", "demo: work done",
                   "--yes")  # fmt: skip
        for _ in range(15):
            state = await windows(1)
            if _ramped_back(state, "eu-west"):
                break
        await _ctl(fleet, OPERATOR_TOKEN, "audit", "--limit", "3")
    if keep_open:
        print("\n== the fleet keeps running (--keep-open) until Ctrl-C\n")
        _pages(fleet)
        await _until_interrupted()
    stop.set()
    await traffic
    print(
        f"\nDone. Requests served: {sum(fleet.ok.values())}, failed: {sum(fleet.failed.values())} "
        + "".join(f" [{what}: {n}]" for what, n in sorted(fleet.errors.items()))
        + f" ({fleet.moved_on} refused by a dead agent went to the next DNS answer). "
        "While eu-west's agent was dead, DNS sent eu clients (dig -b 127.0.0.2) to eu-north, "
        "which scaled from its floor to its load; on recovery eu-west's SRV weight ramped back "
        "and eu-north stepped back down towards its floor; an operator's manual failover did "
        "the same, audited, and its failback ramped back again."
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window-s", type=float, default=2.0, help="health window (seconds)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    parser.add_argument(
        "--keep-open",
        action="store_true",
        help="after the script, keep the fleet running for the fleet page until Ctrl-C",
    )
    args = parser.parse_args(argv)
    if args.window_s < 1:
        parser.error("--window-s must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="meridian-demo-"))
    fleet = Fleet(work=work, window_s=args.window_s)
    try:
        print(
            f"Starting etcd, 3 regions (7 simulated H100 nodes, 3 agents) and 2 controllers; "
            f"windows of {args.window_s:g} s"
        )
        fleet.start_etcd()
        print(f"  etcd: {fleet.etcd_url} (TLS, client certificates); bootstrap:")
        for line in fleet.bootstrap_etcd():
            print(f"    {line}")
        fleet.write_keys()
        fleet.start_bind()
        if fleet.dns is not None:
            print(f"  BIND9: 127.0.0.1:{fleet.dns.port}, views eu (127.0.0.2) and default (us)")
        for region in REGIONS:
            fleet.start_region(region)
            print(f"  {region}: agent {fleet.agents[region].url}")
        for name in ("ctl-a", "ctl-b"):
            fleet.start_controller(name)
            print(f"  controller {name}: {fleet.controllers[name].url}")
        _pages(fleet)
        return asyncio.run(_run(fleet, keep_open=args.keep_open))
    finally:
        fleet.stop_all()
        if args.keep_logs:
            print(f"Logs of every process: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
