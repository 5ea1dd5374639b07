"""The nodes' own KV-cache events, subscribed to and fed into the precise prefix index."""

from regional_agent.kv_events.subscriber import Endpoints, KvEvents, Subscription

__all__ = ["Endpoints", "KvEvents", "Subscription"]
