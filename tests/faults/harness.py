"""The fault matrix's parts: real processes to break, traffic that counts what it lost, a TCP
proxy the test controls for partitions, and the report of measured detect and recover times.

Everything runs on loopback.  Faults are real: ``kill -9`` of a process, a member of an etcd
cluster stopped, a proxy that stops forwarding, faults injected into a simulated node through
its own ``/admin/faults``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.ports import free_port
from tests.support.process import ServerProcess

MODEL = "tiny-model"  # the cpu-tiny profile's model
ROOT = Path(__file__).resolve().parents[2]


# -- the report ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Row:
    """One fault: how long until it was noticed and until service was whole again, against the
    bound the settings promise; and what the clients saw meanwhile."""

    case: str
    fault: str
    detect_s: float | None
    detect_bound_s: float | None
    recover_s: float | None
    recover_bound_s: float | None
    requests: int = 0
    lost: int = 0  # failed before their first byte reached the client: must be 0
    broken: int = 0  # ended with an error event after streaming began (allowed)
    note: str = ""


@dataclass(slots=True)
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        for name, value, bound in (
            ("detect", row.detect_s, row.detect_bound_s),
            ("recover", row.recover_s, row.recover_bound_s),
        ):
            if value is not None and bound is not None:
                assert value <= bound, f"{row.case}: {name} took {value:.2f} s, bound {bound:.2f} s"
        assert row.lost == 0, f"{row.case}: {row.lost} of {row.requests} requests lost"
        self.rows.append(row)
        return row

    def write(self, path: Path) -> None:
        """The rows as JSON at ``path`` and as a markdown table beside it (``.md``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(r) for r in self.rows], indent=2) + "\n")
        path.with_suffix(".md").write_text(self.markdown())

    def markdown(self) -> str:
        def cell(value: float | None, bound: float | None) -> str:
            if value is None:
                return "—"
            return f"{value:.2f} s" + (f" (≤ {bound:.1f})" if bound is not None else "")

        lines = [
            "| fault | injected | detected | recovered | requests | lost | broken | notes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            requests = str(r.requests) if r.requests else "—"
            lines.append(
                f"| {r.case} | {r.fault} | {cell(r.detect_s, r.detect_bound_s)} | "
                f"{cell(r.recover_s, r.recover_bound_s)} | {requests} | {r.lost} | {r.broken} | "
                f"{r.note} |"
            )
        return "\n".join(lines) + "\n"


# -- traffic ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What the clients saw.  ``lost``: a request that failed before any byte of its answer
    arrived (a non-2xx status or a connection error) — the agent must retry those elsewhere.
    ``broken``: a stream that began and then ended with an error event (the node died under it;
    no retry can undo bytes already sent)."""

    ok: int = 0
    lost: int = 0
    broken: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    first_ok_after: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.ok + self.lost + self.broken


class Traffic:
    """``concurrency`` clients streaming chat completions to ``url`` until stopped; a session
    id per client, so prefix- and session-aware policies see repeat customers."""

    def __init__(self, url: str, *, concurrency: int = 4, max_tokens: int = 8) -> None:
        self.url = url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.tally = Tally()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Traffic:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._session.close()

    async def requests(self, n: int, *, timeout_s: float = 60.0) -> None:
        """Wait until ``n`` more requests have ended."""
        target = self.tally.total + n
        end = time.monotonic() + timeout_s
        while self.tally.total < target:
            assert time.monotonic() < end, f"traffic stalled at {self.tally.total} of {target}"
            await asyncio.sleep(0.02)

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {
                "model": MODEL,
                "stream": True,
                "max_tokens": self.max_tokens,
                "messages": [
                    {"role": "system", "content": "You are a careful assistant. " * 8},
                    {"role": "user", "content": f"client {i} turn {n}"},
                ],
            }
            await self._one(body, session=f"client-{i}")

    async def _one(self, body: dict[str, Any], *, session: str) -> None:
        t = self.tally
        started = False
        try:
            async with self._session.post(
                f"{self.url}/v1/chat/completions", json=body, headers={"X-Session-ID": session}
            ) as r:
                t.statuses[str(r.status)] = t.statuses.get(str(r.status), 0) + 1
                if r.status != 200:
                    t.lost += 1
                    await r.read()
                    return
                error = False
                async for line in r.content:
                    started = True
                    if line.startswith(b"data: {") and b'"error"' in line:
                        error = True
                if error:
                    t.broken += 1
                else:
                    t.ok += 1
        except (aiohttp.ClientError, TimeoutError):
            if started:
                t.broken += 1
            else:
                t.statuses["connection"] = t.statuses.get("connection", 0) + 1
                t.lost += 1


# -- processes ----------------------------------------------------------------------------------


@dataclass(slots=True)
class NodeProc:
    """A ``meridian-sim node`` process on a fixed port, so it can come back where it was."""

    port: int
    log_dir: Path
    profile: str = "cpu-tiny"
    time_scale: float = 10.0
    seed: int = 0
    process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NodeProc:
        argv = [
            sys.executable, "-m", "meridian_sim.cli", "node", "--host", "127.0.0.1",
            "--port", str(self.port), "--profile", self.profile,
            "--time-scale", f"{self.time_scale:g}", "--seed", str(self.seed),
            "--log-level", "WARNING",
        ]  # fmt: skip
        log = self.log_dir / f"node-{self.port}-{time.monotonic_ns()}.log"
        self.process = ServerProcess(argv, log_path=log)
        wait_http(f"{self.url}/health", what=f"node {self.url}", process=self.process)
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def fast_agent_toml(
    *,
    region: str,
    geo: str,
    residency: Sequence[str],
    endpoint: str,
    etcd: Sequence[str],
    nodes: Sequence[str],
    lease_ttl_s: int = 2,
    window_s: float = 1.0,
    probe_timeout_s: float = 0.5,
    workers: int = 1,
) -> str:
    """An agent's settings for a test fleet, with the short leases, windows, retries, probes
    and scrapes that make a region's failure visible within seconds (the fault matrix, the
    browser and Prometheus suites); its replica id is ``<region>-a1``: one process unless
    ``workers`` says more (each worker a replica, ``<region>-a1-w<i>``)."""
    listed = "".join(f'[[nodes]]\nurl = "{url}"\n\n' for url in nodes)
    return f"""{listed}
[region]
id = "{region}"
geo = "{geo}"
residency = {json.dumps(list(residency))}
endpoints = ["{endpoint}"]
etcd = {json.dumps(list(etcd))}
agent_id = "{region}-a1"
lease_ttl_s = {lease_ttl_s}
window_s = {window_s}
min_interval_s = 0.2
load_min_interval_s = 0.5
retry_base_s = 0.1
retry_max_s = 0.5
etcd_timeout_s = 1.0

[health]
probe_interval_s = 0.2
probe_timeout_s = {probe_timeout_s}

[telemetry]
scrape_interval_s = 0.2

[workers]
count = {workers}
"""


def start_nodes(n: int, log_dir: Path, *, seed: int = 0, **kw: Any) -> list[NodeProc]:
    return [
        NodeProc(port=free_port(), log_dir=log_dir, seed=seed + i, **kw).start() for i in range(n)
    ]


def wait_http(
    url: str,
    *,
    what: str,
    process: ServerProcess,
    timeout_s: float = 30.0,
    context: ssl.SSLContext | None = None,
) -> None:
    """Poll ``url`` until it answers 200 (stdlib: works outside an event loop); an ``https``
    URL is checked against ``context``."""
    import urllib.error
    import urllib.request

    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if process.exit_code() is not None:
            raise process.failure(f"{what} exited")
        with contextlib.suppress(OSError, urllib.error.URLError), opener.open(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise process.failure(f"{what} did not answer {url} within {timeout_s:g} s")


@dataclass(slots=True)
class AgentProc:
    """A ``meridian-agent`` process (kill -9 for real), configured by a TOML file.  With
    ``tls`` (a client context that trusts its certificate) the agent is expected to serve HTTPS
    (``server.tls_cert_file`` in ``config``) and is waited for over HTTPS."""

    port: int
    log_dir: Path
    config: str
    env: dict[str, str] = field(default_factory=dict)
    process: ServerProcess | None = None
    tls: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> AgentProc:
        path = self.log_dir / f"agent-{self.port}.toml"
        path.write_text(self.config)
        argv = [sys.executable, "-m", "regional_agent.cli", "--config", str(path),
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "INFO"]  # fmt: skip
        log = self.log_dir / f"agent-{self.port}-{time.monotonic_ns()}.log"
        env = {**os.environ, **self.env}
        self.process = ServerProcess(argv, log_path=log, env=env)
        wait_http(
            f"{self.url}/health", what=f"agent {self.url}", process=self.process, context=self.tls
        )
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


# -- a TCP proxy the test controls --------------------------------------------------------------


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``.  ``partition()`` cuts every connection and
    blackholes new ones (accepted, never forwarded: what a dead link looks like, not a refusal);
    ``heal()`` forwards again.  ``blackhole_for(marker)`` blackholes only the new connections
    whose first bytes hold ``marker`` (one client's view of a dead link: an HTTP client's
    ``User-Agent``, say); ``blackhole_for(None)`` ends that.  ``close()`` ends every connection
    it accepted or dialled, and lets their sockets close, before the test's event loop goes."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.partitioned = False
        self.marker: bytes | None = None
        self._closed = False
        self._pairs: set[asyncio.Task[None]] = set()  # forwarding; cancelled by partition()
        self._handlers: set[asyncio.Task[None]] = set()  # every accepted connection's handler
        self._held: list[asyncio.StreamWriter] = []  # blackholed: accepted, never answered
        self._open: set[asyncio.StreamWriter] = set()  # every writer not yet aborted
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for w in list(self._open):
            _abort(w, self._open)
        self._held.clear()
        if self._server is not None:
            await self._server.wait_closed()
        for _ in range(3):
            await asyncio.sleep(0)  # the transports' connection_lost (which closes the socket)

    def partition(self) -> None:
        self.partitioned = True
        for task in list(self._pairs):
            task.cancel()

    def blackhole_for(self, marker: bytes | None) -> None:
        self.marker = marker
        for task in list(self._pairs):
            task.cancel()  # clients reconnect, and the new connections are sorted

    def heal(self) -> None:
        self.partitioned = False
        for w in self._held:
            _abort(w, self._open)  # blackholed connections end; clients reconnect
        self._held.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        if self._closed:
            _abort(writer, self._open)
            return
        if self.partitioned:
            self._held.append(writer)  # never answered; heal() or close() ends it
            return
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            first = b""
            if self.marker is not None:
                first = await reader.read(65536)
                if self.marker in first:
                    self._held.append(writer)  # never answered; heal() or close() ends it
                    self._handlers.discard(task)
                    return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._open.add(up_writer)
            if self.partitioned or self._closed:
                return
            self._pairs.add(task)
            up_writer.write(first)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (asyncio.CancelledError, OSError):
            pass  # cut by partition() or close(), or reset by either end
        finally:
            self._pairs.discard(task)
            self._handlers.discard(task)
            if writer not in self._held:
                _abort(writer, self._open)
            if up_writer is not None:
                _abort(up_writer, self._open)


def _abort(writer: asyncio.StreamWriter, open_: set[asyncio.StreamWriter]) -> None:
    writer.transport.abort()
    open_.discard(writer)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


# -- timing -------------------------------------------------------------------------------------


async def seconds_until(
    predicate: Callable[[], bool] | Callable[[], Awaitable[bool]],
    *,
    timeout_s: float,
    what: str,
    poll_s: float = 0.05,
) -> float:
    """How long until ``predicate`` holds (measured, monotonic); fails after ``timeout_s``."""
    start = time.monotonic()
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(poll_s)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def iter_rows(report: Report) -> Iterator[Row]:
    yield from report.rows
