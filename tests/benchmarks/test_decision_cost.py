"""benchmarks/decision_cost.py measures what it says: every decision routed, through the
agent's own pool and policy, with the bound in force above 16 nodes and off when asked."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decision_cost


def test_a_small_sweep_routes_every_request_of_both_variants() -> None:
    for variant in ("meridian", "meridian-exact"):
        row = decision_cost.measure(32, variant, decisions=200, warmup=100, seed=3)
        assert row["decisions"] == 200 and row["nodes"] == 32
        assert 0 < row["p50_us"] <= row["p99_us"]


def test_the_requests_share_system_prompts_as_the_docs_say() -> None:
    import random

    stream = decision_cost.requests(400, random.Random(1))
    heads = {r.block_hashes[31] for r in stream}  # the 32nd block: the end of the system prompt
    assert 5 < len(heads) <= 64  # shared: far fewer distinct system prompts than requests
    assert all(len(r.block_hashes) == 36 for r in stream)
