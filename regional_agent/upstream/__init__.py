"""The only code that speaks HTTP to nodes (and to sibling workers); it turns aiohttp's errors
into the agent's own."""

from regional_agent.upstream.client import NodeClient, Timeouts, UpstreamResponse, sibling_call

__all__ = ["NodeClient", "Timeouts", "UpstreamResponse", "sibling_call"]
