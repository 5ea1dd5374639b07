"""Hierarchical routing tables: hash buckets of prefixes and sessions → GPU groups, as ranges.

Per-GPU state never goes to etcd (docs/architecture.md, "etcd keyspace").  What agents share
through ``routing/<r>/groups/<key>`` is a coarse table: which *group* of GPUs (an 8-GPU server,
an NVLink domain, a rack) serves which *bucket* of requests.  Inside a group, the agent that
holds the request picks the GPU with its own policy and its own, unshared, per-GPU knowledge.

Buckets
    A request's routing key is hashed into one of ``n_buckets`` buckets (a power of two is not
    required).  Prefix keys (:func:`prefix_key`) hash the first ``key_blocks`` block hashes of
    the rendered prompt: enough blocks to get past what every request shares (every Mooncake
    request starts with block 0, so one block would put the whole trace in one bucket), few
    enough that a conversation's later turns still start with them.  A prompt with fewer blocks
    is keyed on the blocks it has.  Session keys (:func:`session_key`) hash the client's session
    id.  ``bucket_of(key)`` is ``key % n_buckets``; prefix and session buckets are two tables
    (``kind``), each covering ``[0, n_buckets)``.

Assignment (:func:`assign`)
    The bucket space is a ring and each group places ``vnodes`` points on it (BLAKE2b of
    ``"<group>#<i>"``): a bucket belongs to the first point at or after it, clockwise.  Because
    buckets are the ring itself, each group owns a handful of contiguous arcs, so the table is a
    short list of ranges (about ``vnodes`` per group).  Loads are bounded (Mirrokni, Thorup and
    Zadimoghaddam, 2016): a group takes at most ``ceil(load_factor * n_buckets * weight / total
    weight)`` buckets; buckets are placed in order from 0 and one that finds its group full
    walks on to the next point.  The assignment is a pure function of the group list, so every
    agent computes the same one without reading anything.  When a group joins or leaves, the
    arcs next to its points change hands, plus the buckets that spill over a bound: without a
    bound exactly the changed group's buckets move; with the default bound we measured at most
    2.8 fair shares (``n_buckets / groups``) over 1,200 random cases, and the tests hold it to 4.

Table (:class:`Table`)
    Maximal ranges ``[first, end) → group``, sorted, covering every bucket exactly once, adjacent
    ranges always of different groups.  A range is one etcd key, named by its ``first`` bucket.
    :meth:`Table.lookup` is a binary search.  Load moves (:func:`choose`: the bucket's group is
    far busier than the least-loaded one) reassign single buckets (:meth:`Table.reassign`), which
    splits at most one range into three.  Inside the group, :func:`choose_member` picks a GPU
    with no shared state: the GPU this agent last sent the key to, else the first in rendezvous
    order of the key that the load guard allows, so agents that never saw a prefix agree on it.

Flat tables (for comparison)
    The design this replaces: one entry per bucket naming a GPU (:func:`flat_entry`), learned
    from where requests went, one etcd key per entry.  Both kinds of table are published as
    ``Mapping[int, Range]`` keyed by the first bucket, so :func:`diff`, :func:`apply` and
    :class:`Debouncer` serve both.

Publishing
    :func:`diff` says which keys to put and delete to turn what the store holds into the agent's
    view; :func:`apply` is its inverse (``apply(old, diff(old, new)) == new``).  The
    :class:`Debouncer` publishes at most once per window: a change after a quiet window goes out
    at once (leading edge), changes inside a window wait for its end (trailing edge) and go out
    together; only keys touched since the last publish are compared (``dirty``;
    :meth:`Table.keys_around` says which keys a reassignment can touch).  Keys are written under
    the agent's lease, so a dead agent's entries expire and their buckets fall back to the
    assignment.

Sharing between agent replicas
    Several agents of one region write the same table; each routes by the table it last read,
    with its own changes applied at once.  A writer diffs against the keys it knows the store
    holds (not against its view, which holds other agents' changes too), so it writes only what
    it changed, and guards the transaction with a compare on the mod revision of every key it
    puts or deletes (0 for a key it believes absent).  Any two changes to the same stretch of
    buckets touch a common key, so one of them fails its compare; that agent reads again, redoes
    its moves on the fresh table and retries.  Stored ranges therefore never overlap.  A reader
    rebuilds the table by painting the stored ranges over the assignment (:meth:`Table.paint`),
    oldest ``mod_revision`` first, skipping ranges of groups that no longer exist; gaps (expired
    leases) read as the assignment.  Painting in revision order also gives a valid table, newest
    writer winning, should unguarded writes ever overlap.

Not thread-safe, no I/O, no clock: every time is the caller's ``now``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, NewType, TypeVar

from policies.model import NodeId

GroupId = NewType("GroupId", str)
Kind = Literal["prefix", "session"]
Owner = TypeVar("Owner", bound=str)  # a GroupId or a NodeId

DEFAULT_BUCKETS: Final = 16_384
DEFAULT_KEY_BLOCKS: Final = 2
DEFAULT_VNODES: Final = 8
DEFAULT_LOAD_FACTOR: Final = 1.25


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# -- keys and buckets ---------------------------------------------------------------------------


def prefix_key(block_hashes: Sequence[int], *, key_blocks: int = DEFAULT_KEY_BLOCKS) -> int | None:
    """A 64-bit routing key from the first ``key_blocks`` block hashes; ``None`` without blocks.

    The hashes need not be chained: the key covers every one of the first ``key_blocks``.
    """
    if key_blocks < 1:
        raise ValueError(f"key_blocks must be at least 1; got {key_blocks}")
    head = block_hashes[:key_blocks]
    if not head:
        return None
    return _hash64(b"p" + b"".join((h & (2**64 - 1)).to_bytes(8, "little") for h in head))


def session_key(session: str) -> int:
    """A 64-bit routing key from a client's session id."""
    return _hash64(b"s" + session.encode("utf-8"))


def bucket_of(key: int, *, n_buckets: int = DEFAULT_BUCKETS) -> int:
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be at least 1; got {n_buckets}")
    return key % n_buckets


# -- ranges and tables --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Range:
    """Buckets ``[first, end)`` → ``owner``: a group in a group table, a GPU in a flat one."""

    first: int
    end: int
    owner: str

    @property
    def size(self) -> int:
        return self.end - self.first


def _coalesce(ranges: Iterable[Range]) -> tuple[Range, ...]:
    out: list[Range] = []
    for r in ranges:
        if r.end <= r.first:
            continue
        if out and out[-1].owner == r.owner and out[-1].end == r.first:
            out[-1] = Range(first=out[-1].first, end=r.end, owner=r.owner)
        else:
            out.append(r)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Table:
    """Every bucket of ``[0, n_buckets)`` → one group, as maximal ranges sorted by ``first``."""

    kind: Kind
    n_buckets: int
    ranges: tuple[Range, ...]
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_buckets < 1:
            raise ValueError(f"n_buckets must be at least 1; got {self.n_buckets}")
        at = 0
        prev: str | None = None
        for r in self.ranges:
            if r.first != at or r.end <= r.first:
                raise ValueError(f"ranges must cover [0, {self.n_buckets}) in order; at {r}")
            if r.owner == prev:
                raise ValueError(f"adjacent ranges of one owner must be merged; at {r}")
            at, prev = r.end, r.owner
        if at != self.n_buckets:
            raise ValueError(f"ranges end at {at}, not at n_buckets {self.n_buckets}")
        object.__setattr__(self, "_firsts", tuple(r.first for r in self.ranges))

    @classmethod
    def from_owners(cls, owners: Sequence[str], *, kind: Kind = "prefix") -> Table:
        """The table whose bucket ``b`` belongs to ``owners[b]``."""
        ranges: list[Range] = []
        start = 0
        for b in range(1, len(owners) + 1):
            if b == len(owners) or owners[b] != owners[start]:
                ranges.append(Range(first=start, end=b, owner=owners[start]))
                start = b
        return cls(kind=kind, n_buckets=len(owners), ranges=tuple(ranges))

    def lookup(self, bucket: int) -> GroupId:
        """The group that serves ``bucket``."""
        if not 0 <= bucket < self.n_buckets:
            raise ValueError(f"bucket {bucket} is outside [0, {self.n_buckets})")
        return GroupId(self.ranges[bisect.bisect_right(self._firsts, bucket) - 1].owner)

    def owners(self) -> list[str]:
        """One owner per bucket, bucket 0 first."""
        out: list[str] = []
        for r in self.ranges:
            out.extend([r.owner] * r.size)
        return out

    def entries(self) -> dict[int, Range]:
        """What the store holds for this table: one key per range, named by its first bucket."""
        return {r.first: r for r in self.ranges}

    def shares(self) -> dict[str, int]:
        """Buckets per group."""
        out: dict[str, int] = {}
        for r in self.ranges:
            out[r.owner] = out.get(r.owner, 0) + r.size
        return out

    def reassign(self, first: int, end: int, owner: str) -> Table:
        """This table with buckets ``[first, end)`` given to ``owner``."""
        if not 0 <= first < end <= self.n_buckets:
            raise ValueError(f"[{first}, {end}) is not a non-empty span of [0, {self.n_buckets})")
        lo = bisect.bisect_right(self._firsts, first) - 1
        hi = bisect.bisect_left(self._firsts, end)  # ranges [lo, hi) overlap [first, end)
        start, stop = max(lo - 1, 0), min(hi + 1, len(self.ranges))  # and their neighbours
        middle = [
            Range(first=self.ranges[lo].first, end=first, owner=self.ranges[lo].owner),
            Range(first=first, end=end, owner=owner),
            Range(first=end, end=self.ranges[hi - 1].end, owner=self.ranges[hi - 1].owner),
        ]
        merged = _coalesce([*self.ranges[start:lo], *middle, *self.ranges[hi:stop]])
        ranges = (*self.ranges[:start], *merged, *self.ranges[stop:])
        return Table(kind=self.kind, n_buckets=self.n_buckets, ranges=ranges)

    def keys_around(self, first: int, end: int) -> frozenset[int]:
        """Keys of the ranges that overlap ``[first - 1, end + 1)``: every key that reassigning
        ``[first, end)`` can put or delete is among ``keys_around`` of the table before or after.
        """
        lo = bisect.bisect_right(self._firsts, max(first - 1, 0)) - 1
        hi = bisect.bisect_left(self._firsts, min(end + 1, self.n_buckets))
        return frozenset(self._firsts[lo:hi])

    def paint(self, ranges: Iterable[Range], *, allowed: Collection[str] | None = None) -> Table:
        """This table with ``ranges`` painted over it in order (later ones win on overlap).

        Ranges are clipped to ``[0, n_buckets)``; empty ones, and ones whose owner is not in
        ``allowed`` (when given), are skipped.  Pass the stored entries oldest write first.
        """
        owners = self.owners()
        for r in ranges:
            first, end = max(r.first, 0), min(r.end, self.n_buckets)
            if end <= first or (allowed is not None and r.owner not in allowed):
                continue
            owners[first:end] = [r.owner] * (end - first)
        return Table.from_owners(owners, kind=self.kind)


def assign(
    groups: Mapping[GroupId, float] | Sequence[GroupId],
    *,
    n_buckets: int = DEFAULT_BUCKETS,
    kind: Kind = "prefix",
    vnodes: int = DEFAULT_VNODES,
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> Table:
    """Buckets to groups by consistent hashing with bounded loads (see the module docstring).

    ``groups`` maps each group to its weight (its GPUs, say); a plain sequence weighs them
    equally.  A group gets ``vnodes`` points per unit of mean weight (at least one).
    """
    weights = dict(groups) if isinstance(groups, Mapping) else dict.fromkeys(groups, 1.0)
    if not weights:
        raise ValueError("at least one group is needed")
    if any(not w > 0 for w in weights.values()):
        raise ValueError("group weights must be positive")
    if vnodes < 1:
        raise ValueError(f"vnodes must be at least 1; got {vnodes}")
    if load_factor < 1:
        raise ValueError(f"load_factor must be at least 1; got {load_factor}")
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be at least 1; got {n_buckets}")
    total = sum(weights.values())
    mean = total / len(weights)
    points = sorted(
        (_hash64(f"{g}#{i}".encode()) % n_buckets, g)
        for g, w in weights.items()
        for i in range(max(1, round(vnodes * w / mean)))
    )
    positions = [p for p, _ in points]
    caps = {g: math.ceil(load_factor * n_buckets * w / total) for g, w in weights.items()}
    counts = dict.fromkeys(weights, 0)
    owners: list[str] = []
    at = 0  # index of the first point at or after the current bucket
    for b in range(n_buckets):
        while at < len(positions) and positions[at] < b:
            at += 1
        for step in range(len(points)):
            g = points[(at + step) % len(points)][1]
            if counts[g] < caps[g]:
                break
        counts[g] += 1
        owners.append(g)
    return Table.from_owners(owners, kind=kind)


def partition(nodes: Iterable[NodeId], *, group_size: int) -> dict[GroupId, tuple[NodeId, ...]]:
    """GPUs cut into groups of ``group_size`` in sorted order (``g000``, ``g001``, ...).

    A stand-in for topology (one server, one NVLink domain): a real deployment names its groups
    after the hardware, so that a GPU joining or leaving changes its group, not the table.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1; got {group_size}")
    ordered = sorted(set(nodes))
    return {
        GroupId(f"g{i // group_size:03d}"): tuple(ordered[i : i + group_size])
        for i in range(0, len(ordered), group_size)
    }


def flat_entry(bucket: int, gpu: NodeId) -> Range:
    """One entry of a flat per-GPU table: a one-bucket range owned by a GPU."""
    return Range(first=bucket, end=bucket + 1, owner=gpu)


# -- diffs and the debouncer --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Diff:
    """Keys to write: ranges to put (named by ``first``) and keys to delete."""

    puts: tuple[Range, ...] = ()
    deletes: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.puts and not self.deletes

    @property
    def keys(self) -> int:
        return len(self.puts) + len(self.deletes)


def diff(
    old: Mapping[int, Range], new: Mapping[int, Range], *, among: Iterable[int] | None = None
) -> Diff:
    """What to put and delete so that a store holding ``old`` holds ``new``.

    With ``among``, only those keys are compared (the ones touched since the last publish); the
    result is the full diff whenever every key that differs is among them.
    """
    keys = sorted(old.keys() | new.keys() if among is None else set(among))
    puts = tuple(new[k] for k in keys if k in new and old.get(k) != new[k])
    deletes = tuple(k for k in keys if k in old and k not in new)
    return Diff(puts=puts, deletes=deletes)


def apply(entries: Mapping[int, Range], change: Diff) -> dict[int, Range]:
    """``entries`` after ``change``: ``apply(old, diff(old, new)) == new``."""
    out = dict(entries)
    for k in change.deletes:
        out.pop(k, None)
    for r in change.puts:
        out[r.first] = r
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Debouncer:
    """Publish at most once per ``window_s``, only keys touched since the last publish.

    ``touch`` marks keys; ``due_at`` says when the next publish may go out (``None``: nothing to
    publish); ``flush`` returns the diff to write and the debouncer after writing it, or an empty
    diff and itself when nothing is due.  A change after a quiet window goes out at once.
    """

    window_s: float
    last_at: float | None = None
    dirty: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.window_s >= 0:
            raise ValueError(f"window_s must not be negative; got {self.window_s}")

    def touch(self, keys: Iterable[int]) -> Debouncer:
        added = self.dirty.union(keys)
        return self if len(added) == len(self.dirty) else replace(self, dirty=added)

    def due_at(self) -> float | None:
        if not self.dirty:
            return None
        return -math.inf if self.last_at is None else self.last_at + self.window_s

    def flush(
        self, published: Mapping[int, Range], view: Mapping[int, Range], *, now: float
    ) -> tuple[Debouncer, Diff]:
        """The diff from ``published`` (what the store holds) to ``view``, if one is due now."""
        due = self.due_at()
        if due is None or now < due:
            return self, Diff()
        change = diff(published, view, among=self.dirty)
        if change.empty:
            return replace(self, dirty=frozenset()), change
        return replace(self, dirty=frozenset(), last_at=now), change


# -- choices ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Guard:
    """The load guard: an owner is too busy when its load exceeds the least-loaded owner's by
    more than ``abs_threshold`` *and* by more than ``rel_threshold`` times (as ``prefix_aware``
    does per node).  Loads are requests in flight, per GPU for groups."""

    abs_threshold: float = 16.0
    rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.abs_threshold < 0:
            raise ValueError(f"abs_threshold must not be negative; got {self.abs_threshold}")
        if self.rel_threshold < 1:
            raise ValueError(f"rel_threshold must be at least 1; got {self.rel_threshold}")

    def too_busy(self, load: float, least: float) -> bool:
        return load - least > self.abs_threshold and load > self.rel_threshold * least


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """Where a bucket's request goes; ``changed``: the table entry changes (publish it)."""

    owner: str
    changed: bool
    reason: str


def _least(loads: Mapping[Owner, float], rng: random.Random) -> Owner:
    low = min(loads.values())
    tied = [k for k, v in loads.items() if v == low]
    return tied[0] if len(tied) == 1 else rng.choice(sorted(tied))


def choose(
    current: Owner | None, loads: Mapping[Owner, float], *, guard: Guard, rng: random.Random
) -> Choice:
    """Keep the table's owner unless the guard finds it too busy; place a new bucket on the
    least-loaded owner.  ``current``: the table's entry (``None`` when a flat table has none).
    """
    if not loads:
        raise ValueError("no owners to choose from")
    if current is not None and current in loads:
        least = min(loads.values())
        if not guard.too_busy(loads[current], least):
            return Choice(owner=current, changed=False, reason="table: home")
        pick = _least(loads, rng)
        return Choice(
            owner=pick,
            changed=True,
            reason=f"table: moved, home load {loads[current]:g} vs least {least:g}",
        )
    pick = _least(loads, rng)
    why = "new bucket" if current is None else f"home {current} gone"
    return Choice(owner=pick, changed=True, reason=f"table: {why}, least load")


def rendezvous(key: int, members: Iterable[Owner]) -> list[Owner]:
    """``members`` in highest-random-weight order for ``key``: every agent ranks them alike."""
    return sorted(members, key=lambda m: _hash64(f"{m}:{key}".encode()), reverse=True)


def choose_member(
    key: int,
    loads: Mapping[NodeId, float],
    *,
    remembered: NodeId | None,
    guard: Guard,
) -> Choice:
    """A GPU inside the chosen group, with no state shared between agents.

    The GPU this agent last sent ``key`` to, unless the guard finds it too busy; else the first
    GPU in rendezvous order that the guard allows, so that agents with no memory of ``key`` agree.
    ``changed`` is True when ``remembered`` is not the pick (the agent's memory changes).
    """
    if not loads:
        raise ValueError("no members to choose from")
    least = min(loads.values())
    if (
        remembered is not None
        and remembered in loads
        and not guard.too_busy(loads[remembered], least)
    ):
        return Choice(owner=remembered, changed=False, reason="group: remembered GPU")
    ranked = rendezvous(key, loads)
    for i, m in enumerate(ranked):
        if not guard.too_busy(loads[m], least):
            why = "rendezvous first" if i == 0 else f"rendezvous #{i + 1}, earlier ones busy"
            return Choice(owner=m, changed=m != remembered, reason=f"group: {why}")
    raise AssertionError("unreachable: the least-loaded member is never too busy")
