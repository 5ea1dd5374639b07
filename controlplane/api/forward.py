"""Writes received by a follower, forwarded to the leader's admin API as they came.

The controller's only HTTP client (an import-linter contract keeps it so).  The follower has
authenticated the caller already; the leader authenticates again, runs the write fenced, and
its answer is relayed unchanged.  A request forwarded once is never forwarded again: one that
reaches a replica that no longer leads is answered 503 (retry).

**The caller's token is never sent in the clear by a replica that serves TLS.**  When this
replica's admin API runs TLS (``api.tls``), the caller sent its bearer token over HTTPS; a
leader that published a plain ``http://`` admin URL (it runs without TLS, or its
``api.advertise_url`` says http) is refused before anything is sent: 503, nothing sent, nothing
changed, the problem saying which URL and what to fix.  An ``https://`` leader's certificate is
verified (name included) against ``api.tls.ca_file`` (default: this replica's own certificate).
When this replica runs without TLS the network is trusted as it is for its own callers, and
the write goes to the URL the leader published, http or https (verified against the system's
CAs).
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
from meridian_service.tls import client_context
from meridian_wire import keys

FORWARDED = "X-Meridian-Forwarded-By"
LEADER_HEADER = "X-Meridian-Leader"


class Forwarder:
    def __init__(self, *, replica: Replica, settings: ControllerSettings) -> None:
        self._replica = replica
        self._tls = settings.api.tls is not None
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
        if self._tls and not endpoint.url.lower().startswith("https://"):
            raise Unavailable(
                f"the leader {leader} publishes a plain-HTTP admin URL ({endpoint.url}) and this "
                "replica serves TLS: the request, with its bearer token, is not forwarded in the "
                "clear; nothing was sent and nothing was changed",
                fix="serve every replica's admin API with TLS (api.tls; api.advertise_url "
                "https://...), or send the write to the leader yourself",
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
    """How a forwarded write checks the leader: against ``api.tls.ca_file`` (or this replica's
    own certificate) with TLS; the system's CAs (aiohttp's default) without."""
    tls = settings.api.tls
    if tls is None:
        return True
    return client_context(tls.ca_file or tls.cert_file)
