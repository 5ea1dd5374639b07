"""One worker's part in a multi-worker agent (``workers.count`` above 1), wired by
``create_app``:

- its pool's views count every worker's requests (``workers.shared.LoadShare``), read at
  every decision and every ``workers.share_interval_s``, which also wakes its queue when a
  sibling freed a slot;
- its routed prompts go to the siblings' prefix indexes and theirs come into its own
  (:class:`~regional_agent.workers.siblings.PrefixRelay`: rings in shared memory, read before
  every decision and at every turn of the share loop), except the tails of prompts whose head
  the siblings were told moments ago: those it writes once to the shared table, and its policy
  asks the table for the siblings' tails of the prompt it decides
  (``LoadShare.share_tail``, ``LoadShare.deepest_tail``; ``routing.attach_sibling_tails``);
- an admin change it accepts (``POST``, ``PUT``, ``DELETE`` under ``/admin/``) is made on every
  sibling too, over their Unix sockets, before it answers;
- its ``/metrics`` is every worker's, each sample labelled ``worker``;
- its queue's depth and arrivals are posted to the table too, and its autoscaler reads every
  worker's summed (:meth:`WorkerRuntime.demand`): the worker that acts scales for all of them;
- started again after it died, it asks a sibling for the nodes and policy as they are now
  (``GET /admin/nodes``) and takes the admin changes made since the start
  (``regional_agent.admin.catch_up``).

Sibling to sibling, a request carries the supervisor's random secret (``SIBLING_SECRET``), which
the admin API takes in place of the admin token: the admin token itself is never passed on.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import fcntl
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from meridian_service.clock import Clock
from policies import routing
from policies.model import NodeId
from regional_agent.nodes import NodePool
from regional_agent.queue import Dispatcher
from regional_agent.upstream import sibling_call
from regional_agent.workers.shared import LoadShare, LoadTable
from regional_agent.workers.siblings import PrefixRelay, PrefixRings, Record

log = logging.getLogger(__name__)

RELAYED = "X-Meridian-Relayed"  # the worker that passed a request on (informational)
SIBLING_SECRET = "X-Meridian-Worker-Secret"  # the supervisor's secret (module docstring)
MISSED = "X-Meridian-Workers-Missed"  # on an admin answer: the workers that did not take it
_MUTATING = frozenset({"POST", "PUT", "DELETE"})
_SIBLING_TIMEOUT_S = 5.0
_PREFIX_TTL_S = routing.RoutingConfig().prefix_ttl_s  # the tails' when not given
IDLE_SHARE_S = 0.1
"""The share loop's pace while no request waits for a slot (``WorkerRuntime.share_loop``): what
it posts then is for the autoscaler, which reads it every few seconds."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def from_sibling(request: web.Request, secret: str | None) -> bool:
    """Whether ``request`` carries the supervisor's secret (timing-safe, any bytes given)."""
    if secret is None:
        return False
    given = request.headers.get(SIBLING_SECRET, "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode())


@dataclass(frozen=True, slots=True, kw_only=True)
class Worker:
    """Who this process is among the workers; made by the supervisor."""

    index: int
    count: int
    directory: Path  # the workers' private directory (mode 0700): their sockets, the slot lock
    table: LoadTable
    rings: PrefixRings  # the prefix records' (workers.siblings)
    secret: str  # sibling to sibling, in place of the admin token (module docstring)
    restarted: bool = False  # started again after it died: it catches up from a sibling
    ready_fd: int | None = None  # written once this worker listens

    def http_socket(self, worker: int) -> Path:
        """Where ``worker`` serves the app for its siblings."""
        return self.directory / f"w{worker}.http"

    def siblings(self) -> list[int]:
        return [w for w in range(self.count) if w != self.index]

    def announce_ready(self) -> None:
        if self.ready_fd is not None:
            os.write(self.ready_fd, bytes([self.index % 256]))


class WorkerRuntime:
    def __init__(
        self,
        worker: Worker,
        *,
        pool: NodePool,
        dispatcher: Dispatcher,
        clock: Clock,
        render_metrics: Callable[[], bytes],
        share_interval_s: float,
        prefix_ttl_s: float = _PREFIX_TTL_S,
    ) -> None:
        self.worker = worker
        self._pool = pool
        self._dispatcher = dispatcher
        self._clock = clock
        self._render = render_metrics
        self._interval_s = share_interval_s
        self.share = LoadShare(
            worker.table, worker=worker.index, lock_file=worker.directory / "slots.lock"
        )
        pool.shared = self.share
        self._ttl_s = prefix_ttl_s
        self._positions: Callable[[int], tuple[int, ...]] | None = None
        self._attached: routing.Policy | None = None  # the policy asking for the tails
        self.relay = PrefixRelay(
            worker.rings,
            worker=worker.index,
            on_records=self._records,
            clock=clock.now,
            share_tail=self._share_tail,
        )
        self._attach(dispatcher.policy)
        dispatcher.on_routed = self.relay.send
        dispatcher.before_choosing = self._before_choosing
        dispatcher.claims = self.share
        self._admin_lock = AsyncFileLock(worker.directory / "admin.lock")

    def start(self) -> None:
        """The app's Unix socket of this worker's last life goes, so that :meth:`listening`
        sees when this life's is up."""
        with contextlib.suppress(FileNotFoundError):
            self.worker.http_socket(self.worker.index).unlink()

    async def listening(self, timeout_s: float = 30.0) -> bool:
        """Wait until this worker serves its siblings (its Unix socket exists)."""
        path = self.worker.http_socket(self.worker.index)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not path.exists():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def close(self) -> None:
        """No more prefix records, written or read."""
        self._dispatcher.on_routed = None
        self._dispatcher.before_choosing = None

    async def share_loop(self) -> None:
        """Read the siblings' counts (which wakes the queue where a sibling freed a slot), and
        post this worker's demand: every ``workers.share_interval_s`` while requests wait here
        for a slot; while none waits, every :data:`IDLE_SHARE_S`, or at once when one starts
        to.  Decisions read the siblings' counts themselves (``NodePool.views``), so the fast
        pace is only for the waiting requests; at 2 ms it cost each worker 13 ms of CPU a
        second when idle (docs/benchmarks.md, "Workers")."""
        queued = asyncio.Event()
        self._dispatcher.on_queued = queued.set
        try:
            while True:
                if self._dispatcher.depth():
                    await asyncio.sleep(self._interval_s)
                else:
                    queued.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(IDLE_SHARE_S):
                            await queued.wait()
                self._pool.siblings_moved()
                self.relay.take()  # so that an idle worker does not fall a ring behind
                self.share.post_demand(*self._dispatcher.demand())
        finally:
            self._dispatcher.on_queued = None

    def demand(self) -> tuple[int, int]:
        """Every worker's waiting requests and arrivals, summed (``autoscaler.Demand``): the
        autoscaler of the worker that acts reads the load of all of them."""
        return self.share.demand(*self._dispatcher.demand())

    def _before_choosing(self) -> None:
        """Before each decision: the siblings' records taken in, and a policy switched to
        since the last (``POST /admin/policy``) asks the shared table for their tails."""
        policy = self._dispatcher.policy
        if policy is not self._attached:
            self._attach(policy)
        self.relay.take()

    def _attach(self, policy: routing.Policy) -> None:
        self._attached = policy
        self._positions = routing.prefix_positions(policy)
        routing.attach_sibling_tails(policy, self._deepest_tail)

    def _share_tail(self, node_id: str, hashes: Sequence[int], start: int) -> bool:
        """A prompt's tail from block ``start`` on, written once to the shared table at the
        policy's indexed positions; False (the ring carries it) without a prefix index."""
        positions = self._positions
        if positions is None:
            return False
        at = positions(len(hashes))
        return self.share.share_tail(node_id, hashes, at[bisect.bisect_left(at, start) :])

    def _deepest_tail(
        self, hashes: Sequence[int], positions: Sequence[int]
    ) -> tuple[NodeId, int] | None:
        found = self.share.deepest_tail(hashes, positions, self._ttl_s)
        if found is None or found[0] not in self._pool:
            return None
        return NodeId(found[0]), found[1]

    def _records(self, records: list[Record]) -> None:
        """Siblings sent prompts to these nodes, each of its hashes from its first block on
        (they said the blocks before, whole, moments ago): this worker's index learns them."""
        pool = self._pool
        tails = [(NodeId(node), first, hashes) for node, first, hashes in records if node in pool]
        if tails:
            self._dispatcher.policy.observe_relayed(tails, now=self._clock.now())

    # -- the admin API and metrics, for every worker ------------------------------------------

    def relayed(self, handler: Handler) -> Handler:
        """``handler``, an admin endpoint's, with :meth:`relay_admin` around it.  The admin
        routes are wrapped one by one rather than by a middleware, which every inference
        request would pass through too (2-3 µs of CPU a request)."""

        async def relay(request: web.Request) -> web.StreamResponse:
            return await self.relay_admin(request, handler)

        return relay

    async def relay_admin(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """An admin change this worker made is made on its siblings too (module docstring).
        Changes are made one at a time over all workers (a lock file), so two changes that
        arrive at two workers at once reach every worker in the same order."""
        if (
            request.method not in _MUTATING
            or not request.path.startswith("/admin/")
            or from_sibling(request, self.worker.secret)  # a sibling's change: not passed on
        ):
            return await handler(request)
        async with self._admin_lock:
            return await self._change(request, handler)

    async def _change(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if response.status >= 300:
            return response
        body = await request.read()
        headers = {k: request.headers[k] for k in ("Content-Type",) if k in request.headers}
        headers[RELAYED] = str(self.worker.index)
        headers[SIBLING_SECRET] = self.worker.secret
        # shielded: a client that goes away must not leave the change on some workers only
        results = await asyncio.shield(
            asyncio.gather(
                *(
                    self._call(w, request.method, request.path_qs, headers, body)
                    for w in self.worker.siblings()
                )
            )
        )
        missed = [
            f"{w}:{why}" for w, why in zip(self.worker.siblings(), results, strict=True) if why
        ]
        if missed:
            log.warning(
                "admin change not made on every worker method=%s path=%s missed=%s",
                request.method,
                request.path,
                "; ".join(missed),
            )
            response.headers[MISSED] = ", ".join(m.split(":", 1)[0] for m in missed)
        return response

    async def _call(
        self, worker: int, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> str:
        """Pass an admin change to ``worker``; '' when it took it, else why not."""
        try:
            status, reply = await sibling_call(
                str(self.worker.http_socket(worker)),
                method,
                path,
                headers=headers,
                body=body,
                timeout_s=_SIBLING_TIMEOUT_S,
            )
        except OSError as exc:
            return str(exc) or type(exc).__name__
        if status >= 300:
            return f"answered {status}: {reply[:200].decode('utf-8', 'replace')}"
        return ""

    async def catch_up(self, apply: Callable[[dict[str, Any]], Awaitable[list[str]]]) -> None:
        """A restarted worker: take the nodes and policy from the first sibling that answers,
        once this worker listens for its siblings (a change made from then on is passed to it;
        one made before is in the answer)."""
        if not await self.listening():
            log.warning("restarted worker: its Unix socket never came up; not catching up")
            return
        headers = {RELAYED: str(self.worker.index), SIBLING_SECRET: self.worker.secret}
        for worker in self.worker.siblings():
            try:
                status, body = await sibling_call(
                    str(self.worker.http_socket(worker)),
                    "GET",
                    "/admin/nodes",
                    headers=headers,
                    timeout_s=_SIBLING_TIMEOUT_S,
                )
            except OSError as exc:
                log.info("worker %d cannot say the admin state: %s", worker, exc)
                continue
            if status != 200:
                log.info("worker %d cannot say the admin state: it answered %d", worker, status)
                continue
            try:
                state = json.loads(body)
            except ValueError as exc:
                log.info("worker %d said the admin state in bad JSON: %s", worker, exc)
                continue
            done = await apply(state)
            log.warning(
                "restarted worker caught up from worker %d: %s",
                worker,
                "; ".join(done) or "nothing had changed since the start",
            )
            return
        log.warning(
            "restarted worker found no sibling to catch up from: it serves the settings' nodes "
            "and policy, without the admin changes made since the start"
        )

    async def metrics(self, request: web.Request) -> bytes:
        """This worker's metrics and its siblings', each sample labelled with its worker; a
        sibling that does not answer is left out (``meridian_agent_workers_scraped`` says how
        many did)."""
        if from_sibling(request, self.worker.secret):
            return self._render()
        texts: dict[int, str] = {self.worker.index: self._render().decode("utf-8")}
        replies = await asyncio.gather(
            *(
                sibling_call(
                    str(self.worker.http_socket(w)),
                    "GET",
                    "/metrics",
                    headers={RELAYED: str(self.worker.index), SIBLING_SECRET: self.worker.secret},
                    timeout_s=_SIBLING_TIMEOUT_S,
                )
                for w in self.worker.siblings()
            ),
            return_exceptions=True,
        )
        for w, reply in zip(self.worker.siblings(), replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("metrics of worker %d left out: %s", w, reply)
            elif reply[0] == 200:
                texts[w] = reply[1].decode("utf-8")
        return merge_metrics(texts, workers=self.worker.count, exits=self.worker.table.exits())


class AsyncFileLock:
    """``flock`` on a file, taken without blocking the event loop (tried every 5 ms)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1
        self._local = asyncio.Lock()  # this worker's own changes, one at a time

    async def __aenter__(self) -> None:
        await self._local.acquire()
        try:
            if self._fd < 0:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    await asyncio.sleep(0.005)
        except BaseException:
            self._local.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._local.release()


def merge_metrics(
    texts: dict[int, str], *, workers: int, exits: list[tuple[int, int]] | None = None
) -> bytes:
    """One exposition of several workers' (``texts`` by worker index): every sample gains a
    ``worker`` label, and families of one name are merged.  ``exits``: each worker's deaths
    (killed by a signal, exited), from the shared table, so a worker down at the scrape is
    counted too."""
    families: dict[str, Metric] = {}
    for worker, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(
                s._replace(labels={**s.labels, "worker": str(worker)}) for s in family.samples
            )
    scraped = Metric(
        "meridian_agent_workers_scraped", "workers whose metrics this scrape holds", "gauge"
    )
    scraped.add_sample("meridian_agent_workers_scraped", {}, float(len(texts)))
    configured = Metric("meridian_agent_workers", "workers the agent runs", "gauge")
    configured.add_sample("meridian_agent_workers", {}, float(workers))
    died = CounterMetricFamily(
        "meridian_agent_worker_exits",
        "times a worker died since the agent started (the supervisor starts it again): "
        "cause signal (killed: the OOM killer's SIGKILL among them) or status (it exited)",
        labels=["worker", "cause"],
    )
    for worker, (signaled, exited) in enumerate(exits or []):
        died.add_metric([str(worker), "signal"], float(signaled))
        died.add_metric([str(worker), "status"], float(exited))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), scraped, configured, died]))
    return generate_latest(registry)


class _Fixed:
    """A collector of metrics already gathered."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics
