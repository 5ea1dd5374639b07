"""Real servers for tests: etcd and BIND9 on loopback, started and stopped by the helpers here.

The pytest fixtures in tests/conftest.py wrap these; import from here to start a server
yourself (for example, two etcd members, or a server a test kills on purpose).
"""

from tests.support.bind import (
    BindServer,
    DnsView,
    TsigKey,
    check_conf,
    relaunch_bind,
    start_bind,
    start_bind_with,
    zone_file,
)
from tests.support.clock import ManualClock
from tests.support.etcd import EtcdServer, relaunch, start_etcd, start_etcd_cluster
from tests.support.ports import free_port
from tests.support.process import ServerStartError
from tests.support.waits import cancel_all, until

__all__ = [
    "BindServer",
    "DnsView",
    "EtcdServer",
    "ManualClock",
    "ServerStartError",
    "TsigKey",
    "cancel_all",
    "check_conf",
    "free_port",
    "relaunch",
    "relaunch_bind",
    "start_bind",
    "start_bind_with",
    "start_etcd",
    "start_etcd_cluster",
    "until",
    "zone_file",
]
