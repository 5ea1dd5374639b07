"""``meridian-sim``: run a simulated vLLM node, or list the GPU profiles.

meridian-sim node --port 8001 --profile h100-llama3-8b [--model NAME] [--time-scale X]
                  [--seed N] [--host 127.0.0.1] [--legacy-metrics]
meridian-sim profiles
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import service
from simulator import node, profile

log = logging.getLogger("meridian.sim")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
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
    n.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub.add_parser("profiles", help="list the built-in GPU profiles")
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

    app = node.create_app(config, exit_hook=exit_now)
    await service.serve(app, host=host, port=port, handler_cancellation=True, on_ready=ready)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    config = node.NodeConfig(
        profile=prof,
        model=args.model or prof.model,
        time_scale=args.time_scale,
        seed=args.seed,
        legacy_metrics=args.legacy_metrics,
    )
    try:
        asyncio.run(_serve(config, args.host, args.port))
    except OSError as exc:
        print(
            f"meridian-sim: cannot listen on {args.host}:{args.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
