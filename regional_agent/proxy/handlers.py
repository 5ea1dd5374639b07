"""The OpenAI-compatible edge: ``/v1/chat/completions``, ``/v1/completions``, every other
inference endpoint of a vLLM node (``regional_agent.proxy.endpoints``), ``/v1/models`` and
``/v1/models/{model}``, and stored responses (``/v1/responses/{id}``).

A request is parsed just enough to route it: its model, its rendered prompt's block hashes
(``policies.prompt``, the same rendering the simulator caches by; none for an endpoint routed by
load), its priority and session key.  Then it waits for a slot (``queue``), goes to a node
(``upstream``) and its response is relayed unchanged, chunk by chunk for streams.

Retries: a connect error, a reset, a 5xx or a 429 from a node is retried on another node while
nothing has reached the client, up to ``retry.max_attempts`` and within the retry budget.  Once
the first byte of a stream is out, a failure ends the stream with an OpenAI-style error event
(``data: {"error": ...}``), which the ``openai`` client raises as an error: never a hang.

A client that disconnects cancels its handler (aiohttp's handler cancellation), which closes
the upstream connection, which makes vLLM abort the request.  When the agent writes to the
connection before aiohttp has noticed it closed, the write fails (``ConnectionResetError``)
instead, which ends the handler the same way.  Both count as status 499, never as an error.

Parsing is bounded: only the first ``routing.prefix_max_tokens`` tokens of a prompt are
tokenised and hashed, and a body of ``parse.offload_min_bytes`` or more is parsed on a parse
thread (``Edge.offload``), so a large prompt does not stall the event loop for everyone else.

Tenants (``regional_agent.tenants``): with API keys configured, the key is checked before the
body is read (401), the model against the tenant's (403) and the tenant's rate limits before
the request queues (429 with ``x-ratelimit-*``); the priority is the tenant's (its
``X-Priority`` only when trusted; ``X-Tenant`` is ignored) and the key is not forwarded to the
node.  A served response carries the ``x-ratelimit-*`` headers, and its usage settles the
tokens reserved.  Without keys (open mode) none of this applies.

Trace context: when the agent's spans go somewhere (``otel.endpoint`` or ``console_spans``),
the request's span (``agent.request``, kind SERVER) is a child of the client's W3C
``traceparent``, sampled as that says (else by ``otel.trace_sample_ratio``), and the agent sends
the node its own span's context as ``traceparent``, so the node's span (vLLM's ``llm_request``)
is its child.  Otherwise no span is made at all, and the client's ``traceparent`` and
``tracestate`` go to the node as they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.parser
import email.policy
import functools
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

import msgspec
from aiohttp import web
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from meridian_service import strict_json
from policies import admission, prompt
from policies.model import NodeId, RequestView
from regional_agent import request_ids
from regional_agent.edge import EDGE, Edge
from regional_agent.errors import (
    AgentError,
    BadRequest,
    Forbidden,
    InvalidKey,
    NoCapacity,
    NotFound,
    QueueFull,
    RateLimited,
    UnknownModel,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatus,
    UpstreamUnavailable,
)
from regional_agent.observability import RequestMetrics
from regional_agent.prompts import ChatOptions, ModelPrompts, Prompts
from regional_agent.proxy.endpoints import Kind
from regional_agent.queue import Lease
from regional_agent.request_ids import REQUEST_ID, RESPONSE_HOMES
from regional_agent.settings import Settings
from regional_agent.spill import HEADER as SPILLED_FROM
from regional_agent.spill import RESIDENCY_HEADER, SPILLED_TO, Spill, request_tags
from regional_agent.tenants import Admission, Tenant, UsageTally
from regional_agent.upstream import Timeouts, UpstreamResponse

log = logging.getLogger(__name__)

_STAND_IN = Prompts()  # no tokenizer and no prefix cache: for a caller that passes no prompts
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_CHAT_ASSUMED_MAX_TOKENS = 256  # for accounting only, when a chat request names no limit
_FORWARD_HEADERS = ("Authorization", "X-Request-ID", "traceparent", "tracestate")
_TRACE_HEADERS = ("traceparent", "tracestate")
_W3C = TraceContextTextMapPropagator()  # W3C trace context: the client's in, the agent's out
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# a request that sets none of the chat options (a conversation's, the stand-in's): one value
# for all of them, its template arguments read-only
_NO_OPTIONS: Final = ChatOptions(template_kwargs=MappingProxyType({}))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Parsed:
    body: dict[str, Any]
    raw: bytes
    view: RequestView
    stream: bool
    tokens: int  # prompt + max_tokens, for the agent's accounting
    metrics: RequestMetrics  # its model label and tokens, for /metrics
    reply_headers: Mapping[str, str] = field(default_factory=dict)  # x-ratelimit-*
    tally: UsageTally | None = None  # what the response used, with a token limit
    kind: Kind = "chat"  # how it was parsed and routed (regional_agent.proxy.endpoints)


class _ClientGone(Exception):
    """The client closed its connection while the agent wrote the answer to it."""

    def __init__(self, response: web.StreamResponse, *, node_id: str) -> None:
        super().__init__(f"client went away node={node_id}")
        self.response = response
        self.node_id = node_id


async def models(request: web.Request) -> web.Response:
    agent = request.app[EDGE]
    tenant = _authenticate(request, agent)
    data = [
        {"id": model, "object": "model", "owned_by": "meridian", "root": model}
        for model in sorted(agent.pool.models())
        if tenant is None or tenant.may_use(model)
    ]
    return web.json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the model's card as its nodes report it (``client.models
    .retrieve``), or an OpenAI-style 404 naming the models there are."""
    agent = request.app[EDGE]
    tenant = _authenticate(request, agent)
    name = request.match_info["model"]
    served = sorted(m for m in agent.pool.models() if tenant is None or tenant.may_use(m))
    if name not in served:
        raise UnknownModel(
            f"The model `{name}` does not exist; the models served are: "
            f"{', '.join(served) or 'none (no node serves a model yet)'}"
        )
    return web.json_response(_card(agent, name))


def _card(agent: Edge, name: str) -> dict[str, Any]:
    """A model's card: the one of the first node (by id) that reported it, else a plain one."""
    for node in sorted(agent.pool, key=lambda n: n.node_id):
        card = node.cards.get(name)
        if card is not None:
            return {**card, "id": name, "object": "model"}
    return {"id": name, "object": "model", "owned_by": "meridian", "root": name}


def endpoint(path: str, kind: Kind) -> Handler:
    """The handler that proxies ``POST path`` (``regional_agent.proxy.endpoints``): ``_proxy``
    itself with the path bound, not a coroutine that awaits it (one frame less to resume at
    every wait of every request)."""
    return functools.partial(_proxy, path=path, kind=kind)


async def stored_response(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: to the node that made
    the response (vLLM keeps a stored response on the node that served it), which this agent
    remembers for the last ``RESPONSE_HOMES`` responses it relayed."""
    agent = request.app[EDGE]
    tenant = _authenticate(request, agent)
    response_id = request.match_info["response_id"]
    home = agent.response_homes.get(response_id)
    node = None if home is None else agent.pool.get(home)
    if node is None:
        raise NotFound(
            f"no response {response_id!r} is known to this agent: it remembers the node of the "
            f"last {RESPONSE_HOMES} responses it relayed (per worker), and that node must still "
            "be in its pool",
            param="response_id",
        )
    suffix = "/cancel" if request.path.endswith("/cancel") else ""
    path = f"/v1/responses/{response_id}{suffix}"
    if request.query_string:
        path += f"?{request.query_string}"
    raw = await request.read()
    headers = _forward_headers(request, agent, tenant, _request_id(request))
    parsed = _Parsed(
        body={},
        raw=raw,
        view=RequestView(model="", prompt_tokens=0, max_tokens=1),
        stream=request.query.get("stream") == "true",
        tokens=0,
        metrics=RequestMetrics(model="none", prompt_tokens=0),
        kind="load",
    )
    hop = _Hop(node.node_id)
    status = 500
    try:
        response = await _exchange(
            request, agent, parsed, node.endpoint(path), headers, hop, agent.clock.now(),
            method=request.method,
        )  # fmt: skip
        status = response.status
        return response
    except UpstreamStatus as exc:
        status = exc.http_status
        return _relay_error(exc)
    finally:
        agent.instruments.count_request(node=node.node_id, status=status)


# -- tenants --------------------------------------------------------------------------------------


def _authenticate(request: web.Request, agent: Edge) -> Tenant | None:
    """The key's tenant (``None`` in open mode), or 401."""
    try:
        return agent.tenants.authenticate(request.headers.get("Authorization"))
    except InvalidKey:
        agent.instruments.count_refusal(tenant="none", cause="unauthenticated")
        raise


def _admit(agent: Edge, tenant: Tenant, parsed: _Parsed) -> tuple[_Parsed, Admission]:
    """The tenant's model (403) and rate limits (429), then the reply's headers and tally."""
    try:
        agent.tenants.authorize(tenant, parsed.view.model)
    except Forbidden:
        agent.instruments.count_refusal(tenant=tenant.name, cause="model")
        raise
    try:
        admitted = agent.tenants.admit(tenant, tokens=parsed.tokens)
    except RateLimited as exc:
        agent.instruments.count_refusal(tenant=tenant.name, cause=exc.cause)
        raise
    tally = None
    if tenant.limits.tokens is not None:
        tally = UsageTally(prompt_tokens=parsed.view.prompt_tokens)
    return dataclasses.replace(parsed, reply_headers=admitted.headers, tally=tally), admitted


# -- parsing ------------------------------------------------------------------------------------


async def _parse(
    request: web.Request, agent: Edge, *, kind: Kind, tenant: Tenant | None
) -> _Parsed:
    """Read and parse the body: on the event loop when it is small (the common case, cheaper
    than a thread hop), else on a parse thread (``parse.offload_min_bytes``), so that one large
    prompt does not stall every other request.  The work is bounded either way: only the first
    ``routing.prefix_max_tokens`` tokens are tokenised and hashed."""
    raw = await request.read()
    only_model = None
    if kind in ("load", "form"):  # only these may leave the model out (not on the hot path)
        models = agent.pool.models()
        only_model = next(iter(models)) if len(models) == 1 else None
    work = functools.partial(
        _parse_body,
        raw,
        request.headers,
        agent.settings,
        kind=kind,
        tenant=tenant,
        prompts=agent.prompts,
        only_model=only_model,
    )
    if len(raw) < agent.settings.parse.offload_min_bytes:
        return work()
    return await agent.offload(work)


def _parse_body(
    raw: bytes,
    headers: Mapping[str, str],
    settings: Settings,
    *,
    kind: Kind,
    tenant: Tenant | None = None,
    prompts: Prompts | None = None,
    only_model: str | None = None,
) -> _Parsed:
    """Everything ``_parse`` does after reading, without the event loop (it may run on a
    thread: it reads only its arguments, and the prefix cache, which has a lock).

    The prompt is rendered and tokenised with the model's own template and tokenizer when
    ``prompts`` has one for it (``regional_agent.prompts``), else with the stand-in.  An
    endpoint without a prompt to share (``load``, ``form``) is routed by load; its ``model``
    may be left out when the agent's nodes serve one model (``only_model``), as vLLM does."""
    if kind == "form":
        return _parse_form(raw, headers, settings, tenant=tenant, only_model=only_model)
    body = _loads(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _model(body, only_model if kind == "load" else None)
    if kind == "load":
        return _by_load(body, raw, model, headers, settings, tenant)
    max_prompt_tokens = settings.routing.prefix_max_tokens
    block_tokens = settings.routing.prefix_block_tokens
    own = prompts.for_model(model) if prompts is not None else None
    chat = kind != "completion"
    param = {"chat": "messages", "completion": "prompt"}.get(kind, "input")
    try:
        if kind in ("responses", "messages"):
            hashes, prompt_tokens = _conversation_tokens(
                body, kind, own, prompts, block_tokens=block_tokens, max_tokens=max_prompt_tokens
            )
        elif chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise BadRequest(
                    "'messages' must be a non-empty list of messages", param="messages"
                )
            options = _chat_options(body) if own is not None else _NO_OPTIONS
            hashes, prompt_tokens = _chat_tokens(
                messages, options, own, prompts, block_tokens=block_tokens,
                max_tokens=max_prompt_tokens,
            )  # fmt: skip
        else:
            hashes, prompt_tokens = _completion_tokens(
                body, max_prompt_tokens, block_tokens=block_tokens, own=own
            )
    except prompt.PromptError as exc:
        raise BadRequest(str(exc), param=param) from exc
    limit_field = "max_output_tokens" if kind == "responses" else "max_tokens"
    max_tokens = body.get(limit_field)
    if max_tokens is None and kind == "chat":
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadRequest(
            f"'{limit_field}' must be a positive integer, got {_shown(max_tokens)}",
            param=limit_field,
        )
    if max_tokens is None:
        max_tokens = _CHAT_ASSUMED_MAX_TOKENS if chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    priority = _priority(headers, settings, tenant)
    session = _session_key(headers.get("X-Session-ID"), body.get("user"))
    view = RequestView(
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        block_hashes=hashes,
        block_tokens=block_tokens,
        session_key=session,
        priority=priority,
    )
    return _Parsed(
        body=body,
        raw=raw,
        view=view,
        stream=stream,
        tokens=prompt_tokens + max_tokens,
        metrics=RequestMetrics(model=model, prompt_tokens=prompt_tokens),
        kind=kind,
    )


def _model(body: Mapping[str, Any], only_model: str | None) -> str:
    """The body's ``model``; when it names none, ``only_model`` (the one the nodes serve, for
    an endpoint where vLLM takes its only model), else a 400 naming the field."""
    model = body.get("model")
    if model is None and only_model is not None:
        return only_model
    if model is None:
        raise BadRequest(
            "'model' is required: name one of the models from /v1/models", param="model"
        )
    if not isinstance(model, str) or not model:
        raise BadRequest(
            f"'model' must be a string naming one of the models from /v1/models, got "
            f"{_shown(model)}",
            param="model",
        )
    return model


_BYTES_PER_TOKEN = 4  # an estimate of a body's tokens where nothing is tokenised


def _by_load(
    body: Mapping[str, Any],
    raw: bytes,
    model: str,
    headers: Mapping[str, str],
    settings: Settings,
    tenant: Tenant | None,
) -> _Parsed:
    """A request with no prompt to share: routed by load, its size estimated from its bytes
    (the node's ``usage`` replaces the estimate in the metrics when it reports one)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    return _estimated(body, raw, model, stream, headers, settings, tenant, kind="load")


def _estimated(
    body: dict[str, Any] | Mapping[str, Any],
    raw: bytes,
    model: str,
    stream: bool,
    headers: Mapping[str, str],
    settings: Settings,
    tenant: Tenant | None,
    *,
    kind: Kind,
) -> _Parsed:
    prompt_tokens = max(1, len(raw) // _BYTES_PER_TOKEN)
    view = RequestView(
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=1,
        block_tokens=settings.routing.prefix_block_tokens,
        session_key=_session_key(headers.get("X-Session-ID"), body.get("user")),
        priority=_priority(headers, settings, tenant),
    )
    return _Parsed(
        body=dict(body),
        raw=raw,
        view=view,
        stream=stream,
        tokens=prompt_tokens + 1,
        metrics=RequestMetrics(model=model, prompt_tokens=prompt_tokens),
        kind=kind,
    )


def _parse_form(
    raw: bytes,
    headers: Mapping[str, str],
    settings: Settings,
    *,
    tenant: Tenant | None,
    only_model: str | None,
) -> _Parsed:
    """A multipart form (audio): its ``model`` and ``stream`` fields; the file is not read."""
    content_type = headers.get("Content-Type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(
            f"this endpoint takes a multipart/form-data body (a file and its fields), got "
            f"{content_type or 'no Content-Type'}"
        )
    fields = _form_fields(raw, content_type, names=("model", "stream"))
    model = _model({"model": fields.get("model")}, only_model)
    stream = fields.get("stream", "false").strip().lower() == "true"
    return _estimated({}, raw, model, stream, headers, settings, tenant, kind="form")


def _form_fields(raw: bytes, content_type: str, *, names: tuple[str, ...]) -> dict[str, str]:
    """The text fields ``names`` of a multipart/form-data body (the stdlib's MIME parser)."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw
    )
    if not message.is_multipart():
        raise BadRequest("the multipart/form-data body has no parts (or no boundary)")
    out: dict[str, str] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str) and name in names and part.get_filename() is None:
            payload = part.get_payload(decode=True)
            if isinstance(payload, bytes):
                out[name] = payload.decode("utf-8", errors="replace")
    return out


def _conversation_tokens(
    body: Mapping[str, Any],
    kind: Kind,
    own: ModelPrompts | None,
    prompts: Prompts | None,
    *,
    block_tokens: int,
    max_tokens: int,
) -> tuple[tuple[int, ...], int]:
    """The Responses or Messages API's conversation as chat messages, hashed as a chat is: the
    messages up to the first item that is not plain text (a tool call, an image), which ends
    the prefix worth sharing.  The agent's rendering is a stand-in for the node's, so a
    conversation it cannot render is routed by load (no hashes), never refused: the node
    judges the request."""
    messages = _responses_messages(body) if kind == "responses" else _anthropic_messages(body)
    if not messages:
        return (), 1
    try:
        return _chat_tokens(
            messages, _NO_OPTIONS, own, prompts, block_tokens=block_tokens, max_tokens=max_tokens
        )
    except prompt.PromptError:
        return (), 1


def _chat_tokens(
    messages: list[Any],
    options: ChatOptions,
    own: ModelPrompts | None,
    prompts: Prompts | None,
    *,
    block_tokens: int,
    max_tokens: int,
) -> tuple[tuple[int, ...], int]:
    """A chat's block hashes and token count: the model's own template and tokenizer
    (``own``), else the stand-in; ``prompt.PromptError`` when it cannot be rendered."""
    if own is not None:
        head = own.encode_chat(messages, options, block_size=block_tokens, max_tokens=max_tokens)
    else:
        head = (prompts or _STAND_IN).encode_stand_in_chat(
            messages, block_size=block_tokens, max_tokens=max_tokens
        )
    return head.block_hashes, head.total_tokens


def _text_of(content: object) -> str | None:
    """A message's content as text: a string, or text parts only; ``None`` otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str) or part.get("type") not in _TEXT_PARTS:
            return None
        texts.append(text)
    return "".join(texts)


_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _responses_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    value = body.get("input")
    if value is None:
        raise BadRequest("'input' is required: a string or a list of input items", param="input")
    if not isinstance(value, str | list):
        raise BadRequest(
            f"'input' must be a string or a list of input items, got {_shown(value)}",
            param="input",
        )
    messages = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    for item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            break
        role, text = item.get("role"), _text_of(item.get("content"))
        if not isinstance(role, str) or text is None:
            break
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    return messages


def _anthropic_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list):
        raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
    messages = []
    system = _text_of(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for item in value:
        role = item.get("role") if isinstance(item, dict) else None
        text = _text_of(item.get("content")) if isinstance(item, dict) else None
        if not isinstance(role, str) or text is None:
            break
        messages.append({"role": role, "content": text})
    return messages


def _chat_options(body: Mapping[str, Any]) -> ChatOptions:
    """The request's rendering options (``add_generation_prompt``, ``tools``, ...), or
    ``BadRequest`` naming the field that is wrong."""
    try:
        return ChatOptions.from_body(body)
    except prompt.PromptError as exc:
        raise BadRequest(str(exc)) from None


def _priority(headers: Mapping[str, str], settings: Settings, tenant: Tenant | None) -> int:
    """Open mode: ``X-Priority``, else ``X-Tenant``'s class.  With a key: the tenant's class,
    or its ``X-Priority`` when it is trusted to set one; ``X-Tenant`` is ignored."""
    header = headers.get("X-Priority")
    try:
        if tenant is None:
            return admission.parse_priority(
                header,
                tenant=headers.get("X-Tenant"),
                tenant_classes=settings.queue.tenant_priority,
            )
        if tenant.trust_priority and header is not None and header.strip():
            return admission.parse_priority(header, tenant_classes={})
    except admission.PriorityError as exc:
        raise BadRequest(str(exc)) from exc
    return tenant.priority


def _loads(raw: bytes) -> object:
    """The body as JSON, or ``BadRequest`` saying what is wrong with it
    (``meridian_service.strict_json``: no NaN or Infinity, no runaway nesting)."""
    try:
        return strict_json.loads(raw)
    except strict_json.BodyError as exc:
        if exc.literal:
            where = exc.field
            raise BadRequest(
                f"{where or 'the request body'}: {exc.literal} is not a JSON number; send a "
                "finite number (JSON has no NaN or Infinity)",
                param=where or None,
            ) from None
        if exc.problem.startswith("is nested too deeply"):
            raise BadRequest(
                f"the request body {exc.problem}; send a body nested a few levels deep, as the "
                "OpenAI API's are"
            ) from None
        raise BadRequest(f"the request body {exc.problem}") from None


def _shown(value: object) -> str:
    """A client's value in a message: short, and as JSON writes it (escaped, one line)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str) and len(value) > 40:
        return f'{json.dumps(value[:40])[:-1]}..."'
    return json.dumps(value)


def _session_key(header: str | None, user: object) -> str | None:
    """The session key: ``X-Session-ID``, else the body's ``user``.  It is hashed as UTF-8, so
    a lone surrogate (from JSON, or a header's undecodable bytes) is refused here."""
    if header:
        try:
            return prompt.check_text(header, field="X-Session-ID")
        except prompt.PromptError:
            raise BadRequest(  # aiohttp decodes bytes that are not UTF-8 to lone surrogates
                "the X-Session-ID header is not UTF-8 text: send the session id as UTF-8 "
                "(ASCII letters, digits and dashes are safest)"
            ) from None
    if not isinstance(user, str) or not user:
        return None
    try:
        return prompt.check_text(user, field="user")
    except prompt.PromptError as exc:
        raise BadRequest(str(exc), param="user") from exc


_MAX_TOKEN_ID = 2**32 - 1  # block hashes pack token ids in 4 bytes (policies.prompt.hash_block)


def _completion_tokens(
    body: Mapping[str, Any], max_tokens: int, *, block_tokens: int, own: ModelPrompts | None
) -> tuple[tuple[int, ...], int]:
    """The block hashes of a completion's prompt (its first ``max_tokens`` tokens) and its token
    count: a text tokenised by the model's tokenizer with its special tokens (``own``; the
    request's ``add_special_tokens``, as vLLM reads it) or by the stand-in; token ids as sent."""
    value = body.get("prompt")
    field = "prompt"
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value, field = value[0], "prompt[0]"
    if isinstance(value, str):
        text = prompt.check_text(value, field=field)
        if own is not None:
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise BadRequest("'add_special_tokens' must be true or false", param="prompt")
            head = own.encode_completion(
                text, add_special_tokens=special, block_size=block_tokens, max_tokens=max_tokens
            )
            return head.block_hashes, head.total_tokens
        prefix = prompt.tokenize_prefix(text, max_tokens=max_tokens)
        return prompt.block_hashes(prefix.token_ids, block_size=block_tokens), prefix.total_tokens
    if isinstance(value, list) and all(type(t) is int for t in value):
        if not all(0 <= t <= _MAX_TOKEN_ID for t in value):
            raise BadRequest(
                f"'{field}' token ids must be integers from 0 to {_MAX_TOKEN_ID}", param="prompt"
            )
        hashes = prompt.block_hashes(value[:max_tokens], block_size=block_tokens)
        return hashes, len(value)
    raise BadRequest(
        "'prompt' must be a string, a list of token ids, or a list of one of those", param="prompt"
    )


# -- proxying -----------------------------------------------------------------------------------


async def _proxy(request: web.Request, *, path: str, kind: Kind) -> web.StreamResponse:
    agent = request.app[EDGE]
    arrived = agent.clock.now()
    tenant = _authenticate(request, agent)  # before the body is read: 401 costs nothing
    parsed = await _parse(request, agent, kind=kind, tenant=tenant)
    admitted: Admission | None = None
    if tenant is not None:
        parsed, admitted = _admit(agent, tenant, parsed)
    try:
        return await _proxy_admitted(request, agent, parsed, path, arrived, tenant)
    finally:
        if admitted is not None:
            used = parsed.tally.total() if parsed.tally is not None else 0
            agent.tenants.settle(admitted, used=used)


async def _proxy_admitted(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    path: str,
    arrived: float,
    tenant: Tenant | None,
) -> web.StreamResponse:
    request_id = _request_id(request)
    headers = _forward_headers(request, agent, tenant, request_id)
    tracing = agent.instruments.tracing
    agent.budget.on_request(now=agent.clock.now())
    parsed.metrics.model = agent.instruments.model_label(parsed.view.model)
    with _request_span(request, agent) as span:
        if span.is_recording():
            span.set_attributes(
                {
                    "meridian.model": parsed.view.model,
                    "meridian.stream": parsed.stream,
                    "meridian.priority": parsed.view.priority,
                    "meridian.prompt_tokens": parsed.view.prompt_tokens,
                    "meridian.request_id": request_id,
                    "meridian.tenant": "" if tenant is None else tenant.name,
                }
            )
        if tracing:
            _W3C.inject(headers)  # the node's span is a child of this one, not its sibling
        status = 500
        node_label = "none"
        try:
            response, node_label = await _attempts(
                request, agent, parsed, path, headers, span, arrived
            )
            status = response.status
            if not response.prepared:  # a stream carries them from its start (_relay_stream)
                response.headers.update(parsed.reply_headers)
            return response
        except AgentError as exc:
            status = exc.http_status
            span.set_status(Status(StatusCode.ERROR, exc.message))
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            span.set_attribute("meridian.client_cancelled", True)
            raise
        except _ClientGone as gone:  # the same, seen as a failed write rather than a cancel
            status, node_label = 499, gone.node_id
            span.set_attribute("meridian.client_cancelled", True)
            # aiohttp finishes the response: its write to the closed connection is a
            # ConnectionError it ignores (no log line), like any premature disconnection
            return gone.response
        finally:
            span.set_attribute("http.status_code", status)
            agent.instruments.count_request(node=node_label, status=status)
            agent.instruments.record_request(agent.clock.now() - arrived, parsed.metrics)


def _request_id(request: web.Request) -> str:
    """The request's id: the client's ``X-Request-ID``, or the one the agent made for it
    (``regional_agent.request_ids``, which echoes it on the response)."""
    return request.get(REQUEST_ID) or request_ids.new()


def _forward_headers(
    request: web.Request, agent: Edge, tenant: Tenant | None, request_id: str
) -> dict[str, str]:
    """What the node is sent besides the body: its content type, the request id, the client's
    key in open mode, and the trace context when the agent makes no span of its own."""
    headers = {
        "Content-Type": request.headers.get("Content-Type", "application/json"),
        "X-Request-ID": request_id,
    }
    tracing = agent.instruments.tracing
    for name in _FORWARD_HEADERS:
        if name == "Authorization" and tenant is not None:
            continue  # the client's key is the agent's secret, not the node's
        if tracing and name in _TRACE_HEADERS:
            continue  # the agent's own span context goes instead (_proxy_admitted)
        if name in request.headers and name not in headers:
            headers[name] = request.headers[name]
    return headers


def _request_span(request: web.Request, agent: Edge) -> contextlib.AbstractContextManager[Span]:
    """The request's span, a child of the client's if it sent a ``traceparent`` (sampled as
    that says, else by ``otel.trace_sample_ratio``); when the agent's spans go nowhere, no span
    at all: a non-recording stand-in that costs nothing."""
    if not agent.instruments.tracing:
        return contextlib.nullcontext(INVALID_SPAN)
    return agent.instruments.tracer.start_as_current_span(
        "agent.request", context=_W3C.extract(request.headers), kind=SpanKind.SERVER
    )


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
    over = _spill_over(request, agent)  # None: this request stays here
    if over is not None:
        depth = agent.dispatcher.depth(parsed.view.model)
        if over.spill.wants(depth):
            wait_ms = over.spill.home_wait_ms(depth)
            spilled = await _spill(
                request, agent, parsed, path, headers, span, over, "queue", wait_ms
            )
            if spilled is not None:
                return spilled
            over = None  # no region would do: it queues here, and is not offered twice
    while True:
        attempt += 1
        try:
            lease = await agent.dispatcher.acquire(
                parsed.view, tokens=parsed.tokens, exclude=frozenset(tried)
            )
        except (UnknownModel, QueueFull, NoCapacity) as exc:
            if over is not None and last is None:  # refused here before any node tried it
                cause = _SPILL_CAUSES[type(exc)]
                # a full queue: a region whose queue is as long is no better; else any will do
                wait_ms = (
                    over.spill.home_wait_ms(agent.dispatcher.depth(parsed.view.model))
                    if isinstance(exc, QueueFull)
                    else math.inf
                )
                spilled = await _spill(
                    request, agent, parsed, path, headers, span, over, cause, wait_ms
                )
                if spilled is not None:
                    return spilled
            if not isinstance(exc, NoCapacity) or last is None:
                raise
            # no other node to retry on: the client gets the failure we saw
            span.set_attribute("meridian.retries", attempt - 2)
            if isinstance(last, UpstreamStatus):
                return _relay_error(last), "none"
            raise last from None
        agent.instruments.record_queue_wait(lease.queue_wait_s, priority=parsed.view.priority)
        agent.instruments.count_decision(policy=lease.policy, reason=lease.decision.tag)
        if span.is_recording():
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


# -- spill-over -----------------------------------------------------------------------------

_SPILL_CAUSES: dict[type[AgentError], str] = {
    UnknownModel: "model",
    QueueFull: "full",
    NoCapacity: "unavailable",
}


@dataclass(frozen=True, slots=True)
class _SpillOver:
    spill: Spill
    tags: frozenset[str]  # residency tags the request adds to its region's


def _spill_over(request: web.Request, agent: Edge) -> _SpillOver | None:
    """Whether this request may go to another region: spill-over is on and it was not
    forwarded here already (one hop: ``X-Meridian-Spilled-From``).  A malformed
    ``X-Meridian-Residency`` is a 400 here, before the request goes anywhere."""
    origin = request.headers.get(SPILLED_FROM)
    if origin is not None:
        known = agent.spill is not None and agent.spill.knows(origin)
        agent.instruments.count_spilled_in(origin=origin if known else "other")
        return None
    if agent.spill is None:
        return None
    return _SpillOver(agent.spill, request_tags(request.headers.get(RESIDENCY_HEADER)))


async def _spill(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    path: str,
    headers: Mapping[str, str],
    span: Span,
    over: _SpillOver,
    cause: str,
    home_wait_ms: float = math.inf,
) -> tuple[web.StreamResponse, str] | None:
    """Forward the request to the best other region that answers (``policies.spill``), at most
    ``spill.max_regions`` of them in turn, while nothing has reached the client; ``None`` when
    none would do or none answered, and the request stays here."""
    spill = over.spill
    model = parsed.view.model
    choice = spill.choose(model, tags=over.tags, home_wait_ms=home_wait_ms, now=agent.clock.now())
    if not choice.targets:
        agent.instruments.count_spill(to="none", cause=cause, outcome="none")
        log.info("no region to spill to model=%s cause=%s: %s", model, cause, choice.why_none())
        return None
    forward = {**headers, SPILLED_FROM: spill.home}
    if "Authorization" in request.headers:  # the other region checks the client's key itself
        forward["Authorization"] = request.headers["Authorization"]
    for target in choice.targets[: spill.settings.max_regions]:
        hop = _Hop(f"region:{target.region}", region=target.region)
        if span.is_recording():
            span.set_attributes({"meridian.spill_to": target.region, "meridian.spill": cause})
        url = target.endpoint.rstrip("/") + path
        try:
            response = await _exchange(request, agent, parsed, url, forward, hop, agent.clock.now())
        except UpstreamError as exc:
            if not _region_at_fault(exc):  # the client's mistake, wherever it goes
                agent.instruments.count_spill(to=target.region, cause=cause, outcome="served")
                return _relay_error(exc), hop.label
            agent.instruments.count_spill(to=target.region, cause=cause, outcome="failed")
            log.warning(
                "spill-over failed region=%s model=%s cause=%s error=%s",
                target.region,
                model,
                cause,
                exc.message,
            )
            continue
        agent.instruments.count_spill(to=target.region, cause=cause, outcome="served")
        return response, hop.label
    return None


def _region_at_fault(exc: UpstreamError) -> bool:
    """A spill target is at fault as a node is, and also for a 404: the plan said it serves
    the model, and it does not (the plan was stale)."""
    return _node_at_fault(exc) or (isinstance(exc, UpstreamStatus) and exc.http_status == 404)


def _node_at_fault(exc: UpstreamError) -> bool:
    """4xx answers other than 429 are the client's problem, not the node's."""
    if isinstance(exc, UpstreamStatus):
        return exc.http_status >= 500 or exc.http_status == 429
    return True


_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')


def _remember_response(agent: Edge, answer: object, node: str) -> None:
    """Which node made a response, for ``GET /v1/responses/{id}`` and its cancel."""
    response_id = answer.get("id") if isinstance(answer, dict) else None
    if isinstance(response_id, str) and response_id:
        agent.response_homes.put(response_id, NodeId(node))


def _relay_error(exc: UpstreamError) -> web.Response:
    """The node's error as it said it.  A body in FastAPI's shape (``{"detail": ...}``, what
    vLLM answers for a path its model does not serve) is put in OpenAI's, with the node's
    message, so clients read it; any other body is relayed byte for byte."""
    if isinstance(exc, UpstreamStatus) and exc.upstream_body:
        detail = _fastapi_detail(exc.upstream_body) if exc.http_status < 500 else None
        if detail is not None:
            message = f"the node answered {exc.http_status} {detail}"
            if exc.http_status == 404:
                message += " (its model does not serve this endpoint)"
            kind = {404: "NotFoundError", 405: "NotFoundError"}.get(exc.http_status)
            error = {"message": message, "type": kind or "BadRequestError", "param": None,
                     "code": exc.http_status}  # fmt: skip
            return web.json_response({"error": error}, status=exc.http_status)
        return web.Response(
            body=exc.upstream_body, status=exc.http_status, content_type=_mime(exc.content_type)
        )
    return web.json_response(exc.body(), status=exc.http_status)


def _fastapi_detail(body: bytes) -> str | None:
    """``detail`` of a ``{"detail": "..."}`` body, else ``None``."""
    if not body.startswith(b'{"detail"'):
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    detail = parsed.get("detail") if isinstance(parsed, dict) else None
    return detail if isinstance(detail, str) and len(parsed) == 1 else None


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
    node = agent.pool.get(lease.node_id)
    if node is None:  # removed while we waited
        raise UpstreamUnavailable(f"node {lease.node_id} was removed", node_id=lease.node_id)
    url, hop = node.endpoint(path), _Hop(lease.node_id, lease)
    # A drain past its timeout cancels this task (Lease.cut_off), as asyncio.timeout would,
    # without a timeout's context for every request: its cancel is taken back here.
    task = asyncio.current_task()
    assert task is not None
    lease.task, lease.cancelling = task, task.cancelling()
    taken_back = False
    try:
        return await _exchange(request, agent, parsed, url, headers, hop, arrived)
    except asyncio.CancelledError:
        if lease.cut:
            taken_back = True
            if task.uncancel() <= lease.cancelling:  # the drain's cancel, no one else's
                raise UpstreamUnavailable(
                    f"node {lease.node_id} was drained and the request ran past the drain timeout",
                    node_id=lease.node_id,
                ) from None
        raise
    finally:
        lease.task = None
        if lease.cut and not taken_back:
            task.uncancel()  # a stream that caught the cut ended itself with an error event


def _stall_timeouts(agent: Edge, parsed: _Parsed) -> Timeouts:
    """A stream's limits: the first token within ``stall.first_token_s`` (never longer than
    ``upstream.first_byte_timeout_s``), then no silence over ``stall.inter_token_s``."""
    limits = agent.settings.stall.limits(parsed.view.model)
    return Timeouts(
        first_byte_s=min(limits.first_token_s, agent.settings.upstream.first_byte_timeout_s),
        gap_s=limits.inter_token_s,
        first_byte_name="stall.first_token_s",
        gap_name="stall.inter_token_s",
    )


@dataclass(frozen=True, slots=True)
class _Hop:
    """Where one attempt goes: a node, under its lease, or another region (spill-over)."""

    label: str  # the node id, or "region:<id>"
    lease: Lease | None = None
    region: str | None = None  # spill-over's target

    def record(self, agent: Edge, *, ok: bool, ttft_s: float | None) -> None:
        """The attempt's outcome, for the node's health or the region's (``agent.spill``)."""
        now = agent.clock.now()
        if self.region is None:
            agent.health.record(NodeId(self.label), ok=ok, ttft_s=ttft_s, now=now)
        elif agent.spill is not None:
            agent.spill.record(self.region, ok=ok, now=now)

    def draining(self) -> bool:
        """Whether a drain ran the attempt past its timeout (nodes only)."""
        return self.lease is not None and self.lease.cut


async def _exchange(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    url: str,
    headers: Mapping[str, str],
    hop: _Hop,
    arrived: float,
    *,
    method: str = "POST",
) -> web.StreamResponse:
    """Send the request to ``url`` and relay the answer: the one exchange of an attempt.  An
    answer is relayed as a stream when the request asked for one or the node sends one."""
    sent = agent.clock.now()
    try:
        timeouts = _stall_timeouts(agent, parsed) if parsed.stream else None
        async with agent.client.post(
            hop.label, url, body=parsed.raw, headers=headers, timeouts=timeouts, method=method
        ) as up:
            if parsed.stream or up.content_type.startswith("text/event-stream"):
                return await _relay_stream(
                    request, agent, parsed, up, hop, sent=sent, arrived=arrived
                )
            data = await up.read()
            if parsed.tally is not None and up.status < 400:
                parsed.tally.body(data)
            if "json" in up.content_type:
                try:
                    answer = _answer(data)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise UpstreamProtocolError(
                        f"node {hop.label} answered with malformed JSON", node_id=hop.label
                    ) from exc
                if up.status < 400:
                    parsed.metrics.body(answer)
                    if parsed.kind == "responses" and hop.region is None:
                        _remember_response(agent, answer, hop.label)
            hop.record(agent, ok=True, ttft_s=None)
            response = web.Response(
                body=data, status=up.status, content_type=_mime(up.content_type)
            )
            if hop.region is not None:
                response.headers[SPILLED_TO] = hop.region
            return response
    except UpstreamError as exc:
        if _node_at_fault(exc) if hop.region is None else _region_at_fault(exc):
            hop.record(agent, ok=False, ttft_s=None)
        raise


def _answer(data: bytes) -> object:
    """A node's JSON answer: msgspec's decode, else ``json``'s (what msgspec refuses, such as a
    ``-Infinity`` logprob, or its error)."""
    try:
        return msgspec.json.decode(data)
    except (msgspec.MsgspecError, RecursionError, ValueError):  # ValueError: bad UTF-8
        return json.loads(data)


async def _relay_stream(
    request: web.Request,
    agent: Edge,
    parsed: _Parsed,
    up: UpstreamResponse,
    hop: _Hop,
    *,
    sent: float,
    arrived: float,
) -> web.StreamResponse:
    first = await up.next_chunk()  # before this, a failure can still be retried elsewhere
    if not first:
        raise UpstreamProtocolError(f"node {hop.label} sent an empty stream", node_id=hop.label)
    now = agent.clock.now()
    if hop.lease is not None:
        hop.lease.first_token()
    hop.record(agent, ok=True, ttft_s=now - sent)
    agent.instruments.record_ttft(now - arrived, model=parsed.metrics.model)
    headers = {
        "Content-Type": up.content_type,
        "Cache-Control": "no-cache",
        **parsed.reply_headers,
        "X-Request-ID": _request_id(request),
    }
    if hop.region is not None:
        headers[SPILLED_TO] = hop.region
    if parsed.kind == "responses" and hop.region is None:
        found = _RESPONSE_ID.search(first)  # response.created, the stream's first event
        if found is not None:
            agent.response_homes.put(found.group(1).decode(), NodeId(hop.label))
    response = web.StreamResponse(status=up.status, headers=headers)
    tally = parsed.tally
    counted = parsed.metrics
    try:
        await response.prepare(request)
        if tally is not None:
            tally.feed(first)
        counted.chunk(first)
        await response.write(first)
        failure: str | None = None
        try:
            while chunk := await up.next_chunk():
                if tally is not None:
                    tally.feed(chunk)
                counted.chunk(chunk)
                await response.write(chunk)
        except UpstreamError as exc:
            failure = exc.message
            hop.record(agent, ok=False, ttft_s=None)
        except asyncio.CancelledError:
            if not hop.draining():
                raise  # the client went away: closing upstream makes the node abort
            failure = "the node is being drained and the stream ran past the drain timeout"
        if failure is not None:
            log.warning("stream broken after first byte node=%s error=%s", hop.label, failure)
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
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError: the client hung up and the loop noticed it
        # before cancelling this handler.  Leaving the upstream block closes the node's
        # connection, so the node aborts, as on a cancel.  (Upstream failures never get here:
        # next_chunk() raises them as UpstreamError.)
        raise _ClientGone(response, node_id=hop.label) from None
    return response


__all__ = ["endpoint", "model", "models", "stored_response"]
