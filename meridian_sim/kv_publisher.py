"""The simulated node's KV-cache events, published as vLLM publishes them.

``meridian-sim node --kv-events-config JSON`` takes vLLM's own flag value::

    {"enable_kv_cache_events": true, "publisher": "zmq",
     "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
     "buffer_steps": 10000, "hwm": 100000, "topic": ""}

and serves the same sockets with the same messages (``meridian_wire.kv_events``): after every
engine step that changed the cache, one ``EventBatch`` on the PUB socket as
``[topic, seq, payload]``; on the ROUTER socket, a request ``[b"", start]`` is answered with
every buffered ``[b"", topic, seq, payload]`` from ``start`` on and ``[b"", b"", END_SEQ, b""]``,
as vLLM 0.32 does.  Block hashes are the engine's own chained hashes (``int``, as vLLM sends
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), blocks on the ``GPU`` medium.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from meridian_sim.engine import CacheCleared, CacheEvent, CacheStored
from meridian_wire import kv_events
from meridian_wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class KvEventsConfig:
    """vLLM's ``--kv-events-config``, the fields the simulator serves."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig | None:
        """The flag's JSON; None when it does not enable events.  ValueError says what is
        wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {"enable_kv_cache_events", "publisher", *cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        if not raw.get("enable_kv_cache_events", False):
            return None
        publisher = raw.get("publisher", "zmq")
        if publisher != "zmq":
            raise ValueError(f"--kv-events-config: publisher {publisher!r}; only 'zmq' is served")
        fields: dict[str, Any] = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        for name in ("buffer_steps", "hwm"):
            value = fields.get(name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        for name in ("endpoint", "replay_endpoint", "topic"):
            value = fields.get(name, "")
            if value is not None and not isinstance(value, str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        return cls(**fields)


def to_wire(events: Sequence[CacheEvent], *, block_size: int) -> list[kv_events.Event]:
    """The engine's cache events as vLLM's."""
    out: list[kv_events.Event] = []
    for e in events:
        if isinstance(e, CacheStored):
            out.append(
                BlockStored(
                    block_hashes=list(e.block_hashes),
                    parent_block_hash=e.parent_block_hash,
                    token_ids=list(e.token_ids),
                    block_size=block_size,
                    lora_id=None,
                    medium=kv_events.MEDIUM_GPU,
                    lora_name=None,
                )
            )
        elif isinstance(e, CacheCleared):
            out.append(AllBlocksCleared())
        else:
            out.append(BlockRemoved(block_hashes=list(e.block_hashes), medium=kv_events.MEDIUM_GPU))
    return out


def _ipv6(endpoint: str) -> bool:
    """An endpoint on an IPv6 address (ZeroMQ binds those only with its IPV6 option, which
    would also name an IPv4 endpoint ``tcp://[::ffff:127.0.0.1]:...``)."""
    return endpoint.startswith("tcp://[") or "::" in endpoint


class Publisher:
    """The PUB socket, the replay ROUTER and the buffer of the last ``buffer_steps`` batches."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.asyncio.Context()
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.linger = 0
            self._pub.ipv6 = _ipv6(config.endpoint)  # so tcp://[::1]:... binds
            self._pub.sndhwm = config.hwm
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.linger = 0
                self._replay.ipv6 = _ipv6(config.replay_endpoint)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._topic = config.topic.encode("utf-8")
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._seq = 0
        self.published = 0

    async def publish(self, events: list[kv_events.Event]) -> None:
        """One batch, stamped now, numbered next."""
        payload = kv_events.encode_batch(
            EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        )
        seq = self._seq
        self._seq += 1
        await self._pub.send_multipart([self._topic, kv_events.encode_seq(seq), payload])
        self._buffer.append((seq, payload))
        self.published += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        replay = self._replay
        if replay is None:
            return
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: invalid replay request of %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart(
                        [client, b"", self._topic, kv_events.encode_seq(seq), payload]
                    )
            await replay.send_multipart([client, b"", b"", kv_events.END_SEQ, b""])

    def close(self) -> None:
        self._ctx.destroy(linger=0)
