"""Capacity floors into capacity: the autoscaler loop and its actuators
(docs/agent-publisher.md, "Capacity floor").

``plan``        the pure up-fast, down-slow decision of an actuator that runs nodes itself
``actuators``   the ``Actuator`` protocol, the dry-run and command actuators
``simulator_actuator``  the actuator that runs meridian-sim nodes
``remote``      the webhook and Kubernetes actuators (HTTP)
``autoscaler``  the loop, and ``create(settings, ...)``
"""

from aiohttp import web

from regional_agent.autoscaler.actuators import Actuator, Command, DryRun
from regional_agent.autoscaler.autoscaler import Autoscaler, create
from regional_agent.autoscaler.remote import Kubernetes, Webhook
from regional_agent.autoscaler.simulator_actuator import SimulatorActuator

AUTOSCALER = web.AppKey("autoscaler", Autoscaler)  # the agent app's, when an actuator is set

__all__ = [
    "AUTOSCALER",
    "Actuator",
    "Autoscaler",
    "Command",
    "DryRun",
    "Kubernetes",
    "SimulatorActuator",
    "Webhook",
    "create",
]
