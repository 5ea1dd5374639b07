"""What a worker tells its siblings: where it sent each prompt (the prefix index's record), as
datagrams on Unix sockets in the workers' private directory.

Each worker binds ``w<i>.prefix``; a routed request's block hashes and node go to every sibling,
batched: the records of ``flush_after_s`` (the runtime passes ``workers.share_interval_s``, 2 ms)
leave as one datagram per sibling, so a sibling's index is at most that far behind, as its load
counts are (at most ``MAX_DATAGRAM`` bytes each, a fuller batch leaving at once; a longer
prompt's record keeps its leading ``MAX_HASHES`` blocks).  Batching by time rather than by
event-loop turn keeps the syscalls and the siblings' wake-ups to a few hundred a second
whatever the request rate.
A sibling inserts them into its own policy's prefix index, as if
it had routed the request, so N workers keep the hit rate of one.  Sending never blocks: a
sibling that is restarting, or whose socket buffer is full, misses the record (counted in
``dropped``); the index is a hint, and the next request of that prefix teaches it again.

Most prompts start with a head the region has seen (a system prompt, a conversation's earlier
turns).  Every sibling decodes and inserts every record, so with N workers a prompt's head would
cost N - 1 inserts of every block; for 8 workers that was a fifth of their CPU.  So a record
leaves its head out (only the tail's blocks, from block ``start``) when the head is the part of
the prompt this worker's policy matched on the node (``Decision.expected_hit_tokens``) and this
worker sent that head to that node whole less than ``FULL_EVERY_S`` ago.  The siblings' claims
on the head are then at most that much older than on the tail, which the index allows
(``policies.prefix_index``); a sibling that missed the whole record learns the head within
``FULL_EVERY_S``.

Wire format, per record: ``u16`` node id length, ``u32`` first block, ``u32`` hash count, the
node id (UTF-8), the hashes (``u64``, native order: the datagram never leaves the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

MAX_DATAGRAM = 60_000
FULL_EVERY_S = 1.0  # a prompt head is sent whole to the siblings at least this often, per node
_TOLD_KEPT = 16_384  # (node, head) pairs sent whole that are remembered at most
_HEAD = struct.Struct("=HII")
_HASH_BYTES = array("Q").itemsize
MAX_HASHES = (MAX_DATAGRAM - _HEAD.size - 1024) // _HASH_BYTES  # a record fits one datagram


def prefix_socket(directory: Path, worker: int) -> Path:
    return directory / f"w{worker}.prefix"


def encode(node_id: str, hashes: Sequence[int], start: int = 0) -> bytes:
    """One record: a prompt's block hashes from block ``start`` on; raises ``OverflowError`` for
    a hash outside 0 .. 2**64 - 1."""
    name = node_id.encode("utf-8")
    return _HEAD.pack(len(name), start, len(hashes)) + name + array("Q", hashes).tobytes()


def decode(datagram: bytes) -> list[tuple[str, int, tuple[int, ...]]]:
    """The records of one datagram, each its node, first block and hashes; raises
    ``ValueError`` for a malformed one."""
    out = []
    view = memoryview(datagram)
    size = len(view)
    at = 0
    while at < size:
        if at + _HEAD.size > size:
            raise ValueError("a truncated record head")
        name_len, start, count = _HEAD.unpack_from(view, at)
        at += _HEAD.size
        end = at + name_len + count * _HASH_BYTES
        if end > size:
            raise ValueError("a truncated record")
        name = str(view[at : at + name_len], "utf-8")
        # the hashes read in place (a cast view reads unaligned items with memcpy), then copied
        out.append((name, start, tuple(view[at + name_len : end].cast("Q"))))
        at = end
    return out


class PrefixRelay:
    """Sends this worker's prefix records to its siblings and hands theirs to ``on_record``."""

    def __init__(
        self,
        *,
        directory: Path,
        worker: int,
        workers: int,
        on_record: Callable[[str, int, tuple[int, ...]], None],
        flush_after_s: float = 0.002,
        full_every_s: float = FULL_EVERY_S,
    ) -> None:
        self._directory = directory
        self._flush_after_s = flush_after_s
        self._full_every_s = full_every_s
        self._worker = worker
        self._siblings = [prefix_socket(directory, w) for w in range(workers) if w != worker]
        self._on_record = on_record
        self._socket: socket.socket | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None  # the pending batch's flush
        self._loop: asyncio.AbstractEventLoop | None = None
        self._told: dict[tuple[str, int], float] = {}  # (node, a head's last hash): sent whole
        self.sent = 0  # records sent (to each sibling)
        self.tails = 0  # of them, records that left their head out
        self.datagrams = 0  # batches sent (to each sibling)
        self.received = 0
        self.dropped = 0  # datagrams a sibling did not take (restarting, or its buffer full)
        self.malformed = 0

    def counts(self) -> dict[str, int]:
        """Records sent (each to every sibling) and received, and the datagrams a sibling did
        not take (``dropped``) or that came malformed: the metrics'
        (``Instruments.watch_prefix_relay``)."""
        return {
            "sent": self.sent,
            "received": self.received,
            "dropped": self.dropped,
            "malformed": self.malformed,
        }

    def start(self) -> None:
        """Bind this worker's socket and read it on the running loop."""
        path = prefix_socket(self._directory, self._worker)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # the socket of this worker's previous life
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(path))
        self._socket = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)

    def close(self) -> None:
        """Send the pending batch, then close the socket."""
        self._flush()
        if self._socket is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._socket.fileno())
            self._socket.close()
            self._socket = None

    def send(self, node_id: str, hashes: Sequence[int], matched: int = 0) -> None:
        """Tell the siblings ``node_id`` was sent a prompt of these block hashes (batched for
        ``flush_after_s``), of which this worker's policy matched the leading ``matched`` on it:
        those are left out when this worker sent them to that node whole less than
        ``full_every_s`` ago (module docstring).  A prompt of more than ``MAX_HASHES`` blocks
        (7,371: 118k tokens of 16) sends its leading ones."""
        if self._socket is None or not self._siblings or not hashes or self._loop is None:
            return
        start = 0
        if matched > 0:
            told = self._told
            key = (node_id, hashes[min(matched, len(hashes)) - 1])
            now = self._loop.time()
            if now - told.get(key, -math.inf) < self._full_every_s:
                start = matched
            else:
                if len(told) >= _TOLD_KEPT:  # keep those that still count
                    fresh = now - self._full_every_s
                    told = self._told = {k: t for k, t in told.items() if t > fresh}
                    if len(told) >= _TOLD_KEPT // 2:
                        told.clear()  # then some are sent whole again, sooner
                told[key] = now
        end = min(len(hashes), MAX_HASHES)  # the leading blocks: what a prefix match reads first
        if start >= end:
            return  # the siblings were told of all of it a moment ago
        try:
            record = encode(node_id, hashes[start:end], start)
        except OverflowError:
            return  # not a 64-bit hash: nothing a sibling's index could match
        if start:
            self.tails += 1
        if self._pending_bytes + len(record) > MAX_DATAGRAM:
            self._flush()  # a full batch leaves now, and its timer goes with it
        self._pending.append(record)
        self._pending_bytes += len(record)
        self.sent += 1
        if self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(self._flush_after_s, self._flush)

    def _flush(self) -> None:
        """Send the pending batch; at most one timer is ever pending, so batches leave at most
        once per ``flush_after_s`` besides the full ones."""
        if self._timer is not None:
            self._timer.cancel()  # a no-op when it is the timer that runs this
            self._timer = None
        if not self._pending or self._socket is None:
            return
        datagram = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        self.datagrams += 1
        for sibling in self._siblings:
            try:
                self._socket.sendto(datagram, str(sibling))
            except OSError:  # restarting (no socket, refused) or busy (buffer full)
                self.dropped += 1

    def _readable(self) -> None:
        sock = self._socket
        if sock is None:
            return
        for _ in range(64):  # then let the loop serve others; the reader fires again
            try:
                datagram = sock.recv(MAX_DATAGRAM + 1024)
            except (BlockingIOError, InterruptedError):
                return
            try:
                records = decode(datagram)
            except (ValueError, UnicodeDecodeError):
                self.malformed += 1
                continue
            for node_id, start, hashes in records:
                self.received += 1
                self._on_record(node_id, start, hashes)
