"""The group routing tables the agent routes by (docs/group-tables.md): state, no I/O.

:class:`GroupTables` holds, for each kind of table (``prefix``, ``session``), what the agent
routes by and what it must publish.  The ``groups`` policy (``policies.group_routing``) reads it
through ``policies.group_routing.Tables``; :class:`~regional_agent.group_routing.sync.TableSync`
feeds it what etcd holds (a read, then the watch) and writes what it has to publish, under the
agent's lease, in revision-guarded transactions.

* **Groups.**  Each node belongs to a GPU group (``nodes[].group``, default the node id: every
  node its own group).  A group weighs its nodes' weights summed.  The base table is
  ``groups.assign`` of the groups, a pure function: agents with the same nodes compute the same
  one, and only moves away from it are ever written to etcd.
* **View.**  The stored ranges painted over the base, oldest mod revision first, skipping groups
  this agent does not know, then this agent's own moves not yet published on top.
* **Publishing.**  A move (``groups.choose`` found the bucket's group too busy, or gone) changes
  the view at once and marks the keys around it dirty in the ``groups.Debouncer``.  A publish
  is the diff, among dirty keys, from what the agent knows etcd holds to its view, with the mod
  revision the agent last saw for each key (0: absent) as the transaction's compares.

Not thread-safe; every call runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from meridian_wire.models import GroupLayout
from policies import groups
from policies.group_routing import KINDS, GroupRoutingConfig
from policies.groups import GroupId, Kind, Range, Table
from policies.model import NodeId
from regional_agent.settings import GroupTableSettings

# node id -> (its group, its weight), for every node in the pool
Membership = Callable[[], Mapping[NodeId, tuple[GroupId, float]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stored:
    """One range as etcd holds it, with the revision of its last write."""

    range: Range
    mod_revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Publish:
    """What to write for one kind: the diff and the compares (first bucket -> mod revision the
    key must have; 0: it must be absent)."""

    kind: Kind
    diff: groups.Diff
    expect: dict[int, int]
    debouncer: groups.Debouncer  # the debouncer once this is written
    moves: int  # own moves it covers (the first ``moves`` of the pending list)


@dataclass(slots=True, kw_only=True)
class _KindState:
    kind: Kind
    table: Table
    known: dict[int, Range] = field(default_factory=dict)  # etcd, as the agent last saw it
    revs: dict[int, int] = field(default_factory=dict)  # their mod revisions
    gone: dict[int, int] = field(default_factory=dict)  # deleted keys -> revision of the delete
    unusable: dict[int, int] = field(default_factory=dict)  # keys held with a value ignored
    pending: list[tuple[int, int, GroupId]] = field(default_factory=list)  # own moves, unwritten
    since_flush: set[int] = field(default_factory=set)  # keys touched while a publish is out
    debouncer: groups.Debouncer = field(default_factory=lambda: groups.Debouncer(window_s=1.0))
    stale: bool = False  # watched changes not painted yet (painted when next needed)


class GroupTables:
    """The agent's group tables; ``membership()`` says which group each pool node is in."""

    def __init__(self, settings: GroupTableSettings, *, membership: Membership) -> None:
        self.settings = settings
        self._membership = membership
        self.weights: dict[GroupId, float] = {}
        self.members: dict[GroupId, tuple[NodeId, ...]] = {}
        self.group_of: dict[NodeId, GroupId] = {}
        self._base: dict[Kind, Table] = {}
        self._kinds: dict[Kind, _KindState] = {}
        self.moves = 0  # bucket moves this agent made
        self.reads = 0  # tables rebuilt from what etcd holds
        self.sync()

    def config(self, *, block_tokens: int, probation_every: int = 16) -> GroupRoutingConfig:
        """The ``groups`` policy's knobs from these tables' settings."""
        s = self.settings
        return GroupRoutingConfig(
            probation_every=probation_every,
            n_buckets=s.n_buckets,
            key_blocks=s.key_blocks,
            move_abs_threshold=s.move_abs_threshold,
            move_rel_threshold=s.move_rel_threshold,
            memory_keys=s.memory_keys,
            block_tokens=block_tokens,
        )

    # -- groups ------------------------------------------------------------------------------

    def sync(self) -> bool:
        """Follow the pool's groups; a change recomputes the base tables.  True if changed."""
        members: dict[GroupId, list[NodeId]] = {}
        weights: dict[GroupId, float] = {}
        group_of: dict[NodeId, GroupId] = {}
        for node, (grp, weight) in self._membership().items():
            members.setdefault(grp, []).append(node)
            weights[grp] = weights.get(grp, 0.0) + weight
            group_of[node] = grp
        weights = {g: round(w, 6) for g, w in sorted(weights.items())}
        self.group_of = group_of
        self.members = {g: tuple(sorted(m)) for g, m in sorted(members.items())}
        if weights == self.weights and self._kinds:
            return False
        self.weights = weights
        for kind in KINDS:
            base = self._assign(kind)
            self._base[kind] = base
            state = self._kinds.get(kind)
            if state is None:
                self._kinds[kind] = _KindState(
                    kind=kind,
                    table=base,
                    debouncer=groups.Debouncer(window_s=self.settings.debounce_s),
                )
            else:
                self._rebuild(state)
        return True

    def _assign(self, kind: Kind) -> Table:
        s = self.settings
        if not self.weights:  # no nodes: one placeholder group, so that lookups still work
            return Table(
                kind=kind,
                n_buckets=s.n_buckets,
                ranges=(Range(first=0, end=s.n_buckets, owner=""),),
            )
        return groups.assign(
            self.weights, n_buckets=s.n_buckets, kind=kind, vnodes=s.vnodes,
            load_factor=s.load_factor,
        )  # fmt: skip

    def layout(self) -> GroupLayout:
        """What the status tells the controller of these tables."""
        s = self.settings
        return GroupLayout(
            groups=dict(self.weights),
            n_buckets=s.n_buckets,
            vnodes=s.vnodes,
            load_factor=s.load_factor,
        )

    # -- what routing sees -------------------------------------------------------------------

    def table(self, kind: Kind) -> Table:
        return self._fresh(kind).table

    def _fresh(self, kind: Kind) -> _KindState:
        state = self._kinds[kind]
        if state.stale:
            self._rebuild(state)
        return state

    def base(self, kind: Kind) -> Table:
        return self._base[kind]

    def known(self, kind: Kind) -> dict[int, Stored]:
        state = self._kinds[kind]
        return {
            k: Stored(range=r, mod_revision=state.revs.get(k, 0)) for k, r in state.known.items()
        }

    def move(self, kind: Kind, bucket: int, owner: GroupId) -> None:
        """This agent moves ``bucket`` to ``owner``: the view changes now, etcd at the next
        publish."""
        self._reassign(kind, bucket, bucket + 1, owner)
        self.moves += 1

    def restore(self, kind: Kind, r: Range) -> None:
        """Put back a range this agent had published (it expired with a lost lease): a pending
        move like any other, published at the next flush."""
        self._reassign(kind, r.first, r.end, GroupId(r.owner))

    def _reassign(self, kind: Kind, first: int, end: int, owner: GroupId) -> None:
        state = self._fresh(kind)
        before = state.table
        after = before.reassign(first, end, owner)
        touched = before.keys_around(first, end) | after.keys_around(first, end)
        state.table = after
        state.pending.append((first, end, owner))
        state.debouncer = state.debouncer.touch(touched)
        state.since_flush |= touched

    # -- what etcd holds ---------------------------------------------------------------------

    def load(
        self,
        kind: Kind,
        entries: Mapping[int, Stored],
        *,
        unusable: Mapping[int, int] | None = None,
    ) -> None:
        """Everything etcd holds for ``kind`` now (after a read): replaces what was known.
        ``unusable``: keys that hold a value the agent ignores, and their mod revisions (a
        write to one must compare against them)."""
        state = self._kinds[kind]
        state.known = {k: e.range for k, e in entries.items()}
        state.revs = {k: e.mod_revision for k, e in entries.items()}
        state.unusable = dict(unusable or {})
        state.gone.clear()
        self._rebuild(state)

    def changed(
        self, kind: Kind, first: int, value: Range | None, revision: int, *, unusable: bool = False
    ) -> bool:
        """One watched change (``value`` None: deleted, or ``unusable``); old news is ignored.
        Call :meth:`rebuild` after a batch.  True if it was news."""
        state = self._kinds[kind]
        seen = max(state.revs.get(first, 0), state.gone.get(first, 0), state.unusable.get(first, 0))
        if revision <= seen:
            return False
        state.known.pop(first, None)
        state.revs.pop(first, None)
        state.gone.pop(first, None)
        state.unusable.pop(first, None)
        if value is not None:
            state.known[first] = value
            state.revs[first] = revision
        elif unusable:
            state.unusable[first] = revision
        else:
            state.gone[first] = revision
        return True

    def rebuild(self, kind: Kind) -> None:
        """Watched changes arrived: repaint the table when it is next needed (a burst of
        events costs one repaint, about 10 ms at 16,384 buckets)."""
        self._kinds[kind].stale = True

    def _rebuild(self, state: _KindState) -> None:
        order = sorted(state.known, key=lambda k: (state.revs.get(k, 0), k))
        allowed = set(self.weights)
        table = self._base[state.kind].paint((state.known[k] for k in order), allowed=allowed)
        touched: set[int] = set()
        for first, end, owner in state.pending:  # own unpublished moves stay on top
            if owner not in allowed:
                continue
            touched |= table.keys_around(first, end)
            table = table.reassign(first, end, owner)
            touched |= table.keys_around(first, end)
        state.table = table
        state.debouncer = state.debouncer.touch(touched)
        state.stale = False
        self.reads += 1

    # -- publishing --------------------------------------------------------------------------

    def due_at(self) -> float | None:
        for kind in KINDS:
            self._fresh(kind)  # a repaint may re-dirty keys of pending moves
        dues = [d for s in self._kinds.values() if (d := s.debouncer.due_at()) is not None]
        return min(dues) if dues else None

    def flush(self, kind: Kind, *, now: float) -> Publish | None:
        """What to write for ``kind`` now, or ``None`` (nothing due, or nothing differs)."""
        state = self._fresh(kind)
        debouncer, change = state.debouncer.flush(state.known, state.table.entries(), now=now)
        if change.empty:
            state.debouncer = debouncer
            if not state.debouncer.dirty:
                state.pending.clear()  # every own move is in etcd already (or undone by others)
            return None
        touched = [r.first for r in change.puts] + list(change.deletes)
        state.since_flush = set()
        return Publish(
            kind=kind,
            diff=change,
            expect={k: state.revs.get(k, state.unusable.get(k, 0)) for k in touched},
            debouncer=debouncer,
            moves=len(state.pending),
        )

    def published(self, publish: Publish, *, revision: int) -> None:
        """``publish`` was written at ``revision``."""
        state = self._kinds[publish.kind]
        for k in publish.diff.deletes:
            state.known.pop(k, None)
            state.revs.pop(k, None)
            state.gone[k] = revision
        for r in publish.diff.puts:
            state.known[r.first] = r
            state.revs[r.first] = revision
            state.gone.pop(r.first, None)
            state.unusable.pop(r.first, None)
        del state.pending[: publish.moves]
        state.debouncer = publish.debouncer.touch(state.since_flush)
        state.since_flush = set()


def stored_entries(values: Iterable[tuple[int, Range, int]]) -> dict[int, Stored]:
    """``(first, range, mod_revision)`` triples as :meth:`GroupTables.load` takes them."""
    return {first: Stored(range=r, mod_revision=rev) for first, r, rev in values}
