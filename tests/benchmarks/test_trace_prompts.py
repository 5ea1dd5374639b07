"""Trace rows become prompts whose block hashes share exactly what the trace's hash ids share."""

from __future__ import annotations

import json
from pathlib import Path

import _trace_prompts as tp
import pytest

from meridian_sim.workloads import TraceRequest
from policies import prompt

BLOCK = 16  # the simulated nodes' KV block size


def _hashes(
    builder: tp.PromptBuilder, req: TraceRequest, max_model_len: int = 100_000
) -> tuple[int, ...]:
    body = builder.chat_body(req, model="m", stream=True, max_model_len=max_model_len)
    return prompt.block_hashes(
        prompt.tokenize(prompt.render_chat(body["messages"])), block_size=BLOCK
    )


def _req(hash_ids: tuple[int, ...], input_tokens: int, output_tokens: int = 10) -> TraceRequest:
    return TraceRequest(
        timestamp_s=0.0, input_length=input_tokens, output_length=output_tokens, hash_ids=hash_ids
    )


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_every_word_is_one_token_and_length_is_kept() -> None:
    builder = tp.PromptBuilder()
    text = builder.text(_req((0, 1, 2), 1300))
    assert prompt.count_tokens(text) == 1300
    body = builder.chat_body(_req((0, 1, 2), 1300), model="m", stream=False, max_model_len=10_000)
    rendered = prompt.render_chat(body["messages"])
    assert prompt.count_tokens(rendered) == 1300 + tp.TEMPLATE_TOKENS


def test_equal_leading_ids_give_equal_blocks_up_to_the_first_difference() -> None:
    builder = tp.PromptBuilder()
    a = _hashes(builder, _req((0, 1, 2, 3), 2048))
    b = _hashes(builder, _req((0, 1, 7, 8), 2048))
    shared = _common(a, b)
    # 2 shared trace blocks = 1024 tokens plus the 3 template tokens before them, in 16s
    assert shared == (3 + 2 * 512) // BLOCK
    assert len(a) == len(b) == (2048 + tp.TEMPLATE_TOKENS) // BLOCK


def test_a_later_turn_extends_its_conversation_and_shares_nothing_with_others() -> None:
    builder = tp.PromptBuilder()
    turn1 = _hashes(builder, _req((0, 5, 6), 1400))
    turn2 = _hashes(builder, _req((0, 5, 6, 9, 10), 2400))
    other = _hashes(builder, _req((0, 11, 12), 1400))
    # the first turn's partial last block (376 tokens of id 6) is a prefix of the second's
    assert _common(turn1, turn2) == (3 + 1400) // BLOCK
    assert _common(turn1, other) == (3 + 512) // BLOCK


def test_same_ids_same_text_across_builders_and_different_seeds_differ() -> None:
    req = _req((3, 4), 1000)
    assert tp.PromptBuilder(seed=1).text(req) == tp.PromptBuilder(seed=1).text(req)
    assert tp.PromptBuilder(seed=1).text(req) != tp.PromptBuilder(seed=2).text(req)


def test_long_prompts_are_cut_to_fit_the_context_with_their_output() -> None:
    builder = tp.PromptBuilder()
    req = _req(tuple(range(20)), 10_000, output_tokens=500)
    body = builder.chat_body(req, model="m", stream=True, max_model_len=8192)
    n = prompt.count_tokens(prompt.render_chat(body["messages"]))
    assert n + 500 < 8192
    assert n == 8192 - 500 - 1
    assert body["max_tokens"] == body["min_tokens"] == 500
    assert body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_read_rows_skips_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 100, "output_length": 7, "hash_ids": [0]},
        {"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [2]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = tp.read_rows(path, skip=1, limit=1)
    assert [(r.timestamp_s, r.input_length, r.hash_ids) for r in got] == [(1.5, 100, (0,))]


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    import routing_quality

    buckets = {"t_le_1.0": 50.0, "t_le_2.0": 100.0, "t_le_+Inf": 100.0, "u_le_1.0": 3.0}
    assert routing_quality.histogram_quantile(buckets, "t", 0.5) == 1.0
    assert routing_quality.histogram_quantile(buckets, "t", 0.75) == 1.5
    assert routing_quality.histogram_quantile({"t_le_+Inf": 0.0}, "t", 0.5) != 0.0  # nan
    tail = {"t_le_1.0": 1.0, "t_le_+Inf": 2.0}
    assert routing_quality.histogram_quantile(tail, "t", 0.99) == 1.0


def test_meridian_with_workers_is_a_router_of_its_own() -> None:
    import routing_quality

    routers = routing_quality.parse_routers("meridian:meridian,meridian-w2:meridian,meridian-w4")
    assert routers == [("meridian", "meridian"), ("meridian-w2", "meridian"),
                       ("meridian-w4", "meridian")]  # fmt: skip
    assert [routing_quality._workers(n) for n, _ in routers] == [0, 2, 4]
    for bad in ("meridian-w0", "meridian-wx", "other-w2"):
        with pytest.raises(SystemExit, match="meridian-wN"):
            routing_quality.parse_routers(bad)
