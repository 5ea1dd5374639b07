"""vLLM's KV-cache events on the wire: the messages an engine publishes when its prefix cache
stores or drops blocks, in the format vLLM's ``vllm/distributed/kv_events.py`` defines.

The types below follow vLLM's (Apache-2.0, copyright the vLLM project contributors; field names,
order and tags as there), so that the agent decodes what a real engine sends and the simulator
sends what a real engine does.  An engine started with::

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

publishes on a ZeroMQ PUB socket one multipart message per engine step that changed its cache::

    [topic, seq (8 bytes, big-endian), msgpack(EventBatch)]

and answers on a ROUTER socket a request ``[b"", start seq (8 bytes, big-endian)]`` with every
buffered batch from ``start`` on, then an end marker (the frames below).

Three encodings exist, and :func:`decode_batch` reads each: vLLM releases before late 2025 encode
the batch and its events ``array_like`` (a batch is ``[ts, [event, ...]]`` and an event
``["BlockStored", hashes, parent, ...]``); the release pinned by ``scripts/real_vllm.sh`` (0.32)
keeps the batch an array but encodes events as maps tagged by ``"type"``
(``[ts, [{"type": "BlockStored", "block_hashes": ...}]]``); vLLM's main branch encodes both as
maps.  :func:`encode_batch` writes what the pinned release writes.  Fields a newer vLLM adds are
ignored; fields it drops default.  Replay replies are ``[b"", topic, seq, payload]`` in the
pinned release and ``[b"", seq, payload]`` before it (:func:`replay_frames` reads both).

A block hash (vLLM's ``ExternalBlockHash``) is ``bytes`` or ``int`` depending on the release and
its settings; readers treat it as an opaque key.
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias

import msgspec

BlockHash: TypeAlias = bytes | int
"""One engine block hash, opaque (vLLM's ``ExternalBlockHash``)."""

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last frame: no more buffered batches."""

MEDIUM_GPU: Final = "GPU"


class KvEventError(ValueError):
    """A message that is not a vLLM KV-event batch; the text says what was wrong."""


# -- the map form (current vLLM) -----------------------------------------------------------------


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False, frozen=True):
    """Blocks the engine now holds, in prompt order: ``token_ids`` are the tokens of every block
    in ``block_hashes`` (``block_size`` each), and ``parent_block_hash`` is the engine hash of the
    block before the first (``None``: the first block of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # (required in vLLM's types, so always encoded, as vLLM does)
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False, frozen=True):
    """Blocks the engine evicted."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False, frozen=True):
    """The engine dropped its whole prefix cache (a reset)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What one engine step changed, at ``ts`` (seconds since the epoch, the engine's clock)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False, frozen=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# -- the array-like form (vLLM before late 2025) ---------------------------------------------------


class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_PINNED: Final = msgspec.msgpack.Decoder(EventBatch)
_MAP: Final = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY: Final = msgspec.msgpack.Decoder(_ArrayBatch)
_ENCODER: Final = msgspec.msgpack.Encoder()


def _from_array(batch: _ArrayBatch) -> EventBatch:
    events: list[Event] = []
    for e in batch.events:
        if isinstance(e, _ArrayStored):
            events.append(
                BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium,
                    lora_name=e.lora_name,
                )
            )
        elif isinstance(e, _ArrayRemoved):
            events.append(BlockRemoved(block_hashes=e.block_hashes, medium=e.medium))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)


def decode_batch(payload: bytes) -> EventBatch:
    """One published (or replayed) payload, in either encoding.

    Raises :class:`KvEventError` naming what is wrong when it is not a batch of known events.
    """
    if not payload:
        raise KvEventError("empty payload (expected a msgpack EventBatch)")
    first = payload[0]
    try:
        if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # a msgpack map: vLLM's main
            b = _MAP.decode(payload)
            return EventBatch(ts=b.ts, events=b.events, data_parallel_rank=b.data_parallel_rank)
        if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # an array: a release
            try:
                return _PINNED.decode(payload)
            except msgspec.ValidationError as pinned:
                try:
                    return _from_array(_ARRAY.decode(payload))
                except msgspec.DecodeError:
                    raise KvEventError(f"not a KV-event batch: {pinned}") from pinned
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise KvEventError(f"not a KV-event batch: {exc}") from exc
    except RecursionError as exc:  # msgspec's answer to arrays nested thousands deep
        raise KvEventError("not a KV-event batch: nested too deep") from exc
    raise KvEventError(
        "not a KV-event batch: a msgpack batch starts with a map or an array, "
        f"got byte 0x{first:02x}"
    )


def encode_batch(batch: EventBatch) -> bytes:
    """``batch`` as the pinned vLLM release encodes it (an array of ``ts`` and tagged maps)."""
    return _ENCODER.encode(batch)


def encode_seq(seq: int) -> bytes:
    """A sequence number as the PUB and replay sockets carry it."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number in a frame (``-1`` for :data:`END_SEQ`); :class:`KvEventError` if the
    frame is not 8 bytes."""
    if len(frame) != 8:
        raise KvEventError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def replay_frames(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one replay reply, the DEALER's empty delimiter already stripped:
    ``[topic, seq, payload]`` (the pinned release) or ``[seq, payload]`` (before it).  The end
    marker gives ``(-1, b"")``.  :class:`KvEventError` for any other shape."""
    if len(frames) == 3:
        return decode_seq(frames[1]), frames[2]
    if len(frames) == 2:
        return decode_seq(frames[0]), frames[1]
    raise KvEventError(f"a replay reply has 2 or 3 frames after the delimiter, got {len(frames)}")
