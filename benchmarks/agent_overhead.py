"""How much latency and throughput the regional agent adds over talking to a node directly.

Question: what does ``meridian-agent`` cost per request?  Starts K simulated nodes
(``meridian-sim node``, separate processes) at a time scale so high that they answer almost at
once, and one agent process in front of them; then, from this process, a closed-loop load of C
concurrent workers (aiohttp, one kept-alive connection pool) runs for a fixed time per point
against (a) the nodes directly (requests spread round robin over the K nodes) and (b) the
agent, non-streaming and streaming, for each C in the sweep.  Each point is warmed up first.
Records latency p50/p99 (streams: time to first byte and total), requests/s, and the CPU time
each process used per request (``/proc/<pid>/stat``; the agent's idle CPU, from its background
scrapes and probes, is measured first and subtracted).  Writes ``agent_overhead.json``,
``agent_overhead.md`` (tables) and ``agent_overhead.png`` (a plot, when matplotlib is
installed: ``pip install -e '.[bench]'``).

    python benchmarks/agent_overhead.py [--nodes 2] [--concurrency 1,4,16,64] [--duration-s 10]
        [--warmup-s 1] [--policy meridian] [--time-scale 1000] [--max-tokens 2] [--out-dir DIR]

Everything runs on 127.0.0.1 and stops by itself; the child processes are ended on exit, error
or interrupt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_START_TIMEOUT_S = 30.0
_REQUEST_TIMEOUT_S = 30.0
_READY_TIMEOUT_S = 20.0


# -- child processes ----------------------------------------------------------------------------


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    stderr_path: Path
    url: str = ""

    def stderr_tail(self, n: int = 20) -> str:
        try:
            lines = self.stderr_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise SystemExit(f"{self.name} exited with {code}:\n{self.stderr_tail()}")


def spawn(
    name: str, argv: Sequence[str], logdir: Path, *, env: dict[str, str] | None = None
) -> Child:
    stderr_path = logdir / f"{name}.stderr"
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=None if env is None else {**os.environ, **env},
        )
    return Child(name=name, proc=proc, stderr_path=stderr_path)


def kv_endpoints(i: int, logdir: Path) -> tuple[str, str]:
    """Node ``i``'s KV-event PUB and replay endpoints (Unix sockets in ``logdir``)."""
    return f"ipc://{logdir}/node{i}-events.sock", f"ipc://{logdir}/node{i}-replay.sock"


def spawn_node(
    i: int, *, profile: str, time_scale: float, logdir: Path, kv_events: bool = False
) -> Child:
    """``meridian-sim node`` number ``i`` (seeded by ``i``) on a free loopback port; with
    ``kv_events`` publishing its KV-cache events at :func:`kv_endpoints`."""
    argv = ["-m", "meridian_sim.cli", "node", "--port", "0", "--profile", profile, "--time-scale",
            f"{time_scale:g}", "--seed", str(i), "--log-level", "WARNING"]  # fmt: skip
    if kv_events:
        events, replay = kv_endpoints(i, logdir)
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                  "replay_endpoint": replay}  # fmt: skip
        argv += ["--kv-events-config", json.dumps(config)]
    return spawn(f"node{i}", argv, logdir)


def wait_ready(child: Child, *, timeout_s: float = _START_TIMEOUT_S) -> str:
    """Read the child's stdout until ``READY http://...``; return the URL."""
    assert child.proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(child.proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(child.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("READY "):
                    child.url = line.split()[1]
                    return child.url
    child.check_alive()
    raise SystemExit(f"{child.name}: no READY line within {timeout_s:g} s:\n{child.stderr_tail()}")


def stop_all(children: Sequence[Child]) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + 5.0
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait(timeout=5.0)
        if c.proc.stdout is not None:
            c.proc.stdout.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the ")": state is field 3, so utime (14) and stime (15) are at 11 and 12
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_cpu_s() -> float:
    """CPU seconds that processes used on the whole machine, all cores, from /proc/stat: user,
    nice and system; not idle, iowait, interrupts or time stolen by the hypervisor."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (ticks[0] + ticks[1] + ticks[2]) / _CLK_TCK


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- load -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class PointResult:
    latencies_s: list[float] = field(default_factory=list)
    ttfb_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    elapsed_s: float = 0.0


def body(n: int, *, model: str, max_tokens: int, stream: bool) -> bytes:
    """A chat request with a short, unique prompt: no prefix sharing, little to tokenise."""
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"request {n}"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


async def run_load(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    *,
    concurrency: int,
    duration_s: float,
    stream: bool,
    model: str,
    max_tokens: int,
    counter: Iterator[int],
) -> PointResult:
    """Closed loop: ``concurrency`` workers each send a request as soon as the last one ends,
    until ``duration_s`` has passed; requests go round robin over ``urls``."""
    result = PointResult()
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    deadline = started + duration_s

    async def worker() -> None:
        while time.perf_counter() < deadline:
            n = next(counter)
            url = urls[n % len(urls)] + "/v1/chat/completions"
            data = body(n, model=model, max_tokens=max_tokens, stream=stream)
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=data, headers=headers) as resp:
                    if stream:
                        first: float | None = None
                        async for _chunk in resp.content.iter_any():
                            if first is None:
                                first = time.perf_counter()
                    else:
                        await resp.read()
                        first = None
                    t1 = time.perf_counter()
                    if resp.status != 200:
                        result.errors += 1
                        result.first_error = result.first_error or f"HTTP {resp.status}"
                        continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                result.errors += 1
                result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"
                continue
            result.latencies_s.append(t1 - t0)
            if first is not None:
                result.ttfb_s.append(first - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - started
    return result


async def wait_serving(
    session: aiohttp.ClientSession, url: str, *, model: str, timeout_s: float
) -> None:
    """Until one request through ``url`` succeeds (the agent learns node health first)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            async with session.post(
                url + "/v1/chat/completions",
                data=body(0, model=model, max_tokens=1, stream=False),
                headers={"Content-Type": "application/json"},
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.2)
    raise SystemExit(f"{url}: not serving after {timeout_s:g} s ({last})")


async def served_counts(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[float]:
    """Finished requests per node, from each node's ``vllm:request_success_total``."""
    out: list[float] = []
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        out.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total")
            )
        )
    return out


# -- statistics -----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def machine() -> dict[str, Any]:
    model_name = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    return {
        "nproc": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": model_name,
        "mem_gib": mem_gib,
        "arch": platform.machine(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
    }


# -- the benchmark ---------------------------------------------------------------------------------


async def sweep(
    args: argparse.Namespace, nodes: Sequence[Child], agent: Child, concurrency: Sequence[int]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    node_urls = [n.url for n in nodes]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    counter = itertools.count(1)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(node_urls[0] + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        for url in [*node_urls, agent.url]:
            await wait_serving(session, url, model=model, timeout_s=_READY_TIMEOUT_S)

        # the agent's idle CPU: health probes and /metrics scrapes, which run under load too
        await asyncio.sleep(0.5)
        idle_started = time.perf_counter()
        agent_idle0 = cpu_s(agent.proc.pid)
        nodes_idle0 = sum(cpu_s(n.proc.pid) for n in nodes)
        await asyncio.sleep(args.idle_s)
        idle_elapsed = time.perf_counter() - idle_started
        idle = {
            "agent_cpu_per_s": (cpu_s(agent.proc.pid) - agent_idle0) / idle_elapsed,
            "nodes_cpu_per_s": (sum(cpu_s(n.proc.pid) for n in nodes) - nodes_idle0) / idle_elapsed,
            "measured_s": idle_elapsed,
        }
        print(
            f"idle: agent {idle['agent_cpu_per_s'] * 100:.1f} % of a core, nodes "
            f"{idle['nodes_cpu_per_s'] * 100:.1f} % (subtracted from the agent's CPU per request)",
            flush=True,
        )

        points = [
            (s, c, t) for s in (False, True) for c in concurrency for t in ("direct", "agent")
        ]
        rows: list[dict[str, Any]] = []
        for i, (stream, conc, target) in enumerate(points, 1):
            for c in [*nodes, agent]:
                c.check_alive()
            urls = node_urls if target == "direct" else [agent.url]
            load = {
                "concurrency": conc,
                "stream": stream,
                "model": model,
                "max_tokens": args.max_tokens,
                "counter": counter,
            }
            warm = await run_load(session, urls, duration_s=args.warmup_s, **load)
            if not warm.latencies_s:
                raise SystemExit(f"{target}: no request succeeded in warm-up ({warm.first_error})")
            served0 = await served_counts(session, node_urls)
            agent0 = cpu_s(agent.proc.pid)
            nodes0 = [cpu_s(n.proc.pid) for n in nodes]
            self0 = self_cpu_s()
            machine0 = machine_cpu_s()
            res = await run_load(session, urls, duration_s=args.duration_s, **load)
            agent_cpu = cpu_s(agent.proc.pid) - agent0
            nodes_cpu = sum(cpu_s(n.proc.pid) for n in nodes) - sum(nodes0)
            self_cpu = self_cpu_s() - self0
            machine_cpu = machine_cpu_s() - machine0
            served1 = await served_counts(session, node_urls)
            n_ok = len(res.latencies_s)
            per_node = [b - a for a, b in zip(served0, served1, strict=True)]
            agent_net = agent_cpu - idle["agent_cpu_per_s"] * res.elapsed_s
            row: dict[str, Any] = {
                "target": target,
                "stream": stream,
                "concurrency": conc,
                "requests": n_ok,
                "errors": res.errors,
                "first_error": res.first_error,
                "elapsed_s": res.elapsed_s,
                "requests_per_s": n_ok / res.elapsed_s,
                "latency_p50_s": percentile(res.latencies_s, 0.5),
                "latency_p90_s": percentile(res.latencies_s, 0.9),
                "latency_p99_s": percentile(res.latencies_s, 0.99),
                "latency_max_s": max(res.latencies_s, default=float("nan")),
                "ttfb_p50_s": percentile(res.ttfb_s, 0.5) if stream else None,
                "ttfb_p99_s": percentile(res.ttfb_s, 0.99) if stream else None,
                "agent_cpu_s": agent_cpu,
                "agent_cpu_us_per_request": agent_cpu / n_ok * 1e6 if n_ok else None,
                "agent_net_cpu_us_per_request": agent_net / n_ok * 1e6 if n_ok else None,
                "nodes_cpu_s": nodes_cpu,
                "nodes_cpu_us_per_request": nodes_cpu / n_ok * 1e6 if n_ok else None,
                "loadgen_cpu_s": self_cpu,
                "loadgen_cpu_us_per_request": self_cpu / n_ok * 1e6 if n_ok else None,
                "machine_busy": (agent_cpu + nodes_cpu + self_cpu)
                / (res.elapsed_s * (os.cpu_count() or 1)),
                # CPU of processes that are not this benchmark's, over the point, in cores
                "others_cpu_cores": max(0.0, machine_cpu - agent_cpu - nodes_cpu - self_cpu)
                / res.elapsed_s,
                "served_per_node": per_node,
            }
            rows.append(row)
            mode = "stream" if stream else "plain"
            ttfb = (
                f" TTFB p50 {row['ttfb_p50_s'] * 1000:.2f} ms,"
                if stream and row["ttfb_p50_s"] == row["ttfb_p50_s"]
                else ""
            )
            print(
                f"[{i}/{len(points)}] {mode} C={conc} {target}: {n_ok} ok "
                f"({res.errors} errors), {row['requests_per_s']:.0f} req/s,{ttfb} p50 "
                f"{row['latency_p50_s'] * 1000:.2f} ms p99 {row['latency_p99_s'] * 1000:.2f} ms, "
                f"agent CPU {agent_cpu:.2f} s, nodes {nodes_cpu:.2f} s, loadgen {self_cpu:.2f} s, "
                f"others {row['others_cpu_cores']:.2f} cores, "
                f"per node {[int(x) for x in per_node]}",
                flush=True,
            )
            if res.errors:
                print(f"  errors: {res.errors}, first: {res.first_error}", flush=True)
    return rows, idle


def _ms(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x * 1000:.2f}"


def _us(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.0f}"


def tables(rows: Sequence[dict[str, Any]]) -> list[str]:
    by = {(r["stream"], r["concurrency"], r["target"]): r for r in rows}
    keys = sorted({(r["stream"], r["concurrency"]) for r in rows})
    out = [
        "Latency (streams: until the last byte) and throughput; added = agent - direct, "
        "percentile by percentile.",
        "",
        "| mode | C | direct p50 (ms) | direct p99 (ms) | agent p50 (ms) | agent p99 (ms) | "
        "added p50 (ms) | added p99 (ms) | direct req/s | agent req/s | agent/direct req/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stream, conc in keys:
        d, a = by[(stream, conc, "direct")], by[(stream, conc, "agent")]
        out.append(
            f"| {'stream' if stream else 'plain'} | {conc} | {_ms(d['latency_p50_s'])} | "
            f"{_ms(d['latency_p99_s'])} | {_ms(a['latency_p50_s'])} | "
            f"{_ms(a['latency_p99_s'])} | "
            f"{_ms(a['latency_p50_s'] - d['latency_p50_s'])} | "
            f"{_ms(a['latency_p99_s'] - d['latency_p99_s'])} | "
            f"{d['requests_per_s']:.0f} | {a['requests_per_s']:.0f} | "
            f"{a['requests_per_s'] / d['requests_per_s']:.2f} |"
        )
    out += [
        "",
        "Streams: time to first byte.",
        "",
        "| C | direct p50 (ms) | direct p99 (ms) | agent p50 (ms) | agent p99 (ms) | "
        "added p50 (ms) | added p99 (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stream, conc in keys:
        if not stream:
            continue
        d, a = by[(stream, conc, "direct")], by[(stream, conc, "agent")]
        out.append(
            f"| {conc} | {_ms(d['ttfb_p50_s'])} | {_ms(d['ttfb_p99_s'])} | "
            f"{_ms(a['ttfb_p50_s'])} | {_ms(a['ttfb_p99_s'])} | "
            f"{_ms(a['ttfb_p50_s'] - d['ttfb_p50_s'])} | "
            f"{_ms(a['ttfb_p99_s'] - d['ttfb_p99_s'])} |"
        )
    out += [
        "",
        "CPU time per request (µs), from /proc/<pid>/stat; the agent's net of its idle CPU. "
        "Machine busy: this benchmark's processes' CPU over the point's wall time and all cores; "
        "other processes: the most CPU (in cores) that processes outside the benchmark used "
        "during the direct or the agent point.",
        "",
        "| mode | C | agent (net) | agent (raw) | nodes, direct | nodes, via agent | "
        "load gen, direct | load gen, via agent | machine busy, direct | machine busy, agent | "
        "other processes (cores) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stream, conc in keys:
        d, a = by[(stream, conc, "direct")], by[(stream, conc, "agent")]
        out.append(
            f"| {'stream' if stream else 'plain'} | {conc} | "
            f"{_us(a['agent_net_cpu_us_per_request'])} | {_us(a['agent_cpu_us_per_request'])} | "
            f"{_us(d['nodes_cpu_us_per_request'])} | {_us(a['nodes_cpu_us_per_request'])} | "
            f"{_us(d['loadgen_cpu_us_per_request'])} | {_us(a['loadgen_cpu_us_per_request'])} | "
            f"{d['machine_busy'] * 100:.0f} % | {a['machine_busy'] * 100:.0f} % | "
            f"{max(d['others_cpu_cores'], a['others_cpu_cores']):.2f} | "
            f"{d['errors'] + a['errors']} |"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes behind the agent")
    parser.add_argument("--concurrency", default="1,4,16,64", help="closed-loop workers, a list")
    parser.add_argument("--duration-s", type=float, default=10.0, help="measured time per point")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured load per point")
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle CPU measurement, s")
    parser.add_argument("--policy", default="meridian", help="the agent's routing policy")
    parser.add_argument("--profile", default="cpu-tiny", help="the nodes' simulator profile")
    parser.add_argument(
        "--time-scale", type=float, default=1000.0, help="nodes run this much faster than real"
    )
    parser.add_argument("--max-tokens", type=int, default=2, help="output tokens per request")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="C = 1 and 16, 3 s each")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.duration_s, args.idle_s = "1,16", min(args.duration_s, 3.0), 1.0
    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency {args.concurrency!r}: expected integers, e.g. 1,4,16,64")
    if not concurrency or min(concurrency) < 1:
        parser.error("--concurrency: each value must be >= 1")
    if args.nodes < 1:
        parser.error("--nodes must be >= 1")
    if args.duration_s <= 0 or args.warmup_s <= 0 or args.idle_s <= 0:
        parser.error("--duration-s, --warmup-s and --idle-s must be > 0")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    # SIGTERM ends the run like Ctrl-C does, so the children are stopped in `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    children: list[Child] = []
    started = time.perf_counter()
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="agent_overhead.") as tmp:
        logdir = Path(tmp)
        try:
            nodes = [
                spawn_node(i, profile=args.profile, time_scale=args.time_scale, logdir=logdir)
                for i in range(args.nodes)
            ]
            children += nodes
            for n in nodes:
                wait_ready(n)
            agent_argv = ["-m", "regional_agent.cli", "--port", "0", "--policy", args.policy]
            agent_argv += ["--workers", "1"]  # one process, the one measured
            for n in nodes:
                agent_argv += ["--node", n.url]
            agent = spawn("agent", [*agent_argv, "--log-level", "WARNING"], logdir)
            children.append(agent)
            wait_ready(agent)
            print(
                f"nodes {[n.url for n in nodes]} (pids {[n.proc.pid for n in nodes]}), agent "
                f"{agent.url} (pid {agent.proc.pid}, policy {args.policy})",
                flush=True,
            )
            rows, idle = asyncio.run(sweep(args, nodes, agent, concurrency))
        finally:
            stop_all(children)

    meta = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "nodes": args.nodes,
        "profile": args.profile,
        "time_scale": args.time_scale,
        "policy": args.policy,
        "max_tokens": args.max_tokens,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "idle": idle,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "loadavg_at_start": load_at_start,
        "wall_s": time.perf_counter() - started,
    }
    (args.out_dir / "agent_overhead.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    table = tables(rows)
    (args.out_dir / "agent_overhead.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    m = meta["machine"]
    _plot(
        rows,
        f"{args.nodes} nodes, policy {args.policy}; {m['nproc']} cores {m['cpu_model']}",
        args.out_dir / "agent_overhead.png",
    )
    print(f"done in {meta['wall_s']:.0f} s", flush=True)
    return 0


def _plot(rows: Sequence[dict[str, Any]], subtitle: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    by = {(r["stream"], r["concurrency"], r["target"]): r for r in rows}
    conc = sorted({r["concurrency"] for r in rows})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for stream, style in ((False, "-"), (True, "--")):
        mode = "stream" if stream else "plain"
        for q, marker in (("p50", "o"), ("p99", "s")):
            key = f"latency_{q}_s"
            added = [by[(stream, c, "agent")][key] - by[(stream, c, "direct")][key] for c in conc]
            ax.plot(
                conc,
                [x * 1000 for x in added],
                marker + style,
                label=f"{mode} {q}",
            )
        for target, marker in (("direct", "o"), ("agent", "^")):
            ax2.plot(
                conc,
                [by[(stream, c, target)]["requests_per_s"] for c in conc],
                marker + style,
                label=f"{mode}, {target}",
            )
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("added latency, agent - direct (ms)")
    ax.set_title("latency the agent adds")
    ax.legend()
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(conc, [str(c) for c in conc])
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("concurrent clients (closed loop)")
    ax2.set_ylabel("requests/s")
    ax2.set_title("throughput, direct vs through the agent")
    ax2.legend()
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
