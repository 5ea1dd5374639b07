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
node and written whole a moment before: 2 blocks).  And since 2026-12-06 the agent's own path
for such a tail, ``table``: written once to the workers' shared table
(``LoadShare.share_tail`` at the policy's indexed positions), and asked for once a decision by
the deciding worker's policy past its own match (the policy's lookup of
``routing.attach_sibling_tails``, timed on the next prompt of the stream: a new question after
a known head, which the table does not hold).  Each stage is timed over ``--records``
records (``perf_counter``); the reader takes after every 7 records, as one decision would after
a round of its siblings'.  The index fills to its bound (200,000 entries) and evicts in the
longer runs, as a loaded agent's does.  What a worker spends a request at N workers is one
write plus N - 1 reads and inserts through the rings, one write and one lookup with the table.

    python benchmarks/prefix_relay_cost.py [--quick] [--records 40000] [--out-dir DIR]

Writes prefix_relay_cost.json, .md and .png to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import bisect
import json
import platform
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_overhead as ao
import router_cpu as rc

from policies import routing
from policies.model import NodeId
from regional_agent.workers.shared import LoadShare, LoadTable
from regional_agent.workers.siblings import PrefixRelay, PrefixRings, Record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HEAD, TAIL, HEADS, SIBLINGS = 24, 2, 8, 7
NODES = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
WORKERS = (2, 4, 8, 16, 32)
_LABELS = {
    "whole": "whole records, rings (N - 1 reads and inserts)",
    "tail": "tails, rings (N - 1 reads and inserts)",
    "table": "tails, shared table (one write, one lookup)",
}


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


def measure_table(records: int, seed: int) -> dict[str, float]:
    """µs of a tail written to the shared table, and of a decision's lookup there."""
    policy = routing.create("meridian", routing.RoutingConfig())
    ttl_s = routing.RoutingConfig().prefix_ttl_s
    positions = routing.prefix_positions(policy)
    assert positions is not None
    with tempfile.TemporaryDirectory() as tmp:
        table = LoadTable(workers=SIBLINGS + 1, slots=16)
        shares = [
            LoadShare(table, worker=w, lock_file=Path(tmp) / "slots.lock")
            for w in range(SIBLINGS + 1)
        ]
        for share in shares:
            for node in NODES:
                share.slot(node)  # as the pool's views slot every node (under the lock)
    reader = shares[0]

    def lookup(hashes: Sequence[int], at: Sequence[int]) -> tuple[NodeId, int] | None:
        found = reader.deepest_tail(hashes, at, ttl_s)  # WorkerRuntime._deepest_tail
        return None if found is None else (NodeId(found[0]), found[1])

    routing.attach_sibling_tails(policy, lookup)
    rng = random.Random(seed)
    heads = [tuple(rng.getrandbits(64) for _ in range(HEAD)) for _ in range(HEADS)]
    for head in heads:  # the heads went whole through the rings
        for node in NODES:
            policy.observe_relayed([(NodeId(node), 0, head)], now=time.monotonic())
    writing = looking = 0.0
    lookups = 0
    for i in range(records):
        hashes = (*heads[i % HEADS], *(rng.getrandbits(64) for _ in range(TAIL)))
        t0 = time.perf_counter()
        at = positions(len(hashes))  # WorkerRuntime._share_tail
        shares[1 + i % SIBLINGS].share_tail(
            NODES[i % 2], hashes, at[bisect.bisect_left(at, HEAD) :]
        )
        t1 = time.perf_counter()
        writing += t1 - t0
        if i % SIBLINGS == SIBLINGS - 1:  # a decision of the reader's, on a new question
            query = (*heads[(i + 1) % HEADS], *(rng.getrandbits(64) for _ in range(TAIL)))
            t2 = time.perf_counter()
            policy._sibling_tail(query, HEAD)  # type: ignore[attr-defined]
            looking += time.perf_counter() - t2
            lookups += 1
    return {
        "write_us": writing / records * 1e6,
        "read_us": looking / lookups * 1e6,  # a decision's lookup
        "insert_us": 0.0,
    }


def per_request(stages: dict[str, float], workers: int, kind: str = "") -> float:
    """A request's relay cost at ``workers`` workers: its record written once, then read and
    inserted by each sibling; with the table, written once and looked up once."""
    if kind == "table":
        return stages["write_us"] + (stages["read_us"] if workers > 1 else 0.0)
    return stages["write_us"] + (workers - 1) * (stages["read_us"] + stages["insert_us"])


def table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| record | write, µs | read and decode (table: a decision's lookup), µs | insert, µs "
        "| a request at 2 / 4 / 8 / 16 / 32 workers, µs |",
        "|---|---|---|---|---|",
    ]
    for kind, s in result["kinds"].items():
        at = " / ".join(f"{per_request(s, n, kind):.1f}" for n in WORKERS)
        lines.append(
            f"| {kind} | {s['write_us']:.2f} | {s['read_us']:.2f} | {s['insert_us']:.2f} | {at} |"
        )
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    plt = rc._pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (kind, s) in enumerate(result["kinds"].items()):
        ys = [per_request(s, n, kind) for n in WORKERS]
        ax.plot(WORKERS, ys, marker="o", color=f"C{k}", label=_LABELS.get(kind, kind))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(WORKERS, [str(n) for n in WORKERS])
    ax.set_xlabel("workers")
    ax.set_ylabel("relay CPU per request, µs (its write and every read of it)")
    ax.legend(fontsize=8)
    fig.suptitle(
        f"prefix relay per request: whole records, tails through the rings, tails in the "
        f"table\n{result['machine']}",
        fontsize=9,
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
    for kind in ("whole", "tail", "table"):
        kinds[kind] = (
            measure_table(records, args.seed)
            if kind == "table"
            else measure(kind, records, args.seed)
        )
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
