"""The simulator actuator: capacity from ``meridian-sim node`` processes the agent runs itself.

Below the floor it starts ``python -m meridian_sim.cli node --port 0 --profile P --time-scale X``
processes (as many as the deficit needs, at most ``autoscaler.max_nodes`` at once), reads the
``READY http://...`` line each prints, and adds the node to the pool by the path the admin API
uses (``Roster.add``).  A model below its own floor (``model_floors``) gets nodes started with
``--model`` that model first, counting the ones it started that do not serve yet; the region's
floor is then met with nodes of ``autoscaler.model``.  Above the floor it scales down
as ``plan.step`` says — one node at a time, after a delay — draining the node first (its
in-flight requests finish, up to ``health.drain_timeout_s``) and only then removing it and
stopping its process, never a node whose models would fall below their floors.  It never
touches a node it did not start; every node it started is stopped when the agent stops, and a
node whose process exits is taken out of the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import shutil
import sys
from dataclasses import dataclass

from meridian_service.clock import Clock
from policies.model import AdminState, Health, NodeId
from regional_agent.autoscaler import plan
from regional_agent.errors import ActuatorError
from regional_agent.nodes import NodePool
from regional_agent.roster import Roster
from regional_agent.settings import AutoscalerSettings, NodeSettings

log = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0


@dataclass(slots=True, kw_only=True)
class Started:
    """A node this actuator started."""

    node_id: NodeId
    url: str
    process: asyncio.subprocess.Process
    started_s: float
    model: str | None  # its --model (None: the profile's)
    draining_since: float | None = None


class SimulatorActuator:
    name = "simulator"
    per_model = True

    def __init__(
        self,
        *,
        settings: AutoscalerSettings,
        pool: NodePool,
        roster: Roster,
        clock: Clock,
        drain_timeout_s: float,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._roster = roster
        self._clock = clock
        self._drain_timeout_s = drain_timeout_s
        self.started: dict[NodeId, Started] = {}
        self._excess_since: float | None = None
        self._seeds = itertools.count(1)
        self._said: str | None = None
        self._warned: set[str] = set()  # the per-model shortages said once
        # Linux: the node gets SIGTERM if the agent dies without stopping it.
        setpriv = shutil.which("setpriv")
        self._prefix = [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []

    # -- Actuator --------------------------------------------------------------------------------

    async def ensure(
        self, *, floor: float, current: float, models: tuple[plan.ModelNeed, ...] = ()
    ) -> None:
        now = self._clock.now()
        await self._reap(now=now)
        weight = self._settings.node_weight
        room = max(0, self._settings.max_nodes - len(self.started))
        brought = 0  # nodes started or undrained for a model this call
        for need in models:
            short = need.short - weight * self._pending(need.model)
            key = f"short:{need.model}"
            if short <= plan.EPSILON:
                self._warned.discard(key)
                continue
            want = max(1, math.ceil(short / weight - plan.EPSILON))
            draining = [s for s in self.started.values() if s.draining_since is not None]
            mine = [s for s in draining if need.model in self._models(s)]
            kept = self._undrain(mine[:want], reason=f"model {need.model} short by {short:g}")
            n = min(want - kept, room)
            if n < want - kept:
                self._say(
                    key,
                    f"model {need.model} capacity {need.current:g} below its floor "
                    f"{need.floor:g} and no room for another node",
                    level=logging.WARNING,
                )
            room -= n
            brought += kept + await self._bring_new(
                n, model=need.model, floor=need.floor, current=need.current
            )
        active = [s for s in self.started.values() if s.draining_since is None]
        draining = [s for s in self.started.values() if s.draining_since is not None]
        victim = self._victim(active, models, now=now)
        step = plan.step(
            floor=floor,
            current=current + weight * brought,
            node_weight=weight,
            room=len(draining) + room,
            victim_weight=None if victim is None else victim[1],
            excess_since=self._excess_since,
            now=now,
            scale_down_delay_s=self._settings.scale_down_delay_s,
        )
        self._excess_since = step.excess_since
        if step.kind != self._said and (self._said is not None or step.kind != "met"):
            level = logging.WARNING if step.kind == "short" else logging.INFO
            log.log(level, 'autoscaler floor=%g: "%s"', floor, step.reason)
        self._said = step.kind
        if step.stop and victim is not None:
            self._drain(victim[0], now=now, reason=step.reason)
        if step.start:
            n = step.start - self._undrain(draining[: step.start], reason=f"floor {floor:g}")
            await self._bring_new(n, model=self._settings.model, floor=floor, current=current)

    def pending(self) -> int:
        """Nodes it started, not draining, that do not serve yet (on probation, say)."""
        serving = {v.node_id for v in self._pool.serving(now=self._clock.now())}
        return sum(
            1
            for s in self.started.values()
            if s.draining_since is None and s.node_id not in serving
        )

    async def close(self) -> None:
        started = list(self.started.values())
        await asyncio.gather(*(self._stop(s, why="the agent is stopping") for s in started))

    # -- scaling up ------------------------------------------------------------------------------

    def _undrain(self, keep: list[Started], *, reason: str) -> int:
        """Make draining own nodes active again; how many were."""
        for s in keep:
            node = self._pool.get(s.node_id)
            if node is not None:
                node.admin = AdminState.ACTIVE
                node.drain_started_s = None
            s.draining_since = None
            log.info("autoscaler kept node=%s (undrained): %s", s.node_id, reason)
        if keep:
            self._pool.notify()
        return len(keep)

    async def _bring_new(self, n: int, *, model: str | None, floor: float, current: float) -> int:
        """Start ``n`` nodes serving ``model``; how many did (raises if any failed)."""
        if n <= 0:
            return 0
        results = await asyncio.gather(
            *(self._start(model) for _ in range(n)), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, Started):
                log.info(
                    "autoscaler started node=%s url=%s profile=%s model=%s floor=%g "
                    "capacity_before=%g",
                    r.node_id,
                    r.url,
                    self._settings.profile,
                    model or "(the profile's)",
                    floor,
                    current,
                )
        for failure in failures:
            if not isinstance(failure, ActuatorError):
                raise failure
        if failures:
            raise ActuatorError(
                f"{len(failures)} of {len(results)} node(s) did not start: {failures[0]}"
            )
        return n

    def _models(self, s: Started) -> frozenset[str]:
        """What an own node serves: what its model list says, else what it was started with."""
        node = self._pool.get(s.node_id)
        if node is not None and node.models:
            return node.models
        return frozenset() if s.model is None else frozenset({s.model})

    def _pending(self, model: str) -> int:
        """Own active nodes of ``model`` not yet counted as serving it (starting, on probation,
        its model list not read yet)."""
        serving = {v.node_id: v.models for v in self._pool.serving(now=self._clock.now())}
        return sum(
            1
            for s in self.started.values()
            if s.draining_since is None
            and s.model == model
            and model not in serving.get(s.node_id, frozenset())
        )

    def _say(self, key: str, message: str, *, level: int) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.log(level, "autoscaler: %s", message)

    async def _start(self, model: str | None) -> Started:
        s = self._settings
        seed = next(self._seeds)
        argv = [
            *self._prefix,
            sys.executable,
            "-m",
            "meridian_sim.cli",
            "node",
            "--port",
            "0",
            "--profile",
            s.profile,
            "--time-scale",
            f"{s.time_scale:g}",
            "--seed",
            str(seed),
            "--log-level",
            "WARNING",
        ]
        if model:
            argv += ["--model", model]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
            )
        except OSError as exc:
            raise ActuatorError(f"cannot start meridian-sim: {exc}") from exc
        assert process.stdout is not None
        try:
            async with asyncio.timeout(s.start_timeout_s):
                line = (await process.stdout.readline()).decode(errors="replace").strip()
        except TimeoutError:
            await _terminate(process)
            raise ActuatorError(
                f"meridian-sim did not print READY within {s.start_timeout_s:g} s"
            ) from None
        except BaseException:
            await _terminate(process)
            raise
        if not line.startswith("READY "):
            await _terminate(process)
            raise ActuatorError(
                f"meridian-sim did not start (exit status {process.returncode}, said {line!r}); "
                f"check autoscaler.profile={s.profile!r}"
            )
        url = line.split()[1]
        node = self._roster.make(NodeSettings(url=url, weight=s.node_weight), source="autoscaler")
        if node.node_id in self._pool:
            await _terminate(process)
            raise ActuatorError(f"node {node.node_id} is already in the pool")
        started = Started(
            node_id=node.node_id, url=url, process=process, started_s=self._clock.now(), model=model
        )
        self.started[node.node_id] = started
        await self._roster.add(node)
        return started

    # -- scaling down ----------------------------------------------------------------------------

    def _victim(
        self, active: list[Started], models: tuple[plan.ModelNeed, ...], *, now: float
    ) -> tuple[Started, float] | None:
        """The own node to stop next and what it adds to capacity: an unhealthy one first,
        else the newest whose models keep their floors without it."""
        if not active:
            return None
        best: tuple[Started, float] | None = None
        for s in sorted(active, key=lambda s: s.started_s, reverse=True):
            node = self._pool.get(s.node_id)
            if node is None:
                continue
            healthy = self._pool.health.state(s.node_id, now=now) is Health.HEALTHY
            if not healthy:
                return s, 0.0
            serves = self._models(s)
            if best is None and all(
                n.current - node.weight >= n.floor - plan.EPSILON
                for n in models
                if n.model in serves
            ):
                best = (s, node.weight)
        return best

    def _drain(self, s: Started, *, now: float, reason: str) -> None:
        node = self._pool.get(s.node_id)
        s.draining_since = now
        if node is not None:
            node.admin = AdminState.DRAINING
            node.drain_started_s = now
            self._pool.notify()
        log.info(
            'autoscaler draining node=%s in_flight=%d reason="%s"',
            s.node_id,
            0 if node is None else node.in_flight,
            reason,
        )

    async def _reap(self, *, now: float) -> None:
        """Stop drained nodes; take out nodes whose process exited."""
        timeout_s = self._drain_timeout_s
        for s in list(self.started.values()):
            if s.process.returncode is not None:
                log.warning(
                    "autoscaled node exited node=%s status=%s: removed from the pool",
                    s.node_id,
                    s.process.returncode,
                )
                await self._stop(s, why="its process exited")
                continue
            if s.draining_since is None:
                continue
            node = self._pool.get(s.node_id)
            if node is None or node.in_flight == 0 or now - s.draining_since >= timeout_s:
                await self._stop(s, why="drained")

    async def _stop(self, s: Started, *, why: str) -> None:
        node = self._roster.remove(s.node_id)
        await _terminate(s.process)  # still in self.started: close() ends it if we are cancelled
        self.started.pop(s.node_id, None)
        log.info(
            "autoscaler stopped node=%s why=%s in_flight=%d",
            s.node_id,
            why,
            0 if node is None else node.in_flight,
        )


async def _terminate(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            async with asyncio.timeout(_STOP_GRACE_S):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    else:
        await process.wait()
