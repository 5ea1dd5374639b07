"""The controller replica's metrics exported over OTLP/HTTP to a real receiver in the test
(tests/support/otlp.py), beside its Prometheus ``/metrics``: a replica on real etcd leads, and
its leadership, build and window metrics arrive at ``/v1/metrics`` with the replica's resource
(service.name meridian-controller, service.version, service.instance.id = its election id)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from controlplane.app import CONTROLLER, create_app
from meridian_service import otlp, version
from tests.meridianctl.stack import settings
from tests.support import EtcdServer, until
from tests.support.metrics import Scrape
from tests.support.otlp import OtlpReceiver


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    await r.close()


async def test_a_replica_exports_its_metrics_over_otlp(
    etcd: EtcdServer, receiver: OtlpReceiver
) -> None:
    collector = await receiver.start()
    base = settings(etcd.url, "ctl-otlp")
    otel = otlp.OtlpSettings(
        endpoint=collector,
        metrics_interval_s=0.3,
        headers={"x-collector-key": "controller-key"},  # type: ignore[dict-item]
        resource_attributes={"deployment.environment.name": "test"},
    )
    app = create_app(base.model_copy(update={"otel": otel}))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        controller = app[CONTROLLER]
        await until(lambda: controller.election.leading, 10, "the replica leads")

        def leading_exported() -> bool:
            return 1 in receiver.values("meridian-controller", "meridian_controller_leader")

        await until(leading_exported, 10, "meridian_controller_leader = 1 at /v1/metrics")
        await until(lambda: controller.passes >= 2, 10, "two window passes")
        await until(
            lambda: (
                max(
                    receiver.values("meridian-controller", "meridian_controller_window_duration"),
                    default=0,
                )
                >= 2
            ),
            10,
            "the window histogram at /v1/metrics",
        )
        assert receiver.values(
            "meridian-controller", "meridian_controller_build_info", version=version.version()
        )
        point = next(p for p in receiver.points if p.metric == "meridian_controller_leader")
        assert point.resource["service.instance.id"] == "ctl-otlp"
        assert point.resource["service.version"] == version.version()
        assert point.resource["deployment.environment.name"] == "test"
        assert all(h.get("x-collector-key") == "controller-key" for _, h in receiver.requests)
        assert {path for path, _ in receiver.requests} == {"/v1/metrics"}  # no spans
        # and /metrics serves the same instruments still
        assert controller.metrics is not None
        assert Scrape(controller.metrics.render().decode()).value("meridian_controller_leader") == 1
    finally:
        await runner.cleanup()
