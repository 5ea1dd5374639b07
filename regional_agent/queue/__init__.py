"""The region's central queue (``Dispatcher``) and the slot leases it hands out."""

from regional_agent.queue.dispatcher import Dispatcher, Lease

__all__ = ["Dispatcher", "Lease"]
