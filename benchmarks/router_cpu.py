"""CPU per request of each router, saturated by wrk: Meridian's agent against the Rust routers.

Question: what does one request cost each router in CPU, when the router is kept busy the way
production keeps it busy?  A closed-loop Python client leaves routers idle between requests and
inflates their per-request CPU 4-10x; wrk does not.

Set-up (as in the field notes): two ``meridian-sim node --profile cpu-tiny --time-scale 1000``
nodes that answer at once, and wrk ``-t1 -c32`` on core 0; every router on core 1, alone while it
is measured (the others idle, their idle CPU measured and subtracted).  A chat request with a short
prompt (~22 tokens) that changes per request, ``max_tokens`` 2, plain and streamed
(``--prompt-words N`` puts a shared system prompt of N words before it: the prompt-length
sweep, in ``router_cpu_prompts.*``).  CPU is
utime + stime of the router's process tree (``/proc/<pid>/stat``) over the run, less its idle
rate, divided by the requests wrk completed.  Runs are interleaved: each repeat goes once through
every router and mode, in an order rotated per repeat, after one discarded warm-up run each; the
table gives medians (and the range) of the repeats.

Routers: ``meridian`` (the agent, default policy), ``meridian-rr`` (round_robin),
``meridian@REV`` (the agent as it was at git revision REV, run from a worktree: how each change
moved the figure, measured in the same run), the peers vllm-router, sglang-router and smg
(``cache_aware``, installed by ``benchmarks/_peers.py``), and ``bare``
(``benchmarks/_bare_proxy.py``: aiohttp + uvloop relaying bytes, the floor for an aiohttp
router).

    python benchmarks/router_cpu.py [--quick] [--routers meridian,vllm-router,...]
        [--repeats 3] [--duration-s 15] [--connections 32] [--out-dir DIR] [--peers-root DIR]

Writes router_cpu.json, router_cpu.md and router_cpu.png to benchmarks/results/; progress on
stderr.  Needs ``wrk`` and ``taskset`` (Debian: ``apt-get install wrk util-linux``) and 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import agent_overhead as ao
import proxy_overhead as po

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROUTERS = ("meridian", "meridian-rr", *_peers.PEERS, "bare")
MODES = ("plain", "stream")
LOAD_CPU, ROUTER_CPU = 0, 1

# wrk's request() builds a new body per request (a prompt that never repeats); done() prints one
# JSON line this script reads.
_LUA = r"""
local counter = 0
local model = os.getenv("BENCH_MODEL")
local stream = os.getenv("BENCH_STREAM") == "1" and "true" or "false"
local headers = {["Content-Type"] = "application/json"}
local system = [==[SYSTEM_PROMPT]==]
local head = system == "" and "" or ('{"role":"system","content":"' .. system .. '"},')
request = function()
  counter = counter + 1
  local body = string.format(
    '{"model":"%s","messages":[%s{"role":"user","content":"Summarise request number %d of ' ..
    'this benchmark in one short sentence, please."}],"max_tokens":2,"stream":%s}',
    model, head, counter, stream)
  return wrk.format("POST", "/v1/chat/completions", headers, body)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"status_errors":%d,"socket_errors":%d,' ..
    '"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def system_prompt(words: int) -> str:
    """``words`` words of plain ASCII text, the same for every request (a system prompt that
    every request shares, as in production): 0 gives none."""
    vocab = ("route", "token", "cache", "region", "model", "prefill", "decode", "queue",
             "node", "agent", "answer", "stream")  # fmt: skip
    return " ".join(vocab[(i * 7 + i // 12) % len(vocab)] for i in range(words))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class Router:
    name: str
    policy: str
    url: str
    pid: int
    stop: Callable[[], None]
    idle_cpu_per_s: float = 0.0


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` beside the repository (made once, reused), to run an older agent."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    path = Path(tempfile.gettempdir()) / f"meridian-rev-{sha}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha],
                       check=True, capture_output=True)  # fmt: skip
    return path


def start_revision(name: str, rev: str, node_urls: Sequence[str], *, logdir: Path) -> Router:
    """``meridian@REV``: the agent as it was at ``rev``, from a worktree, same interpreter."""
    tree = worktree(rev)
    argv = [sys.executable, "-m", "regional_agent.cli", "--port", "0", "--policy", "meridian",
            "--log-level", "WARNING"]  # fmt: skip
    for u in node_urls:
        argv += ["--node", u]
    err = (logdir / f"{name}.stderr").open("wb")
    # one process, pinned below (an older revision, which ran one by default, ignores it)
    env = {**os.environ, "PYTHONPATH": str(tree), "MERIDIAN_AGENT_WORKERS__COUNT": "1"}
    proc = subprocess.Popen(
        argv, cwd=tree, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err
    )
    child = ao.Child(name=name, proc=proc, stderr_path=logdir / f"{name}.stderr")
    po.pin(proc.pid, {ROUTER_CPU})
    ao.wait_ready(child)
    po.pin(proc.pid, {ROUTER_CPU})
    return Router(name, f"meridian at {rev}", child.url, proc.pid, lambda: ao.stop_all([child]))


def start_router(
    name: str, node_urls: Sequence[str], *, logdir: Path, peers_root: str | None
) -> Router:
    if name.startswith("meridian@"):
        return start_revision(name, name.split("@", 1)[1], node_urls, logdir=logdir)
    if name in ("meridian", "meridian-rr", "bare"):
        if name == "bare":
            argv = [str(ROOT / "benchmarks" / "_bare_proxy.py"), "--port", "0"]
            policy = "round robin"
        else:
            policy = "meridian" if name == "meridian" else "round_robin"
            argv = ["-m", "regional_agent.cli", "--port", "0", "--policy", policy,
                    "--workers", "1", "--log-level", "WARNING"]  # fmt: skip
        for u in node_urls:
            argv += ["--node", u]
        child = ao.spawn(name, argv, logdir)
        po.pin(child.proc.pid, {ROUTER_CPU})
        ao.wait_ready(child)
        po.pin(child.proc.pid, {ROUTER_CPU})  # threads started since
        return Router(name, policy, child.url, child.proc.pid, lambda: ao.stop_all([child]))
    p = po.start_proxy(name, node_urls, logdir=logdir, peers_root=peers_root, cpu=ROUTER_CPU)
    return Router(name, p.policy, p.url, p.pid, p.stop)


def run_wrk(
    url: str,
    *,
    script: Path,
    model: str,
    stream: bool,
    duration_s: float,
    connections: int,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One wrk run against ``url``: its ``WRK_JSON`` result; ``env``: more for the script."""
    env = {
        **os.environ,
        **(env or {}),
        "BENCH_MODEL": model,
        "BENCH_STREAM": "1" if stream else "0",
    }
    argv = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{connections}",
            f"-d{duration_s:g}s", "--timeout", "5s", "-s", str(script), url]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=duration_s + 30)
    for line in out.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            result: dict[str, Any] = json.loads(line.removeprefix("WRK_JSON "))
            return result
    raise SystemExit(f"wrk printed no result (exit {out.returncode}):\n{out.stdout}{out.stderr}")


def measure(
    router: Router, *, stream: bool, args: argparse.Namespace, script: Path
) -> dict[str, Any]:
    cpu0 = po.tree_cpu_s(router.pid)
    t0 = time.perf_counter()
    res = run_wrk(
        router.url,
        script=script,
        model=args.model,
        stream=stream,
        duration_s=args.duration_s,
        connections=args.connections,
    )
    elapsed = time.perf_counter() - t0
    cpu = po.tree_cpu_s(router.pid) - cpu0
    n = res["requests"]
    wrk_s = res["duration_us"] / 1e6
    net = cpu - router.idle_cpu_per_s * elapsed
    return {
        "router": router.name,
        "mode": "stream" if stream else "plain",
        "requests": n,
        "errors": res["status_errors"] + res["socket_errors"],
        "requests_per_s": n / wrk_s,
        "cpu_s": cpu,
        "core_busy": cpu / elapsed,
        "cpu_us_per_request": net / n * 1e6 if n else None,
        "latency_p50_ms": res["p50_us"] / 1000,
        "latency_p99_ms": res["p99_us"] / 1000,
    }


async def _serving(urls: Sequence[str], model_from: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(model_from + "/v1/models") as resp:
            model: str = (await resp.json())["data"][0]["id"]
        for url in urls:
            await ao.wait_serving(session, url, model=model, timeout_s=60)
    return model


def idle_rates(routers: Sequence[Router], seconds: float) -> None:
    c0 = {r.name: po.tree_cpu_s(r.pid) for r in routers}
    t0 = time.perf_counter()
    time.sleep(seconds)
    dt = time.perf_counter() - t0
    for r in routers:
        r.idle_cpu_per_s = (po.tree_cpu_s(r.pid) - c0[r.name]) / dt


def summarise(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    names = list(dict.fromkeys(r["router"] for r in runs))  # in the order they were given
    keys = sorted(
        {(r["router"], r["mode"], r["prompt_words"]) for r in runs},
        key=lambda k: (k[2], names.index(k[0]), k[1]),
    )
    for router, mode, words in keys:
        rs = [
            r for r in runs if (r["router"], r["mode"], r["prompt_words"]) == (router, mode, words)
        ]
        cpu = [r["cpu_us_per_request"] for r in rs if r["cpu_us_per_request"] is not None]
        out.append(
            {
                "router": router,
                "prompt_words": words,
                "mode": mode,
                "repeats": len(rs),
                "cpu_us_median": statistics.median(cpu),
                "cpu_us_min": min(cpu),
                "cpu_us_max": max(cpu),
                "requests_per_s_median": statistics.median(r["requests_per_s"] for r in rs),
                "core_busy_median": statistics.median(r["core_busy"] for r in rs),
                "latency_p50_ms_median": statistics.median(r["latency_p50_ms"] for r in rs),
                "latency_p99_ms_median": statistics.median(r["latency_p99_ms"] for r in rs),
                "errors": sum(r["errors"] for r in rs),
            }
        )
    return out


def table(summary: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| system prompt words | router | mode | CPU µs/request, median (range) | requests/s "
        "| router core busy | latency p50 / p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['prompt_words']} | {s['router']} | {s['mode']} | {s['cpu_us_median']:.0f} "
            f"({s['cpu_us_min']:.0f}-{s['cpu_us_max']:.0f}) | {s['requests_per_s_median']:.0f} "
            f"| {s['core_busy_median']:.0%} | {s['latency_p50_ms_median']:.2f} / "
            f"{s['latency_p99_ms_median']:.2f} | {s['errors']} |"
        )
    return lines


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or ``None`` (said once) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt


def plot_sweep(summary: Sequence[dict[str, Any]], subtitle: str, path: Path) -> None:
    """CPU per request against the system prompt's length, a line per router and mode."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colours = plt.get_cmap("tab10").colors
    for i, router in enumerate(dict.fromkeys(s["router"] for s in summary)):
        for mode, style in zip(MODES, ("-", "--"), strict=True):  # a router's colour, a mode's line
            pts = sorted((s["prompt_words"], s["cpu_us_median"]) for s in summary
                         if s["router"] == router and s["mode"] == mode)  # fmt: skip
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                    color=colours[i % len(colours)], label=f"{router} {mode}")  # fmt: skip
    ax.set_xlabel("words of the shared system prompt (plus a ~22-token question)")
    ax.set_ylabel("CPU per request (µs), median of repeats")
    ax.set_title(f"Router CPU per request by prompt length\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def plot(summary: Sequence[dict[str, Any]], subtitle: str, path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    routers = list(dict.fromkeys(s["router"] for s in summary))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.38
    for k, mode in enumerate(MODES):
        rows = {s["router"]: s for s in summary if s["mode"] == mode}
        xs = [i + (k - 0.5) * width for i, r in enumerate(routers) if r in rows]
        med = [rows[r]["cpu_us_median"] for r in routers if r in rows]
        err = [
            [rows[r]["cpu_us_median"] - rows[r]["cpu_us_min"] for r in routers if r in rows],
            [rows[r]["cpu_us_max"] - rows[r]["cpu_us_median"] for r in routers if r in rows],
        ]
        bars = ax.bar(xs, med, width, yerr=err, capsize=3, label=mode)
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax.set_xticks(range(len(routers)), routers, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("CPU per request (µs), median of repeats")
    ax.set_title(f"Router CPU per request, saturated by wrk\n{subtitle}", fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat of 5 s")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument(
        "--node-profile",
        default="cpu-tiny",
        help="the simulated nodes' profile: cpu-tiny (512-token context) by default, "
        "h100-llama3-8b (8,192) for the prompt-length sweep",
    )
    parser.add_argument(
        "--prompt-words",
        default="0",
        help="a shared system prompt of this many words before the short question (0: none); "
        "a list (0,500,2000,8000) is the prompt-length sweep, in router_cpu_prompts.*",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--peers-root", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.duration_s, args.idle_s = 1, 5.0, 2.0
    names = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = sorted(n for n in set(names) - set(ROUTERS) if not n.startswith("meridian@"))
    if unknown:
        parser.error(f"unknown routers {unknown}; valid: {', '.join(ROUTERS)}")
    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install wrk util-linux")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores: one for the router, one for wrk and the nodes")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="router-cpu-") as tmp:
        logdir = Path(tmp)
        lengths = [int(w) for w in str(args.prompt_words).split(",")]
        scripts = {}
        for words in lengths:
            scripts[words] = logdir / f"chat-{words}.lua"
            scripts[words].write_text(_LUA.replace("SYSTEM_PROMPT", system_prompt(words)))
        nodes = [ao.spawn_node(i, profile=args.node_profile, time_scale=1000, logdir=logdir)
                 for i in range(2)]  # fmt: skip
        routers: list[Router] = []
        try:
            node_urls = [ao.wait_ready(c) for c in nodes]
            for c in nodes:
                po.pin(c.proc.pid, {LOAD_CPU})
            for name in names:
                try:
                    routers.append(
                        start_router(name, node_urls, logdir=logdir, peers_root=args.peers_root)
                    )
                except _peers.PeerError as exc:
                    log(f"skipping {name}: {exc}")
            args.model = asyncio.run(_serving([r.url for r in routers], node_urls[0]))
            idle_rates(routers, args.idle_s)
            for r in routers:
                log(f"{r.name} ({r.policy}) at {r.url}: idle {r.idle_cpu_per_s * 1000:.1f} ms/s")
                for stream in (False, True):  # warm-up, discarded
                    measure(r, stream=stream, args=argparse.Namespace(**{**vars(args),
                            "duration_s": 2.0}), script=scripts[lengths[0]])  # fmt: skip
            runs: list[dict[str, Any]] = []
            for rep, words in itertools.product(range(args.repeats), lengths):
                order = routers[rep % len(routers) :] + routers[: rep % len(routers)]
                for r in order:
                    for stream in (False, True) if rep % 2 == 0 else (True, False):
                        row = measure(r, stream=stream, args=args, script=scripts[words])
                        row["repeat"], row["prompt_words"] = rep, words
                        runs.append(row)
                        log(
                            f"repeat {rep + 1}/{args.repeats} {words} words {r.name} "
                            f"{row['mode']}: "
                            f"{row['cpu_us_per_request']:.0f} µs/request, "
                            f"{row['requests_per_s']:.0f} req/s, core {row['core_busy']:.0%}, "
                            f"p99 {row['latency_p99_ms']:.1f} ms, errors {row['errors']}"
                        )
        finally:
            for r in routers:
                r.stop()
            ao.stop_all(nodes)
    summary = summarise(runs)
    mach = ao.machine()
    subtitle = (
        f"wrk -t1 -c{args.connections} -d{args.duration_s:g}s, {args.repeats} interleaved "
        f"repeats; {mach['cpu_model'] or mach['arch']}, router alone on one core"
    )
    result = {
        "benchmark": "router_cpu",
        "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "machine": mach,
        "idle_cpu_ms_per_s": {r.name: r.idle_cpu_per_s * 1000 for r in routers},
        "runs": runs,
        "summary": summary,
    }
    sweep = lengths != [0]
    name = "router_cpu_prompts" if sweep else "router_cpu"
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    md = [f"# Router CPU per request, saturated ({subtitle})", "", *table(summary), ""]
    (args.out_dir / f"{name}.md").write_text("\n".join(md))
    print("\n".join(table(summary)))
    if len(lengths) > 1:
        plot_sweep(summary, subtitle, args.out_dir / f"{name}.png")
    else:
        plot(summary, subtitle, args.out_dir / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
