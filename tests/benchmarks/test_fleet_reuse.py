"""``--reuse``: rows of policies that were not rerun come from the earlier run, unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import _fleet
import pytest


def _trace(path: Path) -> Path:
    rows = [
        {
            "timestamp": 200 * i,
            "input_length": 600 + 9 * i,  # two 512-token blocks
            "output_length": 20 + i % 7,
            "hash_ids": [0, 1000 + i % 5] if i % 3 else [0, 2000 + i],
        }
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tasks() -> list[_fleet.Task]:
    return [
        _fleet.Task("grid", policy, 2, 0.8, scrape, None, 0)
        for scrape in (0.0, 0.25)
        for policy in ("random", "meridian")
    ]


def test_reused_rows_equal_a_fresh_run_and_only_changed_policies_run(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    kw = {"trace": trace, "profile_name": "cpu-tiny", "capacity_rps": 2.0, "jobs": 1}
    first = _fleet.run_all(_tasks(), **kw)  # type: ignore[arg-type]
    meta = {
        "trace": str(trace),
        "node_capacity_rps": 2.0,
        "min_requests": 0,
        "machine": {"date": "then"},
    }
    _fleet.write(tmp_path, "earlier", meta, first, "")
    earlier = tmp_path / "earlier.json"

    reused = _fleet.reusable(
        _tasks(),
        earlier,
        rerun={"meridian"},
        capacity_rps=2.0,
        trace=trace,
        same={"min_requests": 0},
    )
    assert sorted(reused) == [0, 2]  # the random rows, at both scrape intervals
    assert all(r["reused_from"] == "then" and r["policy"] == "random" for r in reused.values())
    again = _fleet.run_all(_tasks(), **kw, reused=reused)  # type: ignore[arg-type]
    assert [r["policy"] for r in again] == [r["policy"] for r in first]
    for old, new in zip(first, again, strict=True):
        assert new["ttft_p99_s"] == old["ttft_p99_s"]  # deterministic: a rerun gives the same
        assert ("reused_from" in new) == (new["policy"] == "random")
    assert _fleet.reuse_note(again)[0].startswith("2 of 4 rows (random) are reused")

    with pytest.raises(SystemExit, match="capacity"):
        _fleet.reusable(_tasks(), earlier, rerun=set(), capacity_rps=3.0, trace=trace, same={})
    with pytest.raises(SystemExit, match="min_requests"):
        _fleet.reusable(
            _tasks(), earlier, rerun=set(), capacity_rps=2.0, trace=trace, same={"min_requests": 5}
        )
