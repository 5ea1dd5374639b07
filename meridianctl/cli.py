"""``meridianctl``: see the fleet and move traffic by hand, safely.

Every command is one call (or a dry run and a call) to the controller's admin API.  Actions
(drain, undrain, failover, failback, policies set) need ``--reason`` and are audited by the
controller; each shows what it would change and asks for confirmation unless ``--yes``, and
refuses to run without ``--yes`` when standard input is not a terminal (nobody to ask: exit
code 9, nothing sent).  Exit codes: ``meridianctl.errors``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from typing import Any, TypeVar

import click
from click.shell_completion import CompletionItem

from meridian_wire.models import REGION_ID
from meridianctl import config as ctl_config
from meridianctl import shapes
from meridianctl.client import Client
from meridianctl.errors import CtlError, Exit

F = TypeVar("F", bound=Callable[..., Any])

POLICY_KEYS: dict[str, str] = {
    "window_s": "float",
    "strikes": "int",
    "recovery_windows": "int",
    "ramp": "floats",
    "min_hold_s": "float",
    "status_stale_s": "float",
    "min_healthy_fraction": "float",
    "max_error_rate": "float",
    "ttft_p99_slo_s": "float|off",
    "prewarm_fraction": "float",
    "shares": "capacity|equal",
    "backup_rank": "latency|proximity",
    "latency_hysteresis_ms": "float",
}


class _Group(click.Group):
    """Turns meridianctl's errors into a message and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CtlError as exc:
            click.echo(f"meridianctl: {exc.message}", err=True)
            if exc.fix:
                click.echo(f"  what to do: {exc.fix}", err=True)
            ctx.exit(int(exc.code))
        except click.Abort:
            click.echo("aborted: nothing was changed", err=True)
            ctx.exit(int(Exit.ABORTED))


@contextmanager
def _client(ctx: click.Context) -> Iterator[Client]:
    obj = ctx.find_root().params
    config = ctl_config.load(url=obj.get("url"), token=obj.get("token"),
                             config_file=obj.get("config"))  # fmt: skip
    client = Client(config)
    try:
        yield client
    finally:
        client.close()


def _output(f: F) -> F:
    return click.option(
        "--output", "-o", type=click.Choice(["table", "json"]), default="table",
        show_default=True, help="table for people, json for scripts",
    )(f)  # fmt: skip


def _complete_regions(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    try:
        config = ctl_config.load(
            url=ctx.find_root().params.get("url"), token=ctx.find_root().params.get("token")
        )
        client = Client(ctl_config.Config(**{**config.__dict__, "timeout_s": 2.0}))
        try:
            rows = client.get("/v1/regions", shape=shapes.REGIONS)["regions"]
        finally:
            client.close()
    except (CtlError, KeyError, TypeError):
        return []
    return [CompletionItem(r["region"]) for r in rows if r["region"].startswith(incomplete)]


def _region_arg(value: str) -> str:
    if not REGION_ID.match(value):
        raise click.BadParameter(f"{value!r} is not a region id (lowercase letters, digits, -)")
    return value


def _check_region(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else _region_arg(value)


REGION = click.argument("region", callback=_check_region, shell_complete=_complete_regions)
REASON = click.option("--reason", "-r", required=True, help="why (written to the audit log)")
DRY_RUN = click.option("--dry-run", is_flag=True, help="show the plan, change nothing")
YES = click.option(
    "--yes", "-y", is_flag=True,
    help="apply without asking (needed when standard input is not a terminal)",
)  # fmt: skip


def _version() -> str:
    """The installed ``meridian`` distribution's version, as the daemons' ``--version`` says
    (meridian_service.version, which meridianctl may not import)."""
    try:
        return metadata.version("meridian")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", help="admin API URL [env MERIDIAN_URL; default http://127.0.0.1:8091]")
@click.option("--token", help="bearer token [env MERIDIAN_TOKEN]")
@click.option("--config", "config", help="TOML config file [env MERIDIANCTL_CONFIG]")
@click.version_option(_version(), prog_name="meridianctl", message="%(prog)s %(version)s")
def cli(url: str | None, token: str | None, config: str | None) -> None:
    """See the Meridian fleet and move traffic by hand: drain, failover, failback.

    Every action shows what it would change and asks before applying it, unless --yes
    (required when standard input is not a terminal).

    Exit codes: 0 done, 2 usage, 3 API unreachable or not the admin API, 4 not authenticated,
    5 not allowed, 6 not found, 7 refused (nothing changed), 8 controller unavailable,
    9 aborted (answered no, or no terminal to ask on and no --yes).
    """


# -- reads ------------------------------------------------------------------------------------


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value * 100:.0f}%"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]  # fmt: skip
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


def _load(row: dict[str, Any]) -> str:
    load = row.get("load")
    if not load:
        return "-"
    return f"{load.get('requests_per_s', 0):g} rps, kv {load.get('kv_util', 0) * 100:.0f}%"


def _state(row: dict[str, Any]) -> str:
    state = row["state"] or "unknown"
    if row.get("manual_failover"):
        state += " (manual)"
    elif row.get("admin") not in (None, "active"):
        state += f" ({row['admin']})"
    if not row.get("alive"):
        state += " [no lease]"
    if row.get("unreachable"):
        state += " [unreachable]"
    return state


def _json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


@cli.command()
@_output
@click.pass_context
def status(ctx: click.Context, output: str) -> None:
    """Every region at a glance: state, strikes, capacity, load, weight, backup, floor."""
    with _client(ctx) as client:
        data = client.get("/v1/regions", shape=shapes.REGIONS)
    if output == "json":
        _json(data)
        return
    rows = [
        [r["region"], _state(r), str(r["strikes"]), _fmt(r["capacity"]), _load(r),
         _fmt(r["weight"], "pct"), _fmt(r["backup"]), _fmt(r["floor"])]
        for r in data["regions"]
    ]  # fmt: skip
    headers = ["region", "state", "strikes", "capacity", "load", "weight", "backup", "floor"]
    click.echo(_table(headers, rows))
    click.echo(f"\nwindow {data['window']}")
    for geo, shares in sorted(data["serving"].items()):
        click.echo(f"geography {geo}: {_shares(shares)}")
    if data.get("alert"):
        click.echo(f"ALERT: {data['alert']}")
    for bad in data.get("bad_values", []):
        click.echo(f"bad value in etcd: {bad}")


@cli.group()
def regions() -> None:
    """One region in detail."""


@regions.command("show")
@REGION
@_output
@click.pass_context
def regions_show(ctx: click.Context, region: str, output: str) -> None:
    """A region's state, why, its status, desired state and any operator override."""
    with _client(ctx) as client:
        data = client.get(f"/v1/regions/{region}", shape=shapes.REGION)
    if output == "json":
        _json(data)
        return
    row = data["row"]
    pairs = [
        ("region", row["region"]), ("geography", _fmt(row["geo"])),
        ("residency", ",".join(row["residency"]) or "none"), ("state", _state(row)),
        ("why", row["reason"] or "-"), ("strikes", str(row["strikes"])),
        ("capacity", _fmt(row["capacity"])), ("load", _load(row)),
        ("weight", _fmt(row["weight"], "pct")), ("backup", _fmt(row["backup"])),
        ("floor", _fmt(row["floor"])),
    ]  # fmt: skip
    override = data.get("override")
    if override:
        what = "manual failover" if override.get("failover") else f"admin {override['admin']}"
        pairs.append(("override", f"{what} by {override.get('by') or '?'}: {override['reason']}"))
    if row.get("models"):
        backups = row.get("model_backups") or {}
        floors = row.get("model_floors") or {}
        for model, capacity in sorted(row["models"].items()):
            if model not in backups:
                where = "no capacity: not counted" if capacity <= 0 else "backup not chosen yet"
            elif backups[model] is None:
                where = "NO compliant backup"
            else:
                where = f"backup {backups[model]}"
            floor = f", floor {_fmt(floors[model])} for others" if floors.get(model) else ""
            pairs.append((f"model {model}", f"capacity {_fmt(capacity)}, {where}{floor}"))
    if data.get("reach"):
        pairs.append(("probes", data["reach"]["reason"]))
    measured = data.get("measured_latency_ms") or {}
    if measured:
        rtts = ", ".join(f"from {a} {ms:g} ms" for a, ms in sorted(measured.items()))
        pairs.append(("round trip", f"{rtts} (measured by the probes)"))
    for replica, probed in sorted((data.get("probes") or {}).items()):
        where = f" ({probed['region']})" if probed.get("region") else ""
        for p in probed["probes"]:
            seen = "ok" if p["ok"] else "FAILED"
            detail = f"{p['error']}" if p.get("error") else f"{_fmt(p.get('latency_ms'))} ms"
            pairs.append(
                (
                    f"  {replica}{where}",
                    f"{p['endpoint']} {seen}: {detail} ({probed['age_s']:.0f} s ago)",
                )
            )
    width = max(len(k) for k, _ in pairs)
    for key, value in pairs:
        click.echo(f"{key.ljust(width)}  {value}")


@cli.group()
def dns() -> None:
    """DNS steering."""


@dns.command("show")
@_output
@click.pass_context
def dns_show(ctx: click.Context, output: str) -> None:
    """The DNS plan the controller last applied."""
    with _client(ctx) as client:
        data = client.get("/v1/dns", shape=shapes.DNS)
    applied = data.get("applied")
    if output == "json":
        _json(data)
        return
    if applied is None:
        click.echo(data.get("problem") or "no DNS plan applied yet (dns.backend off, or no "
                   "window since it was turned on)")  # fmt: skip
        return
    when = "-"
    if applied.get("applied_at"):
        when = datetime.datetime.fromtimestamp(applied["applied_at"], tz=datetime.UTC).isoformat()
    click.echo(f"backend {applied['backend']} server {applied['server']}")
    click.echo(f"generation {applied['generation']} (newest plan {applied['desired_generation']}),"
               f" window {applied['window']}, applied at {when}")  # fmt: skip
    if applied.get("error"):
        click.echo(f"ERROR: {applied['error']} (DNS serves generation {applied['generation']})")
    for name, view in sorted(applied.get("views", {}).items()):
        hold = " HOLD (left as it was)" if view.get("hold") else ""
        click.echo(f"view {name} ({view['geo']}, zone {view['zone']}){hold}: {view['reason']}")
        for r in view.get("records", []):
            for value in r.get("values", []):
                click.echo(f"  {r['name']} {r['ttl_s']} {r['type']} {value}")


@dns.command("bind-config")
@click.pass_context
def dns_bind_config(ctx: click.Context) -> None:
    """named.conf fragments for BIND (admin token; contains TSIG secrets)."""
    with _client(ctx) as client:
        click.echo(client.text("/v1/dns/bind-config"), nl=False)


def _event_line(e: dict[str, Any]) -> str:
    at = datetime.datetime.fromtimestamp(e["at"], tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{at}  {e['kind']:<9}  {e.get('region') or '-':<12}  {e['reason']}"


@cli.command()
@click.option("--follow", "-f", is_flag=True, help="keep printing new events (Ctrl-C stops)")
@click.option("--region", callback=_check_region, shell_complete=_complete_regions,
              help="only this region's events")  # fmt: skip
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--interval", type=click.FloatRange(0.1, 60), default=2.0, show_default=True,
              help="seconds between polls with --follow")  # fmt: skip
@click.option("--count", type=click.IntRange(1), help="with --follow: stop after N events")
@_output
@click.pass_context
def events(ctx: click.Context, follow: bool, region: str | None, limit: int, interval: float,
           count: int | None, output: str) -> None:  # fmt: skip
    """The newest events: strikes, state changes, failovers, floors, alerts."""
    params: dict[str, Any] = {"limit": limit}
    if region:
        params["region"] = region
    seen = 0
    with _client(ctx) as client:
        while True:
            data = client.get("/v1/events", params=params, shape=shapes.EVENTS)
            for e in data["events"]:
                click.echo(json.dumps(e, sort_keys=True) if output == "json" else _event_line(e))
                seen += 1
                if count is not None and seen >= count:
                    return
            if not follow:
                return
            if data.get("cursor"):
                params["after"] = data["cursor"]
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return


@cli.command()
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@_output
@click.pass_context
def audit(ctx: click.Context, limit: int, output: str) -> None:
    """Who did what, when, why, and what came of it (operator token)."""
    with _client(ctx) as client:
        data = client.get("/v1/audit", params={"limit": limit}, shape=shapes.AUDIT)
    if output == "json":
        _json(data)
        return
    rows = [
        [datetime.datetime.fromtimestamp(a["at"], tz=datetime.UTC).strftime("%H:%M:%S"),
         a["who"], a["action"], a.get("region") or "-", a["result"], a["reason"]]
        for a in data["entries"]
    ]  # fmt: skip
    click.echo(_table(["time", "who", "action", "region", "result", "reason"], rows))


@cli.command()
@_output
@click.pass_context
def health(ctx: click.Context, output: str) -> None:
    """The controller replica behind the URL: leading or not, the leader, etcd."""
    with _client(ctx) as client:
        data = client.get("/v1/health", shape=shapes.HEALTH)
    if output == "json":
        _json(data)
        return
    lead = "leading" if data["leading"] else f"following {data['leader'] or '(no leader)'}"
    took = data.get("pass_s")
    last = f" (last pass {took * 1000:.0f} ms, {data.get('pass_writes')} keys)" if took else ""
    click.echo(f"{data['id']}: {lead}; etcd {data['etcd']}; window {_fmt(data['window'])}{last}")
    if data.get("alert"):
        click.echo(f"ALERT: {data['alert']}")


# -- actions ----------------------------------------------------------------------------------


def _shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{r} {s * 100:.0f}%" for r, s in shares.items()) or "nothing"


def _show_plan(result: dict[str, Any]) -> None:
    verb = "would" if result["dry_run"] else "did"
    click.echo(f"{result['action']} {result['region'] or ''}: {verb} change")
    if not result["changes"]:
        click.echo("  nothing in the plan")
    for c in result["changes"]:
        click.echo(
            f"  {c['region']}: {c['state_before'] or '-'} -> {c['state_after']}, weight "
            f"{_fmt(c['weight_before'], 'pct')} -> {_fmt(c['weight_after'], 'pct')}, backup "
            f"{_fmt(c['backup_after'])}, floor {_fmt(c['floor_after'])}"
        )
    for geo in sorted(set(result["serving_before"]) | set(result["serving_after"])):
        before, after = result["serving_before"].get(geo, {}), result["serving_after"].get(geo, {})
        if before != after:
            click.echo(f"  geography {geo}: {_shares(before)} -> {_shares(after)}")
    if result.get("alert"):
        click.echo(f"  ALERT: {result['alert']}")
    tail = " (dry run: nothing changed)" if result["dry_run"] else ""
    click.echo(f"audit {result['audit_id']}{tail}")


def _need_a_terminal(command: str) -> None:
    """Asking needs someone to answer: without a terminal on standard input (a script, a
    pipe, CI) refuse before anything is sent, rather than wait on a prompt or read a piped
    answer that nobody checked against the plan."""
    stdin = sys.stdin
    if stdin is not None and stdin.isatty():
        return
    raise CtlError(
        f"{command} asks for confirmation, but standard input is not a terminal; nothing was sent",
        code=Exit.ABORTED,
        fix="see the plan with --dry-run, then run the same command with --yes (-y)",
    )


def _confirm() -> None:
    if not click.confirm("apply this?", default=False):
        raise click.Abort()


def _act(ctx: click.Context, *, command: str, path: str, body: dict[str, Any], dry_run: bool,
         yes: bool, output: str) -> None:  # fmt: skip
    ask = not dry_run and not yes
    if ask:
        _need_a_terminal(command)
    with _client(ctx) as client:
        if ask:
            _show_plan(client.post(path, body, dry_run=True))
            _confirm()
        result = client.post(path, body, dry_run=dry_run)
    if output == "json":
        _json(result)
    else:
        _show_plan(result)


@cli.command()
@REGION
@REASON
@DRY_RUN
@YES
@_output
@click.pass_context
def drain(ctx: click.Context, region: str, reason: str, dry_run: bool, yes: bool,
          output: str) -> None:  # fmt: skip
    """Take REGION out of service: its traffic moves to its backup (asks unless --yes)."""
    _act(ctx, command="drain", path=f"/v1/regions/{region}/drain", body={"reason": reason},
         dry_run=dry_run, yes=yes, output=output)  # fmt: skip


@cli.command()
@REGION
@REASON
@DRY_RUN
@YES
@_output
@click.pass_context
def undrain(ctx: click.Context, region: str, reason: str, dry_run: bool, yes: bool,
            output: str) -> None:  # fmt: skip
    """End REGION's drain: it ramps back up as its health windows allow (asks unless --yes)."""
    _act(ctx, command="undrain", path=f"/v1/regions/{region}/undrain",
         body={"reason": reason}, dry_run=dry_run, yes=yes, output=output)  # fmt: skip


@cli.command()
@click.option(
    "--from",
    "region",
    required=True,
    callback=_check_region,
    shell_complete=_complete_regions,
    help="the region to move traffic away from",
)
@click.option(
    "--to",
    "target",
    callback=_check_region,
    shell_complete=_complete_regions,
    help="the region to move it to; default: the compliant backup",
)
@REASON
@DRY_RUN
@YES
@_output
@click.pass_context
def failover(ctx: click.Context, region: str, target: str | None, reason: str, dry_run: bool,
             yes: bool, output: str) -> None:  # fmt: skip
    """Manual failover: move a region's traffic to a compliant backup until `failback`
    (asks unless --yes)."""
    body: dict[str, Any] = {"reason": reason}
    if target:
        body["target"] = target
    _act(ctx, command="failover", path=f"/v1/regions/{region}/failover", body=body,
         dry_run=dry_run, yes=yes, output=output)  # fmt: skip


@cli.command()
@REGION
@REASON
@DRY_RUN
@YES
@_output
@click.pass_context
def failback(ctx: click.Context, region: str, reason: str, dry_run: bool, yes: bool,
             output: str) -> None:  # fmt: skip
    """End REGION's manual failover: it ramps back up as its health windows allow (asks
    unless --yes)."""
    _act(ctx, command="failback", path=f"/v1/regions/{region}/failback",
         body={"reason": reason}, dry_run=dry_run, yes=yes, output=output)  # fmt: skip


# -- policies -----------------------------------------------------------------------------------


@cli.group()
def policies() -> None:
    """The failover policy: windows, strikes, ramp, pre-warm fraction, thresholds."""


@policies.command("get")
@_output
@click.pass_context
def policies_get(ctx: click.Context, output: str) -> None:
    """The policy in force, and who set it."""
    with _client(ctx) as client:
        data = client.get("/v1/policies", shape=shapes.POLICIES)
    if output == "json":
        _json(data)
        return
    for key, value in data["values"].items():
        click.echo(f"{key:<22}{_policy_shown(value)}")
    source = data["source"]
    if source == "etcd":
        click.echo(f"\nset by {data['by']}: {data['reason']}")
    else:
        click.echo("\nfrom the controller's settings")


def _policy_shown(value: Any) -> str:
    if value is None:  # ttft_p99_slo_s: not checked
        return "off"
    return ",".join(f"{v:g}" for v in value) if isinstance(value, list) else _fmt(value)


def _show_policy_change(before: dict[str, Any], after: dict[str, Any], *, dry_run: bool) -> None:
    verb = "would" if dry_run else "did"
    click.echo(f"policies: {verb} change")
    changed = [k for k in after if before.get(k) != after[k]]
    if not changed:
        click.echo("  no value: each is already in force (only the reason and who set it)")
    width = max((len(k) for k in changed), default=0)
    for key in changed:
        shown = _policy_shown(before[key]) if key in before else "-"
        click.echo(f"  {key.ljust(width)}  {shown} -> {_policy_shown(after[key])}")
    if dry_run:
        click.echo("(dry run: nothing changed)")
    else:
        click.echo("the leader applies them from its next window")


def _policy_value(key: str, raw: str) -> tuple[str, Any]:
    kind = POLICY_KEYS.get(key)
    if kind is None:
        raise click.BadParameter(f"unknown key {key!r}; keys: {', '.join(POLICY_KEYS)}")
    try:
        if kind == "int":
            return key, int(raw)
        if kind == "floats":
            return key, [float(v) for v in raw.split(",") if v.strip()]
        if kind in ("capacity|equal", "latency|proximity"):
            if raw not in kind.split("|"):
                raise ValueError(raw)
            return key, raw
        if kind == "float|off" and raw.lower() in ("off", "none", "null"):
            return "ttft_check", False
        return key, float(raw)
    except ValueError as exc:
        want = {
            "int": "an integer",
            "floats": "numbers like 0.05,0.25,0.5,1",
            "capacity|equal": "capacity or equal",
            "latency|proximity": "latency or proximity",
        }.get(kind, "a number")
        raise click.BadParameter(f"{key}={raw!r}: want {want}") from exc


@policies.command("set")
@click.argument("assignments", nargs=-1, required=True, metavar="KEY=VALUE...")
@REASON
@DRY_RUN
@YES
@_output
@click.pass_context
def policies_set(ctx: click.Context, assignments: tuple[str, ...], reason: str, dry_run: bool,
                 yes: bool, output: str) -> None:  # fmt: skip
    """Change the policy (admin token); the leader applies it from the next window.

    Shows each value that would change and asks unless --yes; --dry-run only shows them.

    Keys: window_s, strikes, recovery_windows, ramp (e.g. 0.05,0.25,0.5,1), min_hold_s,
    status_stale_s, min_healthy_fraction, max_error_rate, ttft_p99_slo_s (or off),
    prewarm_fraction, shares (capacity or equal), backup_rank (latency or proximity),
    latency_hysteresis_ms.
    """
    body: dict[str, Any] = {"reason": reason}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE")
        k, v = _policy_value(key.strip(), raw.strip())
        body[k] = v
    ask = not dry_run and not yes
    if ask:
        _need_a_terminal("policies set")
    with _client(ctx) as client:
        before = client.get("/v1/policies", shape=shapes.POLICIES)["values"]
        if ask:
            plan = client.put("/v1/policies", body, dry_run=True)
            _show_policy_change(before, plan["values"], dry_run=True)
            _confirm()
        data = client.put("/v1/policies", body, dry_run=dry_run)
    if output == "json":
        _json(data)
    else:
        _show_policy_change(before, data["values"], dry_run=dry_run)


# -- tokens -------------------------------------------------------------------------------------


@cli.group()
def token() -> None:
    """Make bearer tokens for the controller's [[api.tokens]] (nothing is sent)."""


@token.command("new")
@click.option("--name", required=True, help="who will hold it (shown in the audit log)")
@click.option("--role", type=click.Choice(["viewer", "operator", "admin"]), required=True)
def token_new(name: str, role: str) -> None:
    """Print a new random token (give it to its holder) and the TOML entry with its hash."""
    secret = secrets.token_urlsafe(32)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    click.echo(f"token (give to {name}, shown once): {secret}")
    click.echo("add to the controllers' settings (the token itself is never stored):")
    click.echo(f'[[api.tokens]]\nname = "{name}"\nrole = "{role}"\nsha256 = "{digest}"')


# -- completion --------------------------------------------------------------------------------


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script: eval "$(meridianctl completion bash)"."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None
    click.echo(cls(cli, {}, "meridianctl", "_MERIDIANCTL_COMPLETE").source())


def main() -> None:
    cli(prog_name="meridianctl")
