"""Agents per region in the fleet benchmarks: ``--reuse`` keys on it, the claim table shows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _fleet
import fleet_tables

TRACE = Path("trace.jsonl")


def _row(policy: str, scrape: float, wait_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "section": "claim",
        "policy": policy,
        "nodes": 64,
        "load": 0.8,
        "scrape_interval_s": scrape,
        "window_s": 15.0,
        "queue_wait_p99_s": wait_s,
        **extra,
    }


def test_reuse_takes_only_rows_of_the_same_agents_per_region(tmp_path: Path) -> None:
    old = [_row("random", 0.0, 0.5)]  # written before agents_per_region existed: one agent
    old.append(_row("random", 0.25, 0.6, agents_per_region=4))
    meta = {"trace": str(TRACE), "node_capacity_rps": 1.0, "machine": {"date": "then"}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"meta": meta, "rows": old}))
    tasks = [
        _fleet.Task("claim", "random", 64, 0.8, scrape, 15.0, 0, agents=agents)
        for agents in (1, 4)
        for scrape in (0.0, 0.25)
    ]
    reused = _fleet.reusable(tasks, earlier, rerun=set(), capacity_rps=1.0, trace=TRACE, same={})
    assert sorted(reused) == [0, 3]  # (1 agent, fresh) and (4 agents, 0.25 s)
    assert reused[0]["agents_per_region"] == 1 and reused[0]["queue_wait_p99_s"] == 0.5
    assert reused[3]["agents_per_region"] == 4 and reused[3]["queue_wait_p99_s"] == 0.6
    assert all(r["reused_from"] == "then" for r in reused.values())


def test_claim_table_has_a_row_per_agents_and_telemetry() -> None:
    rows = [
        _row("power_of_two", 0.0, 0.008),
        _row("least_connections", 0.0, 0.012),
        _row("random", 0.0, 0.025),
    ]
    rows += [
        _row(policy, 1.0, wait_s, agents_per_region=4)
        for policy, wait_s in (
            ("power_of_two", 0.03),
            ("least_connections", 0.02),
            ("random", 0.04),
        )
    ]
    meta = {"trace_name": "t", "command": "c", "node_capacity_rps": 1.0, "window_s": 10}
    meta |= {"min_requests": 0, "claim_window_s": 15.0}
    md = fleet_tables.render(rows, meta, sizes=[], loads=[], stale=1.0)
    assert "| agents | telemetry | power of two | least connections | random | order holds |" in md
    assert "| 1 | fresh | 8 | 12 | 25 | yes |" in md
    assert "| 4 | scrape 1 s | 30 | 20 | 40 | no |" in md
