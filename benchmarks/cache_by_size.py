"""Cache-aware against simple routing by cluster size, and Meridian against an oracle.

Questions: (1) the field says simple policies come within 5-10 % of cache-aware routing under
16 GPUs and that cache awareness is essential at 100+ GPUs: is that so on the Mooncake
conversation trace?  (2) The target: at 80 % load, is Meridian's default policy's prefix-cache
hit rate within 5 % of an oracle that knows every node's cache exactly (and sees fresh
telemetry)?

Section ``sizes``: random, round robin, least connections, power of two (simple) and
prefix-aware, meridian, oracle (cache-aware) at each size, 80 % load, the agent's default
scrape interval (0.25 s), the first ``--window-s`` virtual seconds of arrivals (at least
``--min-requests``).  Section ``target``: meridian and oracle on the whole trace (``--quick``:
its first 1,500 requests) at 80 % load on ``--target-sizes`` GPUs.  Nodes: ``h100-llama3-8b``
with a 128k context.  Writes ``cache_by_size.{json,md,png}``.

    python benchmarks/cache_by_size.py [--quick] [--trace data/workloads/...jsonl]
        [--jobs 2] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import _fleet
from _fleet import Task, ms, pct

SIMPLE = ("random", "round_robin", "least_connections", "power_of_two")
AWARE = ("prefix_aware", "meridian", "oracle")
LOAD = 0.8
SCRAPE_S = 0.25


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=_fleet.DEFAULT_TRACE, help="Mooncake JSONL")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--quick", action="store_true", help="a minutes-long subset")
    p.add_argument("--sizes", default=None, help="GPUs, a list (default 4,8,16,32,64,128,256)")
    p.add_argument("--target-sizes", default=None, help="GPUs for the target (default 8,64)")
    p.add_argument("--window-s", type=float, default=None, help="virtual seconds of arrivals")
    p.add_argument("--min-requests", type=int, default=None)
    p.add_argument("--capacity-rps", type=float, default=None, help="skip measuring it")
    _fleet.add_reuse_args(p)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=_fleet.ROOT / "benchmarks" / "results")
    args = p.parse_args()
    q = args.quick
    sizes = [
        int(x) for x in (args.sizes or ("4,16,64" if q else "4,8,16,32,64,128,256")).split(",")
    ]
    target_sizes = [int(x) for x in (args.target_sizes or ("8" if q else "8,64")).split(",")]
    window_s = args.window_s if args.window_s is not None else (5.0 if q else 15.0)
    min_requests = args.min_requests if args.min_requests is not None else (300 if q else 800)
    target_window = 150.0 if q else None  # quick: about the first 1,500 requests at 8 GPUs
    target_min = 0

    tasks = [
        Task("sizes", pol, n, LOAD, SCRAPE_S, window_s, min_requests)
        for n in sizes
        for pol in (*SIMPLE, *AWARE)
    ]
    tasks += [
        Task("target", pol, n, LOAD, SCRAPE_S, target_window, target_min)
        for n in target_sizes
        for pol in ("meridian", "oracle")
    ]
    print(f"cache_by_size: {len(tasks)} runs on {args.jobs} processes", file=sys.stderr)
    cap = args.capacity_rps or _fleet.capacity(args.trace, args.profile)
    print(f"cache_by_size: one node's capacity {cap:.3f} requests/s", file=sys.stderr)
    reused = _fleet.reused_by_args(
        args,
        tasks,
        capacity_rps=cap,
        same={
            "min_requests": min_requests,
            "profile": args.profile,
            "target_window_s": target_window,
        },
    )
    rows = _fleet.run_all(
        tasks,
        trace=args.trace,
        profile_name=args.profile,
        capacity_rps=cap,
        jobs=args.jobs,
        partial=args.out_dir / "cache_by_size.partial.json",
        reused=reused,
    )
    meta = {
        "trace": str(args.trace),
        "profile": args.profile,
        "max_model_len": _fleet.MAX_MODEL_LEN,
        "node_capacity_rps": cap,
        "load": LOAD,
        "scrape_interval_s": SCRAPE_S,
        "window_s": window_s,
        "min_requests": min_requests,
        "target_window_s": target_window,
        "quick": q,
        "machine": _fleet.machine(),
        "command": " ".join(sys.argv),
        "reused_rows": sum(1 for r in rows if "reused_from" in r),
    }
    md = render(rows, meta, sizes=sizes, target_sizes=target_sizes)
    _fleet.write(args.out_dir, "cache_by_size", meta, rows, md)
    plot(rows, args.out_dir / "cache_by_size.png", sizes=sizes)
    return 0


def _gap(simple: float, aware: float) -> str:
    return f"{(simple - aware) / aware * 100:+.0f} %" if aware > 0 else "n/a"


def render(
    rows: list[dict[str, Any]], meta: dict[str, Any], *, sizes: list[int], target_sizes: list[int]
) -> str:
    by = {(r["section"], r["nodes"], r["policy"]): r for r in rows}
    out = [
        "# Cache awareness by cluster size (simulator)",
        "",
        f"Command: `{meta['command']}`; node capacity {meta['node_capacity_rps']:.3f} req/s; "
        f"80 % load, scrape every {SCRAPE_S} s; window {meta['window_s']} s of arrivals, at "
        f"least {meta['min_requests']} requests.",
        "",
        *_fleet.reuse_note(rows),
        "| GPUs | policy | requests | TTFT mean | TTFT p50 | TTFT p99 | e2e p99 | prefix hit |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        for pol in (*SIMPLE, *AWARE):
            r = by.get(("sizes", n, pol))
            if r is None:
                continue
            out.append(
                f"| {n} | {pol} | {r['requests']} | {ms(r['ttft_mean_s'])} | "
                f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {ms(r['e2e_p99_s'])} | "
                f"{pct(r['prefix_hit_rate'])} |"
            )
    out += [
        "",
        "Best simple policy against the best real cache-aware policy (prefix_aware or meridian; "
        "not the oracle), by mean TTFT and by p99 TTFT (positive: simple is slower):",
        "",
        "| GPUs | best simple (mean) | best aware (mean) | gap mean | gap p99 |",
        "|---:|---|---|---:|---:|",
    ]
    for n in sizes:
        simple = [by[("sizes", n, p)] for p in SIMPLE if ("sizes", n, p) in by]
        aware = [by[("sizes", n, p)] for p in AWARE[:2] if ("sizes", n, p) in by]
        if not simple or not aware:
            continue
        s = min(simple, key=lambda r: r["ttft_mean_s"])
        a = min(aware, key=lambda r: r["ttft_mean_s"])
        s99 = min(r["ttft_p99_s"] for r in simple)
        a99 = min(r["ttft_p99_s"] for r in aware)
        out.append(
            f"| {n} | {s['policy']} {ms(s['ttft_mean_s'])} ms | {a['policy']} "
            f"{ms(a['ttft_mean_s'])} ms | {_gap(s['ttft_mean_s'], a['ttft_mean_s'])} | "
            f"{_gap(s99, a99)} |"
        )
    out += [
        "",
        "## Target: meridian against the oracle, 80 % load"
        + (" (first 150 virtual seconds)" if meta["target_window_s"] else " (whole trace)"),
        "",
        "| GPUs | policy | requests | TTFT p50 | TTFT p99 | e2e p99 | prefix hit | hit vs oracle |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in target_sizes:
        o = by.get(("target", n, "oracle"))
        for pol in ("meridian", "oracle"):
            r = by.get(("target", n, pol))
            if r is None:
                continue
            rel = (
                f"{(r['prefix_hit_rate'] / o['prefix_hit_rate'] - 1) * 100:+.1f} %"
                if o is not None and o["prefix_hit_rate"] > 0
                else "n/a"
            )
            out.append(
                f"| {n} | {pol} | {r['requests']} | {ms(r['ttft_p50_s'])} | "
                f"{ms(r['ttft_p99_s'])} | {ms(r['e2e_p99_s'])} | {pct(r['prefix_hit_rate'])} | "
                f"{rel} |"
            )
    out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, *, sizes: list[int]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for pol in (*SIMPLE, *AWARE):
        pts = sorted(
            (r["nodes"], r["prefix_hit_rate"], r["ttft_mean_s"])
            for r in rows
            if r["section"] == "sizes" and r["policy"] == pol
        )
        if not pts:
            continue
        style = "--" if pol in SIMPLE else "-"
        ax1.plot([x for x, _, _ in pts], [h for _, h, _ in pts], style, marker="o", label=pol)
        ax2.plot([x for x, _, _ in pts], [t for _, _, t in pts], style, marker="o", label=pol)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("prefix-cache hit rate")
    ax2.set_ylabel("TTFT mean (s)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle("Mooncake conversation trace, 80 % load, scrape 0.25 s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
