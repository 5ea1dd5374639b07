"""The two optional timing fields fitted to real vLLM on CPU (benchmarks/sim_fidelity.py):
a cost per decoding sequence in a step, and a per-request overhead before the engine's queue."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meridian_sim import offline, profile
from meridian_sim.engine import Engine
from tests.simulator.conftest import NodeFactory, small_profile

_CPU_TINY = Path(profile.__file__).parent / "profiles" / "cpu-tiny.toml"


def _with_overhead(text: str, value: str) -> str:
    """``text`` (a profile) with ``request_overhead_ms = value`` in its [timing] table."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("request_overhead_ms")]
    lines.insert(lines.index("[timing]") + 1, f"request_overhead_ms = {value}")
    return "\n".join(lines) + "\n"


def _timing(**fields: float) -> profile.Timing:
    return dataclasses.replace(small_profile().timing, **fields)


def test_the_optional_fields_default_to_zero_and_are_read() -> None:
    text = _CPU_TINY.read_text()
    stripped = "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(("decode_ms_per_seq", "request_overhead_ms"))
    )
    bare = profile.parse(stripped, source="test").timing
    assert bare.decode_ms_per_seq == 0.0 and bare.request_overhead_ms == 0.0
    fitted = profile.load("cpu-tiny").timing
    assert fitted.decode_ms_per_seq > 0 and fitted.request_overhead_ms > 0
    negative = _with_overhead(text, "-1.0")
    with pytest.raises(profile.ProfileError, match="'request_overhead_ms' must be >= 0"):
        profile.parse(negative, source="test")


def test_each_decoding_sequence_adds_its_cost_to_the_step() -> None:
    timing = _timing(decode_ms_per_seq=0.5)
    base = timing.step_ms(tokens_in_step=4, kv_tokens_read=40, token_pairs=0)
    assert timing.step_ms(tokens_in_step=4, kv_tokens_read=40, token_pairs=0, decode_seqs=4) == (
        base + 2.0
    )
    engine = Engine(small_profile(timing=timing), rng=random.Random(0))
    for i in range(3):
        engine.add(f"r{i}", (i, i + 1), max_tokens=4, ignore_eos=True, now=0.0)
    engine.step(now=0.0)  # the three prefills
    decode = engine.step(now=1.0)
    assert decode.num_decode_requests == 3
    plain = Engine(small_profile(), rng=random.Random(0))
    for i in range(3):
        plain.add(f"r{i}", (i, i + 1), max_tokens=4, ignore_eos=True, now=0.0)
    plain.step(now=0.0)
    assert decode.duration_s == pytest.approx(plain.step(now=1.0).duration_s + 3 * 0.5 / 1000)


def test_request_overhead_counts_in_ttft_not_in_queue_time_offline() -> None:
    prof = small_profile(timing=_timing(request_overhead_ms=30.0))
    arrival = offline.Arrival(time_s=1.0, prompt_token_ids=(1, 2, 3), max_tokens=2, ignore_eos=True)
    (record,) = offline.replay(prof, [arrival]).records
    (plain,) = offline.replay(small_profile(), [arrival]).records
    assert record.arrival_s == 1.0 and record.queued_s == pytest.approx(1.03)
    assert record.first_scheduled_s == pytest.approx(1.03)
    assert record.first_token_s is not None and plain.first_token_s is not None
    assert record.first_token_s - record.arrival_s == pytest.approx(
        plain.first_token_s - plain.arrival_s + 0.03
    )


async def test_a_live_node_reports_the_overhead_in_ttft(
    sim_node: NodeFactory, tmp_path: Path
) -> None:
    path = tmp_path / "slow-front.toml"
    path.write_text(_with_overhead(_CPU_TINY.read_text(), "500.0"))
    url = await sim_node(profile_name=str(path), time_scale=50.0)
    body = {"model": "tiny-model", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
        async with s.get(f"{url}/metrics") as r:
            page = await r.text()
    sums = {
        sample.name: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name.endswith("_sum")
    }
    assert sums["vllm:time_to_first_token_seconds_sum"] >= 0.5  # simulated seconds
    assert sums["vllm:request_queue_time_seconds_sum"] < 0.5
