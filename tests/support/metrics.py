"""Reading a Prometheus exposition in tests (prometheus_client's parser, never regexes over the
text), and the series docs/observability.md documents."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "observability.md"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Scrape:
    """One ``/metrics`` answer, parsed; OpenTelemetry's ``otel_scope_*`` labels are dropped."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.samples = [
            Sample(
                s.name,
                {k: v for k, v in s.labels.items() if not k.startswith("otel_scope_")},
                s.value,
            )
            for family in self.families
            for s in family.samples
        ]

    def find(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the one sample of ``name`` with these labels; ``None`` when absent."""
        found = self.find(name, **labels)
        assert len(found) <= 1, found
        return found[0].value if found else None

    def names(self, prefix: str) -> set[str]:
        """Its series as the reference names them (counters with ``_total``)."""
        return {
            f.name + ("_total" if f.type == "counter" else "")
            for f in self.families
            if f.name.startswith(prefix)
        }


def documented(prefix: str) -> dict[str, tuple[str, set[str]]]:
    """The reference's rows for ``prefix``: name -> (type, labels)."""
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith(f"`{prefix}"):
            continue
        labels = set(re.findall(r"`([a-z_]+)`", cells[2]))
        rows[cells[0].strip("`")] = (cells[1], labels)
    return rows


def base(name: str) -> str:
    """A Prometheus name without the suffixes the exporter adds (the instrument's name)."""
    return re.sub(r"(_seconds)?(_total)?$", "", name)  # a counter of seconds: _seconds_total


def instrument_names(source: Path, prefix: str) -> set[str]:
    """Every ``prefix...`` name a module's source spells, as instrument names."""
    return {base(n) for n in re.findall(rf"\b{prefix}[a-z_]+", source.read_text())}


def check_documented(scrape: Scrape, prefix: str) -> None:
    """Every ``prefix`` series of ``scrape`` is in the reference, with its type and labels."""
    rows = documented(prefix)
    for family in scrape.families:
        if not family.name.startswith(prefix):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name in rows, f"{name} is not in docs/observability.md"
        kind, labels = rows[name]
        assert kind == family.type, (name, kind, family.type)
        seen = {
            k for s in family.samples for k in s.labels if k != "le" and not k.startswith("otel")
        }
        assert seen <= labels, (name, seen, labels)


def zeros(samples: list[Sample]) -> bool:
    """Every sample is 0: the counter is exported before its first event (so that increase()
    sees the first one), and none has happened."""
    return bool(samples) and all(s.value == 0 for s in samples)
