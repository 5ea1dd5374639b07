"""A real BIND9 authoritative server on loopback, with two views of one test zone.

    with start_bind(tmp_dir) as bind: ...

named runs in the foreground (`named -g`) from a config generated in `tmp_dir`: no rndc
control channel, nothing written under /var or /etc/bind, IPv4 only, listening on
127.0.0.1 at a free port. (named binds only addresses configured on an interface, and lo
carries just 127.0.0.1; the rest of 127.0.0.0/8 is still routed to lo, so clients can use
127.0.0.2 as a source address, which is all the views need.) Each view holds its own copy
of `meridian.test.` (SOA, NS and the NS's A record) with its journal in `tmp_dir`.

Views, first match wins (the order of `BindServer.views`):

    view "geo-a"    match-clients { !key meridian-default; key meridian-geo-a; 127.0.0.2; };
    view "default"  match-clients { any; };

How a client targets a view:

- Updates (RFC 2136) and zone transfers: sign with the view's own TSIG key
  (`view.key.tsig_key()`) and send from any address to `bind.host:bind.port`. BIND picks
  the view by the key before the source address, so one controller on one address can
  write every view; this is the standard way to update zones in views, and how a real
  deployment with geo views (which match client subnets, not the controller) works.
  Each zone's `update-policy` grants only its own view's key, so a key writes one view.
- Queries: send to `bind.host:bind.port` from the view's client address,
  `source=view.source`; answers then come from that view's zone.

Each run gets fresh random hmac-sha256 secrets. An unsigned update is REFUSED; an update
signed with a known key name but the wrong secret is answered NOTAUTH with TSIG error BADSIG.

On a host where AppArmor confines /usr/sbin/named to /etc/bind and /var/cache/bind (Debian
and Ubuntu with AppArmor enabled), a private copy of the binary is run instead; AppArmor
attaches profiles by path, so the copy may read its config in `tmp_dir`.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype
import dns.tsig

from tests.support.ports import free_port
from tests.support.process import ServerProcess, find_binary, serve

HOST = "127.0.0.1"
ZONE = "meridian.test."
ALGORITHM = "hmac-sha256"
START_TIMEOUT_S = 30.0
_APPARMOR_ENABLED = Path("/sys/module/apparmor/parameters/enabled")


@dataclass(frozen=True, slots=True, kw_only=True)
class TsigKey:
    """A TSIG key as named.conf knows it; `secret` is base64."""

    name: str
    secret: str
    algorithm: str = ALGORITHM

    def tsig_key(self) -> dns.tsig.Key:
        """The key for dnspython: `UpdateMessage(zone, keyring=key.tsig_key())`."""
        return dns.tsig.Key(self.name, self.secret, self.algorithm)

    def keyring(self) -> dict[dns.name.Name, dns.tsig.Key]:
        key = self.tsig_key()
        return {key.name: key}


@dataclass(frozen=True, slots=True, kw_only=True)
class DnsView:
    """One view: queries from `source` see it; messages signed with `key` go to it."""

    name: str
    source: str
    key: TsigKey


@dataclass(frozen=True, slots=True, kw_only=True)
class BindServer:
    """A running test named. Send to `host:port`; pick a view as the module docstring says."""

    host: str
    port: int
    zone: str
    views: tuple[DnsView, ...]
    work_dir: Path
    process: ServerProcess

    @property
    def algorithm(self) -> str:
        return ALGORITHM

    def view(self, name: str) -> DnsView:
        for view in self.views:
            if view.name == name:
                return view
        raise KeyError(f"no view {name!r}; views are {[v.name for v in self.views]}")

    def keyring(self) -> dict[dns.name.Name, dns.tsig.Key]:
        """Every view's key, for code that picks a key by name."""
        return {k: v for view in self.views for k, v in view.key.keyring().items()}


def make_views() -> tuple[DnsView, ...]:
    """The test views with fresh random secrets, in match order."""

    def key(name: str) -> TsigKey:
        return TsigKey(name=name, secret=base64.b64encode(secrets.token_bytes(32)).decode())

    return (
        DnsView(name="geo-a", source="127.0.0.2", key=key("meridian-geo-a")),
        DnsView(name="default", source="127.0.0.1", key=key("meridian-default")),
    )


@contextmanager
def start_bind(tmp_dir: Path) -> Iterator[BindServer]:
    """Start named in a new directory under `tmp_dir`, wait until every view serves the
    zone, stop it on exit. Config, zones, journals and named.log stay in that directory."""
    binary = find_binary("named")

    def launch() -> BindServer:
        return _launch(binary, Path(tempfile.mkdtemp(prefix="bind-", dir=tmp_dir)))

    with serve(launch, _wait_ready) as server:
        yield server


@contextmanager
def start_bind_with(
    tmp_dir: Path,
    *,
    body: Callable[[Path], str],
    zone_files: Mapping[str, str],
    views: tuple[DnsView, ...],
) -> Iterator[BindServer]:
    """Start named with the test options and a named.conf body of the caller's (keys, views,
    zones — for example what an operator's config generator renders): ``body(work_dir)``
    returns it; ``zone_files`` maps file names under ``work_dir/zones`` to their text (use
    ``zone_file()``). ``views`` are the views the body defines, to wait for, in match order."""
    binary = find_binary("named")

    def launch() -> BindServer:
        work_dir = Path(tempfile.mkdtemp(prefix="bind-", dir=tmp_dir))
        return _launch(binary, work_dir, views=views, body=body(work_dir), zone_files=zone_files)

    with serve(launch, _wait_ready) as server:
        yield server


def relaunch_bind(server: BindServer) -> BindServer:
    """Start a stopped (or killed) named again: same config, port, zones and journals; wait
    until it serves every view. The caller stops the returned server.

    A journal that named was writing when it was killed can be torn (empty, or cut inside a
    transaction), and named then refuses that zone: it is moved aside first, as docs/dns.md
    ("If named crashed") tells an operator to do, so the zone comes back as of its last dump and
    the controller writes the rest back."""
    set_aside_torn_journals(server.work_dir)
    process = ServerProcess(server.process.argv, log_path=server.work_dir / "named-again.log")
    again = dataclasses.replace(server, process=process)
    try:
        _wait_ready(again)
    except BaseException:
        process.stop()
        raise
    return again


def set_aside_torn_journals(work_dir: Path) -> list[Path]:
    """Rename every zone journal under ``work_dir/zones`` that ``named-journalprint`` cannot
    read to ``<name>.torn``; return the journals set aside."""
    torn = []
    for journal in sorted((work_dir / "zones").glob("*.jnl")):
        result = subprocess.run(
            [find_binary("named-journalprint"), str(journal)], capture_output=True, check=False
        )
        if result.returncode != 0:
            journal.rename(journal.with_name(journal.name + ".torn"))
            torn.append(journal)
    return torn


def check_conf(path: Path) -> str:
    """Run ``named-checkconf`` on ``path``; return its output, raise ValueError if it fails."""
    result = subprocess.run(
        [find_binary("named-checkconf"), str(path)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ValueError(f"named-checkconf {path}: {result.stdout}{result.stderr}")
    return result.stdout + result.stderr


def _launch(
    binary: str,
    work_dir: Path,
    *,
    views: tuple[DnsView, ...] | None = None,
    body: str | None = None,
    zone_files: Mapping[str, str] | None = None,
) -> BindServer:
    (work_dir / "zones").mkdir()
    views = views or make_views()
    port = free_port()
    conf = work_dir / "named.conf"
    if body is None:
        conf.write_text(_named_conf(work_dir=work_dir, port=port, views=views))
        zone_files = {f"{view.name}.db": zone_file() for view in views}
    else:
        conf.write_text(_options(work_dir=work_dir, port=port) + body)
    for file_name, text in (zone_files or {}).items():
        (work_dir / "zones" / file_name).write_text(text)
    if _apparmor_enabled():
        binary = str(shutil.copy2(binary, work_dir / "named"))
    argv = [binary, "-g", "-4", "-n", "1", "-c", str(conf)]
    process = ServerProcess(argv, log_path=work_dir / "named.log")
    return BindServer(
        host=HOST, port=port, zone=ZONE, views=views, work_dir=work_dir, process=process
    )


def _named_conf(*, work_dir: Path, port: int, views: tuple[DnsView, ...]) -> str:
    keys = "".join(
        f'key "{v.key.name}" {{ algorithm {v.key.algorithm}; secret "{v.key.secret}"; }};\n'
        for v in views
    )
    blocks = []
    for i, view in enumerate(views):
        if i == len(views) - 1:
            match = "any;"
        else:
            # Messages signed by another view's key go on to that view, whatever their source.
            others = " ".join(f'!key "{v.key.name}";' for v in views if v is not view)
            match = f'{others} key "{view.key.name}"; {view.source};'
        blocks.append(
            f'view "{view.name}" {{\n'
            f"    match-clients {{ {match} }};\n"
            f'    zone "{ZONE}" {{\n'
            f"        type primary;\n"
            f'        file "{work_dir}/zones/{view.name}.db";\n'
            f'        update-policy {{ grant "{view.key.name}" zonesub ANY; }};\n'
            f'        allow-transfer {{ key "{view.key.name}"; }};\n'
            f"    }};\n"
            f"}};\n"
        )
    return _options(work_dir=work_dir, port=port) + f"{keys}" + "".join(blocks)


def _options(*, work_dir: Path, port: int) -> str:
    return (
        "// Generated for one test run by tests/support/bind.py.\n"
        "options {\n"
        f'    directory "{work_dir}";\n'
        f'    pid-file "{work_dir}/named.pid";\n'
        f'    session-keyfile "{work_dir}/session.key";\n'
        f'    managed-keys-directory "{work_dir}";\n'
        f'    dump-file "{work_dir}/cache_dump.db";\n'
        f'    statistics-file "{work_dir}/named.stats";\n'
        f'    memstatistics-file "{work_dir}/named.memstats";\n'
        f"    listen-on port {port} {{ {HOST}; }};\n"
        "    listen-on-v6 { none; };\n"
        "    recursion no;\n"
        "    dnssec-validation no;\n"
        "    notify no;\n"
        "};\n"
        "controls { };  // no rndc control channel\n"
    )


def zone_file() -> str:
    """The starting text of every test zone: SOA, NS and the NS's A record."""
    return (
        "$TTL 300\n"
        f"{ZONE} IN SOA ns1.{ZONE} hostmaster.{ZONE} 1 3600 600 86400 30\n"
        f"{ZONE} IN NS ns1.{ZONE}\n"
        f"ns1.{ZONE} IN A {HOST}\n"
    )


def _apparmor_enabled() -> bool:
    try:
        return _APPARMOR_ENABLED.read_text().strip().upper().startswith("Y")
    except OSError:
        return False


def _wait_ready(server: BindServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(server.views)
    while time.monotonic() < deadline:
        if server.process.port_taken():  # named logs it and keeps running
            raise server.process.failure("named could not bind its port")
        if server.process.exit_code() is not None:
            raise server.process.failure("named exited during start")
        pending = [view for view in pending if not _serves_soa(server, view)]
        if not pending:
            return
        time.sleep(0.05)
    raise server.process.failure(
        f"named not serving {ZONE} in views {[v.name for v in pending]} "
        f"after {START_TIMEOUT_S:.0f} s"
    )


def _serves_soa(server: BindServer, view: DnsView) -> bool:
    query = dns.message.make_query(ZONE, dns.rdatatype.SOA)
    try:
        response = dns.query.udp(
            query, server.host, port=server.port, source=view.source, timeout=0.5
        )
    except (OSError, dns.exception.DNSException):
        return False
    return (
        response.rcode() == dns.rcode.NOERROR
        and bool(response.flags & dns.flags.AA)
        and bool(response.answer)
    )
