"""``meridian-sim fleet``: one ``name: value`` line per figure, the same figures as JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meridian_sim import cli

REQUIRED = (
    "ttft_p50_s",
    "ttft_p99_s",
    "e2e_p99_s",
    "queue_wait_p99_s",
    "prefix_hit_rate",
    "throughput_tok_s",
)


def _trace(tmp_path: Path, n: int = 24) -> Path:
    lines = []
    for i in range(n):
        # conversations of two turns: the second repeats the first's blocks and adds one
        conv = i // 2
        ids = [0, 1000 + conv] + ([2000 + conv] if i % 2 else [])
        row = {
            "timestamp": i * 500,
            "input_length": 512 * len(ids) - 100,
            "output_length": 20,
            "hash_ids": ids,
        }
        lines.append(json.dumps(row))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prints_name_value_lines_and_writes_the_same_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet", "--trace", str(_trace(tmp_path)), "--nodes", "3", "--policy", "meridian"]
    argv += ["--load", "0.5", "--capacity-rps", "2", "--regions", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert all(re.fullmatch(r"[a-z0-9_]+: \S+", line) for line in lines), lines
    printed = dict(line.split(": ", 1) for line in lines)
    for key in REQUIRED:
        assert key in printed
    figures = json.loads(out.read_text())
    assert set(figures) == set(printed)
    assert figures["requests"] == figures["completed"] == 24
    assert figures["policy"] == "meridian" and figures["nodes"] == 3
    assert float(printed["ttft_p99_s"]) == pytest.approx(figures["ttft_p99_s"], rel=1e-5)
    assert figures["arrival_rate_per_s"] == pytest.approx(3.0)  # 0.5 x 3 nodes x 2 req/s
    assert 0 < figures["prefix_hit_rate"] < 1  # second turns hit their first turn's blocks


def test_agents_per_region_runs_replicas_and_refuses_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet", "--trace", str(_trace(tmp_path)), "--nodes", "3", "--policy"]
    argv += ["least_connections", "--load", "0.5", "--capacity-rps", "2"]
    assert cli.main([*argv, "--agents-per-region", "3", "--json", str(out)]) == 0
    assert "agents_per_region: 3" in capsys.readouterr().out.splitlines()
    figures = json.loads(out.read_text())
    assert figures["agents_per_region"] == 3
    assert figures["requests"] == figures["completed"] == 24
    assert cli.main([*argv, "--agents-per-region", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "meridian-sim: agents_per_region must be at least 1, got 0" in captured.err


def test_the_groups_policy_is_one_of_the_choices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fleet", "--trace", str(_trace(tmp_path)), "--nodes", "3", "--policy", "groups"]
    assert cli.main([*argv, "--load", "0.5", "--capacity-rps", "2"]) == 0
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert printed["policy"] == "groups" and printed["completed"] == "24"


def test_a_bad_trace_exits_2_naming_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n')
    path.write_text(path.read_text() + '{"timestamp": 1, "input_length": 10, "hash_ids": [0]}\n')
    argv = ["fleet", "--trace", str(path), "--nodes", "2", "--policy", "jsq", "--load", "0.5"]
    assert cli.main([*argv, "--capacity-rps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: missing field 'output_length'" in err


def test_progress_goes_to_stderr_in_a_real_process(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "meridian_sim.cli", "fleet", "--trace", str(_trace(tmp_path))]
    argv += ["--nodes", "2", "--policy", "oracle", "--load", "0.8"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "measuring one node's capacity" in proc.stderr
    assert "policy: oracle" in proc.stdout
    assert "fleet:" not in proc.stdout
