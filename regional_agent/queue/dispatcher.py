"""The region's central queue: a request waits here until a node has a free slot for it.

Routing happens when a request leaves the queue, not when it arrives, so it goes where things
stand then.  The queue is drained whenever something a request could be routed on changes — a
slot frees, a node's health or admin state changes, a telemetry round lands — through
``NodePool.notify``.  Ordering and admission are ``policies.admission``'s; where a request goes
is the routing policy's.

A request is refused at once when no node serves its model (404) or none that does can take
traffic at all (503: all drained, ejected or unhealthy — waiting would only hide an outage);
it waits when routable nodes exist but their slots are full, up to ``max_depth`` waiting per
model (429 with Retry-After past that) and its deadline (504).  At ``max_depth`` a newcomer
that outranks someone waiting sheds the newest waiting request of the lowest class below it
(that one gets the 429) instead of being refused itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meridian_service.clock import Clock
from policies import admission, routing
from policies.model import Decision, NodeId, NodeView, RequestView
from regional_agent.errors import DeadlineExceeded, NoCapacity, QueueFull, UnknownModel
from regional_agent.nodes import NodePool
from regional_agent.settings import QueueSettings

log = logging.getLogger(__name__)

_CHOICES = 3  # decisions a request may take when sibling workers keep taking the chosen slot


class PrefixClaims(Protocol):
    """With several workers, the prompts a sibling sent somewhere moments ago, before the
    prefix relay tells this worker (``regional_agent.workers.shared.LoadShare``)."""

    def claimed(self, hashes: Sequence[int], start: int) -> tuple[str, int] | None: ...

    def claim(self, node_id: str, hashes: Sequence[int], start: int) -> None: ...


@dataclass(slots=True, kw_only=True, eq=False)
class Lease:
    """A request's hold on one slot of one node; release it exactly once."""

    node_id: NodeId
    decision: Decision
    tokens: int
    prefill_tokens: int  # uncached prompt tokens counted on the node until the first token
    queue_wait_s: float
    policy: str
    _dispatcher: Dispatcher
    released: bool = False
    task: asyncio.Task[Any] | None = None  # the proxy's, while an attempt is at the node
    cancelling: int = 0  # the task's cancel requests when the attempt began
    cut: bool = False  # a drain's timeout cancelled the attempt (cut_off)

    def cut_off(self) -> bool:
        """A drain ran out of time: cancel the attempt at the node, which the proxy turns into
        a node failure (retried elsewhere before the first byte, else the stream's error
        event).  ``False`` when no attempt is running or it was cut already."""
        if self.task is None or self.cut:
            return False
        self.cut = True
        self.task.cancel()
        return True

    def first_token(self) -> None:
        """The node sent the first token: the prefill counted for this request is done."""
        if not self.released and self.prefill_tokens:
            self._dispatcher._pool.first_token(self.node_id, prefill=self.prefill_tokens)
            self.prefill_tokens = 0

    def release(self, *, failed: bool = False) -> None:
        if not self.released:
            self.released = True
            self._dispatcher._release(self, failed=failed)


@dataclass(slots=True, kw_only=True)
class _Waiter:
    item: admission.Waiting
    request: RequestView
    exclude: frozenset[NodeId]
    future: asyncio.Future[Lease]
    tokens: int


@dataclass(slots=True)
class DispatchStats:
    routed: Counter[str] = field(default_factory=Counter)  # by policy reason
    rejected: Counter[str] = field(default_factory=Counter)  # by cause
    arrivals: int = 0  # requests asked for a slot, retries not counted (the autoscaler's rate)


class Dispatcher:
    def __init__(
        self,
        *,
        pool: NodePool,
        policy: routing.Policy,
        settings: QueueSettings,
        clock: Clock,
        rng: random.Random,
    ) -> None:
        self._pool = pool
        self.policy = policy
        self._settings = settings
        self._clock = clock
        self._rng = rng
        self._waiting: dict[int, _Waiter] = {}
        self._seq = itertools.count()
        self._leases: dict[NodeId, set[Lease]] = {}
        self.stats = DispatchStats()
        # with several workers: tells the siblings where a prompt went, and how many of its
        # leading blocks the policy matched there (workers.siblings)
        self.on_routed: Callable[[NodeId, tuple[int, ...], int], None] | None = None
        # with several workers: takes in where the siblings sent prompts, before a decision
        self.before_choosing: Callable[[], None] | None = None
        # with several workers: where they sent new prompts moments ago (_with_claims)
        self.claims: PrefixClaims | None = None
        # with several workers: a request now waits for a slot (the share loop's fast pace)
        self.on_queued: Callable[[], None] | None = None
        self._learns = routing.learns_prefixes(policy)
        pool.subscribe(self.pump)

    # -- public ----------------------------------------------------------------------------

    def set_policy(self, policy: routing.Policy) -> None:
        log.info("routing policy changed from=%s to=%s", self.policy.name, policy.name)
        self.policy = policy
        self._learns = routing.learns_prefixes(policy)
        self.pump()

    def depth(self, model: str | None = None) -> int:
        if model is None:
            return len(self._waiting)
        return sum(1 for w in self._waiting.values() if w.request.model == model)

    def demand(self) -> tuple[int, int]:
        """The requests waiting for a slot, and the requests that have asked for one (retries
        not counted): what the autoscaler's load policy reads (``autoscaler.Demand``)."""
        return len(self._waiting), self.stats.arrivals

    def leases(self, node_id: NodeId) -> Iterable[Lease]:
        return list(self._leases.get(node_id, ()))

    async def acquire(
        self, request: RequestView, *, tokens: int, exclude: frozenset[NodeId] = frozenset()
    ) -> Lease:
        """Wait for a slot; raises UnknownModel, NoCapacity, QueueFull or DeadlineExceeded."""
        now = self._clock.now()
        if not exclude:
            self.stats.arrivals += 1
        views = self._pool.views(now=now)
        routable = views.routable(request.model)  # computed once per change of the pool
        if not routable and not any(request.model in v.models for v in views):
            self.stats.rejected["unknown-model"] += 1
            models = ", ".join(sorted(self._pool.models())) or "none yet"
            raise UnknownModel(
                f"The model `{request.model}` does not exist. Models served here: {models}.",
                param="model",
            )
        if not routable or (exclude and all(i in exclude for i in routable)):
            self.stats.rejected["no-capacity"] += 1
            raise NoCapacity(
                f"no node can serve `{request.model}` now: all are drained, ejected or "
                "unhealthy (or already failed this request)"
            )
        # fast path: nobody of the same model is ahead, try to route right now
        if not any(w.request.model == request.model for w in self._waiting.values()):
            lease = self._try_route(request, exclude, tokens, enqueued_s=now, views=views)
            if lease is not None:
                return lease
        item = admission.Waiting(seq=next(self._seq), priority=request.priority, enqueued_s=now)
        full = not admission.admit(self.depth(request.model), max_depth=self._settings.max_depth)
        if full and not self._shed_for(request, now=now):
            self.stats.rejected["queue-full"] += 1
            raise QueueFull(
                f"the queue for `{request.model}` is full ({self._settings.max_depth} waiting); "
                f"retry after {self._settings.retry_after_s} s",
                retry_after_s=self._settings.retry_after_s,
            )
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._waiting[item.seq] = _Waiter(
            item=item, request=request, exclude=exclude, future=future, tokens=tokens
        )
        if self.on_queued is not None:
            self.on_queued()
        self.pump()
        try:
            async with asyncio.timeout(self._settings.deadline_s):
                lease = await asyncio.shield(future)
        except TimeoutError:
            self._abandon(item.seq, future)
            self.stats.rejected["deadline"] += 1
            raise DeadlineExceeded(
                f"waited {self._settings.deadline_s:g} s in the queue for `{request.model}` "
                "without a free node; the region is overloaded"
            ) from None
        except BaseException:  # the client went away while waiting
            self._abandon(item.seq, future)
            raise
        return lease

    def pump(self) -> None:
        """Route every waiting request that can go somewhere now, in priority order."""
        if not self._waiting:
            return
        now = self._clock.now()
        views = self._pool.views(now=now)
        ordered = admission.order(
            [w.item for w in self._waiting.values()],
            now=now,
            max_wait_low_s=self._settings.max_wait_low_s,
        )
        blocked: set[str] = set()  # models whose head could not be routed
        for item in ordered:
            waiter = self._waiting.get(item.seq)
            if waiter is None or waiter.future.done():
                continue
            if waiter.request.model in blocked and not waiter.exclude:
                continue  # keep order within a model: nobody overtakes a blocked head
            lease = self._try_route(
                waiter.request,
                waiter.exclude,
                waiter.tokens,
                enqueued_s=item.enqueued_s,
                views=views,
            )
            if lease is None:
                blocked.add(waiter.request.model)
                continue
            del self._waiting[item.seq]
            waiter.future.set_result(lease)
            views = self._pool.views(now=now)

    # -- internals -------------------------------------------------------------------------

    def _with_claims(
        self,
        claims: PrefixClaims,
        request: RequestView,
        views: Sequence[NodeView],
        decision: Decision,
        target: NodeId,
        now: float,
    ) -> tuple[Decision, NodeId]:
        """Where this worker's index holds less of the prompt than a sibling's claim covers
        (the sibling sent it somewhere moments ago and the relay has not said so yet), the
        claim is learnt as if relayed and the request chosen again: N workers that meet a new
        prompt at once send it where one agent would (``workers.shared``, module docstring).
        The prompt's blocks past what the index held are claimed for the node chosen, at once,
        so that a sibling deciding on the same prompt now reads the claim the sooner.  (Not
        for a probation trial, which goes where it goes.  The second choice counts as a
        decision towards the next trial too: a trial may come one decision early.)"""
        hashes = request.block_hashes
        found = claims.claimed(hashes, decision.expected_hit_tokens // request.block_tokens)
        if found is not None and found[0] == target:
            return decision, target  # claimed already, for this node
        if found is not None and found[0] in self._pool:
            node_id = NodeId(found[0])
            head = RequestView(
                model=request.model,
                prompt_tokens=0,
                max_tokens=0,
                block_hashes=hashes[: found[1]],
                block_tokens=request.block_tokens,
            )
            self.policy.observe_routed(head, node_id, now=now)
            again = self.policy.choose(request, views, now=now, rng=self._rng)
            if again.node is not None:
                decision, target = again, again.node
                if target == node_id:  # counted apart (the reason's first word)
                    decision = dataclasses.replace(again, reason=f"sibling-claim: {again.reason}")
        claims.claim(target, hashes, decision.expected_hit_tokens // request.block_tokens)
        return decision, target

    def _try_route(
        self,
        request: RequestView,
        exclude: frozenset[NodeId],
        tokens: int,
        *,
        enqueued_s: float,
        views: Sequence[NodeView],
    ) -> Lease | None:
        if self.before_choosing is not None:
            self.before_choosing()
        now = self._clock.now()
        for _ in range(_CHOICES):
            if exclude:  # a retry: a plain list, which every policy scores in full
                views = [v for v in views if v.node_id not in exclude]
            decision = self.policy.choose(request, views, now=now, rng=self._rng)
            target = decision.node
            if target is None:
                return None
            claims = self.claims
            if claims is not None and self._learns and request.block_hashes and not decision.trial:
                decision, target = self._with_claims(claims, request, views, decision, target, now)
            prefill = max(0, request.prompt_tokens - decision.expected_hit_tokens)
            if self._pool.acquire(target, tokens=tokens, prefill=prefill):
                break
            # a sibling worker took the node's last slot since this worker's view: choose
            # again on its fresh count
            views = self._pool.views(now=now)
        else:
            return None  # it waits: a freed slot wakes the queue
        self.policy.observe_routed(request, target, now=now)
        if self.on_routed is not None and request.block_hashes:
            self.on_routed(
                target, request.block_hashes, decision.expected_hit_tokens // request.block_tokens
            )
        node = self._pool.get(target)
        if node is not None:
            node.decisions.append(decision)
        self.stats.routed[decision.tag] += 1
        lease = Lease(
            node_id=target,
            decision=decision,
            tokens=tokens,
            prefill_tokens=prefill,
            queue_wait_s=now - enqueued_s,
            policy=self.policy.name,
            _dispatcher=self,
        )
        self._leases.setdefault(target, set()).add(lease)
        return lease

    def _shed_for(self, request: RequestView, *, now: float) -> bool:
        """The model's queue is full: shed the newest waiting request of the lowest class below
        ``request``'s (``admission.make_room``), answering it 429, so that ``request`` may
        wait in its place.  False when nobody waiting ranks below it."""
        same = [w.item for w in self._waiting.values() if w.request.model == request.model]
        victim = admission.make_room(
            same,
            priority=request.priority,
            now=now,
            max_wait_low_s=self._settings.max_wait_low_s,
        )
        if victim is None:
            return False
        waiter = self._waiting.pop(victim.seq)
        self.stats.rejected["shed"] += 1
        log.info(
            "shed a waiting request for a higher-priority one model=%s shed_priority=%d "
            "new_priority=%d",
            request.model,
            waiter.request.priority,
            request.priority,
        )
        if not waiter.future.done():
            waiter.future.set_exception(
                QueueFull(
                    f"the queue for `{request.model}` is full ({self._settings.max_depth} "
                    "waiting) and this request was shed for one of higher priority; retry "
                    f"after {self._settings.retry_after_s} s",
                    retry_after_s=self._settings.retry_after_s,
                )
            )
        return True

    def _release(self, lease: Lease, *, failed: bool) -> None:
        held = self._leases.get(lease.node_id)
        if held is not None:
            held.discard(lease)
            if not held:
                del self._leases[lease.node_id]
        self._pool.release(
            lease.node_id, tokens=lease.tokens, failed=failed, prefill=lease.prefill_tokens
        )  # notifies: pump
        lease.prefill_tokens = 0

    def _abandon(self, seq: int, future: asyncio.Future[Lease]) -> None:
        """A waiter gave up; if it was routed in the meantime, give the slot back."""
        self._waiting.pop(seq, None)
        if future.done():
            if not future.cancelled() and future.exception() is None:
                future.result().release()
        else:
            future.cancel()
