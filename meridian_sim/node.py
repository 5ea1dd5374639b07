"""A vLLM-compatible OpenAI server over the simulated engine (``meridian-sim node``).

Endpoints, as vLLM's OpenAI server has them: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/responses`` (streaming and not), ``/v1/embeddings``,
``/tokenize``, ``/detokenize``, ``/health``, ``/metrics`` and ``/reset_prefix_cache``.  Fault
injection for tests and drills lives under ``/admin/faults``.

What a request may ask besides its prompt, as vLLM takes it: ``n`` choices (each its own
engine request; the prompt is cached once), ``logprobs``/``top_logprobs`` (made-up values of
vLLM's shape), ``tools`` with ``tool_choice`` naming a function or ``"required"`` (a call to it,
``finish_reason`` ``tool_calls``, as a vLLM started with ``--tool-call-parser``; ``"auto"`` is
refused as vLLM refuses it without ``--enable-auto-tool-choice``), ``response_format``
(``json_object``, or ``json_schema``: the content is the schema's smallest instance) and
``seed`` (accepted; the text is the node's).
Embeddings are deterministic: ``EMBEDDING_DIMENSIONS`` floats from the token ids, unit length,
each input a prefill in the engine.  ``/detokenize`` knows the pieces of the text the node has
tokenised and generated (the stand-in tokenizer is a hash).

The engine runs in one background task: it takes a step, sleeps for the step's simulated
duration divided by ``time_scale``, then hands the step's tokens to the waiting handlers.  A
client that goes away (a closed stream, or a cancelled non-streaming request) aborts its
request in the engine, which frees its KV blocks and counts it under
``request_success{finished_reason="abort"}``, as vLLM does.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import random
import struct
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from aiohttp import web
from opentelemetry.trace import Span

from meridian_sim.engine import (
    GENERATED_WORDS,
    Engine,
    RequestRecord,
    RequestTooLarge,
    TokenEvent,
)
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
    pieces: dict[int, str] = field(default_factory=dict)  # token id -> text, for /detokenize
    # the last responses made, for GET /v1/responses/{id} (vLLM's store)
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
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
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
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
    _learn(state, text)
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": state.config.profile.max_model_len,
            "tokens": list(tokens),
            "token_strs": prompt.pieces(text) if body.get("return_token_strs") else None,
        }
    )


_MAX_PIECES: Final = 100_000


def _learn(state: NodeState, text: str) -> None:
    """Remember the pieces of ``text`` by id, so /detokenize can give them back."""
    for piece in prompt.pieces(text):
        if len(state.pieces) >= _MAX_PIECES:
            return
        state.pieces.setdefault(prompt.piece_id(piece), piece)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    _check_model(state, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    unknown = [t for t in tokens if t not in state.pieces and t not in _WORD_TEXT]
    if unknown:
        raise ApiError(
            400,
            f"token id {unknown[0]} is not one this node has tokenised or generated "
            "(meridian-sim's tokenizer is a hash: it detokenizes only ids it has seen)",
            param="tokens",
        )
    text = "".join(state.pieces.get(t) or _WORD_TEXT[t] for t in tokens)
    return web.json_response({"prompt": text})


_WORD_TEXT: Final = {prompt.tokenize(w)[0]: w for w in GENERATED_WORDS}


# -- embeddings --------------------------------------------------------------------------------

EMBEDDING_DIMENSIONS: Final = 256


def embedding_of(token_ids: tuple[int, ...]) -> list[float]:
    """A unit vector of :data:`EMBEDDING_DIMENSIONS` floats determined by the token ids."""
    seed = zlib.crc32(struct.pack(f"<{len(token_ids)}I", *token_ids))
    rng = random.Random(seed)
    raw = [rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_DIMENSIONS)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _embedding_inputs(value: object) -> list[tuple[int, ...]]:
    """``input`` as vLLM takes it: a string, token ids, or a list of either."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(type(t) is int for t in value)
    ):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(
            400,
            "'input' must be a string, a list of strings, a list of token ids or a list of those",
            param="input",
        )
    out = []
    for item in value:
        if isinstance(item, str) and item:
            out.append(prompt.tokenize(item))
        elif (
            isinstance(item, list) and item and all(type(t) is int and 0 <= t < 2**32 for t in item)
        ):
            out.append(tuple(item))
        else:
            raise ApiError(
                400, "each 'input' must be a non-empty string or token id list", param="input"
            )
    return out


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _json_body(request)
    _check_model(state, body)
    inputs = _embedding_inputs(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(
            400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    if body.get("dimensions") is not None:
        raise ApiError(
            400,
            f'Model "{state.config.model}" does not support matryoshka representation, '
            "changing output dimensions will lead to poor results.",
            param="dimensions",
        )
    limit = state.config.profile.max_model_len
    for ids in inputs:
        if len(ids) > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input.",
                param="input",
            )
    injected = state.faults.injected_error()
    if injected is not None:
        return error_response(injected, f"injected fault: HTTP {injected}")
    request_id = f"embd-{uuid.uuid4().hex}"
    await asyncio.gather(
        *(_prefill(state, f"{request_id}-{i}", ids) for i, ids in enumerate(inputs))
    )
    data = []
    for i, ids in enumerate(inputs):
        vector = embedding_of(ids)
        shown: list[float] | str = vector
        if encoding == "base64":
            shown = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": i, "object": "embedding", "embedding": shown})
    tokens = sum(len(ids) for ids in inputs)
    return web.json_response(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": state.config.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


async def _prefill(state: NodeState, request_id: str, token_ids: tuple[int, ...]) -> None:
    """Run ``token_ids`` through the engine as a prefill (what pooling costs), aborting it
    if the client goes away."""
    queue: asyncio.Queue[TokenEvent | RequestRecord] = asyncio.Queue()
    state.streams[request_id] = queue
    now = state.now()
    state.engine.add(request_id, token_ids, max_tokens=1, now=now, arrival_s=now)
    state.wake.set()
    done = False
    try:
        while not isinstance(await queue.get(), RequestRecord):
            pass
        done = True
    finally:
        state.streams.pop(request_id, None)
        if not done and state.engine.abort(request_id, now=state.now()) is not None:
            state.wake.set()


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


Api = Literal["chat", "completion", "responses"]
_MAX_N: Final = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class _Call:
    api: Api
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    tool: str | None = None  # the function the answer calls (tool_choice)
    content: str | None = None  # a fixed answer (response_format), in place of the words
    body: Mapping[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.api == "chat"


def _parse_call(state: NodeState, body: Mapping[str, Any], *, api: Api) -> _Call:
    _check_model(state, body)
    if api == "chat":
        token_ids = prompt.tokenize(_render(body.get("messages"), True))
    elif api == "responses":
        token_ids = prompt.tokenize(_render(_responses_input(body), True))
    else:
        token_ids = _completion_prompt(body.get("prompt"))
    n = _int_param(body, "n", minimum=1) or 1
    if n > _MAX_N:
        raise ApiError(400, f"'n' must be at most {_MAX_N}, got {n}", param="n")
    if api == "responses" and n != 1:
        raise ApiError(400, "the Responses API has no 'n'", param="n")
    limit_name = "max_output_tokens" if api == "responses" else "max_tokens"
    max_tokens = _int_param(body, limit_name, minimum=1)
    if api == "chat" and max_tokens is None:
        max_tokens = _int_param(body, "max_completion_tokens", minimum=1)
    limit = state.config.profile.max_model_len
    if len(token_ids) >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{len(token_ids)} tokens. Please reduce the length of the prompt.",
            param={"chat": "messages", "completion": "prompt"}.get(api, "input"),
        )
    if max_tokens is None:
        max_tokens = (
            _COMPLETIONS_DEFAULT_MAX_TOKENS if api == "completion" else limit - len(token_ids)
        )
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
        raise ApiError(400, str(exc), param=limit_name) from exc
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be true or false", param="ignore_eos")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    return _Call(
        api=api,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        n=n,
        logprobs=_logprobs(body, api),
        tool=_tool(body) if api == "chat" else None,
        content=_fixed_content(body.get("response_format")) if api != "responses" else None,
        body=body,
    )


def _logprobs(body: Mapping[str, Any], api: Api) -> int | None:
    """How many alternatives each token's logprobs list (chat: ``logprobs`` true with
    ``top_logprobs``; completions: ``logprobs`` N); ``None`` when none are asked."""
    value = body.get("logprobs")
    if api == "chat":
        if value is None or value is False:
            return None
        if value is not True:
            raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
        top = _int_param(body, "top_logprobs", minimum=0) or 0
        if top > 20:
            raise ApiError(400, "'top_logprobs' must be at most 20", param="top_logprobs")
        return top
    if api == "completion" and value is not None:
        count = _int_param(body, "logprobs", minimum=0)
        if count is not None and count > 20:
            raise ApiError(400, "'logprobs' must be at most 20", param="logprobs")
        return count
    return None


def _tool(body: Mapping[str, Any]) -> str | None:
    """The function the answer calls: ``tool_choice`` naming one, or ``"required"`` (the
    first tool); ``None`` for ``"none"`` or no tools.  ``"auto"`` is refused as vLLM refuses
    it without ``--enable-auto-tool-choice``."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    names = [
        t["function"]["name"]
        for t in tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    if len(names) != len(tools):
        raise ApiError(
            400, "each tool must be {'type': 'function', 'function': {'name': ...}}", param="tools"
        )
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set",
            param="tool_choice",
        )
    if choice == "required":
        return str(names[0])
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in names:
        raise ApiError(
            400, f"'tool_choice' names {name!r}, which is not among 'tools'", param="tool_choice"
        )
    return str(name)


def _fixed_content(value: object) -> str | None:
    """What ``response_format`` makes the answer: ``{}`` for a JSON object, the smallest
    instance of a JSON schema; ``None`` for text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "{}"
    if kind == "json_schema":
        spec = value.get("json_schema") if isinstance(value, dict) else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "'response_format.json_schema.schema' must be an object",
                param="response_format",
            )
        return json.dumps(_instance(schema))
    raise ApiError(
        400,
        "'response_format.type' must be text, json_object or json_schema",
        param="response_format",
    )


def _instance(schema: Mapping[str, Any], depth: int = 0) -> Any:
    """The smallest value a JSON schema accepts, for the types structured output uses."""
    if depth > 16:
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0] if kind else None
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {
            name: _instance(props.get(name) or {}, depth + 1)
            for name in schema.get("required") or []
        }
    if kind == "array":
        item = schema.get("items") or {}
        return [_instance(item, depth + 1) for _ in range(int(schema.get("minItems", 0)))]
    return {"integer": 0, "number": 0, "string": "", "boolean": False}.get(str(kind))


def _responses_input(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's ``instructions`` and ``input`` as chat messages."""
    value = body.get("input")
    if value is None:
        raise ApiError(400, "'input' is required", param="input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "'input' must be a string or a list of input items", param="input")
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ApiError(
                400, f"input[{i}] must be a message with a 'role' and 'content'", param="input"
            )
        content = item.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise ApiError(400, f"input[{i}].content parts must be text", param="input")
            content = "".join(texts)  # type: ignore[arg-type]
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": content})
    return messages


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
    return await _serve(request, api="completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, api="chat")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _serve(request, api="responses")


def _usage(records: list[RequestRecord]) -> dict[str, Any]:
    """The usage of a request's choices: the prompt once (its copies are cached), every
    choice's tokens."""
    first = records[0]
    generated = sum(r.generation_tokens for r in records)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens},
    }


class _Dropped(Exception):
    """The injected ``drop_after_tokens`` fault fired: cut the connection."""


def _drop_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


_ID_PREFIXES: Final = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}


async def _serve(request: web.Request, *, api: Api) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    call = _parse_call(state, body, api=api)
    injected = state.faults.injected_error()
    if injected is not None:
        return error_response(injected, f"injected fault: HTTP {injected}")
    if state.faults.drop_after_tokens == 0:
        _drop_connection(request)
        return web.Response(status=500)

    request_id = f"{_ID_PREFIXES[api]}{uuid.uuid4().hex}"
    arrival_s = state.now()
    span = None
    if state.tracing is not None:  # vLLM's llm_request span, under the caller's traceparent
        span = state.tracing.start(
            request.headers, request_id=request_id, max_tokens=call.max_tokens
        )
    records: list[RequestRecord] = []
    overhead_ms = state.config.profile.timing.request_overhead_ms
    if overhead_ms > 0:  # the API server's and the engine hop's share of TTFT (profile.py)
        await asyncio.sleep(overhead_ms / 1000.0 / state.config.time_scale)
    queue: asyncio.Queue[TokenEvent | RequestRecord] = asyncio.Queue()
    # n choices are n engine requests (vLLM's parallel sampling); the prompt is cached once
    ids = [request_id] if call.n == 1 else [f"{request_id}-{i}" for i in range(call.n)]
    for engine_id in ids:
        state.streams[engine_id] = queue
        state.engine.add(
            engine_id,
            call.prompt_token_ids,
            max_tokens=call.max_tokens,
            min_tokens=call.min_tokens,
            ignore_eos=call.ignore_eos,
            now=max(state.now(), arrival_s),
            arrival_s=arrival_s,
        )
    state.wake.set()
    choices = _Choices(ids)
    done = False
    try:
        if api == "responses":
            writer = _stream_responses if call.stream else _collect_responses
        else:
            writer = _stream if call.stream else _collect
        job = _Job(request, state, call, request_id, queue, choices)
        response = await writer(job)
        records = choices.records
        done = True
        return response
    except _Dropped:
        _drop_connection(request)  # injected fault: the client sees the connection reset
        return web.Response(status=500)
    finally:
        for engine_id in ids:
            state.streams.pop(engine_id, None)
            if not done:
                aborted = state.engine.abort(engine_id, now=state.now())
                if aborted is not None:
                    records.append(aborted)
                    state.wake.set()
                    log.info("request aborted request_id=%s reason=connection-closed", engine_id)
        if span is not None:
            _end_span(span, records[0] if records else None, aborted=not done)


@dataclass(slots=True)
class _Choices:
    """A request's engine requests, by choice index, and what each has produced."""

    ids: list[str]
    texts: list[list[str]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    _index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {engine_id: i for i, engine_id in enumerate(self.ids)}
        self.texts = [[] for _ in self.ids]
        self.finish = ["stop"] * len(self.ids)

    def index(self, engine_id: str) -> int:
        return self._index[engine_id]

    @property
    def done(self) -> bool:
        return len(self.records) == len(self.ids)

    def take(self, item: TokenEvent | RequestRecord) -> TokenEvent | None:
        """Record one engine output; the token, if it is one."""
        if isinstance(item, RequestRecord):
            self.records.append(item)
            return None
        i = self.index(item.request_id)
        self.texts[i].append(item.text)
        if item.finish_reason is not None:
            self.finish[i] = item.finish_reason
        return item


@dataclass(frozen=True, slots=True)
class _Job:
    """What a writer (``_collect``, ``_stream`` and the Responses API's two) answers from."""

    request: web.Request
    state: NodeState
    call: _Call
    request_id: str
    queue: asyncio.Queue[TokenEvent | RequestRecord]
    choices: _Choices


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


# -- logprobs and tool calls -------------------------------------------------------------------


def _logprob(text: str, rank: int = 0) -> float:
    """A made-up but stable log-probability: the token's own, then lower for alternatives."""
    return -0.05 - (zlib.crc32(text.encode()) % 5000) / 1000.0 - 0.5 * rank


def _alternatives(text: str, k: int) -> list[str]:
    start = zlib.crc32(text.encode()) % len(GENERATED_WORDS)
    others = [w for w in GENERATED_WORDS if w != text]
    return [text, *(others[(start + j) % len(others)] for j in range(max(0, k - 1)))][: max(k, 1)]


def _chat_logprobs(texts: list[str], k: int) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t,
                "logprob": _logprob(t),
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {"token": a, "logprob": _logprob(t, r), "bytes": list(a.encode())}
                    for r, a in enumerate(_alternatives(t, k))
                ][:k],
            }
            for t in texts
        ]
    }


def _completion_logprobs(texts: list[str], k: int, offset: int = 0) -> dict[str, Any]:
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": list(texts),
        "token_logprobs": [_logprob(t) for t in texts],
        "top_logprobs": [
            {a: _logprob(t, r) for r, a in enumerate(_alternatives(t, k))} for t in texts
        ]
        if k
        else None,
        "text_offset": offsets,
    }


def _tool_call(call: _Call) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.tool, "arguments": call.content or "{}"},
    }


# -- chat and completions ----------------------------------------------------------------------


async def _collect(job: _Job) -> web.StreamResponse:
    state, call, request_id = job.state, job.call, job.request_id
    queue, choices = job.queue, job.choices
    drop_after = state.faults.drop_after_tokens
    tokens = 0
    while not choices.done:
        if choices.take(await queue.get()) is not None:
            tokens += 1
            if drop_after is not None and tokens >= drop_after:
                raise _Dropped
    out = []
    for i, texts in enumerate(choices.texts):
        text = "".join(texts) if call.content is None else call.content
        logprobs = None
        choice: dict[str, Any]
        if call.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = choices.finish[i]
            if call.tool is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [_tool_call(call)]}
                finish = "tool_calls"
            if call.logprobs is not None:
                logprobs = _chat_logprobs(texts, call.logprobs)
            choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            if call.logprobs is not None:
                logprobs = _completion_logprobs(texts, call.logprobs)
            choice = {"index": i, "text": text, "logprobs": logprobs,
                      "finish_reason": choices.finish[i]}  # fmt: skip
        choice["stop_reason"] = None
        out.append(choice)
    return web.json_response(
        {
            "id": request_id,
            "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()),
            "model": state.config.model,
            "choices": out,
            "usage": _usage(choices.records),
        }
    )


async def _event_stream(request: web.Request) -> web.StreamResponse:
    """A server-sent-events answer, its headers sent."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def _stream(job: _Job) -> web.StreamResponse:
    request, state, call, request_id = job.request, job.state, job.call, job.request_id
    queue, choices = job.queue, job.choices
    response = await _event_stream(request)
    created = int(time.time())
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    model = state.config.model

    async def send(
        chunk_choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> None:
        chunk: dict[str, Any] = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": chunk_choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    sent = [0] * len(choices.ids)
    offsets = [0] * len(choices.ids)
    drop_after = state.faults.drop_after_tokens
    while not choices.done:
        item = choices.take(await queue.get())
        if item is None:
            continue
        i = choices.index(item.request_id)
        text = item.text
        if call.content is not None:  # a fixed answer: all of it with the first token
            text = call.content if sent[i] == 0 else ""
        if call.chat and sent[i] == 0:
            # as vLLM: the role chunk goes out with the first engine output, not before the
            # prefill, so a proxy's first byte is the first token
            await send([{"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])  # fmt: skip
        if call.chat and call.tool is not None:
            delta: dict[str, Any] = {}
            if sent[i] == 0:
                delta = {"tool_calls": [{"index": 0, **_tool_call(call)}]}
            finish = None if item.finish_reason is None else "tool_calls"
            if delta or finish:
                await send([{"index": i, "delta": delta, "logprobs": None,
                             "finish_reason": finish}])  # fmt: skip
        elif call.chat:
            logprobs = None if call.logprobs is None else _chat_logprobs([item.text], call.logprobs)
            await send([{"index": i, "delta": {"content": text}, "logprobs": logprobs,
                         "finish_reason": item.finish_reason}])  # fmt: skip
        else:
            logprobs = None
            if call.logprobs is not None:
                logprobs = _completion_logprobs([item.text], call.logprobs, offsets[i])
            await send([{"index": i, "text": text, "logprobs": logprobs,
                         "finish_reason": item.finish_reason}])  # fmt: skip
        offsets[i] += len(item.text)
        sent[i] += 1
        if drop_after is not None and sum(sent) >= drop_after and item.finish_reason is None:
            raise _Dropped
    if call.include_usage:
        await send([], usage=_usage(choices.records))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# -- the Responses API -------------------------------------------------------------------------

_MAX_STORED: Final = 1000


def _store(state: NodeState, answer: dict[str, Any]) -> None:
    state.stored[answer["id"]] = answer
    while len(state.stored) > _MAX_STORED:
        state.stored.pop(next(iter(state.stored)))


async def stored_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: a response this node made, as vLLM's store keeps it."""
    response_id = request.match_info["response_id"]
    answer = request.app[STATE].stored.get(response_id)
    if answer is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return web.json_response(answer)


def _response_object(
    state: NodeState,
    call: _Call,
    request_id: str,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A Responses-API response as vLLM writes one."""
    body = call.body
    return {
        "id": request_id,
        "object": "response",
        "created_at": created,
        "model": state.config.model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata"),
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "temperature": body.get("temperature", 1.0),
        "text": None,
        "tool_choice": body.get("tool_choice", "none"),
        "tools": body.get("tools", []),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "background": False,
        "service_tier": "auto",
        "user": body.get("user"),
        "usage": usage,
    }


def _response_usage(records: list[RequestRecord]) -> dict[str, Any]:
    u = _usage(records)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _message_item(item_id: str, text: str, *, status: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    ]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content if status == "completed" or text else []}  # fmt: skip


async def _collect_responses(job: _Job) -> web.StreamResponse:
    state, call, request_id = job.state, job.call, job.request_id
    queue, choices = job.queue, job.choices
    while not choices.done:
        choices.take(await queue.get())
    text = "".join(choices.texts[0])
    status = "incomplete" if choices.finish[0] == "length" else "completed"
    item = _message_item(f"msg_{uuid.uuid4().hex[:16]}", text, status="completed")
    answer = _response_object(state, call, request_id, int(time.time()), status=status,
                              output=[item], usage=_response_usage(choices.records))  # fmt: skip
    _store(state, answer)
    return web.json_response(answer)


async def _stream_responses(job: _Job) -> web.StreamResponse:
    request, state, call, request_id = job.request, job.state, job.call, job.request_id
    queue, choices = job.queue, job.choices
    response = await _event_stream(request)
    created = int(time.time())
    item_id = f"msg_{uuid.uuid4().hex[:16]}"
    sequence = 0

    async def send(kind: str, **fields: Any) -> None:
        nonlocal sequence
        event = {**fields, "sequence_number": sequence, "type": kind}
        sequence += 1
        await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    started = False
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    while not choices.done:
        item = choices.take(await queue.get())
        if item is None:
            continue
        if not started:  # as for chat: the first bytes go out with the first token
            shell = _response_object(state, call, request_id, created, status="in_progress",
                                     output=[], usage=None)  # fmt: skip
            await send("response.created", response=shell)
            await send("response.in_progress", response=shell)
            await send("response.output_item.added", output_index=0,
                       item=_message_item(item_id, "", status="in_progress"))  # fmt: skip
            await send("response.content_part.added", **where,
                       part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
            started = True
        await send("response.output_text.delta", **where, delta=item.text, logprobs=[])
    text = "".join(choices.texts[0])
    part: dict[str, Any] = {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": None,
    }
    await send("response.output_text.done", **where, text=text, logprobs=[])
    await send("response.content_part.done", **where, part=part)
    done_item = _message_item(item_id, text, status="completed")
    await send("response.output_item.done", output_index=0, item=done_item)
    status = "incomplete" if choices.finish[0] == "length" else "completed"
    usage = _response_usage(choices.records)
    final = _response_object(state, call, request_id, created, status=status,
                             output=[done_item], usage=usage)  # fmt: skip
    _store(state, final)
    await send(f"response.{status}", response=final)
    await response.write_eof()
    return response


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
