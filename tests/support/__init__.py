"""Real servers for tests: etcd and BIND9 on loopback, started and stopped by the helpers here.

The pytest fixtures in tests/conftest.py wrap these; import from here to start a server
yourself (for example, two etcd members, or a server a test kills on purpose).
"""

from tests.support.bind import BindServer, DnsView, TsigKey, start_bind
from tests.support.etcd import EtcdServer, relaunch, start_etcd, start_etcd_cluster
from tests.support.ports import free_port
from tests.support.process import ServerStartError

__all__ = [
    "BindServer",
    "DnsView",
    "EtcdServer",
    "ServerStartError",
    "TsigKey",
    "free_port",
    "relaunch",
    "start_bind",
    "start_etcd",
    "start_etcd_cluster",
]
