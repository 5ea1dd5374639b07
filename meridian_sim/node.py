"""A vLLM-compatible OpenAI server over the simulated engine (``meridian-sim node``).

Endpoints, as vLLM's OpenAI server has them: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streaming and not), ``/tokenize``, ``/health``, ``/metrics`` and
``/reset_prefix_cache``.  Fault injection for tests and drills lives under ``/admin/faults``.

The engine runs in one background task: it takes a step, sleeps for the step's simulated
duration divided by ``time_scale``, then hands the step's tokens to the waiting handlers.  A
client that goes away (a closed stream, or a cancelled non-streaming request) aborts its
request in the engine, which frees its KV blocks and counts it under
``request_success{finished_reason="abort"}``, as vLLM does.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from aiohttp import web
from opentelemetry.trace import Span

from meridian_sim.engine import Engine, RequestRecord, RequestTooLarge, TokenEvent
from meridian_sim.faults import FaultError, Faults
from meridian_sim.kv_publisher import KvEventsConfig, Publisher, to_wire
from meridian_sim.metrics import CONTENT_TYPE, NodeMetrics
from meridian_sim.profile import Profile
from meridian_sim.tracing import NodeTracing
from policies import prompt

log = logging.getLogger(__name__)

_ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """What one simulated node serves and how fast it runs."""

    profile: Profile
    model: str
    time_scale: float = 1.0
    seed: int = 0
    legacy_metrics: bool = False
    # OTLP tracing as vLLM's --otlp-traces-endpoint (meridian_sim.tracing); None: no spans
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    # KV-cache events as vLLM's --kv-events-config (meridian_sim.kv_publisher); None: none
    kv_events: KvEventsConfig | None = None


class ApiError(Exception):
    """A request the node refuses; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(status: int, message: str, *, param: str | None = None) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }
    return web.json_response(body, status=status)


class SimClock:
    """Simulation seconds since start: wall-clock seconds times ``time_scale``."""

    def __init__(self, time_scale: float) -> None:
        self.time_scale = time_scale
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.time_scale


@dataclass(slots=True)
class NodeState:
    config: NodeConfig
    engine: Engine
    metrics: NodeMetrics
    clock: SimClock
    faults: Faults
    exit_hook: Callable[[], None]
    tracing: NodeTracing | None = None
    kv_publisher: Publisher | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    streams: dict[str, asyncio.Queue[TokenEvent | RequestRecord]] = field(default_factory=dict)
    steps: int = 0
    engine_time: float = 0.0  # the end of the step being run, in simulation seconds
    busy: bool = False

    def now(self) -> float:
        """Simulation time for stamping arrivals and aborts.

        While the engine is busy it keeps its own time (each step starts where the last one
        ended), so reported latencies are the profile's and not this process's scheduling
        jitter times ``time_scale``; when the host cannot keep up, the simulation runs slower
        than ``time_scale`` rather than reporting inflated latencies.
        """
        wall = self.clock.now()
        return min(wall, self.engine_time) if self.busy else wall


STATE: Final = web.AppKey("state", NodeState)


def _default_exit() -> None:
    raise SystemExit(3)


def create_app(
    config: NodeConfig, *, exit_hook: Callable[[], None] = _default_exit
) -> web.Application:
    """The node's aiohttp application; the engine task starts and stops with it."""
    if config.time_scale <= 0:
        raise ValueError("time_scale must be positive")
    engine = Engine(
        config.profile, rng=random.Random(config.seed), record_events=config.kv_events is not None
    )
    clock = SimClock(config.time_scale)
    state = NodeState(
        config=config,
        engine=engine,
        metrics=NodeMetrics(
            engine=engine,
            profile=config.profile,
            model_name=config.model,
            legacy=config.legacy_metrics,
            created_s=time.time(),
        ),
        clock=clock,
        faults=Faults(rng=random.Random(config.seed ^ 0x5EED)),
        exit_hook=exit_hook,
    )
    if config.otlp_traces_endpoint is not None:
        state.tracing = NodeTracing(
            config.otlp_traces_endpoint, protocol=config.otlp_traces_protocol, model=config.model
        )
    app = web.Application(middlewares=[_errors_middleware], client_max_size=32 * 1024**2)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/admin/faults", get_faults)
    app.router.add_post("/admin/faults", set_faults)
    app.router.add_delete("/admin/faults", clear_faults)
    app.cleanup_ctx.append(_engine_task)
    return app


# -- the engine loop ---------------------------------------------------------------------------


async def _engine_task(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    replay: asyncio.Task[None] | None = None
    if state.config.kv_events is not None:
        state.kv_publisher = Publisher(state.config.kv_events)
        replay = asyncio.create_task(
            state.kv_publisher.serve_replay(), name="meridian-sim-kv-replay"
        )
        replay.add_done_callback(_log_crash)
    task = asyncio.create_task(_run_engine(state), name="meridian-sim-engine")
    task.add_done_callback(_log_crash)
    yield
    for running in (task, replay):
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    if state.kv_publisher is not None:
        state.kv_publisher.close()
    if state.tracing is not None:
        await asyncio.to_thread(state.tracing.shutdown)  # the last spans: off the event loop


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("engine task crashed", exc_info=task.exception())


async def _run_engine(state: NodeState) -> None:
    engine = state.engine
    clock = state.clock
    while True:
        if state.faults.hang or not engine.has_unfinished:
            state.busy = False
            state.wake.clear()
            await state.wake.wait()
            continue
        if not state.busy:  # waking up: resume from the wall clock
            state.busy = True
            state.engine_time = max(state.engine_time, clock.now())
        now = state.engine_time
        result = engine.step(now=now, latency_multiplier=state.faults.latency_multiplier)
        if result.num_scheduled_tokens == 0 and not result.finished:
            state.busy = False
            state.wake.clear()  # nothing can run until a request arrives or is aborted
            await state.wake.wait()
            continue
        state.engine_time = now + result.duration_s
        await asyncio.sleep(max(0.0, (state.engine_time - clock.now()) / clock.time_scale))
        state.steps += 1
        state.metrics.observe_step(result)
        await _publish_events(state)
        for event in result.tokens:
            queue = state.streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
        for record in result.finished:
            state.metrics.observe_finished(record)
            queue = state.streams.get(record.request_id)
            if queue is not None:
                queue.put_nowait(record)


async def _publish_events(state: NodeState) -> None:
    """What the step (or a reset) changed in the cache, as one batch of KV events."""
    publisher = state.kv_publisher
    if publisher is None:
        return
    events = state.engine.take_events()
    if events:
        await publisher.publish(to_wire(events, block_size=state.engine.kv.block_size))


# -- middleware and small endpoints ------------------------------------------------------------


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return error_response(exc.status, exc.message, param=exc.param)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.status, exc.reason)
        raise


async def health(request: web.Request) -> web.Response:
    if request.app[STATE].faults.fail_health:
        return error_response(503, "health check failing (injected fault)")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": config.profile.max_model_len,
                }
            ],
        }
    )


async def reset_prefix_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.engine.reset_prefix_cache()
    await _publish_events(state)
    return web.Response(status=200)


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].faults.describe())


async def set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    try:
        state.faults.update(body)
    except FaultError as exc:
        raise ApiError(400, str(exc)) from exc
    state.wake.set()
    if state.faults.exit:
        asyncio.get_running_loop().call_later(0.05, state.exit_hook)
    return web.json_response(state.faults.describe())


async def clear_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.faults.clear()
    state.wake.set()
    return web.json_response(state.faults.describe())


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    _check_model(state, body)
    if "messages" in body:
        text = _render(body.get("messages"), bool(body.get("add_generation_prompt", True)))
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise ApiError(
            400, "send either 'prompt' (a string) or 'messages' (a chat)", param="prompt"
        )
    tokens = prompt.tokenize(text)
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": state.config.profile.max_model_len,
            "tokens": list(tokens),
            "token_strs": prompt.pieces(text) if body.get("return_token_strs") else None,
        }
    )


# -- request parsing ---------------------------------------------------------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(state: NodeState, body: Mapping[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        return  # vLLM serves its only model when none is named
    if model != state.config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")


def _render(messages: object, add_generation_prompt: bool) -> str:
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    try:
        return prompt.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except prompt.PromptError as exc:
        raise ApiError(400, str(exc), param="messages") from exc


def _int_param(body: Mapping[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise ApiError(400, f"'{name}' must be at least {minimum}, got {value}", param=name)
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class _Call:
    chat: bool
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _parse_call(state: NodeState, body: Mapping[str, Any], *, chat: bool) -> _Call:
    _check_model(state, body)
    if chat:
        token_ids = prompt.tokenize(_render(body.get("messages"), True))
    else:
        token_ids = _completion_prompt(body.get("prompt"))
    n = _int_param(body, "n", minimum=1)
    if n is not None and n != 1:
        raise ApiError(400, "meridian-sim serves n=1 only; send one request per choice", param="n")
    max_tokens = _int_param(body, "max_tokens", minimum=1)
    if chat and max_tokens is None:
        max_tokens = _int_param(body, "max_completion_tokens", minimum=1)
    limit = state.config.profile.max_model_len
    if len(token_ids) >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{len(token_ids)} tokens. Please reduce the length of the prompt.",
            param="messages" if chat else "prompt",
        )
    if max_tokens is None:
        max_tokens = limit - len(token_ids) if chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
    min_tokens = _int_param(body, "min_tokens", minimum=0) or 0
    if min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    try:
        state.engine.check_fits(prompt_tokens=len(token_ids), max_tokens=max_tokens)
    except RequestTooLarge as exc:
        raise ApiError(400, str(exc), param="max_tokens") from exc
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be true or false", param="ignore_eos")
    return _Call(
        chat=chat,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def _completion_prompt(value: object) -> tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        return prompt.tokenize(value)
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1:
        raise ApiError(
            400,
            "meridian-sim takes one prompt per request; send a batch as separate requests",
            param="prompt",
        )
    raise ApiError(
        400, "'prompt' must be a non-empty string or a list of token ids", param="prompt"
    )


# -- completions -------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


def _usage(record: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.generation_tokens,
        "total_tokens": record.prompt_tokens + record.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": record.cached_prompt_tokens},
    }


class _Dropped(Exception):
    """The injected ``drop_after_tokens`` fault fired: cut the connection."""


def _drop_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _serve(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    call = _parse_call(state, body, chat=chat)
    injected = state.faults.injected_error()
    if injected is not None:
        return error_response(injected, f"injected fault: HTTP {injected}")
    if state.faults.drop_after_tokens == 0:
        _drop_connection(request)
        return web.Response(status=500)

    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    arrival_s = state.now()
    span = None
    if state.tracing is not None:  # vLLM's llm_request span, under the caller's traceparent
        span = state.tracing.start(
            request.headers, request_id=request_id, max_tokens=call.max_tokens
        )
    record: RequestRecord | None = None
    overhead_ms = state.config.profile.timing.request_overhead_ms
    if overhead_ms > 0:  # the API server's and the engine hop's share of TTFT (profile.py)
        await asyncio.sleep(overhead_ms / 1000.0 / state.config.time_scale)
    queue: asyncio.Queue[TokenEvent | RequestRecord] = asyncio.Queue()
    state.streams[request_id] = queue
    state.engine.add(
        request_id,
        call.prompt_token_ids,
        max_tokens=call.max_tokens,
        min_tokens=call.min_tokens,
        ignore_eos=call.ignore_eos,
        now=max(state.now(), arrival_s),
        arrival_s=arrival_s,
    )
    state.wake.set()
    done = False
    try:
        if call.stream:
            response, record = await _stream(request, state, call, request_id, queue)
        else:
            response, record = await _collect(request, state, call, request_id, queue)
        done = True
        return response
    except _Dropped:
        _drop_connection(request)  # injected fault: the client sees the connection reset
        return web.Response(status=500)
    finally:
        state.streams.pop(request_id, None)
        if not done:
            record = state.engine.abort(request_id, now=state.now())
            if record is not None:
                state.wake.set()
                log.info("request aborted request_id=%s reason=connection-closed", request_id)
        if span is not None:
            _end_span(span, record, aborted=not done)


def _end_span(span: Span, record: RequestRecord | None, *, aborted: bool) -> None:
    """The request's tokens and the simulated GPU's latencies, as vLLM reports them."""
    if record is None:
        NodeTracing.finish(span, error="aborted" if aborted else None)
        return
    first = record.first_token_s
    scheduled = record.first_scheduled_s
    NodeTracing.finish(
        span,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.generation_tokens,
        time_in_queue_s=None if scheduled is None else max(0.0, scheduled - record.queued_s),
        time_to_first_token_s=None if first is None else max(0.0, first - record.arrival_s),
        e2e_s=max(0.0, record.finished_s - record.arrival_s),
        error="aborted" if aborted else None,
    )


async def _collect(
    request: web.Request,
    state: NodeState,
    call: _Call,
    request_id: str,
    queue: asyncio.Queue[TokenEvent | RequestRecord],
) -> tuple[web.StreamResponse, RequestRecord]:
    texts: list[str] = []
    finish_reason = "stop"
    drop_after = state.faults.drop_after_tokens
    while True:
        item = await queue.get()
        if isinstance(item, RequestRecord):
            break
        texts.append(item.text)
        if drop_after is not None and len(texts) >= drop_after:
            raise _Dropped
        if item.finish_reason is not None:
            finish_reason = item.finish_reason
    created = int(time.time())
    text = "".join(texts)
    choice: dict[str, Any]
    if call.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    answer = web.json_response(
        {
            "id": request_id,
            "object": "chat.completion" if call.chat else "text_completion",
            "created": created,
            "model": state.config.model,
            "choices": [choice],
            "usage": _usage(item),
        }
    )
    return answer, item


async def _stream(
    request: web.Request,
    state: NodeState,
    call: _Call,
    request_id: str,
    queue: asyncio.Queue[TokenEvent | RequestRecord],
) -> tuple[web.StreamResponse, RequestRecord]:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    created = int(time.time())
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    model = state.config.model

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk: dict[str, Any] = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    sent = 0
    drop_after = state.faults.drop_after_tokens
    while True:
        item = await queue.get()
        if isinstance(item, RequestRecord):
            break
        if call.chat and sent == 0:
            # as vLLM: the role chunk goes out with the first engine output, not before the
            # prefill, so a proxy's first byte is the first token
            await send(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        if call.chat:
            await send(
                [
                    {
                        "index": 0,
                        "delta": {"content": item.text},
                        "logprobs": None,
                        "finish_reason": item.finish_reason,
                    }
                ]
            )
        else:
            await send(
                [
                    {
                        "index": 0,
                        "text": item.text,
                        "logprobs": None,
                        "finish_reason": item.finish_reason,
                    }
                ]
            )
        sent += 1
        if drop_after is not None and sent >= drop_after and item.finish_reason is None:
            raise _Dropped
    if call.include_usage:
        await send([], usage=_usage(item))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response, item


# -- serving -----------------------------------------------------------------------------------


async def start(
    app: web.Application, *, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve ``app``; returns the runner (call ``cleanup()`` to stop) and the bound port.

    Handler cancellation is on, so a client that disconnects cancels its handler and so aborts
    its request in the engine, as vLLM does.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)
