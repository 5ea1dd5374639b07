"""Throughput and prefix routing of ``meridian-agent --workers N``, saturated by wrk.

Question: do N workers serve N times what one does, and keep its prefix hit rate?

Set-up: two nodes, wrk ``-t1 -c64`` sending chat requests whose prompt is one of ``--groups``
shared system prompts (``--prompt-words`` words each, picked round robin) and a question that
never repeats, ``max_tokens`` 2, each with ``X-Request-ID: g<group>-<n>``.  The nodes are either

- ``--nodes static`` (the default): one nginx answering as two vLLM servers with fixed bodies
  (``_static_nodes.py``: 14-20 µs of CPU a request, so the cores are left to the agent).  The
  routing measure is the **prompt affinity**: the share of all requests that went to the node
  that got most of their system prompt's requests (from the ids each node logged);
  1.0 when every prompt stays on one node, about 0.5 when each request goes to either node at
  random; or
- ``--nodes sim``: two ``meridian-sim node --profile h100-llama3-8b --time-scale 1000`` nodes
  (they answer at once and keep a prefix cache; Python, they cost about what the agent does).
  The routing measure is the nodes' prefix hit rate over the run
  (``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``).

The agent (``--policy``, default ``meridian``; a fresh process per run) is pinned to the last N
cores, wrk and the nodes to the cores before them; where there are not N + 1 cores, the agent
shares core 0 with them (the table says so, and how much of the cores wrk and the nodes took).
Per run: requests/s (wrk), the agent's CPU per request (its process tree,
``/proc/<pid>/stat``), the machine's busy cores (``/proc/stat``), the routing measure.  Each run
has 2 s of warm-up first (not counted); repeats are interleaved, each going once through every
N in an order rotated per repeat; the table gives medians (and the range).

``--idle`` sends no traffic: the agent's CPU a second (every process) with N workers doing
nothing but their timers, and how often each node served its ``/metrics`` page and answered a
health probe meanwhile (the static nodes' scrape and probe logs), written to workers_idle.json,
.md and .png.

``--one-core`` pins every worker to the last core instead: the throughput cannot grow, and the
CPU per request against one worker's is what the sharing costs (the prefix records each worker
inserts for its siblings, the reads of their counts, a second event loop).  It takes more
workers than the host has cores (up to 16), for what grows with N: each worker takes in its
N - 1 siblings' records, and N event loops take turns on the core (which separate cores would
not), so the growth it shows is an upper bound for the sharing's.

``--independent`` (the control, for N above 1) runs N agents of one worker each instead of one
agent of N workers, each on a port of its own with its own wrk (``--connections`` / N
connections, the questions of each its own): N processes that share nothing, no counts, no
prefix records, no claims.  With ``--core-share``, what N of them serve against one agent is
what N quota-held processes on these cores cost by themselves, so that N workers' ratio can be
read against it: the gap between the two is the workers' sharing.

``--core-share F`` gives every worker process the same share of a core, on a host without a
free core for each worker and one for wrk: each worker (with one worker, the agent's one
process) goes into a cgroup of its own (the cgroup v1 ``cpu`` controller) with a CFS quota of
``F`` of a core every ``--quota-period-ms``.  With ``F`` below what wrk and the nodes leave of
core 0, N workers have N times the CPU one worker has, and requests/s against one worker's is
what the workers' sharing costs, measured by wrk.  N may exceed the cores (up to 16) while N
times ``F`` leaves a quarter of a core to wrk and the nodes; the workers then take turns on
the cores, as with ``--one-core`` but less crowded.  The supervisor stays outside the quota (it
serves no request).  Needs a writable ``/sys/fs/cgroup/cpu`` (root); cgroup v2 hosts are not
handled.

    python benchmarks/workers_throughput.py [--quick] [--workers 1,2] [--nodes static|sim]
        [--one-core | --core-share F [--quota-period-ms 10] | --idle] [--independent]
        [--policy meridian]
        [--repeats 3] [--duration-s 10] [--connections 64] [--groups 8] [--prompt-words 300]
        [--out-dir DIR]

Writes workers_throughput[_sim][_one_core|_core_share][_independent].json, .md and .png to
benchmarks/results/; progress on stderr.  Needs ``wrk``, ``taskset`` and, for static nodes,
``nginx`` (Debian: ``apt-get install wrk util-linux nginx-light``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_overhead as ao
import proxy_overhead as po
import router_cpu as rc
from _static_nodes import StaticNodes

ROOT = Path(__file__).resolve().parents[1]
_ONE_CORE_MAX = 16  # workers --one-core takes
RESULTS = ROOT / "benchmarks" / "results"

_LUA = r"""
local counter = tonumber(os.getenv("BENCH_COUNTER_FROM") or "0")
local model = os.getenv("BENCH_MODEL")
local groups = tonumber(os.getenv("BENCH_GROUPS"))
local headers = {["Content-Type"] = "application/json"}
local system = [==[SYSTEM_PROMPT]==]
request = function()
  counter = counter + 1
  local group = counter % groups
  headers["X-Request-ID"] = string.format("g%d-%d", group, counter)
  local body = string.format(
    '{"model":"%s","messages":[{"role":"system","content":"Group %d. %s"},' ..
    '{"role":"user","content":"Question %d: answer in one word."}],"max_tokens":2}',
    model, group, system, counter)
  return wrk.format("POST", "/v1/chat/completions", headers, body)
end
""" + rc._LUA[rc._LUA.index("done = function") :]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def _prefix_counters(urls: Sequence[str]) -> tuple[float, float]:
    hits = queries = 0.0
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("vllm:prefix_cache_hits_total"):
                        hits += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_queries_total"):
                        queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def prompt_affinity(logs: Sequence[Sequence[str]]) -> float | None:
    """Of each system prompt's requests, the share on the node that got most of them, over
    every prompt (module docstring); ``logs``: the request ids each node answered."""
    by_group: dict[str, Counter[int]] = {}
    for node, ids in enumerate(logs):
        for request_id in ids:
            if not request_id.startswith("g"):
                continue  # the agent's own requests (probes, scrapes) carry no id
            group = request_id.split("-", 1)[0]
            by_group.setdefault(group, Counter())[node] += 1
    total = sum(sum(c.values()) for c in by_group.values())
    return sum(max(c.values()) for c in by_group.values()) / total if total else None


class Nodes(Protocol):
    urls: list[str]
    measure: str  # what routing() measures, for the table

    def mark(self) -> None:
        """The routing measure starts now."""

    def routing(self) -> float | None:
        """The routing measure since :meth:`mark`."""

    def pids(self) -> list[int]:
        """The nodes' processes, each with its children (``po.tree_cpu_s``, ``po.pin``)."""

    def stop(self) -> None: ...


class SimNodes:
    """Two simulated nodes; the routing measure is their prefix hit rate."""

    measure = "node prefix hit rate"

    def __init__(self, logdir: Path, cpu: int) -> None:
        self._children = [ao.spawn_node(i, profile="h100-llama3-8b", time_scale=1000,
                                        logdir=logdir) for i in range(2)]  # fmt: skip
        self.urls = [ao.wait_ready(c) for c in self._children]
        for c in self._children:
            po.pin(c.proc.pid, {cpu})
        self._at = (0.0, 0.0)

    def mark(self) -> None:
        self._at = asyncio.run(_prefix_counters(self.urls))

    def routing(self) -> float | None:
        hits, queries = asyncio.run(_prefix_counters(self.urls))
        return (hits - self._at[0]) / (queries - self._at[1]) if queries > self._at[1] else None

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    def stop(self) -> None:
        ao.stop_all(self._children)


class Static:
    """Two static nodes in one nginx; the routing measure is the prompt affinity."""

    measure = "prompt affinity"

    def __init__(self, logdir: Path, cpu: int) -> None:
        self._nodes = StaticNodes(2, logdir / "nginx")
        self.urls = self._nodes.urls
        po.pin(self._nodes.pid, {cpu})  # and its worker

    def mark(self) -> None:
        self._nodes.take_logs()

    def routing(self) -> float | None:
        return prompt_affinity(self._nodes.take_logs())

    def pids(self) -> list[int]:
        return [self._nodes.pid]  # the worker is counted with its master (po.tree_cpu_s)

    def scrapes(self) -> list[int]:
        """How many times each node has served its ``/metrics`` page since the start."""
        return self._nodes.scrapes()

    def probes(self) -> list[int]:
        """How many times each node has answered ``/health`` since the start."""
        return self._nodes.probes()

    def stop(self) -> None:
        self._nodes.stop()


class CoreShare:
    """Each worker process in a cgroup of its own with a CFS quota of ``share`` of a core
    (module docstring, ``--core-share``)."""

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, share: float, period_ms: float) -> None:
        if not (self.ROOT / "cgroup.procs").exists():
            raise SystemExit(f"--core-share needs the cgroup v1 cpu controller at {self.ROOT}")
        self.period_us = round(period_ms * 1000)
        self.quota_us = round(share * self.period_us)
        if self.period_us < 1000 or self.quota_us < 1000:
            raise SystemExit("--core-share: the quota and its period must be 1 ms or more")
        self._groups: list[Path] = []

    def apply(self, agent_pid: int, workers: int) -> None:
        """Put the agent's serving processes (the process itself with one worker, else the
        supervisor's children) each into its own cgroup."""
        pids = [agent_pid] if workers == 1 else _children(agent_pid)
        if len(pids) != workers:
            raise RuntimeError(f"expected {workers} worker processes, found {pids}")
        for pid in pids:
            group = self.ROOT / f"meridian-bench-{os.getpid()}-w{len(self._groups)}"
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            (group / "cgroup.procs").write_text(str(pid))  # with its threads
            self._groups.append(group)

    def throttled(self) -> tuple[int, float]:
        """Periods throttled and seconds throttled, over every group so far."""
        periods, ns = 0, 0
        for group in self._groups:
            stat = dict(
                line.split() for line in (group / "cpu.stat").read_text().splitlines() if line
            )
            periods += int(stat.get("nr_throttled", 0))
            ns += int(stat.get("throttled_time", 0))
        return periods, ns / 1e9

    def remove(self) -> None:
        """Remove the groups (their processes have ended: ``ao.stop_all``)."""
        for group in self._groups:
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except OSError:  # EBUSY until the last task has left
                    time.sleep(0.1)
        self._groups.clear()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        text = Path(f"/proc/{pid}/task/{task}/children").read_text()
        out += [int(c) for c in text.split()]
    return sorted(out)


def start_agent(
    workers: int,
    node_urls: Sequence[str],
    cpus: set[int],
    logdir: Path,
    policy: str = "meridian",
    name: str | None = None,
) -> ao.Child:
    argv = ["-m", "regional_agent.cli", "--port", "0", "--workers", str(workers),
            "--policy", policy, "--log-level", "WARNING"]  # fmt: skip
    for url in node_urls:
        argv += ["--node", url]
    child = ao.spawn(name or f"agent-{workers}", argv, logdir)
    po.pin(child.proc.pid, cpus)
    ao.wait_ready(child)
    po.pin(child.proc.pid, cpus)  # the workers and their threads, started since
    return child


def run_once(
    workers: int,
    *,
    nodes: Nodes,
    agent_cpus: set[int],
    load_cpu: int,
    script: Path,
    model: str,
    args: argparse.Namespace,
    logdir: Path,
) -> dict[str, Any]:
    # the agent of N workers, or (--independent) N agents of one worker each
    alone = args.independent and workers > 1
    if alone:
        agents = [
            start_agent(1, nodes.urls, agent_cpus, logdir, args.policy, f"agent-1-of-{workers}-{i}")
            for i in range(workers)
        ]
    else:
        agents = [start_agent(workers, nodes.urls, agent_cpus, logdir, policy=args.policy)]
    share = CoreShare(args.core_share, args.quota_period_ms) if args.core_share else None
    try:
        if share is not None:
            for agent in agents:
                share.apply(agent.proc.pid, 1 if alone else workers)
        for agent in agents:
            asyncio.run(_wait(agent.url, model))
        os.environ["BENCH_GROUPS"] = str(args.groups)  # the script's; rc.run_wrk passes it on

        def wrk(duration_s: float) -> dict[str, Any]:
            if not alone:
                return rc.run_wrk(
                    agents[0].url,
                    script=script,
                    model=model,
                    stream=False,
                    duration_s=duration_s,
                    connections=args.connections,
                )
            return _wrk_each([a.url for a in agents], script, model, duration_s, args.connections)

        wrk(2.0)  # warm-up
        nodes.mark()
        cpu0 = sum(po.tree_cpu_s(a.proc.pid) for a in agents)
        nodes_cpu0 = sum(po.tree_cpu_s(p) for p in nodes.pids())
        wrk_cpu0 = _children_cpu_s()
        throttled0 = share.throttled() if share is not None else (0, 0.0)
        t0 = time.perf_counter()
        res = wrk(args.duration_s)
        elapsed = time.perf_counter() - t0
        cpu = sum(po.tree_cpu_s(a.proc.pid) for a in agents) - cpu0
        nodes_cpu = sum(po.tree_cpu_s(p) for p in nodes.pids()) - nodes_cpu0
        wrk_cpu = _children_cpu_s() - wrk_cpu0  # wrk is the only child waited for meanwhile
        throttled1 = share.throttled() if share is not None else (0, 0.0)
        routing = nodes.routing()
        relay = asyncio.run(_relay(agents[0].url)) if workers > 1 and not alone else None
    finally:
        ao.stop_all(agents)
        if share is not None:
            share.remove()
    n = res["requests"]
    return {
        "workers": workers,
        "independent": alone,
        "agent_cpus": sorted(agent_cpus),
        "shares_load_core": load_cpu in agent_cpus,
        "requests": n,
        "errors": res["status_errors"] + res["socket_errors"],
        "requests_per_s": res.get("requests_per_s", n / (res["duration_us"] / 1e6)),
        "cpu_us_per_request": cpu / n * 1e6 if n else None,
        "cores_busy": cpu / elapsed,
        # wrk and the nodes: what the agent could not have where it shares their core
        "load_cores_busy": (wrk_cpu + nodes_cpu) / elapsed,
        "wrk_cpu_us_per_request": wrk_cpu / n * 1e6 if n else None,
        "nodes_cpu_us_per_request": nodes_cpu / n * 1e6 if n else None,
        "routing": routing,
        "latency_p99_ms": res["p99_us"] / 1000,
        # --core-share: how often the quota stopped a worker, and for how long (summed)
        "core_share": args.core_share,
        "throttled_periods": throttled1[0] - throttled0[0],
        "throttled_s": throttled1[1] - throttled0[1],
        # the prefix relay over the agent's life (warm-up included): the records written, and
        # those a sibling lost (a share of records sent times siblings; the relay of 64984aa
        # and before counted lost datagrams, of one or more records each)
        "relay": relay,
        "relay_lost_pct": (
            100 * relay["lost"] / (relay["sent"] * (workers - 1))
            if relay is not None and relay["sent"]
            else None
        ),
    }


_CONTROL = "N agents of one worker each, sharing nothing (the control); "
_COUNTER_STRIDE = 1_000_000_000  # each wrk's questions start here times its index


def _wrk_each(
    urls: Sequence[str], script: Path, model: str, duration_s: float, connections: int
) -> dict[str, Any]:
    """One wrk a URL at once (``--independent``), each with its share of the connections and
    questions of its own; their results summed: requests, errors, requests/s (each wrk's over
    its own duration), and the highest of their p99s."""
    each = max(1, connections // len(urls))

    def one(i: int) -> dict[str, Any]:
        return rc.run_wrk(
            urls[i],
            script=script,
            model=model,
            stream=False,
            duration_s=duration_s,
            connections=each,
            env={"BENCH_COUNTER_FROM": str(i * _COUNTER_STRIDE)},
        )

    with ThreadPoolExecutor(len(urls)) as pool:
        results = list(pool.map(one, range(len(urls))))
    return sum_wrk(results)


def sum_wrk(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several wrk results as one: counts summed, requests/s summed (each over its own
    duration), the longest duration and the highest p50 and p99."""
    return {
        "requests": sum(r["requests"] for r in results),
        "requests_per_s": sum(r["requests"] / (r["duration_us"] / 1e6) for r in results),
        "duration_us": max(r["duration_us"] for r in results),
        "status_errors": sum(r["status_errors"] for r in results),
        "socket_errors": sum(r["socket_errors"] for r in results),
        "p50_us": max(r["p50_us"] for r in results),
        "p99_us": max(r["p99_us"] for r in results),
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _relay(url: str) -> dict[str, float]:
    """The prefix relay's counts from the agent's ``/metrics`` (every worker's): records sent
    through the rings, received, and lost (any cause), and prompt tails written to the shared
    table instead (``shared``)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    out = {"sent": 0.0, "shared": 0.0, "received": 0.0, "lost": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meridian_agent_prefix_relay_records_total":
                out[sample.labels["direction"]] += sample.value
            elif sample.name.startswith("meridian_agent_prefix_relay_lost_"):
                out["lost"] += sample.value
    return out


async def _wait(url: str, model: str) -> None:
    async with aiohttp.ClientSession() as session:
        await ao.wait_serving(session, url, model=model, timeout_s=60)


def _spread(values: list[float]) -> dict[str, float] | None:
    """The median and range of ``values``; None where there are none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for workers in sorted({r["workers"] for r in runs}):
        rows = [r for r in runs if r["workers"] == workers]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> dict[str, float] | None:
            return _spread([r[key] for r in rows if r.get(key) is not None])

        out.append(
            {
                "workers": workers,
                "agent_cpus": rows[0]["agent_cpus"],
                "shares_load_core": rows[0]["shares_load_core"],
                "requests_per_s": med("requests_per_s"),
                "cpu_us_per_request": med("cpu_us_per_request"),
                "cores_busy": med("cores_busy"),
                "load_cores_busy": med("load_cores_busy"),
                "routing": med("routing"),
                "latency_p99_ms": med("latency_p99_ms"),
                "throttled_s": med("throttled_s"),
                "relay_lost_pct": med("relay_lost_pct"),
                "errors": sum(r["errors"] for r in rows),
            }
        )
    return out


def table(summary: Sequence[dict[str, Any]], measure: str, *, throttled: bool = False) -> list[str]:
    base = summary[0]["requests_per_s"]["median"] if summary else 1.0

    def rng(s: dict[str, float] | None, fmt: str) -> str:
        if s is None:
            return "-"
        return f"{s['median']:{fmt}} ({s['min']:{fmt}} to {s['max']:{fmt}})"

    lines = [
        "| workers | agent cores | requests/s | of one worker's | CPU per request, µs "
        f"| agent cores busy | wrk + nodes cores busy | {measure} | p99 ms | errors "
        "| prefix records lost, % |" + (" quota throttled, s (all workers) |" if throttled else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if throttled else ""),
    ]
    for s in summary:
        cores = ",".join(str(c) for c in s["agent_cpus"])
        if s["shares_load_core"]:
            cores += " (shared with wrk and the nodes)"
        lines.append(
            f"| {s['workers']} | {cores} | {rng(s['requests_per_s'], ',.0f')} "
            f"| {s['requests_per_s']['median'] / base:.2f}x "
            f"| {rng(s['cpu_us_per_request'], ',.0f')} "
            f"| {rng(s['cores_busy'], '.2f')} | {rng(s['load_cores_busy'], '.2f')} "
            f"| {rng(s['routing'], '.3f')} "
            f"| {rng(s['latency_p99_ms'], '.1f')} | {s['errors']} "
            f"| {rng(s.get('relay_lost_pct'), '.1f')} |"
            + (f" {rng(s['throttled_s'], '.2f')} |" if throttled else "")
        )
    return lines


def plot(
    summary: Sequence[dict[str, Any]],
    subtitle: str,
    measure: str,
    path: Path,
    *,
    one_core: bool = False,
) -> None:
    plt = rc._pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [s["workers"] for s in summary]
    if one_core:  # the throughput cannot grow: what each worker more costs a request
        cpu = [s["cpu_us_per_request"] for s in summary]
        left.errorbar(
            xs,
            [c["median"] for c in cpu],
            yerr=[[c["median"] - c["min"] for c in cpu], [c["max"] - c["median"] for c in cpu]],
            marker="o",
            capsize=3,
            label="measured (median, range)",
        )
        left.set_ylim(bottom=0)
        left.set_ylabel("agent CPU per request, µs")
    else:
        _throughput(left, xs, [s["requests_per_s"]["median"] for s in summary])
    left.set_xlabel("workers")
    left.set_xticks(xs)
    left.legend()
    values = [s["routing"]["median"] if s["routing"] else 0.0 for s in summary]
    right.bar([str(x) for x in xs], values)
    right.set_ylim(0, 1)
    right.set_xlabel("workers")
    right.set_ylabel(measure)
    wrapped = "\n".join(textwrap.wrap(subtitle, 120))
    fig.suptitle(f"meridian-agent --workers N, saturated by wrk\n{wrapped}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _throughput(left: Any, xs: list[int], rps: list[float]) -> None:
    left.plot(xs, rps, marker="o", label="measured")
    left.plot(
        xs, [rps[0] * x for x in xs], linestyle="--", color="grey", label="N times one worker"
    )
    left.plot(
        xs,
        [rps[0] * x * 0.8 for x in xs],
        linestyle=":",
        color="grey",
        label="80 % of N times one worker",
    )
    left.set_ylabel("requests/s")


def idle_cpu(args: argparse.Namespace, counts: list[int], cpus: Sequence[int]) -> int:
    """``--idle``: each N's agent with no traffic at all, its CPU (every process) over
    ``--duration-s`` after 2 s settled; repeats interleaved as for the throughput."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="workers-idle-") as tmp:
        logdir = Path(tmp)
        nodes = Static(logdir, rc.LOAD_CPU)
        try:
            model = asyncio.run(rc._serving([], nodes.urls[0]))
            for rep in range(args.repeats):
                order = counts[rep % len(counts) :] + counts[: rep % len(counts)]
                for workers in order:
                    agent = start_agent(workers, nodes.urls, set(cpus), logdir, policy=args.policy)
                    try:
                        asyncio.run(_wait(agent.url, model))
                        time.sleep(2.0)
                        cpu0, t0 = po.tree_cpu_s(agent.proc.pid), time.perf_counter()
                        scrapes0, probes0 = nodes.scrapes(), nodes.probes()
                        time.sleep(args.duration_s)
                        cpu = po.tree_cpu_s(agent.proc.pid) - cpu0
                        scrapes = sum(nodes.scrapes()) - sum(scrapes0)
                        probes = sum(nodes.probes()) - sum(probes0)
                        elapsed = time.perf_counter() - t0
                    finally:
                        ao.stop_all([agent])
                    row = {
                        "workers": workers,
                        "repeat": rep,
                        "cpu_ms_per_s": cpu / elapsed * 1e3,
                        # what the agent costs the nodes: /metrics renders per node a second
                        "node_scrapes_per_s": scrapes / len(nodes.urls) / elapsed,
                        "node_probes_per_s": probes / len(nodes.urls) / elapsed,  # /health
                    }
                    runs.append(row)
                    log(
                        f"repeat {rep + 1}/{args.repeats} workers {workers}: idle, "
                        f"{row['cpu_ms_per_s']:.1f} ms of CPU a second, each node scraped "
                        f"{row['node_scrapes_per_s']:.2f} and probed "
                        f"{row['node_probes_per_s']:.2f} times a second"
                    )
        finally:
            nodes.stop()
    summary: list[dict[str, Any]] = []
    for workers in counts:
        rows = [r for r in runs if r["workers"] == workers]
        summary.append(
            {
                "workers": workers,
                **{
                    key: _spread([r[key] for r in rows])
                    for key in ("cpu_ms_per_s", "node_scrapes_per_s", "node_probes_per_s")
                },
            }
        )
    mach = ao.machine()
    subtitle = (
        f"no traffic, two static (nginx) nodes, policy {args.policy}; CPU of every agent process "
        f"over {args.duration_s:g} s, {args.repeats} interleaved repeats; "
        f"{mach['cpu_model'] or mach['arch']}, {len(cpus)} cores"
    )
    lines = [
        "| workers | agent CPU, ms a second (all processes) | per worker "
        "| scrapes of each node a second | probes of each node a second |",
        "|---|---|---|---|---|",
    ]
    for entry in summary:
        c, n, p = entry["cpu_ms_per_s"], entry["node_scrapes_per_s"], entry["node_probes_per_s"]
        lines.append(
            f"| {entry['workers']} | {c['median']:.1f} ({c['min']:.1f} to {c['max']:.1f}) "
            f"| {c['median'] / entry['workers']:.1f} | {n['median']:.2f} | {p['median']:.2f} |"
        )
    result = {
        "benchmark": "workers_throughput --idle",
        "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "machine": mach,
        "runs": runs,
        "summary": summary,
    }
    (args.out_dir / "workers_idle.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / "workers_idle.md").write_text(
        "\n".join([f"# meridian-agent --workers N, idle ({subtitle})", "", *lines, ""])
    )
    print("\n".join(lines))
    plt = rc._pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(r["workers"]) for r in summary], [r["cpu_ms_per_s"]["median"] for r in summary])
    ax.set_xlabel("workers")
    ax.set_ylabel("agent CPU, ms a second (median)")
    fig.suptitle("meridian-agent --workers N, idle\n" + "\n".join(textwrap.wrap(subtitle, 80)),
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(args.out_dir / "workers_idle.png", dpi=120)
    return 0


def _share_text(args: argparse.Namespace) -> str:
    return (
        f"each worker a CFS quota of {args.core_share:g} of a core every "
        f"{args.quota_period_ms:g} ms; "
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cpus = sorted(os.sched_getaffinity(0))
    parser.add_argument("--quick", action="store_true", help="1 repeat of 5 s")
    parser.add_argument("--workers", default=",".join(str(n) for n in range(1, len(cpus) + 1)))
    parser.add_argument("--nodes", choices=("static", "sim"), default="static")
    parser.add_argument("--policy", default="meridian")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--one-core", action="store_true", help="every worker on the last core")
    parser.add_argument(
        "--core-share",
        type=float,
        default=None,
        help="each worker a CFS quota of this share of a core (0.05 to 1)",
    )
    parser.add_argument("--quota-period-ms", type=float, default=10.0)
    parser.add_argument("--idle", action="store_true", help="CPU with no traffic, by N")
    parser.add_argument(
        "--independent",
        action="store_true",
        help="the control: N agents of one worker each, sharing nothing, instead of N workers",
    )
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.duration_s = 1, 5.0
    counts = [int(n) for n in args.workers.split(",")]
    if args.independent and (args.idle or args.one_core):
        parser.error("--independent: not with --idle or --one-core")
    if args.core_share is not None:
        if args.one_core:
            parser.error("--core-share: not with --one-core")
        if not 0.05 <= args.core_share <= 1.0:
            parser.error("--core-share: a share of one core, from 0.05 to 1")
    if (args.one_core or args.idle) and max(counts) > _ONE_CORE_MAX:
        parser.error(f"--workers: at most {_ONE_CORE_MAX} with --one-core or --idle")
    if args.core_share is not None:
        if max(counts) > _ONE_CORE_MAX:
            parser.error(f"--workers: at most {_ONE_CORE_MAX} with --core-share")
        if max(counts) * args.core_share > len(cpus) - 0.25:
            parser.error(
                f"--core-share: {max(counts)} workers of {args.core_share:g} of a core leave "
                f"less than a quarter of a core of the {len(cpus)} here to wrk and the nodes"
            )
    elif not (args.one_core or args.idle) and max(counts) > len(cpus):
        parser.error(
            f"--workers: at most {len(cpus)} here (the cores this process may use); "
            "--one-core takes more, on one core"
        )
    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install wrk util-linux")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.idle:
        return idle_cpu(args, counts, cpus)
    load_cpu = rc.LOAD_CPU  # where rc.run_wrk pins wrk; the nodes go there too
    if load_cpu not in cpus:
        raise SystemExit(f"needs core {load_cpu} for wrk and the nodes")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="workers-") as tmp:
        logdir = Path(tmp)
        script = logdir / "chat.lua"
        script.write_text(_LUA.replace("SYSTEM_PROMPT", rc.system_prompt(args.prompt_words)))
        nodes: Nodes = (
            Static(logdir, load_cpu) if args.nodes == "static" else SimNodes(logdir, load_cpu)
        )
        try:
            model = asyncio.run(rc._serving([], nodes.urls[0]))
            for rep in range(args.repeats):
                order = counts[rep % len(counts) :] + counts[: rep % len(counts)]
                for workers in order:
                    agent_cpus = {cpus[-1]} if args.one_core else set(cpus[-workers:])
                    row = run_once(
                        workers,
                        nodes=nodes,
                        agent_cpus=agent_cpus,
                        load_cpu=load_cpu,
                        script=script,
                        model=model,
                        args=args,
                        logdir=logdir,
                    )
                    row["repeat"] = rep
                    runs.append(row)
                    routing = row["routing"]
                    log(
                        f"repeat {rep + 1}/{args.repeats} workers {workers}: "
                        f"{row['requests_per_s']:,.0f} req/s, "
                        f"{row['cpu_us_per_request']:.0f} µs/request, "
                        f"agent cores {row['cores_busy']:.2f}, "
                        f"wrk + nodes cores {row['load_cores_busy']:.2f}, "
                        f"{nodes.measure} "
                        f"{'-' if routing is None else format(routing, '.3f')}, "
                        f"errors {row['errors']}"
                        + (
                            f", prefix records lost {row['relay_lost_pct']:.1f} %"
                            if row["relay_lost_pct"] is not None
                            else ""
                        )
                        + (
                            f", throttled {row['throttled_periods']} periods "
                            f"({row['throttled_s']:.2f} s)"
                            if args.core_share
                            else ""
                        )
                    )
        finally:
            nodes.stop()
    summary = summarise(runs)
    mach = ao.machine()
    subtitle = (
        f"{'static (nginx)' if args.nodes == 'static' else 'simulated'} nodes, policy "
        f"{args.policy}; wrk -t1 -c{args.connections} -d{args.duration_s:g}s, {args.groups} "
        f"system prompts of {args.prompt_words} words, {args.repeats} interleaved repeats; "
        f"{'every worker on one core; ' if args.one_core else ''}"
        f"{_CONTROL if args.independent else ''}"
        f"{_share_text(args) if args.core_share else ''}"
        f"{mach['cpu_model'] or mach['arch']}, {len(cpus)} cores"
    )
    result = {
        "benchmark": "workers_throughput",
        "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "machine": mach,
        "routing_measure": nodes.measure,
        "runs": runs,
        "summary": summary,
    }
    name = "workers_throughput"
    name += "_sim" if args.nodes == "sim" else ""
    name += "_one_core" if args.one_core else ""
    name += "_core_share" if args.core_share else ""
    name += "_independent" if args.independent else ""
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    lines = table(summary, nodes.measure, throttled=args.core_share is not None)
    md = [f"# meridian-agent --workers N ({subtitle})", "", *lines, ""]
    (args.out_dir / f"{name}.md").write_text("\n".join(md))
    print("\n".join(lines))
    plot(summary, subtitle, nodes.measure, args.out_dir / f"{name}.png", one_core=args.one_core)
    return 0


if __name__ == "__main__":
    sys.exit(main())
