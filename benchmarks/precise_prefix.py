"""Precise prefix routing (the engines' KV events) against the approximate index and an oracle,
in the fleet simulator under cache pressure.

Question (issue 19): with a KV cache small enough that evictions matter, does the precise
index (``policies.kv_index``, fed by every engine's events ``--delay-s`` after the step that
changed its cache) bring Meridian's prefix-cache hit rate within 2 % of an oracle that reads the
engines' caches, and its TTFT p99 below the approximate index's?

Runs ``meridian`` and ``prefix_aware``, each with the approximate index (``approx``) and with
KV events (``precise``), and the oracle, at each of ``--sizes`` GPUs, 80 % load, the agent's
default 1 s scrape, on the Mooncake conversation trace (``--quick``: its first 150 virtual
seconds).  Nodes: ``h100-llama3-8b`` with a 128k context and ``--cache-fraction`` of its KV
cache (default 1/8: 3,474 blocks, 56k tokens); one node's capacity is measured on that smaller
cache.  Writes ``precise_prefix.{json,md,png}``.

    python benchmarks/precise_prefix.py [--quick] [--sizes 16,64] [--cache-fraction 0.125]
        [--delay-s 0.05] [--jobs 2] [--out-dir benchmarks/results]
        [--only oracle --keep benchmarks/results/precise_prefix.json]

``--only LABELS`` runs only those variants (``meridian precise``, ``oracle``, ...) and, with
``--keep``, takes the other rows from an earlier run's JSON with the same settings (runs are
deterministic: a variant whose code did not change gives the same row again).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import _fleet
from _fleet import Task, ms, pct

from meridian_sim import profile

LOAD = 0.8
SCRAPE_S = 1.0
VARIANTS: tuple[tuple[str, bool], ...] = (
    ("meridian", False),
    ("meridian", True),
    ("prefix_aware", False),
    ("prefix_aware", True),
    ("oracle", False),
)


def _label(policy: str, precise: bool) -> str:
    if policy == "oracle":
        return "oracle"
    return f"{policy} {'precise' if precise else 'approx'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=_fleet.DEFAULT_TRACE, help="Mooncake JSONL")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--quick", action="store_true", help="the first 150 virtual seconds")
    p.add_argument("--sizes", default=None, help="GPUs, a list (default 16,64; quick: 16)")
    p.add_argument("--cache-fraction", type=float, default=0.125, help="of the profile's cache")
    p.add_argument("--delay-s", type=float, default=0.05, help="KV event delay, seconds")
    p.add_argument("--capacity-rps", type=float, default=None, help="skip measuring it")
    p.add_argument("--only", default=None, help="comma-separated variant labels to run")
    p.add_argument("--keep", type=Path, default=None, help="earlier JSON for the other rows")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=_fleet.ROOT / "benchmarks" / "results")
    args = p.parse_args()
    sizes = [int(x) for x in (args.sizes or ("16" if args.quick else "16,64")).split(",")]
    blocks = max(1, int(profile.load(args.profile).num_gpu_blocks * args.cache_fraction))
    window = 150.0 if args.quick else None
    tasks = [
        Task(
            "precise",
            pol,
            n,
            LOAD,
            SCRAPE_S,
            window,
            0,
            kv_events=precise,
            kv_event_delay_s=args.delay_s,
            num_gpu_blocks=blocks,
        )
        for n in sizes
        for pol, precise in VARIANTS
    ]
    kept: list[dict[str, Any]] = []
    only = None if args.only is None else {x.strip() for x in args.only.split(",")}
    if only is not None and args.keep is None:
        tasks = [t for t in tasks if _label(t.policy, t.kv_events) in only]  # those rows alone
    elif only is not None:
        earlier = json.loads(args.keep.read_text())
        for key in ("num_gpu_blocks", "kv_event_delay_s", "window_s", "trace"):
            if earlier["meta"][key] != {"num_gpu_blocks": blocks, "kv_event_delay_s":
                    args.delay_s, "window_s": window, "trace": str(args.trace)}[key]:  # fmt: skip
                raise SystemExit(f"--keep {args.keep}: its {key} differs from this run's")
        when = earlier["meta"]["machine"]["date"]
        kept = [
            {**r, "reused_from": r.get("reused_from", when)}
            for r in earlier["rows"]
            if _key(r)[1] not in only and _key(r)[0] in sizes
        ]
        tasks = [t for t in tasks if _label(t.policy, t.kv_events) in only]
        if args.capacity_rps is None:
            args.capacity_rps = float(earlier["meta"]["node_capacity_rps"])
    print(f"precise_prefix: {len(tasks)} runs on {args.jobs} processes", file=sys.stderr)
    cap = args.capacity_rps or _fleet.capacity(args.trace, args.profile, num_gpu_blocks=blocks)
    print(f"precise_prefix: one node's capacity {cap:.3f} requests/s", file=sys.stderr)
    ran = _fleet.run_all(
        tasks,
        trace=args.trace,
        profile_name=args.profile,
        capacity_rps=cap,
        jobs=args.jobs,
        partial=args.out_dir / "precise_prefix.partial.json",
    )
    rows = sorted(
        [*kept, *ran],
        key=lambda r: (r["nodes"], [_label(p, k) for p, k in VARIANTS].index(_key(r)[1])),
    )
    meta = {
        "trace": str(args.trace),
        "profile": args.profile,
        "num_gpu_blocks": blocks,
        "cache_fraction": args.cache_fraction,
        "kv_event_delay_s": args.delay_s,
        "max_model_len": _fleet.MAX_MODEL_LEN,
        "node_capacity_rps": cap,
        "load": LOAD,
        "scrape_interval_s": SCRAPE_S,
        "window_s": window,
        "quick": args.quick,
        "machine": _fleet.machine(),
        "command": " ".join(sys.argv),
        "reused_rows": len(kept),
    }
    md = render(rows, meta, sizes=sizes)
    _fleet.write(args.out_dir, "precise_prefix", meta, rows, md)
    plot(rows, args.out_dir / "precise_prefix.png", sizes=sizes)
    print(md)
    return 0


def _key(r: dict[str, Any]) -> tuple[int, str]:
    return int(r["nodes"]), _label(str(r["policy"]), bool(r["kv_events"]))


def render(rows: list[dict[str, Any]], meta: dict[str, Any], *, sizes: list[int]) -> str:
    by = {_key(r): r for r in rows}
    span = "first 150 virtual seconds" if meta["window_s"] else "whole trace"
    out = [
        "# Precise (KV events) against approximate prefix routing, under cache pressure",
        "",
        f"Command: `{meta['command']}`; {meta['profile']} with {meta['num_gpu_blocks']} KV "
        f"blocks a node ({meta['cache_fraction']:g} of its cache); node capacity "
        f"{meta['node_capacity_rps']:.3f} req/s; 80 % load; scrape every {SCRAPE_S:g} s; "
        f"events {meta['kv_event_delay_s'] * 1000:g} ms after their step; {span}. TTFT in ms.",
        "",
        "| GPUs | routing | requests | TTFT p50 | TTFT p99 | prefix hit | hit vs oracle | "
        "index MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        oracle = by.get((n, "oracle"))
        for pol, precise in VARIANTS:
            r = by.get((n, _label(pol, precise)))
            if r is None:
                continue
            rel = (
                f"{(r['prefix_hit_rate'] / oracle['prefix_hit_rate'] - 1) * 100:+.1f} %"
                if oracle is not None and oracle["prefix_hit_rate"] > 0
                else "n/a"
            )
            mib = r["kv_index_mib"] + r["prefix_index_mib"]
            out.append(
                f"| {n} | {_label(pol, precise)} | {r['requests']} | {ms(r['ttft_p50_s'])} | "
                f"{ms(r['ttft_p99_s'])} | {pct(r['prefix_hit_rate'])} | {rel} | {mib:.1f} |"
            )
    reused = sorted({str(r["reused_from"]) for r in rows if "reused_from" in r})
    if reused:
        out += ["", f"Rows not in `--only` are reused from the run of {', '.join(reused)}."]
    out += [
        "",
        "index MiB: the agents' indexes at the end, by their own estimates (the approximate "
        "index's entries x 340 B, the precise index's x 300 B; a precise run keeps both).",
        "",
    ]
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, *, sizes: list[int]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    by = {_key(r): r for r in rows}
    labels = [lb for lb in (_label(p, k) for p, k in VARIANTS) if any(k[1] == lb for k in by)]
    fig, (hit_ax, p99_ax) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(sizes))]
        hits = [by[(n, label)]["prefix_hit_rate"] * 100 if (n, label) in by else 0 for n in sizes]
        p99 = [by[(n, label)]["ttft_p99_s"] if (n, label) in by else 0 for n in sizes]
        hit_ax.bar(xs, hits, width, label=label)
        p99_ax.bar(xs, p99, width, label=label)
    for ax, title in ((hit_ax, "prefix-cache hit rate, %"), (p99_ax, "TTFT p99, s")):
        ax.set_xticks(range(len(sizes)), [f"{n} GPUs" for n in sizes])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    hit_ax.legend(fontsize=8)
    fig.suptitle("Mooncake, 80 % load, 1/8 of an H100's KV cache per node: precise vs approximate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
