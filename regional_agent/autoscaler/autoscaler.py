"""The autoscaler's loop: hands the capacity floor and the region's healthy capacity to the
actuator every ``autoscaler.interval_s``, and at once when the floor changes.

The floor comes from the controller, through the publisher (``regions/<r>/desired``); until
one is read it is 0 and no actuator does anything.  With ``autoscaler.load.policy`` set, the
region's own load raises it: every tick the loop measures the serving nodes, their mean KV-cache
use (from the scrapes), the requests waiting (the central queue and the engines') and the
arrival rate, asks ``policies.autoscaling.decide`` for a node count, and hands the actuator the
larger of the controller's floor and that count times ``autoscaler.node_weight``.  Each decision
that changes the count is logged with its reason.

The controller's per-model floors (``model_floors``: what the region keeps warm of each model
for the regions it backs up) go to the actuator with each model's serving capacity.  One that
brings one kind of node gets the floor raised by the largest shortfall among the models its
nodes serve (``autoscaler.models``; every model when empty); a model they do not serve is
logged as unmet once.  The simulator actuator starts nodes of the short model itself.

An actuator that fails is logged once and retried with backoff; the agent keeps serving either
way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from typing import Any, Protocol

from meridian_service.clock import Clock
from policies import autoscaling
from regional_agent.autoscaler import plan
from regional_agent.autoscaler.actuators import Actuator, Command, DryRun
from regional_agent.autoscaler.remote import Kubernetes, Webhook
from regional_agent.autoscaler.simulator_actuator import SimulatorActuator
from regional_agent.errors import ActuatorError
from regional_agent.nodes import NodePool, capacity_by_model
from regional_agent.retry import Backoff
from regional_agent.roster import Roster
from regional_agent.settings import AutoscalerSettings

log = logging.getLogger(__name__)

_RETRY_MAX_S = 60.0


class Demand(Protocol):
    """The requests the load policy reads: ``demand()`` gives those waiting in the agent's
    queue now and those that have arrived so far (a running count: its rate is the arrival
    rate).  The dispatcher's; with several workers, every worker's summed
    (``WorkerRuntime.demand``)."""

    def demand(self) -> tuple[int, int]: ...


class Autoscaler:
    def __init__(
        self,
        *,
        actuator: Actuator,
        settings: AutoscalerSettings,
        pool: NodePool,
        clock: Clock,
        rng: random.Random,
        demand: Demand | None = None,
    ) -> None:
        self._pool = pool
        self._demand = demand
        self._clock = clock
        self.actuator = actuator
        self._settings = settings
        self._backoff = Backoff(
            base_s=settings.interval_s, max_s=max(_RETRY_MAX_S, settings.interval_s), rng=rng
        )
        self.floor = 0.0  # the controller's
        self.model_floors: dict[str, float] = {}  # the controller's, per model
        self.unmet: tuple[str, ...] = ()  # models short that the actuator's nodes do not serve
        self._wake = asyncio.Event()
        self.failing: str | None = None  # the error the last ensure() met, if it failed
        load = settings.load
        self._load = None if load.policy == "off" else load.config()
        self._load_state = autoscaling.State()
        self.decision: autoscaling.Decision | None = None  # the load policy's last
        self.last_signals: autoscaling.Signals | None = None  # what that decision read
        self.last_change: tuple[float, autoscaling.Decision] | None = None  # its last up/down
        self.target: float | None = None  # the floor last handed to the actuator
        self.load_target: int | None = None  # the node count its last up or down asked for
        self._arrivals: tuple[float, int] | None = None  # (when, arrivals then)
        # with a publisher, only the replica holding regions/<r>/agents/_autoscaler acts
        self.acting = True
        self.actor: str | None = None  # the replica that does, when another one

    def set_floor(self, floor: float, model_floors: dict[str, float] | None = None) -> None:
        models = {m: f for m, f in (model_floors or {}).items() if f > 0}
        if floor != self.floor or models != self.model_floors:
            log.info(
                "capacity floor changed from=%g to=%g model_floors=%s actuator=%s current=%g",
                self.floor,
                floor,
                ",".join(f"{m}={f:g}" for m, f in sorted(models.items())) or "none",
                self.actuator.name,
                self.current(),
            )
            self.floor, self.model_floors = floor, models
            self._wake.set()

    def set_acting(self, acting: bool, actor: str | None) -> None:
        if acting and not self.acting:  # taking over: what it knew is another replica's past
            self._load_state = autoscaling.State()
            self._arrivals = None
            self.load_target = None
            if isinstance(self.actuator, Webhook | Kubernetes):
                self.actuator.applied = None
        self.acting, self.actor = acting, None if acting else actor
        if acting:
            self._wake.set()

    def current(self) -> float:
        """The region's healthy capacity: the weights of active, healthy nodes summed."""
        return sum(v.weight for v in self._pool.serving(now=self._clock.now()))

    def current_by_model(self) -> dict[str, float]:
        """Each model's healthy capacity: the weights of active, healthy nodes serving it."""
        return capacity_by_model(self._pool.serving(now=self._clock.now()))

    def needs(self) -> tuple[plan.ModelNeed, ...]:
        """Each model the controller asks a floor of, with its capacity now."""
        if not self.model_floors:
            return ()
        return plan.needs(self.model_floors, self.current_by_model())

    def signals(self) -> autoscaling.Signals:
        """The region's load now, as the load policy reads it."""
        now = self._clock.now()
        serving = self._pool.serving(now=now)
        kvs = [v.telemetry.kv_util for v in serving if v.telemetry is not None]
        waiting = sum(v.queue_depth or 0 for v in serving)
        queue = waiting
        rate: float | None = None
        if self._demand is not None:
            queued, count = self._demand.demand()
            queue += queued
            # a sample spans at least half a tick: a tick woken early (the floor changed) would
            # count a few milliseconds' arrivals, and the forecast's trend divides by the span
            if self._arrivals is None:
                self._arrivals = (now, count)
            elif now - self._arrivals[0] >= self._settings.interval_s / 2:
                rate = (count - self._arrivals[1]) / (now - self._arrivals[0])
                self._arrivals = (now, count)
        load = self._settings.load
        return autoscaling.Signals(
            now=now,
            serving=len(serving),
            # what was asked and does not serve yet is on its way, as far as the agent can tell
            # (a Deployment's starting pods): counted so an "up" does not ask for less
            pending=max(
                self.actuator.pending(),
                0 if self.load_target is None else self.load_target - len(serving),
            ),
            kv_util=sum(kvs) / len(kvs) if kvs else None,
            queue=queue,
            arrival_rps=rate,
            node_capacity_rps=load.node_capacity_rps,
            floor_nodes=math.ceil(self.floor / self._settings.node_weight - 1e-9),
            horizon_s=load.provision_delay_s + self._settings.interval_s,
        )

    def effective_floor(self) -> float:
        """The controller's floor, raised by the load policy's node count when it has one."""
        if self._load is None:
            return self.floor
        signals = self.signals()
        decision, self._load_state = autoscaling.decide(self._load, self._load_state, signals)
        previous = self.decision
        self.decision, self.last_signals = decision, signals
        # a hold keeps the count the last step asked for: the actuator may still be on its way
        # there (a stop waits autoscaler.scale_down_delay_s), and a node lost meanwhile is one
        # to replace, not a new count
        if self.load_target is None or decision.kind == "down":
            self.load_target = decision.target
        elif decision.kind == "up":
            self.load_target = max(self.load_target, decision.target)
        if decision.kind != "hold":
            self.last_change = (signals.now, decision)
        if decision.kind != "hold" or previous is None:
            log.info(
                "autoscaler load policy=%s decision=%s target=%d serving=%d pending=%d "
                "kv_util=%s queue=%d arrival_rps=%s reason=%r",
                self._load.mode,
                decision.kind,
                decision.target,
                signals.serving,
                signals.pending,
                "unknown" if signals.kv_util is None else f"{signals.kv_util:.2f}",
                signals.queue,
                "unknown" if signals.arrival_rps is None else f"{signals.arrival_rps:.2f}",
                decision.reason,
            )
        return max(self.floor, self.load_target * self._settings.node_weight)

    def describe(self) -> dict[str, Any]:
        """What ``GET /admin/autoscaler`` shows: who acts, the floors, the load policy's last
        decision with its reason and the signals it read, and the actuator's last error."""
        decision, signals = self.decision, self.last_signals
        forecast = self._load_state.forecast

        def shown(d: autoscaling.Decision) -> dict[str, Any]:
            return {
                "kind": d.kind,
                "target_nodes": d.target,
                "reason": d.reason,
                "reactive_nodes": d.reactive,
                "predictive_nodes": d.predictive,
            }

        return {
            "actuator": self.actuator.name,
            "acting": self.acting,
            "actor": self.actor,
            "policy": "off" if self._load is None else self._load.mode,
            "floor": self.floor,
            "model_floors": [
                {"model": n.model, "floor": n.floor, "current": n.current, "short": n.short}
                for n in self.needs()
            ],
            "unmet_models": list(self.unmet),
            "target": self.target,
            "capacity": self.current(),
            "pending": self.actuator.pending(),
            "load_target_nodes": self.load_target,
            "decision": None if decision is None else shown(decision),
            "last_change": None
            if self.last_change is None
            else {
                **shown(self.last_change[1]),
                "age_s": round(self._clock.now() - self.last_change[0], 3),
            },
            "signals": None
            if signals is None
            else {
                "serving": signals.serving,
                "pending": signals.pending,
                "kv_util": signals.kv_util,
                "queue": signals.queue,
                "arrival_rps": signals.arrival_rps,
                "floor_nodes": signals.floor_nodes,
            },
            "forecast_rps": None
            if forecast is None
            else {
                "level": forecast.level,
                "trend_per_s": forecast.trend,
                "ahead": None if signals is None else forecast.ahead(signals.horizon_s),
                "horizon_s": None if signals is None else signals.horizon_s,
            },
            "failing": self.failing,
        }

    async def run(self) -> None:
        while True:
            self._wake.clear()
            if not self.acting:  # another replica acts for the region
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._settings.interval_s):
                        await self._wake.wait()
                continue
            try:
                floor, current, models = self.effective_floor(), self.current(), self.needs()
                if not self.actuator.per_model:
                    floor, unmet = plan.raised(
                        floor=floor,
                        current=current,
                        models=models,
                        serves=frozenset(self._settings.models),
                    )
                    self._say_unmet(unmet, models)
                self.target = floor
                await self.actuator.ensure(floor=floor, current=current, models=models)
            except ActuatorError as exc:
                if self.failing is None:
                    log.warning(
                        "autoscaler actuator failed actuator=%s floor=%g error=%s: retrying "
                        "with backoff",
                        self.actuator.name,
                        floor,
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

    def _say_unmet(self, unmet: tuple[str, ...], models: tuple[plan.ModelNeed, ...]) -> None:
        if unmet == self.unmet:
            return
        self.unmet = unmet
        for n in models:
            if n.model in unmet:
                log.warning(
                    "autoscaler cannot meet model %s's floor=%g (current=%g): the nodes the %s "
                    "actuator brings serve %s (autoscaler.models)",
                    n.model,
                    n.floor,
                    n.current,
                    self.actuator.name,
                    ", ".join(self._settings.models),
                )

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
    demand: Demand | None = None,
) -> Autoscaler | None:
    """The autoscaler ``settings`` ask for; ``None`` for ``actuator = "none"``.  ``demand``: the
    requests queued and arrived that its load policy reads."""
    actuator: Actuator
    if settings.actuator == "none":
        return None
    if settings.actuator == "dry-run":
        actuator = DryRun()
    elif settings.actuator == "command":
        actuator = Command(
            argv=settings.command, timeout_s=settings.command_timeout_s, region=region
        )
    elif settings.actuator == "webhook":
        assert settings.webhook_url is not None and settings.webhook_secret_file is not None
        actuator = Webhook(
            url=settings.webhook_url,
            secret_file=settings.webhook_secret_file,
            timeout_s=settings.request_timeout_s,
            region=region,
            node_weight=settings.node_weight,
        )
    elif settings.actuator == "kubernetes":
        api, namespace = settings.kubernetes_api_url(), settings.kubernetes_namespace_name()
        assert api is not None and namespace is not None and settings.kubernetes_deployment
        actuator = Kubernetes(
            api=api,
            namespace=namespace,
            deployment=settings.kubernetes_deployment,
            kind=settings.kubernetes_kind,
            token_file=settings.kubernetes_token_file,
            ca_file=settings.kubernetes_ca(),
            timeout_s=settings.request_timeout_s,
            node_weight=settings.node_weight,
            follow=settings.load.policy != "off",
        )
    else:
        actuator = SimulatorActuator(
            settings=settings, pool=pool, roster=roster, clock=clock,
            drain_timeout_s=drain_timeout_s,
        )  # fmt: skip
    return Autoscaler(
        actuator=actuator,
        settings=settings,
        pool=pool,
        clock=clock,
        rng=rng,
        demand=demand,
    )
