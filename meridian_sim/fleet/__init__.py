"""The fleet simulator: hundreds of simulated vLLM engines behind regional agents, in virtual
time, routed by the same ``policies`` code as the agent (``meridian-sim fleet``)."""

from meridian_sim.fleet.sim import (
    POLICIES,
    Fleet,
    FleetConfig,
    FleetError,
    FleetResult,
    Outcome,
    Scaling,
    Spill,
    Tick,
    Workload,
    at_load,
    simulate,
    with_context,
)

__all__ = [
    "POLICIES",
    "Fleet",
    "FleetConfig",
    "FleetError",
    "FleetResult",
    "Outcome",
    "Scaling",
    "Spill",
    "Tick",
    "Workload",
    "at_load",
    "simulate",
    "with_context",
]
