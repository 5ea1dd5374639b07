"""``meridian-sim``: run a simulated vLLM node, or list the GPU profiles.

meridian-sim node --port 8001 --profile h100-llama3-8b [--model NAME] [--time-scale X]
                  [--seed N] [--host 127.0.0.1] [--legacy-metrics]
                  [--otlp-traces-endpoint URL]
meridian-sim profiles
meridian-sim fleet --trace FILE --nodes N --policy NAME --load X [--regions K]
                   [--agents-per-region A [--workers]] [--scrape-interval-s S] [--profile NAME]
                   [--duration-s D] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from meridian_service import hygiene, loops, serving, version
from meridian_sim import fleet, node, profile, tracing, workloads
from meridian_sim.kv_publisher import KvEventsConfig
from policies import routing

log = logging.getLogger("meridian.sim")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meridian-sim", description=__doc__.split("\n")[0])
    version.add_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    n = sub.add_parser("node", help="serve one simulated vLLM node (OpenAI API, /metrics)")
    n.add_argument("--port", type=_port, required=True, help="TCP port; 0 picks a free one")
    n.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    n.add_argument(
        "--profile",
        required=True,
        help="built-in profile name (see 'meridian-sim profiles') or a path to a .toml profile",
    )
    n.add_argument("--model", help="served model name (default: the profile's model)")
    n.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        help="run this many times faster than the profiled GPU (default 1)",
    )
    n.add_argument("--seed", type=int, default=0, help="seed for output lengths and faults")
    n.add_argument(
        "--legacy-metrics",
        action="store_true",
        help="also emit pre-0.10 vLLM names (vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_*)",
    )
    n.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export an llm_request span per request over OTLP, as vLLM's flag does: "
        "http://collector:4318/v1/traces (http/protobuf, the default) or "
        "http://collector:4317 with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc",
    )
    n.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help="publish KV-cache events as vLLM's flag of that name does, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (tcp://127.0.0.1:* binds a free port; the log '
        "line names it)",
    )
    n.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub.add_parser("profiles", help="list the built-in GPU profiles")
    f = sub.add_parser(
        "fleet", help="simulate a fleet behind regional agents on a trace, in virtual time"
    )
    f.add_argument("--trace", required=True, help="Mooncake .jsonl or Azure .csv trace")
    f.add_argument("--nodes", type=_positive_int, required=True, help="GPUs (one engine each)")
    f.add_argument(
        "--policy", required=True, choices=fleet.POLICIES, help="routing policy, or oracle"
    )
    f.add_argument(
        "--load",
        type=_positive_float,
        required=True,
        help="arrival rate as a fraction of the fleet's capacity (0.8: 80 %%)",
    )
    f.add_argument("--regions", type=_positive_int, default=1, help="regions (default 1)")
    f.add_argument(
        "--agents-per-region",
        type=int,
        default=1,
        help="agent replicas per region, each with its own policy, queue and in-flight counts; "
        "a session sticks to one (default 1)",
    )
    f.add_argument(
        "--workers",
        action="store_true",
        help="the agents of a region are the workers of one agent (meridian-agent --workers): "
        "summed counts, shared prefix records, requests spread per request",
    )
    f.add_argument(
        "--scrape-interval-s",
        type=_nonneg_float,
        default=1.0,
        help="telemetry scrape interval, seconds; 0 = fresh (default 1, the agent's)",
    )
    f.add_argument(
        "--stale-after-s",
        type=_positive_float,
        help="a scrape older than this is unknown (default max(1, 4 x scrape interval))",
    )
    f.add_argument("--profile", default="h100-llama3-8b", help="node profile (default h100)")
    f.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=131072,
        help="context limit of the nodes (default 131072, Llama-3.1-8B's; the profile's "
        "timing and KV cache are kept)",
    )
    f.add_argument(
        "--duration-s",
        type=_positive_float,
        help="keep the arrivals of the first D seconds after scaling (default: whole trace)",
    )
    f.add_argument("--limit", type=_positive_int, help="read at most this many requests")
    f.add_argument(
        "--capacity-rps",
        type=_positive_float,
        help="one node's capacity in requests/s (default: measured on the trace's mix)",
    )
    f.add_argument("--slots", type=_positive_int, default=64, help="agent slots per node")
    f.add_argument(
        "--prefix-capacity-blocks",
        type=_positive_int,
        help="the agent's prefix index size, entries (default RoutingConfig's, 200000)",
    )
    f.add_argument(
        "--prefix-stride-blocks",
        type=_positive_int,
        help="index every k-th prompt block and the last (default RoutingConfig's, 32)",
    )
    f.add_argument(
        "--prefix-dense-head-blocks",
        type=_nonneg_int,
        help="index every one of a prompt's first blocks before the stride (default "
        "RoutingConfig's, 32; 0: stride from the first block)",
    )
    f.add_argument(
        "--kv-events",
        action="store_true",
        help="the engines publish KV-cache events and the agents route on the precise index "
        "they feed (prefix_aware, meridian; needs the profile's block size, 16)",
    )
    f.add_argument(
        "--kv-event-delay-s",
        type=_nonneg_float,
        default=0.05,
        help="from a step's end to the agents' index, seconds (default 0.05)",
    )
    f.add_argument(
        "--num-gpu-blocks",
        type=_positive_int,
        help="KV-cache blocks per node instead of the profile's (a smaller cache: pressure)",
    )
    f.add_argument("--seed", type=int, default=0, help="seed for routing and scrape phases")
    f.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    f.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


async def _serve(config: node.NodeConfig, host: str, port: int) -> None:
    def exit_now() -> None:
        log.warning("exiting on injected fault")
        logging.shutdown()
        os._exit(3)

    def ready(bound: int) -> None:
        p = config.profile
        log.info(
            "meridian-sim node listening url=http://%s:%d model=%s profile=%s block_size=%d "
            "num_gpu_blocks=%d time_scale=%g",
            host, bound, config.model, p.name, p.block_size, p.num_gpu_blocks, config.time_scale,
        )  # fmt: skip
        publisher = app[node.STATE].kv_publisher
        if publisher is not None:
            log.info(
                "meridian-sim kv events endpoint=%s replay_endpoint=%s",
                publisher.endpoint,
                publisher.replay_endpoint,
            )

    app = node.create_app(config, exit_hook=exit_now)
    # vLLM's server (uvicorn) closes no kept-alive connection after a number of requests: the
    # agent's pool to a simulated node behaves as it does to vLLM
    limits = hygiene.ConnectionLimits(max_requests_per_connection=0)
    await serving.serve(
        app, host=host, port=port, handler_cancellation=True, limits=limits,
        label="meridian-sim", on_ready=ready,
    )  # fmt: skip


def _format(value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _prefix_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The prefix index flags given, as RoutingConfig fields (the rest stay default)."""
    given = {
        "prefix_capacity_blocks": args.prefix_capacity_blocks,
        "prefix_stride_blocks": args.prefix_stride_blocks,
        "prefix_dense_head_blocks": args.prefix_dense_head_blocks,
    }
    return {k: v for k, v in given.items() if v is not None}


def _fleet(args: argparse.Namespace) -> int:
    try:
        prof = fleet.with_context(profile.load(args.profile), args.max_model_len)
        if args.num_gpu_blocks is not None:
            prof = dataclasses.replace(prof, num_gpu_blocks=args.num_gpu_blocks)
        requests = workloads.read_trace(args.trace, limit=args.limit)
        config = fleet.FleetConfig(
            nodes=args.nodes,
            policy=args.policy,
            regions=args.regions,
            agents_per_region=args.agents_per_region,
            workers=args.workers,
            scrape_interval_s=args.scrape_interval_s,
            stale_after_s=args.stale_after_s,
            slots_per_node=args.slots,
            seed=args.seed,
            routing=routing.RoutingConfig(**_prefix_overrides(args)),
            kv_events=args.kv_events,
            kv_event_delay_s=args.kv_event_delay_s,
        )
        progress = None if args.quiet else sys.stderr
        if progress is not None and args.capacity_rps is None:
            print("fleet: measuring one node's capacity on the trace's mix", file=progress)
        work = fleet.at_load(
            requests,
            prof,
            nodes=args.nodes,
            load=args.load,
            slots_per_node=args.slots,
            duration_s=args.duration_s,
            node_capacity_rps=args.capacity_rps,
        )
        result = fleet.simulate(prof, work.requests, config, progress=progress)
    except (profile.ProfileError, workloads.WorkloadError, fleet.FleetError) as exc:
        print(f"meridian-sim: {exc}", file=sys.stderr)
        return 2
    figures: dict[str, float | int | str] = {
        "trace": str(args.trace),
        "profile": prof.name,
        "load": args.load,
        "node_capacity_rps": work.node_capacity_rps,
        "arrival_rate_per_s": work.rate_per_s,
        **result.summary,
    }
    for key, value in figures.items():
        print(f"{key}: {_format(value)}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "fleet":
        return _fleet(args)
    if args.command == "profiles":
        for name in profile.builtin_names():
            p = profile.load(name)
            print(f"{name:18} {p.description}")
        return 0
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        prof = profile.load(args.profile)
    except profile.ProfileError as exc:
        print(f"meridian-sim: {exc}", file=sys.stderr)
        return 2
    try:
        protocol = tracing.protocol_from_env()
        if args.otlp_traces_endpoint is not None:
            tracing.check_endpoint(args.otlp_traces_endpoint)
        kv = None
        if args.kv_events_config is not None:
            kv = KvEventsConfig.parse(args.kv_events_config)
    except ValueError as exc:
        print(f"meridian-sim: {exc}", file=sys.stderr)
        return 2
    config = node.NodeConfig(
        profile=prof,
        model=args.model or prof.model,
        time_scale=args.time_scale,
        seed=args.seed,
        legacy_metrics=args.legacy_metrics,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        otlp_traces_protocol=protocol,
        kv_events=kv,
    )
    try:
        loops.run(_serve(config, args.host, args.port))
    except OSError as exc:
        print(
            f"meridian-sim: cannot listen on {args.host}:{args.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
