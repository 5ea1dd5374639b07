"""How long parsing one chat request stalls the agent's event loop: the stand-in tokenizer and
a model's own tokenizer, parsed inline or on the parse thread.

Question: what does a chat prompt of N words cost the event loop, i.e. every other request on
the agent, while the agent parses it (JSON, rendering, tokenising the first
``routing.prefix_max_tokens`` tokens, block hashing), with ``policies.prompt``'s pure-Python
stand-in and with a served model's ``tokenizer.json`` and chat template (``[tokenizer]``,
``regional_agent.prompts``: Rust, which releases the GIL in its batch calls)?

An agent runs in this process (``create_app``, served as ``meridian-agent`` serves it) in front
of one ``meridian-sim node`` process (``h100-llama3-8b``, time scale 1000: it answers at once).
A ticker on the agent's loop sleeps 0.5 ms at a time and records how late it wakes; a client on
another thread (blocking ``http.client``: it waits outside the GIL) sends one chat request at a
time.  Per request, the loop's longest stall from just before the request is sent to its answer
is one sample; each prompt is new (a number first), so nothing comes from the prefix cache,
except in the "shared system prompt" rows, where the N words are the system prompt of every
request and only a short question differs.  "idle" is the same window with no request.  The
prompts are words of this repository's docs/*.md, in order; a "short prompt" row (one
sentence) is the reference for what a long one adds.  The parse CPU time per request
(``handlers._parse_body`` alone, no loop) is given too, and the loop's own CPU per request (the
event-loop thread's CPU clock around each request, in another pass without the ticker).

On two cores or more the loop thread runs alone on the last core and the node process and the
agent's other threads (the parse thread, the client) on core 0, as in a deployment where the
agent has its own cores and the nodes are other machines; ``--no-pin`` leaves them all to the
scheduler (on a 2-core host the node's parse of each forwarded prompt then competes with the
loop, and the stall measures the host as much as the agent).

    python benchmarks/parse_stall.py [--quick] [--words 400,800,2000,3200,12800] [--reps 30]
        [--model-dir tests/fixtures/tiny-llama] [--out-dir benchmarks/results] [--no-pin]

``--model-dir``: a Hugging Face model directory (tokenizer.json, chat_template.jinja or
tokenizer_config.json); the default is the tiny test model's 2,048-token BPE, which makes about
2.3 tokens of an English word (Llama-3's makes 1.3), so it tokenises more than a real model
would.  Writes parse_stall.json and parse_stall.md to the out dir.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agent_overhead as ao  # noqa: E402

from meridian_service import hygiene  # noqa: E402
from regional_agent.app import create_app  # noqa: E402
from regional_agent.edge import EDGE  # noqa: E402
from regional_agent.proxy import handlers  # noqa: E402
from regional_agent.settings import Settings  # noqa: E402

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # what the h100-llama3-8b profile serves
TICK_S = 0.0005


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def words(n: int) -> str:
    text = " ".join((ROOT / "docs" / name).read_text() for name in sorted(
        p.name for p in (ROOT / "docs").glob("*.md")))  # fmt: skip
    found = re.findall(r"\S+", text)
    while len(found) < n:
        found += found
    return " ".join(found[:n])


class Ticker:
    """The loop's lateness: a task that sleeps TICK_S and records how late it wakes."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            self.worst = max(self.worst, time.perf_counter() - due)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def reset(self) -> None:
        self.worst = 0.0

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def _post(port: int, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


async def serve(settings: Settings) -> tuple[web.AppRunner, int, web.Application]:
    app = create_app(settings, seed=0)
    runner = hygiene.runner(app, settings.server.limits(), handler_cancellation=True,
                            access_log=None)  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    return runner, server.sockets[0].getsockname()[1], app  # type: ignore[attr-defined]


async def measure(
    settings: Settings,
    bodies: list[bytes],
    fresh: list[bytes],
    unseen: list[bytes],
    *,
    idle: bool = False,
    pin: bool = False,
) -> tuple[list[float], float, float, int]:
    """The loop's worst stall per request (ms), the parse CPU per request (ms), the loop's CPU
    per request (ms) and the first prompt's tokens as the agent counts them.  ``fresh``: bodies
    not sent, for the parse CPU; ``unseen``: bodies sent without the ticker, for the loop's CPU
    (a body parsed before would come from the prefix cache).  ``pin``: the loop on the last
    core, the agent's other threads (the parse thread, the client) on core 0 with the node."""
    runner, port, app = await serve(settings)
    ticker = Ticker()
    loop = asyncio.get_running_loop()
    loop_clock = time.pthread_getcpuclockid(threading.get_ident())
    everywhere = os.sched_getaffinity(0)
    stalls, loop_cpu = [], []
    try:
        if pin:  # threads started from here on inherit core 0
            os.sched_setaffinity(0, {0})
        await loop.run_in_executor(None, _post, port, bodies[0])  # warm: threads, connections
        if pin:
            os.sched_setaffinity(0, {max(everywhere)})
        ticker.start()
        for body in bodies:
            await asyncio.sleep(0.02)
            ticker.reset()
            if idle:
                await asyncio.sleep(0.01)
            else:
                status = await loop.run_in_executor(None, _post, port, body)
                # 400: the node's, for a prompt past its 8k context (the agent parsed it first)
                assert status in (200, 400), status
            stalls.append(ticker.worst * 1000)
        await ticker.stop()
        for body in unseen:
            await asyncio.sleep(0.005)
            started_cpu = time.clock_gettime(loop_clock)
            if idle:
                await asyncio.sleep(0.002)
            else:
                await loop.run_in_executor(None, _post, port, body)
            loop_cpu.append((time.clock_gettime(loop_clock) - started_cpu) * 1000)
        edge = app[EDGE]
        started = time.process_time()
        for body in fresh:
            handlers._parse_body(body, {}, settings, kind="chat", prompts=edge.prompts)
        cpu_ms = (time.process_time() - started) * 1000 / len(fresh)
        view = handlers._parse_body(bodies[0], {}, settings, kind="chat", prompts=edge.prompts).view
    finally:
        await ticker.stop()
        os.sched_setaffinity(0, everywhere)
        await runner.cleanup()
    return stalls, cpu_ms, statistics.median(loop_cpu), view.prompt_tokens


def chat(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    logdir = Path(tempfile.mkdtemp(prefix="parse-stall-"))
    node = ao.spawn_node(0, profile="h100-llama3-8b", time_scale=1000, logdir=logdir)
    if args.pin:
        os.sched_setaffinity(node.proc.pid, {0})
    rows: list[dict[str, Any]] = []
    try:
        url = ao.wait_ready(node)
        base: dict[str, Any] = {
            "nodes": [{"url": url}],
            "routing": {"policy": "round_robin"},
            "health": {"probe_interval_s": 60.0},  # no probes or scrapes in the windows
            "telemetry": {"scrape_interval_s": 60.0},
        }
        tokenizers: dict[str, dict[str, Any]] = {
            "stand-in": {},
            "model": {"model_dir": str(args.model_dir)},
        }
        nothing = [chat([{"role": "user", "content": "x"}])] * args.reps
        idle, _, idle_cpu, _ = await measure(
            Settings(**base), nothing, nothing, nothing, idle=True, pin=args.pin
        )
        rows.append({"prompt": "idle loop", "words": 0, "tokenizer": "", "where": "",
                     **summary(idle), "parse_cpu_ms": 0.0,
                     "loop_cpu_ms": round(idle_cpu, 3)})  # fmt: skip
        question = "What does the agent do when a node stops answering?"
        kinds: list[tuple[str, int, Callable[[int, str], list[dict[str, str]]]]] = [
            ("short prompt", 0, lambda i, t: [{"role": "user", "content": f"{i} {question}"}]),
        ]
        for n in args.words:
            kinds.append(("new prompt", n, lambda i, t: [{"role": "user", "content": f"{i} {t}"}]))
            if n == args.shared_words:
                kinds.append(("shared system prompt", n, lambda i, t: [
                    {"role": "system", "content": t},
                    {"role": "user", "content": f"question {i}?"},
                ]))  # fmt: skip
        for kind, n, make in kinds:
            text = words(n)
            reps = args.reps
            bodies = [chat(make(i, text)) for i in range(reps)]
            fresh = [chat(make(i, text)) for i in range(reps, 2 * reps + 1)]
            unseen = [chat(make(i, text)) for i in range(2 * reps + 1, 3 * reps + 1)]
            for name, tok in tokenizers.items():
                for where, offload in (("inline", 1 << 30), ("parse thread", 0)):
                    settings = Settings(**base, tokenizer=tok, parse={"offload_min_bytes": offload})
                    stalls, cpu_ms, loop_cpu, tokens = await measure(
                        settings, bodies, fresh, unseen, pin=args.pin
                    )
                    row = {"prompt": kind, "words": n, "bytes": len(bodies[0]),
                           "tokens": tokens, "tokenizer": name, "where": where,
                           **summary(stalls), "parse_cpu_ms": round(cpu_ms, 2),
                           "loop_cpu_ms": round(loop_cpu, 3)}  # fmt: skip
                    rows.append(row)
                    log(json.dumps(row))
    finally:
        ao.stop_all([node])
    return rows


def summary(stalls: list[float]) -> dict[str, float]:
    ordered = sorted(stalls)
    return {
        "stall_median_ms": round(statistics.median(ordered), 2),
        "stall_p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
        "stall_max_ms": round(ordered[-1], 2),
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# The event loop's longest stall while one chat request is parsed",
        "",
        f"benchmarks/parse_stall.py, {args.reps} requests a row, model tokenizer: "
        f"`{args.model_dir}`. Stall: the loop's longest lateness (ms) from sending a request to "
        "its answer; parse CPU: ms per request of `_parse_body` alone; loop CPU: the event "
        "loop thread's CPU ms per request (median; another pass, without the ticker). "
        + (
            "The loop on its own core, the node and the agent's other threads on core 0."
            if args.pin
            else "No pinning."
        ),
        "",
        "| prompt | words | bytes | tokens | tokenizer | parsed | stall median | p90 | max "
        "| parse CPU | loop CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {r['words']} | {r.get('bytes', '')} | {r.get('tokens', '')} | "
            f"{r['tokenizer']} | "
            f"{r['where']} | {r['stall_median_ms']} | {r['stall_p90_ms']} | {r['stall_max_ms']} | "
            f"{r['parse_cpu_ms']} | {r['loop_cpu_ms']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2,000 words only, 10 requests a row")
    p.add_argument("--words", default="400,800,2000,3200,12800")
    p.add_argument("--shared-words", type=int, default=2000)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--model-dir", type=Path, default=ROOT / "tests" / "fixtures" / "tiny-llama")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave every thread to the scheduler (by default, on two cores or more, "
        "the loop has the last core and the node and the agent's other threads "
        "core 0, as an agent with its own cores and the nodes on other machines)",
    )
    args = p.parse_args()
    args.pin = args.pin and len(os.sched_getaffinity(0)) >= 2
    args.words = [int(w) for w in args.words.split(",")]
    if args.quick:
        args.words, args.reps = [2000], 10
    rows = asyncio.run(run(args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "parse_stall.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out_dir / "parse_stall.md").write_text(table(rows, args))
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    logging.getLogger("regional_agent").setLevel(logging.ERROR)  # the open data plane warning
    sys.exit(main())
