"""Does scoring a bounded candidate set route as well as scoring every node?

Question: the ``meridian`` policy scores, above ``meridian_candidates`` (16) routable nodes,
only the prefix index's holders of the prompt (16 at most) plus ``meridian_sampled`` (4) nodes
drawn at random (docs/agent.md).  Does that keep the fleet tables' TTFT, queue wait and hit
rate?  The fleet
simulator (the set-up of ``fleet_tables.py``: the Mooncake conversation trace, simulated H100s,
telemetry scraped every second) runs ``meridian`` with every node scored
(``meridian_candidates`` = 0, the policy as it was) and bounded (16), at 16, 64 and 256 GPUs
and 80 and 95 % load, same seed and arrivals.  At 16 GPUs the bound is not reached: both rows
must be the same.

    python benchmarks/bounded_candidates.py [--quick] [--sizes 16,64,256] [--loads 0.8,0.95]
        [--jobs 2] [--capacity-rps X] [--bounds 16x8,8x4] [--seed 0] [--out-dir DIR]

``--bounds`` runs other bounded sets beside every node, each ``HOLDERSxDRAWN``
(``meridian_candidates`` x ``meridian_sampled``); ``--seed`` the simulation's seed, to see
how far a seed alone moves the tables.

Writes bounded_candidates.json and .md to benchmarks/results/; progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fleet
import decision_cost

from policies import routing

SAMPLED = routing.RoutingConfig().meridian_sampled  # drawn at random into the bounded set


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| GPUs | load | scored | TTFT p50 s | TTFT p99 s | queue wait p99 s | hit rate "
        "| requests |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        scored = (
            "every node"
            if r["candidates"] == 0
            else f"bounded ({r['candidates']} holders + {r.get('sampled') or SAMPLED} drawn)"
        )
        lines.append(
            f"| {r['nodes']} | {r['load']:.0%} | {scored} | {r['ttft_p50_s']:.3f} "
            f"| {r['ttft_p99_s']:.3f} | {r['queue_wait_p99_s']:.3f} "
            f"| {r['prefix_hit_rate']:.1%} | {r['requests']} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=_fleet.DEFAULT_TRACE)
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--quick", action="store_true", help="64 GPUs at 80 %% only, 5 s window")
    p.add_argument("--sizes", default="16,64,256")
    p.add_argument("--loads", default="0.8,0.95")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--min-requests", type=int, default=600)
    p.add_argument("--capacity-rps", type=float, default=None)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="the simulation's seed (arrivals, draws)")
    p.add_argument(
        "--bounds",
        default=f"16x{SAMPLED}",
        help="bounded sets to run beside every node, each HOLDERSxDRAWN (comma-separated)",
    )
    p.add_argument("--out-dir", type=Path, default=_fleet.ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    if args.quick:
        sizes, loads, args.window_s, args.min_requests = [64], [0.8], 5.0, 300
    try:
        bounds = decision_cost.parse_bounds(args.bounds)
    except ValueError as exc:
        p.error(str(exc))
    capacity = args.capacity_rps or _fleet.capacity(args.trace, args.profile)
    tasks = [
        _fleet.Task(
            section="bounded",
            policy="meridian",
            nodes=n,
            load=load,
            scrape_interval_s=1.0,
            window_s=args.window_s,
            min_requests=args.min_requests,
            candidates=k,
            sampled=d,
            seed=args.seed,
        )
        for n in sizes
        for load in loads
        for k, d in [(0, None), *bounds]
    ]
    rows = _fleet.run_all(
        tasks, trace=args.trace, profile_name=args.profile, capacity_rps=capacity, jobs=args.jobs
    )
    lines = [
        "# meridian: every node scored against a bounded candidate set (fleet simulator)",
        "",
        *table(rows),
        "",
    ]
    meta = {"capacity_rps": capacity, "machine": _fleet.machine(),
            "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    _fleet.write(args.out_dir, "bounded_candidates", meta, rows, "\n".join(lines))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
