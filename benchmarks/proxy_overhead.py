"""What each router adds per request in front of fast nodes: Meridian against the three peers.

Question: how much latency (p50, p99) does ``meridian-agent`` add over talking to the nodes
directly, next to vllm-router 0.1.17, sglang-router 0.3.2 and smg 1.13.0, and how many
requests/s can each serve per core of CPU?

Two simulated ``cpu-tiny`` nodes at ``--time-scale 1000`` answer almost at once.  Each router
in turn runs in front of them with its default policy (``meridian`` for Meridian,
``cache_aware`` for the peers) at its quietest log level.  The router is pinned to core 1
(``taskset``/``sched_setaffinity``), the nodes and this load generator to core 0, so the router
has a core of its own and the direct baseline runs on the same core as everything else.  The load
is a closed loop of C workers (aiohttp, kept-alive connections; ``agent_overhead.run_load``),
chat requests with a short prompt that differs per request, non-streaming (2 output tokens) and
streaming (8 tokens, so 10 SSE events).  Per point: 1 s of warm-up, then ``--duration-s``
measured.  Each router point comes right after a direct point at the same C (the router idle in
the meantime), so both see the same outside load; "added" is router p50 minus that direct p50
(and p99 minus p99).

CPU per request is the router's process tree's user + system time (``/proc``) over the point,
divided by its requests; its idle CPU (health checks, scrapes), measured before its points, is
subtracted for "net".  Requests/s per core = 1 / net CPU per request: what one saturated core
would serve.  The measured requests/s is also given, but with the nodes and the load generator
sharing one core it says more about them than about a Rust router.

    python benchmarks/proxy_overhead.py [--quick] [--routers meridian,vllm-router,...]
        [--concurrency 1,16] [--duration-s 10] [--out-dir DIR] [--peers-root DIR]

Writes proxy_overhead.json and proxy_overhead.md to benchmarks/results/; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import agent_overhead as ao

ROOT = Path(__file__).resolve().parents[1]
ROUTERS = ("meridian", *_peers.PEERS)
PLAIN_TOKENS = 2
STREAM_TOKENS = 8


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (launchers that exec or fork a server)."""
    out = [pid]
    i = 0
    while i < len(out):
        p = out[i]
        i += 1
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in descendants(pid):
        try:
            total += ao.cpu_s(p)
        except OSError:
            continue
    return total


def pin(pid: int, cpus: set[int]) -> bool:
    """Pin every thread of ``pid`` and of its children to ``cpus``; False where not possible."""
    ok = False
    for p in descendants(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                os.sched_setaffinity(int(task), cpus)
                ok = True
            except OSError:
                continue
    return ok


@dataclass(slots=True)
class Proxy:
    name: str
    policy: str
    url: str
    pid: int
    stop: Callable[[], None]


def start_proxy(
    name: str, node_urls: Sequence[str], *, logdir: Path, peers_root: str | None, cpu: int | None
) -> Proxy:
    if name == "meridian":
        argv = ["-m", "regional_agent.cli", "--port", "0", "--policy", "meridian"]
        argv += ["--workers", "1"]  # one process, pinned below
        for u in node_urls:
            argv += ["--node", u]
        child = ao.spawn("agent", [*argv, "--log-level", "WARNING"], logdir)
        if cpu is not None:
            pin(child.proc.pid, {cpu})
        ao.wait_ready(child)
        return Proxy(
            name=name,
            policy="meridian",
            url=child.url,
            pid=child.proc.pid,
            stop=lambda: ao.stop_all([child]),
        )
    peer = _peers.PEERS[name]
    _peers.install(peer, root=peers_root)
    running = _peers.start(
        peer,
        worker_urls=node_urls,
        policy=peer.default_policy,
        logdir=logdir,
        root=peers_root,
        cpu=cpu,
    )
    return Proxy(
        name=name,
        policy=peer.default_policy,
        url=running.url,
        pid=running.proc.pid,
        stop=running.stop,
    )


async def measure(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    *,
    stream: bool,
    concurrency: int,
    args: argparse.Namespace,
    counter: itertools.count[int],
    proxy_pid: int,
    node_pids: Sequence[int],
) -> dict[str, Any]:
    load = {
        "concurrency": concurrency,
        "stream": stream,
        "model": args.model,
        "max_tokens": STREAM_TOKENS if stream else PLAIN_TOKENS,
        "counter": counter,
    }
    warm = await ao.run_load(session, urls, duration_s=args.warmup_s, **load)
    if not warm.latencies_s:
        raise SystemExit(f"{urls[0]}: no request succeeded in warm-up ({warm.first_error})")
    proxy0 = tree_cpu_s(proxy_pid)
    nodes0 = sum(ao.cpu_s(p) for p in node_pids)
    self0 = ao.self_cpu_s()
    machine0 = ao.machine_cpu_s()
    res = await ao.run_load(session, urls, duration_s=args.duration_s, **load)
    proxy_cpu = tree_cpu_s(proxy_pid) - proxy0
    nodes_cpu = sum(ao.cpu_s(p) for p in node_pids) - nodes0
    self_cpu = ao.self_cpu_s() - self0
    machine_cpu = ao.machine_cpu_s() - machine0
    n = len(res.latencies_s)
    pct = ao.percentile
    return {
        "stream": stream,
        "concurrency": concurrency,
        "requests": n,
        "errors": res.errors,
        "first_error": res.first_error,
        "elapsed_s": res.elapsed_s,
        "requests_per_s": n / res.elapsed_s,
        "latency_p50_s": pct(res.latencies_s, 0.5),
        "latency_p99_s": pct(res.latencies_s, 0.99),
        "ttfb_p50_s": pct(res.ttfb_s, 0.5) if stream else None,
        "ttfb_p99_s": pct(res.ttfb_s, 0.99) if stream else None,
        "proxy_cpu_s": proxy_cpu,
        "nodes_cpu_s": nodes_cpu,
        "loadgen_cpu_s": self_cpu,
        "others_cpu_cores": max(0.0, machine_cpu - proxy_cpu - nodes_cpu - self_cpu)
        / res.elapsed_s,
    }


async def run_all(
    args: argparse.Namespace,
    node_urls: Sequence[str],
    node_pids: Sequence[int],
    routers: Sequence[str],
    concurrency: Sequence[int],
    *,
    logdir: Path,
    proxy_cpu: int | None,
) -> list[dict[str, Any]]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=30)
    counter = itertools.count(1)
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(node_urls[0] + "/v1/models") as resp:
            args.model = (await resp.json())["data"][0]["id"]
        for target in routers:
            try:
                proxy = start_proxy(
                    target, node_urls, logdir=logdir, peers_root=args.peers_root, cpu=proxy_cpu
                )
            except _peers.PeerError as exc:
                log(f"skipping {target}: {exc}")
                continue
            try:
                for u in [*node_urls, proxy.url]:
                    await ao.wait_serving(session, u, model=args.model, timeout_s=60)
                await asyncio.sleep(0.5)
                c0, t0 = tree_cpu_s(proxy.pid), time.perf_counter()
                await asyncio.sleep(args.idle_s)
                idle_cpu_per_s = (tree_cpu_s(proxy.pid) - c0) / (time.perf_counter() - t0)
                for stream in (False, True):
                    for conc in concurrency:
                        # the direct point right before the router's: the same outside load
                        pair: list[dict[str, Any]] = []
                        for urls in (list(node_urls), [proxy.url]):
                            pair.append(
                                await measure(
                                    session,
                                    urls,
                                    stream=stream,
                                    concurrency=conc,
                                    args=args,
                                    counter=counter,
                                    proxy_pid=proxy.pid,
                                    node_pids=node_pids,
                                )
                            )
                        direct, row = pair
                        net = row["proxy_cpu_s"] - idle_cpu_per_s * row["elapsed_s"]
                        n = row["requests"]
                        row.update(
                            target=target,
                            policy=proxy.policy,
                            idle_cpu_cores=idle_cpu_per_s,
                            cpu_us_per_request=row["proxy_cpu_s"] / n * 1e6 if n else None,
                            net_cpu_us_per_request=net / n * 1e6 if n else None,
                            requests_per_core=n / net if n and net > 0 else None,
                            direct=direct,
                        )
                        rows.append(row)
                        log(
                            f"{target} {'stream' if stream else 'plain'} C={conc}: "
                            f"{row['requests_per_s']:.0f} req/s (direct "
                            f"{direct['requests_per_s']:.0f}), p50 "
                            f"{row['latency_p50_s'] * 1000:.2f} ms (direct "
                            f"{direct['latency_p50_s'] * 1000:.2f}), p99 "
                            f"{row['latency_p99_s'] * 1000:.2f} ms (direct "
                            f"{direct['latency_p99_s'] * 1000:.2f}), "
                            f"{row['net_cpu_us_per_request']:.0f} µs CPU/request net, others "
                            f"{max(row['others_cpu_cores'], direct['others_cpu_cores']):.2f} "
                            f"cores, errors {row['errors'] + direct['errors']}"
                        )
            finally:
                proxy.stop()
    return rows


def _ms(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x * 1000:.2f}"


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per router and point; "added" against the direct point measured just before."""
    out = [
        "| mode | C | router | direct req/s | router req/s | direct p50 (ms) | router p50 (ms) "
        "| added p50 (ms) | added p99 (ms) | added TTFB p50 (ms) | added TTFB p99 (ms) "
        "| CPU/request net (µs) | idle CPU (cores) | req/s per core | other load (cores) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(ROUTERS)}
    for r in sorted(rows, key=lambda r: (r["stream"], r["concurrency"], order[r["target"]])):
        d = r["direct"]
        cells = [
            "stream" if r["stream"] else "plain",
            str(r["concurrency"]),
            r["target"],
            f"{d['requests_per_s']:.0f}",
            f"{r['requests_per_s']:.0f}",
            _ms(d["latency_p50_s"]),
            _ms(r["latency_p50_s"]),
        ]
        for key in ("latency_p50_s", "latency_p99_s", "ttfb_p50_s", "ttfb_p99_s"):
            cells.append("" if r[key] is None else _ms(r[key] - d[key]))
        net = r["net_cpu_us_per_request"]
        per_core = r["requests_per_core"]
        cells += [
            "n/a" if net is None else f"{net:.0f}",
            f"{r['idle_cpu_cores']:.3f}",
            f"{per_core:.0f}" if per_core else "n/a",
            f"{max(r['others_cpu_cores'], d['others_cpu_cores']):.2f}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="C 1 and 16, 3 s points")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--concurrency", help="closed-loop workers (default 1,4,16,64; quick 1,16)")
    parser.add_argument("--duration-s", type=float, help="measured s per point (10; quick 3)")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle CPU measurement per router")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--profile", default="cpu-tiny")
    parser.add_argument("--time-scale", type=float, default=1000.0)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--peers-root", help="where the peers' venvs live (default ~/.cache/...)")
    args = parser.parse_args(argv)
    concurrency = [
        int(c) for c in (args.concurrency or ("1,16" if args.quick else "1,4,16,64")).split(",")
    ]
    args.duration_s = args.duration_s or (3.0 if args.quick else 10.0)
    routers = [r for r in args.routers.split(",") if r]
    for r in routers:
        if r not in ROUTERS:
            raise SystemExit(f"unknown router {r!r}; choose from {', '.join(ROUTERS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the children
    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) >= 2
    proxy_cpu = cpus[1] if pinned else None
    if pinned:
        os.sched_setaffinity(0, {cpus[0]})  # the load generator
    started = time.perf_counter()
    load_start = os.getloadavg()
    where = f"router on cpu {cpus[1]}, the rest on cpu {cpus[0]}" if pinned else "none"
    log(f"load average at start {load_start}; pinning: {where}")

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proxy_overhead.") as tmp:
        logdir = Path(tmp)
        children: list[ao.Child] = []
        try:
            for i in range(args.nodes):
                children.append(
                    ao.spawn_node(
                        i, profile=args.profile, time_scale=args.time_scale, logdir=logdir
                    )
                )
            node_urls = [ao.wait_ready(c) for c in children]
            rows = asyncio.run(
                run_all(
                    args,
                    node_urls,
                    [c.proc.pid for c in children],
                    routers,
                    concurrency,
                    logdir=logdir,
                    proxy_cpu=proxy_cpu,
                )
            )
        finally:
            ao.stop_all(children)

    meta = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "nodes": args.nodes,
        "profile": args.profile,
        "time_scale": args.time_scale,
        "plain_tokens": PLAIN_TOKENS,
        "stream_tokens": STREAM_TOKENS,
        "pinned": pinned,
        "machine": ao.machine(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "elapsed_s": time.perf_counter() - started,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "versions": {p.name: p.version for p in _peers.PEERS.values()},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "proxy_overhead.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    md = [
        "# Proxy overhead (benchmarks/proxy_overhead.py)",
        "",
        f"`{meta['command']}`, {meta['date']}, {meta['elapsed_s']:.0f} s; load average "
        f"{load_start[0]:.2f} at start, {meta['loadavg_end'][0]:.2f} at end; router pinned to "
        f"its own core: {'yes' if pinned else 'no'}.",
        "",
        *table(rows),
    ]
    (args.out_dir / "proxy_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    log(f"done in {meta['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
