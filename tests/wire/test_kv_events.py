"""vLLM's KV-event messages: the fixtures vLLM 0.32's own types encoded, the older and newer
encodings, and bad bytes (each refused with KvEventError, never another exception)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meridian_wire import kv_events
from meridian_wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kv_events"


def test_reads_what_vllm_0_32_encodes() -> None:
    batch = kv_events.decode_batch((FIXTURES / "vllm-0.32.0-batch.msgpack").read_bytes())
    assert batch.ts == 1764000000.25
    assert batch.data_parallel_rank == 0
    first, second, removed, cleared = batch.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [bytes([0]) * 32, bytes([1]) * 32]
    assert first.parent_block_hash is None
    assert first.token_ids == list(range(1, 33))
    assert (first.block_size, first.medium) == (16, "GPU")
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == bytes([1]) * 32
    assert (second.group_idx, second.kv_cache_spec_kind) == (0, "full_attention")
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [bytes([2]) * 32]
    assert isinstance(cleared, AllBlocksCleared)


def test_reads_int_hashes() -> None:
    batch = kv_events.decode_batch((FIXTURES / "vllm-0.32.0-int-hashes.msgpack").read_bytes())
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash) == ([7, 8], 6)


def test_what_it_encodes_is_what_vllm_0_32_encodes() -> None:
    """The simulator publishes with encode_batch: byte for byte vLLM's encoding of the same
    batch (the fixture)."""
    h = [bytes([i]) * 32 for i in range(3)]
    ours = EventBatch(
        ts=1764000000.25,
        events=[
            BlockStored(
                block_hashes=[h[0], h[1]],
                parent_block_hash=None,
                token_ids=list(range(1, 33)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockStored(
                block_hashes=[h[2]],
                parent_block_hash=h[1],
                token_ids=list(range(100, 116)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[h[2]], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    theirs = msgspec.msgpack.decode((FIXTURES / "vllm-0.32.0-batch.msgpack").read_bytes())
    assert msgspec.msgpack.decode(kv_events.encode_batch(ours)) == theirs


class _OldStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _OldCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_OldStored | _OldCleared]


def test_reads_the_older_array_like_events() -> None:
    """vLLM before late 2025 (its subscriber example's types): every struct array_like."""
    payload = msgspec.msgpack.encode(
        _OldBatch(ts=2.0, events=[_OldStored([1], None, list(range(16)), 16, None), _OldCleared()])
    )
    batch = kv_events.decode_batch(payload)
    stored, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.token_ids, stored.medium) == ([1], list(range(16)), None)
    assert isinstance(cleared, AllBlocksCleared)


def test_reads_the_newer_map_batches() -> None:
    """vLLM's main branch: the batch a map too, and fields this module does not know."""
    payload = msgspec.msgpack.encode(
        {
            "ts": 3.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"a"],
                    "parent_block_hash": None,
                    "token_ids": list(range(16)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "locality": "LOCAL",
                    "session_id": "x",
                }
            ],
        }
    )
    (stored,) = kv_events.decode_batch(payload).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [b"a"]


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"", "empty payload"),
        (b"\xc0", "starts with a map or an array"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockEaten"}]]), "not a KV-event batch"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "block_hashes"),
        (msgspec.msgpack.encode(["soon", []]), "not a KV-event batch"),
        (msgspec.msgpack.encode({"events": []}), "ts"),
        (b"\x92\xcb\x00", "not a KV-event batch"),  # truncated
    ],
)
def test_bad_payloads_say_what_is_wrong(payload: bytes, says: str) -> None:
    with pytest.raises(kv_events.KvEventError, match=says):
        kv_events.decode_batch(payload)


def test_arrays_nested_thousands_deep_are_refused_not_a_crash() -> None:
    """``extra_keys`` is ``list[Any]``: msgspec recurses into whatever is there."""
    deep = msgspec.Raw(b"\x91" * 100_000 + b"\x90")  # [[[...[]...]]]
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [0] * 16,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [deep],
    }
    with pytest.raises(kv_events.KvEventError, match="nested too deep"):
        kv_events.decode_batch(msgspec.msgpack.encode([0.0, [stored]]))


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_kv_event_error(payload: bytes) -> None:
    with contextlib.suppress(kv_events.KvEventError):
        kv_events.decode_batch(payload)


def test_sequence_numbers_and_replay_frames() -> None:
    assert kv_events.decode_seq(kv_events.encode_seq(5)) == 5
    assert kv_events.decode_seq(kv_events.END_SEQ) == -1
    with pytest.raises(kv_events.KvEventError, match="8 bytes"):
        kv_events.decode_seq(b"\x00")
    seq = kv_events.encode_seq(9)
    assert kv_events.replay_frames([b"topic", seq, b"p"]) == (9, b"p")
    assert kv_events.replay_frames([seq, b"p"]) == (9, b"p")
    assert kv_events.replay_frames([b"", kv_events.END_SEQ, b""]) == (-1, b"")
    with pytest.raises(kv_events.KvEventError, match="2 or 3 frames"):
        kv_events.replay_frames([seq])
