"""``meridian-agent``: the region's OpenAI-compatible routing proxy.

    meridian-agent --port 8080 --node http://127.0.0.1:8001 --node http://127.0.0.1:8002 \\
                   [--policy meridian] [--config agent.toml] [--workers N] \\
                   [--region eu-west --geo eu --residency eu --endpoint https://eu.example.com \\
                    --etcd http://10.0.0.1:2379,http://10.0.0.2:2379 [--actuator dry-run]]

The admin token never goes on the command line (``ps`` shows every process's arguments to every
user): ``admin.token_file``, ``admin.token_sha256`` or ``MERIDIAN_AGENT_ADMIN__TOKEN``
(docs/security.md).  With ``server.tls_cert_file`` and ``server.tls_key_file`` the agent serves
HTTPS and reads the pair again on SIGHUP.

With ``tenants.keys_file`` the data plane takes API keys (docs/agent.md, "Tenants, keys and
rate limits"); SIGHUP reads that file again too.  ``meridian-agent key new [--tenant T]``
prints a new key and the keys-file entry with its hash.

With ``--region`` and ``--etcd`` the agent publishes its liveness and status to etcd and follows
the controller's desired state for the region (docs/agent-publisher.md).

Flags override the environment (``MERIDIAN_AGENT_...``), which overrides the TOML file, which
overrides the defaults (docs/agent.md lists every setting).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from meridian_service import checkconfig, gc_tuning, logs, loops, serving, version
from meridian_service.tls import ServerTls, TlsError
from regional_agent import prompts as prompts_module
from regional_agent import settings as agent_settings
from regional_agent.app import create_app, reload_on_signal
from regional_agent.prompts import TokenizerLoadError
from regional_agent.tenants import new_key
from regional_agent.workers import supervisor
from regional_agent.workers.runtime import Worker

log = logging.getLogger("meridian.agent")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meridian-agent", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--host", help="address to listen on (server.host)")
    p.add_argument("--port", type=int, help="TCP port; 0 picks a free one (server.port)")
    p.add_argument(
        "--node", action="append", default=[], metavar="URL", help="a node's base URL (repeat)"
    )
    p.add_argument(
        "--discover-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="nodes from NAME's A records, each at PORT, re-resolved (discovery.dns; repeat)",
    )
    p.add_argument(
        "--discover-srv",
        action="append",
        default=[],
        metavar="NAME",
        help="nodes from NAME's SRV records: each target at its port (discovery.dns; repeat)",
    )
    p.add_argument("--policy", help="routing policy (routing.policy)")
    # Gone: a token in argv is readable by every user of the host.  Kept only to say so.
    p.add_argument("--admin-token", help=argparse.SUPPRESS)
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
        choices=["none", "dry-run", "command", "simulator", "webhook", "kubernetes"],
        help="what to do with the controller's capacity floor (autoscaler.actuator)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="agent processes serving the port; 0: one per CPU (workers.count; the default)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    checkconfig.add_flags(p, prog="meridian-agent")
    version.add_flag(p)
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if server:
        out["server"] = server
    if args.node:
        out["nodes"] = [{"url": url} for url in args.node]
    discovered: list[dict[str, Any]] = []
    for spec in args.discover_dns:
        name, _, port = spec.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"--discover-dns {spec!r}: write NAME:PORT, e.g. vllm.ns.svc.:8000")
        discovered.append({"name": name, "record": "A", "port": int(port)})
    discovered += [{"name": name, "record": "SRV"} for name in args.discover_srv]
    if discovered:
        out["discovery"] = {"dns": discovered}
    if args.policy is not None:
        out["routing"] = {"policy": args.policy}
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
    if args.workers is not None:
        out["workers"] = {"count": args.workers}
    return out


def _split(*values: str) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


NO_TOKEN_FLAG = (
    "meridian-agent: --admin-token is no longer taken: a token on the command line is visible "
    "to every user of the host (ps, /proc/<pid>/cmdline). Put it in a file readable by the "
    "agent only (admin.token_file), in the environment (MERIDIAN_AGENT_ADMIN__TOKEN), or "
    "configure its SHA-256 (admin.token_sha256); and replace this token, it has been exposed"
)

# Environment variables that carry secrets: removed once the settings are read, so that the
# processes the agent starts (autoscaler hooks, simulated nodes) do not inherit them.
_SECRET_ENV = re.compile(r"^MERIDIAN_AGENT_.*(TOKEN|PASSWORD|SECRET|API_KEYS?)$", re.IGNORECASE)


def _forget_secret_env() -> None:
    for name in [n for n in os.environ if _SECRET_ENV.match(n)]:
        del os.environ[name]


async def _serve(
    settings: agent_settings.Settings,
    checked: Checked,
    *,
    worker: Worker | None = None,
    port: int | None = None,
) -> None:
    """Serve one agent process: the only one, or ``worker`` of several on ``port``."""
    app = create_app(settings, prompts=checked.prompts, worker=worker)
    tls = checked.tls

    def ready(port: int) -> None:
        # SIGHUP: the API keys and the TLS certificates (this replaces serve's TLS-only one);
        # in every worker, before the supervisor hears it is ready (it forwards SIGHUP)
        with contextlib.suppress(NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_on_signal, app)
        gc_tuning.settle(settings.server.gc_young_threshold)  # start-up is done: freeze it
        if worker is not None:
            log.info("worker listening pid=%d workers=%d", os.getpid(), worker.count)
            worker.announce_ready()
            if worker.index != 0:
                return  # worker 0 says what the agent is
        log.info(
            "meridian-agent listening url=%s://%s:%d policy=%s nodes=%d loop=%s",
            "https" if tls else "http", settings.server.host, port, settings.routing.policy,
            len(settings.nodes), loops.running(),
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
        app,
        host=settings.server.host,
        port=settings.server.port if port is None else port,
        handler_cancellation=True,
        limits=settings.server.limits(),
        tls=tls,
        on_ready=ready,
        reuse_port=worker is not None,
        unix_path=None if worker is None else str(worker.http_socket(worker.index)),
        announce=worker is None,
    )


def _serve_workers(settings: agent_settings.Settings, checked: Checked, count: int) -> int:
    """``workers.count`` above 1: the supervisor (``regional_agent.workers.supervisor``)."""

    def start_worker(worker: Worker, port: int) -> int:
        for handler in logging.getLogger().handlers:  # whose line it is, in the one log
            line = LOG_FORMAT.replace("%(message)s", f"worker={worker.index} %(message)s")
            handler.setFormatter(logging.Formatter(line))
        try:
            loops.run(
                _serve(settings, checked, worker=worker, port=port),
                choice=settings.server.event_loop,
            )
        except OSError as exc:
            print(
                f"meridian-agent: worker {worker.index} cannot listen on "
                f"{settings.server.host}:{port}: {exc.strerror}",
                file=sys.stderr,
            )
            return 1
        return 0

    return supervisor.run(
        count=count,
        host=settings.server.host,
        port=settings.server.port,
        table_slots=settings.workers.table_slots,
        scheme="https" if checked.tls is not None else "http",
        start_worker=start_worker,
    )


def key_main(argv: Sequence[str]) -> int:
    """``meridian-agent key new [--tenant T] [--name LABEL]``: a new API key and the keys-file
    entry with its hash (as ``meridianctl token new`` does for the controller's tokens)."""
    p = argparse.ArgumentParser(
        prog="meridian-agent key", description="make an API key for tenants.keys_file"
    )
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="print a new random key and its [[tenants.keys]] entry")
    new.add_argument("--tenant", help="the tenant it is for (named in the comment)")
    new.add_argument("--name", default="", help="a label for the key, e.g. 2026-03")
    args = p.parse_args(argv)
    key, sha256 = new_key()
    where = f"the [[tenants]] entry of {args.tenant}" if args.tenant else "its tenant's [[tenants]]"
    print(key)
    print(f"# give the key above to its holder only; add this under {where} in the keys file:")
    print(f'[[tenants.keys]]\nname = "{args.name}"\nsha256 = "{sha256}"')
    return 0


NO_NODES = (
    "no nodes: pass --node URL (repeat) or set [[nodes]] in the config file, find them in DNS "
    "(--discover-dns NAME:PORT, --discover-srv NAME, or [[discovery.dns]]), or let the "
    "simulator actuator start them (--region, --etcd, --actuator simulator)"
)


@dataclass(frozen=True, slots=True)
class Checked:
    """What :func:`start_checks` loaded for the start: the listener's TLS, the tokenizers."""

    tls: ServerTls | None
    prompts: prompts_module.Prompts


def start_checks(settings: agent_settings.Settings) -> Checked:
    """What a start checks once the settings are loaded, before it listens (``--check-config``
    runs the same): the TLS pair loads, there are nodes to route to, and every tokenizer and
    chat template loads and renders (``regional_agent.prompts``).  Returns what it loaded;
    raises ``ValueError`` (``TlsError``, ``TokenizerLoadError``) naming the setting."""
    tls = settings.server.tls()
    autoscaled = settings.region.publishing and settings.autoscaler.actuator == "simulator"
    if not settings.nodes and not settings.discovery.dns and not autoscaled:
        raise ValueError(NO_NODES)
    return Checked(tls=tls, prompts=prompts_module.load(settings.tokenizer))


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["key"]:
        return key_main(given[1:])
    args = build_parser().parse_args(given)
    if args.admin_token is not None:
        print(NO_TOKEN_FLAG, file=sys.stderr)
        return 2
    if args.check_config is not None:
        return _check_config(args)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    logs.install()  # a malformed HTTP request: one short line, rate-limited, not a traceback
    try:
        flags = overrides(args)
    except ValueError as exc:
        print(f"meridian-agent: {exc}", file=sys.stderr)
        return 2
    try:
        settings = agent_settings.load(config_file=args.config, overrides=flags)
    except pydantic.ValidationError as exc:
        lines = checkconfig.explain(
            exc,
            model=agent_settings.Settings,
            config_file=args.config,
            env_prefix=ENV_PREFIX,
            overrides=flags,
        )
        print("meridian-agent: invalid settings:", *lines, sep="\n  ", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"meridian-agent: {exc}", file=sys.stderr)
        return 2
    finally:
        _forget_secret_env()
    try:
        checked = start_checks(settings)
    except (TlsError, TokenizerLoadError) as exc:
        print(f"meridian-agent: invalid settings:\n  {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"meridian-agent: {exc}", file=sys.stderr)
        return 2
    try:
        count = settings.processes()
        if count > 1:
            return _serve_workers(settings, checked, count)
        loops.run(_serve(settings, checked), choice=settings.server.event_loop)
    except OSError as exc:
        print(
            f"meridian-agent: cannot listen on {settings.server.host}:{settings.server.port}: "
            f"{exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


ENV_PREFIX = "MERIDIAN_AGENT_"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def _check_config(args: argparse.Namespace) -> int:
    """``--check-config FILE``: load and check as a start would, print, exit (0 or 2)."""
    problem = checkconfig.same_file(args.config, args.check_config)
    if problem is not None:
        print(f"meridian-agent: {problem}", file=sys.stderr)
        return 2
    try:
        flags = overrides(args)
    except ValueError as exc:
        print(f"meridian-agent: {exc}", file=sys.stderr)
        return 2
    try:
        return checkconfig.check(
            lambda: agent_settings.load(config_file=args.check_config, overrides=flags),
            prog="meridian-agent",
            config_file=args.check_config,
            model=agent_settings.Settings,
            env_prefix=ENV_PREFIX,
            overrides=flags,
            start_checks=start_checks,
            output=args.output,
        )
    finally:
        _forget_secret_env()


if __name__ == "__main__":
    sys.exit(main())
