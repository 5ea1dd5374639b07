"""meridian_service.gc_tuning: the collector settled once the agent listens, and its pauses
counted (``meridian_agent_gc_*``)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meridian_service import gc_tuning
from tests.support.ports import free_port
from tests.support.process import ServerProcess
from tests.support.waits import answered


@pytest.fixture
def collector() -> Iterator[None]:
    """This process's collector as it was, afterwards."""
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_settle_freezes_start_up_and_raises_the_young_threshold_only(collector: None) -> None:
    gc.unfreeze()
    _, middle, oldest = gc.get_threshold()
    start_up = [object(), [1, 2], {"a": []}]
    gc_tuning.settle(50_000)
    assert gc.get_threshold() == (50_000, middle, oldest)
    assert gc.get_freeze_count() > 0
    # frozen objects are out of every generation the collector walks
    assert not any(o is start_up for o in gc.get_objects())


def test_settle_zero_leaves_the_collector_as_it_is(collector: None) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    gc_tuning.settle(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_pauses_count_each_collection_by_generation_once() -> None:
    pauses = gc_tuning.Pauses()
    pauses.install()
    pauses.install()  # a second install adds no second hook
    try:
        gc.collect(0)
        gc.collect()
        assert pauses.collections[0] >= 1 and pauses.collections[2] >= 1
        assert pauses.seconds[2] > 0
        full = pauses.collections[2]
        gc.collect()
        assert pauses.collections[2] == full + 1
    finally:
        gc.callbacks.remove(pauses._hook)
    assert pauses._hook not in gc.callbacks


@pytest.mark.parametrize("threshold", [50_000, 0])
async def test_the_agent_settles_its_collector_once_listening_and_counts_pauses(
    tmp_path: Path, threshold: int
) -> None:
    """A real ``meridian-agent`` process: with the default it logs the frozen start-up and the
    young threshold; with 0 it leaves CPython's; either way /metrics has the pause series."""
    port = free_port()
    # one process: one collector settled (each worker settles its own)
    argv = [sys.executable, "-m", "regional_agent.cli", "--port", str(port), "--workers", "1",
            "--node", "http://127.0.0.1:9", "--log-level", "INFO"]  # fmt: skip
    env = {"MERIDIAN_AGENT_SERVER__GC_YOUNG_THRESHOLD": str(threshold)}
    agent = ServerProcess(argv, log_path=tmp_path / "agent.log", env={**os.environ, **env})
    try:
        metrics = await answered(f"http://127.0.0.1:{port}/metrics", agent, "meridian-agent")
        log = agent.log_tail(100_000)
    finally:
        await asyncio.to_thread(agent.stop)
    settled = [line for line in log.splitlines() if "garbage collector settled" in line]
    if threshold:
        assert len(settled) == 1 and f"thresholds={threshold}," in settled[0], log
        assert int(settled[0].split("frozen=")[1].split()[0]) > 10_000  # start-up's objects
    else:
        assert not settled, log
    for generation in "012":
        assert f'meridian_agent_gc_collections_total{{generation="{generation}"' in metrics
        assert f'meridian_agent_gc_pause_seconds_total{{generation="{generation}"' in metrics
