"""What a worker tells its siblings: where it sent each prompt (the prefix index's record), in
rings in one anonymous shared mapping that the supervisor makes before it forks the workers.

Each worker appends a routed request's record (its node and block hashes) to its own ring, at
once: a memory copy, no system call.  A worker reads its siblings' rings before each of its
decisions (``Dispatcher.before_choosing``) and at each turn of its share loop (at least every
``runtime.IDLE_SHARE_S``, so an idle worker does not fall a ring behind), decodes their records
in place and inserts all that one read found into its own policy's prefix index at once
(``Policy.observe_relayed``: one clock read and one expiry pass, no request view a record), as
if it had routed the requests, so N workers keep the hit rate of one.  A decision therefore
sees every record its siblings wrote before it began.  Nothing wakes a worker for its siblings'
records, and nothing is lost to a worker that is busy or preempted for a while: the ring holds
``RING_BYTES`` (1 MiB: about 4,000 records of a 400-token prompt, far more of those that leave
their head out).

Until 2026-12-05 the records went as datagrams on Unix sockets, batched every 2 ms: each batch
woke every sibling, and a sibling's receive queue (``net.unix.max_dgram_qlen``, often 10
datagrams) overflowed whenever its loop stalled for a few milliseconds (about 1 % of them lost
with 8 workers on a fifth of a core each; none from the rings there, at a CPU cost a request
that did not differ measurably: docs/benchmarks.md, "Workers").

Most prompts start with a head the region has seen (a system prompt, a conversation's earlier
turns).  Every sibling decodes and inserts every record, so with N workers a prompt's head
would cost N - 1 inserts of every block; 8 workers spent a fifth of their CPU on the relay,
most of it taking the siblings' records in.  So a
record leaves its head out (only the tail's blocks, from block ``start``) when the head is the
part of the prompt this worker's policy matched on the node (``Decision.expected_hit_tokens``)
and this worker wrote that head for that node whole less than ``full_every_s`` (1 s) ago.  The
siblings' claims on the head are then at most that much older than on the tail, which the
index allows (``policies.prefix_index``).

Such a tail does not go to the ring when ``share_tail`` is given (the runtime gives it with a
policy that keeps a prefix index): it is written once to a table in the load table's mapping,
and each sibling's policy asks that table for the tails of the prompt it is deciding, past its
own index's deepest match (``workers.shared``, "Prompt tails").  Taking the tails in then costs
a decision two or three probes of the table at any number of workers, where through the ring
every sibling decoded and inserted every tail (7 records a request at 8 workers, 31 at 32).
Whole records (a new prompt, or a head not written whole for that node within the second)
still go through the ring.

A ring is ``RING_BYTES`` of frames, each a ``u32`` length and a record; a frame that does not
fit before the ring's end is written at its start, after a wrap mark (``u32`` all ones) where
four bytes are left.  Three ``int64`` cells per worker, at the mapping's start: the bytes it
has written, ever (its *head*: a frame's position is the head modulo ``RING_BYTES``), its
records, and how far it may be writing (*reserved*).  The writer stores the reservation first,
then the frame, then the head; a reader copies the frames from its own cursor up to the head it
read, then reads the reservation: if it is more than a ring ahead of the cursor, the writer may
have written over some of what was copied, so the copy is dropped and counted ``overrun``, with
the records it missed, and the reader goes on from the head.  x86-64 keeps the writer's stores
and the reader's loads in order; arm64 need not, so there a reader may rarely decode a frame
read while written, which is counted ``malformed`` (the index is a hint: the next request of
that prefix teaches it again).  A worker started again goes on from its last life's head and
reads from its siblings' heads as they are.

Record format: ``u16`` node id length, ``u32`` first block, ``u32`` hash count, the node id
(UTF-8), the hashes (``u64``, native order: the mapping never leaves the host).
"""

from __future__ import annotations

import math
import mmap
import struct
from array import array
from collections.abc import Callable, Sequence

RING_BYTES = 1 << 20  # each worker's ring
MAX_RECORD = 60_000  # bytes; a longer prompt's record keeps its leading blocks
FULL_EVERY_S = 1.0  # a prompt head is written whole at least this often, per node
_TOLD_KEPT = 16_384  # (node, head) pairs written whole that are remembered at most
_HEAD = struct.Struct("=HII")
_FRAME = struct.Struct("=I")
_WRAP = 0xFFFFFFFF  # "the next frame is at the ring's start"
_HASH_BYTES = array("Q").itemsize
MAX_HASHES = (MAX_RECORD - _HEAD.size - 1024) // _HASH_BYTES  # with a node id of 1 KiB
_MAX_FRAME = _FRAME.size + MAX_RECORD
_CELLS = 3  # per worker: head, records, reserved
# a record read: the node, the first block it gives, the hashes from there (``decode``)
Record = tuple[str, int, tuple[int, ...]]


def encode(node_id: str, hashes: Sequence[int], start: int = 0) -> bytes:
    """One record: a prompt's block hashes from block ``start`` on; raises ``OverflowError`` for
    a hash outside 0 .. 2**64 - 1."""
    name = node_id.encode("utf-8")
    return _HEAD.pack(len(name), start, len(hashes)) + name + array("Q", hashes).tobytes()


# What decoding a record looks up rather than makes again (each worker's own; cleared when
# full): the node ids met, by their UTF-8 bytes (a handful: the pool's nodes), and a struct
# of each hash count met.  A tail record decodes in about 1.2 µs instead of 1.9 (a memoryview
# slice made into a str, another cast and copied into a tuple, before).
_NAMES: dict[bytes, str] = {}
_HASH_STRUCTS: dict[int, struct.Struct] = {}
_KEPT = 1024


def decode(data: bytes | memoryview, at: int = 0, length: int | None = None) -> Record:
    """The record of ``length`` bytes (default: to the end) at ``at`` in ``data``, read in place:
    its node, first block and hashes; raises ``ValueError`` for a malformed one."""
    end = len(data) if length is None else at + length
    if end - at < _HEAD.size:
        raise ValueError("a truncated record head")
    name_len, start, count = _HEAD.unpack_from(data, at)
    name_at = at + _HEAD.size
    hashes_at = name_at + name_len
    last = hashes_at + count * _HASH_BYTES
    if last != end:
        raise ValueError("a truncated record" if last > end else "bytes past a record's end")
    raw = bytes(data[name_at:hashes_at])
    name = _NAMES.get(raw)
    if name is None:
        name = str(raw, "utf-8")  # UnicodeDecodeError for bytes that are not
        if len(_NAMES) >= _KEPT:
            _NAMES.clear()
        _NAMES[raw] = name
    hashes = _HASH_STRUCTS.get(count)
    if hashes is None:
        if len(_HASH_STRUCTS) >= _KEPT:
            _HASH_STRUCTS.clear()
        hashes = _HASH_STRUCTS[count] = struct.Struct(f"={count}Q")
    return name, start, hashes.unpack_from(data, hashes_at)  # read in place, as a tuple


class PrefixRings:
    """The mapping: made once, before the workers fork, and inherited by each."""

    def __init__(self, *, workers: int, ring_bytes: int = RING_BYTES) -> None:
        if workers < 1:
            raise ValueError("prefix rings need at least one worker")
        if ring_bytes < 2 * _MAX_FRAME:  # a wrap may leave up to a frame's length unused
            raise ValueError(f"a prefix ring needs at least {2 * _MAX_FRAME} bytes")
        self.workers = workers
        self.ring_bytes = ring_bytes
        self.data_at = 8 * _CELLS * workers  # after the cells
        self._map = mmap.mmap(-1, self.data_at + workers * ring_bytes)  # anonymous, MAP_SHARED
        # per worker: head, records, reserved (module docstring)
        self.cells = memoryview(self._map)[: self.data_at].cast("q")
        self.data = memoryview(self._map)

    def ring_at(self, worker: int) -> int:
        """Where ``worker``'s ring starts in :attr:`data`."""
        return self.data_at + worker * self.ring_bytes


class PrefixRelay:
    """Writes this worker's prefix records to its ring and hands its siblings' to ``on_records``
    (module docstring)."""

    def __init__(
        self,
        rings: PrefixRings,
        *,
        worker: int,
        on_records: Callable[[list[Record]], None],
        clock: Callable[[], float],
        full_every_s: float = FULL_EVERY_S,
        share_tail: Callable[[str, Sequence[int], int], bool] | None = None,
    ) -> None:
        self._rings = rings
        self._worker = worker
        self._siblings = [w for w in range(rings.workers) if w != worker]
        self._on_records = on_records
        self._clock = clock
        self._full_every_s = full_every_s
        self._share_tail = share_tail
        cells = rings.cells
        # where this worker has read each sibling's ring to, and that ring's records up to there
        self._cursors = [cells[_CELLS * w] for w in range(rings.workers)]
        self._seen = [cells[_CELLS * w + 1] for w in range(rings.workers)]
        self._told: dict[tuple[str, int], float] = {}  # (node, a head's last hash): written whole
        self.sent = 0  # records written to the ring (for every sibling)
        self.tails = 0  # records that left their head out (to the ring or ``share_tail``)
        self.shared = 0  # of those, tails given to ``share_tail``, not the ring
        self.received = 0
        self.overrun = 0  # records a sibling wrote that this worker read too late to take
        self.malformed = 0

    def counts(self) -> dict[str, int]:
        """Records written (each for every sibling) and taken in, and those lost (``overrun``,
        ``malformed``): the metrics' (``Instruments.watch_prefix_relay``)."""
        return {
            "sent": self.sent,
            "shared": self.shared,
            "received": self.received,
            "overrun": self.overrun,
            "malformed": self.malformed,
        }

    def send(self, node_id: str, hashes: Sequence[int], matched: int = 0) -> None:
        """Tell the siblings ``node_id`` was sent a prompt of these block hashes, of which this
        worker's policy matched the leading ``matched`` on it: those are left out when this
        worker wrote them for that node whole less than ``full_every_s`` ago (module
        docstring); such a tail goes to ``share_tail`` when given, and to the ring only when it
        declines.  A prompt of more than ``MAX_HASHES`` blocks (7,371: 118k tokens of 16) sends
        its leading ones."""
        if not self._siblings or not hashes:
            return
        start = 0
        if matched > 0:
            told = self._told
            key = (node_id, hashes[min(matched, len(hashes)) - 1])
            now = self._clock()
            if now - told.get(key, -math.inf) < self._full_every_s:
                start = matched
            else:
                if len(told) >= _TOLD_KEPT:  # keep those that still count
                    fresh = now - self._full_every_s
                    told = self._told = {k: t for k, t in told.items() if t > fresh}
                    if len(told) >= _TOLD_KEPT // 2:
                        told.clear()  # then some are written whole again, sooner
                told[key] = now
        end = min(len(hashes), MAX_HASHES)  # the leading blocks: what a prefix match reads first
        if start >= end:
            return  # the siblings were told of all of it a moment ago
        if start and self._share_tail is not None and self._share_tail(node_id, hashes, start):
            self.tails += 1
            self.shared += 1
            return
        try:
            record = encode(node_id, hashes[start:end], start)
        except OverflowError:
            return  # not a 64-bit hash: nothing a sibling's index could match
        if len(record) > MAX_RECORD:
            return  # a node id of over 1 KiB: no node's
        self._append(record)
        self.sent += 1
        if start:
            self.tails += 1

    def _append(self, record: bytes) -> None:
        rings, w = self._rings, self._worker
        cells, size, at = rings.cells, rings.ring_bytes, _CELLS * w
        head = cells[at]
        pos = head % size
        need = _FRAME.size + len(record)
        wrap = size - pos < need  # not before the ring's end: at its start
        end = head + (size - pos if wrap else 0) + need
        cells[at + 2] = end  # first: what a reader copies past a ring before it may be torn
        if wrap:
            if size - pos >= _FRAME.size:
                _FRAME.pack_into(rings.data, rings.ring_at(w) + pos, _WRAP)
            pos = 0
        frame = rings.ring_at(w) + pos
        _FRAME.pack_into(rings.data, frame, len(record))
        rings.data[frame + _FRAME.size : frame + need] = record
        cells[at + 1] += 1
        cells[at] = end  # last: a reader reads up to it

    def take(self) -> None:
        """Hand the records the siblings wrote since the last take to ``on_records``, all at
        once (none: not called)."""
        cells, cursors = self._rings.cells, self._cursors
        records: list[Record] = []
        for w in self._siblings:
            head = cells[_CELLS * w]
            if head != cursors[w]:
                self._take(w, head, records)
        if records:
            self.received += len(records)
            self._on_records(records)

    def _take(self, w: int, head: int, out: list[Record]) -> None:
        """Decode sibling ``w``'s records from this worker's cursor up to ``head`` in place,
        then keep them (in ``out``) unless the writer may have written over them meanwhile."""
        rings = self._rings
        cells, data, size = rings.cells, rings.data, rings.ring_bytes
        base = rings.ring_at(w)
        cursor = self._cursors[w]
        records: list[Record] = []
        malformed = 0
        torn = False
        if head - cursor <= size:  # else it wrote over some of them already
            at = cursor
            while at < head:
                pos = at % size
                if size - pos < _FRAME.size:
                    at += size - pos
                    continue
                (length,) = _FRAME.unpack_from(data, base + pos)
                if length == _WRAP:
                    at += size - pos
                    continue
                if length > size - pos - _FRAME.size or at + _FRAME.size + length > head:
                    torn = True  # a frame read while written (module docstring)
                    break
                frame = base + pos + _FRAME.size
                at += _FRAME.size + length
                try:
                    records.append(decode(data, frame, length))
                except (ValueError, UnicodeDecodeError):
                    malformed += 1
        reserved = cells[_CELLS * w + 2]  # after the reads (module docstring)
        now_head, written = cells[_CELLS * w], cells[_CELLS * w + 1]
        if reserved > cursor + size:  # it may have written over what was read
            self.overrun += max(0, written - self._seen[w])
            self._cursors[w], self._seen[w] = now_head, written
            return
        self._cursors[w] = head
        self.malformed += malformed
        if torn:
            self.malformed += 1
            self._cursors[w], self._seen[w] = now_head, written
        else:
            self._seen[w] += len(records) + malformed
        out += records
