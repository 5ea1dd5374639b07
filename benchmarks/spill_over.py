"""Spill-over or queue: when forwarding a saturated region's requests to another region beats
waiting for a GPU at home, and when it does not, in the fleet simulator.

Question (issue 21, part 2): a region whose queue is long can send requests to another region
(``spill.*`` in the agent; ``FleetConfig.spill`` here, the same ``policies.spill`` choice from a
plan refreshed every window).  The request pays the round trip and its whole prefill again (the
KV cache does not cross regions); it saves its wait.  Which wins, by load and round trip?

Two regions on the Mooncake conversation trace, sessions split evenly between them as DNS would:
``home`` with ``--home-nodes`` GPUs (default 2) and ``other`` with ``--other-nodes`` (6), so home
carries half the traffic on a quarter of the GPUs.  For each total load (a fraction of all GPUs'
capacity), three runs: ``queue`` (spill-over off), and spill-over with a round trip of
``--near-ms`` (20) and ``--far-ms`` (80), budget 100 ms, threshold ``--queue-depth`` (32, the
agent's default) waiting in the agent's queue, plan every 5 s.  Then the case where it cannot
help: both regions alike (4 + 4 GPUs) over capacity.  Nodes: ``h100-llama3-8b`` with a 128k
context.  Writes ``spill_over.{json,md,png}``.

    python benchmarks/spill_over.py [--quick] [--loads 0.25,0.4,0.5,0.6,0.8] [--jobs 2]
        [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _fleet
from _fleet import ms, pct

from meridian_sim import fleet, profile, workloads

PLAN_S = 5.0
BUDGET_S = 0.1


@dataclass(frozen=True, slots=True)
class Run:
    scenario: str  # "uneven" (home small) or "even" (both alike, both over capacity)
    variant: str  # "queue", "spill 20 ms", ...
    load: float
    region_nodes: tuple[int, int]
    rtt_s: float | None  # None: spill-over off
    queue_depth: int
    window_s: float | None
    slots: int = 64


_STATE: dict[str, Any] = {}


def _init(trace: str, profile_name: str, capacity: float) -> None:
    _STATE["requests"] = workloads.read_trace(trace)
    _STATE["profile"] = fleet.with_context(profile.load(profile_name), _fleet.MAX_MODEL_LEN)
    _STATE["capacity"] = capacity
    _STATE["hasher"] = workloads.BlockHasher(block_size=16)


def _run(run: Run) -> dict[str, Any]:
    nodes = sum(run.region_nodes)
    work = fleet.at_load(
        _STATE["requests"],
        _STATE["profile"],
        nodes=nodes,
        load=run.load,
        duration_s=run.window_s,
        min_requests=0,
        node_capacity_rps=_STATE["capacity"],
    )
    spill = (
        None
        if run.rtt_s is None
        else fleet.Spill(
            queue_depth=run.queue_depth, rtt_s=run.rtt_s, budget_s=BUDGET_S, plan_interval_s=PLAN_S
        )
    )
    config = fleet.FleetConfig(
        nodes=nodes,
        regions=2,
        region_nodes=run.region_nodes,
        policy="meridian",
        spill=spill,
        slots_per_node=run.slots,
    )
    started = time.monotonic()
    result = fleet.simulate(_STATE["profile"], work.requests, config, hasher=_STATE["hasher"])
    home = [o for o in result.outcomes if o.region == 0]
    home_ttft = [o.first_token_s - o.arrival_s for o in home if o.first_token_s is not None]
    return {
        "scenario": run.scenario,
        "variant": run.variant,
        "load": run.load,
        "region_nodes": list(run.region_nodes),
        "rtt_ms": None if run.rtt_s is None else run.rtt_s * 1000,
        "queue_depth": run.queue_depth,
        "slots_per_node": run.slots,
        "arrival_rate_per_s": work.rate_per_s,
        "home_requests": len(home),
        "home_ttft_p50_s": _pctl(home_ttft, 0.5),
        "home_ttft_p99_s": _pctl(home_ttft, 0.99),
        "home_refused": sum(1 for o in home if o.refused is not None),
        "run_wall_s": time.monotonic() - started,
        **result.summary,
    }


def _pctl(values: list[float], q: float) -> float:
    from meridian_sim.offline import percentile

    return percentile(values, q)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=_fleet.DEFAULT_TRACE, help="Mooncake JSONL")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--quick", action="store_true", help="the first 120 virtual seconds")
    p.add_argument("--loads", default="0.25,0.4,0.5,0.6,0.8", help="of all GPUs' capacity")
    p.add_argument("--home-nodes", type=int, default=2)
    p.add_argument("--other-nodes", type=int, default=6)
    p.add_argument("--near-ms", type=float, default=20.0)
    p.add_argument("--far-ms", type=float, default=80.0)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--slots", type=int, default=16, help="queue.slots_per_node")
    p.add_argument("--even-load", type=float, default=1.2, help="both regions alike, this load")
    p.add_argument("--window-s", type=float, default=600.0, help="virtual seconds of arrivals")
    p.add_argument("--capacity-rps", type=float, default=None, help="skip measuring it")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=_fleet.ROOT / "benchmarks" / "results")
    args = p.parse_args()
    window = 120.0 if args.quick else args.window_s
    loads = [float(x) for x in args.loads.split(",")]
    uneven = (args.home_nodes, args.other_nodes)
    variants: list[tuple[str, float | None]] = [
        ("queue", None),
        (f"spill {args.near_ms:g} ms", args.near_ms / 1000),
        (f"spill {args.far_ms:g} ms", args.far_ms / 1000),
    ]
    runs = [
        Run("uneven", name, load, uneven, rtt, args.queue_depth, window, args.slots)
        for load in loads
        for name, rtt in variants
    ]
    half = (sum(uneven) // 2, sum(uneven) - sum(uneven) // 2)
    runs += [
        Run("even", name, args.even_load, half, rtt, args.queue_depth, window, args.slots)
        for name, rtt in variants[:2]
    ]
    cap = args.capacity_rps or _fleet.capacity(args.trace, args.profile)
    print(
        f"spill_over: one node's capacity {cap:.3f} requests/s; {len(runs)} runs", file=sys.stderr
    )
    rows: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(
        args.jobs, initializer=_init, initargs=(str(args.trace), args.profile, cap)
    ) as pool:
        for row in pool.imap(_run, runs):
            rows.append(row)
            print(
                f"spill_over: {len(rows)}/{len(runs)} {row['scenario']} load {row['load']:g} "
                f"{row['variant']}: TTFT p99 {ms(row['ttft_p99_s'])} ms, spilled {row['spilled']}"
                f" ({row['run_wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    meta = {
        "trace": str(args.trace),
        "profile": args.profile,
        "max_model_len": _fleet.MAX_MODEL_LEN,
        "node_capacity_rps": cap,
        "region_nodes": list(uneven),
        "queue_depth": args.queue_depth,
        "budget_ms": BUDGET_S * 1000,
        "plan_interval_s": PLAN_S,
        "window_s": window,
        "quick": args.quick,
        "machine": _fleet.machine(),
        "command": " ".join(["python", "benchmarks/spill_over.py", *sys.argv[1:]]),
    }
    md = render(rows, meta)
    _fleet.write(args.out_dir, "spill_over", meta, rows, md)
    plot(rows, args.out_dir / "spill_over.png", loads=loads, variants=[v for v, _ in variants])
    print(md)
    return 0


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    home, other = meta["region_nodes"]
    out = [
        "# Spill-over or queue",
        "",
        f"Command: `{meta['command']}`; {meta['profile']} (128k context), node capacity "
        f"{meta['node_capacity_rps']:.3f} req/s on the trace; two regions, sessions split "
        f"evenly; `uneven`: home {home} GPUs, other {other}; `even`: "
        f"{(home + other) // 2} + {(home + other) - (home + other) // 2}; spill-over at "
        f"{meta['queue_depth']} waiting, budget {meta['budget_ms']:g} ms, plan every "
        f"{meta['plan_interval_s']:g} s; first {meta['window_s']:g} virtual seconds of arrivals. "
        "Load: of all GPUs' capacity. TTFT in ms, as the client sees it (a spilled request's "
        "includes the round trip).",
        "",
        "| scenario | load | variant | requests | TTFT p50 | TTFT p99 | home TTFT p99 | refused | "
        "spilled | spilled TTFT p50 | stayed TTFT p50 | hit spilled | hit stayed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        refused = r["refused_queue_full"] + r["refused_deadline"]
        spilled = r["spilled"]
        some = spilled > 0
        out.append(
            f"| {r['scenario']} | {r['load']:g} | {r['variant']} | {r['requests']} | "
            f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {ms(r['home_ttft_p99_s'])} | "
            f"{refused} | {spilled} ({pct(spilled / max(1, r['requests']))}) | "
            f"{ms(r['ttft_spilled_p50_s']) if some else '-'} | "
            f"{ms(r.get('ttft_stayed_p50_s', r['ttft_p50_s']))} | "
            f"{pct(r['hit_rate_spilled']) if some else '-'} | "
            f"{pct(r.get('hit_rate_stayed', r['prefix_hit_rate']))} |"
        )
    out += [
        "",
        "refused: the queue's 429 and its 120 s deadline; hit: the prefix-cache hit rate of the "
        "spilled requests and of the others (the cache a spilled request leaves behind).",
        "",
    ]
    return "\n".join(out)


def plot(
    rows: list[dict[str, Any]], path: Path, *, loads: list[float], variants: list[str]
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in variants:
        mine = [r for r in rows if r["scenario"] == "uneven" and r["variant"] == variant]
        mine.sort(key=lambda r: r["load"])
        xs = [r["load"] for r in mine]
        a.plot(xs, [r["home_ttft_p99_s"] for r in mine], marker="o", label=variant)
        b.plot(xs, [r["ttft_p50_s"] for r in mine], marker="o", label=variant)
    a.set_title("home region's TTFT p99")
    b.set_title("all requests' TTFT p50")
    for ax in (a, b):
        ax.set_xlabel("load (of all GPUs' capacity)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Spill-over or queue: a small home region (2 GPUs) beside a larger one (6)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
