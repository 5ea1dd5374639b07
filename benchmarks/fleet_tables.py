"""Routing policies across fleet sizes, loads and telemetry staleness, in the fleet simulator.

Question: how do random, round robin, least connections, power of two, JSQ, prefix-aware and
meridian compare at 16, 64 and 256 GPUs and 50, 80 and 95 % load, with fresh telemetry (every
decision sees live engine state) and stale telemetry (scraped every ``--stale-scrape-s``)?  And
the field's claim: at 64 GPUs and 80 % load, power of two < least connections < random on p99
queue wait (8, 12, 25 ms): does it hold, under which staleness, and with several agent replicas
per region (``--claim-agents``), each counting only the requests it sent itself?

Workload: the Mooncake conversation trace, scaled to each load of the fleet's capacity
(``meridian_sim.workloads.node_capacity_rps``), keeping the first ``--window-s`` virtual seconds of
arrivals (at least ``--min-requests``); every request runs to completion.  Nodes:
``h100-llama3-8b`` with a 128k context.  Writes ``fleet_tables.{json,md,png}``.

    python benchmarks/fleet_tables.py [--quick] [--trace data/workloads/...jsonl]
        [--claim-agents 1,4] [--jobs 2] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import _fleet
from _fleet import Task, ms, pct

POLICIES = (
    "random",
    "round_robin",
    "least_connections",
    "power_of_two",
    "jsq",
    "prefix_aware",
    "meridian",
)
CLAIM_POLICIES = ("power_of_two", "least_connections", "random")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _agent_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"agents per region must be at least 1, got {text!r}")
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=_fleet.DEFAULT_TRACE, help="Mooncake JSONL")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--quick", action="store_true", help="a minutes-long subset")
    p.add_argument("--sizes", default=None, help="GPUs, a list (default 16,64,256)")
    p.add_argument("--loads", default=None, help="load fractions (default 0.5,0.8,0.95)")
    p.add_argument(
        "--largest-loads", default=None, help="loads at the largest size only (default: --loads)"
    )
    p.add_argument("--stale-scrape-s", type=float, default=1.0, help="the stale case's interval")
    p.add_argument("--claim-scrapes", default=None, help="claim check intervals, s")
    p.add_argument(
        "--claim-agents",
        type=_agent_counts,
        default=[1],
        help="agent replicas per region for the claim check, a list (default 1); each counts "
        "only its own requests",
    )
    p.add_argument("--window-s", type=float, default=None, help="virtual seconds of arrivals")
    p.add_argument("--min-requests", type=int, default=None)
    p.add_argument(
        "--claim-window-s", type=float, default=None, help="the claim check's window (30 s)"
    )
    p.add_argument("--capacity-rps", type=float, default=None, help="skip measuring it")
    p.add_argument("--no-grid", action="store_true", help="the claim check only")
    _fleet.add_reuse_args(p)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=_fleet.ROOT / "benchmarks" / "results")
    args = p.parse_args()
    q = args.quick
    sizes = [int(x) for x in (args.sizes or ("16,64" if q else "16,64,256")).split(",")]
    loads = _floats(args.loads or ("0.8" if q else "0.5,0.8,0.95"))
    claim_scrapes = _floats(args.claim_scrapes or ("0,1" if q else "0,0.25,1,2,5"))
    window_s = args.window_s if args.window_s is not None else (5.0 if q else 10.0)
    min_requests = args.min_requests if args.min_requests is not None else (300 if q else 600)
    claim_window_s = args.claim_window_s or (window_s if q else 30.0)
    stale = args.stale_scrape_s

    largest_loads = _floats(args.largest_loads) if args.largest_loads else loads
    tasks = [
        Task("grid", pol, n, load, scrape, window_s, min_requests)
        for n in sizes
        for load in (largest_loads if n == max(sizes) else loads)
        for scrape in (0.0, stale)
        for pol in POLICIES
        if not args.no_grid
    ]
    tasks += [
        Task("claim", pol, 64, 0.8, scrape, claim_window_s, min_requests, agents=agents)
        for agents in args.claim_agents
        for scrape in claim_scrapes
        for pol in CLAIM_POLICIES
    ]
    print(f"fleet_tables: {len(tasks)} runs on {args.jobs} processes", file=sys.stderr)
    cap = args.capacity_rps or _fleet.capacity(args.trace, args.profile)
    print(f"fleet_tables: one node's capacity {cap:.3f} requests/s", file=sys.stderr)
    reused = _fleet.reused_by_args(
        args, tasks, capacity_rps=cap, same={"min_requests": min_requests, "profile": args.profile}
    )
    rows = _fleet.run_all(
        tasks,
        trace=args.trace,
        profile_name=args.profile,
        capacity_rps=cap,
        jobs=args.jobs,
        partial=args.out_dir / "fleet_tables.partial.json",
        reused=reused,
    )
    meta = {
        "trace": str(args.trace),
        "trace_name": args.trace.name,
        "profile": args.profile,
        "max_model_len": _fleet.MAX_MODEL_LEN,
        "node_capacity_rps": cap,
        "window_s": window_s,
        "claim_window_s": claim_window_s,
        "claim_agents": args.claim_agents,
        "min_requests": min_requests,
        "stale_scrape_s": stale,
        "quick": q,
        "machine": _fleet.machine(),
        "command": " ".join(sys.argv),
        "reused_rows": sum(1 for r in rows if "reused_from" in r),
    }
    md = render(rows, meta, sizes=sizes, loads=loads, stale=stale)
    _fleet.write(args.out_dir, "fleet_tables", meta, rows, md)
    plot(rows, args.out_dir / "fleet_tables.png", sizes=sizes, stale=stale)
    return 0


def _agents(r: dict[str, Any]) -> int:
    return int(r.get("agents_per_region", 1))  # rows from before it existed had one


def _key(r: dict[str, Any]) -> tuple[int, float, float, str]:
    return (int(r["nodes"]), float(r["load"]), float(r["scrape_interval_s"]), str(r["policy"]))


def render(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    *,
    sizes: list[int],
    loads: list[float],
    stale: float,
) -> str:
    by = {_key(r): r for r in rows if r["section"] == "grid"}
    out = [
        f"# Fleet tables (simulator, {meta.get('trace_name', 'trace')})",
        "",
        f"Command: `{meta['command']}`; node capacity {meta['node_capacity_rps']:.3f} req/s; "
        f"window {meta['window_s']} s of arrivals, at least {meta['min_requests']} requests.",
        "",
        *_fleet.reuse_note(rows),
        "Times in ms; queue wait = agent queue + engine queue until first scheduled.",
        "",
    ]
    for n in sizes:
        for load in loads:
            if not any(k[0] == n and k[1] == load for k in by):
                continue
            out += [
                f"## {n} GPUs, {load:.0%} load",
                "",
                "| policy | telemetry | requests | TTFT p50 | TTFT p99 | e2e p99 | queue wait p99 "
                "| prefix hit | out tok/s |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for scrape in (0.0, stale):
                for pol in POLICIES:
                    r = by.get((n, load, scrape, pol))
                    if r is None:
                        continue
                    tel = "fresh" if scrape == 0 else f"scrape {scrape:g} s"
                    out.append(
                        f"| {pol} | {tel} | {r['requests']} | {ms(r['ttft_p50_s'])} | "
                        f"{ms(r['ttft_p99_s'])} | {ms(r['e2e_p99_s'])} | "
                        f"{ms(r['queue_wait_p99_s'])} | {pct(r['prefix_hit_rate'])} | "
                        f"{r['throughput_tok_s']:.0f} |"
                    )
            out.append("")
    claim = [r for r in rows if r["section"] == "claim"]
    out += [
        "## Claim check: 64 GPUs, 80 % load, p99 queue wait (field: p2c 8 < lc 12 < random 25 ms)",
        "",
        f"Window {meta['claim_window_s']} s of arrivals. Agents: replicas per region, a "
        "session sticking to one; each counts only the requests it sent itself.",
        "",
        "| agents | telemetry | power of two | least connections | random | order holds |",
        "|---:|---|---:|---:|---:|---|",
    ]
    cases = sorted({(_agents(r), r["scrape_interval_s"]) for r in claim})
    for agents, s in cases:
        vals = {
            r["policy"]: r["queue_wait_p99_s"]
            for r in claim
            if (_agents(r), r["scrape_interval_s"]) == (agents, s)
        }
        if len(vals) < 3:
            continue
        holds = vals["power_of_two"] < vals["least_connections"] < vals["random"]
        tel = "fresh" if s == 0 else f"scrape {s:g} s"
        out.append(
            f"| {agents} | {tel} | {ms(vals['power_of_two'])} | "
            f"{ms(vals['least_connections'])} | {ms(vals['random'])} | "
            f"{'yes' if holds else 'no'} |"
        )
    out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, *, sizes: list[int], stale: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 8), squeeze=False)
    for col, n in enumerate(sizes):
        for row_i, scrape in enumerate((0.0, stale)):
            ax = axes[row_i][col]
            for pol in POLICIES:
                pts = sorted(
                    (r["load"], r["ttft_p99_s"])
                    for r in rows
                    if r["section"] == "grid"
                    and r["nodes"] == n
                    and r["policy"] == pol
                    and r["scrape_interval_s"] == scrape
                )
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol)
            tel = "fresh" if scrape == 0 else f"scrape {scrape:g} s"
            ax.set_title(f"{n} GPUs, {tel}")
            ax.set_xlabel("load (fraction of capacity)")
            ax.set_ylabel("TTFT p99 (s)")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
