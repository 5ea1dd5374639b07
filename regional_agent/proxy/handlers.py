"""The OpenAI-compatible edge: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A request is parsed just enough to route it: its model, its rendered prompt's block hashes
(``policies.prompt``, the same rendering the simulator caches by), its priority and session
key.  Then it waits for a slot (``queue``), goes to a node (``upstream``) and its response is
relayed unchanged, chunk by chunk for streams.

Retries: a connect error, a reset, a 5xx or a 429 from a node is retried on another node while
nothing has reached the client, up to ``retry.max_attempts`` and within the retry budget.  Once
the first byte of a stream is out, a failure ends the stream with an OpenAI-style error event
(``data: {"error": ...}``), which the ``openai`` client raises as an error: never a hang.

A client that disconnects cancels its handler (aiohttp's handler cancellation), which closes
the upstream connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span, Status, StatusCode

from policies import admission, prompt
from policies.model import NodeId, RequestView
from regional_agent.edge import EDGE, Edge
from regional_agent.errors import (
    AgentError,
    BadRequest,
    NoCapacity,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatus,
    UpstreamUnavailable,
)
from regional_agent.queue import Lease
from regional_agent.upstream import UpstreamResponse

log = logging.getLogger(__name__)

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_CHAT_ASSUMED_MAX_TOKENS = 256  # for accounting only, when a chat request names no limit
_FORWARD_HEADERS = ("Authorization", "X-Request-ID", "traceparent", "tracestate")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Parsed:
    body: dict[str, Any]
    raw: bytes
    view: RequestView
    stream: bool
    tokens: int  # prompt + max_tokens, for the agent's accounting


async def models(request: web.Request) -> web.Response:
    agent = request.app[EDGE]
    data = [
        {"id": model, "object": "model", "owned_by": "meridian", "root": model}
        for model in sorted(agent.pool.models())
    ]
    return web.json_response({"object": "list", "data": data})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, path="/v1/chat/completions", chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, path="/v1/completions", chat=False)


# -- parsing ------------------------------------------------------------------------------------


async def _parse(request: web.Request, agent: Edge, *, chat: bool) -> _Parsed:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(
            "'model' is required: name one of the models from /v1/models", param="model"
        )
    try:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise BadRequest(
                    "'messages' must be a non-empty list of messages", param="messages"
                )
            token_ids = prompt.tokenize(prompt.render_chat(messages))
        else:
            token_ids = _completion_tokens(body.get("prompt"))
    except prompt.PromptError as exc:
        raise BadRequest(str(exc), param="messages") from exc
    max_tokens = body.get("max_tokens")
    if max_tokens is None and chat:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadRequest(
            f"'max_tokens' must be a positive integer, got {max_tokens!r}", param="max_tokens"
        )
    if max_tokens is None:
        max_tokens = _CHAT_ASSUMED_MAX_TOKENS if chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    settings = agent.settings
    try:
        priority = admission.parse_priority(
            request.headers.get("X-Priority"),
            tenant=request.headers.get("X-Tenant"),
            tenant_classes=settings.queue.tenant_priority,
        )
    except admission.PriorityError as exc:
        raise BadRequest(str(exc)) from exc
    session = request.headers.get("X-Session-ID") or body.get("user")
    block_tokens = settings.routing.prefix_block_tokens
    view = RequestView(
        model=model,
        prompt_tokens=len(token_ids),
        max_tokens=max_tokens,
        block_hashes=prompt.block_hashes(token_ids, block_size=block_tokens),
        block_tokens=block_tokens,
        session_key=session if isinstance(session, str) and session else None,
        priority=priority,
    )
    return _Parsed(body=body, raw=raw, view=view, stream=stream, tokens=len(token_ids) + max_tokens)


def _completion_tokens(value: object) -> tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return prompt.tokenize(value)
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return tuple(value)
    raise BadRequest(
        "'prompt' must be a string, a list of token ids, or a list of one of those", param="prompt"
    )


# -- proxying -----------------------------------------------------------------------------------


async def _proxy(request: web.Request, *, path: str, chat: bool) -> web.StreamResponse:
    agent = request.app[EDGE]
    arrived = agent.clock.now()
    parsed = await _parse(request, agent, chat=chat)
    request_id = request.headers.get("X-Request-ID") or uuid.uuid4().hex
    headers = {"Content-Type": "application/json", "X-Request-ID": request_id}
    for name in _FORWARD_HEADERS:
        if name in request.headers and name not in headers:
            headers[name] = request.headers[name]
    agent.budget.on_request(now=agent.clock.now())
    with agent.instruments.tracer.start_as_current_span(
        "agent.request",
        attributes={
            "meridian.model": parsed.view.model,
            "meridian.stream": parsed.stream,
            "meridian.priority": parsed.view.priority,
            "meridian.prompt_tokens": parsed.view.prompt_tokens,
            "meridian.request_id": request_id,
        },
    ) as span:
        status = 500
        node_label = "none"
        try:
            response, node_label = await _attempts(
                request, agent, parsed, path, headers, span, arrived
            )
            status = response.status
            return response
        except AgentError as exc:
            status = exc.http_status
            span.set_status(Status(StatusCode.ERROR, exc.message))
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            span.set_attribute("meridian.client_cancelled", True)
            raise
        finally:
            span.set_attribute("http.status_code", status)
            agent.instruments.count_request(node=node_label, status=status)


async def _attempts(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    path: str,
    headers: Mapping[str, str],
    span: Span,
    arrived: float,
) -> tuple[web.StreamResponse, str]:
    tried: set[NodeId] = set()
    max_attempts = agent.settings.retry.max_attempts
    attempt = 0
    last: UpstreamError | None = None
    while True:
        attempt += 1
        try:
            lease = await agent.dispatcher.acquire(
                parsed.view, tokens=parsed.tokens, exclude=frozenset(tried)
            )
        except NoCapacity:
            if last is None:
                raise
            # no other node to retry on: the client gets the failure we saw
            span.set_attribute("meridian.retries", attempt - 2)
            if isinstance(last, UpstreamStatus):
                return _relay_error(last), "none"
            raise last from None
        agent.instruments.queue_wait.record(lease.queue_wait_s)
        agent.instruments.count_decision(
            policy=lease.policy, reason=lease.decision.reason.split(":")[0]
        )
        span.set_attributes(
            {
                "meridian.policy": lease.policy,
                "meridian.node": lease.node_id,
                "meridian.reason": lease.decision.reason,
                "meridian.queue_wait_s": lease.queue_wait_s,
                "meridian.attempt": attempt,
            }
        )
        try:
            response = await _one_attempt(request, agent, parsed, path, headers, lease, arrived)
        except UpstreamError as exc:
            lease.release(failed=_node_at_fault(exc))
            if not _node_at_fault(exc):
                return _relay_error(exc), lease.node_id
            tried.add(lease.node_id)
            last = exc
            can_retry = exc.retryable and attempt < max_attempts
            if can_retry and agent.budget.try_spend(now=agent.clock.now()):
                cause = (
                    type(exc).__name__
                    if not isinstance(exc, UpstreamStatus)
                    else str(exc.http_status)
                )
                agent.instruments.count_retry(cause=cause)
                log.info(
                    "retrying request on another node node=%s attempt=%d cause=%s",
                    lease.node_id,
                    attempt,
                    exc.message,
                )
                continue
            span.set_attribute("meridian.retries", attempt - 1)
            if isinstance(exc, UpstreamStatus):
                return _relay_error(exc), lease.node_id
            raise
        except BaseException:
            lease.release(failed=False)
            raise
        lease.release(failed=False)
        span.set_attribute("meridian.retries", attempt - 1)
        return response, lease.node_id


def _node_at_fault(exc: UpstreamError) -> bool:
    """4xx answers other than 429 are the client's problem, not the node's."""
    if isinstance(exc, UpstreamStatus):
        return exc.http_status >= 500 or exc.http_status == 429
    return True


def _relay_error(exc: UpstreamError) -> web.Response:
    if isinstance(exc, UpstreamStatus) and exc.upstream_body:
        return web.Response(
            body=exc.upstream_body, status=exc.http_status, content_type=_mime(exc.content_type)
        )
    return web.json_response(exc.body(), status=exc.http_status)


def _mime(content_type: str) -> str:
    return content_type.split(";")[0].strip() or "application/json"


async def _one_attempt(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    path: str,
    headers: Mapping[str, str],
    lease: Lease,
    arrived: float,
) -> web.StreamResponse:
    try:
        async with asyncio.timeout(None) as timeout:
            lease.timeout = timeout  # a drain that runs out of time reschedules it
            return await _send(request, agent, parsed, path, headers, lease, arrived)
    except TimeoutError:
        if lease.timeout is not None and lease.timeout.expired():
            raise UpstreamUnavailable(
                f"node {lease.node_id} was drained and the request ran past the drain timeout",
                node_id=lease.node_id,
            ) from None
        raise


async def _send(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    path: str,
    headers: Mapping[str, str],
    lease: Lease,
    arrived: float,
) -> web.StreamResponse:
    node = agent.pool.get(lease.node_id)
    if node is None:  # removed while we waited
        raise UpstreamUnavailable(f"node {lease.node_id} was removed", node_id=lease.node_id)
    sent = agent.clock.now()
    url = node.endpoint(path)
    try:
        async with agent.client.post(lease.node_id, url, body=parsed.raw, headers=headers) as up:
            if parsed.stream:
                return await _relay_stream(request, agent, up, lease, sent=sent, arrived=arrived)
            data = await up.read()
            if "json" in up.content_type:
                try:
                    json.loads(data)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise UpstreamProtocolError(
                        f"node {lease.node_id} answered with malformed JSON", node_id=lease.node_id
                    ) from exc
            agent.health.record(lease.node_id, ok=True, ttft_s=None, now=agent.clock.now())
            return web.Response(body=data, status=up.status, content_type=_mime(up.content_type))
    except UpstreamError as exc:
        if _node_at_fault(exc):
            agent.health.record(lease.node_id, ok=False, ttft_s=None, now=agent.clock.now())
        raise


async def _relay_stream(
    request: web.Request,
    agent: Edge,
    up: UpstreamResponse,
    lease: Lease,
    *,
    sent: float,
    arrived: float,
) -> web.StreamResponse:
    chunks = up.chunks()
    try:
        first = await anext(chunks)  # before this, a failure can still be retried elsewhere
    except StopAsyncIteration:
        raise UpstreamProtocolError(
            f"node {lease.node_id} sent an empty stream", node_id=lease.node_id
        ) from None
    now = agent.clock.now()
    lease.first_token()
    agent.health.record(lease.node_id, ok=True, ttft_s=now - sent, now=now)
    agent.instruments.record_ttft(now - arrived)
    response = web.StreamResponse(
        status=up.status,
        headers={"Content-Type": up.content_type, "Cache-Control": "no-cache"},
    )
    await response.prepare(request)
    await response.write(first)
    failure: str | None = None
    try:
        async for chunk in chunks:
            await response.write(chunk)
    except UpstreamError as exc:
        failure = exc.message
        agent.health.record(lease.node_id, ok=False, ttft_s=None, now=agent.clock.now())
    except asyncio.CancelledError:
        if lease.timeout is None or not lease.timeout.expired():
            raise  # the client went away: closing upstream makes the node abort
        failure = "the node is being drained and the stream ran past the drain timeout"
    if failure is not None:
        log.warning("stream broken after first byte node=%s error=%s", lease.node_id, failure)
        event = {
            "error": {
                "message": f"the serving node failed mid-stream: {failure}",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
        }
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


__all__ = ["chat_completions", "completions", "models"]
