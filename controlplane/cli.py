"""``meridian-controller``: one replica of the global controller (run several).

meridian-controller --etcd http://127.0.0.1:2379[,URL...] [--config FILE] [--window-s S]
                    [--strikes N] [--recovery-windows N] [--prewarm-fraction F]
                    [--id NAME] [--port P] [--admin-port P]
meridian-controller dns bind-config [--config FILE] [--zone-dir DIR]
                    print the named.conf fragments for the [dns] settings (docs/dns.md)
meridian-controller etcd bootstrap [--config FILE] [--region ID ...] [--root-password-file F]
                    [--password-dir DIR] [--dry-run] ...
                    etcd's roles, users and auth for least privilege
                    (docs/security.md#etcd-tls-users-and-roles)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic

import meridian_etcd
from controlplane import access
from controlplane import settings as controller_settings
from controlplane.api import server as admin_server
from controlplane.app import create_app
from controlplane.dns import bindconf
from meridian_etcd import security
from meridian_service import checkconfig, logs, serving, version
from meridian_service.tls import TlsError, client_context

log = logging.getLogger("meridian.controller")


COMMANDS = """\
commands:
  meridian-controller [options]   with no command: run one replica (the options above)
  meridian-controller dns bind-config [--config FILE] [--zone-dir DIR]
                                  print the named.conf fragments for the [dns] settings
                                  (docs/dns.md); meridian-controller dns --help for more
  meridian-controller etcd bootstrap [--config FILE] [--region ID ...] [--dry-run]
                                  create etcd's roles and users (one per region, the
                                  controller's, root) and enable auth, idempotently
                                  (docs/security.md#etcd-tls-users-and-roles);
                                  meridian-controller etcd --help
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
    checkconfig.add_flags(p, prog="meridian-controller")
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


ENV_PREFIX = "MERIDIAN_CONTROLLER_"


def _load(
    *, config_file: Path | None, overrides: dict[str, Any] | None = None
) -> controller_settings.ControllerSettings | None:
    """The settings, or ``None`` once stderr says why they cannot be loaded."""
    try:
        return controller_settings.load(config_file=config_file, overrides=overrides)
    except pydantic.ValidationError as exc:
        lines = checkconfig.explain(
            exc,
            model=controller_settings.ControllerSettings,
            config_file=config_file,
            env_prefix=ENV_PREFIX,
            overrides=overrides,
        )
        print("meridian-controller: invalid settings:", *lines, sep="\n  ", file=sys.stderr)
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


def etcd_main(argv: Sequence[str]) -> int:
    """``meridian-controller etcd bootstrap``: etcd's roles, users, auth (controlplane.access)."""
    p = argparse.ArgumentParser(
        prog="meridian-controller etcd",
        description="Create in etcd, as root, a role and a user per region for its agents "
        "(agent-<region>: its own agents' keys, its group tables, its desired state), the "
        "controller's (meridian-controller: everything under /meridian/v1/), the root user, "
        "and enable auth. Idempotent: what is already right is left alone, and a second run "
        "changes nothing and says so (docs/security.md#etcd-tls-users-and-roles). etcd is "
        "reached as the [etcd] settings say, the flags below overriding them.",
    )
    p.add_argument("command", choices=["bootstrap"], help="bootstrap: make etcd match")
    p.add_argument("--config", type=Path, help="TOML settings file: [etcd] and [[regions]]")
    p.add_argument("--etcd", help="etcd client URLs, comma-separated (etcd.endpoints)")
    p.add_argument("--region", action="append", default=[],
                   help="a region id besides the config's [[regions]]; repeat")  # fmt: skip
    p.add_argument("--ca-file", type=Path, help="CA of the members' certificates (etcd.ca_file)")
    p.add_argument(
        "--cert-file", type=Path, help="client certificate to act with, CN root (etcd.cert_file)"
    )
    p.add_argument("--key-file", type=Path, help="its private key (etcd.key_file)")
    p.add_argument(
        "--root-password-file",
        type=Path,
        help="root's password: root is created with it and authenticates with it once auth is "
        "on (default: etcd.password_file when etcd.user is root; without one, root has no "
        "password and acts by a client certificate with CN root)",
    )
    p.add_argument(
        "--password-dir",
        type=Path,
        help="a directory with one file per user to create with a password, named after the "
        "user (agent-eu-west, meridian-controller); without it, users get no password "
        "and are authenticated by their client certificates' CN",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would change; change nothing")
    args = p.parse_args(argv)
    etcd_overrides: dict[str, Any] = {}
    if args.etcd:
        etcd_overrides["endpoints"] = [u.strip() for u in args.etcd.split(",") if u.strip()]
    for name in ("ca_file", "cert_file", "key_file"):
        if getattr(args, name) is not None:
            etcd_overrides[name] = getattr(args, name)
    settings = _load(config_file=args.config,
                     overrides={"etcd": etcd_overrides} if etcd_overrides else None)  # fmt: skip
    if settings is None:
        return 2
    regions = sorted({r.id for r in settings.regions} | set(args.region))
    try:
        if not regions:
            raise ValueError("no regions: list them in [[regions]] or give --region")
        access.roles(regions)  # a bad region id, before etcd is touched
        root_file = args.root_password_file
        if root_file is None and settings.etcd.user == access.ROOT:
            root_file = settings.etcd.password_file
        root_password = None if root_file is None else security.read_password(
            root_file, "--root-password-file")  # fmt: skip
        passwords = None
        if args.password_dir is not None:
            passwords = {
                u.name: security.read_password(args.password_dir / u.name, "--password-dir")
                for u in access.users(regions)
                if u.name != access.ROOT
            }
        config = meridian_etcd.ClientConfig(
            endpoints=settings.etcd.endpoints,
            timeout_s=settings.etcd.timeout_s,
            ca_file=settings.etcd.ca_file,
            cert_file=settings.etcd.cert_file,
            key_file=settings.etcd.key_file,
            user=None if root_password is None else access.ROOT,
            password=root_password,
        )
    except ValueError as exc:
        print(f"meridian-controller etcd: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_bootstrap(config, regions, passwords, root_password, args.dry_run))


async def _bootstrap(
    config: meridian_etcd.ClientConfig,
    regions: list[str],
    passwords: dict[str, str] | None,
    root_password: str | None,
    dry_run: bool,
) -> int:
    admin = meridian_etcd.Admin(config)
    try:
        report = await access.bootstrap(
            admin,
            regions=regions,
            passwords=passwords,
            root_password=root_password,
            dry_run=dry_run,
        )
    except meridian_etcd.EtcdError as exc:
        print(f"meridian-controller etcd: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await admin.close()
    print("\n".join(report.lines()))
    return 0


def start_checks(settings: controller_settings.ControllerSettings) -> None:
    """What a start reads besides the settings before it serves (``--check-config`` runs the
    same): the admin port's certificate and key, and the CA a forwarded write trusts.  Raises
    ``ValueError`` (``TlsError``) naming the setting."""
    if settings.api.port is not None:
        admin_server.server_tls(settings)
    tls = settings.api.tls
    if tls is not None:
        setting = "api.tls.ca_file" if tls.ca_file is not None else "api.tls.cert_file"
        try:
            client_context(tls.ca_file or tls.cert_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(
                f"{setting}: {tls.ca_file or tls.cert_file} holds no usable CA certificate ({exc})"
            ) from None


def _check_config(args: argparse.Namespace) -> int:
    """``--check-config FILE``: load and check as a start would, print, exit (0 or 2)."""
    problem = checkconfig.same_file(args.config, args.check_config)
    if problem is not None:
        print(f"meridian-controller: {problem}", file=sys.stderr)
        return 2
    flags = overrides(args)
    return checkconfig.check(
        lambda: controller_settings.load(config_file=args.check_config, overrides=flags),
        prog="meridian-controller",
        config_file=args.check_config,
        model=controller_settings.ControllerSettings,
        env_prefix=ENV_PREFIX,
        overrides=flags,
        start_checks=start_checks,
        output=args.output,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dns"]:
        return dns_main(argv[1:])
    if argv[:1] == ["etcd"]:
        return etcd_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.check_config is not None:
        return _check_config(args)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logs.install()  # a malformed HTTP request: one short line, rate-limited, not a traceback
    settings = _load(config_file=args.config, overrides=overrides(args))
    if settings is None:
        return 2
    try:
        start_checks(settings)
        asyncio.run(_serve(settings))
    except TlsError as exc:  # api.tls names files that hold no usable certificate and key
        print(f"meridian-controller: invalid settings:\n  {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"meridian-controller: cannot listen: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
