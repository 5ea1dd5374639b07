"""``make demo``: simulated H100 nodes behind a regional agent, under traffic, with a failure.

Starts four ``meridian-sim node`` processes, each publishing its KV-cache events as vLLM does,
and one ``meridian-agent`` in front of them that routes on what the engines report they hold
(docs/agent.md, "KV events from the engines"), then sends streaming chat traffic from three
tenants (each with a long system prompt, so prefixes repeat, and a handful of sessions) through
the agent.  Every second it prints each node's load
and the agent's latest routing decision, read from the agent's admin API.  A third of the way
in it drains one node; two thirds in it kills another outright.  At the end it prints, per
node, what was served, what the node's own ``/metrics`` say about its prefix cache, how many
blocks the agent knows the node holds (and whether its events are in sync: the killed node's
are not), and how many client requests failed.

Later issues put etcd, the controller and DNS around this region.

    python -m meridian_demo.region [--requests 240] [--concurrency 16] [--time-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from meridian_sim.offline import percentile

ADMIN_TOKEN = "demo-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
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
class Proc:
    name: str
    url: str
    proc: subprocess.Popen[str]


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _start(name: str, args: list[str], *, env: dict[str, str] | None = None) -> Proc:
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"demo: {name} did not start (output: {line!r})")
    return Proc(name=name, url=line.split()[1], proc=proc)


async def _one(
    session: aiohttp.ClientSession, agent: str, rng: random.Random, tally: Tally
) -> None:
    tenant = rng.choice(list(TENANTS))
    body = {
        "model": "meta-llama/Meta-Llama-3-8B-Instruct",
        "messages": [
            {"role": "system", "content": TENANTS[tenant]},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ],
        "max_tokens": 48,
        "stream": True,
    }
    headers = {"X-Session-ID": f"{tenant}-{rng.randrange(4)}", "X-Tenant": tenant}
    t0 = time.monotonic()
    first: float | None = None
    try:
        async with session.post(f"{agent}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                tally.failed += 1
                tally.errors.append(f"HTTP {r.status}")
                return
            async for line in r.content:
                if line.startswith(b'data: {"error"'):
                    tally.failed += 1
                    tally.errors.append(json.loads(line[6:])["error"]["message"][:100])
                    return
                is_token = b'"content": "' in line and b'"content": ""' not in line
                if first is None and is_token:
                    first = time.monotonic()
    except aiohttp.ClientError as exc:
        tally.failed += 1
        tally.errors.append(type(exc).__name__)
        return
    tally.ok += 1
    if first is not None:
        tally.ttfts_s.append(first - t0)


async def _admin_nodes(session: aiohttp.ClientSession, agent: str) -> list[dict[str, object]]:
    async with session.get(f"{agent}/admin/nodes", headers=ADMIN) as r:
        return list((await r.json())["nodes"])


def _status_line(elapsed: float, done: int, total: int, nodes: list[dict[str, object]]) -> str:
    cells = []
    for n in nodes:
        health = n["health"]
        state = health.get("state", "?") if isinstance(health, dict) else "?"
        admin = str(n["admin"])
        flag = (
            ""
            if admin == "active" and state == "healthy"
            else f" [{admin if admin != 'active' else state}]"
        )
        cells.append(f"{str(n['id']).split(':')[-1]}: {n['in_flight']:>2} in flight{flag}")
    return f"[{elapsed:5.1f}s] {done:>3}/{total} done | " + " | ".join(cells)


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    try:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created") and "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def _run(
    nodes: list[Proc], agent: Proc, *, requests: int, concurrency: int, seed: int
) -> int:
    rng = random.Random(seed)
    tally = Tally()
    sem = asyncio.Semaphore(concurrency)
    started = time.monotonic()
    events: list[str] = []

    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            async with sem:
                await _one(session, agent.url, rng, tally)

        tasks = [asyncio.ensure_future(worker()) for _ in range(requests)]
        drained = killed = False
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            done = tally.ok + tally.failed
            listing = await _admin_nodes(session, agent.url)
            print(_status_line(time.monotonic() - started, done, requests, listing), flush=True)
            if not drained and done >= requests // 3:
                drained = True
                node_id = listing[3]["id"]
                await session.post(f"{agent.url}/admin/nodes/{node_id}/drain", headers=ADMIN)
                events.append(f"drained {nodes[3].name} ({node_id}) after {done} requests")
                print(f"  >>> draining {nodes[3].name}: no new requests, in-flight ones finish")
            if not killed and done >= 2 * requests // 3:
                killed = True
                nodes[2].proc.send_signal(signal.SIGKILL)
                events.append(f"killed {nodes[2].name} after {done} requests")
                print(
                    f"  >>> killing {nodes[2].name} (SIGKILL): the agent retries what had not begun"
                )
        await asyncio.gather(*tasks)
        # the agent's probes notice the dead node within a couple of probe intervals
        # (the listing printed is the one that shows it: another worker may answer a later one)
        for _ in range(100):
            listing = await _admin_nodes(session, agent.url)
            health = listing[2]["health"]
            if isinstance(health, dict) and health.get("state") != "healthy":
                break
            await asyncio.sleep(0.1)

        agent_metrics = await _metrics(session, agent.url)
        print()
        header = (
            f"{'node':8} {'state':>10} {'served':>7} {'prefix hit %':>13} "
            f"{'blocks the agent knows':>24}  {'last decision'}"
        )
        print(header)
        for proc, n in zip(nodes, listing, strict=True):
            m = await _metrics(session, proc.url)
            queries = m.get("vllm:prefix_cache_queries_total", 0.0)
            hits = m.get("vllm:prefix_cache_hits_total", 0.0)
            health = n["health"]
            state = health.get("state", "?") if isinstance(health, dict) else "?"
            state = str(n["admin"]) if n["admin"] != "active" else str(state)
            hit = f"{100 * hits / queries:.1f}" if queries else ("(dead)" if not m else "-")
            decisions = n["recent_decisions"]
            last = decisions[-1] if isinstance(decisions, list) and decisions else "-"
            kv = n.get("kv_events")
            known = (
                f"{kv['blocks']} ({'in sync' if kv['in_sync'] else 'not in sync'})"
                if isinstance(kv, dict)
                else "-"
            )
            print(
                f"{proc.name:8} {state:>10} {n['requests_total']!s:>7} {hit:>13} {known:>24}  "
                f"{last}"
            )
        print()
        print(
            f"client: {tally.ok} ok, {tally.failed} failed; TTFT p50 "
            f"{percentile(tally.ttfts_s, 0.5) * 1000:.0f} ms, p99 "
            f"{percentile(tally.ttfts_s, 0.99) * 1000:.0f} ms (wall clock, through the agent)"
        )
        retries = agent_metrics.get("meridian_agent_retries_total", 0.0)
        print(f"agent: {int(retries)} retries on another node before the first byte")
        for event in events:
            print(f"event: {event}")
        if tally.errors:
            print("failed requests (streams cut after their first token when their node died):")
            for error, count in sorted({e: tally.errors.count(e) for e in tally.errors}.items()):
                print(f"  {count} x {error}")
        await _surface(session, agent.url)
    return 0


async def _surface(session: aiohttp.ClientSession, agent: str) -> None:
    """The rest of a vLLM node's OpenAI surface, through the agent, each answer with the
    request id the agent echoes (docs/agent.md, "The whole OpenAI surface")."""
    print("\nThe rest of the OpenAI surface, through the agent:")
    async with session.get(f"{agent}/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    asks: list[tuple[str, str, dict[str, object] | None]] = [
        ("GET", f"/v1/models/{model}", None),
        ("POST", "/v1/embeddings", {"model": model, "input": ["the cat sat", "a dog ran"]}),
        ("POST", "/v1/responses", {"model": model, "input": "Say hi.", "max_output_tokens": 6,
                                   "stream": True}),
        ("POST", "/v1/chat/completions", {
            "model": model, "n": 2, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                                                         "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ]  # fmt: skip
    for method, path, body in asks:
        async with session.request(method, f"{agent}{path}", json=body) as r:
            raw = await r.read()
            said = _said(path, raw, r.headers.get("Content-Type", ""))
            print(
                f"  {method} {path}: {r.status}, {said} (X-Request-ID {r.headers['X-Request-ID']})"
            )


def _said(path: str, raw: bytes, content_type: str) -> str:
    """One line of what an answer holds."""
    if content_type.startswith("text/event-stream"):
        kinds = [line[7:] for line in raw.decode().splitlines() if line.startswith("event: ")]
        return f"{len(kinds)} events, {kinds[0]} ... {kinds[-1]}"
    answer = json.loads(raw)
    if path.startswith("/v1/models/"):
        return f"card of {answer['id']}, max_model_len {answer.get('max_model_len')}"
    if path == "/v1/embeddings":
        return f"{len(answer['data'])} vectors of {len(answer['data'][0]['embedding'])} floats"
    calls = [c["message"]["tool_calls"][0]["function"]["name"] for c in answer["choices"]]
    return f"{len(calls)} choices, each calling {', '.join(sorted(set(calls)))}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--policy", default="meridian")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.requests < 3 or args.concurrency < 1 or args.time_scale <= 0:
        parser.error("--requests >= 3, --concurrency >= 1 and --time-scale > 0")

    procs: list[Proc] = []
    sockets: str | None = None
    try:
        print(
            f"Starting four simulated vLLM nodes ({args.profile}, time scale {args.time_scale:g})"
        )
        nodes = []
        sockets = tempfile.mkdtemp(prefix="meridian-demo-")
        node_settings = []
        for i in range(4):
            # each node publishes its KV-cache events as vLLM does (on Unix sockets here), and
            # the agent routes on what the engines report they hold
            events = f"ipc://{sockets}/node-{i + 1}-events.sock"
            replay = f"ipc://{sockets}/node-{i + 1}-replay.sock"
            kv_config = json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": events, "replay_endpoint": replay}
            )  # fmt: skip
            node = _start(
                f"node-{i + 1}",
                ["meridian_sim.cli", "node", "--port", "0", "--profile", args.profile,
                 "--time-scale", str(args.time_scale), "--seed", str(args.seed + i),
                 "--log-level", "WARNING", "--kv-events-config", kv_config],
            )  # fmt: skip
            procs.append(node)
            nodes.append(node)
            node_settings.append(
                {"url": node.url, "kv_events_endpoint": events, "kv_events_replay_endpoint": replay}
            )
            print(f"  {node.name} at {node.url}, KV events at {events}")
        agent = _start(
            "agent",
            ["regional_agent.cli", "--port", "0", "--policy", args.policy,
             "--log-level", "WARNING"],
            env={
                "MERIDIAN_AGENT_ADMIN__TOKEN": ADMIN_TOKEN,  # never on the command line
                "MERIDIAN_AGENT_NODES": json.dumps(node_settings),
            },
        )  # fmt: skip
        procs.append(agent)
        print(f"Regional agent at {agent.url} (policy {args.policy})")
        print(f"Sending {args.requests} streaming chat requests, {args.concurrency} at a time\n")
        return asyncio.run(
            _run(nodes, agent, requests=args.requests, concurrency=args.concurrency, seed=args.seed)
        )
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        if sockets is not None:
            shutil.rmtree(sockets, ignore_errors=True)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=10)
            if p.proc.stdout is not None:
                p.proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
