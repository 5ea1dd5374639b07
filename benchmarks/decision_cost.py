"""What one routing decision costs the agent, from 8 to 1,024 nodes.

Question: how long does the agent's event loop spend deciding where one request goes, the view
lookup included, as the region grows?  In-process, on the agent's own classes: a
``regional_agent.nodes.NodePool`` of N nodes with telemetry (waiting and KV use drawn at
random, known for every node), the ``meridian`` policy with its prefix index warmed by the same
traffic, and a stream of chat-like requests: 64 system prompts of 32 blocks shared by many
requests (``--system-prompts``; 1: one prompt every request shares and every node soon holds,
the widest match there is), each with 4 blocks of its own.  Each decision is timed from
``pool.views()`` through ``policy.choose()`` (``perf_counter_ns``); then the request is
dispatched as the queue does (``pool.acquire``, ``observe_routed``) and the oldest in flight
completes (``pool.release``), so views change between decisions as they do in the agent: about
8 requests in flight per node.
That bookkeeping after the decision (the kept views' updates and the prefix index's insert) is
timed too, apart ("bookkeeping"): the views are updated there, not in the decision.  The
garbage collector is settled first as the agent settles it once listening (``gc.freeze`` and a
young threshold of 50,000, ``meridian_service.gc_tuning``; ``--gc-young-threshold 0`` for
CPython's 700, under which a young collection lands in about one decision in a hundred).

Variants: ``meridian`` (the default: a bounded candidate set above
``meridian_candidates`` = 16 routable nodes) and ``meridian-exact`` (``meridian_candidates`` =
0: every node scored).  ``--label`` names a run of the tree on ``PYTHONPATH``, so an older
revision can be measured with this script and appended to the same results (the "before" rows):

    python benchmarks/decision_cost.py [--quick] [--nodes 8,16,...] [--decisions 5000]
    python benchmarks/decision_cost.py --nodes 256 --bounds 16x8,8x4 --decisions 30000

``--bounds`` times bounded sets of other sizes (``meridian_candidates`` holders and
``meridian_sampled`` drawn) side by side instead of the variants, interleaved in blocks of 500
decisions (``interleaved``), so that a noisy host's drift falls on every set alike.
    PYTHONPATH=/path/to/old/checkout python benchmarks/decision_cost.py --label before --append

Writes decision_cost.json, decision_cost.md and decision_cost.png to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from policies import prompt, routing
from policies.model import Health, NodeId, RequestView, Telemetry
from regional_agent.nodes import Node, NodePool

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "m"
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


class Sources:
    """Telemetry and health for the pool: every node healthy, warm and scraped."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.telemetry = {
            NodeId(f"n{i}"): Telemetry(
                age_s=0.2,
                running=rng.randint(0, 32),
                waiting=rng.randint(0, 4),
                kv_util=rng.uniform(0.1, 0.9),
                prefix_hit_rate=None,
                block_size=16,
            )
            for i in range(n)
        }

    def snapshot(self, node_id: NodeId, *, now: float) -> Telemetry | None:
        return self.telemetry.get(node_id)

    def fresh_until(self, node_id: NodeId) -> float:
        return math.inf

    def state(self, node_id: NodeId, *, now: float) -> Health:
        return Health.HEALTHY

    def slow_start(self, node_id: NodeId, *, now: float) -> float:
        return 1.0

    def steady_until(self, node_id: NodeId, *, now: float) -> float:
        return math.inf


def requests(count: int, rng: random.Random, *, system_prompts: int = 64) -> list[RequestView]:
    systems = [[rng.randrange(1 << 30) for _ in range(32 * 16)] for _ in range(system_prompts)]
    last = system_prompts - 1
    out = []
    for i in range(count):
        tokens = systems[min(last, int(rng.expovariate(1 / 12)))] + [i] * 64
        out.append(
            RequestView(
                model=MODEL,
                prompt_tokens=len(tokens),
                max_tokens=128,
                block_hashes=prompt.block_hashes(tokens, block_size=16),
                block_tokens=16,
            )
        )
    return out


class _Run:
    """A pool of ``n`` nodes, a ``meridian`` policy of ``config`` and a request stream, stepped
    a number of decisions at a time (:meth:`step`), each timed as the module docstring says."""

    def __init__(
        self, n: int, config: routing.RoutingConfig, *, requests_: int, seed: int,
        system_prompts: int,
    ) -> None:  # fmt: skip
        self.rng = rng = random.Random(seed)
        self.pool = pool = NodePool()
        sources = Sources(n, rng)
        pool.health = sources  # type: ignore[assignment]
        pool.telemetry = sources  # type: ignore[assignment]
        for i in range(n):
            pool.add(Node(node_id=NodeId(f"n{i}"), url=f"http://n{i}", models=frozenset({MODEL})))
        self.policy = routing.create("meridian", config)
        self.stream = iter(requests(requests_, rng, system_prompts=system_prompts))
        self.in_flight: collections.deque[tuple[NodeId, int]] = collections.deque()
        self.target = 8 * n
        self.now = 0.0
        self.times: list[int] = []
        self.kept: list[int] = []  # the request's bookkeeping after the decision

    def step(self, count: int, *, keep: bool) -> None:
        pool, policy, rng, in_flight = self.pool, self.policy, self.rng, self.in_flight
        for request in itertools.islice(self.stream, count):
            self.now += 0.001
            now = self.now
            t0 = time.perf_counter_ns()
            views = pool.views(now=now)
            decision = policy.choose(request, views, now=now, rng=rng)
            t1 = time.perf_counter_ns()
            if keep:
                self.times.append(t1 - t0)
            assert decision.node is not None, decision
            tokens = request.prompt_tokens + request.max_tokens
            t2 = time.perf_counter_ns()
            pool.acquire(decision.node, tokens=tokens)
            policy.observe_routed(request, decision.node, now=now)
            in_flight.append((decision.node, tokens))
            while len(in_flight) > self.target:
                node_id, done = in_flight.popleft()
                pool.release(node_id, tokens=done, failed=False)
            if keep:
                self.kept.append(time.perf_counter_ns() - t2)


def parse_bounds(text: str) -> list[tuple[int, int]]:
    """``--bounds``: comma-separated ``HOLDERSxDRAWN`` pairs (``16x8,8x4``), each at least 1;
    raises ``ValueError`` saying what to give."""
    try:
        bounds = [(int(h), int(d)) for h, d in (b.split("x") for b in text.split(",") if b)]
    except ValueError:
        bounds = [(0, 0)]
    if any(h < 1 or d < 1 for h, d in bounds):
        raise ValueError(f"--bounds {text!r}: give HOLDERSxDRAWN pairs such as 16x8,8x4")
    return bounds


def measure(
    n: int, variant: str, *, decisions: int, warmup: int, seed: int, system_prompts: int = 64
) -> dict[str, Any]:
    config = routing.RoutingConfig()
    if variant == "meridian-exact":
        if not hasattr(config, "meridian_candidates"):
            raise SystemExit("this revision has no meridian_candidates: measure 'meridian'")
        config = dataclasses.replace(config, meridian_candidates=0)
    run = _Run(n, config, requests_=warmup + decisions, seed=seed, system_prompts=system_prompts)
    run.step(warmup, keep=False)
    run.step(decisions, keep=True)
    return {
        "nodes": n,
        "variant": variant,
        "decisions": len(run.times),
        **_quantiles("", run.times),
        **_quantiles("kept_", run.kept),
    }


def interleaved(
    n: int,
    bounds: Sequence[tuple[int, int]],
    *,
    decisions: int,
    warmup: int,
    seed: int,
    system_prompts: int = 64,
    block: int = 500,
) -> list[dict[str, Any]]:
    """``meridian`` with each bounded set ``(holders, drawn)`` (``meridian_candidates``,
    ``meridian_sampled``), side by side: one pool, policy and stream (the same seed) each,
    stepped ``block`` decisions at a time in turn, the order rotated every round, so that the
    host's drift from one minute to the next falls on every set alike."""
    runs = [
        _Run(
            n,
            dataclasses.replace(routing.RoutingConfig(), meridian_candidates=h, meridian_sampled=d),
            requests_=warmup + decisions,
            seed=seed,
            system_prompts=system_prompts,
        )
        for h, d in bounds
    ]
    for run in runs:
        run.step(warmup, keep=False)
    for r in range(math.ceil(decisions / block)):
        for i in range(len(runs)):
            runs[(i + r) % len(runs)].step(block, keep=True)
    return [
        {
            "nodes": n,
            "variant": f"meridian {h}x{d}",
            "decisions": len(run.times),
            **_quantiles("", run.times),
            **_quantiles("kept_", run.kept),
        }
        for (h, d), run in zip(bounds, runs, strict=True)
    ]


def _quantiles(prefix: str, ns: list[int]) -> dict[str, float]:
    us = sorted(t / 1000 for t in ns)
    at = {q: us[min(len(us) - 1, int(len(us) * q))] for q in (0.5, 0.98, 0.99, 0.999)}
    return {
        f"{prefix}p50_us": at[0.5],
        f"{prefix}p98_us": at[0.98],
        f"{prefix}p99_us": at[0.99],
        f"{prefix}p999_us": at[0.999],
        f"{prefix}mean_us": statistics.fmean(us),
    }


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| run | variant | nodes | p50 µs | p98 µs | p99 µs | p99.9 µs | mean µs "
        "| bookkeeping p50 / p99 µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kept = f"{r['kept_p50_us']:.1f} / {r['kept_p99_us']:.1f}" if "kept_p50_us" in r else "n/a"
        p98 = f"{r['p98_us']:.1f}" if "p98_us" in r else "n/a"
        p999 = f"{r['p999_us']:.1f}" if "p999_us" in r else "n/a"
        lines.append(
            f"| {r['label']} | {r['variant']} | {r['nodes']} | {r['p50_us']:.1f} "
            f"| {p98} | {r['p99_us']:.1f} | {p999} | {r['mean_us']:.1f} | {kept} |"
        )
    return lines


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in sorted({(r["label"], r["variant"]) for r in rows}):
        pts = sorted((r["nodes"], r["p99_us"], r["p50_us"]) for r in rows
                     if (r["label"], r["variant"]) == key)  # fmt: skip
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                       label=f"{key[0]} {key[1]} p99")[0]  # fmt: skip
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=line.get_color(),
                alpha=0.6, label=f"{key[0]} {key[1]} p50")  # fmt: skip
    ax.axhline(50, color="grey", ls=":", label="target: 50 µs p99 at 256 nodes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes in the region")
    ax.set_ylabel("µs per decision (views + choose)")
    ax.set_title("One routing decision of the agent, by region size", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 decisions, up to 256 nodes")
    parser.add_argument("--nodes", default=",".join(map(str, SIZES)))
    parser.add_argument("--variants", default="meridian,meridian-exact")
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--label", default="now")
    parser.add_argument("--append", action="store_true", help="add to the existing results")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--system-prompts",
        type=int,
        default=64,
        help="distinct system prompts (popularity falling exponentially); 1: every request "
        "shares one, which every node then holds (the widest match)",
    )
    parser.add_argument(
        "--gc-young-threshold",
        type=int,
        default=50_000,
        help="settle the garbage collector as the agent does once it listens (gc.freeze, this "
        "young threshold: server.gc_young_threshold's default); 0: CPython's own",
    )
    parser.add_argument(
        "--bounds",
        default="",
        help="instead of --variants: these bounded sets side by side, interleaved in blocks of "
        "500 decisions, each HOLDERSxDRAWN (meridian_candidates x meridian_sampled), e.g. 16x8,8x4",
    )
    args = parser.parse_args(argv)
    try:
        bounds = parse_bounds(args.bounds)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        from meridian_service import gc_tuning
    except ImportError:  # a revision from before the agent settled its collector
        args.gc_young_threshold = 0
    else:
        gc_tuning.settle(args.gc_young_threshold)
    sizes = [int(x) for x in args.nodes.split(",")]
    if args.quick:
        args.decisions, args.warmup = 1000, 500
        sizes = [s for s in sizes if s <= 256]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "decision_cost.json"
    rows: list[dict[str, Any]] = []
    if args.append and path.exists():
        rows = [r for r in json.loads(path.read_text())["rows"] if r["label"] != args.label]
    for n in sizes if bounds else ():
        for row in interleaved(n, bounds, decisions=args.decisions, warmup=args.warmup,
                               seed=args.seed, system_prompts=args.system_prompts):  # fmt: skip
            row["label"] = args.label
            rows.append(row)
            print(f"{args.label} {row['variant']} {n} nodes: p50 {row['p50_us']:.1f} µs, p99 "
                  f"{row['p99_us']:.1f} µs", file=sys.stderr, flush=True)  # fmt: skip
    for variant in args.variants.split(",") if not bounds else ():
        for n in sizes:
            row = measure(n, variant, decisions=args.decisions, warmup=args.warmup,
                          seed=args.seed, system_prompts=args.system_prompts)  # fmt: skip
            row["label"] = args.label
            rows.append(row)
            print(f"{args.label} {variant} {n} nodes: p50 {row['p50_us']:.1f} µs, p99 "
                  f"{row['p99_us']:.1f} µs", file=sys.stderr, flush=True)  # fmt: skip
    result = {"benchmark": "decision_cost", "args": {k: str(v) for k, v in vars(args).items()},
              "python": sys.version.split()[0], "rows": rows}  # fmt: skip
    path.write_text(json.dumps(result, indent=2))
    md = ["# One routing decision (pool.views + policy.choose)", "", *table(rows), ""]
    (args.out_dir / "decision_cost.md").write_text("\n".join(md))
    print("\n".join(table(rows)))
    plot(rows, args.out_dir / "decision_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
