"""etcd writes and routing accuracy: flat per-GPU routing tables against group tables.

Question: how many etcd writes per second does sharing a region's routing table cost, and how
often does a request land where its prefix is cached, when the table names one GPU per bucket
(flat) or one group of GPUs per range of buckets (``policies.groups``), at 16, 64 and 256 GPUs,
with agents that see each other's changes only after a staleness window of 100 ms or 1 s?

Region.  N GPUs in groups of 8 and ``--agents`` agent replicas behind an L4 balancer: each
request goes to one of them at random.  Each agent routes by its own view of the table: what
it last read from the store (it reads every window, as a poll or a batched watch would) with
its own changes applied at once.  It publishes its changes through ``groups.Debouncer`` (at
most once per window) to a real etcd under its own lease; etcd counts the revisions.

Tables (``--modes``, ``--in-group``).
``flat``  bucket → GPU.  A bucket not in the agent's view goes to the least-loaded GPU; a known
          one stays unless the load guard (16 requests and 1.5x over the least-loaded GPU, the
          ``prefix_aware`` defaults) moves it.  One key per entry that changes, in transactions
          of at most 128 keys, last writer wins (entries of one bucket cannot overlap).
``group`` bucket ranges → group: ``groups.assign`` (8 points per group, loads bounded at
          1.25x), published once at time 0 ("setup", reported apart).  The group guard
          (``--group-guard`` requests per GPU over the least-loaded group's mean, and 1.5x)
          moves a bucket to the least-loaded group; one key per range that changes, in one
          transaction that compares the mod revision of each key (a conflict: read, redo,
          retry).  Inside the group the agent picks the GPU with no shared state: ``hash``
          (``groups.choose_member``) = the GPU it last sent this prefix to, else the first in
          rendezvous order of the prefix key that the 16-request guard allows; ``least-load`` =
          the GPU it last sent this prefix to, else the least-loaded member (what
          ``prefix_aware`` does when its own index has no match).

Workload.  The Mooncake conversation trace (``--trace``), in virtual time.  Its timestamps come
in 3 s steps; each request is spread uniformly over its step.  Trace time runs ``--speedups``
times faster (1: real think times between turns, median about 2 minutes).  The trace is cut
into windows of ``--duration-s`` x speedup seconds (shorter runs when the trace has less), each
replayed from time 0 with its own block ids (block 0 stays shared by all), and windows are
stacked, rotated in time when used again, until the region gets ``--rate-per-gpu`` requests/s
per GPU; the last window is thinned by conversation.  The prefix key is the first 2 blocks
(1,024 tokens), hashed into 16,384 buckets.

Ground truth.  Each GPU's prefix cache is an LRU of 512-token blocks, 868 per GPU (an H100 with
Llama-3-8B holds 27,793 blocks of 16 tokens in a real vLLM log: 444,688 tokens).  A
request's blocks are cached on its GPU when it arrives, deepest first, so a prompt's first
blocks go last (vLLM frees blocks in reverse).  A request occupies its GPU for 30 ms + 250 µs
per uncached prompt token + 12 ms per output token (llm-d's simulator, 8B on H100); "load" is
requests in flight, and every agent sees it exactly.  A request is *warm* when some GPU holds
at least its first two blocks (every request shares block 0); *accuracy* is the share of warm
requests sent to a GPU that holds the longest cached prefix any GPU holds (*group accuracy*: to
a group that holds it); *block recall* is the cached leading blocks used over those available;
*stale views* are requests whose agent's entry for the bucket differed from the latest any agent
had made; *load joined* is the requests in flight on the GPU a request joined (mean / p99).

    python benchmarks/group_tables.py
        [--trace data/workloads/mooncake_conversation_trace.jsonl]
        [--gpus 16,64,256] [--windows-s 0.1,1] [--speedups 1,10,100] [--modes flat,group]
        [--in-group hash,least-load] [--agents 2] [--rate-per-gpu 1] [--duration-s 120]
        [--group-guard 8] [--etcd URL] [--out-dir DIR]

Writes ``group_tables.json``, ``group_tables.md`` and ``group_tables.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import meridian_etcd  # noqa: E402
from meridian_wire import keys  # noqa: E402
from policies import groups  # noqa: E402
from policies.groups import Debouncer, GroupId, Guard, Range, Table  # noqa: E402
from policies.model import NodeId  # noqa: E402

DEFAULT_TRACE = ROOT / "data" / "workloads" / "mooncake_conversation_trace.jsonl"

BLOCK_TOKENS = 512
GPU_CACHE_BLOCKS = 868  # 27,793 x 16 tokens / 512
TTFT_BASE_S = 0.030
PREFILL_S_PER_TOKEN = 250e-6
ITL_S = 0.012
GROUP_SIZE = 8
N_BUCKETS = groups.DEFAULT_BUCKETS
KEY_BLOCKS = groups.DEFAULT_KEY_BLOCKS
WARM_BLOCKS = 2  # a request is warm when some GPU holds at least this many of its first blocks
GPU_GUARD = Guard(abs_threshold=16, rel_threshold=1.5)  # routing.RoutingConfig's defaults
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
TRACE_STEP_MS = 3000  # the Mooncake trace's timestamps are multiples of about 3 s


# -- workload -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    t: float
    blocks: tuple[int, ...]  # chained block keys, distinct per stacked window
    input_tokens: int
    output_tokens: int
    key: int  # groups.prefix_key of the blocks
    bucket: int


def read_trace(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    if not rows or "hash_ids" not in rows[0]:
        raise SystemExit(f"{path}: expected Mooncake JSON lines with timestamp and hash_ids")
    return rows


def build_workload(
    rows: list[dict[str, Any]],
    *,
    target: int,
    duration_s: float,
    speedup: float,
    seed: int,
) -> list[Request]:
    """``target`` requests over ``duration_s`` from stacked windows of the trace."""
    rng = random.Random(seed)
    span_ms = duration_s * speedup * 1000  # trace time per window
    # The trace's timestamps come in steps of 3 s; spread each request over its step.
    stamped = sorted(
        ({**r, "timestamp": r["timestamp"] + rng.uniform(0, TRACE_STEP_MS)} for r in rows),
        key=lambda r: float(r["timestamp"]),
    )
    end_ms = max(r["timestamp"] for r in stamped)
    n_windows = max(1, round(end_ms / span_ms))
    windows: list[list[dict[str, Any]]] = [[] for _ in range(n_windows)]
    for r in stamped:
        w = int(r["timestamp"] // span_ms)
        if w < n_windows:
            windows[w].append(r)
    out: list[Request] = []
    copy = 0
    while len(out) < target:
        window = windows[copy % n_windows]
        # a window used again is rotated in time (wrapping) so repeats do not burst together
        shift = 0.0 if copy < n_windows else rng.uniform(0, duration_s)
        # the last window needed is thinned by conversation (prefix key), not by request
        keep = min(1.0, (target - len(out)) / max(1, len(window)))
        for r in window:
            t = ((r["timestamp"] - (copy % n_windows) * span_ms) / 1000 / speedup + shift) % (
                duration_s
            )
            ids = r["hash_ids"]
            chained = [ids[0]]  # block 0: the prefix every request shares
            for i in ids[1:]:
                chained.append(hash((chained[-1], copy, i)))
            blocks = tuple(chained)
            key = groups.prefix_key(blocks, key_blocks=KEY_BLOCKS)
            assert key is not None
            if keep < 1.0 and key % 100_000 >= keep * 100_000:
                continue
            out.append(
                Request(
                    t=t,
                    blocks=blocks,
                    input_tokens=int(r["input_length"]),
                    output_tokens=int(r["output_length"]),
                    key=key,
                    bucket=groups.bucket_of(key, n_buckets=N_BUCKETS),
                )
            )
        copy += 1
    out.sort(key=lambda q: q.t)
    return out


# -- the store ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Txn:
    """One successful publish, as every reader later sees it (a watch event, in effect)."""

    at: float
    agent: str
    rev: int
    deleted: tuple[Range, ...]  # the ranges whose keys it deleted, as they were
    puts: tuple[Range, ...]


class Writer:
    """Publishes diffs to etcd and counts what etcd did.

    With ``expect`` (group tables), one transaction whose compares require every key it puts or
    deletes to be at the mod revision the agent last saw (0: absent), so that stored ranges never
    overlap; without (flat tables, where keys cannot overlap), transactions of at most
    MAX_TXN_OPS keys, last writer wins.  The model is etcd's only writer, so it knows the
    revision each successful transaction makes; run_one checks the count against etcd's own.
    """

    def __init__(self, client: meridian_etcd.Store, region: str, mode: str, *, rev: int) -> None:
        self.client = client
        self.prefix = keys.groups(region) if mode == "group" else f"{keys.ROUTING}{region}/gpus/"
        self.rev = rev
        self.revisions = 0
        self.keys = 0
        self.bytes = 0
        self.conflicts = 0

    def key(self, first: int) -> str:
        return f"{self.prefix}prefix-{first:05d}"

    async def write(
        self,
        change: groups.Diff,
        *,
        lease: meridian_etcd.Lease,
        agent: str,
        at: float,
        expect: dict[int, int] | None,
    ) -> int | None:
        """The revision the change made, or None when a compare failed (nothing written)."""
        puts: list[tuple[str, bytes]] = []
        size = 0
        for r in change.puts:
            key = self.key(r.first)
            value = json.dumps(
                {"first": r.first, "end": r.end, "owner": r.owner, "agent": agent, "at": at},
                separators=(",", ":"),
            ).encode()
            puts.append((key, value))
            size += len(key) + len(value)
        deletes = [self.key(first) for first in change.deletes]
        size += sum(len(k) for k in deletes)
        n_ops = len(puts) + len(deletes)
        if expect is not None:
            if n_ops > MAX_TXN_OPS:
                raise SystemExit(f"a group diff of {n_ops} keys: more than one transaction")
            made = await self.client.commit(
                puts=puts,
                deletes=deletes,
                expect={self.key(k): rev for k, rev in expect.items()},
                lease=lease,
            )
            if made is None:
                self.conflicts += 1
                return None
            chunks = 1
        else:
            ops: list[tuple[str, bytes] | str] = [*puts, *deletes]
            chunks = 0
            for i in range(0, len(ops), MAX_TXN_OPS):
                chunk = ops[i : i + MAX_TXN_OPS]
                await self.client.commit(
                    puts=[op for op in chunk if isinstance(op, tuple)],
                    deletes=[op for op in chunk if isinstance(op, str)],
                    lease=lease,
                )
                chunks += 1
        self.rev += chunks
        self.revisions += chunks
        self.keys += n_ops
        self.bytes += size
        return self.rev


async def revision(client: meridian_etcd.Store, marker: str) -> int:
    """The store's revision after one write of ``marker`` (that write is the revision)."""
    return await client.put(marker, b"")


# -- the region ---------------------------------------------------------------------------------


@dataclass
class Agent:
    name: str
    lease: meridian_etcd.Lease
    debouncer: Debouncer
    known: dict[int, Range] = field(default_factory=dict)  # the store, as this agent last saw it
    revs: dict[int, int] = field(default_factory=dict)  # group mode: their mod revisions
    flat: dict[int, Range] = field(default_factory=dict)  # flat mode: the view
    table: Table | None = None  # group mode: the view
    pending: list[tuple[int, int, str]] = field(default_factory=list)  # group moves unpublished
    memory: dict[int, NodeId] = field(default_factory=dict)  # prefix key → GPU it last chose
    cursor: int = 0  # transactions read
    flush_queued: bool = False


@dataclass
class Stats:
    requests: int = 0
    warm: int = 0
    gpu_hits: int = 0
    group_hits: int = 0
    recall_num: int = 0
    recall_den: int = 0
    moves: int = 0
    stale: int = 0
    new_entries: int = 0
    joined: list[int] = field(default_factory=list)  # requests in flight on the GPU it joined


class Region:
    def __init__(
        self,
        *,
        n_gpus: int,
        mode: str,
        in_group: str,
        window_s: float,
        n_agents: int,
        writer: Writer,
        leases: Sequence[meridian_etcd.Lease],
        group_guard: Guard,
        seed: int,
    ) -> None:
        self.mode, self.in_group, self.window_s = mode, in_group, window_s
        self.writer = writer
        self.group_guard = group_guard
        self.rng = random.Random(seed)
        self.gpus = [NodeId(f"gpu{i:03d}") for i in range(n_gpus)]
        self.groups = groups.partition(self.gpus, group_size=GROUP_SIZE)
        self.group_of = {g: grp for grp, members in self.groups.items() for g in members}
        self.inflight: dict[NodeId, float] = dict.fromkeys(self.gpus, 0.0)
        self.group_sum: dict[GroupId, float] = dict.fromkeys(self.groups, 0.0)
        self.group_load: dict[GroupId, float] = dict.fromkeys(self.groups, 0.0)
        self.finishing: list[tuple[float, NodeId]] = []
        self.cache: dict[NodeId, OrderedDict[int, None]] = {g: OrderedDict() for g in self.gpus}
        self.holders: dict[int, set[NodeId]] = {}
        self.base = groups.assign(list(self.groups), n_buckets=N_BUCKETS)
        self.truth: dict[int, str] = {}  # the latest owner any agent gave each bucket
        self.stored: dict[int, Range] = {}  # what etcd holds
        self.txns: list[Txn] = []
        self.agents = [
            Agent(name=f"a{i}", lease=leases[i], debouncer=Debouncer(window_s=window_s))
            for i in range(n_agents)
        ]
        self.events: list[tuple[float, int, str, int]] = []
        self.event_seq = 0
        for i in range(n_agents):
            self._push(self.rng.uniform(0, window_s), "read", i)
        self.stats = Stats()
        self.setup_revisions = 0
        self.setup_keys = 0

    def _push(self, at: float, kind: str, agent: int) -> None:
        self.event_seq += 1
        heapq.heappush(self.events, (at, self.event_seq, kind, agent))

    async def setup(self) -> None:
        """Group mode: the first agent publishes the assignment; every agent starts from it."""
        if self.mode != "group":
            return
        first = self.agents[0]
        change = groups.diff({}, self.base.entries())
        rev = await self.writer.write(
            change, lease=first.lease, agent=first.name, at=0.0, expect=None
        )
        assert rev is not None
        self.setup_revisions, self.setup_keys = self.writer.revisions, self.writer.keys
        self.stored = self.base.entries()
        for a in self.agents:
            a.known = dict(self.stored)
            a.revs = dict.fromkeys(self.stored, rev)  # chunks: later ones are newer; harmless
            a.table = self.base
        # the chunks made revisions rev - chunks + 1 .. rev; the compares need each key's own
        chunk_revs = range(rev - self.setup_revisions + 1, rev + 1)
        for i, r in enumerate(change.puts):
            for a in self.agents:
                a.revs[r.first] = chunk_revs[i // MAX_TXN_OPS]

    async def _flush(self, agent: Agent, now: float) -> None:
        attempts = 0
        while True:
            if self.mode == "flat":
                view = agent.flat
            else:
                assert agent.table is not None
                view = agent.table.entries()
            debouncer, change = agent.debouncer.flush(agent.known, view, now=now)
            if change.empty:
                agent.debouncer = debouncer
                return
            expect = None
            if self.mode == "group":
                touched = [r.first for r in change.puts] + list(change.deletes)
                expect = {k: agent.revs.get(k, 0) for k in touched}
            rev = await self.writer.write(
                change, lease=agent.lease, agent=agent.name, at=round(now, 3), expect=expect
            )
            if rev is None:  # another agent changed these ranges: read, redo the moves, retry
                attempts += 1
                if attempts > 3:
                    raise SystemExit(f"agent {agent.name}: compares failed {attempts} times")
                self._read(agent)
                continue
            agent.debouncer = debouncer
            deleted = tuple(self.stored[k] for k in change.deletes)
            for k in change.deletes:
                del self.stored[k]
            for r in change.puts:
                self.stored[r.first] = r
            self.txns.append(
                Txn(at=now, agent=agent.name, rev=rev, deleted=deleted, puts=change.puts)
            )
            agent.pending.clear()
            return

    def _read(self, agent: Agent) -> None:
        """Catch up with every transaction since the last read (what a watch would deliver)."""
        news = self.txns[agent.cursor :]
        agent.cursor = len(self.txns)
        if not news:
            return
        table = agent.table
        for txn in news:
            for r in txn.deleted:
                agent.known.pop(r.first, None)
                agent.revs.pop(r.first, None)
                if table is not None:  # its buckets fall back to the assignment
                    for b in self.base.ranges:
                        lo, hi = max(b.first, r.first), min(b.end, r.end)
                        if lo < hi:
                            table = table.reassign(lo, hi, b.owner)
            for r in txn.puts:
                agent.known[r.first] = r
                agent.revs[r.first] = txn.rev
                if table is not None:
                    if r.owner in self.groups:
                        table = table.reassign(r.first, r.end, r.owner)
                elif r.first not in agent.debouncer.dirty:
                    agent.flat[r.first] = r
        if table is not None:
            touched: set[int] = set()
            for first, end, owner in agent.pending:  # its own unpublished moves stay on top
                touched |= table.keys_around(first, end)
                table = table.reassign(first, end, owner)
                touched |= table.keys_around(first, end)
            agent.table = table
            agent.debouncer = agent.debouncer.touch(touched)

    async def advance(self, now: float) -> None:
        """Run every read and publish due at or before ``now``, in time order."""
        while self.events and self.events[0][0] <= now:
            at, _, kind, i = heapq.heappop(self.events)
            agent = self.agents[i]
            if kind == "read":
                self._read(agent)
                self._push(at + self.window_s, "read", i)
            else:
                agent.flush_queued = False
                await self._flush(agent, at)
        while self.finishing and self.finishing[0][0] <= now:
            _, gpu = heapq.heappop(self.finishing)
            self._load(gpu, -1)

    def _load(self, gpu: NodeId, delta: int) -> None:
        self.inflight[gpu] += delta
        grp = self.group_of[gpu]
        self.group_sum[grp] += delta
        self.group_load[grp] = self.group_sum[grp] / len(self.groups[grp])

    async def route(self, req: Request) -> None:
        await self.advance(req.t)
        i = self.rng.randrange(len(self.agents))
        agent = self.agents[i]
        best, holding = self._best(req.blocks)
        route = self._route_flat if self.mode == "flat" else self._route_group
        gpu = route(agent, req)
        s = self.stats
        s.requests += 1
        depth = self._depth(gpu, req.blocks)
        if best >= WARM_BLOCKS:
            s.warm += 1
            s.gpu_hits += gpu in holding
            s.group_hits += any(m in holding for m in self.groups[self.group_of[gpu]])
            s.recall_num += depth
            s.recall_den += best
        s.joined.append(round(self.inflight[gpu]))
        self._cache(gpu, req.blocks)
        uncached = max(0, req.input_tokens - BLOCK_TOKENS * depth)
        service_s = TTFT_BASE_S + PREFILL_S_PER_TOKEN * uncached + ITL_S * req.output_tokens
        heapq.heappush(self.finishing, (req.t + service_s, gpu))
        self._load(gpu, +1)
        due = agent.debouncer.due_at()
        if due is not None and not agent.flush_queued:
            if due <= req.t:
                await self._flush(agent, req.t)
            else:
                agent.flush_queued = True
                self._push(due, "flush", i)

    def _route_flat(self, agent: Agent, req: Request) -> NodeId:
        entry = agent.flat.get(req.bucket)
        current = None if entry is None else NodeId(entry.owner)
        self.stats.stale += self.truth.get(req.bucket) != current
        choice = groups.choose(current, self.inflight, guard=GPU_GUARD, rng=self.rng)
        gpu = NodeId(choice.owner)
        if choice.changed:
            self.stats.moves += current is not None
            self.stats.new_entries += current is None
            agent.flat[req.bucket] = groups.flat_entry(req.bucket, gpu)
            agent.debouncer = agent.debouncer.touch((req.bucket,))
            self.truth[req.bucket] = gpu
        return gpu

    def _route_group(self, agent: Agent, req: Request) -> NodeId:
        table = agent.table
        assert table is not None
        b = req.bucket
        home = table.lookup(b)
        self.stats.stale += self.truth.get(b, self.base.lookup(b)) != home
        choice = groups.choose(home, self.group_load, guard=self.group_guard, rng=self.rng)
        grp = GroupId(choice.owner)
        if choice.changed:
            self.stats.moves += 1
            moved = table.reassign(b, b + 1, grp)
            touched = table.keys_around(b, b + 1) | moved.keys_around(b, b + 1)
            agent.table = moved
            agent.pending.append((b, b + 1, grp))
            agent.debouncer = agent.debouncer.touch(touched)
            self.truth[b] = grp
        loads = {m: self.inflight[m] for m in self.groups[grp]}
        remembered = agent.memory.get(req.key)
        if self.in_group == "hash":
            gpu = NodeId(
                groups.choose_member(req.key, loads, remembered=remembered, guard=GPU_GUARD).owner
            )
        else:
            least = min(loads.values())
            if remembered in loads and not GPU_GUARD.too_busy(loads[remembered], least):
                gpu = remembered
            else:
                gpu = self.rng.choice(sorted(m for m, v in loads.items() if v == least))
        agent.memory[req.key] = gpu
        return gpu

    # ground truth: each GPU's prefix cache

    def _best(self, blocks: tuple[int, ...]) -> tuple[int, set[NodeId]]:
        """The longest leading run of ``blocks`` any GPU holds, and the GPUs that hold it."""
        holding = self.holders.get(blocks[0])
        if not holding:
            return 0, set()
        depth = 1
        for k in blocks[1:]:
            here = self.holders.get(k)
            if not here:
                break
            both = holding & here
            if not both:
                break
            holding, depth = both, depth + 1
        return depth, holding

    def _depth(self, gpu: NodeId, blocks: tuple[int, ...]) -> int:
        cache = self.cache[gpu]
        n = 0
        for k in blocks:
            if k not in cache:
                break
            n += 1
        return n

    def _cache(self, gpu: NodeId, blocks: tuple[int, ...]) -> None:
        cache = self.cache[gpu]
        for k in reversed(blocks):  # deepest first: the first blocks end up most recent
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
                self.holders.setdefault(k, set()).add(gpu)
        while len(cache) > GPU_CACHE_BLOCKS:
            k, _ = cache.popitem(last=False)
            holders = self.holders[k]
            holders.discard(gpu)
            if not holders:
                del self.holders[k]

    async def finish(self, end: float) -> None:
        await self.advance(end)
        for agent in self.agents:  # publish what is still pending
            due = agent.debouncer.due_at()
            if due is not None:
                await self._flush(agent, max(end, due))


# -- one scenario -------------------------------------------------------------------------------


async def run_one(
    client: meridian_etcd.Store,
    workload: list[Request],
    *,
    n_gpus: int,
    mode: str,
    in_group: str,
    window_s: float,
    speedup: float,
    n_agents: int,
    duration_s: float,
    group_guard: Guard,
    seed: int,
) -> dict[str, Any]:
    started = time.perf_counter()
    label = mode if mode == "flat" else f"group-{in_group}"
    region = f"bench-{label}-n{n_gpus}-w{round(window_s * 1000)}-x{speedup:g}".replace(".", "p")
    leases = [await client.grant(ttl_s=3600) for _ in range(n_agents)]
    marker = f"{keys.PREFIX}bench/{region}/marker"
    rev0 = await revision(client, marker)
    writer = Writer(client, region, mode, rev=rev0)
    sim = Region(
        n_gpus=n_gpus,
        mode=mode,
        in_group=in_group,
        window_s=window_s,
        n_agents=n_agents,
        writer=writer,
        leases=leases,
        group_guard=group_guard,
        seed=seed,
    )
    await sim.setup()
    for req in workload:
        await sim.route(req)
    await sim.finish(duration_s)
    rev1 = await revision(client, marker)
    revisions = rev1 - rev0 - 1
    if revisions != writer.revisions:
        raise SystemExit(f"{region}: etcd made {revisions} revisions, the model {writer.revisions}")
    stored = (await client.get_prefix(writer.prefix)).entries
    table_keys = 0
    table_bytes = 0
    owners: dict[int, str] = {}
    for kv in stored:
        table_keys += 1
        table_bytes += len(kv.key) + len(kv.value)
        value = json.loads(kv.value)
        owners[value["first"]] = value["owner"]
    if owners != {k: r.owner for k, r in sim.stored.items()}:
        raise SystemExit(f"{region}: etcd holds a table other than the one the model wrote")
    if mode == "group":  # compare-and-swap kept the stored ranges apart
        spans = sorted((r.first, r.end) for r in sim.stored.values())
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            raise SystemExit(f"{region}: stored ranges overlap")
    for agent in sim.agents:  # every agent, having read everything, sees the stored table
        sim._read(agent)
        if mode == "flat":
            same = agent.flat == sim.stored
        else:
            same = agent.table == sim.base.paint(sim.stored.values(), allowed=sim.groups)
        if not same:
            raise SystemExit(f"{region}: agent {agent.name} reads another table than etcd holds")
    for lease in leases:
        await client.revoke(lease)
    s = sim.stats
    steady_revisions = writer.revisions - sim.setup_revisions
    steady_keys = writer.keys - sim.setup_keys
    acc = s.gpu_hits / s.warm if s.warm else float("nan")
    return {
        "mode": mode,
        "in_group": in_group if mode == "group" else None,
        "label": label,
        "gpus": n_gpus,
        "groups": len(sim.groups),
        "window_s": window_s,
        "speedup": speedup,
        "agents": n_agents,
        "requests": s.requests,
        "duration_s": duration_s,
        "requests_per_s": s.requests / duration_s,
        "revisions": steady_revisions,
        "revisions_per_s": steady_revisions / duration_s,
        "keys_written": steady_keys,
        "keys_per_s": steady_keys / duration_s,
        "bytes_written": writer.bytes,
        "kib_per_s": writer.bytes / 1024 / duration_s,
        "setup_revisions": sim.setup_revisions,
        "setup_keys": sim.setup_keys,
        "table_keys": table_keys,
        "table_bytes": table_bytes,
        "warm_requests": s.warm,
        "warm_share": s.warm / s.requests,
        "gpu_accuracy": acc,
        "group_accuracy": s.group_hits / s.warm if s.warm and mode == "group" else None,
        "all_requests_accuracy": 1 - (s.warm - s.gpu_hits) / s.requests,
        "block_recall": s.recall_num / s.recall_den if s.recall_den else float("nan"),
        "moves": s.moves,
        "conflicts": writer.conflicts,
        "new_entries": s.new_entries,
        "stale_lookups": s.stale,
        "joined_load_mean": statistics.fmean(s.joined),
        "joined_load_p99": sorted(s.joined)[int(0.99 * (len(s.joined) - 1))],
        "stale_share": s.stale / s.requests,
        "wall_s": time.perf_counter() - started,
    }


async def run_all(args: argparse.Namespace, rows: list[dict[str, Any]], url: str) -> list[Any]:
    out: list[dict[str, Any]] = []
    plan = [
        (n, s, w, mode, ig)
        for s in args.speedups
        for n in args.gpus
        for w in args.windows_s
        for mode in args.modes
        for ig in (args.in_group if mode == "group" else ["-"])
    ]
    client = meridian_etcd.Store(meridian_etcd.ClientConfig(endpoints=[url], timeout_s=30.0))
    try:
        workloads: dict[tuple[int, float], list[Request]] = {}
        trace_s = max(r["timestamp"] for r in rows) / 1000 + TRACE_STEP_MS / 1000
        for i, (n, s, w, mode, ig) in enumerate(plan, 1):
            duration_s = min(args.duration_s, trace_s / s)  # a window fits in the trace
            if (n, s) not in workloads:
                workloads.clear()
                t0 = time.perf_counter()
                workloads[(n, s)] = build_workload(
                    rows,
                    target=round(n * args.rate_per_gpu * duration_s),
                    duration_s=duration_s,
                    speedup=s,
                    seed=args.seed,
                )
                print(
                    f"workload: {n} GPUs, trace time x{s:g}: {len(workloads[(n, s)])} requests "
                    f"over {duration_s:.0f} s ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
            row = await run_one(
                client,
                workloads[(n, s)],
                n_gpus=n,
                mode=mode,
                in_group=ig,
                window_s=w,
                speedup=s,
                n_agents=args.agents,
                duration_s=duration_s,
                group_guard=Guard(abs_threshold=args.group_guard, rel_threshold=1.5),
                seed=args.seed,
            )
            out.append(row)
            ga = row["group_accuracy"]
            print(
                f"[{i}/{len(plan)}] x{s:g} {n:>3} GPUs window {w * 1000:>4.0f} ms "
                f"{row['label']:<16} {row['revisions_per_s']:7.1f} rev/s "
                f"{row['keys_per_s']:7.1f} keys/s  table {row['table_keys']:>5} keys  "
                f"accuracy {row['gpu_accuracy'] * 100:5.1f} %"
                + (f" (group {ga * 100:5.1f} %)" if ga is not None else "")
                + f"  stale {row['stale_share'] * 100:4.1f} %  ({row['wall_s']:.1f} s)",
                flush=True,
            )
    finally:
        await client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSON lines")
    parser.add_argument("--gpus", default="16,64,256", help="GPUs in the region")
    parser.add_argument("--windows-s", default="0.1,1", help="staleness windows, seconds")
    parser.add_argument(
        "--speedups", default="1,10,100", help="trace time compression: 1 keeps real think times"
    )
    parser.add_argument("--modes", default="flat,group")
    parser.add_argument("--in-group", default="hash,least-load", help="group mode's GPU pick")
    parser.add_argument("--agents", type=int, default=2, help="agent replicas in the region")
    parser.add_argument("--rate-per-gpu", type=float, default=1.0, help="requests/s per GPU")
    parser.add_argument("--duration-s", type=float, default=120.0, help="virtual seconds")
    parser.add_argument(
        "--group-guard",
        type=float,
        default=8.0,
        help="group mode moves a bucket when its group's mean load per GPU exceeds the "
        "least-loaded group's by this many requests (and by 1.5x)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--etcd", default=None, help="an etcd URL; default: start one")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="16 and 64 GPUs, speedup 10, 30 s")
    args = parser.parse_args()
    if args.quick:
        args.gpus, args.speedups, args.duration_s = "16,64", "10", min(args.duration_s, 30.0)
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file (pass the Mooncake trace's path)")
    args.gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
    args.windows_s = [float(x) for x in args.windows_s.split(",") if x.strip()]
    args.speedups = [float(x) for x in args.speedups.split(",") if x.strip()]
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    args.in_group = [x.strip() for x in args.in_group.split(",") if x.strip()]
    if not set(args.modes) <= {"flat", "group"}:
        parser.error("--modes: flat, group")
    if not set(args.in_group) <= {"hash", "least-load"}:
        parser.error("--in-group: hash, least-load")
    if args.agents < 1:
        parser.error("--agents must be at least 1")
    rows = read_trace(args.trace)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.etcd:
        results = asyncio.run(run_all(args, rows, args.etcd))
    else:
        from tests.support import start_etcd

        with (
            tempfile.TemporaryDirectory(prefix="group-tables-") as tmp,
            start_etcd(Path(tmp)) as etcd,
        ):
            print(f"etcd: {etcd.url} (data in {tmp})", flush=True)
            results = asyncio.run(run_all(args, rows, etcd.url))
    wall_s = time.perf_counter() - started

    meta = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "trace": args.trace.name,
        "duration_s": args.duration_s,
        "rate_per_gpu": args.rate_per_gpu,
        "agents": args.agents,
        "group_size": GROUP_SIZE,
        "buckets": N_BUCKETS,
        "key_blocks": KEY_BLOCKS,
        "gpu_cache_blocks": GPU_CACHE_BLOCKS,
        "block_tokens": BLOCK_TOKENS,
        "seed": args.seed,
        "wall_s": wall_s,
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"python {platform.python_version()}".strip(),
    }
    (args.out_dir / "group_tables.json").write_text(
        json.dumps({"meta": meta, "rows": results}, indent=2) + "\n"
    )
    table = markdown(results)
    (args.out_dir / "group_tables.md").write_text(table)
    print(table)
    print(f"total {wall_s:.0f} s")
    plot(results, args.out_dir / "group_tables.png")
    return 0


def markdown(rows: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for speedup in sorted({r["speedup"] for r in rows}):
        some = [r for r in rows if r["speedup"] == speedup]
        out += [
            f"Trace time x{speedup:g}, {some[0]['duration_s']:.0f} s of virtual time per run.",
            "",
            "| GPUs | window | table | req/s | etcd rev/s | keys/s | KiB/s | table keys | "
            "table KiB | warm req. | accuracy | group acc. | block recall | stale views | "
            "load joined |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in some:
            ga = r["group_accuracy"]
            out.append(
                f"| {r['gpus']} | {r['window_s'] * 1000:.0f} ms | {r['label']} | "
                f"{r['requests_per_s']:.0f} | {r['revisions_per_s']:.1f} | "
                f"{r['keys_per_s']:.1f} | {r['kib_per_s']:.1f} | "
                f"{r['setup_keys']} → {r['table_keys']} | {r['table_bytes'] / 1024:.1f} | "
                f"{r['warm_requests']} ({r['warm_share'] * 100:.0f} %) | "
                f"{r['gpu_accuracy'] * 100:.1f} % | "
                f"{'-' if ga is None else f'{ga * 100:.1f} %'} | "
                f"{r['block_recall'] * 100:.1f} % | {r['stale_share'] * 100:.2f} % | "
                f"{r['joined_load_mean']:.1f} / {r['joined_load_p99']} |"
            )
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    speedups = sorted({r["speedup"] for r in rows})
    fig, axes = plt.subplots(len(speedups), 2, figsize=(11, 3.6 * len(speedups)), squeeze=False)
    labels = sorted({r["label"] for r in rows})
    windows = sorted({r["window_s"] for r in rows})
    styles = {w: s for w, s in zip(windows, ["-", "--", ":", "-."], strict=False)}
    colors = {lab: f"C{i}" for i, lab in enumerate(labels)}
    for row_i, s in enumerate(speedups):
        ax_w, ax_a = axes[row_i]
        for lab in labels:
            for w in windows:
                pts = sorted(
                    (r["gpus"], r)
                    for r in rows
                    if r["speedup"] == s and r["label"] == lab and r["window_s"] == w
                )
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                name = f"{lab}, {w * 1000:.0f} ms"
                ax_w.plot(
                    xs,
                    [p[1]["keys_per_s"] for p in pts],
                    marker="o",
                    linestyle=styles[w],
                    color=colors[lab],
                    label=name,
                )
                ax_a.plot(
                    xs,
                    [p[1]["gpu_accuracy"] * 100 for p in pts],
                    marker="o",
                    linestyle=styles[w],
                    color=colors[lab],
                    label=name,
                )
        for ax in (ax_w, ax_a):
            ax.set_xscale("log", base=2)
            ax.set_xticks([r["gpus"] for r in rows])
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("GPUs in the region")
        ax_w.set_yscale("symlog", linthresh=0.1)
        ax_w.set_ylim(bottom=0)
        ax_w.set_ylabel("etcd keys written per s (symlog)")
        ax_w.set_title(f"write load, trace time x{s:g}")
        ax_a.set_ylabel("warm requests on the best GPU (%)")
        ax_a.set_title(f"routing accuracy, trace time x{s:g}")
        ax_a.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
