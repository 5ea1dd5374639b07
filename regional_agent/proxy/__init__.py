"""The OpenAI-compatible edge of the agent."""
