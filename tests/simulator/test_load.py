"""Under rising load, time to first token rises and preemptions appear once the KV cache fills.

Two views of the same claim: the engine in virtual time with the H100 profile (a load curve,
as ``benchmarks/node_load_curve.py`` measures it), and a live node over HTTP with the CPU
profile, read back from ``/metrics`` as a router would.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp

from meridian_sim import offline, profile
from tests.simulator.conftest import NodeFactory
from tests.simulator.test_node import _count, _scrape, _sum, _value

MEDIUM_PROMPT = " ".join(f"word{i % 50} alpha beta gamma" for i in range(50))  # 250 tokens


def test_h100_load_curve_has_a_knee_where_the_kv_cache_fills() -> None:
    h100 = profile.load("h100-llama3-8b")
    results = {}
    for rate in (2.0, 5.0, 11.0):
        arrivals = offline.poisson_arrivals(
            rate_per_s=rate,
            duration_s=30.0,
            prompt_tokens=2000,
            output_tokens=500,
            rng=random.Random(1),
        )
        results[rate] = offline.replay(h100, arrivals)
    p50 = {rate: offline.percentile(offline.ttfts(r.records), 0.5) for rate, r in results.items()}
    assert p50[2.0] < p50[5.0] < p50[11.0]
    # light load: TTFT is about one 2000-token prefill step, as the profile says
    alone_s = h100.timing.step_ms(tokens_in_step=2000, kv_tokens_read=0, token_pairs=2000**2 / 2)
    assert alone_s / 1000 <= p50[2.0] < 2 * alone_s / 1000
    # below the knee the cache never fills and nothing is preempted
    for rate in (2.0, 5.0):
        assert results[rate].num_preemptions == 0
        assert results[rate].peak_kv_usage < 0.9
    # past it the cache is full, requests queue and the engine preempts
    overloaded = results[11.0]
    assert overloaded.peak_kv_usage > 0.99
    assert overloaded.num_preemptions > 0
    assert overloaded.peak_waiting > 0
    assert p50[11.0] > 3 * p50[2.0]
    p99_overloaded = offline.percentile(offline.ttfts(overloaded.records), 0.99)
    assert p99_overloaded > 10 * offline.percentile(offline.ttfts(results[2.0].records), 0.99)


async def test_live_node_reports_rising_ttft_and_preemptions(sim_node: NodeFactory) -> None:
    # cpu-tiny: 16 blocks of 128 tokens.  A request is admitted with the 2 blocks its prompt
    # needs and grows to 4 as it generates: 8 fit at admission, only 4 at the end.
    url = await sim_node(profile_name="cpu-tiny", time_scale=10)
    body = {"prompt": MEDIUM_PROMPT, "max_tokens": 250, "ignore_eos": True}
    ttft = "vllm:time_to_first_token_seconds"

    async def burst(session: aiohttp.ClientSession, n: int, salt: str) -> None:
        async def one(i: int) -> None:
            # a distinct first word per request: no prefix sharing
            payload = {**body, "prompt": f"{salt}{i} {MEDIUM_PROMPT}"}
            async with session.post(f"{url}/v1/completions", json=payload) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(one(i) for i in range(n)))

    async with aiohttp.ClientSession() as s:
        await burst(s, 2, "light")
        light = await _scrape(url)
        await burst(s, 12, "heavy")
        heavy = await _scrape(url)
    assert _value(light, "vllm:num_preemptions") == 0
    assert _value(heavy, "vllm:num_preemptions") > 0
    light_mean = _sum(light, ttft) / _count(light, ttft)
    heavy_mean = (_sum(heavy, ttft) - _sum(light, ttft)) / (
        _count(heavy, ttft) - _count(light, ttft)
    )
    assert heavy_mean > 2 * light_mean
