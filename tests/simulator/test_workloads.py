"""Trace readers, the prompt mapping, the synthetic generator and rate scaling."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from meridian_sim import profile, workloads
from policies import prompt

WORKLOADS = Path(__file__).resolve().parents[2] / "data" / "workloads"
MOONCAKE = WORKLOADS / "mooncake_conversation_trace.jsonl"
AZURE = WORKLOADS / "azure_conv_2023.csv"


def test_mooncake_slice_reads_with_seconds_and_whole_blocks() -> None:
    rows = workloads.read_mooncake(MOONCAKE, limit=200)
    assert len(rows) == 200
    assert rows[0].timestamp_s == 0.0
    assert all(a.timestamp_s <= b.timestamp_s for a, b in itertools.pairwise(rows))
    for r in rows:
        assert len(r.hash_ids) == -(-r.input_length // 512)
        assert r.block_tokens == 512
        assert r.hash_ids[0] == 0  # every request of this trace starts with block 0


def test_memoised_hashes_equal_the_agents_hashing_on_real_requests() -> None:
    rows = workloads.read_mooncake(MOONCAKE, limit=30)
    for block_size in (16, 128, 48):  # 48 does not divide 512: hashed from scratch
        hasher = workloads.BlockHasher(block_size=block_size)
        for r in rows[:10]:
            tokens = workloads.prompt_of(r)
            assert hasher.hashes(r) == prompt.block_hashes(tokens, block_size=block_size)


def test_equal_ids_share_engine_blocks_and_different_ids_do_not() -> None:
    rows = workloads.read_mooncake(MOONCAKE, limit=2000)
    hasher = workloads.BlockHasher(block_size=16)
    by_first: dict[int, workloads.TraceRequest] = {}
    pair = None
    for r in rows:
        if len(r.hash_ids) > 2 and r.hash_ids[1] in by_first:
            pair = (by_first[r.hash_ids[1]], r)
            break
        if len(r.hash_ids) > 2:
            by_first[r.hash_ids[1]] = r
    assert pair is not None, "the trace has multi-turn conversations"
    a, b = pair
    shared = 0
    while (
        shared < min(len(a.hash_ids), len(b.hash_ids))
        and a.hash_ids[shared] == (b.hash_ids[shared])
    ):
        shared += 1
    ha, hb = hasher.hashes(a), hasher.hashes(b)
    full = min(shared * 32, len(ha), len(hb))
    assert ha[:full] == hb[:full]
    if shared < len(a.hash_ids) and shared < len(b.hash_ids) and len(ha) > full:
        assert ha[full] != hb[full]


def test_azure_slice_reads_relative_times_and_fresh_ids() -> None:
    rows = workloads.read_azure(AZURE, limit=300)
    assert rows[0].timestamp_s == 0.0
    assert rows[-1].timestamp_s > 0
    assert all(a.timestamp_s <= b.timestamp_s for a, b in itertools.pairwise(rows))
    assert rows[0].input_length == 374 and rows[0].output_length == 44
    ids = [h for r in rows for h in r.hash_ids]
    assert len(ids) == len(set(ids)), "no prefix is shared in an Azure trace"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "line_2_placeholder: not valid JSON"),
        ('{"timestamp": 5, "output_length": 5, "hash_ids": [0]}', "field 'input_length'"),
        (
            '{"timestamp": 5, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1]}',
            "field 'hash_ids' has 2 blocks",
        ),
        (
            '{"timestamp": "x", "input_length": 10, "output_length": 5, "hash_ids": [0]}',
            "field 'timestamp' must be a number",
        ),
        (
            '{"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [0]}',
            "field 'output_length' must be >= 1",
        ),
        (
            '{"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [-1]}',
            "field 'hash_ids' must be a list of non-negative integers",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_mooncake_names_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    path = _write(tmp_path, "t.jsonl", GOOD + line + "\n")
    with pytest.raises(workloads.WorkloadError) as err:
        workloads.read_mooncake(path)
    message = str(err.value)
    assert f"{path}:2" in message
    assert needle.replace("line_2_placeholder: ", "") in message


def test_mooncake_time_going_back_and_empty_file(tmp_path: Path) -> None:
    back = GOOD.replace('"timestamp": 0', '"timestamp": 9')
    path = _write(tmp_path, "t.jsonl", back + GOOD)
    with pytest.raises(workloads.WorkloadError, match=r"t\.jsonl:2: field 'timestamp' goes back"):
        workloads.read_mooncake(path)
    with pytest.raises(workloads.WorkloadError, match="no requests"):
        workloads.read_mooncake(_write(tmp_path, "e.jsonl", "\n"))
    with pytest.raises(workloads.WorkloadError, match="cannot read trace"):
        workloads.read_mooncake(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("2023-11-16 18:15:50.99,x,10\n", "t.csv:3: field 'ContextTokens' must be an integer"),
        ("yesterday,10,10\n", "t.csv:3: field 'TIMESTAMP' must look like"),
        ("2023-11-16 18:15:50.99,10\n", "t.csv:3: expected 3 fields, got 2"),
        ("2023-11-16 18:15:40.00,10,10\n", "t.csv:3: field 'TIMESTAMP' goes back in time"),
        ("2023-11-16 18:15:50.99,10,0\n", "t.csv:3: field 'GeneratedTokens' must be >= 1"),
    ],
)
def test_malformed_azure_names_line_and_field(tmp_path: Path, body: str, needle: str) -> None:
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    path = _write(tmp_path, "t.csv", head + body)
    with pytest.raises(workloads.WorkloadError) as err:
        workloads.read_azure(path)
    assert needle in str(err.value)


def test_azure_header_is_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.csv", "time,in,out\n")
    with pytest.raises(workloads.WorkloadError, match=r"t\.csv:1: expected the header"):
        workloads.read_azure(path)
    with pytest.raises(workloads.WorkloadError, match="unknown trace format"):
        workloads.read_trace(tmp_path / "t.txt")


def test_synthetic_is_seeded_zipf_popular_and_grows_by_turn() -> None:
    def make(seed: int) -> list[workloads.TraceRequest]:
        return workloads.synthetic(
            duration_s=300, sessions_per_s=2.0, rng=random.Random(seed), num_system_prompts=8
        )

    a, b = make(1), make(1)
    assert a == b
    assert make(2) != a
    assert all(x.timestamp_s <= y.timestamp_s for x, y in itertools.pairwise(a))
    # system prompt popularity: rank 1 is the most used
    first_turns: dict[str, workloads.TraceRequest] = {}
    for r in a:
        assert r.session is not None
        first_turns.setdefault(r.session, r)
    counts: dict[int, int] = {}
    for r in first_turns.values():
        counts[r.hash_ids[0]] = counts.get(r.hash_ids[0], 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 2 * ranked[-1]
    # multi-turn growth: each turn's prompt extends the previous turn's
    turns: dict[str, list[workloads.TraceRequest]] = {}
    for r in a:
        assert r.session is not None
        turns.setdefault(r.session, []).append(r)
    multi = [t for t in turns.values() if len(t) > 1]
    assert multi
    for t in multi:
        for prev, nxt in itertools.pairwise(t):
            assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
            assert nxt.input_length > prev.input_length
            assert nxt.timestamp_s >= prev.timestamp_s


def test_scale_to_rate_hits_the_target_rate() -> None:
    rows = workloads.synthetic(duration_s=200, sessions_per_s=1.0, rng=random.Random(3))
    scaled = workloads.scale_to_rate(rows, rate_per_s=40.0)
    assert workloads.mean_rate_per_s(scaled) == pytest.approx(40.0)
    assert [r.hash_ids for r in scaled] == [r.hash_ids for r in rows]
    with pytest.raises(ValueError, match="positive"):
        workloads.scale_to_rate(rows, rate_per_s=0)


def test_node_capacity_falls_with_longer_prompts() -> None:
    prof = profile.load("h100-llama3-8b")

    def trace(input_length: int) -> list[workloads.TraceRequest]:
        return [
            workloads.TraceRequest(
                timestamp_s=float(i),
                input_length=input_length,
                output_length=64,
                hash_ids=tuple(range(i * 100, i * 100 + -(-input_length // 512))),
            )
            for i in range(60)
        ]

    short = workloads.node_capacity_rps(prof, trace(256), sample=60, warmup=8)
    long = workloads.node_capacity_rps(prof, trace(4096), sample=60, warmup=8)
    assert short > long > 0
