"""The global plane at scale: one real etcd, the real controller, and 10 to 500 regions of
1..10 agent replicas each.

Question: where does the controller's window pass stop fitting in its window, and what does
the fleet cost etcd?

Set-up, per scale (a fresh etcd each): ``meridian-controller`` (``python -m controlplane.cli``)
with every region configured (``[[regions]]``, ten regions per geography, each backed by the
next one of its geography), ``failover.window_s`` = ``--window-s``; and ``_publishers.py``, one
process that writes what every agent replica of every region writes with the agents' default
settings (a lease of 10 s refreshed every 3.3 s, alive and status keys under it, the status
rewritten every ``--status-every-s``; region ``i`` has ``1 + i % 10`` replicas).  Once every
replica has published and the controller has passed two windows (the first judges nothing),
``--windows`` windows are measured:

* the window pass: how long each pass took (the leader's ``/health`` ``pass_s``, polled), p50
  and the largest, and the keys it wrote;
* etcd: puts and transactions per second, bytes received and sent per second over gRPC, WAL
  bytes written per second, the keys and the database size (etcd's own ``/metrics``);
* CPU (``/proc/<pid>/stat``) of etcd, the controller and the publishers, in cores;
* the controller's memory: resident set at the end and its peak (``VmRSS``, ``VmHWM``);
* what one pass reads (``/meridian/v1/regions/``: keys and bytes) and writes (the plan key);
* DNS: the plan for one view per geography computed from the fleet the controller left in
  etcd (``policies.dns_plan`` with the controller's own inputs), its records, and the size on
  the wire of an RFC 2136 update that replaces every record of a view (dnspython, unsigned).

    python benchmarks/control_plane_scale.py [--quick] [--regions 10,100,500] [--windows 12]
        [--window-s 10] [--status-every-s 30] [--out-dir DIR]

``--quick`` (``make bench``): 10 and 100 regions, 4 windows of 5 s.  Writes
control_plane_scale.json, .md and .png to benchmarks/results/; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _publishers as pub
import dns.update
from agent_overhead import cpu_s, machine

import meridian_etcd
from controlplane.dns import steering
from controlplane.reconcile import fleet
from controlplane.settings import ControllerSettings
from meridian_wire import keys
from policies import dns_plan
from tests.support.etcd import start_etcd
from tests.support.ports import free_port
from tests.support.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_ETCD_METRICS = {
    "puts": "etcd_mvcc_put_total",
    "txns": "etcd_mvcc_txn_total",
    "ranges": "etcd_mvcc_range_total",
    "received_bytes": "etcd_network_client_grpc_received_bytes_total",
    "sent_bytes": "etcd_network_client_grpc_sent_bytes_total",
    "wal_bytes": "etcd_disk_wal_write_bytes_total",
    "keys": "etcd_debugging_mvcc_keys_total",
    "db_bytes": "etcd_mvcc_db_total_size_in_bytes",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def regions(n: int) -> list[dict[str, Any]]:
    """Ten regions per geography, each backed by the next one of its geography."""
    out = []
    for i in range(n):
        geo = pub.geo_of(i)
        peers = [j for j in range(n) if pub.geo_of(j) == geo]
        backup = peers[(peers.index(i) + 1) % len(peers)]
        out.append(
            {
                "id": pub.region_name(i),
                "geo": geo,
                "residency": [geo],
                "backups": [pub.region_name(backup)] if backup != i else [],
            }
        )
    return out


def controller_toml(n: int, *, port: int, etcd: str, window_s: float, heartbeat_s: float) -> str:
    lines = [
        "[etcd]",
        f"endpoints = {json.dumps([etcd])}",
        "timeout_s = 10.0",
        "[election]",
        'id = "ctl-bench"',
        "[failover]",
        f"window_s = {window_s}",
        f"agent_heartbeat_s = {heartbeat_s}",
        f"status_stale_s = {3 * heartbeat_s}",
        "min_hold_s = 0.0",
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
    ]
    for r in regions(n):
        lines += [
            "[[regions]]",
            f'id = "{r["id"]}"',
            f'geo = "{r["geo"]}"',
            f"residency = {json.dumps(r['residency'])}",
            f"backups = {json.dumps(r['backups'])}",
        ]
    return "\n".join(lines) + "\n"


def etcd_metrics(url: str) -> dict[str, float]:
    with _HTTP.open(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    wanted = {name: key for key, name in _ETCD_METRICS.items()}
    out = dict.fromkeys(_ETCD_METRICS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return out


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


class Health:
    """Polls the controller's ``/health`` in a thread: each window's pass time and writes."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/health"
        self.passes: dict[int, tuple[float, int]] = {}
        self._said = 0.0  # when progress was last logged
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError), _HTTP.open(self.url, timeout=2) as r:
                body = json.loads(r.read())
                if body.get("window") is not None and body.get("pass_s") is not None:
                    self.passes[int(body["window"])] = (body["pass_s"], body["pass_writes"])
            self._stop.wait(0.2)

    @property
    def window(self) -> int:
        return max(self.passes, default=-1)

    def progress(self, begin: int, windows: int) -> None:
        """Log how many of the measured windows have passed, every 15 s."""
        if time.monotonic() - self._said >= 15:
            self._said = time.monotonic()
            log(f"  window {self.window - begin} of {windows}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def _fleet_sizes(url: str, n: int) -> dict[str, Any]:
    """What a pass reads and writes, and the DNS plan of the fleet left in etcd."""
    store = meridian_etcd.Store(meridian_etcd.ClientConfig(endpoints=[url], timeout_s=30.0))
    try:
        snap = await store.get_prefix(keys.REGIONS)
        plan = await store.get(keys.PLAN)
        view = await fleet.read(store)
    finally:
        await store.close()
    settings = ControllerSettings(etcd={"endpoints": [url]}, regions=regions(n))
    inputs = steering.inputs(settings, view)
    zone = "meridian.example."
    specs = [
        dns_plan.ViewSpec(view=f"view-{g}", zone=zone, geo=g)
        for g in sorted({pub.geo_of(i) for i in range(n)})
    ]
    planned = dns_plan.plan(specs, fleet=inputs, names=dns_plan.Names(), window=1)
    records, wire = [], []
    for v in planned.views.values():
        message = dns.update.UpdateMessage(zone)
        for rrset in v.records:
            message.replace(rrset.name, rrset.ttl_s, rrset.rdtype, *rrset.values)
        records.append(sum(len(r.values) for r in v.records))
        wire.append(len(message.to_wire()))
    states = [h.state for r in view.regions.values() if (h := r.health) is not None]
    return {
        "read_keys": len(snap.entries),
        "read_bytes": sum(len(e.key) + len(e.value) for e in snap.entries),
        "plan_bytes": len(plan.value) if plan is not None else 0,
        "healthy": states.count("healthy"),
        "dns_views": len(specs),
        "dns_records_per_view": statistics.median(records),
        "dns_update_bytes_per_view": statistics.median(wire),
        "dns_update_bytes_all": sum(wire),
    }


def run_scale(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    agents = sum(pub.agents_of(i) for i in range(n))
    log(f"{n} regions, {agents} agent replicas: starting etcd")
    with start_etcd(work) as etcd:
        port = free_port()
        config = work / f"controller-{n}.toml"
        config.write_text(
            controller_toml(n, port=port, etcd=etcd.url, window_s=args.window_s,
                            heartbeat_s=args.status_every_s)
        )  # fmt: skip
        argv = [sys.executable, "-m", "controlplane.cli", "--config", str(config)]
        ctl = ServerProcess(argv, log_path=work / f"controller-{n}.log")
        errors = (work / f"publishers-{n}.log").open("w")
        publishers = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_publishers.py")), "--etcd", etcd.url,
             "--regions", str(n), "--status-every-s", str(args.status_every_s)],
            stdout=subprocess.PIPE, text=True, stderr=errors,
        )  # fmt: skip
        drain: threading.Thread | None = None
        health = Health(port)
        try:
            assert publishers.stdout is not None
            started = time.monotonic()
            line = publishers.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"the publishers stopped: see {work}/publishers-{n}.log")
            log(f"  {agents} replicas published in {time.monotonic() - started:.1f} s")
            drain = threading.Thread(target=publishers.stdout.read, daemon=True)
            drain.start()
            first = health.window
            while health.window < first + 2:  # two passes: the grace window, then one judging
                if ctl.exit_code() is not None:
                    raise ctl.failure("the controller exited")
                time.sleep(0.2)
            begin_window = health.window
            before = etcd_metrics(etcd.url)
            cpu0 = {w: cpu_s(p) for w, p in (("etcd", etcd.process.pid), ("controller", ctl.pid),
                                             ("publishers", publishers.pid))}  # fmt: skip
            t0 = time.monotonic()
            while health.window < begin_window + args.windows:
                if ctl.exit_code() is not None:
                    raise ctl.failure("the controller exited")
                time.sleep(0.2)
                health.progress(begin_window, args.windows)
            elapsed = time.monotonic() - t0
            after = etcd_metrics(etcd.url)
            cpu = {w: (cpu_s(p) - cpu0[w]) / elapsed
                   for w, p in (("etcd", etcd.process.pid), ("controller", ctl.pid),
                                ("publishers", publishers.pid))}  # fmt: skip
            mem = memory_kib(ctl.pid)
            passes = [health.passes[w] for w in sorted(health.passes) if w > begin_window]
            sizes = asyncio.run(_fleet_sizes(etcd.url, n))
        finally:
            health.stop()
            publishers.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                publishers.wait(timeout=10)
            if drain is not None:
                drain.join(timeout=10)
            if publishers.stdout is not None:
                publishers.stdout.close()
            errors.close()
            ctl.stop()
    durations = sorted(p[0] for p in passes)
    rate = {k: (after[k] - before[k]) / elapsed for k in ("puts", "txns", "ranges",
                                                           "received_bytes", "sent_bytes",
                                                           "wal_bytes")}  # fmt: skip
    row = {
        "regions": n,
        "agents": agents,
        "window_s": args.window_s,
        "passes": len(durations),
        "pass_p50_s": statistics.median(durations),
        "pass_max_s": durations[-1],
        "pass_max_fraction_of_window": durations[-1] / args.window_s,
        "pass_writes_p50": statistics.median(p[1] for p in passes),
        "etcd_per_s": rate,
        "etcd_keys": after["keys"],
        "etcd_db_bytes": after["db_bytes"],
        "cpu_cores": cpu,
        "controller_rss_mib": mem.get("VmRSS", 0) / 1024,
        "controller_peak_mib": mem.get("VmHWM", 0) / 1024,
        **sizes,
    }
    p50_ms, max_ms, rss = row["pass_p50_s"] * 1000, row["pass_max_s"] * 1000, mem.get("VmRSS", 0)
    log(f"  pass p50 {p50_ms:.0f} ms, max {max_ms:.0f} ms; etcd {rate['puts']:.0f} puts/s; "
        f"controller {rss / 1024:.0f} MiB")  # fmt: skip
    return row


def _kib(x: float) -> str:
    return f"{x / 1024:,.0f}"


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    out = [
        "| regions | agents | pass p50 | pass max (of the window) | keys written / pass | "
        "etcd puts/s | etcd txns/s | gRPC in / out KiB/s | WAL KiB/s | CPU etcd / controller / "
        "publishers | controller RSS (peak) | one pass reads | plan key | DNS per view: records, "
        "update |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        e, c = r["etcd_per_s"], r["cpu_cores"]
        out.append(
            f"| {r['regions']} | {r['agents']} | {r['pass_p50_s'] * 1000:.0f} ms | "
            f"{r['pass_max_s'] * 1000:.0f} ms ({r['pass_max_fraction_of_window']:.1%}) | "
            f"{r['pass_writes_p50']:.0f} | {e['puts']:.0f} | {e['txns']:.1f} | "
            f"{_kib(e['received_bytes'])} / {_kib(e['sent_bytes'])} | {_kib(e['wal_bytes'])} | "
            f"{c['etcd']:.2f} / {c['controller']:.2f} / {c['publishers']:.2f} | "
            f"{r['controller_rss_mib']:.0f} MiB ({r['controller_peak_mib']:.0f}) | "
            f"{r['read_keys']:,} keys, {_kib(r['read_bytes'])} KiB | {_kib(r['plan_bytes'])} KiB | "
            f"{r['dns_records_per_view']:.0f}, {r['dns_update_bytes_per_view']:,.0f} B |"
        )
    return out


def plot(rows: Sequence[dict[str, Any]], subtitle: str, path: Path) -> None:
    from router_cpu import _pyplot

    plt = _pyplot()
    if plt is None:
        return
    xs = [r["regions"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    a.plot(xs, [r["pass_p50_s"] * 1000 for r in rows], "o-", label="p50")
    a.plot(xs, [r["pass_max_s"] * 1000 for r in rows], "s--", label="max")
    a.axhline(rows[0]["window_s"] * 100, color="grey", lw=0.8, ls=":",
              label="10 % of the window")  # fmt: skip
    a.set(xscale="log", yscale="log", xlabel="regions", ylabel="window pass (ms)",
          title="the leader's window pass")  # fmt: skip
    a.legend()
    b.plot(xs, [r["etcd_per_s"]["puts"] for r in rows], "o-", label="puts/s")
    b.plot(xs, [r["etcd_per_s"]["wal_bytes"] / 1024 for r in rows], "s--", label="WAL KiB/s")
    b.plot(xs, [r["etcd_per_s"]["sent_bytes"] / 1024 for r in rows], "^:", label="gRPC out KiB/s")
    b.set(xscale="log", yscale="log", xlabel="regions", title="etcd")
    b.legend()
    c.plot(xs, [r["controller_peak_mib"] for r in rows], "o-", label="controller peak RSS (MiB)")
    c.plot(xs, [r["plan_bytes"] / 1024 for r in rows], "s--", label="plan key (KiB)")
    c.plot(xs, [r["read_bytes"] / 1024 for r in rows], "^:", label="one pass reads (KiB)")
    c.set(xscale="log", yscale="log", xlabel="regions", title="size")
    c.legend()
    fig.suptitle(f"meridian-controller against 10-500 regions of 1-10 agents ({subtitle})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--regions", default=None, help="comma-separated, e.g. 10,100,500")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--window-s", type=float, default=None)
    parser.add_argument("--status-every-s", type=float, default=30.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    scales = [
        int(x) for x in (args.regions or ("10,100" if args.quick else "10,100,500")).split(",")
    ]
    args.windows = args.windows or (4 if args.quick else 12)
    args.window_s = args.window_s or (5.0 if args.quick else 10.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cp-scale-") as tmp:
        for n in scales:
            rows.append(run_scale(n, args, Path(tmp)))
    host = machine()
    result = {
        "machine": host,
        "command": "python benchmarks/control_plane_scale.py " + " ".join(argv or sys.argv[1:]),
        "window_s": args.window_s,
        "windows": args.windows,
        "status_every_s": args.status_every_s,
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "control_plane_scale.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = table(rows)
    (args.out_dir / "control_plane_scale.md").write_text("\n".join(lines) + "\n")
    subtitle = f"{host['sched_cpus']} cores, window {args.window_s:g} s"
    plot(rows, subtitle, args.out_dir / "control_plane_scale.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
