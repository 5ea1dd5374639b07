"""``meridian-controller``: one replica of the global controller (run several).

meridian-controller --etcd http://127.0.0.1:2379[,URL...] [--config FILE] [--window-s S]
                    [--strikes N] [--recovery-windows N] [--prewarm-fraction F]
                    [--id NAME] [--port P] [--admin-port P]
meridian-controller dns bind-config [--config FILE] [--zone-dir DIR]
                    print the named.conf fragments for the [dns] settings (docs/dns.md)
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

from controlplane import settings as controller_settings
from controlplane.app import create_app
from controlplane.dns import bindconf
from meridian_service import logs, serving, version

log = logging.getLogger("meridian.controller")


COMMANDS = """\
commands:
  meridian-controller [options]   with no command: run one replica (the options above)
  meridian-controller dns bind-config [--config FILE] [--zone-dir DIR]
                                  print the named.conf fragments for the [dns] settings
                                  (docs/dns.md); meridian-controller dns --help for more
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meridian-controller",
        description=__doc__.split("\n")[0],
        epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--etcd", help="etcd client URLs, comma-separated (etcd.endpoints)")
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--window-s", type=float, help="health window, seconds (failover.window_s)")
    p.add_argument("--strikes", type=int, help="failed windows before failed (failover.strikes)")
    p.add_argument("--recovery-windows", type=int, help="good windows to recover")
    p.add_argument("--prewarm-fraction", type=float, help="backup floor share (0..1)")
    p.add_argument("--id", help="this replica's name (election.id)")
    p.add_argument("--host", help="read API address (server.host)")
    p.add_argument("--port", type=int, help="read API port; 0 picks one (server.port)")
    p.add_argument("--admin-host", help="admin API address (api.host)")
    p.add_argument(
        "--admin-port", type=int, help="serve the admin API on this port; 0 picks one (api.port)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    version.add_flag(p)
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.etcd:
        out["etcd"] = {"endpoints": [u.strip() for u in args.etcd.split(",") if u.strip()]}
    failover = {
        k: v
        for k, v in (
            ("window_s", args.window_s),
            ("strikes", args.strikes),
            ("recovery_windows", args.recovery_windows),
            ("prewarm_fraction", args.prewarm_fraction),
        )
        if v is not None
    }
    if failover:
        out["failover"] = failover
    if args.id:
        out["election"] = {"id": args.id}
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    admin = {
        k: v for k, v in (("host", args.admin_host), ("port", args.admin_port)) if v is not None
    }
    if admin:
        out["api"] = admin
    if server:
        out["server"] = server
    return out


async def _serve(settings: controller_settings.ControllerSettings) -> None:
    def ready(port: int) -> None:
        log.info(
            "meridian-controller id=%s url=http://%s:%d etcd=%s window_s=%g strikes=%d",
            settings.election.id, settings.server.host, port, ",".join(settings.etcd.endpoints),
            settings.failover.window_s, settings.failover.strikes,
        )  # fmt: skip

    await serving.serve(
        create_app(settings),
        host=settings.server.host,
        port=settings.server.port,
        limits=settings.server.limits(),
        on_ready=ready,
    )


def _invalid(exc: pydantic.ValidationError) -> str:
    lines = [
        f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
    ]
    return "meridian-controller: invalid settings:\n" + "\n".join(lines)


def _load(
    *, config_file: Path | None, overrides: dict[str, Any] | None = None
) -> controller_settings.ControllerSettings | None:
    """The settings, or ``None`` once stderr says why they cannot be loaded."""
    try:
        return controller_settings.load(config_file=config_file, overrides=overrides)
    except pydantic.ValidationError as exc:
        print(_invalid(exc), file=sys.stderr)
    except (FileNotFoundError, ValueError) as exc:
        print(f"meridian-controller: {exc}", file=sys.stderr)
    return None


def dns_main(argv: Sequence[str]) -> int:
    """``meridian-controller dns bind-config``: named.conf keys, views and zones for [dns]."""
    p = argparse.ArgumentParser(
        prog="meridian-controller dns",
        description="Print the named.conf fragments BIND needs for the controller's [dns] "
        "settings: one TSIG key and one view per geography, each zone with its update-policy "
        "(docs/dns.md). Reads only the settings: no etcd, nothing is served.",
    )
    p.add_argument(
        "command",
        choices=["bind-config"],
        help="bind-config: print the fragments on standard output",
    )
    p.add_argument("--config", type=Path, help="TOML settings file (its [dns] group)")
    p.add_argument(
        "--zone-dir",
        default="/var/lib/bind",
        help="where named keeps the zones (default /var/lib/bind)",
    )
    args = p.parse_args(argv)
    settings = _load(config_file=args.config)
    if settings is None:
        return 2
    if not settings.dns.views:
        print("meridian-controller: no [[dns.views]] in the settings: nothing to render",
              file=sys.stderr)  # fmt: skip
        return 2
    sys.stdout.write(bindconf.render(settings.dns, zone_dir=args.zone_dir))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dns"]:
        return dns_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logs.install()  # a malformed HTTP request: one short line, rate-limited, not a traceback
    settings = _load(config_file=args.config, overrides=overrides(args))
    if settings is None:
        return 2
    try:
        asyncio.run(_serve(settings))
    except OSError as exc:
        print(f"meridian-controller: cannot listen: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
