"""N workers against one agent in the fleet simulator: do they keep its hit rate and TTFT?

Question: ``meridian-agent --workers N`` spreads connections, not sessions, over its workers;
with their summed counts and each other's prefix records, do they route like one agent?  And
what would the same N processes do without sharing (N independent agent replicas, each session
sticking to one)?

Set-up: the fleet simulator (``meridian_sim.fleet``, the Mooncake conversation trace, H100
profile) at 80 % load, ``meridian`` policy, 1 s scrapes, per size: one agent; N workers
(``FleetConfig.workers``: counts summed, every routed prompt observed by every worker, requests
to a worker per request); N replicas (``agents_per_region`` alone: nothing shared, session
sticky).  Each configuration runs with seeds 0 and 1 (the seed draws the scrape phases and the
routing tie-breaks).

    python benchmarks/workers_fleet.py [--quick] [--sizes 8,64] [--workers 2,4] [--seeds 0,1]
        [--window-s 60] [--min-requests 800] [--jobs 2] [--out-dir DIR]

Writes workers_fleet.json, .md and .png to benchmarks/results/; progress on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fleet
from _fleet import Task


def label(row: dict[str, Any]) -> str:
    agents = int(row["agents_per_region"])
    if agents == 1:
        return "one agent"
    return f"{agents} workers" if row["workers"] else f"{agents} replicas, nothing shared"


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| GPUs | agent | seeds | TTFT p50 ms | TTFT p99 ms | hit rate | queue wait p99 ms "
        "| refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((int(r["nodes"]), label(r)), []).append(r)
    order = sorted(groups, key=lambda k: (k[0], _rank(k[1])))
    for nodes, name in order:
        g = groups[(nodes, name)]

        def span(key: str, scale: float = 1000.0, g: list[dict[str, Any]] = g) -> str:
            values = sorted(r[key] * scale for r in g)
            if len(values) == 1:
                return f"{values[0]:.0f}"
            return f"{statistics.mean(values):.0f} ({values[0]:.0f} to {values[-1]:.0f})"

        hits = sorted(r["prefix_hit_rate"] for r in g)
        refused = sum(r["refused_queue_full"] + r["refused_deadline"] for r in g)
        lines.append(
            f"| {nodes} | {name} | {len(g)} | {span('ttft_p50_s')} | {span('ttft_p99_s')} "
            f"| {statistics.mean(hits):.3f} ({hits[0]:.3f} to {hits[-1]:.3f}) "
            f"| {span('queue_wait_p99_s')} | {refused} |"
        )
    return lines


def _rank(name: str) -> tuple[int, int]:
    if name == "one agent":
        return (0, 0)
    n = int(name.split()[0])
    return (1, n) if "workers" in name else (2, n)


def plot(rows: Sequence[dict[str, Any]], subtitle: str, path: Path) -> None:
    import router_cpu as rc

    plt = rc._pyplot()

    if plt is None:
        return
    sizes = sorted({int(r["nodes"]) for r in rows})
    names = sorted({label(r) for r in rows}, key=_rank)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        for ax, key, scale in ((axes[0], "ttft_p99_s", 1.0), (axes[1], "prefix_hit_rate", 1.0)):
            values = []
            for n in sizes:
                g = [r[key] * scale for r in rows if int(r["nodes"]) == n and label(r) == name]
                values.append(statistics.mean(g) if g else 0.0)
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(sizes))]
            ax.bar(xs, values, width, label=name)
    for ax, title in ((axes[0], "TTFT p99 (s)"), (axes[1], "prefix hit rate")):
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{n} GPUs" for n in sizes])
        ax.set_ylabel(title)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"N workers against one agent, fleet simulator\n{subtitle}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 GPUs, 2 workers, one seed, 20 s")
    p.add_argument("--trace", type=Path, default=_fleet.DEFAULT_TRACE)
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--sizes", default=None, help="GPUs, a list (default 8,64)")
    p.add_argument("--workers", default=None, help="worker counts, a list (default 2,4)")
    p.add_argument("--seeds", default=None, help="a list (default 0,1)")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--window-s", type=float, default=None, help="virtual seconds (default 60)")
    p.add_argument("--min-requests", type=int, default=None, help="default 800")
    p.add_argument("--capacity-rps", type=float, default=None, help="skip measuring it")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=_fleet.ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    q = args.quick
    sizes = [int(x) for x in (args.sizes or ("8" if q else "8,64")).split(",")]
    counts = [int(x) for x in (args.workers or ("2" if q else "2,4")).split(",")]
    seeds = [int(x) for x in (args.seeds or ("0" if q else "0,1")).split(",")]
    window_s = args.window_s if args.window_s is not None else (20.0 if q else 60.0)
    min_requests = args.min_requests if args.min_requests is not None else (300 if q else 800)
    tasks = []
    for n in sizes:
        for seed in seeds:
            common = {"seed": seed}
            tasks.append(
                Task("workers", "meridian", n, args.load, 1.0, window_s, min_requests, **common)
            )
            for k in counts:
                for shared in (True, False):
                    tasks.append(
                        Task(
                            "workers",
                            "meridian",
                            n,
                            args.load,
                            1.0,
                            window_s,
                            min_requests,
                            agents=k,
                            workers=shared,
                            **common,
                        )
                    )
    print(f"workers_fleet: {len(tasks)} runs on {args.jobs} processes", file=sys.stderr)
    cap = args.capacity_rps or _fleet.capacity(args.trace, args.profile)
    print(f"workers_fleet: one node's capacity {cap:.3f} requests/s", file=sys.stderr)
    rows = _fleet.run_all(
        tasks, trace=args.trace, profile_name=args.profile, capacity_rps=cap, jobs=args.jobs
    )
    subtitle = (
        f"Mooncake conversation trace at {args.load:.0%} load, {window_s:g} s windows "
        f"(at least {min_requests} requests), meridian policy, 1 s scrapes, seeds "
        f"{','.join(map(str, seeds))}"
    )
    meta = {
        "trace": str(args.trace),
        "profile": args.profile,
        "capacity_rps": cap,
        "window_s": window_s,
        "min_requests": min_requests,
        "machine": _fleet.machine(),
    }
    md = "\n".join([f"# N workers against one agent ({subtitle})", "", *table(rows), ""])
    _fleet.write(args.out_dir, "workers_fleet", meta, rows, md)
    print("\n".join(table(rows)))
    plot(rows, subtitle, args.out_dir / "workers_fleet.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
