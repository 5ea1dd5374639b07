"""The cyclic garbage collector of a long-running server: start-up's objects frozen, young
collections rarer, and every collection's pause counted.

CPython frees most objects by reference counting; the cyclic collector is for reference cycles
only, yet it runs whenever the container objects allocated and not yet freed pass a threshold
(700 for the youngest generation), and every so often it walks every tracked object, start-up's
included (a full collection).  Under load the agent's in-flight requests keep enough objects
alive across young collections that full collections follow each other: measured on the 2-core
development VM with ``benchmarks/router_cpu.py`` (wrk, one agent core saturated, 30 s), 46-60
full collections of 39-42 ms on average (up to 63 ms), and about 10 % of the agent's CPU in
the collector; wrk's latency p99 was 46-61 ms.  With start-up frozen and young collections
every 50,000 allocations, collections all but stop under that load, the CPU per request drops
7-11 % and the p99 to 18-22 ms (docs/benchmarks.md, "The garbage collector").

:func:`settle` does that once the server listens (``server.gc_young_threshold``; 0 leaves the
collector as CPython sets it).  :data:`PAUSES` counts every collection and its pause by
generation, whatever the setting, for ``meridian_agent_gc_*`` (docs/observability.md).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Final

log = logging.getLogger(__name__)

GENERATIONS: Final = (0, 1, 2)


class Pauses:
    """Collections and their pauses (seconds) by generation, since :meth:`install`; counted
    in a ``gc.callbacks`` hook with no lock (it runs with the GIL held, in whichever thread
    triggered the collection)."""

    __slots__ = ("_installed", "_started", "collections", "seconds")

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0
        self._installed = False

    def install(self) -> None:
        """Start counting (once per process: later calls do nothing)."""
        if not self._installed:
            self._installed = True
            gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


PAUSES: Final = Pauses()


def settle(young_threshold: int) -> None:
    """Once start-up is done: collect once, freeze every object left (``gc.freeze``: full
    collections no longer walk them), and collect the youngest generation after
    ``young_threshold`` container allocations instead of CPython's 700 (the older
    generations' thresholds stay).  0 leaves the collector as it is."""
    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, oldest)
    log.info(
        "garbage collector settled frozen=%d thresholds=%s",
        gc.get_freeze_count(), ",".join(map(str, gc.get_threshold())),
    )  # fmt: skip
