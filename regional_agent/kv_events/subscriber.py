"""Subscribes to every node's KV-cache events (vLLM's ZeroMQ publisher, or meridian-sim's) and
feeds the precise prefix index (:class:`policies.kv_index.PreciseIndex`).

One :class:`Subscription` per node with an events endpoint (``kv_events.endpoint``, a template
on the node's host, or the node's own ``kv_events_endpoint``); :class:`KvEvents` starts and
stops them as nodes join and leave the pool.  Every agent replica and every worker subscribes
itself, so all of them hold the same index without writing anything anywhere.

A subscription's life::

    connect SUB ──► handshake (socket monitor) ──► resync ──► in sync (node is precise)
        ▲               │ not within retry_interval_s: warn (once an interval)       │
        │               ▼                                                              │
        └──────── disconnected: node approximate ◄── gap, restart, replay timeout ◄────┘

*Resync* asks the replay endpoint for the batches from the last one applied on: if the first
one it returns is that very batch (same sequence number, same bytes), the stream is continuous
and the rest is applied.  Otherwise the engine restarted or the gap is older than its buffer, so
the node's entries are cleared and the whole buffer is applied (blocks whose parents are older
than the buffer stay unkeyed until stored again).  Without a replay endpoint a gap, a reconnect
or a restart clears the node and the stream is taken from the next batch.

A sequence number past the next one is a gap (the PUB socket dropped batches: its high-water
mark, or a slow agent) and triggers a resync; one at or below the last is a duplicate of a
replayed batch and is skipped.  A restarted engine always reconnects, and every (re)connect
resyncs, so a restart is never mistaken for duplicates.  The replay itself may lose batches (a
ROUTER drops what a full pipe cannot take): replayed sequence numbers must be consecutive too,
and at a hole the resync applies what came before it and asks again from there.

Bad input never stops a subscription: a frame or payload that is not a KV-event batch is counted
(``malformed``) and skipped; a block of another size than ``routing.prefix_block_tokens`` is
refused (``refused``) with a warning once an interval naming the setting to change.  Blocks on
another medium than the GPU (vLLM's CPU offload), of another kind than full attention, of a
LoRA adapter, or with extra keys (a cache salt, multimodal inputs) are counted (``ignored``)
and skipped: the agent's keys are base-model token ids on the GPU.  Token ids that are not
token ids are ``malformed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from meridian_service.clock import Clock
from meridian_wire import kv_events
from meridian_wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from policies.kv_index import BlockSizeMismatch, PreciseIndex
from policies.model import NodeId
from regional_agent.nodes import Node, NodePool
from regional_agent.settings import KvEventsSettings

log = logging.getLogger(__name__)

EVENT_KINDS: Final = ("stored", "removed", "cleared", "ignored")
ERROR_KINDS: Final = ("malformed", "refused", "unkeyed", "gap", "resync_cleared", "replay_timeout")
_MONITOR: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_FULL_ATTENTION: Final = frozenset({"full_attention", "mla_attention"})
_DRAIN: Final = 4096  # messages read in one turn of the loop before the monitor is looked at
_YIELD_EVERY: Final = 256  # batches applied between two yields to the event loop
_REPLAY_ROUNDS: Final = 8  # replays that lost batches before a resync gives up for an interval


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where one node publishes: its PUB socket and (optionally) its replay ROUTER."""

    events: str
    replay: str | None


class Subscription:
    """One node's event stream, kept in sync with the index."""

    def __init__(
        self,
        node_id: NodeId,
        endpoints: Endpoints,
        *,
        index: PreciseIndex,
        context: zmq.asyncio.Context,
        settings: KvEventsSettings,
        clock: Clock,
        counts: Counter[tuple[str, str]],
    ) -> None:
        self.node_id = node_id
        self.endpoints = endpoints
        self._index = index
        self._ctx = context
        self._settings = settings
        self._clock = clock
        self._counts = counts
        self.connected = False
        # the last batch applied; -1: none yet, and the engine's next is its first (0)
        self.last_seq: int | None = None
        self._synced = False  # False: messages wait for a resync (they are in its replay)
        self._last_payload: bytes | None = None
        self._warned_s: dict[str, float] = {}

    @property
    def precise(self) -> bool:
        return self._index.is_precise(self.node_id)

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: keep the node's stream in sync; never raises for bad input."""
        cfg = self._settings
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.linger = 0
            sub.ipv6 = True  # a node on an IPv6 address; IPv4 still connects
            sub.rcvhwm = cfg.receive_hwm
            sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode("utf-8"))
            monitor = sub.get_monitor_socket(_MONITOR)
        except BaseException:
            sub.close(linger=0)
            raise
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        interval_ms = int(cfg.retry_interval_s * 1000)
        resync_due: float | None = None
        try:
            sub.connect(self.endpoints.events)
            since = self._clock.now()
            while True:
                ready = dict(await poller.poll(timeout=interval_ms))
                now = self._clock.now()
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # a ZeroMQ peer
                        self.connected = True
                        log.info(
                            "kv events connected node=%s endpoint=%s",
                            self.node_id,
                            self.endpoints.events,
                        )
                        resync_due = now
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        self.connected = False
                        self._synced = False
                        since = now
                        self._index.set_precise(self.node_id, False)
                        log.warning(
                            "kv events disconnected node=%s endpoint=%s: the node is routed "
                            "by the approximate index until it is back",
                            self.node_id,
                            self.endpoints.events,
                        )
                if sub in ready:
                    for drained in range(_DRAIN):  # what is queued, in bounded turns
                        try:
                            frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self._on_message(frames) and resync_due is None:
                            resync_due = now
                        if drained % _YIELD_EVERY == _YIELD_EVERY - 1:
                            await asyncio.sleep(0)  # let requests be served meanwhile
                if not self.connected and now - since >= cfg.retry_interval_s:
                    self._warn_once(
                        "unreachable",
                        "kv events endpoint does not answer node=%s endpoint=%s for %.0f s: "
                        "the node is routed by the approximate index",
                        self.node_id,
                        self.endpoints.events,
                        now - since,
                    )
                if resync_due is not None and self.connected and now >= resync_due:
                    if await self._resync():
                        resync_due = None
                    else:
                        resync_due = self._clock.now() + cfg.retry_interval_s
        finally:
            self._index.set_precise(self.node_id, False)
            self.connected = False
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    # -- messages --------------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> bool:
        """Apply one published batch; True when the stream needs a resync (a gap)."""
        if len(frames) != 3:
            self._error("malformed", f"a published message has 3 frames, got {len(frames)}")
            return False
        try:
            seq = kv_events.decode_seq(frames[1])
        except kv_events.KvEventError as exc:
            self._error("malformed", str(exc))
            return False
        if not self._synced:
            return False  # a resync is due: its replay brings this batch
        last = self.last_seq
        if last is not None and seq <= last:
            return False  # a batch the resync's replay already applied
        if last is not None and seq > last + 1:
            self._counts[(self.node_id, "gap")] += 1
            if self.endpoints.replay is not None:
                self._synced = False
                self._index.set_precise(self.node_id, False)
                return True
            self._counts[(self.node_id, "resync_cleared")] += 1
            self._index.clear(self.node_id)
        self._apply(seq, frames[2])
        return False

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._last_payload = payload
        try:
            batch = kv_events.decode_batch(payload)
        except kv_events.KvEventError as exc:
            self._error("malformed", str(exc))
            return
        for event in batch.events:
            try:
                self._apply_event(event)
            except BlockSizeMismatch as exc:
                self._error("refused", str(exc))
            except (ValueError, OverflowError) as exc:  # token ids that are not token ids
                self._error("malformed", str(exc))

    def _apply_event(self, event: kv_events.Event) -> None:
        node = self.node_id
        counts = self._counts
        if isinstance(event, BlockStored):
            if not _ours(event.medium, event.group_idx, event.kv_cache_spec_kind) or (
                event.lora_id is not None
                or event.lora_name is not None
                or (event.extra_keys is not None and any(k is not None for k in event.extra_keys))
            ):
                counts[(node, "ignored")] += 1  # keys the agent's hash of token ids lacks
                return
            keyed = self._index.stored(
                node,
                parent=event.parent_block_hash,
                hashes=event.block_hashes,
                token_ids=event.token_ids,
                block_size=event.block_size,
            )
            counts[(node, "stored")] += 1
            if keyed < len(event.block_hashes):
                counts[(node, "unkeyed")] += len(event.block_hashes) - keyed
        elif isinstance(event, BlockRemoved):
            if not _ours(event.medium, event.group_idx, None):
                counts[(node, "ignored")] += 1
                return
            self._index.removed(node, event.block_hashes)
            counts[(node, "removed")] += 1
        elif isinstance(event, AllBlocksCleared):
            self._index.clear(node)
            counts[(node, "cleared")] += 1

    # -- resync ----------------------------------------------------------------------------

    async def _resync(self) -> bool:
        """Bring the index up to the engine's state (module docstring); False when the replay
        endpoint did not answer in time or its answers keep missing batches (the node stays
        approximate; retried)."""
        node = self.node_id
        if self.endpoints.replay is None:
            if self.last_seq is not None or self._index.blocks(node):
                self._counts[(node, "resync_cleared")] += 1
            self._index.clear(node)
            self.last_seq = None
            self._synced = True
            self._index.set_precise(node, True)
            return True
        for _ in range(_REPLAY_ROUNDS):
            last = self.last_seq
            start = last if last is not None and last >= 0 else 0
            items, complete = await self._replay(start)
            if last is not None and last >= 0 and items[:1] == [(last, self._last_payload)]:
                items = items[1:]  # continuous: the buffer resumes at the batch applied last
            elif last is not None and last < 0 and (not items or items[0][0] == 0):
                pass  # nothing applied yet, and the engine's first batch is where it starts
            elif not items and not complete:
                return False  # no answer at all
            else:  # the engine restarted, or the gap is older than its buffer
                if last is not None or self._index.blocks(node):
                    self._counts[(node, "resync_cleared")] += 1
                    log.info(
                        "kv events resync node=%s: the engine restarted or the gap is older "
                        "than its replay buffer; its blocks are cleared and the buffer applied",
                        node,
                    )
                self._index.clear(node)
                self.last_seq = last = None
                if start > 0 and not (items and items[0][0] > start):
                    items, complete = await self._replay(0)  # a restarted engine's whole buffer
            hole = False
            for n, (seq, payload) in enumerate(items):
                if self.last_seq is not None and self.last_seq >= 0 and seq != self.last_seq + 1:
                    hole = True  # the replay lost batches (ROUTER drops past its high-water mark)
                    break
                self._apply(seq, payload)
                if n % _YIELD_EVERY == _YIELD_EVERY - 1:
                    await asyncio.sleep(0)
            if self.last_seq is None:
                self.last_seq = -1  # an empty buffer: the engine's next batch is its first
            if complete and not hole:
                self._synced = True
                self._index.set_precise(node, True)
                return True
            self._counts[(node, "gap")] += 1  # ask again from the last batch applied
        return False

    async def _replay(self, start: int) -> tuple[list[tuple[int, bytes]], bool]:
        """The buffered batches from ``start`` on, and whether the end marker came (False: the
        replay endpoint stopped answering for ``replay_timeout_s``, a warning says so)."""
        assert self.endpoints.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        timeout_ms = int(self._settings.replay_timeout_s * 1000)
        items: list[tuple[int, bytes]] = []
        try:
            dealer.linger = 0
            dealer.ipv6 = True
            dealer.rcvhwm = 0  # no limit: the replay comes at once, and a full pipe drops
            dealer.connect(self.endpoints.replay)
            await dealer.send_multipart([b"", kv_events.encode_seq(start)])
            while True:
                if not await dealer.poll(timeout=timeout_ms):
                    self._counts[(self.node_id, "replay_timeout")] += 1
                    self._warn_once(
                        "replay",
                        "kv events replay endpoint does not answer node=%s endpoint=%s within "
                        "%.1f s: the node is routed by the approximate index until it does",
                        self.node_id,
                        self.endpoints.replay,
                        self._settings.replay_timeout_s,
                    )
                    return items, False
                frames = await dealer.recv_multipart()
                if frames[:1] == [b""]:
                    frames = frames[1:]
                try:
                    seq, payload = kv_events.replay_frames(frames)
                except kv_events.KvEventError as exc:
                    self._error("malformed", f"replay: {exc}")
                    continue
                if seq < 0:
                    return items, True
                items.append((seq, payload))
        finally:
            dealer.close(linger=0)

    # -- reporting -------------------------------------------------------------------------

    def _error(self, kind: str, message: str) -> None:
        self._counts[(self.node_id, kind)] += 1
        self._warn_once(kind, "kv events %s node=%s: %s", kind, self.node_id, message)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        now = self._clock.now()
        last = self._warned_s.get(key)
        if last is not None and now - last < self._settings.retry_interval_s:
            return
        self._warned_s[key] = now
        log.warning(message, *args)


def _ours(medium: str | None, group_idx: int | None, kind: str | None) -> bool:
    """A block the agent's hashes describe: on the GPU, of full attention (the first group
    when the engine does not say which kind)."""
    if medium not in (None, kv_events.MEDIUM_GPU):
        return False
    if kind is not None:
        return kind in _FULL_ATTENTION
    return group_idx in (None, 0)


class KvEvents:
    """Starts a :class:`Subscription` for each node with an events endpoint and stops it when
    the node leaves the pool (its blocks are forgotten)."""

    def __init__(
        self,
        settings: KvEventsSettings,
        *,
        pool: NodePool,
        index: PreciseIndex,
        clock: Clock,
        per_node: Mapping[NodeId, Endpoints] | None = None,
    ) -> None:
        self.settings = settings
        self.index = index
        self._pool = pool
        self._clock = clock
        self._per_node = dict(per_node or {})
        self._context: zmq.asyncio.Context | None = None
        self.subscriptions: dict[NodeId, tuple[Subscription, asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, not yet finished
        self.counts: Counter[tuple[str, str]] = Counter()

    def endpoints(self, node: Node) -> Endpoints | None:
        """Where ``node`` publishes: its own endpoints from settings, else the templates on its
        URL's host; None when neither is configured."""
        own = self._per_node.get(node.node_id)
        if own is not None:
            return own
        template = self.settings.endpoint
        if template is None:
            return None
        host = urlsplit(node.url).hostname or ""
        if ":" in host:
            host = f"[{host}]"  # an IPv6 literal, as ZeroMQ's tcp:// wants it
        replay = self.settings.replay_endpoint
        return Endpoints(
            events=template.format(host=host),
            replay=None if replay is None else replay.format(host=host),
        )

    def reconcile(self) -> None:
        """Subscriptions for the pool's nodes now: new ones started, departed ones stopped."""
        if self._context is None:
            self._context = zmq.asyncio.Context()
        wanted: dict[NodeId, Endpoints] = {}
        for node in self._pool:
            found = self.endpoints(node)
            if found is not None:
                wanted[node.node_id] = found
        for node_id, (sub, task) in list(self.subscriptions.items()):
            if wanted.get(node_id) != sub.endpoints:
                task.cancel()
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
                del self.subscriptions[node_id]
                self.index.forget(node_id)
                for key in [k for k in self.counts if k[0] == node_id]:
                    del self.counts[key]  # its series go with it
            elif task.done():  # crashed (logged): start it again, from a clean slate
                del self.subscriptions[node_id]
                self.index.forget(node_id)
        for node_id, found in wanted.items():
            if node_id not in self.subscriptions:
                sub = Subscription(
                    node_id,
                    found,
                    index=self.index,
                    context=self._context,
                    settings=self.settings,
                    clock=self._clock,
                    counts=self.counts,
                )
                task = asyncio.create_task(sub.run(), name=f"meridian-agent-kv-events-{node_id}")
                task.add_done_callback(_log_crash)
                self.subscriptions[node_id] = (sub, task)

    async def run(self) -> None:
        """Reconcile every ``reconcile_interval_s`` until cancelled, then stop every stream."""
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(self.settings.reconcile_interval_s)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [task for _, task in self.subscriptions.values()] + list(self._stopping)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.subscriptions.clear()
        if self._context is not None:
            self._context.destroy(linger=0)  # never blocks: every socket is closed or dropped
            self._context = None

    def describe(self, node_id: NodeId) -> dict[str, object] | None:
        """``node_id``'s subscription as ``GET /admin/nodes`` shows it (None: it has none):
        endpoints, connected, in sync, the last sequence number applied, blocks held."""
        found = self.subscriptions.get(node_id)
        if found is None:
            return None
        sub = found[0]
        return {
            "endpoint": sub.endpoints.events,
            "replay_endpoint": sub.endpoints.replay,
            "connected": sub.connected,
            "in_sync": sub.precise,
            "last_seq": sub.last_seq,
            "blocks": self.index.blocks(node_id),
        }


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("kv events subscription crashed: %r", task.exception(), exc_info=task.exception())
