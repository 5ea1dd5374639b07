"""``meridian-agent``: the region's OpenAI-compatible routing proxy.

    meridian-agent --port 8080 --node http://127.0.0.1:8001 --node http://127.0.0.1:8002 \\
                   [--policy meridian] [--config agent.toml] [--admin-token TOKEN] \\
                   [--region eu-west --geo eu --residency eu --endpoint https://eu.example.com \\
                    --etcd http://10.0.0.1:2379,http://10.0.0.2:2379 [--actuator dry-run]]

With ``--region`` and ``--etcd`` the agent publishes its liveness and status to etcd and follows
the controller's desired state for the region (docs/agent-publisher.md).

Flags override the environment (``MERIDIAN_AGENT_...``), which overrides the TOML file, which
overrides the defaults (docs/agent.md lists every setting).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic

from meridian_service import logs, serving, version
from meridian_service import settings as settings_loading
from regional_agent import settings as agent_settings
from regional_agent.app import create_app

log = logging.getLogger("meridian.agent")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meridian-agent", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--host", help="address to listen on (server.host)")
    p.add_argument("--port", type=int, help="TCP port; 0 picks a free one (server.port)")
    p.add_argument(
        "--node", action="append", default=[], metavar="URL", help="a node's base URL (repeat)"
    )
    p.add_argument("--policy", help="routing policy (routing.policy)")
    p.add_argument("--admin-token", help="bearer token for /admin/* (admin.token)")
    p.add_argument("--region", help="region id, e.g. eu-west (region.id)")
    p.add_argument("--geo", help="geography the region serves, e.g. eu (region.geo)")
    p.add_argument(
        "--residency", metavar="TAG[,TAG]", help="data-residency tags (region.residency)"
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL[,URL]",
        help="client-facing URL of the region (region.endpoints; repeat or comma-separate)",
    )
    p.add_argument(
        "--etcd",
        action="append",
        default=[],
        metavar="URL[,URL]",
        help="etcd client URL (region.etcd; repeat or comma-separate)",
    )
    p.add_argument(
        "--actuator",
        choices=["none", "dry-run", "command", "simulator"],
        help="what to do with the controller's capacity floor (autoscaler.actuator)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    version.add_flag(p)
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if server:
        out["server"] = server
    if args.node:
        out["nodes"] = [{"url": url} for url in args.node]
    if args.policy is not None:
        out["routing"] = {"policy": args.policy}
    if args.admin_token is not None:
        out["admin"] = {"token": args.admin_token}
    region: dict[str, Any] = {}
    if args.region is not None:
        region["id"] = args.region
    if args.geo is not None:
        region["geo"] = args.geo
    if args.residency is not None:
        region["residency"] = _split(args.residency)
    if args.endpoint:
        region["endpoints"] = _split(*args.endpoint)
    if args.etcd:
        region["etcd"] = _split(*args.etcd)
    if region:
        out["region"] = region
    if args.actuator is not None:
        out["autoscaler"] = {"actuator": args.actuator}
    return out


def _split(*values: str) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


async def _serve(settings: agent_settings.Settings) -> None:
    def ready(port: int) -> None:
        log.info(
            "meridian-agent listening url=http://%s:%d policy=%s nodes=%d",
            settings.server.host, port, settings.routing.policy, len(settings.nodes),
        )  # fmt: skip
        region = settings.region
        if region.publishing:
            log.info(
                "publishing region=%s geo=%s etcd=%s lease_ttl_s=%d window_s=%g actuator=%s",
                region.id, region.geo, ",".join(region.etcd), region.lease_ttl_s,
                region.window_s, settings.autoscaler.actuator,
            )  # fmt: skip
        elif region.id is not None:
            log.warning("region=%s set without etcd: not publishing (pass --etcd URL)", region.id)

    await serving.serve(
        create_app(settings),
        host=settings.server.host,
        port=settings.server.port,
        handler_cancellation=True,
        limits=settings.server.limits(),
        on_ready=ready,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logs.install()  # a malformed HTTP request: one short line, rate-limited, not a traceback
    try:
        settings = agent_settings.load(config_file=args.config, overrides=overrides(args))
    except pydantic.ValidationError as exc:
        print(f"meridian-agent: {settings_loading.explain(exc)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"meridian-agent: {exc}", file=sys.stderr)
        return 2
    autoscaled = settings.region.publishing and settings.autoscaler.actuator == "simulator"
    if not settings.nodes and not autoscaled:
        print(
            "meridian-agent: no nodes: pass --node URL (repeat) or set nodes in --config "
            "(or let the simulator actuator start them: --region, --etcd, --actuator simulator)",
            file=sys.stderr,
        )
        return 2
    try:
        asyncio.run(_serve(settings))
    except OSError as exc:
        print(
            f"meridian-agent: cannot listen on {settings.server.host}:{settings.server.port}: "
            f"{exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
