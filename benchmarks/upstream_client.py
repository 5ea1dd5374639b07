"""CPU per call to a node: aiohttp's client against the agent's own (upstream.http1).

Question: of the agent's CPU per request, how much is the HTTP client that talks to the node, and
what did replacing aiohttp's ``ClientSession`` on the request path with
``regional_agent.upstream.http1`` (httptools on keep-alive connections) buy?  One
``meridian-sim node --profile cpu-tiny --time-scale 1000`` (it answers at once) on core 0; this
process, pinned to core 1, sends ``--requests`` chat requests (a short prompt, ``max_tokens`` 2)
from 32 concurrent tasks on uvloop and reads every answer whole, plain and streamed, through:

- ``aiohttp``: a ``ClientSession`` set up as the agent's was before (no cookie jar, no
  decompression, an unlimited ``TCPConnector``), ``session.request`` then ``content.readany``;
- ``http1``: the agent's ``NodeClient.post`` (``async with``, then ``read()``).

CPU is this process's user + system time over the run (``getrusage``) divided by the requests.
Repeats are interleaved (each goes once through every client and mode, in an order rotated per
repeat, after a discarded warm-up); the table gives medians and ranges.

    python benchmarks/upstream_client.py [--requests 20000] [--repeats 3] [--out-dir DIR]

Writes upstream_client.json, upstream_client.md and upstream_client.png to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _plots
import agent_overhead as ao

from regional_agent.upstream.client import NodeClient

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CLIENTS = ("aiohttp", "http1")
MODES = ("plain", "stream")
CONCURRENCY = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(client: str, mode: str, *, url: str, model: str, requests: int) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "X-Request-ID": "bench"}
    stream = mode == "stream"
    counter = 0

    def body() -> bytes:
        nonlocal counter
        counter += 1
        return json.dumps({
            "model": model,
            "messages": [{"role": "user", "content": f"Summarise request number {counter}."}],
            "max_tokens": 2,
            "stream": stream,
        }).encode()  # fmt: skip

    one: Callable[[], Awaitable[int]]
    session: aiohttp.ClientSession | None = None
    node: NodeClient | None = None
    if client == "aiohttp":
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

        async def one() -> int:
            assert session is not None
            async with session.request("POST", url, data=body(), headers=headers) as r:
                size = 0
                while chunk := await r.content.readany():
                    size += len(chunk)
                return size
    else:
        node = NodeClient(connect_timeout_s=5.0, first_byte_timeout_s=30.0, read_timeout_s=30.0)

        async def one() -> int:
            assert node is not None
            async with node.post("n0", url, body=body(), headers=headers) as up:
                return len(await up.read())

    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if not await one():
                raise SystemExit(f"{client} {mode}: an empty answer")

    try:
        for _ in range(200):  # warm-up: connections open, code paths hot
            await one()
        t0, c0 = time.perf_counter(), cpu_s()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        t1, c1 = time.perf_counter(), cpu_s()
    finally:
        if session is not None:
            await session.close()
        if node is not None:
            await node.close()
    return {
        "client": client,
        "mode": mode,
        "requests": requests,
        "cpu_us_per_request": (c1 - c0) / requests * 1e6,
        "requests_per_s": requests / (t1 - t0),
    }


def summarise(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for client in CLIENTS:
        for mode in MODES:
            mine = [r for r in runs if (r["client"], r["mode"]) == (client, mode)]
            if not mine:
                continue
            cpu = [r["cpu_us_per_request"] for r in mine]
            rows.append({
                "client": client,
                "mode": mode,
                "cpu_us_median": statistics.median(cpu),
                "cpu_us_min": min(cpu),
                "cpu_us_max": max(cpu),
                "requests_per_s_median": statistics.median(r["requests_per_s"] for r in mine),
                "repeats": len(cpu),
            })  # fmt: skip
    return rows


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| client | mode | CPU µs per call, median (range) | calls/s |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['client']} | {r['mode']} | {r['cpu_us_median']:.0f} "
            f"({r['cpu_us_min']:.0f}-{r['cpu_us_max']:.0f}) | {r['requests_per_s_median']:,.0f} |"
        )
    return lines


def plot(rows: Sequence[dict[str, Any]], subtitle: str, path: Path) -> None:
    plt = _plots.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, client in enumerate(CLIENTS):
        pts = [next(r for r in rows if (r["client"], r["mode"]) == (client, m)) for m in MODES]
        xs = [i + (k - 0.5) * width for i in range(len(MODES))]
        med = [p["cpu_us_median"] for p in pts]
        err = [[p["cpu_us_median"] - p["cpu_us_min"] for p in pts],
               [p["cpu_us_max"] - p["cpu_us_median"] for p in pts]]  # fmt: skip
        bars = ax.bar(xs, med, width, yerr=err, capsize=4, label=client)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set_ylabel("CPU µs per call to the node (median, range)")
    ax.set_title(f"The agent's HTTP client to its nodes\n{subtitle}", fontsize=9)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5,000 requests, 1 repeat")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 5000, 1
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores: one for the node, one for this client")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="upstream-client-"))
    node = ao.spawn_node(0, profile="cpu-tiny", time_scale=1000, logdir=logdir)
    try:
        os.sched_setaffinity(node.proc.pid, {0})
        os.sched_setaffinity(0, {1})
        base = ao.wait_ready(node)
        model = first_model(base)
        runs: list[dict[str, Any]] = []
        combos = [(c, m) for c in CLIENTS for m in MODES]
        for repeat in range(args.repeats):
            order = combos[repeat % len(combos) :] + combos[: repeat % len(combos)]
            for client, mode in order:
                r = uvloop.run(run(client, mode, url=f"{base}/v1/chat/completions", model=model,
                                   requests=args.requests))  # fmt: skip
                r["repeat"] = repeat
                runs.append(r)
                cost, rate = r["cpu_us_per_request"], r["requests_per_s"]
                log(f"repeat {repeat + 1}/{args.repeats} {client} {mode}: "
                    f"{cost:.0f} µs/call, {rate:,.0f} calls/s")  # fmt: skip
    finally:
        ao.stop_all([node])
    rows = summarise(runs)
    info = ao.machine()
    subtitle = (f"{args.requests:,} calls x {args.repeats} interleaved repeats, 32 at once, "
                f"{info.get('cpu_model', platform.processor())}")  # fmt: skip
    (args.out_dir / "upstream_client.json").write_text(
        json.dumps({"machine": info, "runs": runs, "rows": rows}, indent=2)
    )
    md = "\n".join(table(rows)) + "\n"
    (args.out_dir / "upstream_client.md").write_text(md)
    print(md)
    plot(rows, subtitle, args.out_dir / "upstream_client.png")
    return 0


def first_model(base: str) -> str:
    """The node's first model id (``GET /v1/models``)."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


if __name__ == "__main__":
    sys.exit(main())
