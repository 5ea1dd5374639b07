"""Node health in the agent: active ``/health`` probes, passive outlier ejection from every
upstream attempt, latency (gray-failure) ejection and slow start.

The rules live in ``policies.health`` (pure); :class:`~regional_agent.health.monitor.HealthMonitor`
is the I/O shell that feeds them and answers ``NodePool``'s ``state`` and ``slow_start``.
"""

from regional_agent.health.monitor import HealthMonitor

__all__ = ["HealthMonitor"]
