"""benchmarks/spill_over.py: a short run writes a row per scenario and variant, spills only
with spill-over on, and its table has a line per row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_spills_only_with_spill_over_on(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "spill_over.py"),
            "--loads", "0.6", "--window-s", "60", "--capacity-rps", "1.179",
            "--jobs", "1", "--out-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "spill_over.json").read_text())["rows"]
    by = {(r["scenario"], r["variant"]): r for r in rows}
    assert set(by) == {
        ("uneven", "queue"), ("uneven", "spill 20 ms"), ("uneven", "spill 80 ms"),
        ("even", "queue"), ("even", "spill 20 ms"),
    }  # fmt: skip
    assert by["uneven", "queue"]["spilled"] == 0 and by["even", "queue"]["spilled"] == 0
    assert by["uneven", "spill 20 ms"]["spilled"] > 0
    assert by["uneven", "spill 20 ms"]["home_ttft_p99_s"] < by["uneven", "queue"]["home_ttft_p99_s"]
    assert all(
        r["requests"] == by["uneven", "queue"]["requests"]
        for k, r in by.items()
        if k[0] == "uneven"
    )
    table = (tmp_path / "spill_over.md").read_text()
    assert sum(1 for line in table.splitlines() if line.startswith("| uneven")) == 3
