"""How one simulated node's time to first token and preemptions grow with the arrival rate.

Question: where is the knee of a node's load curve under a real length mix, and does the
simulator put it where the KV cache fills?  Replays, in virtual time (``meridian_sim.offline``),
Poisson arrivals at each rate with prompt and output lengths taken in order from an Azure LLM
inference trace (``ContextTokens``, ``GeneratedTokens``), every request generating its full
output (``ignore_eos``).  Writes ``node_load_curve.json``, ``node_load_curve.md`` (a table) and
``node_load_curve.png`` (a plot, when matplotlib is installed: ``pip install -e '.[bench]'``).

    python benchmarks/node_load_curve.py [--trace data/workloads/azure_conv_2023.csv]
        [--profile h100-llama3-8b] [--rates 5,10,15,20] [--duration-s 120] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meridian_sim import offline, profile  # noqa: E402

DEFAULT_TRACE = ROOT / "data" / "workloads" / "azure_conv_2023.csv"


def read_lengths(path: Path, *, max_model_len: int) -> list[tuple[int, int]]:
    """(prompt, output) token counts from an Azure trace, clipped to fit the model."""
    out: list[tuple[int, int]] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            prompt_tokens = max(1, int(row["ContextTokens"]))
            output_tokens = max(1, int(row["GeneratedTokens"]))
            prompt_tokens = min(prompt_tokens, max_model_len - 2)
            output_tokens = min(output_tokens, max_model_len - prompt_tokens)
            out.append((prompt_tokens, output_tokens))
    if not out:
        raise SystemExit(f"{path}: no rows with ContextTokens and GeneratedTokens")
    return out


def arrivals(
    lengths: list[tuple[int, int]], *, rate_per_s: float, duration_s: float, seed: int
) -> list[offline.Arrival]:
    rng = random.Random(seed)
    out: list[offline.Arrival] = []
    t = rng.expovariate(rate_per_s)
    n = 0
    while t < duration_s:
        prompt_tokens, output_tokens = lengths[n % len(lengths)]
        # unique token ids per request: this curve is about load, not prefix sharing
        ids = tuple(range(n * 10_000 + 1, n * 10_000 + 1 + prompt_tokens))
        out.append(offline.Arrival(time_s=t, prompt_token_ids=ids, max_tokens=output_tokens))
        n += 1
        t += rng.expovariate(rate_per_s)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure trace CSV")
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument(
        "--rates", default="5,10,15,20,25,30,35,40", help="arrival rates, requests/s"
    )
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="3 rates, 30 s each (make bench)")
    args = parser.parse_args()
    if args.quick:
        args.rates, args.duration_s = "5,15,25", min(args.duration_s, 30.0)
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file (pass the Azure trace CSV's path)")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    prof = profile.load(args.profile)
    lengths = read_lengths(args.trace, max_model_len=prof.max_model_len)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    rows: list[dict[str, Any]] = []
    for i, rate in enumerate(rates, 1):
        started = time.perf_counter()
        arr = arrivals(lengths, rate_per_s=rate, duration_s=args.duration_s, seed=args.seed)
        result = offline.replay(prof, arr, seed=args.seed)
        t = offline.ttfts(result.records)
        generated = sum(r.generation_tokens for r in result.records)
        row = {
            "rate_per_s": rate,
            "requests": len(arr),
            "ttft_p50_s": offline.percentile(t, 0.5),
            "ttft_p90_s": offline.percentile(t, 0.9),
            "ttft_p99_s": offline.percentile(t, 0.99),
            "output_tokens_per_s": generated / result.end_s,
            "preemptions": result.num_preemptions,
            "peak_kv_usage": result.peak_kv_usage,
            "peak_waiting": result.peak_waiting,
            "engine_steps": result.num_steps,
            "wall_s": time.perf_counter() - started,
        }
        rows.append(row)
        print(
            f"[{i}/{len(rates)}] rate {rate:g}/s: {len(arr)} requests, TTFT p50 "
            f"{row['ttft_p50_s'] * 1000:.0f} ms p99 {row['ttft_p99_s'] * 1000:.0f} ms, "
            f"{row['preemptions']} preemptions ({row['wall_s']:.1f} s)",
            flush=True,
        )

    meta = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "profile": prof.name,
        "trace": args.trace.name,
        "duration_s": args.duration_s,
        "seed": args.seed,
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"python {platform.python_version()}".strip(),
    }
    (args.out_dir / "node_load_curve.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    table = [
        "| rate (req/s) | requests | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | "
        "output tok/s | preemptions | peak KV use | peak waiting |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        table.append(
            f"| {r['rate_per_s']:g} | {r['requests']} | {r['ttft_p50_s'] * 1000:.0f} | "
            f"{r['ttft_p90_s'] * 1000:.0f} | {r['ttft_p99_s'] * 1000:.0f} | "
            f"{r['output_tokens_per_s']:.0f} | {r['preemptions']} | "
            f"{r['peak_kv_usage'] * 100:.1f} % | {r['peak_waiting']} |"
        )
    (args.out_dir / "node_load_curve.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    _plot(rows, prof.name, args.trace.name, args.out_dir / "node_load_curve.png")
    return 0


def _plot(rows: list[dict[str, Any]], profile_name: str, trace: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    rates = [r["rate_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [r["ttft_p50_s"] for r in rows], "o-", label="TTFT p50")
    ax.plot(rates, [r["ttft_p99_s"] for r in rows], "s-", label="TTFT p99")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("time to first token (s, log)")
    ax2 = ax.twinx()
    ax2.plot(
        rates,
        [r["peak_kv_usage"] * 100 for r in rows],
        "^--",
        color="gray",
        label="peak KV use (%)",
    )
    for r in rows:
        if r["preemptions"]:
            ax2.annotate(
                f"{r['preemptions']} preempted",
                (r["rate_per_s"], r["peak_kv_usage"] * 100),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
            )
    ax2.set_ylim(0, 110)
    ax2.set_ylabel("peak KV cache use (%)")
    ax.set_title(f"{profile_name}: one node under rising load ({trace})")
    lines = ax.get_legend_handles_labels()
    bars = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + bars[0], lines[1] + bars[1], loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
