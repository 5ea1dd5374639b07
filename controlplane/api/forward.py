"""Writes received by a follower, forwarded to the leader's admin API as they came.

The controller's only HTTP client (an import-linter contract keeps it so).  The follower has
authenticated the caller already; the leader authenticates again, runs the write fenced, and
its answer is relayed unchanged.  A request forwarded once is never forwarded again: one that
reaches a replica that no longer leads is answered 503 (retry).
"""

from __future__ import annotations

import contextlib
import ssl

import aiohttp
import pydantic
from aiohttp import web

from controlplane.api import keys as api_keys
from controlplane.api.models import AdminEndpoint
from controlplane.api.problems import Unavailable
from controlplane.replica import Replica
from controlplane.settings import ControllerSettings
from meridian_wire import keys

FORWARDED = "X-Meridian-Forwarded-By"
LEADER_HEADER = "X-Meridian-Leader"


class Forwarder:
    def __init__(self, *, replica: Replica, settings: ControllerSettings) -> None:
        self._replica = replica
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.api.forward_timeout_s),
            connector=aiohttp.TCPConnector(ssl=_client_tls(settings)),
        )

    async def close(self) -> None:
        await self._session.close()

    async def forward(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        me = self._replica.election.identity
        if request.headers.get(FORWARDED):
            raise Unavailable(
                "this replica no longer leads (leadership moved while forwarding); "
                "nothing was changed",
                fix="retry in a few seconds",
            )
        leader_entry = await self._replica.store.get(keys.LEADER)
        endpoint_entry = await self._replica.store.get(api_keys.ADMIN)
        if leader_entry is None:
            raise Unavailable(
                "no controller leads right now; nothing was changed",
                fix="retry in a few seconds (a leader is elected within one lease TTL)",
            )
        leader = leader_entry.value.decode()
        endpoint = None
        if endpoint_entry is not None:
            with contextlib.suppress(pydantic.ValidationError):
                endpoint = AdminEndpoint.model_validate_json(endpoint_entry.value)
        if endpoint is None or endpoint.id != leader:
            raise Unavailable(
                f"the leader {leader} has not published its admin URL yet; nothing was changed",
                fix="retry in a few seconds",
            )
        headers = {FORWARDED: me}
        for name in ("Authorization", "Idempotency-Key", "Content-Type"):
            if name in request.headers:
                headers[name] = request.headers[name]
        try:
            async with self._session.request(
                request.method, endpoint.url + request.path_qs, data=raw or None, headers=headers
            ) as upstream:
                body = await upstream.read()
                out = web.Response(body=body, status=upstream.status)
                out.headers["Content-Type"] = upstream.headers.get(
                    "Content-Type", "application/json"
                )
                for name in (LEADER_HEADER, "Idempotent-Replayed"):
                    if name in upstream.headers:
                        out.headers[name] = upstream.headers[name]
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(
                f"could not reach the leader {leader} at {endpoint.url}: {type(exc).__name__}; "
                "the action may or may not have been applied",
                fix="retry with the same Idempotency-Key (it is applied once), or check "
                "`meridianctl audit` before running the command again",
            ) from exc


def _client_tls(settings: ControllerSettings) -> ssl.SSLContext | bool:
    tls = settings.api.tls
    if tls is None:
        return True
    return ssl.create_default_context(cafile=str(tls.ca_file or tls.cert_file))
