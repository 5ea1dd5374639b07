"""``make demo``: three simulated H100 nodes, a short chat load, and what their metrics say.

Starts three ``meridian-sim node`` processes on free loopback ports, sends a stream of chat
requests from three "tenants" (each with its own long system prompt, so prefixes repeat), round
robin across the nodes, measures time to first token at the client, then scrapes every node's
``/metrics`` the way a router does and prints a table.  Later issues put the regional agent,
etcd, the controller and DNS in front of these nodes.

    python -m simulator.demo [--requests 60] [--concurrency 12] [--time-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from simulator.offline import percentile

TENANTS = {
    "support": "You are a support agent for a GPU cloud. Answer briefly and cite the runbook. "
    * 24,
    "code": "You are a code reviewer. Point out bugs, races and missing tests, then praise. " * 24,
    "legal": "You summarise contracts for engineers: obligations, dates, data residency. " * 24,
}
QUESTIONS = (
    "How do I drain a node?",
    "Why is my p99 TTFT high?",
    "Review this retry loop.",
    "Where may EU data be served?",
    "What does a preemption cost?",
)


@dataclass
class NodeProc:
    name: str
    url: str
    proc: subprocess.Popen[str]
    ttfts_s: list[float] = field(default_factory=list)
    errors: int = 0


def _start_node(name: str, profile: str, time_scale: float, seed: int) -> NodeProc:
    cmd = [
        sys.executable,
        "-m",
        "simulator.cli",
        "node",
        "--port",
        "0",
        "--profile",
        profile,
        "--time-scale",
        str(time_scale),
        "--seed",
        str(seed),
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"demo: node {name} did not start (output: {line!r})")
    return NodeProc(name=name, url=line.split()[1], proc=proc)


async def _one(session: aiohttp.ClientSession, node: NodeProc, tenant: str, question: str) -> None:
    body = {
        "messages": [
            {"role": "system", "content": TENANTS[tenant]},
            {"role": "user", "content": question},
        ],
        "max_tokens": 48,
        "stream": True,
    }
    t0 = time.monotonic()
    first: float | None = None
    async with session.post(f"{node.url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            node.errors += 1
            return
        async for line in r.content:
            is_token = b'"content": "' in line and b'"content": ""' not in line
            if first is None and is_token:
                first = time.monotonic()
    if first is not None:
        node.ttfts_s.append(first - t0)


async def _load(nodes: Sequence[NodeProc], *, requests: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def task(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal done
        async with sem:
            node = nodes[i % len(nodes)]  # round robin: the agent (next issue) routes smarter
            await _one(session, node, rng.choice(list(TENANTS)), rng.choice(QUESTIONS))
        done += 1
        if done % 10 == 0 or done == requests:
            print(f"  {done}/{requests} requests done", flush=True)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(task(i, session) for i in range(requests)))


async def _scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created") or "le" in sample.labels:
                continue
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _row(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "  ".join(
        str(c).rjust(w) if i else str(c).ljust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


async def _report(nodes: Sequence[NodeProc]) -> None:
    header = (
        "node",
        "requests",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "prefix hit %",
        "KV use %",
        "preempted",
        "errors",
    )
    widths = [max(len(h), 6) for h in header]
    print()
    print(_row(header, widths))
    for node in nodes:
        m = await _scrape(node.url)
        queries = m.get("vllm:prefix_cache_queries_total", 0.0)
        hits = m.get("vllm:prefix_cache_hits_total", 0.0)
        done = m.get("vllm:request_success_total", 0.0)
        cells = (
            node.name,
            int(done),
            f"{percentile(node.ttfts_s, 0.5) * 1000:.0f}",
            f"{percentile(node.ttfts_s, 0.99) * 1000:.0f}",
            f"{100 * hits / queries:.1f}" if queries else "-",
            f"{100 * m.get('vllm:kv_cache_usage_perc', 0.0):.2f}",
            int(m.get("vllm:num_preemptions_total", 0.0)),
            node.errors,
        )
        print(_row(cells, widths))
    print()
    print("TTFT is measured at the client (wall clock); the rest is read from each node's")
    print("/metrics page with prometheus_client's parser, as the regional agent reads vLLM.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.time_scale <= 0:
        parser.error("--requests and --concurrency must be >= 1 and --time-scale > 0")

    print(f"Starting three simulated vLLM nodes ({args.profile}, time scale {args.time_scale:g})")
    nodes: list[NodeProc] = []
    try:
        for i in range(3):
            node = _start_node(f"node-{i + 1}", args.profile, args.time_scale, args.seed + i)
            nodes.append(node)
            print(f"  {node.name} at {node.url}")
        print(
            f"Sending {args.requests} chat requests from {len(TENANTS)} tenants, "
            f"{args.concurrency} at a time, round robin"
        )
        asyncio.run(
            _load(nodes, requests=args.requests, concurrency=args.concurrency, seed=args.seed)
        )
        asyncio.run(_report(nodes))
    finally:
        for node in nodes:
            node.proc.terminate()
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
            if node.proc.stdout is not None:
                node.proc.stdout.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
