"""The fault matrix (``make test-faults``): every case breaks a real process or link on loopback,
measures how long until Meridian noticed and until it was whole again, and checks both against
the bound its settings promise.  The measured rows are written to ``MERIDIAN_FAULT_REPORT``
(default ``.cache/faults/report.json``) for docs/reliability.md."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import ROOT, Report


@pytest.fixture(scope="session")
def report() -> Iterator[Report]:
    out = Report()
    yield out
    path = Path(os.environ.get("MERIDIAN_FAULT_REPORT", ROOT / ".cache" / "faults" / "report.json"))
    out.write(path)
    lines = [f"{r.case}: detect {r.detect_s} s (bound {r.detect_bound_s}), recover {r.recover_s} s "
             f"(bound {r.recover_bound_s}), requests {r.requests}, lost {r.lost}, broken {r.broken}"
             for r in out.rows]  # fmt: skip
    print("\nfault matrix (" + str(path) + "):\n" + "\n".join(lines))


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    return d
