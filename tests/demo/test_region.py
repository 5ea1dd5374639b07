"""``make demo`` runs end to end (shortened): nodes behind an agent, a drain and a kill."""

from __future__ import annotations

import re

import pytest

from meridian_demo import region as demo


def test_demo_runs_drains_kills_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--requests", "36", "--concurrency", "6", "--time-scale", "10"]) == 0
    out = capsys.readouterr().out
    assert "draining node-4" in out and "killing node-3" in out
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if re.match(r"node-\d +\w", line)
    }
    assert set(rows) == {"node-1", "node-2", "node-3", "node-4"}
    assert rows["node-4"][1] == "drained"
    assert rows["node-3"][1] in ("ejected", "unhealthy")
    assert rows["node-1"][1] == rows["node-2"][1] == "healthy"
    known = {
        name: re.search(r"(\d+) \((in sync|not in sync)\)", " ".join(row))
        for name, row in rows.items()
    }
    assert all(known.values()), out  # every node's KV events were followed
    assert known["node-3"][2] == "not in sync"  # type: ignore[index]  # killed: its stream ended
    for name in ("node-1", "node-2", "node-4"):  # alive: in sync, and holding what they served
        found = known[name]
        assert found is not None and found[2] == "in sync", out
        assert int(found[1]) > 0 or rows[name][2] == "0", out  # (routing may leave one idle)
    ok, failed = map(int, re.search(r"client: (\d+) ok, (\d+) failed", out).groups())  # type: ignore[union-attr]
    assert ok + failed == 36
    assert ok >= 30  # only streams already under way on the killed node may fail
    # the rest of the OpenAI surface, each answer with the agent's request id
    surface = out.split("The rest of the OpenAI surface, through the agent:")[1]
    assert re.search(r"GET /v1/models/\S+: 200, card of .*max_model_len \d+", surface)
    assert "POST /v1/embeddings: 200, 2 vectors of 256 floats" in surface
    assert re.search(r"POST /v1/responses: 200, \d+ events, response.created \.\.\. "
                     r"response.(completed|incomplete)", surface)  # fmt: skip
    assert "POST /v1/chat/completions: 200, 2 choices, each calling get_weather" in surface
    assert len(re.findall(r"X-Request-ID [0-9a-f]{32}\)", surface)) == 4
