"""The webhook and Kubernetes actuators against HTTP servers the test runs.

No Kubernetes API server runs here, so ``ScaleServer`` implements the part the actuator uses
as the Kubernetes API reference documents it: ``GET`` and ``PATCH`` (a JSON merge patch,
``application/merge-patch+json``) of ``/apis/apps/v1/namespaces/{namespace}/deployments/{name}/
scale``, answering an ``autoscaling/v1`` ``Scale``; optimistic concurrency on
``metadata.resourceVersion`` (a patch carrying a stale one gets 409 ``Conflict``); bearer tokens
(401 ``Unauthorized`` for an unknown one, 403 ``Forbidden`` for one whose role may only read);
404 ``NotFound``; every failure a ``v1`` ``Status`` object."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from regional_agent.autoscaler import Kubernetes, Webhook
from regional_agent.autoscaler.plan import ModelNeed
from regional_agent.autoscaler.remote import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from regional_agent.errors import ActuatorError
from tests.agent.publishing import eventually
from tests.conftest import NodeFactory
from tests.support.agent import AgentFactory

PREFIX = "/apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale"


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip
    return web.json_response(body, status=code)


@dataclass
class Deployment:
    replicas: int
    version: int = 1
    kind: str = "deployments"  # or statefulsets: the same scale subresource


@dataclass
class ScaleServer:
    deployments: dict[tuple[str, str], Deployment]
    tokens: dict[str, str] = field(default_factory=lambda: {"good": "edit", "viewer": "view"})
    interfere: int = 0  # this many GETs are followed by another writer's change
    patches: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def _scale(self, ns: str, name: str, d: Deployment) -> web.Response:
        return web.json_response({
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": str(d.version)},
            "spec": {"replicas": d.replicas},
            "status": {"replicas": d.replicas, "selector": f"app={name}"},
        })  # fmt: skip

    async def handle(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        bearer = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        role = None if bearer is None else self.tokens.get(bearer)
        if role is None:
            return _status(401, "Unauthorized", "Unauthorized")
        ns, name = request.match_info["ns"], request.match_info["name"]
        kind = request.match_info["kind"]
        verb = "get" if request.method == "GET" else "patch"
        if verb == "patch" and role != "edit":
            message = (
                f'{kind}.apps "{name}" is forbidden: User '
                f'"system:serviceaccount:{ns}:meridian" cannot patch resource '
                f'"{kind}/scale" in API group "apps" in the namespace "{ns}"'
            )
            return _status(403, "Forbidden", message)
        d = self.deployments.get((ns, name))
        if d is None or d.kind != kind:
            return _status(404, "NotFound", f'{kind}.apps "{name}" not found')
        if verb == "get":
            response = self._scale(ns, name, d)
            if self.interfere > 0:
                self.interfere -= 1
                d.version += 1  # someone else wrote after this read
            return response
        if request.content_type != "application/merge-patch+json":
            return _status(415, "UnsupportedMediaType", f"the body of the request was in an "
                           f"unknown format: {request.content_type}")  # fmt: skip
        patch = json.loads(await request.read())
        self.patches.append(patch)
        version = (patch.get("metadata") or {}).get("resourceVersion")
        if version is not None and version != str(d.version):
            return _status(409, "Conflict", f'Operation cannot be fulfilled on {kind}.apps '
                           f'"{name}": the object has been modified; please apply your changes '
                           "to the latest version and try again")  # fmt: skip
        replicas = (patch.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            return _status(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
        d.replicas = replicas
        d.version += 1
        return self._scale(ns, name, d)


@asynccontextmanager
async def _served(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free loopback port, for as long as the block runs."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def scale_server() -> AsyncIterator[ScaleServer]:
    server = ScaleServer(deployments={("inference", "vllm"): Deployment(replicas=2)})
    app = web.Application()
    path = PREFIX.format(ns="{ns}", kind="{kind}", name="{name}")
    app.router.add_route("GET", path, server.handle)
    app.router.add_route("PATCH", path, server.handle)
    async with _served(app) as url:
        server.url = url
        yield server


def _kubernetes(
    server: ScaleServer, tmp_path: Path, *, token: str = "good", follow: bool = False,
    deployment: str = "vllm", kind: str = "deployments",
) -> tuple[Kubernetes, Path]:  # fmt: skip
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    actuator = Kubernetes(
        api=server.url, namespace="inference", deployment=deployment, kind=kind,
        token_file=token_file, ca_file=None, timeout_s=5.0, node_weight=1.0, follow=follow,
    )  # fmt: skip
    return actuator, token_file


async def test_kubernetes_raises_the_replicas_to_the_floor_once(
    scale_server: ScaleServer, tmp_path: Path
) -> None:
    actuator, _ = _kubernetes(scale_server, tmp_path)
    try:
        await actuator.ensure(floor=4.5, current=2.0)  # ceil: 5 replicas
        assert scale_server.deployments[("inference", "vllm")].replicas == 5
        assert scale_server.patches == [{"metadata": {"resourceVersion": "1"},
                                         "spec": {"replicas": 5}}]  # fmt: skip
        await actuator.ensure(floor=5.0, current=5.0)  # already there: read, no patch
        await actuator.ensure(floor=1.0, current=5.0)  # without the load policy: never lower
        assert len(scale_server.patches) == 1
        assert scale_server.deployments[("inference", "vllm")].replicas == 5
    finally:
        await actuator.close()


async def test_kubernetes_scales_a_statefulset_by_the_same_subresource(
    scale_server: ScaleServer, tmp_path: Path
) -> None:
    """The Terraform region module runs vLLM as a StatefulSet: kubernetes_kind = statefulsets."""
    scale_server.deployments[("inference", "vllm-sts")] = Deployment(2, kind="statefulsets")
    actuator, _ = _kubernetes(scale_server, tmp_path, deployment="vllm-sts", kind="statefulsets")
    wrong, _ = _kubernetes(scale_server, tmp_path, deployment="vllm-sts")
    try:
        await actuator.ensure(floor=3.0, current=2.0)
        assert scale_server.deployments[("inference", "vllm-sts")].replicas == 3
        with pytest.raises(ActuatorError, match=r"deployment inference/vllm-sts does not exist "
                           r"\(autoscaler.kubernetes_deployment, _kind"):  # fmt: skip
            await wrong.ensure(floor=4.0, current=3.0)
    finally:
        await actuator.close()
        await wrong.close()


async def test_kubernetes_follows_the_load_policy_down_too(
    scale_server: ScaleServer, tmp_path: Path
) -> None:
    actuator, _ = _kubernetes(scale_server, tmp_path, follow=True)
    try:
        await actuator.ensure(floor=1.0, current=2.0)
        assert scale_server.deployments[("inference", "vllm")].replicas == 1
    finally:
        await actuator.close()


async def test_kubernetes_reads_again_after_a_conflict_and_gives_up_after_three(
    scale_server: ScaleServer, tmp_path: Path
) -> None:
    actuator, _ = _kubernetes(scale_server, tmp_path)
    try:
        scale_server.interfere = 1
        await actuator.ensure(floor=3.0, current=2.0)
        assert actuator.conflicts == 1 and len(scale_server.patches) == 2
        assert scale_server.deployments[("inference", "vllm")].replicas == 3
        scale_server.interfere = 10
        with pytest.raises(ActuatorError, match="3 conflicts in a row"):
            await actuator.ensure(floor=6.0, current=3.0)
        assert scale_server.deployments[("inference", "vllm")].replicas == 3
    finally:
        await actuator.close()


@pytest.mark.parametrize(
    ("token", "deployment", "says"),
    [
        ("stale", "vllm", r"refused the service-account token.*Unauthorized"),
        (
            "viewer",
            "vllm",
            r"may not patch deployments/scale in namespace inference: grant get "
            r"and patch.*cannot patch resource",
        ),
        ("good", "missing", r"deployment inference/missing does not exist.*not found"),
    ],
)
async def test_kubernetes_401_403_404_say_what_to_fix(
    scale_server: ScaleServer, tmp_path: Path, token: str, deployment: str, says: str
) -> None:
    actuator, _ = _kubernetes(scale_server, tmp_path, token=token, deployment=deployment)
    try:
        with pytest.raises(ActuatorError, match=says):
            await actuator.ensure(floor=3.0, current=2.0)
    finally:
        await actuator.close()


async def test_kubernetes_reads_the_token_on_every_call(
    scale_server: ScaleServer, tmp_path: Path
) -> None:
    actuator, token_file = _kubernetes(scale_server, tmp_path, token="stale")
    try:
        with pytest.raises(ActuatorError, match="refused the service-account token"):
            await actuator.ensure(floor=3.0, current=2.0)
        token_file.write_text("good")  # the kubelet rotated the bound token
        await actuator.ensure(floor=3.0, current=2.0)
        assert scale_server.deployments[("inference", "vllm")].replicas == 3
    finally:
        await actuator.close()


async def test_the_agent_scales_the_deployment_to_its_floor(
    scale_server: ScaleServer,
    tmp_path: Path,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="regional_agent.autoscaler")
    (tmp_path / "token").write_text("good")
    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")],
        autoscaler={
            "actuator": "kubernetes",
            "interval_s": 0.2,
            "kubernetes_api": scale_server.url,
            "kubernetes_namespace": "inference",
            "kubernetes_deployment": "vllm",
            "kubernetes_token_file": str(tmp_path / "token"),
            "kubernetes_ca_file": None,
        },
    )
    scaler = handle.autoscaler
    assert scaler is not None and isinstance(scaler.actuator, Kubernetes)
    scaler.set_floor(4)  # as the publisher does with the controller's floor
    deployment = scale_server.deployments[("inference", "vllm")]
    await eventually(lambda: deployment.replicas == 4, what="4 replicas")
    # a failing API server is retried with backoff and reported once
    scale_server.tokens.clear()
    scaler.set_floor(6)
    await eventually(lambda: scaler.failing is not None, what="the failure reported")
    assert caplog.text.count("autoscaler actuator failed") == 1
    scale_server.tokens["good"] = "edit"
    await eventually(lambda: deployment.replicas == 6, what="6 replicas", timeout_s=30)
    assert "autoscaler actuator recovered" in caplog.text


# -- the webhook --------------------------------------------------------------------------------


@dataclass
class Hook:
    secret: bytes
    fail_first: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    bad_signatures: int = 0
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        stamp = request.headers.get(TIMESTAMP_HEADER, "")
        if request.headers.get(SIGNATURE_HEADER) != sign(self.secret, stamp, body):
            self.bad_signatures += 1
            return web.json_response({"error": "bad signature"}, status=401)
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response({"error": "busy"}, status=503)
        self.seen.append(json.loads(body))
        return web.json_response({"ok": True})


@pytest.fixture
async def hook() -> AsyncIterator[Hook]:
    h = Hook(secret=b"s3cret-key")
    app = web.Application()
    app.router.add_post("/scale", h.handle)
    async with _served(app) as url:
        h.url = f"{url}/scale"
        yield h


async def test_the_webhook_posts_a_signed_count_once_per_change(hook: Hook, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-key\n")
    actuator = Webhook(url=hook.url, secret_file=secret, timeout_s=5.0, region="eu-west",
                       node_weight=0.5)  # fmt: skip
    try:
        await actuator.ensure(floor=0.0, current=1.0)  # nothing asked yet: nothing sent
        await actuator.ensure(floor=2.0, current=1.0)
        await actuator.ensure(floor=2.0, current=4.0)
        assert [(s["region"], s["replicas"], s["floor"]) for s in hook.seen] == [
            ("eu-west", 4, 2.0)
        ]
        hook.fail_first = 1
        with pytest.raises(ActuatorError, match="answered 503"):
            await actuator.ensure(floor=3.0, current=4.0)
        await actuator.ensure(floor=3.0, current=4.0)  # the loop's retry
        assert [s["replicas"] for s in hook.seen] == [4, 6]
        secret.write_text("another key")
        with pytest.raises(ActuatorError, match="answered 401"):
            await actuator.ensure(floor=1.0, current=6.0)
        assert hook.bad_signatures == 1
    finally:
        await actuator.close()


async def test_the_webhook_says_each_models_floor_and_posts_again_when_one_changes(
    hook: Hook, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-key")
    actuator = Webhook(url=hook.url, secret_file=secret, timeout_s=5.0, region="eu-west",
                       node_weight=1.0)  # fmt: skip
    b = ModelNeed(model="B", floor=2.0, current=1.0)
    b_met = ModelNeed(model="B", floor=2.0, current=2.0)
    try:
        await actuator.ensure(floor=0.0, current=1.0, models=(b,))  # a model floor alone
        await actuator.ensure(floor=0.0, current=1.0, models=(b,))  # the same: not again
        await actuator.ensure(floor=0.0, current=2.0, models=(b_met,))  # only capacity changed
        await actuator.ensure(floor=0.0, current=2.0, models=())  # B's floor gone
    finally:
        await actuator.close()
    assert [s["models"] for s in hook.seen] == [{"B": {"floor": 2.0, "current": 1.0}}, {}]


async def test_the_agent_retries_a_failing_webhook_with_backoff(
    hook: Hook,
    tmp_path: Path,
    sim_node: NodeFactory,
    start_agent: AgentFactory,
) -> None:
    (tmp_path / "secret").write_text("s3cret-key")
    hook.fail_first = 2
    handle = await start_agent(
        [await sim_node(profile_name="cpu-tiny")],
        region={"id": "eu-west", "geo": "eu"},
        autoscaler={
            "actuator": "webhook",
            "interval_s": 0.1,
            "webhook_url": hook.url,
            "webhook_secret_file": str(tmp_path / "secret"),
        },
    )
    scaler = handle.autoscaler
    assert scaler is not None
    scaler.set_floor(3)
    await eventually(lambda: hook.seen or None, what="the webhook accepted", timeout_s=30)
    assert hook.seen[0]["replicas"] == 3 and hook.seen[0]["region"] == "eu-west"
    await asyncio.sleep(0.3)
    assert len(hook.seen) == 1  # accepted once, not again every tick


def test_actuator_settings_name_what_is_missing(tmp_path: Path) -> None:
    from regional_agent.settings import Settings

    with pytest.raises(ValueError, match=r"autoscaler\.webhook_url must be an http"):
        Settings(nodes=[], autoscaler={"actuator": "webhook"})
    with pytest.raises(ValueError, match=r"autoscaler\.webhook_secret_file must name a readable"):
        Settings(
            nodes=[],
            autoscaler={
                "actuator": "webhook",
                "webhook_url": "http://x/y",
                "webhook_secret_file": str(tmp_path / "none"),
            },
        )
    with pytest.raises(ValueError, match=r"autoscaler\.kubernetes_deployment is required"):
        Settings(nodes=[], autoscaler={"actuator": "kubernetes"})
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST is not in the environment"):
        Settings(nodes=[], autoscaler={"actuator": "kubernetes", "kubernetes_deployment": "v"})


def test_a_predictive_policy_needs_a_measured_capacity() -> None:
    from regional_agent.settings import Settings

    with pytest.raises(ValueError, match=r"autoscaler\.load\.node_capacity_rps is required"):
        Settings(nodes=[], autoscaler={"load": {"policy": "predictive"}})
    Settings(nodes=[], autoscaler={"load": {"policy": "predictive", "node_capacity_rps": 8.0}})
