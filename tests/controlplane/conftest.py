"""Fixtures shared by the controller's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import meridian_etcd
from tests.support import EtcdServer
from tests.support.etcd import client as etcd_client


@pytest.fixture
async def store(etcd: EtcdServer) -> AsyncIterator[meridian_etcd.Store]:
    """The controller's store on the session's etcd."""
    s = etcd_client(etcd.url)
    yield s
    await s.close()
