"""The only code that speaks HTTP to nodes; it turns aiohttp's errors into the agent's own."""

from regional_agent.upstream.client import NodeClient, Timeouts, UpstreamResponse

__all__ = ["NodeClient", "Timeouts", "UpstreamResponse"]
