"""Autoscaling under 2x spikes in the fleet simulator: static provisioning against the reactive,
predictive and combined policies of ``policies.autoscaling``, with provisioning delays.

Question (issue 20): the seed claims its policy keeps p99 queue wait under 200 ms across 2x
traffic spikes on a 32-GPU cluster for 8-12 % over-provisioning.  With a 2-minute warm delay,
what p99 queue wait, TTFT p99 and GPU-hours does each policy give, and what over-provisioning?

Set-up: ``--gpus`` (32) ``h100-llama3-8b`` nodes at most, the ``meridian`` policy, one agent
scraping every second; the Azure conversation trace (its lengths and its own burstiness)
arriving at ``--base-load`` (40 %) of the 32 GPUs' capacity, then twice that: the ``sudden``
shape reaches 2x in 60 s, the ``gradual`` one in 5 minutes; both hold 2x, go back in 60 s and
run at the base again (``workloads.shaped``).  ``static`` runs all ``--gpus`` nodes throughout;
the autoscaled runs start with the nodes the base load needs at 80 % utilisation and may grow
to ``--gpus``; ordered nodes arrive ``--delay-s`` (120) later, cold.  The autoscaler ticks every
10 s with the seed's defaults (``policies.autoscaling.Config``); the forecast sizes nodes with
one node's capacity measured on the trace (``workloads.node_capacity_rps``).

Over-provisioning is GPU-hours over the GPU-hours the requests need at that measured capacity
(requests completed / capacity), less one.  Queue wait is the agent's queue plus the engine's,
as the fleet tables count it.  Writes ``autoscaling.{json,md,png}``.

    python benchmarks/autoscaling.py [--quick] [--gpus 32] [--duration-s 1200] [--delay-s 120]
        [--shapes sudden,gradual] [--variants static,reactive,predictive,combined] [--jobs 2]
        [--out-dir benchmarks/results]

``--quick``: 8 GPUs, 600 virtual seconds, the sudden shape.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meridian_sim import fleet, profile, workloads  # noqa: E402
from meridian_sim.offline import percentile  # noqa: E402
from policies import autoscaling  # noqa: E402

TRACE = ROOT / "data" / "workloads" / "azure_conv_2023.csv"
VARIANTS = ("static", "reactive", "predictive", "combined")
WINDOW_S = 30.0  # the plot's latency windows


def shape_of(name: str, duration_s: float) -> list[tuple[float, float]]:
    """(t, multiplier): the base for a quarter of the run, 2x, and back for the last third."""
    start, back = 0.25 * duration_s, 0.6 * duration_s
    rise = {"sudden": 60.0, "gradual": 300.0}[name]
    return [(0.0, 1.0), (start, 1.0), (start + rise, 2.0), (back, 2.0), (back + 60.0, 1.0)]


def _run(task: dict[str, Any]) -> dict[str, Any]:
    prof = profile.load("h100-llama3-8b")
    base = workloads.read_trace(TRACE)
    cap = task["capacity"]
    gpus, duration = task["gpus"], task["duration_s"]
    requests = workloads.shaped(
        base,
        base_rps=task["base_load"] * gpus * cap,
        shape=shape_of(task["shape"], duration),
        duration_s=duration,
    )
    scaling = None
    if task["variant"] != "static":
        scaling = fleet.Scaling(
            policy=autoscaling.Config(mode=task["variant"], max_nodes=gpus),
            initial_nodes=math.ceil(task["base_load"] * gpus / 0.8),
            provision_delay_s=task["delay_s"],
            node_capacity_rps=cap,
        )
    config = fleet.FleetConfig(nodes=gpus, policy="meridian", autoscaling=scaling)
    started = time.monotonic()
    result = fleet.simulate(prof, requests, config)
    s = result.summary
    gpu_hours = float(s["gpu_hours"])
    done = [o for o in result.outcomes if o.finished_s is not None]
    need_h = len(done) / cap / 3600.0
    windows: dict[int, list[float]] = {}
    for o in done:
        if o.dispatched_s is None or o.first_scheduled_s is None or o.queued_s is None:
            continue
        wait = (o.dispatched_s - o.arrival_s) + (o.first_scheduled_s - o.queued_s)
        windows.setdefault(int(o.arrival_s // WINDOW_S), []).append(wait)
    arrivals: dict[int, int] = {}
    for r in requests:
        arrivals[int(r.timestamp_s // WINDOW_S)] = (
            arrivals.get(int(r.timestamp_s // WINDOW_S), 0) + 1
        )
    print(
        f"autoscaling: {task['shape']} {task['variant']} done in "
        f"{time.monotonic() - started:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return {
        "shape": task["shape"],
        "variant": task["variant"],
        "requests": s["requests"],
        "completed": s["completed"],
        "refused": len(requests) - len(done),
        "queue_wait_p99_s": s["queue_wait_p99_s"],
        "queue_wait_p50_s": s["queue_wait_p50_s"],
        "ttft_p99_s": s["ttft_p99_s"],
        "ttft_p50_s": s["ttft_p50_s"],
        "gpu_hours": s["gpu_hours"],
        "need_gpu_hours": need_h,
        "over_provisioning": gpu_hours / need_h - 1.0,
        "nodes_mean": s["nodes_mean"],
        "nodes_max": max((t.serving for t in result.timeline), default=gpus),
        "scale_ups": sum(1 for t in result.timeline if t.kind == "up"),
        "scale_downs": sum(1 for t in result.timeline if t.kind == "down"),
        "timeline": [
            [t.t, t.serving, t.pending, t.draining, t.queue, t.arrival_rps, t.kind]
            for t in result.timeline
        ],
        "reasons": [[t.t, t.reason] for t in result.timeline if t.kind != "hold"],
        "windows": {
            str(k * WINDOW_S): [arrivals.get(k, 0) / WINDOW_S, percentile(v, 0.99)]
            for k, v in sorted(windows.items())
        },
        "wall_s": s["wall_s"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 GPUs, 600 s, the sudden shape")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--duration-s", type=float, default=None)
    p.add_argument("--delay-s", type=float, default=120.0)
    p.add_argument("--base-load", type=float, default=0.4)
    p.add_argument("--shapes", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    gpus = args.gpus or (8 if args.quick else 32)
    duration = args.duration_s or (600.0 if args.quick else 1200.0)
    shapes = (args.shapes or ("sudden" if args.quick else "sudden,gradual")).split(",")
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown {v!r}; valid: {', '.join(VARIANTS)}")
    for sh in shapes:
        if sh not in ("sudden", "gradual"):
            p.error(f"--shapes: unknown {sh!r}; valid: sudden, gradual")
    prof = profile.load("h100-llama3-8b")
    print("autoscaling: measuring one node's capacity on the trace", file=sys.stderr)
    cap = workloads.node_capacity_rps(prof, workloads.read_trace(TRACE), slots=64)
    tasks = [
        {"shape": sh, "variant": v, "gpus": gpus, "duration_s": duration, "capacity": cap,
         "base_load": args.base_load, "delay_s": args.delay_s}
        for sh in shapes for v in variants
    ]  # fmt: skip
    print(f"autoscaling: {len(tasks)} runs on {args.jobs} processes", file=sys.stderr)
    started = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        rows = pool.map(_run, tasks, chunksize=1)
    meta = {
        "command": " ".join(sys.argv),
        "gpus": gpus,
        "duration_s": duration,
        "delay_s": args.delay_s,
        "base_load": args.base_load,
        "node_capacity_rps": cap,
        "trace": str(TRACE.relative_to(ROOT)),
        "machine": f"{platform.machine()} python {platform.python_version()}",
        "wall_s": time.monotonic() - started,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "autoscaling.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    table = render(rows, meta)
    (args.out_dir / "autoscaling.md").write_text(table)
    print(table)
    plot(rows, meta, args.out_dir / "autoscaling.png")
    return 0


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = [
        f"{meta['gpus']} GPUs at most, base load {meta['base_load']:.0%} then 2x, provisioning "
        f"delay {meta['delay_s']:.0f} s, {meta['duration_s']:.0f} virtual s; one node "
        f"{meta['node_capacity_rps']:.2f} req/s",
        "",
        "| shape | policy | queue wait p99 ms | TTFT p99 ms | GPU-hours | over-provisioning | "
        "nodes mean / max | ups / downs | refused |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['shape']} | {r['variant']} | {1000 * r['queue_wait_p99_s']:.0f} | "
            f"{1000 * r['ttft_p99_s']:.0f} | {r['gpu_hours']:.2f} | "
            f"{100 * r['over_provisioning']:.0f} % | {r['nodes_mean']:.1f} / {r['nodes_max']} | "
            f"{r['scale_ups']} / {r['scale_downs']} | {r['refused']} |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 7), squeeze=False)
    cap = meta["node_capacity_rps"]
    colours = {"static": "grey", "reactive": "tab:orange", "predictive": "tab:blue",
               "combined": "tab:green"}  # fmt: skip
    for col, shape in enumerate(shapes):
        top, bottom = axes[0][col], axes[1][col]
        drawn_load = False
        for r in (r for r in rows if r["shape"] == shape):
            colour = colours[r["variant"]]
            windows = sorted((float(k), v) for k, v in r["windows"].items())
            if not drawn_load:
                top.fill_between(
                    [t for t, _ in windows], [v[0] / cap for _, v in windows],
                    step="post", color="lightgrey", label="load (nodes at capacity)",
                )  # fmt: skip
                drawn_load = True
            if r["timeline"]:
                top.step(
                    [x[0] for x in r["timeline"]],
                    [x[1] + x[2] for x in r["timeline"]],
                    where="post",
                    color=colour,
                    label=f"{r['variant']}: ordered + serving",
                )
            else:
                top.axhline(
                    meta["gpus"], color=colour, label=f"{r['variant']}: {meta['gpus']} nodes"
                )
            bottom.step([t for t, _ in windows], [max(1e-4, v[1]) for _, v in windows],
                        where="post", color=colour, label=r["variant"])  # fmt: skip
        top.set_title(f"{shape} 2x spike, {meta['delay_s']:.0f} s provisioning delay")
        top.set_ylabel("nodes")
        top.legend(fontsize=7, loc="upper left")
        bottom.axhline(0.2, color="red", linestyle=":", label="200 ms")
        bottom.set_yscale("log")
        bottom.set_ylabel(f"queue wait p99 per {WINDOW_S:.0f} s of arrivals, s")
        bottom.set_xlabel("virtual time, s")
        bottom.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"autoscaling: wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
