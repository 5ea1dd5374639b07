"""Callbacks for OpenTelemetry's observable instruments, shared by the agent's and the
controller's metrics: a table of counts read when scraped, one observation per row."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Observation

Callback = Callable[[CallbackOptions], Iterable[Observation]]


def labelled(table: Mapping[tuple[str, ...], int], keys: tuple[str, ...]) -> Callback:
    """One observation per row of ``table``, its key tuple labelled ``keys`` in order."""

    def cb(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, dict(zip(keys, k, strict=True))) for k, v in list(table.items())]

    return cb


def by_label(table: Mapping[str, int], known: Iterable[str] = (), key: str = "kind") -> Callback:
    """One observation per row of ``table`` labelled ``key``; every value in ``known`` is
    observed at 0 until it has a row, so that ``increase()`` sees its first event."""
    zeros = dict.fromkeys(known, 0)

    def cb(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, {key: k}) for k, v in (zeros | dict(table)).items()]

    return cb
