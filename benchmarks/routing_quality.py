"""Routing quality over HTTP: Meridian's policies against vllm-router, sglang-router and smg.

Question: on the Mooncake conversation trace, replayed open loop against 8 simulated H100 nodes
at 50, 80 and 95 % of the fleet's capacity, which router gives the lowest time to first token
and the most prefix-cache reuse?

Real processes on 127.0.0.1: ``--nodes`` ``meridian-sim node`` processes (``h100-llama3-8b`` at
``--time-scale``), one router at a time in front of them (``meridian-agent`` with each policy, or
a peer from ``_peers.py`` with each of its policies), and this process as the load generator.
``meridian-events:POLICY`` is the agent routing on the nodes' own KV-cache events (the precise
index, docs/agent.md); when it is among the routers, every node publishes its events (Unix
sockets) for every router's runs, so all of them run against the same nodes.
``meridian-wN:POLICY`` is the agent with ``--workers N`` (docs/agent.md, Workers).
Trace rows become chat requests whose text reproduces the trace's block sharing
(``_trace_prompts.py``), streamed, each generating exactly its trace output length.  Arrivals
keep the trace's own gaps, compressed so that the mean rate is the load fraction times the
fleet's capacity.  Capacity is estimated offline (``meridian_sim.offline.replay``, virtual time):
one node fed every ``--nodes``-th request of the trace all at once, its throughput times the
number of nodes; that is the fleet's saturation throughput under round robin, with the cache
reuse round robin gets.

Before each run the nodes are idle and their prefix caches reset (``POST /reset_prefix_cache``);
hit rates are the deltas of the nodes' own ``vllm:prefix_cache_{queries,hits}_total``.  Also
reported: an upper bound on reuse (every request on one node with an infinite cache), and what
the load generator itself used (CPU, and how late it sent requests), to show it was not the
bottleneck.  Latencies are wall-clock seconds as the client saw them; multiply by the time
scale for H100 time.

    python benchmarks/routing_quality.py [--quick] [--trace PATH] [--requests N]
        [--loads 0.5,0.8,0.95] [--routers meridian:meridian,vllm-router:cache_aware,...]
        [--time-scale X] [--out-dir DIR] [--peers-root DIR]

Writes routing_quality.json, routing_quality.md and routing_quality.png to benchmarks/results/.
Progress goes to stderr.  Peers are installed on first use (``_peers.py``); a peer that cannot be
installed is reported and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import _trace_prompts
import agent_overhead as ao
import proxy_overhead as po

from meridian_sim import offline, profile, workloads
from meridian_sim.workloads import TraceRequest
from policies import prompt

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "data" / "workloads" / "mooncake_conversation_trace.jsonl"
MERIDIAN_POLICIES = ("meridian", "prefix_aware", "session", "power_of_two", "round_robin")
EVENTS = "meridian-events"  # the agent routing on the nodes' KV events (the precise index)
FULL_PEER_POLICIES = ("cache_aware", "round_robin", "power_of_two")
QUICK_ROUTERS = (
    "meridian:meridian",
    "meridian-events:meridian",
    "meridian:prefix_aware",
    "vllm-router:cache_aware",
    "sglang-router:cache_aware",
    "smg:cache_aware",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- workload ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """One request ready to send: its trace time and its encoded body."""

    trace_s: float
    body: bytes
    prompt_tokens: int
    output_tokens: int


def prepare(
    rows: Sequence[TraceRequest],
    builder: _trace_prompts.PromptBuilder,
    *,
    model: str,
    max_model_len: int,
    block_size: int,
) -> tuple[list[Prepared], list[tuple[int, ...]]]:
    """Encoded request bodies, and each prompt's token ids under the nodes' tokenizer."""
    out: list[Prepared] = []
    tokens: list[tuple[int, ...]] = []
    t0 = rows[0].timestamp_s
    for row in rows:
        body = builder.chat_body(row, model=model, stream=True, max_model_len=max_model_len)
        ids = prompt.tokenize(prompt.render_chat(body["messages"]))
        tokens.append(ids)
        out.append(
            Prepared(
                trace_s=row.timestamp_s - t0,
                body=json.dumps(body).encode(),
                prompt_tokens=len(ids),
                output_tokens=row.output_length,
            )
        )
    return out, tokens


def system_prompt_rows(n: int, *, seed: int) -> list[TraceRequest]:
    """The first ``n`` requests of synthetic multi-turn chat sessions, each opening with one of
    32 system prompts of 512 to 4,096 tokens chosen by a Zipf law (s = 1.1), then turns of about
    200 user and 300 answer tokens, every answer part of the next turn's prompt, a session ending
    before its prompt would pass 8,000 tokens (``meridian_sim.workloads.synthetic``), in 512-token
    blocks as the Mooncake rows are (so a turn adds two blocks): the workload where a shared
    system prompt, not a long conversation, is the prefix to keep."""
    rows: list[TraceRequest] = []
    duration_s = 600.0
    while len(rows) < n:
        rows = workloads.synthetic(
            duration_s=duration_s,
            sessions_per_s=1.0,
            rng=random.Random(seed),
            max_input_tokens=8_000,  # a session ends before the 8k context would cut it
            block_tokens=_trace_prompts.TRACE_BLOCK_TOKENS,
        )
        duration_s *= 2
    return rows[:n]


def reuse_bound(tokens: Sequence[tuple[int, ...]], *, block_size: int) -> float:
    """Prefix-cache hit rate if every request ran on one node with an infinite cache.

    As vLLM counts it: cached tokens are whole leading blocks seen before, at most all blocks
    but the one holding the last prompt token, over all prompt tokens."""
    seen: set[int] = set()
    hits = 0
    total = 0
    for ids in tokens:
        hashes = prompt.block_hashes(ids, block_size=block_size)
        usable = (len(ids) - 1) // block_size
        n = 0
        while n < min(usable, len(hashes)) and hashes[n] in seen:
            n += 1
        hits += n * block_size
        total += len(ids)
        seen.update(hashes)
    return hits / total if total else float("nan")


def estimate_capacity(
    prof: profile.Profile,
    rows: Sequence[TraceRequest],
    builder: _trace_prompts.PromptBuilder,
    *,
    nodes: int,
) -> dict[str, float]:
    """Fleet saturation throughput (requests/s of simulated time) under round robin.

    One node gets every ``nodes``-th row, all at time 0, so it stays saturated while its queue
    lasts.  Throughput is taken between the 10th and the 60th percentile of completion times,
    while requests still wait: the fill at the start and the drain at the end (one 2,000-token
    answer alone takes ~30 s) would otherwise dominate a short sample."""
    arrivals = []
    for row in rows[::nodes]:
        body = builder.chat_body(
            row, model=prof.model, stream=False, max_model_len=prof.max_model_len
        )
        ids = prompt.tokenize(prompt.render_chat(body["messages"]))
        arrivals.append(
            offline.Arrival(time_s=0.0, prompt_token_ids=ids, max_tokens=row.output_length)
        )
    rep = offline.replay(prof, arrivals)
    done = sorted(r.finished_s for r in rep.records)
    lo, hi = int(0.1 * len(done)), int(0.6 * len(done))
    node_rps = (hi - lo) / (done[hi] - done[lo])
    return {
        "node_requests_per_s": node_rps,
        "fleet_requests_per_s": node_rps * nodes,
        "node_requests_in_sample": len(arrivals),
        "node_peak_waiting": rep.peak_waiting,
        "node_drain_requests_per_s": len(arrivals) / rep.end_s,
    }


# -- node counters ------------------------------------------------------------------------------


_COUNTERS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:request_success_total": "finished",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:num_preemptions_total": "preemptions",
}


_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds_bucket": "ttft",
    "vllm:e2e_request_latency_seconds_bucket": "e2e",
}


async def node_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The node's counters and gauges, and its TTFT and e2e histogram buckets
    (``ttft_le_<bound>``: requests at or under ``bound`` seconds of simulated time)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = dict.fromkeys(_COUNTERS.values(), 0.0)
    out["running"] = out["waiting"] = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        hist = _HISTOGRAMS.get(name)
        if hist:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bucket = f"{hist}_le_{le}"
            out[bucket] = out.get(bucket, 0.0) + float(line.rsplit(" ", 1)[1])
            continue
        key = _COUNTERS.get(name) or {
            "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting",
        }.get(name)
        if key:
            out[key] += float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(buckets: dict[str, float], prefix: str, q: float) -> float:
    """Prometheus' histogram_quantile over cumulative ``<prefix>_le_<bound>`` counts: linear
    inside the bucket the quantile falls in; the last finite bound if it falls in +Inf."""
    pts = sorted(
        (float(k.rsplit("_", 1)[1]), v) for k, v in buckets.items() if k.startswith(prefix + "_le_")
    )
    if not pts or pts[-1][1] <= 0:
        return float("nan")
    rank = q * pts[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in pts:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return pts[-1][0]


async def settle_nodes(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Wait until no node runs or queues anything, then empty every prefix cache."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        counts = [await node_counters(session, u) for u in urls]
        if all(c["running"] == 0 and c["waiting"] == 0 for c in counts):
            break
        await asyncio.sleep(0.5)
    for u in urls:
        async with session.post(u + "/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise SystemExit(f"{u}/reset_prefix_cache answered {resp.status}")


# -- load ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    ok: bool
    sent_s: float
    lag_s: float
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    output_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class RunResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    loadgen_cpu_s: float = 0.0


async def send_one(
    session: aiohttp.ClientSession, url: str, req: Prepared, *, scheduled: float, t0: float
) -> Outcome:
    sent = time.perf_counter()
    out = Outcome(ok=False, sent_s=sent - t0, lag_s=sent - scheduled)
    first: float | None = None
    usage_tokens = 0
    try:
        async with session.post(
            url + "/v1/chat/completions",
            data=req.body,
            headers={"Content-Type": "application/json"},
        ) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if first is None and b'"content"' in line and b'"content": ""' not in line:
                    first = time.perf_counter()
                elif b'"usage"' in line and b'"usage": null' not in line:
                    usage = json.loads(line[5:])["usage"]
                    if usage:
                        usage_tokens = int(usage.get("completion_tokens", 0))
                elif b'"error"' in line:
                    out.error = line.decode(errors="replace")[:200]
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    end = time.perf_counter()
    if out.error or first is None:
        out.error = out.error or "no token in the stream"
        return out
    out.ok = True
    out.ttft_s = first - sent
    out.e2e_s = end - sent
    out.output_tokens = usage_tokens
    return out


async def replay_open_loop(
    session: aiohttp.ClientSession, url: str, reqs: Sequence[Prepared], *, speedup: float
) -> RunResult:
    """Send each request at its trace time divided by ``speedup``, whatever came back."""
    result = RunResult()
    cpu0 = ao.self_cpu_s()
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    for i, req in enumerate(reqs):
        scheduled = t0 + req.trace_s / speedup
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_one(session, url, req, scheduled=scheduled, t0=t0)))
        if (i + 1) % 50 == 0:
            log(f"  sent {i + 1}/{len(reqs)}")
    result.outcomes = list(await asyncio.gather(*tasks))
    result.wall_s = time.perf_counter() - t0
    result.loadgen_cpu_s = ao.self_cpu_s() - cpu0
    return result


# -- routers ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Router:
    name: str  # "meridian" or a peer's name
    policy: str
    url: str
    stop: Callable[[], None]
    pid: int


def start_router(
    name: str,
    policy: str,
    node_urls: Sequence[str],
    *,
    logdir: Path,
    peers_root: str | None,
) -> Router:
    if name in ("meridian", EVENTS) or _workers(name):
        argv = ["-m", "regional_agent.cli", "--port", "0", "--policy", policy]
        argv += ["--workers", str(_workers(name) or 1)]  # one process unless named meridian-wN
        env = None
        if name == EVENTS:  # every node's KV events, by node settings (no --node flags)
            nodes = []
            for i, u in enumerate(node_urls):
                events, replay = ao.kv_endpoints(i, logdir)
                nodes.append(
                    {"url": u, "kv_events_endpoint": events, "kv_events_replay_endpoint": replay}
                )
            env = {"MERIDIAN_AGENT_NODES": json.dumps(nodes)}
        else:
            for u in node_urls:
                argv += ["--node", u]
        child = ao.spawn(f"{name}-{policy}", [*argv, "--log-level", "WARNING"], logdir, env=env)
        ao.wait_ready(child)
        return Router(
            name=name,
            policy=policy,
            url=child.url,
            stop=lambda: ao.stop_all([child]),
            pid=child.proc.pid,
        )
    peer = _peers.PEERS[name]
    _peers.install(peer, root=peers_root)
    running = _peers.start(
        peer, worker_urls=node_urls, policy=policy, logdir=logdir, root=peers_root
    )
    return Router(
        name=name, policy=policy, url=running.url, stop=running.stop, pid=running.proc.pid
    )


# -- the benchmark ------------------------------------------------------------------------------


def summarize(
    res: RunResult,
    before: Sequence[dict[str, float]],
    after: Sequence[dict[str, float]],
    *,
    time_scale: float,
) -> dict[str, Any]:
    ok = [o for o in res.outcomes if o.ok]
    pct = offline.percentile
    delta = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    fleet = {k: sum(d.get(k, 0.0) for d in delta) for k in delta[0]}
    queries = sum(d["queries"] for d in delta)
    hits = sum(d["hits"] for d in delta)
    gen = sum(d["generation_tokens"] for d in delta)
    ttft = [o.ttft_s for o in ok]
    e2e = [o.e2e_s for o in ok]
    lags = [o.lag_s for o in res.outcomes]
    errors = [o.error for o in res.outcomes if not o.ok]
    return {
        "requests": len(res.outcomes),
        "ok": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "wall_s": res.wall_s,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "ttft_p99_s": pct(ttft, 0.99),
        "e2e_p50_s": pct(e2e, 0.5),
        "e2e_p99_s": pct(e2e, 0.99),
        "ttft_p99_gpu_s": pct(ttft, 0.99) * time_scale,
        # the nodes' own histograms, in simulated (H100) seconds: not inflated when this host
        # is too slow to keep the time scale, but blind to time spent in the router
        "node_ttft_p50_s": histogram_quantile(fleet, "ttft", 0.5),
        "node_ttft_p99_s": histogram_quantile(fleet, "ttft", 0.99),
        "node_e2e_p99_s": histogram_quantile(fleet, "e2e", 0.99),
        "throughput_req_s": len(ok) / res.wall_s,
        "throughput_output_tok_s": gen / res.wall_s,
        "output_tokens_client": sum(o.output_tokens for o in ok),
        "prefix_hit_rate": hits / queries if queries else float("nan"),
        "prefix_queries": queries,
        "prefix_hits": hits,
        "preemptions": sum(d["preemptions"] for d in delta),
        "finished_per_node": [int(d["finished"]) for d in delta],
        "loadgen_cpu_cores": res.loadgen_cpu_s / res.wall_s,
        "send_lag_p99_s": pct(lags, 0.99),
        "send_lag_max_s": max(lags, default=float("nan")),
    }


async def run_all(
    args: argparse.Namespace,
    node_urls: Sequence[str],
    reqs: Sequence[Prepared],
    routers: Sequence[tuple[str, str]],
    loads: Sequence[float],
    *,
    capacity_rps: float,
    logdir: Path,
    pids: list[int],
) -> list[dict[str, Any]]:
    trace_span = reqs[-1].trace_s - reqs[0].trace_s
    trace_rate = (len(reqs) - 1) / trace_span if trace_span > 0 else float("inf")
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    rows: list[dict[str, Any]] = []
    total = len(routers) * len(loads)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        n = 0
        for name, policy in routers:
            try:
                router = start_router(
                    name, policy, node_urls, logdir=logdir, peers_root=args.peers_root
                )
            except _peers.PeerError as exc:
                log(f"skipping {name} {policy}: {exc}")
                n += len(loads)
                continue
            try:
                await ao.wait_serving(session, router.url, model=args.model, timeout_s=60)
                for load in loads:
                    n += 1
                    # target wall rate: load x capacity (simulated req/s) x time scale
                    wall_rate = load * capacity_rps * args.time_scale
                    speedup = wall_rate / trace_rate
                    await settle_nodes(session, node_urls)
                    before = [await node_counters(session, u) for u in node_urls]
                    cpu0 = {p: ao.cpu_s(p) for p in pids}
                    router_cpu0 = router_cpu_s(name, router.pid)
                    machine0 = ao.machine_cpu_s()
                    log(
                        f"[{n}/{total}] {name} {policy} load {load:.0%}: {len(reqs)} requests "
                        f"at {wall_rate:.2f}/s wall (trace x{speedup:.2f})"
                    )
                    res = await replay_open_loop(session, router.url, reqs, speedup=speedup)
                    cpu = {p: ao.cpu_s(p) - c for p, c in cpu0.items()}
                    router_cpu = router_cpu_s(name, router.pid) - router_cpu0
                    machine_cpu = ao.machine_cpu_s() - machine0
                    after = [await node_counters(session, u) for u in node_urls]
                    row = summarize(res, before, after, time_scale=args.time_scale)
                    ours = sum(cpu.values()) + router_cpu + res.loadgen_cpu_s
                    row.update(
                        router=name,
                        policy=policy,
                        load=load,
                        wall_rate_req_s=wall_rate,
                        router_cpu_cores=router_cpu / res.wall_s,
                        nodes_cpu_cores=sum(cpu[p] for p in pids) / res.wall_s,
                        others_cpu_cores=max(0.0, machine_cpu - ours) / res.wall_s,
                        loadavg_1m=os.getloadavg()[0],
                    )
                    rows.append(row)
                    args.out_dir.mkdir(parents=True, exist_ok=True)
                    with (args.out_dir / "routing_quality.partial.jsonl").open("a") as f:
                        f.write(json.dumps(row) + "\n")  # kept if the run is cut short
                    log(
                        f"  ok {row['ok']}/{row['requests']}, TTFT p50 "
                        f"{row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s (nodes, H100 "
                        f"time: {row['node_ttft_p50_s']:.3f} / {row['node_ttft_p99_s']:.3f} s), "
                        "e2e p99 "
                        f"{row['e2e_p99_s']:.2f} s, hit {row['prefix_hit_rate']:.1%}, "
                        f"{row['throughput_output_tok_s']:.0f} tok/s, per node "
                        f"{row['finished_per_node']}, router {row['router_cpu_cores']:.2f} cores,"
                        f" nodes {row['nodes_cpu_cores']:.2f}, loadgen "
                        f"{row['loadgen_cpu_cores']:.2f} (send lag p99 "
                        f"{row['send_lag_p99_s'] * 1000:.0f} ms), others "
                        f"{row['others_cpu_cores']:.2f}"
                    )
                    if row["errors"]:
                        log(f"  {row['errors']} errors, first: {row['first_error']}")
            finally:
                router.stop()
    return rows


def _f(x: float, spec: str) -> str:
    return "n/a" if x != x else format(x, spec)


def table(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    lines = [
        f"{meta.get('workload') or 'Mooncake conversation trace'}, "
        f"{meta['nodes']} x `{meta['profile']}` at time scale {meta['time_scale']:g}; "
        f"fleet capacity {meta['capacity']['fleet_requests_per_s']:.2f} req/s (simulated), "
        f"reuse bound (one node, infinite cache) {meta['reuse_bound']:.1%}. "
        "Latencies in wall seconds.",
        "",
        "| load | router | policy | ok | TTFT p50 (s) | TTFT p99 (s) | e2e p99 (s) "
        "| node TTFT p50 (H100 s) | node TTFT p99 (H100 s) | node e2e p99 (H100 s) | output tok/s "
        "| hit rate | finished per node | router cores | loadgen cores | send lag p99 (ms) "
        "| other load (cores) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["load"], r["ttft_p99_s"])):
        lines.append(
            f"| {r['load']:.0%} | {r['router']} | {r['policy']} | {r['ok']}/{r['requests']} "
            f"| {_f(r['ttft_p50_s'], '.3f')} | {_f(r['ttft_p99_s'], '.3f')} "
            f"| {_f(r['e2e_p99_s'], '.2f')} | {_f(r['node_ttft_p50_s'], '.3f')} "
            f"| {_f(r['node_ttft_p99_s'], '.3f')} | {_f(r['node_e2e_p99_s'], '.1f')} "
            f"| {r['throughput_output_tok_s']:.0f} "
            f"| {_f(r['prefix_hit_rate'] * 100, '.1f')} % "
            f"| {' '.join(str(x) for x in r['finished_per_node'])} "
            f"| {r['router_cpu_cores']:.2f} | {r['loadgen_cpu_cores']:.2f} "
            f"| {r['send_lag_p99_s'] * 1000:.0f} | {r['others_cpu_cores']:.2f} |"
        )
    return lines


def plot(rows: Sequence[dict[str, Any]], path: Path, *, title: str, bound: float) -> bool:
    """TTFT p99 and hit rate per router: bars for one load, lines over several."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return False
    keys = sorted({(r["router"], r["policy"]) for r in rows})
    loads = sorted({r["load"] for r in rows})
    fig, (ax1, ax3, ax2) = plt.subplots(
        1, 3, figsize=(15, 0.9 + 0.32 * len(keys) if len(loads) == 1 else 4.5)
    )
    if len(loads) == 1:
        by = {(r["router"], r["policy"]): r for r in rows}
        labels = [f"{k[0]} {k[1]}" for k in keys]
        colors = ["tab:blue" if k[0] == "meridian" else "tab:gray" for k in keys]
        ax1.barh(labels, [by[k]["ttft_p99_s"] for k in keys], color=colors)
        ax1.set_xlabel(f"client TTFT p99 (wall s) at {loads[0]:.0%} load")
        ax1.invert_yaxis()
        ax3.barh(labels, [by[k]["node_ttft_p99_s"] for k in keys], color=colors)
        ax3.set_xlabel("nodes' TTFT p99 (H100 s)")
        ax3.invert_yaxis()
        ax3.set_yticklabels([])
        ax2.barh(labels, [by[k]["prefix_hit_rate"] * 100 for k in keys], color=colors)
        ax2.axvline(bound * 100, linestyle="--", color="black", label="reuse bound")
        ax2.set_xlabel("prefix-cache hit rate (%)")
        ax2.invert_yaxis()
        ax2.set_yticklabels([])
        ax2.legend(fontsize=7)
    else:
        for key in keys:
            pts = sorted(
                (r for r in rows if (r["router"], r["policy"]) == key), key=lambda r: r["load"]
            )
            xs = [r["load"] * 100 for r in pts]
            style = "-o" if key[0] == "meridian" else "--s"
            label = f"{key[0]} {key[1]}"
            ax1.plot(xs, [r["ttft_p99_s"] for r in pts], style, label=label)
            ax3.plot(xs, [r["node_ttft_p99_s"] for r in pts], style, label=label)
            ax2.plot(xs, [r["prefix_hit_rate"] * 100 for r in pts], style, label=label)
        ax2.axhline(bound * 100, linestyle=":", color="black", label="reuse bound")
        ax1.set_xlabel("load (% of fleet capacity)")
        ax1.set_ylabel("client TTFT p99 (wall s)")
        ax1.set_yscale("log")
        ax3.set_xlabel("load (% of fleet capacity)")
        ax3.set_ylabel("nodes' TTFT p99 (H100 s)")
        ax3.set_yscale("log")
        ax2.set_xlabel("load (% of fleet capacity)")
        ax2.set_ylabel("prefix-cache hit rate (%)")
        ax2.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def router_cpu_s(name: str, pid: int) -> float:
    """The router's CPU seconds: with workers, the supervisor's and every worker's."""
    return po.tree_cpu_s(pid) if _workers(name) else ao.cpu_s(pid)


def _workers(name: str) -> int:
    """N of a ``meridian-wN`` router (the agent with ``--workers N``), else 0."""
    head, _, count = name.partition("-w")
    return int(count) if head == "meridian" and count.isdecimal() and int(count) > 0 else 0


def parse_routers(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for item in text.split(","):
        name, _, policy = item.strip().partition(":")
        if name in ("meridian", EVENTS) or _workers(name):
            out.append((name, policy or "meridian"))
        elif name in _peers.PEERS:
            peer = _peers.PEERS[name]
            for p in peer.policies if policy == "all" else [policy or peer.default_policy]:
                out.append((name, p))
        else:
            raise SystemExit(
                f"unknown router {name!r}: meridian, meridian-wN (N workers), {EVENTS} or one "
                f"of {', '.join(_peers.PEERS)}"
            )
    return out


def default_routers(quick: bool) -> str:
    if quick:
        return ",".join(QUICK_ROUTERS)
    return ",".join(
        [
            *(f"meridian:{p}" for p in MERIDIAN_POLICIES),
            f"{EVENTS}:meridian",
            f"{EVENTS}:prefix_aware",
            *(f"{p}:{q}" for p in _peers.PEERS for q in FULL_PEER_POLICIES),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short slice: minutes in all")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--workload",
        choices=("mooncake", "system-prompts"),
        default="mooncake",
        help="mooncake: rows of --trace; system-prompts: synthetic multi-turn sessions over 32 "
        "shared system prompts (meridian_sim.workloads.synthetic, 512-token blocks, seeded)",
    )
    parser.add_argument("--requests", type=int, help="trace rows (default 300 quick, 600 full)")
    parser.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    parser.add_argument(
        "--loads", help="fractions of capacity (default 0.8 quick, else 0.5,0.8,0.95)"
    )
    parser.add_argument("--routers", help="name:policy,... ; name:all for every policy of a peer")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.5,
        help="nodes run this many times faster than an H100 (default 0.5: half speed, so "
        "that 95 %% load fits 2 cores)",
    )
    parser.add_argument("--capacity-sample", type=int, default=1600, help="trace rows for capacity")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--peers-root", help="where the peers' venvs live (default ~/.cache/...)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n_requests = args.requests or (300 if args.quick else 600)
    loads = [float(x) for x in (args.loads or ("0.8" if args.quick else "0.5,0.8,0.95")).split(",")]
    routers = parse_routers(args.routers or default_routers(args.quick))
    if args.workload == "mooncake" and not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace}; pass --trace PATH")

    # SIGTERM ends the run like Ctrl-C does, so the children are stopped in `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prof = profile.load(args.profile)
    args.model = prof.model
    (args.out_dir / "routing_quality.partial.jsonl").unlink(missing_ok=True)
    started = time.perf_counter()
    load_start = os.getloadavg()
    sample_n = max(n_requests, args.capacity_sample)
    if args.workload == "mooncake":
        log(f"load average at start {load_start}; reading {args.trace}")
        rows_all = _trace_prompts.read_rows(args.trace, limit=sample_n, skip=args.skip)
        workload = f"Mooncake conversation trace, {n_requests} requests from row {args.skip}"
    else:
        log(f"load average at start {load_start}; synthetic system-prompt sessions")
        rows_all = system_prompt_rows(sample_n + args.skip, seed=args.seed)[args.skip :]
        workload = (
            f"synthetic sessions over 32 shared system prompts, {n_requests} requests from row "
            f"{args.skip}"
        )
    log(f"building {n_requests} prompts...")
    builder = _trace_prompts.PromptBuilder(seed=args.seed)
    reqs, tokens = prepare(
        rows_all[:n_requests],
        builder,
        model=prof.model,
        max_model_len=prof.max_model_len,
        block_size=prof.block_size,
    )
    clipped = sum(
        1
        for r, p in zip(rows_all[:n_requests], reqs, strict=True)
        if p.prompt_tokens < r.input_length
    )
    bound = reuse_bound(tokens, block_size=prof.block_size)
    log(f"estimating capacity from {len(rows_all)} rows (offline replay, virtual time)...")
    capacity = estimate_capacity(prof, rows_all, builder, nodes=args.nodes)
    log(
        f"capacity: {capacity['node_requests_per_s']:.2f} req/s per node, "
        f"{capacity['fleet_requests_per_s']:.2f} for {args.nodes} nodes (simulated time); "
        f"reuse bound {bound:.1%}; {clipped}/{len(reqs)} prompts cut to the context"
    )

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="routing_quality.") as tmp:
        logdir = Path(tmp)
        children: list[ao.Child] = []
        try:
            events = any(name == EVENTS for name, _ in routers)
            for i in range(args.nodes):
                children.append(
                    ao.spawn_node(
                        i,
                        profile=args.profile,
                        time_scale=args.time_scale,
                        logdir=logdir,
                        kv_events=events,  # every router then runs against publishing nodes
                    )
                )
            node_urls = [ao.wait_ready(c) for c in children]
            log(f"{args.nodes} nodes up: {node_urls[0]} ...")
            rows = asyncio.run(
                run_all(
                    args,
                    node_urls,
                    reqs,
                    routers,
                    loads,
                    capacity_rps=capacity["fleet_requests_per_s"],
                    logdir=logdir,
                    pids=[c.proc.pid for c in children],
                )
            )
        finally:
            ao.stop_all(children)
        if os.environ.get("MERIDIAN_BENCH_KEEP_LOGS"):
            shutil.copytree(logdir, args.out_dir / "routing_quality_logs", dirs_exist_ok=True)

    meta = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "workload": workload,
        "trace": str(args.trace) if args.workload == "mooncake" else args.workload,
        "requests": n_requests,
        "skip": args.skip,
        "prompts_cut_to_context": clipped,
        "nodes": args.nodes,
        "profile": args.profile,
        "time_scale": args.time_scale,
        "capacity": capacity,
        "capacity_sample_rows": len(rows_all),
        "reuse_bound": bound,
        "loads": loads,
        "machine": ao.machine(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "elapsed_s": time.perf_counter() - started,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "routing_quality.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    md = [
        "# Routing quality (benchmarks/routing_quality.py)",
        "",
        f"`{meta['command']}`, {meta['date']}, {meta['elapsed_s']:.0f} s; load average "
        f"{load_start[0]:.2f} at start, {meta['loadavg_end'][0]:.2f} at end.",
        "",
        *table(rows, meta),
    ]
    (args.out_dir / "routing_quality.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if rows:
        title = f"{workload}, {args.nodes} x {args.profile} at time scale {args.time_scale:g}"
        plot(rows, args.out_dir / "routing_quality.png", title=title, bound=bound)
    log(f"done in {meta['elapsed_s']:.0f} s; wrote {args.out_dir}/routing_quality.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
