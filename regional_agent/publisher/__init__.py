"""The region's presence in etcd: liveness under a lease, status on change, desired state
followed (docs/agent-publisher.md).

``status``     what the status says and when it is worth a write (pure decisions)
``load``       request rate, error rate and p99 TTFT over a sliding window
``publisher``  the three loops: alive, status, desired; and the group tables' sync under its lease

etcd itself is the etcd layer's (``meridian_etcd``).
"""

from regional_agent.publisher.publisher import Link, Publisher

__all__ = ["Link", "Publisher"]
