"""The region's presence in etcd: liveness under a lease, status on change, desired state
followed (docs/agent-publisher.md).

``store``      the only module that speaks to etcd (aetcd); translates its errors
``status``     what the status says and when it is worth a write (pure decisions)
``load``       request rate, error rate and p99 TTFT over a sliding window
``publisher``  the three loops: alive, status, desired
"""

from regional_agent.publisher.publisher import Link, Publisher
from regional_agent.publisher.store import Store

__all__ = ["Link", "Publisher", "Store"]
