"""Actuators: what the autoscaler calls to bring the region's capacity up to a floor.

Every actuator answers :meth:`Actuator.ensure` (called every ``autoscaler.interval_s`` and when
the floor changes, with the floor, the region's healthy capacity and each model's floor and
capacity, ``plan.ModelNeed``) and :meth:`Actuator.close`
(when the agent stops).  ``ensure`` is idempotent: called again with the same numbers, it does
nothing new.  It raises ``ActuatorError`` when it could not act; the autoscaler logs that once
and retries with backoff.

=========  =================================================================================
dry-run    logs what it would do, once per change
command    runs ``autoscaler.command`` when the floor changes (a cloud autoscaler's hook);
           ``{floor}``, ``{current}``, ``{region}`` and ``{model_floors}`` (``A=0.5,B=2``)
           in its arguments are replaced
simulator  starts ``meridian-sim node`` processes and adds them to the pool (simulator.py),
           of the model that is short when one is (``per_model``)

An actuator with ``per_model`` false brings one kind of node; the autoscaler raises the floor it
hands it to cover the shortfall of the models those nodes serve (``plan.raised``).
=========  =================================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from regional_agent.autoscaler.plan import ModelNeed
from regional_agent.errors import ActuatorError

log = logging.getLogger(__name__)


class Actuator(Protocol):
    name: str
    per_model: bool  # it brings nodes of the model that is short; else one kind of node

    async def ensure(
        self, *, floor: float, current: float, models: tuple[ModelNeed, ...] = ()
    ) -> None:
        """Act so that the region's healthy capacity becomes at least ``floor`` (and, for a
        ``per_model`` actuator, each model's at least its floor)."""
        ...

    async def close(self) -> None:
        """The agent stops: undo what must not outlive it."""
        ...

    def pending(self) -> int:
        """Nodes ordered and not yet serving, as far as the actuator knows (0: it cannot tell)."""
        ...


class DryRun:
    """Logs what it would do; changes nothing."""

    name = "dry-run"
    per_model = False

    def __init__(self) -> None:
        self._said: tuple[object, ...] | None = None

    async def ensure(
        self, *, floor: float, current: float, models: tuple[ModelNeed, ...] = ()
    ) -> None:
        need = max(0.0, floor - current)
        said = (floor, round(need, 6), models)
        if said == self._said:
            return
        self._said = said
        for n in models:
            if n.short > 0:
                log.info(
                    "autoscaler dry run: model %s short by %g (floor=%g current=%g)",
                    n.model,
                    n.short,
                    n.floor,
                    n.current,
                )
        if need > 0:
            log.info(
                "autoscaler dry run: would add capacity=%g to reach floor=%g (current=%g)",
                need,
                floor,
                current,
            )
        else:
            log.info("autoscaler dry run: floor=%g met (current=%g)", floor, current)

    async def close(self) -> None:
        return None

    def pending(self) -> int:
        return 0


class Command:
    """Runs a command (no shell) when the floor changes; the command makes it so (a cloud
    autoscaler's API, a Terraform run, a pager).  Exit status 0 means the floor was handed
    over; anything else is retried."""

    name = "command"
    per_model = False

    def __init__(self, *, argv: Sequence[str], timeout_s: float, region: str | None) -> None:
        if not argv:
            raise ValueError("the command actuator needs a command")
        self._argv = list(argv)
        self._timeout_s = timeout_s
        self._region = region or ""
        self.applied: tuple[float, str] = (0.0, "")  # what the last successful run handed over
        self.runs = 0

    def argv(
        self, *, floor: float, current: float, models: tuple[ModelNeed, ...] = ()
    ) -> list[str]:
        values = {
            "{floor}": f"{floor:g}",
            "{current}": f"{current:g}",
            "{region}": self._region,
            "{model_floors}": model_floors(models),
        }
        out = []
        for arg in self._argv:
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            out.append(arg)
        return out

    async def ensure(
        self, *, floor: float, current: float, models: tuple[ModelNeed, ...] = ()
    ) -> None:
        asked = (floor, model_floors(models))
        if asked == self.applied:
            return
        argv = self.argv(floor=floor, current=current, models=models)
        self.runs += 1
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise ActuatorError(f"cannot run autoscaler command {argv[0]!r}: {exc}") from exc
        try:
            async with asyncio.timeout(self._timeout_s):
                output, _ = await process.communicate()
        except TimeoutError:
            await _kill(process)
            raise ActuatorError(
                f"autoscaler command {argv[0]!r} ran past {self._timeout_s:g} s and was killed"
            ) from None
        except BaseException:  # cancelled: the agent is stopping; leave nothing running
            await _kill(process)
            raise
        tail = output.decode(errors="replace").strip()[-500:]
        if process.returncode != 0:
            raise ActuatorError(
                f"autoscaler command {argv[0]!r} exited with status {process.returncode}: "
                f"{tail or '(no output)'}"
            )
        log.info(
            "autoscaler command ran floor=%g model_floors=%s current=%g previous_floor=%g "
            "output=%r",
            floor,
            asked[1] or "none",
            current,
            self.applied[0],
            tail[-200:],
        )
        self.applied = asked

    async def close(self) -> None:
        return None

    def pending(self) -> int:
        return 0


def model_floors(models: tuple[ModelNeed, ...]) -> str:
    """``A=0.5,B=2``: each model's floor, in name order (empty when none)."""
    return ",".join(f"{n.model}={n.floor:g}" for n in models)


async def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    await process.wait()
