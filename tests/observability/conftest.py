"""The live fleet (tests/observability/stack.py) and a real Prometheus scraping it, once per
module: starting a dozen processes per test would cost more than the tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.observability.prom import Prometheus
from tests.observability.stack import Fleet
from tests.support import BindServer, EtcdServer, start_bind


@pytest.fixture(scope="module")
def fleet_bind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BindServer]:
    with start_bind(tmp_path_factory.mktemp("bind")) as server:
        yield server


@pytest.fixture(scope="module")
def fleet(
    etcd_server: EtcdServer, fleet_bind: BindServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    etcd_server.wipe()
    f = Fleet(etcd_server.url, fleet_bind, tmp_path_factory.mktemp("logs"))
    try:
        yield f.start()
    finally:
        f.stop()


@pytest.fixture(scope="module")
def prometheus(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    p = Prometheus(tmp_path_factory.mktemp("prometheus"), fleet.scrape_config())
    try:
        yield p
    finally:
        p.stop()
