"""A vLLM-compatible node simulator (and, later, a fleet simulator) driven by GPU profiles."""
