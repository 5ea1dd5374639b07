"""What the workers' prefix relay costs a request, stage by stage, in one process.

Question: of the CPU that N workers spend telling each other where prompts went
(``regional_agent.workers.siblings``), how much is writing a record, reading and decoding a
sibling's, and inserting it into the policy's prefix index, and how much does leaving out the
head the siblings were told of a moment before save?

Set-up: the agent's own classes, one process, no quota: ``PrefixRings`` for 8 workers, 7
writers (``PrefixRelay.send``) and one reader (``PrefixRelay.take``) whose records go into a
``meridian`` policy the way ``WorkerRuntime._records`` puts them (all a take read, in one
``observe_relayed``).  Prompts as in ``workers_throughput.py``: one of 8
system prompts of 24 blocks and 2 blocks of their own, sent to one of 2 nodes.  Two kinds of
record: ``whole`` (nothing matched: 26 blocks) and ``tail`` (the 24-block head matched on the
node and written whole a moment before: 2 blocks).  Each stage is timed over ``--records``
records (``perf_counter``); the reader takes after every 7 records, as one decision would after
a round of its siblings'.  The index fills to its bound (200,000 entries) and evicts in the
longer runs, as a loaded agent's does.  What a worker spends a request at N workers is one
write plus N - 1 reads and inserts.

    python benchmarks/prefix_relay_cost.py [--quick] [--records 40000] [--out-dir DIR]

Writes prefix_relay_cost.json, .md and .png to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_overhead as ao
import router_cpu as rc

from policies import routing
from policies.model import NodeId
from regional_agent.workers.siblings import PrefixRelay, PrefixRings, Record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HEAD, TAIL, HEADS, SIBLINGS = 24, 2, 8, 7
NODES = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")


def measure(kind: str, records: int, seed: int) -> dict[str, float]:
    """µs per record of each stage for ``kind`` (``whole`` or ``tail``) records."""
    rings = PrefixRings(workers=SIBLINGS + 1)
    clock = time.monotonic
    writers = [
        PrefixRelay(rings, worker=w, on_records=lambda _: None, clock=clock)
        for w in range(1, SIBLINGS + 1)
    ]
    policy = routing.create("meridian", routing.RoutingConfig())
    inserting = [0.0]

    def take_in(records: list[Record]) -> None:  # WorkerRuntime._records (every node known)
        t0 = time.perf_counter()
        tails = [(NodeId(node), first, hashes) for node, first, hashes in records]
        policy.observe_relayed(tails, now=clock())
        inserting[0] += time.perf_counter() - t0

    reader = PrefixRelay(rings, worker=0, on_records=take_in, clock=clock)
    rng = random.Random(seed)
    heads = [tuple(rng.getrandbits(64) for _ in range(HEAD)) for _ in range(HEADS)]
    matched = HEAD if kind == "tail" else 0
    for w, writer in enumerate(writers):  # each head written whole once per node: then tails
        for head in heads:
            for node in NODES:
                writer.send(node, (*head, w), 0)
                writer.send(node, (*head, w + 1), HEAD)
    reader.take()
    inserting[0] = 0.0
    writing = taking = 0.0
    for i in range(records):
        hashes = (*heads[i % HEADS], *(rng.getrandbits(64) for _ in range(TAIL)))
        t0 = time.perf_counter()
        writers[i % SIBLINGS].send(NODES[i % 2], hashes, matched)
        t1 = time.perf_counter()
        if i % SIBLINGS == SIBLINGS - 1:
            reader.take()
        writing += t1 - t0
        taking += time.perf_counter() - t1
    tails = sum(w.tails for w in writers)
    assert (tails > records * 0.9) if kind == "tail" else tails == 0
    return {
        "write_us": writing / records * 1e6,
        "read_us": (taking - inserting[0]) / records * 1e6,  # reading and decoding
        "insert_us": inserting[0] / records * 1e6,
    }


def per_request(stages: dict[str, float], workers: int) -> float:
    """A request's relay cost at ``workers`` workers: its record written once, then read and
    inserted by each sibling."""
    return stages["write_us"] + (workers - 1) * (stages["read_us"] + stages["insert_us"])


def table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| record | write, µs | read and decode, µs | insert, µs "
        "| a request at 2 / 4 / 8 workers, µs |",
        "|---|---|---|---|---|",
    ]
    for kind, s in result["kinds"].items():
        at = " / ".join(f"{per_request(s, n):.1f}" for n in (2, 4, 8))
        lines.append(
            f"| {kind} | {s['write_us']:.2f} | {s['read_us']:.2f} | {s['insert_us']:.2f} | {at} |"
        )
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    plt = rc._pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    workers = [2, 4, 8]
    width = 0.38
    for k, (kind, s) in enumerate(result["kinds"].items()):
        xs = [i + (k - 0.5) * width for i in range(len(workers))]
        write = [s["write_us"] for _ in workers]
        read = [(n - 1) * s["read_us"] for n in workers]
        insert = [(n - 1) * s["insert_us"] for n in workers]
        ax.bar(xs, write, width, label=f"{kind}: write", color=f"C{3 * k}")
        ax.bar(xs, read, width, bottom=write, label=f"{kind}: read", color=f"C{3 * k + 1}")
        bottom = [a + b for a, b in zip(write, read, strict=True)]
        ax.bar(xs, insert, width, bottom=bottom, label=f"{kind}: insert", color=f"C{3 * k + 2}")
    ax.set_xticks(range(len(workers)), [f"{n} workers" for n in workers])
    ax.set_ylabel("relay CPU per request, µs")
    ax.legend(fontsize=8)
    fig.suptitle(
        f"prefix relay per request, whole records and tails\n{result['machine']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5,000 records a kind")
    parser.add_argument("--records", type=int, default=40_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    records = 5_000 if args.quick else args.records
    kinds = {}
    for kind in ("whole", "tail"):
        kinds[kind] = measure(kind, records, args.seed)
        print(
            f"{kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds[kind].items()), file=sys.stderr
        )
    result = {
        "records": records,
        "machine": f"{ao.machine()['cpu_model']}, Python {platform.python_version()}",
        "kinds": kinds,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "prefix_relay_cost.json").write_text(json.dumps(result, indent=2))
    md = [f"# The prefix relay per request ({records:,} records a kind; {result['machine']})", ""]
    md += table(result)
    (args.out_dir / "prefix_relay_cost.md").write_text("\n".join(md) + "\n")
    plot(result, args.out_dir / "prefix_relay_cost.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
