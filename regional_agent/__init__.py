"""The regional agent: an OpenAI-compatible routing proxy in front of a region's vLLM nodes."""
