"""Shared plumbing of the fleet-simulator benchmarks (fleet_tables.py, cache_by_size.py).

Runs are independent ``meridian_sim.fleet`` simulations; they go to a pool of worker processes
(2 by default: the development machine has 2 cores), each of which reads the trace once and
keeps its block-hash memo across runs.  One node's capacity on the trace's length mix is
measured once in the parent (``meridian_sim.workloads.node_capacity_rps``) and handed to every
run, so every load fraction means the same thing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meridian_sim import fleet, profile, workloads  # noqa: E402
from policies import routing  # noqa: E402

DEFAULT_TRACE = ROOT / "data" / "workloads" / "mooncake_conversation_trace.jsonl"
MAX_MODEL_LEN = 131_072  # Llama-3.1-8B's context: the Mooncake trace has 126k-token prompts


@dataclass(frozen=True, slots=True)
class Task:
    section: str
    policy: str
    nodes: int
    load: float
    scrape_interval_s: float
    window_s: float | None  # keep this many virtual seconds of arrivals (None: all)
    min_requests: int
    seed: int = 0
    regions: int = 1
    agents: int = 1  # agent replicas per region (FleetConfig.agents_per_region)
    workers: bool = False  # the agents are one agent's workers (FleetConfig.workers)
    candidates: int | None = None  # RoutingConfig.meridian_candidates (None: the default)
    sampled: int | None = None  # RoutingConfig.meridian_sampled (None: the default)
    kv_events: bool = False  # the precise index fed by the engines' events (FleetConfig)
    kv_event_delay_s: float = 0.05
    num_gpu_blocks: int | None = None  # KV-cache blocks per node (None: the profile's)


_STATE: dict[str, Any] = {}


def _init(trace: str, profile_name: str, capacity: float) -> None:
    _STATE["requests"] = workloads.read_trace(trace)
    _STATE["profile"] = fleet.with_context(profile.load(profile_name), MAX_MODEL_LEN)
    _STATE["capacity"] = capacity
    _STATE["hasher"] = workloads.BlockHasher(block_size=16)


def _routing_config(task: Task) -> routing.RoutingConfig:
    """The default routing configuration with the task's bound, where it sets one."""
    config = routing.RoutingConfig()
    if task.candidates is not None:
        config = dataclasses.replace(config, meridian_candidates=task.candidates)
    if task.sampled is not None:
        config = dataclasses.replace(config, meridian_sampled=task.sampled)
    return config


def _run(task: Task) -> dict[str, Any]:
    prof = _STATE["profile"]
    if task.num_gpu_blocks is not None:
        prof = dataclasses.replace(prof, num_gpu_blocks=task.num_gpu_blocks)
    work = fleet.at_load(
        _STATE["requests"],
        prof,
        nodes=task.nodes,
        load=task.load,
        duration_s=task.window_s,
        min_requests=task.min_requests,
        node_capacity_rps=_STATE["capacity"],
    )
    config = fleet.FleetConfig(
        nodes=task.nodes,
        policy=task.policy,
        regions=task.regions,
        agents_per_region=task.agents,
        workers=task.workers,
        scrape_interval_s=task.scrape_interval_s,
        seed=task.seed,
        routing=_routing_config(task),
        kv_events=task.kv_events,
        kv_event_delay_s=task.kv_event_delay_s,
    )
    result = fleet.simulate(prof, work.requests, config, hasher=_STATE["hasher"])
    return {
        "section": task.section,
        "load": task.load,
        "arrival_rate_per_s": work.rate_per_s,
        "window_s": task.window_s,
        "candidates": task.candidates,
        "sampled": task.sampled,
        "workers": task.workers,
        "num_gpu_blocks": prof.num_gpu_blocks,
        "kv_event_delay_s": task.kv_event_delay_s if task.kv_events else None,
        **result.summary,
    }


def capacity(trace: Path, profile_name: str, *, num_gpu_blocks: int | None = None) -> float:
    prof = fleet.with_context(profile.load(profile_name), MAX_MODEL_LEN)
    if num_gpu_blocks is not None:
        prof = dataclasses.replace(prof, num_gpu_blocks=num_gpu_blocks)
    return workloads.node_capacity_rps(prof, workloads.read_trace(trace))


def _task_key(
    section: str, policy: str, nodes: int, load: float, scrape: float, window: Any, agents: Any
) -> tuple[Any, ...]:
    return (section, policy, int(nodes), float(load), float(scrape), window, int(agents))


def add_reuse_args(parser: argparse.ArgumentParser) -> None:
    """``--reuse FILE --rerun POLICIES``, read by :func:`reusable`."""
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="an earlier run's JSON: take its rows for the policies not in --rerun",
    )
    parser.add_argument(
        "--rerun", default="", help="policies to run again with --reuse (changed since it)"
    )


def reused_by_args(
    args: argparse.Namespace,
    tasks: Sequence[Task],
    *,
    capacity_rps: float,
    same: dict[str, Any],
) -> dict[int, dict[str, Any]] | None:
    """:func:`reusable` for the ``--reuse``/``--rerun`` of :func:`add_reuse_args` (``None``
    without ``--reuse``); ``args.trace`` is the run's trace."""
    if args.reuse is None:
        return None
    return reusable(
        tasks,
        args.reuse,
        rerun=policy_set(args.rerun),
        capacity_rps=capacity_rps,
        trace=args.trace,
        same=same,
    )


def policy_set(text: str) -> set[str]:
    """``"a,b"`` -> ``{"a", "b"}``; empty names are dropped."""
    return {name for name in text.split(",") if name}


def reusable(
    tasks: Sequence[Task],
    previous: Path,
    *,
    rerun: set[str],
    capacity_rps: float,
    trace: Path,
    same: dict[str, Any],
) -> dict[int, dict[str, Any]]:
    """Rows of an earlier run (its JSON) that stand for ``tasks`` of a policy not in ``rerun``:
    same section, policy, size, load, scrape interval, window and agents per region (a row
    without ``agents_per_region``, from before it existed, had one), same trace, measured
    capacity and ``same`` settings (keys of its ``meta``).  Runs are deterministic (seed 0, one
    region here), so a policy whose code did not change gives the same row again; reused rows
    are marked ``reused_from`` with the earlier run's date."""
    data = json.loads(previous.read_text())
    meta = data["meta"]
    for key, value in same.items():
        if meta.get(key) != value:
            raise SystemExit(f"--reuse {previous}: its {key} is {meta.get(key)!r}, not {value!r}")
    if abs(float(meta["node_capacity_rps"]) - capacity_rps) > 1e-9:
        raise SystemExit(
            f"--reuse {previous}: its node capacity {meta['node_capacity_rps']} differs from "
            f"this run's {capacity_rps}; pass --capacity-rps {meta['node_capacity_rps']} or "
            "rerun everything"
        )
    if Path(meta["trace"]).name != trace.name:
        raise SystemExit(f"--reuse {previous}: it ran on {meta['trace']}, not {trace}")
    when = meta.get("machine", {}).get("date", str(previous))
    by = {
        _task_key(r["section"], r["policy"], r["nodes"], r["load"], r["scrape_interval_s"],
                  r["window_s"], r.get("agents_per_region", 1)): r
        for r in data["rows"]
        if int(r.get("regions", 1)) == 1
    }  # fmt: skip
    out: dict[int, dict[str, Any]] = {}
    for i, t in enumerate(tasks):
        if t.policy in rerun or t.seed != 0 or t.regions != 1:
            continue
        row = by.get(_task_key(t.section, t.policy, t.nodes, t.load, t.scrape_interval_s,
                               t.window_s, t.agents))  # fmt: skip
        if row is not None:
            out[i] = {
                **row,
                "agents_per_region": t.agents,
                "reused_from": row.get("reused_from", when),
            }
    return out


def reuse_note(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A markdown line naming the rows taken from earlier runs (``--reuse``), if any."""
    reused = [r for r in rows if "reused_from" in r]
    if not reused:
        return []
    policies = ", ".join(sorted({str(r["policy"]) for r in reused}))
    dates = ", ".join(sorted({str(r["reused_from"]) for r in reused}))
    return [
        f"{len(reused)} of {len(rows)} rows ({policies}) are reused from the run of {dates}.",
        "",
    ]


def run_all(
    tasks: Sequence[Task],
    *,
    trace: Path,
    profile_name: str,
    capacity_rps: float,
    jobs: int,
    partial: Path | None = None,
    reused: dict[int, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run every task, ``jobs`` at a time, printing progress on stderr; rows in task order.
    ``partial``: rewritten after every run with the rows so far (a long run can be read early).
    ``reused``: rows by task index (:func:`reusable`) that are not run again.
    """
    started = time.monotonic()
    rows: list[dict[str, Any] | None] = [None] * len(tasks)
    for i, row in (reused or {}).items():
        rows[i] = row
    todo = [(i, t) for i, t in enumerate(tasks) if rows[i] is None]
    if reused:
        print(f"reusing {len(reused)} rows; running {len(todo)}", file=sys.stderr, flush=True)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(
        jobs, initializer=_init, initargs=(str(trace), profile_name, capacity_rps)
    ) as pool:
        results = pool.imap_unordered(_indexed, todo)
        for done, (i, row) in enumerate(results, start=1):
            rows[i] = row
            t = tasks[i]
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps([r for r in rows if r is not None], indent=1))
            print(
                f"[{done}/{len(todo)} {time.monotonic() - started:.0f} s] {t.section} "
                f"{t.policy} n={t.nodes} load={t.load} scrape={t.scrape_interval_s} "
                f"agents={t.agents}: "
                f"ttft p99 {row['ttft_p99_s']:.3f} s, hit {row['prefix_hit_rate']:.3f}, "
                f"{row['requests']} req in {row['wall_s']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return [r for r in rows if r is not None]


def _indexed(item: tuple[int, Task]) -> tuple[int, dict[str, Any]]:
    return item[0], _run(item[1])


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def write(
    out_dir: Path, name: str, meta: dict[str, Any], rows: list[dict[str, Any]], md: str
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(md)
    print(f"wrote {out_dir / name}.json and .md", file=sys.stderr)


def ms(value: float) -> str:
    return f"{value * 1000:.0f}"


def pct(value: float) -> str:
    return f"{value * 100:.1f} %"
