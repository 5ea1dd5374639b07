"""Fixtures shared by the controller's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from controlplane.store import Store
from tests.support import EtcdServer


@pytest.fixture
async def store(etcd: EtcdServer) -> AsyncIterator[Store]:
    """The controller's store on the session's etcd."""
    s = Store([etcd.url])
    yield s
    await s.close()
