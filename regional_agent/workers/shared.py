"""The workers' shared load table: each worker's in-flight, token and prefill counts per node,
in one anonymous shared mapping that the supervisor makes before it forks them.

Layout (int64 cells, ``memoryview.cast("q")``)::

    [0]                      magic
    [1 .. W]                 generation of each worker (moves on every write of that worker)
    [.. W * RING]            each worker's ring: the slots of its last RING writes
    [.. S]                   node keys: slot s holds the 63-bit key of one node id (0: free)
    [..]                     cells: slot s, worker w -> in_flight, tokens, prefill, version
    [.. CLAIMS * 3]          claims: block hash key, (node slot + 1) << 16 | worker, µs stamp
    [.. (TAILS + 8) * 4]     prompt tails: a claim's entry and the prompt's length, kept for
                             the prefix index's TTL
    [.. W * 2]               demand: each worker's queued requests, and its arrivals so far
    [.. W * 2]               exits: how often each worker died killed by a signal, and exiting
    [.. S * SAMPLE_FIELDS]   samples: slot s -> the node's last telemetry, whoever scraped it
    [.. S * PROBE_FIELDS]    probes: slot s -> the node's last health probe, whoever sent it

No locks on reading the counts: a worker writes only its own cells (aligned 8-byte stores,
which x86-64 and arm64 never tear), readers sum every worker's cells of a slot.  A read can be
one write behind; the next one catches up.  Claiming a free slot for a new node takes a lock
(``flock`` on a file in the workers' private directory, which the kernel drops if its holder
dies; slots are never freed, so a lookup without the lock is safe).

:meth:`LoadShare.reserve` counts a request on a node only while every worker's requests there
stay within the node's slots, and takes no lock while the node has room to spare.  It writes
the request into the worker's own cells first and sums every worker's after, so of two workers
that reserve at once, the later reader sees the other's request.  The hardware may let a read
pass the store just before it (x86-64 for the nanoseconds a store waits in its core's buffer),
so each sibling's reservation under way may go unseen: that is at most ``workers - 1``
requests, and the sum must leave that many slots free for the reservation to stand without the
lock.  Nearer the node's limit, the sum is read again under the lock, where a reservation that
does not fit is undone (its request goes back to the queue), so two workers never both take a
node's last slot.  A reservation without the lock costs 1.0 µs of CPU, against 2.5 µs with
it (a pair of ``flock`` calls), and no worker waits for a sibling the scheduler preempted while
it held the lock.

A reader learns which nodes its siblings' writes touched from their generations and rings:
a sibling whose generation moved by less than RING since the last read wrote the slots its ring
names; one that moved more (or was cleared) makes the reader compare every slot's versions, and
so does a read ``SCAN_EVERY_S`` after the last such comparison, a backstop for an entry read
before it was stored (x86-64 keeps stores in order, arm64 need not).  The backstop goes by time,
not by reads: reads come with every decision, and a comparison costs a pass over every slot.

Claims cover the moments before the prefix relay (``workers.siblings``) tells the siblings
where a new prompt went.  When 64 clients start at once with 8 system prompts, each worker
meets each prompt for the first time within the same millisecond, and without a word from the
others each sends it to the node it finds least loaded: a prompt lands on two nodes, and stays
on both (docs/benchmarks.md, "Workers").  So a worker that routes a prompt whose head its index
did not hold claims the head for the node (:meth:`LoadShare.claim`: blocks 4, 8, 16 and 32 of
the prompt, ``CLAIM_AT``, keyed by block hash: at most four entries, and none where the node
chosen held the prompt's first 32 blocks), and a worker whose own index holds less of a prompt
asks the claims first (:meth:`LoadShare.claimed`: for a prompt nobody claimed, the entries
tried for its 4th block, at most ``_CLAIM_PROBES``); the dispatcher learns a sibling's claim
as if it were relayed and chooses again.  A claim is written without a lock: its stamp last,
read first and again after the rest, and its value carries bits of its key, so a read while it
is written, or an entry two workers wrote at once, is ignored.  The hardware's reordering and
two workers routing the same new prompt within the same microseconds can still put it on two
nodes; and a reader whose node chosen held less of the prompt than the sibling's index did can
miss a claim that starts deeper.  Claims older than ``CLAIM_TTL_S`` are ignored (the relay has
told everyone by then), and overwritten.

Prompt tails are the part of a routed prompt after the head its node was matched on
(``workers.siblings``: the head went to every sibling whole moments before).  A worker writes a
tail once, here, at the prefix index's indexed positions from the tail's first block on
(:meth:`LoadShare.share_tail`: an entry a position, a claim's entry and the prompt's length;
the ``_CLAIM_PROBES`` entries tried for a key follow its home entry and are read as one slice),
and a sibling's policy asks for the tails of the prompt it is deciding past its own index's
deepest match (:meth:`LoadShare.deepest_tail`, attached by
``policies.routing.attach_sibling_tails``): because hashes chain, a node that holds a deeper
indexed block holds every one before, so a bisection over those positions finds the deepest in
a few probes; where the prompt written there ended before the query's next indexed position,
one more probe, of that prompt's last block (written too: an index keeps a prompt's last
block), says whether the query goes on as far.  So taking the tails in costs a decision the
same at any number of workers, where relaying them through the rings cost every sibling an
insert of every tail (7 records a request at 8 workers, 31 at 32: docs/benchmarks.md,
"Workers").  An entry names one node (the last writer's); a reader ignores tails older than
the index's ``ttl_s``, and a writer whose key has no entry yet writes over the oldest of those
tried (a free one is stamped 0), so the table keeps the newest entries.

Demand is what the autoscaler's load policy reads (``autoscaler.load``): each worker posts the
requests waiting in its queue and its arrivals so far (:meth:`LoadShare.post_demand`, every
``workers.share_interval_s``), and the worker that acts sums them (:meth:`LoadShare.demand`), so
it reads the load of every worker as one process reads its own.  A worker's arrivals are a
running count over its lives (a new life goes on from the last's), so their sum never falls.

Samples spare the nodes a scrape per worker (``telemetry.scraper``): the worker that owns a
node (its slot modulo the workers) scrapes its ``/metrics`` and publishes what it derived
(:meth:`LoadShare.publish`: up to ``SAMPLE_VALUES`` numbers); the others read it
(:meth:`LoadShare.latest`) and scrape the node themselves only while its owner has neither
published a sample nor failed a scrape lately (:meth:`LoadShare.owner_published`): it died, or
hangs.  A sample is written as a seqlock: a sequence made odd first, the fields, the sequence
made even last; a reader takes the fields only between two equal even reads of it, so a sample
read while written is skipped.

Probes spare the nodes a health probe per worker (``health.monitor``) the same way: the node's
owner probes it every ``health.probe_interval_s`` and publishes the outcome and its detail
(:meth:`LoadShare.publish_probe`, a seqlock too, the detail cut to ``PROBE_DETAIL_BYTES``);
the others apply the newest one they have not applied yet, every 0.1 s
(:meth:`LoadShare.probe`), and probe the node themselves only while its owner has published
none for two intervals and a probe's time limit (:meth:`LoadShare.owner_probed`).

A worker that dies leaves its counts behind; the supervisor zeroes them and its queued requests
(:meth:`LoadTable.clear_worker`) before it starts the worker again, and counts the death
(:meth:`LoadTable.count_exit`), which every worker's ``/metrics`` shows for all of them.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path

from policies import prefix_index

log = logging.getLogger(__name__)

_MAGIC = 0x4D455249  # "MERI"
_FIELDS = 4  # in_flight, tokens, prefill, version
_VERSION = 3
RING = 64  # slots of its last writes each worker names (module docstring)
SCAN_EVERY_S = 0.05  # seconds between full comparisons (module docstring)
CLAIMS = 16384  # claim entries (module docstring): 384 KiB
CLAIM_AT = (3, 7, 15, 31)  # the blocks claimed: a prompt's 4th, 8th, 16th, 32nd (of 16 tokens)
CLAIM_TTL_S = 0.25  # a claim older than this is ignored (the relay says it in milliseconds)
_CLAIM_PROBES = 8  # entries tried for a key, from its home entry on
TAILS = 1 << 18  # prompt tail entries (module docstring): 8 MiB
_TAIL_WIDTH = 4  # a tail entry: key, value (as a claim's), stamp, the prompt's length
_TAIL_SPAN = _CLAIM_PROBES * _TAIL_WIDTH  # the cells of the entries tried for a key
SAMPLE_VALUES = 12  # what a published sample may carry (the scraper says what they are)
# a sample: sequence, scraped at (µs of the monotonic clock), the worker that scraped it, when
# the node's owner last published one (µs), and its values as doubles (NaN: none)
SAMPLE_FIELDS = 4 + SAMPLE_VALUES
PROBE_DETAIL_BYTES = 256  # of a probe's detail (UTF-8), kept at most
# a probe: sequence, sent at (µs of the monotonic clock), the worker that sent it, when the
# node's owner last published one (µs), good (1) or not (0), the detail's length, the detail
PROBE_FIELDS = 6 + PROBE_DETAIL_BYTES // 8
_KEY_MASK = (1 << 63) - 1
# a claim's value: the key's low 22 bits (a torn entry's value names another key), node slot
# + 1 (24 bits: workers.table_slots is at most 65,536), worker (16 bits)
_TAG_SHIFT = 40
_TAG_MASK = (1 << 22) - 1
_WORKER_BITS = 16
_WORKER_MASK = (1 << _WORKER_BITS) - 1
_VALUE_MASK = (1 << _TAG_SHIFT) - 1  # a value less its tag: node slot + 1, worker


def node_key(node_id: str) -> int:
    """A node id's key in the table: 63 bits of its BLAKE2b, never 0 (a free slot)."""
    digest = hashlib.blake2b(node_id.encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


class LoadTable:
    """The mapping itself; made once, before the workers fork, and inherited by each."""

    def __init__(self, *, workers: int, slots: int) -> None:
        if workers < 1 or slots < 1:
            raise ValueError("a load table needs at least one worker and one slot")
        self.workers = workers
        self.slots = slots
        self.rings_at = 1 + workers
        self.keys_at = self.rings_at + workers * RING
        self.cells_at = self.keys_at + slots
        self.claims_at = self.cells_at + slots * workers * _FIELDS
        self.tails_at = self.claims_at + CLAIMS * 3
        # the entries tried for a key follow its home entry, past the last one too
        self.demand_at = self.tails_at + (TAILS + _CLAIM_PROBES) * _TAIL_WIDTH
        self.exits_at = self.demand_at + workers * 2
        self.samples_at = self.exits_at + workers * 2
        self.probes_at = self.samples_at + slots * SAMPLE_FIELDS
        size = self.probes_at + slots * PROBE_FIELDS
        self._map = mmap.mmap(-1, size * 8)  # anonymous, MAP_SHARED: shared across fork
        self.cells = memoryview(self._map).cast("q")
        self.floats = memoryview(self._map).cast("d")  # the same cells, as doubles
        self.bytes = memoryview(self._map)  # and as bytes
        self.cells[0] = _MAGIC

    def cell(self, slot: int, worker: int) -> int:
        """Index of the first field of ``worker``'s cell of ``slot``."""
        return self.cells_at + (slot * self.workers + worker) * _FIELDS

    def clear_worker(self, worker: int) -> None:
        """Zero what ``worker`` counted (it died), so its siblings stop routing around it."""
        cells = self.cells
        for slot in range(self.slots):
            at = self.cell(slot, worker)
            if cells[at] or cells[at + 1] or cells[at + 2]:
                cells[at] = cells[at + 1] = cells[at + 2] = 0
                cells[at + _VERSION] += 1
        cells[1 + worker] += RING + 1  # past its ring: readers compare every slot
        cells[self.demand_at + worker * 2] = 0  # its queue died with it (arrivals stay)

    def count_exit(self, worker: int, *, signaled: bool) -> None:
        """``worker`` died: killed by a signal (the OOM killer's SIGKILL among them), or it
        exited.  Only the supervisor writes these cells."""
        self.cells[self.exits_at + worker * 2 + (0 if signaled else 1)] += 1

    def exits(self) -> list[tuple[int, int]]:
        """Each worker's deaths since the agent started: (killed by a signal, exited)."""
        cells, at = self.cells, self.exits_at
        return [(cells[at + w * 2], cells[at + w * 2 + 1]) for w in range(self.workers)]


class LoadShare:
    """One worker's handle on the table: writes its own cells, reads every worker's sums.

    Satisfies ``regional_agent.nodes.SharedLoad``."""

    def __init__(self, table: LoadTable, *, worker: int, lock_file: Path) -> None:
        self._table = table
        self._cells = table.cells
        self._worker = worker
        self._slots: dict[str, int | None] = {}  # node id -> its slot (None: the table is full)
        self._by_slot: dict[int, str] = {}  # the reverse, of the slotted ones
        self._versions: dict[int, int] = {}  # slot -> the sum of its versions at the last scan
        self._generations = [0] * table.workers  # each worker's, as last read
        self._scanned_s = time.monotonic()  # the last backstop
        self._written = 0  # every worker's generations summed, at the last backstop
        self._ring = table.rings_at + worker * RING
        self._span = table.workers * _FIELDS
        self._unseen = table.workers - 1  # siblings' reservations a read may miss (reserve)
        self._lock = _FileLock(lock_file)
        self.full_warned = False
        self._demand = table.demand_at + worker * 2
        self._arrived_before = self._cells[self._demand + 1]  # its earlier lives' (docstring)

    @property
    def worker(self) -> int:
        """This worker's index."""
        return self._worker

    # -- slots -------------------------------------------------------------------------------

    def slot(self, node_id: str) -> int | None:
        """The node's slot, claimed on first use; None when the table has no room."""
        try:
            return self._slots[node_id]
        except KeyError:
            pass
        key = node_key(node_id)
        found = self._find(key, claim=False)
        if found is None:
            with self._lock:
                found = self._find(key, claim=True)
        if found is None and not self.full_warned:
            self.full_warned = True
            log.warning(
                "the workers' load table is full (workers.table_slots = %d): node %s is routed "
                "on this worker's own counts only; raise workers.table_slots",
                self._table.slots,
                node_id,
            )
        self._slots[node_id] = found
        if found is not None:
            self._by_slot[found] = node_id
            self._versions[found] = self._version_sum(found)  # what a scan compares with
        return found

    def _find(self, key: int, *, claim: bool) -> int | None:
        cells, slots, at = self._cells, self._table.slots, self._table.keys_at
        start = key % slots
        for i in range(slots):
            s = (start + i) % slots
            held = cells[at + s]
            if held == key:
                return s
            if held == 0:
                if not claim:
                    return None
                cells[at + s] = key
                return s
        return None

    # -- the counts ----------------------------------------------------------------------------

    def write(self, node_id: str, in_flight: int, tokens: int, prefill: int) -> None:
        """This worker's counts of ``node_id`` are now these."""
        slot = self.slot(node_id)
        if slot is None:
            return
        cells = self._cells
        at = self._table.cell(slot, self._worker)
        cells[at] = in_flight
        cells[at + 1] = tokens
        cells[at + 2] = prefill
        cells[at + _VERSION] += 1
        generation = cells[1 + self._worker] + 1
        cells[self._ring + generation % RING] = slot
        cells[1 + self._worker] = generation  # last: a reader that sees it sees the ring entry

    def reserve(self, node_id: str, slots: int, in_flight: int, tokens: int, prefill: int) -> bool:
        """Write this worker's new counts of ``node_id`` (``in_flight`` is one more than its
        last) if every worker's requests there, this one included, stay within ``slots``;
        False, this worker's counts as they were, when a sibling has taken the last slot since
        (the module docstring says how: no lock while the node has room to spare)."""
        slot = self.slot(node_id)
        if slot is None:
            self.write(node_id, in_flight, tokens, prefill)
            return True
        cells = self._cells
        mine = self._table.cell(slot, self._worker)
        before = (cells[mine], cells[mine + 1], cells[mine + 2])
        self.write(node_id, in_flight, tokens, prefill)  # first: a sibling reserving sees it
        at = self._table.cell(slot, 0)
        end = at + self._span
        if sum(cells[at:end:_FIELDS]) <= slots - self._unseen:
            return True
        with self._lock:
            if sum(cells[at:end:_FIELDS]) <= slots:
                return True
            self.write(node_id, *before)
        return False

    def forget(self, node_id: str) -> None:
        """``node_id`` left this worker's pool: what it had counted there is gone with it."""
        if self._slots.get(node_id) is not None:
            self.write(node_id, 0, 0, 0)

    def totals(self, node_id: str) -> tuple[int, int, int] | None:
        """Every worker's in-flight, token and prefill counts of ``node_id``, summed; None when
        it has no slot (only this worker's own counts are known)."""
        slot = self.slot(node_id)
        if slot is None:
            return None
        cells, span = self._cells, self._span
        at = self._table.cell(slot, 0)
        end = at + span
        return (
            max(0, sum(cells[at:end:_FIELDS])),
            max(0, sum(cells[at + 1 : end : _FIELDS])),
            max(0, sum(cells[at + 2 : end : _FIELDS])),
        )

    def moved(self) -> set[str]:
        """The nodes (of those this worker has slotted) whose counts another worker changed
        since the last call; at once empty when no other worker wrote anything."""
        cells, me = self._cells, self._worker
        seen = self._generations
        slots: set[int] = set()
        scan = False
        clock = time.monotonic()
        if clock - self._scanned_s >= SCAN_EVERY_S:  # the backstop, unless nobody wrote since
            self._scanned_s = clock
            written = sum(cells[1 : 1 + self._table.workers])
            scan, self._written = written != self._written, written
        for worker in range(self._table.workers):
            if worker == me:
                continue
            now = cells[1 + worker]
            before = seen[worker]
            if now == before:
                continue
            if now - before >= RING or now < before:
                scan = True
            else:
                # the ring's entries of generations before + 1 .. now, read as one or two runs
                ring = self._table.rings_at + worker * RING
                first = ring + (before + 1) % RING
                end = first + now - before
                if end <= ring + RING:
                    slots.update(cells[first:end])
                else:
                    slots.update(cells[first : ring + RING])
                    slots.update(cells[ring : end - RING])
                # it may have overwritten the oldest entry read (a writer stores the entry of
                # its next generation before the generation)
                if cells[1 + worker] - before >= RING:
                    scan = True
            seen[worker] = now
        if scan:
            slots = self._scan()
        by_slot = self._by_slot
        return {by_slot[s] for s in slots if s in by_slot}

    # -- telemetry samples ---------------------------------------------------------------------

    def owns(self, node_id: str) -> bool:
        """Whether this worker scrapes ``node_id`` for every worker (module docstring); a node
        without a slot, each scrapes for itself."""
        slot = self.slot(node_id)
        return slot is None or self._owner(slot)

    def _owner(self, slot: int) -> bool:
        """Whether this worker owns the node of ``slot`` (module docstring)."""
        return slot % self._table.workers == self._worker

    def publish(self, node_id: str, taken_s: float, values: Sequence[float | None]) -> None:
        """This worker scraped ``node_id`` at ``taken_s`` (the monotonic clock) and derived
        ``values`` (at most ``SAMPLE_VALUES``; None, and any left out: not known)."""
        if len(values) > SAMPLE_VALUES:
            raise ValueError(f"a sample carries at most {SAMPLE_VALUES} values")
        begun = self._begin_write(node_id, self._table.samples_at, SAMPLE_FIELDS, taken_s)
        if begun is None:
            return
        at, sequence = begun
        floats = self._table.floats
        for i in range(SAMPLE_VALUES):
            value = values[i] if i < len(values) else None
            floats[at + 4 + i] = math.nan if value is None else value
        self._cells[at] = sequence + 1  # even: written

    def _begin_write(
        self, node_id: str, region_at: int, fields: int, at_s: float
    ) -> tuple[int, int] | None:
        """Start writing ``node_id``'s entry of a seqlocked region (samples, probes): its
        sequence made odd, the time, this worker, and if it owns the node, the owner's time.
        Where it starts and its odd sequence, which the writer makes even when done; None
        when the node has no slot."""
        slot = self.slot(node_id)
        if slot is None:
            return None
        cells = self._cells
        at = region_at + slot * fields
        sequence = cells[at] | 1  # odd: being written (even after a writer that died midway)
        cells[at] = sequence
        cells[at + 1] = round(at_s * 1e6)
        cells[at + 2] = self._worker
        if self._owner(slot):
            cells[at + 3] = round(at_s * 1e6)  # the owner is alive
        return at, sequence

    def _begin_read(self, node_id: str, region_at: int, fields: int) -> tuple[int, int] | None:
        """Where ``node_id``'s entry of a seqlocked region starts, and its sequence, to compare
        after reading the fields; None when there is none, or it is being written."""
        slot = self.slot(node_id)
        if slot is None:
            return None
        at = region_at + slot * fields
        sequence = self._cells[at]
        if sequence == 0 or sequence & 1:
            return None
        return at, sequence

    def _owner_time(self, node_id: str, region_at: int, fields: int) -> float | None:
        """The owner's time in ``node_id``'s entry of a seqlocked region (the monotonic clock);
        None when the owner never wrote it."""
        slot = self.slot(node_id)
        if slot is None:
            return None
        at_us = self._cells[region_at + slot * fields + 3]
        return at_us / 1e6 if at_us else None

    def tried(self, node_id: str, at_s: float) -> None:
        """This worker's scrape of ``node_id`` failed at ``at_s``: if it owns the node, it is
        alive (:meth:`owner_published`), and the node is what does not answer."""
        slot = self.slot(node_id)
        if slot is not None and self._owner(slot):
            self._cells[self._table.samples_at + slot * SAMPLE_FIELDS + 3] = round(at_s * 1e6)

    def owner_published(self, node_id: str) -> float | None:
        """When ``node_id``'s owner last published a sample of it, or failed to scrape it (the
        monotonic clock); None when it never did either.  Samples other workers publish do not
        move it: while it is recent, the owner is alive and the others need not scrape the
        node."""
        return self._owner_time(node_id, self._table.samples_at, SAMPLE_FIELDS)

    def latest(self, node_id: str) -> tuple[float, int, tuple[float | None, ...]] | None:
        """The last sample any worker published of ``node_id``: when it was scraped (the
        monotonic clock), by which worker, and its values (all ``SAMPLE_VALUES``); None when
        there is none, or it was being written (read again at the next view)."""
        begun = self._begin_read(node_id, self._table.samples_at, SAMPLE_FIELDS)
        if begun is None:
            return None
        at, sequence = begun
        cells = self._cells
        taken_us, worker = cells[at + 1], cells[at + 2]
        raw = self._table.floats[at + 4 : at + SAMPLE_FIELDS].tolist()
        if cells[at] != sequence:
            return None
        return taken_us / 1e6, worker, tuple(None if math.isnan(v) else v for v in raw)

    # -- health probes -------------------------------------------------------------------------

    def publish_probe(self, node_id: str, at_s: float, ok: bool, detail: str) -> None:
        """This worker probed ``node_id`` at ``at_s`` (the monotonic clock): good or not, and
        why (cut to ``PROBE_DETAIL_BYTES`` of UTF-8)."""
        begun = self._begin_write(node_id, self._table.probes_at, PROBE_FIELDS, at_s)
        if begun is None:
            return
        at, sequence = begun
        cells = self._cells
        text = detail.encode("utf-8")[:PROBE_DETAIL_BYTES]
        cells[at + 4] = 1 if ok else 0
        cells[at + 5] = len(text)
        start = (at + 6) * 8
        self._table.bytes[start : start + len(text)] = text
        cells[at] = sequence + 1  # even: written

    def probe(self, node_id: str) -> tuple[float, int, bool, str] | None:
        """The last probe any worker published of ``node_id``: when it was sent (the monotonic
        clock), by which worker, good or not, and its detail; None when there is none, or it
        was being written (read again at the next round)."""
        begun = self._begin_read(node_id, self._table.probes_at, PROBE_FIELDS)
        if begun is None:
            return None
        at, sequence = begun
        cells = self._cells
        at_us, worker, ok, length = cells[at + 1], cells[at + 2], cells[at + 4], cells[at + 5]
        start = (at + 6) * 8
        raw = bytes(self._table.bytes[start : start + min(max(length, 0), PROBE_DETAIL_BYTES)])
        if cells[at] != sequence:
            return None
        # a detail cut within a character loses that character
        return at_us / 1e6, worker, ok == 1, raw.decode("utf-8", errors="ignore")

    def owner_probed(self, node_id: str) -> float | None:
        """When ``node_id``'s owner last published a probe of it (the monotonic clock); None
        when it never did.  Probes other workers publish do not move it."""
        return self._owner_time(node_id, self._table.probes_at, PROBE_FIELDS)

    # -- demand --------------------------------------------------------------------------------

    def post_demand(self, queued: int, arrivals: int) -> None:
        """This worker's queue holds ``queued`` requests, and ``arrivals`` have come to it in
        this life."""
        cells, at = self._cells, self._demand
        cells[at] = queued
        cells[at + 1] = self._arrived_before + arrivals

    def demand(self, queued: int, arrivals: int) -> tuple[int, int]:
        """Every worker's queued requests and arrivals summed, this worker's as given (its
        own, fresher than what it last posted)."""
        cells, base = self._cells, self._table.demand_at
        end = base + self._table.workers * 2
        own = self._demand
        return (
            sum(cells[base:end:2]) - cells[own] + queued,
            sum(cells[base + 1 : end : 2]) - cells[own + 1] + self._arrived_before + arrivals,
        )

    # -- claims --------------------------------------------------------------------------------

    def claim(self, node_id: str, hashes: Sequence[int], start: int) -> None:
        """This worker sent a prompt of ``hashes`` to ``node_id``, where its index held only
        the first ``start`` blocks: the blocks at ``CLAIM_AT`` from ``start`` on are claimed
        for the node (module docstring)."""
        if start > CLAIM_AT[-1] or len(hashes) <= CLAIM_AT[0]:
            return
        slot = self.slot(node_id)
        if slot is None:
            return
        cells = self._cells
        node = (slot + 1) << _WORKER_BITS | self._worker
        stamp = time.monotonic_ns() // 1000 or 1
        for i in CLAIM_AT:
            if i >= len(hashes):
                break
            if i < start:
                continue
            key = hashes[i] & _KEY_MASK or 1
            at = self._claim_entry(key, stamp)
            cells[at + 2] = 0  # first: a reader between these stores ignores the entry
            cells[at] = key
            cells[at + 1] = (key & _TAG_MASK) << _TAG_SHIFT | node
            cells[at + 2] = stamp

    def claimed(self, hashes: Sequence[int], start: int) -> tuple[str, int] | None:
        """The node a sibling claimed the blocks of ``hashes`` at ``CLAIM_AT`` from ``start``
        on for, within ``CLAIM_TTL_S``, and how many leading blocks of ``hashes`` its claims
        cover (more than ``start``); None when no sibling claimed the first of them."""
        if start > CLAIM_AT[-1]:
            return None
        oldest = time.monotonic_ns() // 1000 - int(CLAIM_TTL_S * 1e6)
        node = depth = 0
        siblings = False
        for i in CLAIM_AT:  # shallowest first: a prompt nobody claimed stops at the first
            if i >= len(hashes):
                break
            if i < start:
                continue
            value = self._claim_value(hashes[i] & _KEY_MASK or 1, oldest)
            if value is None or (node and value >> _WORKER_BITS != node):
                break
            node, depth = value >> _WORKER_BITS, i + 1
            siblings = siblings or value & _WORKER_MASK != self._worker
        if not siblings:
            return None  # none, or this worker's own claims only: its index holds the prompt
        node_id = self._by_slot.get(node - 1)
        if node_id is None:
            return None  # a node this worker has never counted: not in its pool
        return node_id, depth

    def _claim_entry(self, key: int, stamp: int) -> int:
        """Where ``key``'s claim goes: its entry, else a free or expired one, else the oldest
        of those tried."""
        cells, base = self._cells, self._table.claims_at
        expired = stamp - int(CLAIM_TTL_S * 1e6)
        home = key % CLAIMS
        oldest_at, oldest = -1, 0
        for i in range(_CLAIM_PROBES):
            at = base + (home + i) % CLAIMS * 3
            held = cells[at + 2]
            if cells[at] == key or held < expired:
                return at
            if oldest_at < 0 or held < oldest:
                oldest_at, oldest = at, held
        return oldest_at

    def _claim_value(self, key: int, oldest: int) -> int | None:
        cells, base = self._cells, self._table.claims_at
        home = key % CLAIMS
        for i in range(_CLAIM_PROBES):
            at = base + (home + i) % CLAIMS * 3
            held = cells[at]
            if held == 0:
                return None  # never written: the probe ends (entries are never emptied)
            stamp = cells[at + 2]
            if held == key and stamp >= oldest:
                value = cells[at + 1]
                if (
                    cells[at + 2] == stamp  # not rewritten meanwhile
                    and cells[at] == key
                    and value >> _TAG_SHIFT == key & _TAG_MASK  # not another key's value
                ):
                    return value & ((1 << _TAG_SHIFT) - 1)
        return None

    # -- prompt tails --------------------------------------------------------------------------

    def share_tail(self, node_id: str, hashes: Sequence[int], positions: Sequence[int]) -> bool:
        """This worker sent a prompt of ``hashes`` to ``node_id``: write its blocks at
        ``positions`` (the prefix index's, from the tail's first block on), each with the
        prompt's length, for the siblings (module docstring).  False when the node has no slot
        in the table."""
        slot = self.slot(node_id)
        if slot is None:
            return False
        cells, base = self._cells, self._table.tails_at
        node = (slot + 1) << _WORKER_BITS | self._worker
        stamp = time.monotonic_ns() // 1000 or 1
        end = len(hashes)
        for i in positions:
            key = hashes[i] & _KEY_MASK or 1
            at = base + key % TAILS * _TAIL_WIDTH  # the entries tried: from here, one slice
            keys = cells[at : at + _TAIL_SPAN : _TAIL_WIDTH].tolist()
            if key in keys:
                at += keys.index(key) * _TAIL_WIDTH
            else:  # the oldest of them (a free one is stamped 0)
                stamps = cells[at + 2 : at + _TAIL_SPAN : _TAIL_WIDTH].tolist()
                at += stamps.index(min(stamps)) * _TAIL_WIDTH
            cells[at + 2] = 0  # first: a reader between these stores ignores the entry
            cells[at] = key
            cells[at + 1] = (key & _TAG_MASK) << _TAG_SHIFT | node
            cells[at + 3] = end
            cells[at + 2] = stamp
        return True

    def deepest_tail(
        self, hashes: Sequence[int], positions: Sequence[int], ttl_s: float
    ) -> tuple[str, int] | None:
        """The node of the deepest tail written within ``ttl_s`` that covers a block of
        ``hashes`` at one of ``positions``, and how many leading blocks it covers; None when
        the bisection finds none.  ``positions`` ascend from past the caller's own deepest
        match: the tails held there end at some position and go on unbroken before it, as
        chained hashes do.  Where the prompt written there ended between two of ``positions``,
        its last block (written too) is looked up: the match goes on to it when held (module
        docstring)."""
        oldest = time.monotonic_ns() // 1000 - int(ttl_s * 1e6)
        cells = self._cells

        def written(block: int) -> tuple[int, int] | None:
            at = self._tail_at(block & _KEY_MASK or 1, oldest)
            # (a length read as rewritten names a block the last-block check misses)
            return None if at is None else (cells[at + 1], cells[at + 3])

        deepest = prefix_index.deepest_written(hashes, positions, written)
        if deepest is None:
            return None
        found, depth = deepest
        node_id = self._by_slot.get(((found & _VALUE_MASK) >> _WORKER_BITS) - 1)
        if node_id is None:
            return None  # a node this worker has never counted: not in its pool
        return node_id, depth

    def _tail_at(self, key: int, oldest: int) -> int | None:
        """Where ``key``'s tail entry is, unless stamped before ``oldest``, read while written,
        or written by two workers at once; None then."""
        cells = self._cells
        at = self._table.tails_at + key % TAILS * _TAIL_WIDTH
        keys = cells[at : at + _TAIL_SPAN : _TAIL_WIDTH].tolist()
        if key not in keys:
            return None
        at += keys.index(key) * _TAIL_WIDTH
        stamp = cells[at + 2]
        value = cells[at + 1]
        if (
            stamp >= oldest
            and cells[at + 2] == stamp  # not rewritten meanwhile
            and cells[at] == key
            and value >> _TAG_SHIFT == key & _TAG_MASK  # not another key's value
        ):
            return at
        return None

    def _scan(self) -> set[int]:
        """Every slotted node whose versions moved since the last scan (a sibling wrote more
        than its ring holds, or was cleared)."""
        versions = self._versions
        out = set()
        for slot in self._by_slot:
            total = self._version_sum(slot)
            if versions.get(slot) != total:
                versions[slot] = total
                out.add(slot)
        return out

    def _version_sum(self, slot: int) -> int:
        at = self._table.cell(slot, 0) + _VERSION
        return sum(self._cells[at : at + self._span : _FIELDS])


class _FileLock:
    """``flock`` on a file of the private directory, held for a ``with`` block; the file is
    opened on first use, in the worker that uses it (a descriptor inherited across fork would
    share one lock between the processes, which excludes nobody)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1

    def __enter__(self) -> _FileLock:
        if self._fd < 0:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
