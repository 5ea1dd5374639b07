"""benchmarks/decision_cost.py measures what it says: every decision routed, through the
agent's own pool and policy, with the bound in force above 16 nodes and off when asked."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decision_cost
import pytest


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


def test_bounded_sets_side_by_side_each_route_every_decision() -> None:
    rows = decision_cost.interleaved(
        64, [(16, 8), (4, 1)], decisions=300, warmup=100, seed=2, block=50
    )
    assert [r["variant"] for r in rows] == ["meridian 16x8", "meridian 4x1"]
    assert all(r["decisions"] == 300 and 0 < r["p50_us"] <= r["p99_us"] for r in rows)


def test_a_malformed_bound_is_refused() -> None:
    with pytest.raises(SystemExit) as exit_:
        decision_cost.main(["--bounds", "16x0"])
    assert exit_.value.code == 2
