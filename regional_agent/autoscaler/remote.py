"""Actuators that hand the count to someone else over HTTP: a webhook, and Kubernetes.

=========== ===================================================================================
webhook     POSTs ``{"region", "floor", "current", "replicas", "models", "sent_at"}`` as JSON
            to ``autoscaler.webhook_url`` when the count or a model's floor changes (``models``:
            each model's ``{"floor", "current"}``, for a receiver that runs a pool per model),
            signed: ``X-Meridian-Signature:
            sha256=HEX``, the HMAC-SHA256 of ``"{X-Meridian-Timestamp}.{body}"`` with the secret
            in ``autoscaler.webhook_secret_file`` (the receiver recomputes it and refuses old
            timestamps).  Any 2xx is accepted; anything else is retried by the loop with backoff.
kubernetes  reads and patches the ``scale`` subresource of the vLLM Deployment or StatefulSet
            (``GET``/``PATCH /apis/apps/v1/namespaces/NS/KIND/NAME/scale``, a JSON merge
            patch carrying the ``resourceVersion`` it read, so a concurrent writer gets a 409 and
            it reads again) with the pod's service-account token, re-read on every call (bound
            tokens rotate).  With ``autoscaler.load`` off it only raises the replicas to the
            floor; with it on it sets them to the policy's count.  401, 403 and 404 say what to
            fix (the RBAC it needs is in docs/autoscaling.md).
=========== ===================================================================================

Both count replicas as ``ceil(floor / autoscaler.node_weight)``, of the floor the autoscaler
raised to cover the shortfall of the models their nodes serve (``autoscaler.models``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import ssl
import time
from pathlib import Path
from typing import Any

import httpx

from regional_agent.autoscaler.plan import ModelNeed
from regional_agent.errors import ActuatorError

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Meridian-Signature"
TIMESTAMP_HEADER = "X-Meridian-Timestamp"
_CONFLICT_TRIES = 3


def replicas_for(floor: float, node_weight: float) -> int:
    return max(0, math.ceil(floor / node_weight - 1e-9))


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """The webhook's signature header value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ActuatorError(f"{what}: cannot read {path}: {exc.strerror or exc}") from exc


class Webhook:
    name = "webhook"
    per_model = False

    def __init__(
        self,
        *,
        url: str,
        secret_file: Path,
        timeout_s: float,
        region: str | None,
        node_weight: float,
    ) -> None:
        self._url = url
        self._secret_file = secret_file
        self._region = region or ""
        self._node_weight = node_weight
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
        self.applied: int | None = None  # the replicas the last accepted call handed over
        self._models: tuple[tuple[str, float], ...] = ()  # and the model floors
        self.calls = 0

    async def ensure(
        self, *, floor: float, current: float, models: tuple[ModelNeed, ...] = ()
    ) -> None:
        replicas = replicas_for(floor, self._node_weight)
        floors = tuple((n.model, n.floor) for n in models)
        if (replicas == self.applied and floors == self._models) or (
            self.applied is None and floor == 0 and not floors
        ):
            return
        secret = _read(self._secret_file, "autoscaler.webhook_secret_file").encode()
        payload = {
            "region": self._region,
            "floor": floor,
            "current": current,
            "replicas": replicas,
            "models": {n.model: {"floor": n.floor, "current": n.current} for n in models},
            "sent_at": time.time(),
        }
        body = json.dumps(payload, separators=(",", ":")).encode()
        stamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: stamp,
            SIGNATURE_HEADER: sign(secret, stamp, body),
        }
        self.calls += 1
        try:
            response = await self._client.post(self._url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise ActuatorError(f"autoscaler webhook {self._url}: {exc!r}") from exc
        if not 200 <= response.status_code < 300:
            raise ActuatorError(
                f"autoscaler webhook {self._url} answered {response.status_code}: "
                f"{response.text[:300] or '(no body)'}"
            )
        log.info(
            "autoscaler webhook accepted replicas=%d floor=%g current=%g previous=%s",
            replicas,
            floor,
            current,
            self.applied,
        )
        self.applied, self._models = replicas, floors

    def pending(self) -> int:
        return 0

    async def close(self) -> None:
        await self._client.aclose()


class Kubernetes:
    name = "kubernetes"
    per_model = False

    def __init__(
        self,
        *,
        api: str,
        namespace: str,
        deployment: str,
        kind: str = "deployments",
        token_file: Path,
        ca_file: Path | None,
        timeout_s: float,
        node_weight: float,
        follow: bool,
    ) -> None:
        self._path = f"/apis/apps/v1/namespaces/{namespace}/{kind}/{deployment}/scale"
        self._kind = kind
        self._where = f"{kind.removesuffix('s')} {namespace}/{deployment}"
        self._namespace = namespace
        self._token_file = token_file
        self._node_weight = node_weight
        self._follow = follow
        verify: ssl.SSLContext | bool = True
        if ca_file is not None and api.startswith("https://"):
            verify = ssl.create_default_context(cafile=str(ca_file))
        self._client = httpx.AsyncClient(
            base_url=api.rstrip("/"), timeout=timeout_s, verify=verify, follow_redirects=False
        )
        self.applied: int | None = None
        self.patches = 0
        self.conflicts = 0

    def _headers(self) -> dict[str, str]:
        token = _read(self._token_file, "autoscaler.kubernetes_token_file")
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    def _fail(self, verb: str, response: httpx.Response) -> ActuatorError:
        try:
            status: Any = response.json()
            message = status.get("message") if isinstance(status, dict) else None
        except ValueError:
            message = None
        detail = message or response.text[:300] or "(no body)"
        code = response.status_code
        if code == 401:
            hint = "the API server refused the service-account token (is it mounted and current?)"
        elif code == 403:
            hint = (
                f"the service account may not {verb} {self._kind}/scale in namespace "
                f"{self._namespace}: grant get and patch on {self._kind}/scale "
                "(docs/autoscaling.md)"
            )
        elif code == 404:
            hint = (
                f"{self._where} does not exist (autoscaler.kubernetes_deployment, _kind, "
                "_namespace)"
            )
        else:
            hint = f"the API server answered {code}"
        return ActuatorError(f"kubernetes {verb} {self._where}/scale: {hint}: {detail}")

    async def _get(self) -> tuple[int, str]:
        try:
            r = await self._client.get(self._path, headers=self._headers())
        except httpx.HTTPError as exc:
            raise ActuatorError(f"kubernetes get {self._where}/scale: {exc!r}") from exc
        if r.status_code != 200:
            raise self._fail("get", r)
        scale = r.json()
        try:
            return int(scale["spec"].get("replicas", 0)), str(scale["metadata"]["resourceVersion"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ActuatorError(
                f"kubernetes get {self._where}/scale: not a Scale object: {r.text[:300]}"
            ) from exc

    async def ensure(
        self, *, floor: float, current: float, models: tuple[ModelNeed, ...] = ()
    ) -> None:
        wanted = replicas_for(floor, self._node_weight)
        if floor == 0 and self.applied is None:
            return  # no floor read yet, no load policy: nothing asked
        for _ in range(_CONFLICT_TRIES):
            replicas, version = await self._get()
            target = wanted if self._follow else max(replicas, wanted)
            if target == replicas:
                self.applied = replicas
                return
            body = {"metadata": {"resourceVersion": version}, "spec": {"replicas": target}}
            headers = {**self._headers(), "Content-Type": "application/merge-patch+json"}
            self.patches += 1
            try:
                r = await self._client.patch(self._path, content=json.dumps(body), headers=headers)
            except httpx.HTTPError as exc:
                raise ActuatorError(f"kubernetes patch {self._where}/scale: {exc!r}") from exc
            if r.status_code == 409:
                self.conflicts += 1
                log.info(
                    "autoscaler kubernetes conflict on %s (resourceVersion %s changed): "
                    "reading it again",
                    self._where,
                    version,
                )
                continue
            if r.status_code != 200:
                raise self._fail("patch", r)
            log.info(
                "autoscaler kubernetes scaled %s replicas=%d from=%d floor=%g current=%g",
                self._where,
                target,
                replicas,
                floor,
                current,
            )
            self.applied = target
            return
        raise ActuatorError(
            f"kubernetes patch {self._where}/scale: {_CONFLICT_TRIES} conflicts in a row "
            "(another writer keeps changing it); retrying with backoff"
        )

    def pending(self) -> int:
        return 0

    async def close(self) -> None:
        await self._client.aclose()
