"""The controller replica's metrics on ``/metrics`` of its read port (``server.port``).

OpenTelemetry's SDK with the Prometheus exporter, as the agent has them: each replica has its
own meter provider and its own Prometheus registry, so several replicas (tests, the demo) can
live in one process without mixing their numbers.  Nothing here is threaded through the
controller: gauges read the replica's state when scraped, and the counters are fed by hooks the
replica wires (:meth:`ControllerMetrics.committed` after every pass written, by the window loop
or an admin action; :meth:`~ControllerMetrics.action` for each admin action;
:meth:`~ControllerMetrics.window` for each window the loop ran).

Metrics (Prometheus names; docs/observability.md has the reference):

- ``meridian_controller_region_state{region, state}`` (1 for the region's state, 0 for the
  others), ``..._region_strikes``, ``..._region_weight``, ``..._region_capacity``,
  ``..._region_capacity_floor``, ``..._region_backup{region, backup}`` (1; ``none``) and
  ``..._region_agents_alive`` (agent replicas whose liveness key the pass read): the plan of
  the last pass this replica wrote, only while it leads;
- ``meridian_controller_geo_regions{geo, which}``: per geography, its member regions
  (``member``) and the regions the plan in force gives a share of its traffic (``serving``),
  likewise only while it leads;
- ``meridian_controller_failovers_total{region, cause}`` and
  ``meridian_controller_recoveries_total{region, cause}``: failover and recovery events of the
  passes this replica wrote;
- ``meridian_controller_window_duration_seconds`` and
  ``meridian_controller_window_lateness_seconds``: histograms of the leader's window passes;
- ``meridian_controller_leader`` (1/0), ``meridian_controller_elections_total{kind}``;
- ``meridian_controller_etcd_connected`` (1/0), ``meridian_controller_etcd_errors_total{kind}``;
- ``meridian_controller_dns_last_apply_timestamp_seconds``,
  ``meridian_controller_dns_generation{view, which}`` (``desired``, ``applied``),
  ``meridian_controller_dns_update_errors_total{kind}``;
- ``meridian_controller_admin_actions_total{verb, result}``;
- ``meridian_controller_probes_total{region, result}`` (``reached``, ``failed``): this replica's
  probes of regions' endpoints, and ``meridian_controller_probe_reached{region}`` (1/0): whether
  its last round reached the region (with ``probe.enabled``; every replica, leader or not);
- ``meridian_controller_build_info{version}`` (1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import get_args

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from prometheus_client import CollectorRegistry, generate_latest

from controlplane.dns.steering import DnsStats
from controlplane.reconcile.windows import Prepared
from meridian_service import otlp, version
from meridian_service.metrics import by_label, labelled
from meridian_wire.models import ProbeReport
from policies.failover import RegionState, Verdict

STATES: tuple[str, ...] = get_args(RegionState)
_WINDOW_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

Callback = Callable[[CallbackOptions], Iterable[Observation]]


# Every label value a counter can take, exported at 0 before its first event, so that
# increase() and rate() see the first failover, error or action (a series that appears with
# the value 1 has no increase to show).  Region-labelled counters start at 0 for the regions in
# the controller's settings.
FAILOVER_CAUSES = ("health", "manual", "drain", "backup_changed")
RECOVERY_CAUSES = ("health", "failback", "undrain")
ELECTION_KINDS = ("new", "resumed")
ETCD_ERROR_KINDS = ("unavailable", "token_expired", "lease_lost", "fenced", "refused")
DNS_ERROR_KINDS = ("unavailable", "refused", "failed", "etcd", "error")
ACTION_VERBS = ("drain", "undrain", "failover", "failback", "policies")
ACTION_RESULTS = ("applied", "dry-run", "refused", "error", "replayed")


def failover_cause(before: Verdict | None, after: Verdict) -> str:
    """Why a region's traffic moved to its backup: ``manual`` (an operator's failover),
    ``drain``, ``health`` (its windows failed), or ``backup_changed`` (still below full weight,
    its traffic moves to another backup)."""
    if after.manual:
        return "manual"
    if after.state == "drained":
        return "drain"
    if after.weight <= 0 and (before is None or before.weight > 0):
        return "health"
    return "backup_changed"


def recovery_cause(before: Verdict | None) -> str:
    """Why a region's weight rose: ``undrain``, ``failback`` (the end of a manual failover)
    or ``health`` (good windows: the ramp)."""
    if before is not None and before.state == "drained":
        return "undrain"
    if before is not None and before.manual:
        return "failback"
    return "health"


class ControllerMetrics:
    def __init__(
        self,
        *,
        leading: Callable[[], bool],
        etcd_ok: Callable[[], bool],
        etcd_failures: Mapping[str, int],
        elections: Mapping[str, int],
        dns: DnsStats,
        otel: otlp.OtlpSettings | None = None,
        instance: str = "meridian-controller",
        regions: Iterable[str] = (),
    ) -> None:
        otel = otel or otlp.OtlpSettings()
        # OTLP export (docs/observability.md#otlp): a periodic reader beside the Prometheus one
        self.export = otlp.Export(otel, what="meridian-controller") if otel.endpoint else None
        self.registry = CollectorRegistry()
        reader = PrometheusMetricReader(disable_target_info=True, registry=self.registry)
        readers: list[MetricReader] = [reader]
        if self.export is not None and self.export.metric_reader is not None:
            readers.append(self.export.metric_reader)
        views = [
            View(
                instrument_name=name,
                aggregation=ExplicitBucketHistogramAggregation(boundaries=_WINDOW_BUCKETS_S),
            )
            for name in (
                "meridian_controller_window_duration",
                "meridian_controller_window_lateness",
            )
        ]
        resource = otlp.resource(otel, service="meridian-controller", instance=instance)
        self._meters = MeterProvider(metric_readers=readers, resource=resource, views=views)
        meter = self._meters.get_meter("meridian.controller")
        self._leading = leading
        self._verdicts: Mapping[str, Verdict] = {}
        self._capacity: dict[str, float] = {}
        self._agents_alive: dict[str, int] = {}
        self._geos: dict[tuple[str, str], int] = {}  # (geo, member|serving) -> regions
        regions = sorted(set(regions))
        self._failovers: Counter[tuple[str, ...]] = Counter(
            {(r, c): 0 for r in regions for c in FAILOVER_CAUSES}
        )
        self._recoveries: Counter[tuple[str, ...]] = Counter(
            {(r, c): 0 for r in regions for c in RECOVERY_CAUSES}
        )
        self._actions: Counter[tuple[str, ...]] = Counter(
            {(v, r): 0 for v in ACTION_VERBS for r in ACTION_RESULTS}
        )
        self._probes: Counter[tuple[str, ...]] = Counter()
        self._reached: dict[str, int] = {}

        def per_region(value: Callable[[Verdict], float]) -> Callback:
            def cb(_: CallbackOptions) -> Iterable[Observation]:
                if not leading():
                    return []
                return [Observation(value(v), {"region": r}) for r, v in self._verdicts.items()]

            return cb

        def states(_: CallbackOptions) -> Iterable[Observation]:
            if not leading():
                return []
            return [
                Observation(1 if v.state == s else 0, {"region": r, "state": s})
                for r, v in self._verdicts.items()
                for s in STATES
            ]

        def backups(_: CallbackOptions) -> Iterable[Observation]:
            if not leading():
                return []
            return [
                Observation(1, {"region": r, "backup": v.backup or "none"})
                for r, v in self._verdicts.items()
            ]

        def capacity(_: CallbackOptions) -> Iterable[Observation]:
            if not leading():
                return []
            return [Observation(c, {"region": r}) for r, c in self._capacity.items()]

        meter.create_observable_gauge(
            "meridian_controller_region_state",
            callbacks=[states],
            description="1 for the region's state (healthy, suspect, failed, recovering, "
            "drained), 0 for the others; exported by the leader.",
        )
        meter.create_observable_gauge(
            "meridian_controller_region_strikes",
            callbacks=[per_region(lambda v: v.strikes)],
            description="Consecutive failed health windows of the region (0..strikes).",
        )
        meter.create_observable_gauge(
            "meridian_controller_region_weight",
            callbacks=[per_region(lambda v: v.weight)],
            description="Share of its own traffic the region keeps (0..1); the rest goes to "
            "its backup.",
        )
        meter.create_observable_gauge(
            "meridian_controller_region_capacity",
            callbacks=[capacity],
            description="Capacity the region's agents report (node-equivalents).",
        )
        meter.create_observable_gauge(
            "meridian_controller_region_capacity_floor",
            callbacks=[per_region(lambda v: v.capacity_floor)],
            description="Capacity the region keeps warm for the regions it backs up.",
        )
        meter.create_observable_gauge(
            "meridian_controller_region_backup",
            callbacks=[backups],
            description="1 for the region's backup (none: it has no backup).",
        )

        def agents_alive(_: CallbackOptions) -> Iterable[Observation]:
            if not leading():
                return []
            return [Observation(n, {"region": r}) for r, n in self._agents_alive.items()]

        def geos(_: CallbackOptions) -> Iterable[Observation]:
            if not leading():
                return []
            return [
                Observation(n, {"geo": geo, "which": which})
                for (geo, which), n in self._geos.items()
            ]

        meter.create_observable_gauge(
            "meridian_controller_region_agents_alive",
            callbacks=[agents_alive],
            description="Agent replicas of the region whose liveness key the last pass read.",
        )
        meter.create_observable_gauge(
            "meridian_controller_geo_regions",
            callbacks=[geos],
            description="Per geography, its member regions (which=member) and the regions "
            "the plan in force gives a share of its traffic (which=serving).",
        )
        meter.create_observable_counter(
            "meridian_controller_failovers",
            callbacks=[labelled(self._failovers, ("region", "cause"))],
            description="Failover events written by this replica, by region and cause "
            "(health, manual, drain, backup_changed).",
        )
        meter.create_observable_counter(
            "meridian_controller_recoveries",
            callbacks=[labelled(self._recoveries, ("region", "cause"))],
            description="Recovery events (a weight increase) written by this replica, by "
            "region and cause (health, failback, undrain).",
        )
        self._window_duration = meter.create_histogram(
            "meridian_controller_window_duration",
            unit="s",
            description="Time one window pass took (read, plan, write).",
        )
        self._window_lateness = meter.create_histogram(
            "meridian_controller_window_lateness",
            unit="s",
            description="How much later than planned a window pass started.",
        )
        meter.create_observable_gauge(
            "meridian_controller_leader",
            callbacks=[lambda _: [Observation(1 if leading() else 0)]],
            description="1 while this replica leads, else 0.",
        )
        meter.create_observable_counter(
            "meridian_controller_elections",
            callbacks=[by_label(elections, ELECTION_KINDS)],
            description="Times this replica began leading: new (won the leader key) or "
            "resumed (kept it through an etcd outage).",
        )
        meter.create_observable_gauge(
            "meridian_controller_etcd_connected",
            callbacks=[lambda _: [Observation(1 if etcd_ok() else 0)]],
            description="1 when etcd answered this replica's last calls, else 0.",
        )
        meter.create_observable_counter(
            "meridian_controller_etcd_errors",
            callbacks=[by_label(etcd_failures, ETCD_ERROR_KINDS)],
            description="etcd calls that failed, by kind (unavailable, token_expired, "
            "lease_lost, fenced, refused).",
        )

        def applied_at(_: CallbackOptions) -> Iterable[Observation]:
            at = dns.applied_at
            return [] if at is None else [Observation(at)]

        def generations(_: CallbackOptions) -> Iterable[Observation]:
            out = [Observation(g, {"view": v, "which": "desired"}) for v, g in dns.desired.items()]
            out += [Observation(g, {"view": v, "which": "applied"}) for v, g in dns.applied.items()]
            return out

        meter.create_observable_gauge(
            "meridian_controller_dns_last_apply_timestamp",
            unit="s",
            callbacks=[applied_at],
            description="Unix time of the last DNS pass that left every view serving the "
            "plan (sent the difference, or found none).",
        )
        meter.create_observable_gauge(
            "meridian_controller_dns_generation",
            callbacks=[generations],
            description="Per DNS view, the plan generation desired and the one it serves.",
        )
        meter.create_observable_counter(
            "meridian_controller_dns_update_errors",
            callbacks=[by_label(dns.errors, DNS_ERROR_KINDS)],
            description="Failed DNS passes, by kind (unavailable, refused, failed, etcd, error).",
        )
        meter.create_observable_counter(
            "meridian_controller_admin_actions",
            callbacks=[labelled(self._actions, ("verb", "result"))],
            description="Admin API actions run by this replica (as leader), by verb (drain, "
            "undrain, failover, failback, policies) and result (applied, dry-run, refused, "
            "error, replayed).",
        )
        meter.create_observable_counter(
            "meridian_controller_probes",
            callbacks=[labelled(self._probes, ("region", "result"))],
            description="This replica's probes of regions' published endpoints, by region and "
            "result (reached, failed).",
        )
        meter.create_observable_gauge(
            "meridian_controller_probe_reached",
            callbacks=[lambda _: [Observation(v, {"region": r}) for r, v in self._reached.items()]],
            description="1 when this replica's last probe round reached the region (any of "
            "its endpoints answered), else 0.",
        )
        build = version.version()
        meter.create_observable_gauge(
            "meridian_controller_build_info",
            callbacks=[lambda _: [Observation(1, {"version": build})]],
            description="1, labelled with the installed Meridian version.",
        )

    # -- hooks -----------------------------------------------------------------------------------

    def committed(self, prepared: Prepared) -> None:
        """A pass was written (a window or an admin action): its plan, and its failovers and
        recoveries."""
        before, after = prepared.previous.verdicts, prepared.result.state.verdicts
        self._verdicts = {str(r): v for r, v in after.items()}
        self._capacity = {
            r: record.status.capacity
            for r, record in prepared.view.regions.items()
            if record.status is not None and r in after
        }
        regions = prepared.view.regions
        self._agents_alive = {
            r: sum(a.alive for a in regions[r].agents.values()) if r in regions else 0
            for r in self._verdicts
        }
        geos: dict[tuple[str, str], int] = {}
        for info in prepared.topology.regions.values():
            geos[(info.geo, "member")] = geos.get((info.geo, "member"), 0) + 1
            geos.setdefault((info.geo, "serving"), 0)
        for geo, shares in prepared.result.state.serving.items():
            geos[(geo, "serving")] = sum(1 for share in shares.values() if share > 0)
        self._geos = geos
        for event in prepared.result.events:
            region = event.region
            if region is None or region not in after:
                continue
            if event.kind == "failover":
                cause = failover_cause(before.get(region), after[region])
                self._failovers[(region, cause)] += 1
            elif event.kind == "recovery":
                self._recoveries[(region, recovery_cause(before.get(region)))] += 1

    def probed(self, report: ProbeReport) -> None:
        """One probe round of this replica ended."""
        reached = {}
        for region, probes in report.regions.items():
            for p in probes:
                self._probes[(region, "reached" if p.ok else "failed")] += 1
            reached[region] = int(any(p.ok for p in probes))
        self._reached = reached

    def window(self, *, duration_s: float, lateness_s: float) -> None:
        self._window_duration.record(max(0.0, duration_s))
        self._window_lateness.record(max(0.0, lateness_s))

    def action(self, verb: str, result: str) -> None:
        self._actions[(verb, result)] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Stop the meter provider; with OTLP export, a last export first, for
        ``otel.timeout_s`` at most.  Blocking: the app calls it on a thread."""
        if self.export is not None:
            self.export.shutdown(tracers=None, meters=self._meters)
            return
        self._meters.shutdown()
