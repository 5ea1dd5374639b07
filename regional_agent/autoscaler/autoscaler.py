"""The autoscaler's loop: hands the capacity floor and the region's healthy capacity to the
actuator every ``autoscaler.interval_s``, and at once when the floor changes.

The floor comes from the controller, through the publisher (``regions/<r>/desired``); until
one is read it is 0 and no actuator does anything.  An actuator that fails is logged once and
retried with backoff; the agent keeps serving either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from meridian_service.clock import Clock
from regional_agent.autoscaler.actuators import Actuator, Command, DryRun
from regional_agent.autoscaler.simulator_actuator import SimulatorActuator
from regional_agent.errors import ActuatorError
from regional_agent.nodes import NodePool
from regional_agent.retry import Backoff
from regional_agent.roster import Roster
from regional_agent.settings import AutoscalerSettings

log = logging.getLogger(__name__)

_RETRY_MAX_S = 60.0


class Autoscaler:
    def __init__(
        self,
        *,
        actuator: Actuator,
        settings: AutoscalerSettings,
        pool: NodePool,
        clock: Clock,
        rng: random.Random,
    ) -> None:
        self._pool = pool
        self._clock = clock
        self.actuator = actuator
        self._settings = settings
        self._backoff = Backoff(
            base_s=settings.interval_s, max_s=max(_RETRY_MAX_S, settings.interval_s), rng=rng
        )
        self.floor = 0.0
        self._wake = asyncio.Event()
        self.failing: str | None = None  # the error the last ensure() met, if it failed

    def set_floor(self, floor: float) -> None:
        if floor != self.floor:
            log.info(
                "capacity floor changed from=%g to=%g actuator=%s current=%g",
                self.floor,
                floor,
                self.actuator.name,
                self.current(),
            )
            self.floor = floor
            self._wake.set()

    def current(self) -> float:
        """The region's healthy capacity: the weights of active, healthy nodes summed."""
        return sum(v.weight for v in self._pool.serving(now=self._clock.now()))

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.actuator.ensure(floor=self.floor, current=self.current())
            except ActuatorError as exc:
                if self.failing is None:
                    log.warning(
                        "autoscaler actuator failed actuator=%s floor=%g error=%s: retrying "
                        "with backoff",
                        self.actuator.name,
                        self.floor,
                        exc.message,
                    )
                self.failing = exc.message
                delay_s = self._backoff.next_s()
            else:
                if self.failing is not None:
                    log.info("autoscaler actuator recovered actuator=%s", self.actuator.name)
                self.failing = None
                self._backoff.reset()
                delay_s = self._settings.interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._wake.wait()

    async def close(self) -> None:
        await self.actuator.close()


def create(
    settings: AutoscalerSettings,
    *,
    region: str | None,
    pool: NodePool,
    roster: Roster,
    clock: Clock,
    drain_timeout_s: float,
    rng: random.Random,
) -> Autoscaler | None:
    """The autoscaler ``settings`` ask for; ``None`` for ``actuator = "none"``."""
    actuator: Actuator
    if settings.actuator == "none":
        return None
    if settings.actuator == "dry-run":
        actuator = DryRun()
    elif settings.actuator == "command":
        actuator = Command(
            argv=settings.command, timeout_s=settings.command_timeout_s, region=region
        )
    else:
        actuator = SimulatorActuator(
            settings=settings, pool=pool, roster=roster, clock=clock,
            drain_timeout_s=drain_timeout_s,
        )  # fmt: skip
    return Autoscaler(actuator=actuator, settings=settings, pool=pool, clock=clock, rng=rng)
