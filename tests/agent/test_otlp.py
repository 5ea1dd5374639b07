"""OTLP export from the agent and the simulated node, to a real OTLP receiver in the test
(tests/support/otlp.py: aiohttp for OTLP/HTTP, grpc.aio for OTLP/gRPC, bodies decoded with
opentelemetry-proto).

- a trace through real ``meridian-agent`` and ``meridian-sim node`` processes: the client's
  ``traceparent`` is the agent span's parent, the agent's span the node's (``llm_request``,
  vLLM's name, with gen_ai attributes), one trace id; the agent's metrics arrive too, with the
  resource attributes and the configured header, whose value is never in the log;
- without export the agent forwards the client's ``traceparent`` as it came;
- a collector that is down (a closed port) or never answers (a listening socket that never
  accepts): every request is served, the export runs off the request path through a bounded
  BatchSpanProcessor, and the exporters' log lines come through one rate-limited filter;
- OTLP/gRPC;
- the settings: header values are secrets (masked by --check-config), bad URLs refused.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import secrets
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pydantic
import pytest
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from meridian_service import checkconfig, logs, version
from meridian_sim import cli as sim_cli
from meridian_sim import node, profile
from regional_agent.settings import Settings
from tests.conftest import NodeFactory
from tests.support import free_port, until
from tests.support.agent import AgentFactory, metric, openai_client
from tests.support.otlp import KIND_SERVER, OtlpReceiver
from tests.support.process import ServerProcess
from tests.support.waits import answered

MODEL = "tiny-model"  # the cpu-tiny profile's
FAST_BATCHES = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms between span batches (default 5000)


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    await r.close()


@pytest.fixture
def fast_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FAST_BATCHES.items():
        monkeypatch.setenv(name, value)


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


async def _chat(url: str, headers: dict[str, str], *, timeout_s: float = 30.0) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def _traced_node(endpoint: str, *, protocol: str = "http/protobuf") -> tuple[Any, str]:
    """An in-process simulated node exporting its spans to ``endpoint``."""
    prof = profile.load("cpu-tiny")
    config = node.NodeConfig(
        profile=prof,
        model=prof.model,
        time_scale=20.0,
        otlp_traces_endpoint=endpoint,
        otlp_traces_protocol=protocol,  # type: ignore[arg-type]
    )
    runner, port = await node.start(node.create_app(config))
    return runner, f"http://127.0.0.1:{port}"


# -- 1. one trace through real processes -----------------------------------------------------


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Callable[..., ServerProcess]]:
    """Processes stopped (SIGTERM) on a thread: the receiver, on this event loop, answers
    their last exports meanwhile."""
    started: list[ServerProcess] = []

    def start(argv: list[str], name: str) -> ServerProcess:
        env = {**os.environ, **FAST_BATCHES}
        process = ServerProcess(argv, log_path=tmp_path / f"{name}.log", env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        await asyncio.to_thread(process.stop)


async def test_one_trace_spans_client_agent_and_node_and_the_agent_exports_its_metrics(
    receiver: OtlpReceiver, processes: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    collector = await receiver.start()
    node_port, agent_port = free_port(), free_port()
    node_url, agent_url = f"http://127.0.0.1:{node_port}", f"http://127.0.0.1:{agent_port}"
    sim = processes(
        [
            sys.executable,
            "-m",
            "meridian_sim.cli",
            "node",
            "--port",
            str(node_port),
            "--profile",
            "cpu-tiny",
            "--time-scale",
            "20",
            "--log-level",
            "WARNING",
            "--otlp-traces-endpoint",
            f"{collector}/v1/traces",
        ],
        "node",
    )
    header_secret = "otlp-" + secrets.token_hex(8)
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {agent_port}\n\n'
        f'[[nodes]]\nurl = "{node_url}"\n\n'
        "[workers]\ncount = 1\n\n"  # one process: one instance id, agent-otlp-1
        '[region]\nid = "eu-west"\ngeo = "eu"\nagent_id = "agent-otlp-1"\n\n'
        f'[otel]\nendpoint = "{collector}"\nmetrics_interval_s = 0.5\n'
        f'headers = {{ "x-collector-key" = "{header_secret}" }}\n'
    )
    agent = processes(
        [
            sys.executable,
            "-m",
            "regional_agent.cli",
            "--config",
            str(config),
            "--log-level",
            "INFO",
        ],
        "agent",
    )
    await answered(f"{node_url}/health", sim, "meridian-sim")
    await answered(f"{agent_url}/ready", agent, "meridian-agent")

    trace_id, client_span, traceparent = _traceparent()
    answer = await _chat(agent_url, {"traceparent": traceparent, "tracestate": "client=1"})

    def both() -> bool:
        return bool(receiver.spans_of("meridian-agent", trace_id=trace_id)) and bool(
            receiver.spans_of("meridian-sim", trace_id=trace_id)
        )

    await until(both, 20, "the agent's and the node's spans of the trace")
    (proxy,) = receiver.spans_of("meridian-agent", trace_id=trace_id)
    (engine,) = receiver.spans_of("meridian-sim", trace_id=trace_id)
    assert (proxy.name, proxy.kind) == ("agent.request", KIND_SERVER)
    assert proxy.parent_span_id == client_span  # a child of the client's span
    assert engine.parent_span_id == proxy.span_id  # a child of the agent's, not its sibling
    assert engine.span_id not in (proxy.span_id, client_span)
    assert (engine.name, engine.kind) == ("llm_request", KIND_SERVER)
    usage = answer["usage"]
    assert engine.attributes["gen_ai.response.model"] == MODEL
    assert engine.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] > 0
    assert engine.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert engine.attributes["gen_ai.request.max_tokens"] == 4
    assert engine.attributes["gen_ai.latency.e2e"] > 0
    assert engine.attributes["gen_ai.request.id"] == answer["id"]
    assert proxy.attributes["http.status_code"] == 200
    assert proxy.attributes["meridian.node"] == f"127.0.0.1:{node_port}"
    assert proxy.resource["service.version"] == version.version()
    assert proxy.resource["meridian.region"] == "eu-west"
    assert proxy.resource["service.instance.id"] == "agent-otlp-1"
    assert engine.resource["service.version"] == version.version()

    def requests_counted() -> bool:
        return (
            max(
                receiver.values("meridian-agent", "meridian_agent_requests", status="200"),
                default=0,
            )
            >= 1
        )

    await until(requests_counted, 10, "meridian_agent_requests at /v1/metrics")
    point = next(p for p in receiver.points if p.metric == "meridian_agent_requests")
    assert point.resource["service.name"] == "meridian-agent"
    assert point.resource["meridian.region"] == "eu-west"
    assert point.resource["service.instance.id"] == "agent-otlp-1"
    build = receiver.values("meridian-agent", "meridian_agent_build_info", region="eu-west")
    assert build and set(build) == {1}
    agent_exports = [h for path, h in receiver.requests if h.get("x-collector-key")]
    assert agent_exports and all(h["x-collector-key"] == header_secret for h in agent_exports)
    paths = {path for path, h in receiver.requests if h.get("x-collector-key")}
    assert paths == {"/v1/traces", "/v1/metrics"}
    log = agent.log_tail(1_000_000)
    assert "exports over OTLP" in log and "headers=x-collector-key" in log, log[-2000:]
    assert header_secret not in log


async def test_without_export_the_client_traceparent_goes_to_the_node_as_it_came(
    receiver: OtlpReceiver, start_agent: AgentFactory, fast_batches: None
) -> None:
    collector = await receiver.start()
    runner, node_url = await _traced_node(f"{collector}/v1/traces")
    try:
        handle = await start_agent([node_url])
        assert handle.edge.instruments.tracing is False
        trace_id, client_span, traceparent = _traceparent()
        await _chat(handle.url, {"traceparent": traceparent})
        await until(
            lambda: bool(receiver.spans_of("meridian-sim", trace_id=trace_id)), 10, "node span"
        )
        (engine,) = receiver.spans_of("meridian-sim", trace_id=trace_id)
        assert engine.parent_span_id == client_span
        assert receiver.spans_of("meridian-agent") == []
    finally:
        await runner.cleanup()


# -- 2. a collector that is down or never answers ---------------------------------------------


def _export_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if any(r.name == p or r.name.startswith(p + ".") for p in logs.EXPORT_LOGGERS)
    ]


async def test_a_collector_that_is_down_costs_requests_nothing_and_is_logged_once(
    sim_node: NodeFactory,
    start_agent: AgentFactory,
    fast_batches: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    closed = free_port()  # nothing listens there: every export is refused
    handle = await start_agent(
        [await sim_node()],
        otel={
            "endpoint": f"http://127.0.0.1:{closed}",
            "timeout_s": 1.0,
            "metrics_interval_s": 0.2,
        },
    )
    export = handle.edge.instruments.export
    assert export is not None and isinstance(export.span_processor, BatchSpanProcessor)
    assert export.metric_reader is not None
    limiter = logs.install_export_filter()
    dropped_before = limiter.dropped_total
    async with openai_client(handle.url, timeout=10.0) as client:
        for batch in range(5):
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"hello {batch} {i}"}],
                        max_tokens=3,
                        extra_headers={"traceparent": _traceparent()[2]},
                    )
                    for i in range(10)
                )
            )
            assert all(r.choices[0].message.content for r in replies)
    # the exports failed, again and again (spans every 100 ms, metrics every 200 ms)
    await until(lambda: limiter.dropped_total - dropped_before >= 5, 15, "failed exports")
    records = _export_records(caplog)
    assert len(records) <= 1, [r.getMessage() for r in records]
    for record in records:  # one line, no traceback, saying what it is
        text = record.getMessage()
        assert text.startswith("OTLP export: ") and "\n" not in text
        assert record.exc_info is None
    assert await metric(handle.url, "meridian_agent_requests_total", status="200") == 50


async def test_a_collector_that_never_answers_holds_no_request(
    sim_node: NodeFactory, start_agent: AgentFactory, fast_batches: None
) -> None:
    """A listening socket that never accepts: the exporter's connection is queued by the
    kernel and its request never answered, so every export hangs for its timeout."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        port = hung.getsockname()[1]
        handle = await start_agent(
            [await sim_node()],
            otel={
                "endpoint": f"http://127.0.0.1:{port}",
                "timeout_s": 2.0,
                "metrics_interval_s": 0.2,
                "max_queue_size": 16,
            },
        )
        export = handle.edge.instruments.export
        assert export is not None
        processor = export.span_processor
        assert isinstance(processor, BatchSpanProcessor)  # ending a span only queues it
        batches = processor._batch_processor
        assert batches._max_queue_size == 16  # bounded: beyond it spans are dropped

        async def one(i: int) -> None:
            # the request's own deadline; the exporter waits 2 s for each batch meanwhile
            await _chat(handle.url, {"traceparent": _traceparent()[2]}, timeout_s=10.0)

        for batch in range(5):
            await asyncio.gather(*(one(batch * 10 + i) for i in range(10)))
        assert len(batches._queue) <= 16
        # and the exporter was at it all along: its connection waits in the socket's backlog
        hung.setblocking(False)
        connection = None
        for _ in range(100):
            try:
                connection, _ = hung.accept()
                break
            except BlockingIOError:
                await asyncio.sleep(0.05)
        assert connection is not None, "the exporter never connected"
        connection.close()
        assert await metric(handle.url, "meridian_agent_requests_total", status="200") == 50


# -- 3. OTLP/gRPC --------------------------------------------------------------------------------


async def test_spans_and_metrics_over_grpc(
    receiver: OtlpReceiver, start_agent: AgentFactory, fast_batches: None
) -> None:
    collector = await receiver.start_grpc()
    runner, node_url = await _traced_node(collector, protocol="grpc")
    try:
        handle = await start_agent(
            [node_url],
            otel={
                "endpoint": collector,
                "protocol": "grpc",
                "metrics_interval_s": 0.3,
                "headers": {"X-Collector-Key": "grpc-key"},
            },
        )
        trace_id, client_span, traceparent = _traceparent()
        await _chat(handle.url, {"traceparent": traceparent})

        def arrived() -> bool:
            return (
                bool(receiver.spans_of("meridian-agent", trace_id=trace_id))
                and bool(receiver.spans_of("meridian-sim", trace_id=trace_id))
                and bool(receiver.values("meridian-agent", "meridian_agent_requests"))
            )

        await until(arrived, 15, "spans and metrics over gRPC")
        (proxy,) = receiver.spans_of("meridian-agent", trace_id=trace_id)
        (engine,) = receiver.spans_of("meridian-sim", trace_id=trace_id)
        assert proxy.parent_span_id == client_span and engine.parent_span_id == proxy.span_id
        keyed = [
            h for path, h in receiver.requests if path == "grpc:traces" and "x-collector-key" in h
        ]
        assert keyed and keyed[0]["x-collector-key"] == "grpc-key"
    finally:
        await runner.cleanup()


async def test_parent_based_sampling_traces_what_the_client_sampled_and_no_more(
    receiver: OtlpReceiver, start_agent: AgentFactory, sim_node: NodeFactory, fast_batches: None
) -> None:
    """``otel.trace_sample_ratio = 0``: a request whose traceparent says sampled (01) gets its
    span, one that says not sampled (00) or that brings no trace context gets none; and the
    node still gets the client's context when the agent made no span."""
    collector = await receiver.start()
    node_url = await sim_node()
    handle = await start_agent(
        [node_url], otel={"endpoint": collector, "metrics": False, "trace_sample_ratio": 0.0}
    )
    sampled_id, _, sampled = _traceparent()
    unsampled_id, _, unsampled = _traceparent()
    await _chat(handle.url, {"traceparent": unsampled[:-2] + "00"})
    await _chat(handle.url, {})
    await _chat(handle.url, {"traceparent": sampled, "X-Request-ID": "traced-request-7"})
    await until(
        lambda: bool(receiver.spans_of("meridian-agent", trace_id=sampled_id)), 10, "the span"
    )
    await asyncio.sleep(0.3)  # a batch later: nothing else arrives
    spans = receiver.spans_of("meridian-agent")
    assert [s.trace_id for s in spans] == [sampled_id]
    assert spans[0].attributes["meridian.model"] == MODEL  # a recorded span has its attributes
    assert spans[0].attributes["meridian.request_id"] == "traced-request-7"  # as the log lines
    assert unsampled_id not in {s.trace_id for s in spans}


async def test_without_tracing_the_agent_makes_no_span_at_all(start_agent: AgentFactory) -> None:
    """Nothing exports the agent's spans: its tracer is the API's no-op tracer, so a request
    costs no SDK span (docs/benchmarks.md, "Router CPU per request")."""
    handle = await start_agent([])
    instruments = handle.edge.instruments
    assert instruments.tracing is False
    with instruments.tracer.start_as_current_span("probe") as span:
        assert not span.is_recording()


# -- 4. the settings and the log filter -------------------------------------------------------


def test_header_values_are_secrets_and_bad_urls_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MERIDIAN_AGENT_OTEL__HEADERS", json.dumps({"x-api-key": "s3cret"}))
    monkeypatch.setenv("MERIDIAN_AGENT_OTEL__ENDPOINT", "https://collector.example:4318/")
    settings = Settings()
    assert settings.otel.endpoint == "https://collector.example:4318"
    assert settings.otel.plain_headers() == {"x-api-key": "s3cret"}
    assert "s3cret" not in repr(settings.otel) and "s3cret" not in str(settings)
    shown = checkconfig.effective(settings)["otel"]
    assert shown["headers"] == {"x-api-key": checkconfig.MASK}
    assert shown["protocol"] == "http/protobuf" and shown["traces"] is shown["metrics"] is True
    monkeypatch.delenv("MERIDIAN_AGENT_OTEL__HEADERS")
    monkeypatch.delenv("MERIDIAN_AGENT_OTEL__ENDPOINT")
    for bad in (
        {"endpoint": "collector:4318"},
        {"endpoint": "ftp://collector"},
        {"protocol": "http/json"},
        {"headers": {"bad name": "x"}},
        {"headers": {"x-key": "a\r\nInjected: 1"}},
        {"timeout_s": 0},
    ):
        with pytest.raises(pydantic.ValidationError) as caught:
            Settings(otel=bad)
        assert caught.value.errors()[0]["loc"][0] == "otel"
        (line,) = checkconfig.explain(
            caught.value, model=Settings, config_file=None, env_prefix="MERIDIAN_AGENT_"
        )
        assert line.startswith("environment MERIDIAN_AGENT_OTEL__") or "otel." in line, line
        assert "Injected" not in line  # what a start prints: never a header's value


def test_the_export_filter_lets_one_line_a_minute_through_with_a_count() -> None:
    now = [0.0]
    limiter = logs.OncePerInterval(what="OTLP export", interval_s=60.0, clock=lambda: now[0])
    logger = logging.getLogger("tests.otlp.limited")
    logger.propagate = False
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    logger.addFilter(limiter)
    try:
        for i in range(100):
            now[0] = i * 0.5  # 100 failures in 50 s
            try:
                raise ConnectionError(f"refused {i}\nsecond line")
            except ConnectionError:
                logger.exception("Failed to export spans batch")
        now[0] = 61.0
        logger.warning("Failed to export metrics batch due to timeout")
    finally:
        logger.removeFilter(limiter)
    assert seen == [
        "OTLP export: Failed to export spans batch (ConnectionError: refused 0 second line)",
        "OTLP export: Failed to export metrics batch due to timeout; 99 more OTLP export "
        "lines not logged in the last 60s",
    ]
    assert limiter.dropped_total == 99


def test_the_filter_is_on_the_exporters_loggers() -> None:
    for module in ("grpc", "http"):  # what Export imports when it exports
        importlib.import_module(f"opentelemetry.exporter.otlp.proto.{module}.trace_exporter")
    limiter = logs.install_export_filter()
    for name in (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.grpc.exporter",
        "opentelemetry.sdk._shared_internal",
        "opentelemetry.sdk.metrics._internal.export",
    ):
        assert limiter in logging.getLogger(name).filters, name
    assert logs.install_export_filter() is limiter


def test_the_node_refuses_a_bad_otlp_endpoint_or_protocol(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["node", "--port", "0", "--profile", "cpu-tiny", "--otlp-traces-endpoint"]
    assert sim_cli.main([*argv, "collector:4318"]) == 2
    assert "--otlp-traces-endpoint: " in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    assert sim_cli.main([*argv, "http://127.0.0.1:4318/v1/traces"]) == 2
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf" in (
        capsys.readouterr().err
    )
