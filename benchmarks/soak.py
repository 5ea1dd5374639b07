"""Soak: does the agent lose requests, memory or file descriptors over a long run with faults?

Question: under minutes of mixed streaming and non-streaming load with node faults injected on a
schedule (a node killed and restarted, a node failing half its requests, a node 20x slower, an
engine that stops stepping, a node whose ``/health`` flaps), how many requests are lost (failed
before their first byte reached the client), how many streams break mid-way, and do the agent's
resident memory and open file descriptors stay flat?

One ``meridian-agent`` process in front of ``--nodes`` ``meridian-sim`` processes (cpu-tiny,
time scale 10), ``--concurrency`` clients with their own sessions (shared system prompts,
random lengths, three requests in four streamed).  Every second the agent's RSS
(``/proc/<pid>/status``) and descriptors (``/proc/<pid>/fd``) are sampled.  Writes
``soak.json``, ``soak.md`` and ``soak.png`` (with matplotlib: ``pip install -e '.[bench]'``).

    python benchmarks/soak.py [--duration-s 600] [--nodes 4] [--concurrency 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.faults.harness import AgentProc, NodeProc, Traffic, start_nodes  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

FAULTS = ("kill", "errors", "slow", "hang", "flap")


@dataclass(slots=True)
class Sample:
    t_s: float
    rss_mb: float
    fds: int
    ok: int
    lost: int
    broken: int
    fault: str | None


@dataclass(slots=True)
class Soak:
    nodes: list[NodeProc]
    agent: AgentProc
    traffic: Traffic
    samples: list[Sample] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    current: str | None = None


def _proc(pid: int) -> tuple[float, int]:
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def _faults(node: NodeProc, body: dict[str, Any] | None) -> None:
    async with aiohttp.ClientSession() as s:
        if body is None:
            async with s.delete(f"{node.url}/admin/faults") as r:
                r.raise_for_status()
        else:
            async with s.post(f"{node.url}/admin/faults", json=body) as r:
                r.raise_for_status()


async def _inject(soak: Soak, kind: str, node: NodeProc, hold_s: float) -> None:
    soak.current = f"{kind} {node.port}"
    started = time.monotonic()
    if kind == "kill":
        node.kill()
        await asyncio.sleep(hold_s)
        await asyncio.to_thread(node.start)
    elif kind == "flap":
        end = time.monotonic() + hold_s
        failing = False
        while time.monotonic() < end:
            failing = not failing
            await _faults(node, {"fail_health": failing})
            await asyncio.sleep(0.5)
        await _faults(node, None)
    else:
        body = {
            "errors": {"error_rate": 0.5, "error_status": 503},
            "slow": {"latency_multiplier": 20.0},
            "hang": {"hang": True},
        }[kind]
        await _faults(node, body)
        await asyncio.sleep(hold_s)
        await _faults(node, None)
    soak.faults.append({"kind": kind, "node": node.port, "at_s": started, "hold_s": hold_s})
    soak.current = None


async def run(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    nodes = start_nodes(args.nodes, logs, time_scale=10.0)
    config = "".join(f'[[nodes]]\nurl = "{n.url}"\n' for n in nodes) + (
        "[health]\nprobe_interval_s = 0.5\nprobe_timeout_s = 1.0\neject_base_s = 5.0\n"
        "max_ejected_fraction = 0.5\n"
    )
    agent = AgentProc(port=free_port(), log_dir=logs, config=config).start()
    assert agent.process is not None
    pid = agent.process.pid
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    async with Traffic(agent.url, concurrency=args.concurrency, max_tokens=24) as traffic:
        soak = Soak(nodes=nodes, agent=agent, traffic=traffic)

        async def sample() -> None:
            while True:
                rss_mb, fds = _proc(pid)
                t = traffic.tally
                soak.samples.append(
                    Sample(
                        t_s=round(time.monotonic() - t0, 1),
                        rss_mb=round(rss_mb, 1),
                        fds=fds,
                        ok=t.ok,
                        lost=t.lost,
                        broken=t.broken,
                        fault=soak.current,
                    )
                )
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        try:
            await asyncio.sleep(min(20.0, args.duration_s / 10))  # warm up
            schedule = list(FAULTS)
            while time.monotonic() - t0 < args.duration_s - args.fault_every_s:
                kind = schedule[len(soak.faults) % len(schedule)]
                await _inject(soak, kind, rng.choice(nodes), hold_s=args.fault_hold_s)
                await asyncio.sleep(args.fault_every_s - args.fault_hold_s)
                print(f"[{time.monotonic() - t0:5.0f} s] {kind}: ok {traffic.tally.ok} "
                      f"lost {traffic.tally.lost} broken {traffic.tally.broken} "
                      f"rss {soak.samples[-1].rss_mb} MB fds {soak.samples[-1].fds}",
                      flush=True)  # fmt: skip
            await asyncio.sleep(max(0.0, args.duration_s - (time.monotonic() - t0)))
        finally:
            sampler.cancel()
    agent.stop()
    for n in nodes:
        n.stop()
    first = soak.samples[min(len(soak.samples) - 1, 30)]  # after warm-up
    last = soak.samples[-1]
    t = traffic.tally
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "duration_s": round(time.monotonic() - t0, 1),
        "nodes": args.nodes,
        "concurrency": args.concurrency,
        "requests": t.total,
        "ok": t.ok,
        "lost": t.lost,
        "broken": t.broken,
        "statuses": t.statuses,
        "faults": soak.faults,
        "rss_mb": {
            "after_warmup": first.rss_mb,
            "end": last.rss_mb,
            "max": max(s.rss_mb for s in soak.samples),
        },
        "fds": {
            "after_warmup": first.fds,
            "end": last.fds,
            "max": max(s.fds for s in soak.samples),
        },
        "samples": [dataclasses.asdict(s) for s in soak.samples],
    }


def _table(r: dict[str, Any]) -> str:
    return "\n".join([
        "| duration | requests | ok | lost | broken mid-stream | faults "
        "| RSS after warm-up → end (max) | fds after warm-up → end (max) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {r['duration_s']:.0f} s | {r['requests']} | {r['ok']} | {r['lost']} | {r['broken']} | "
        f"{len(r['faults'])} ({', '.join(sorted({f['kind'] for f in r['faults']}))}) | "
        f"{r['rss_mb']['after_warmup']} → {r['rss_mb']['end']} MB ({r['rss_mb']['max']}) | "
        f"{r['fds']['after_warmup']} → {r['fds']['end']} ({r['fds']['max']}) |",
    ]) + "\n"  # fmt: skip


def _plot(r: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    s = r["samples"]
    t = [x["t_s"] for x in s]
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    top.plot(t, [x["rss_mb"] for x in s], color="tab:blue")
    top.set_ylabel("agent RSS (MB)")
    mid.plot(t, [x["fds"] for x in s], color="tab:green")
    mid.set_ylabel("open fds")
    ok = [x["ok"] for x in s]
    bottom.plot(t[1:], [b - a for a, b in itertools.pairwise(ok)], color="tab:gray",
                label="ok per s")  # fmt: skip
    bottom.plot(t, [x["lost"] for x in s], color="tab:red", label="lost (cumulative)")
    bottom.plot(t, [x["broken"] for x in s], color="tab:orange", label="broken (cumulative)")
    bottom.set_ylabel("requests")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    for ax in (top, mid, bottom):
        start = None
        for x in s:
            if x["fault"] and start is None:
                start = x["t_s"]
            elif not x["fault"] and start is not None:
                ax.axvspan(start, x["t_s"], color="tab:red", alpha=0.08)
                start = None
    fig.suptitle(f"Soak: {r['requests']} requests, {r['lost']} lost, {len(r['faults'])} faults "
                 "(shaded)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--fault-every-s", type=float, default=40.0)
    p.add_argument("--fault-hold-s", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="90 s, a fault every 15 s")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    if args.quick:
        args.duration_s, args.fault_every_s, args.fault_hold_s = 90.0, 15.0, 6.0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    (args.out_dir / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    table = _table(result)
    (args.out_dir / "soak.md").write_text(table)
    print(table)
    _plot(result, args.out_dir / "soak.png")
    return 0 if result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
