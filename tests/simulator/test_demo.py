"""``make demo`` runs end to end (shortened)."""

from __future__ import annotations

import pytest

from simulator import demo


def test_demo_runs_and_reports_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--requests", "9", "--concurrency", "3", "--time-scale", "10"]) == 0
    out = capsys.readouterr().out
    assert "9/9 requests done" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("node-")]
    assert [row[0] for row in rows] == ["node-1", "node-2", "node-3"]
    assert all(row[1] == "3" for row in rows)  # requests finished per node
    assert all(row[-1] == "0" for row in rows)  # no errors
