"""A vLLM-like engine core: continuous batching over a paged KV cache with prefix caching.

The engine does no I/O and reads no clock: the caller passes ``now`` (seconds, in the
simulation's own time) and owns the loop.  The HTTP node (``meridian_sim.node``) steps it in real
time; the fleet simulator steps it in virtual time.  One call to :meth:`Engine.step` is one
forward pass of vLLM's V1 engine:

1. **Schedule** (vLLM V1's unified scheduler).  A token budget of ``max_num_batched_tokens``
   is spent first on running requests in order — one token for a decoding request, the next
   chunk of the prompt for one still prefilling (chunked prefill) — and then on waiting
   requests, first come first served, while fewer than ``max_num_seqs`` run.  A running request
   that needs a new KV block when none is free preempts the most recently admitted running
   request (recompute: its blocks are freed, it goes back to the front of the queue).  No
   waiting request is admitted in a step that preempted.
2. **Cost**.  The step's duration comes from the profile (``meridian_sim.profile``): tokens in the
   step, KV tokens read by decoding requests, and prefill attention pairs.
3. **Advance**.  Every request whose tokens are all in the KV cache after the step samples one
   token, stamped at the end of the step.  A request stops at its target length (``length``
   when that is ``max_tokens``, else ``stop``: the simulated model said EOS).

The KV cache (:class:`KVCache`) has a fixed number of blocks.  A full block is registered under
the chained hash of its tokens (``policies.prompt.block_hashes``); a new request reuses the
longest run of cached blocks at the start of its prompt (never the block holding the last
prompt token, which vLLM always recomputes).  Freed blocks keep their contents and hash until
they are reused: free blocks are handed out least recently used first, and a request's blocks
are freed tail first so that shared prefixes are evicted last.  KV usage is
``1 - free_blocks / num_blocks`` as in vLLM (cached but unreferenced blocks count as free).
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from meridian_sim.profile import Profile
from policies import prompt

FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")

# Words the simulated model "says"; ids come from the same tokenizer as prompts.
GENERATED_WORDS: Final = (
    " the",
    " a",
    " model",
    " token",
    " cache",
    " region",
    " request",
    " node",
    " fast",
    " serve",
    " route",
    " prefix",
    " queue",
    " batch",
    " and",
    " of",
    " to",
    " in",
    " is",
    ".",
)


class EngineError(Exception):
    """Base error of the engine (a request that can never fit, an unknown request id)."""


class RequestTooLarge(EngineError):
    """The prompt plus ``max_tokens`` exceeds the model's context or the whole KV cache."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, kw_only=True)
class _Request:
    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    target_tokens: int
    arrival_s: float
    queued_s: float
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    cached_prompt_tokens: int = 0
    counted: bool = False
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_preemptions: int = 0
    prompt_len: int = 0  # len(prompt_token_ids), kept: the fleet's prompts compute it in Python

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        n = self.prompt_len
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenEvent:
    """One generated token; ``finish_reason`` is set on a request's last event."""

    request_id: str
    index: int
    token_id: int
    text: str
    time_s: float
    itl_s: float | None  # time since the request's previous token; None for the first
    finish_reason: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """Timings and counts of a finished (or aborted) request, for metrics and usage."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    cached_prompt_tokens: int
    max_tokens: int
    num_preemptions: int
    arrival_s: float
    queued_s: float  # when it entered the engine's queue (arrival plus the request overhead)
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    started_s: float
    duration_s: float
    num_scheduled_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    num_preempted: int
    tokens: tuple[TokenEvent, ...]
    finished: tuple[RequestRecord, ...]


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters, named after the vLLM metrics they feed."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    request_success: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0)
    )


@dataclass(frozen=True, slots=True)
class CacheStored:
    """Blocks the cache registered, in prompt order (vLLM's ``BlockStored``): their hashes,
    the hash of the block before the first (``None``: the prompt's first block), and the
    ``block_size`` token ids of each (none when the engine keeps no token ids in its events)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheRemoved:
    """Blocks the cache evicted (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The whole prefix cache was dropped (vLLM's ``AllBlocksCleared``): a reset with no block
    in use."""


CacheEvent = CacheStored | CacheRemoved | CacheCleared


class KVCache:
    """Fixed-size paged KV cache with hash-addressed prefix reuse and LRU eviction.

    With ``record_events`` it keeps what it stored and evicted, in order, in :attr:`events`
    (the caller takes and clears them: the node publishes them as vLLM's KV events).
    """

    def __init__(self, *, num_blocks: int, block_size: int, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events: list[CacheEvent] | None = [] if record_events else None
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Free blocks, least recently freed first; insertion order is eviction order.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def lookup(self, hashes: list[int], *, max_blocks: int) -> list[int]:
        """Blocks holding the longest cached run of ``hashes`` from the start."""
        found: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            b, _none = self._free.popitem(last=False)
            old = self._hash_of[b]
            if old is not None:  # evict the cached contents
                del self._by_hash[old]
                self._hash_of[b] = None
                evicted.append(old)
            self._ref[b] = 1
            out.append(b)
        if evicted and self.events is not None:
            self.events.append(CacheRemoved(tuple(evicted)))
        return out

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail first: prefixes stay cached longest
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def register(self, block: int, block_hash: int) -> bool:
        """Cache ``block`` under ``block_hash``; False when either is taken already."""
        if block_hash in self._by_hash or self._hash_of[block] is not None:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no request holds.  The event is vLLM's when no block is in
        use (``AllBlocksCleared``); vLLM refuses a reset while one is, this drops the rest and
        says which (``BlockRemoved``)."""
        dropped: list[int] = []
        for h, b in list(self._by_hash.items()):
            if self._ref[b] == 0:
                del self._by_hash[h]
                self._hash_of[b] = None
                dropped.append(h)
        if self.events is not None:
            if not any(self._ref):
                self.events.append(CacheCleared())
            elif dropped:
                self.events.append(CacheRemoved(tuple(dropped)))


class Engine:
    """One simulated vLLM engine.  Not thread-safe; drive it from one task."""

    def __init__(
        self,
        profile: Profile,
        *,
        rng: random.Random,
        record_events: bool = False,
        event_token_ids: bool = True,
    ) -> None:
        """``record_events``: keep the cache's events (:meth:`take_events`), with each stored
        block's token ids unless ``event_token_ids`` is False (the fleet simulator's agents key
        blocks by the engine's hashes, and a trace's synthetic tokens are costly to make)."""
        self.profile = profile
        self._event_token_ids = event_token_ids
        self.kv = KVCache(
            num_blocks=profile.num_gpu_blocks,
            block_size=profile.block_size,
            record_events=record_events,
        )
        self.stats = EngineStats()
        self._rng = rng
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._word_ids = [prompt.tokenize(w)[0] for w in GENERATED_WORDS]

    # -- state -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    # -- requests --------------------------------------------------------------------------

    def check_fits(self, *, prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`RequestTooLarge` when a request could never be served."""
        total = prompt_tokens + max_tokens
        if total > self.profile.max_model_len:
            raise RequestTooLarge(
                f"This model's maximum context length is {self.profile.max_model_len} tokens. "
                f"However, you requested {total} tokens ({prompt_tokens} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                "of max_tokens."
            )
        if total > self.kv.num_blocks * self.kv.block_size:
            raise RequestTooLarge(
                f"the request needs {total} tokens of KV cache but the node holds "
                f"{self.kv.num_blocks * self.kv.block_size}"
            )

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        now: float,
        arrival_s: float | None = None,
        block_hashes: Sequence[int] | None = None,
    ) -> None:
        """Queue a request at ``now``; ``arrival_s`` (default ``now``) is when it reached the
        server, which TTFT and end-to-end latency count from.

        ``block_hashes``, when given, must be ``prompt.block_hashes(prompt_token_ids,
        block_size=profile.block_size)``: the fleet simulator passes them memoised."""
        if request_id in self._requests:
            raise EngineError(f"duplicate request id {request_id!r}")
        if not prompt_token_ids:
            raise RequestTooLarge("the prompt is empty: it must have at least one token")
        if max_tokens < 1:
            raise RequestTooLarge("max_tokens must be at least 1")
        self.check_fits(prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens)
        if ignore_eos:
            target = max_tokens
        else:
            sampled = 1 + int(self._rng.expovariate(1.0 / self.profile.mean_output_tokens))
            target = min(max_tokens, max(min_tokens, sampled))
        req = _Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            target_tokens=max(1, target),
            arrival_s=now if arrival_s is None else arrival_s,
            queued_s=now,
        )
        if block_hashes is None:
            block_hashes = prompt.block_hashes(prompt_token_ids, block_size=self.kv.block_size)
        req.block_hashes = list(block_hashes)
        self._requests[request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str, *, now: float) -> RequestRecord | None:
        """Stop a request (client gone); ``None`` when it already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status is Status.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        return self._finish(req, "abort", now)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def take_events(self) -> list[CacheEvent]:
        """What the cache stored and evicted since the last call (``record_events``), oldest
        first; empty without it."""
        events = self.kv.events
        if not events:
            return []
        taken = list(events)
        events.clear()
        return taken

    # -- the step --------------------------------------------------------------------------

    def step(self, *, now: float, latency_multiplier: float = 1.0) -> StepResult:
        scheduled: list[tuple[_Request, int]] = []
        budget = self.profile.max_num_batched_tokens
        preempted = 0

        # 1. running requests, in admission order
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self._grow(req, num_new):
                victim = self._running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1

        # 2. waiting requests, first come first served
        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < self.profile.max_num_seqs
        ):
            req = self._waiting[0]
            hit = self._lookup_prefix(req)
            num_new = min(req.num_tokens - len(hit) * self.kv.block_size, budget)
            needed = self._blocks_for(len(hit) * self.kv.block_size + num_new) - len(hit)
            # touch first, so that allocating cannot evict the blocks we are about to reuse
            self.kv.touch(hit)
            fresh = self.kv.allocate(needed)
            if fresh is None:
                self.kv.free(hit)
                break
            self._waiting.popleft()
            req.block_ids = hit + fresh
            req.num_registered_blocks = len(hit)
            req.num_computed_tokens = len(hit) * self.kv.block_size
            if not req.counted:
                req.counted = True
                req.cached_prompt_tokens = req.num_computed_tokens
                self.stats.prefix_cache_queries += req.prompt_len
                self.stats.prefix_cache_hits += req.num_computed_tokens
                self.stats.prompt_tokens += req.prompt_len
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now
            req.status = Status.RUNNING
            self._running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        # 3. cost of the step
        tokens_in_step = 0
        kv_read = 0
        pairs = 0.0
        prefills = decodes = 0
        for req, num_new in scheduled:
            tokens_in_step += num_new
            before = req.num_computed_tokens
            if num_new == 1 and before >= req.prompt_len:
                kv_read += before
                decodes += 1
            else:
                pairs += num_new * before + num_new * num_new / 2
                prefills += 1
        duration_s = 0.0
        if scheduled:
            duration_s = (
                self.profile.timing.step_ms(
                    tokens_in_step=tokens_in_step,
                    kv_tokens_read=kv_read,
                    token_pairs=pairs,
                    decode_seqs=decodes,
                )
                * latency_multiplier
                / 1000.0
            )
        end = now + duration_s

        # 4. advance: compute the scheduled tokens, sample where a request is caught up
        events: list[TokenEvent] = []
        finished: list[RequestRecord] = []
        for req, num_new in scheduled:
            req.num_computed_tokens += num_new
            self._register_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # still prefilling
            k = self._rng.randrange(len(GENERATED_WORDS))
            token_id, text = self._word_ids[k], GENERATED_WORDS[k]
            req.output_token_ids.append(token_id)
            self.stats.generation_tokens += 1
            if req.first_token_s is None:
                req.first_token_s = end
            itl_s = None if req.last_token_s is None else end - req.last_token_s
            req.last_token_s = end
            n_out = len(req.output_token_ids)
            reason: str | None = None
            if n_out >= req.target_tokens:
                reason = "length" if n_out >= req.max_tokens else "stop"
            self._extend_hashes(req)
            events.append(
                TokenEvent(
                    request_id=req.request_id,
                    index=n_out - 1,
                    token_id=token_id,
                    text=text,
                    time_s=end,
                    itl_s=itl_s,
                    finish_reason=reason,
                )
            )
            if reason is not None:
                self._running.remove(req)
                finished.append(self._finish(req, reason, end))

        return StepResult(
            started_s=now,
            duration_s=duration_s,
            num_scheduled_tokens=tokens_in_step,
            num_prefill_requests=prefills,
            num_decode_requests=decodes,
            num_preempted=preempted,
            tokens=tuple(events),
            finished=tuple(finished),
        )

    # -- internals -------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.kv.block_size)

    def _lookup_prefix(self, req: _Request) -> list[int]:
        # vLLM never serves the last token from cache: it must be computed to sample.
        max_blocks = (req.num_tokens - 1) // self.kv.block_size
        return self.kv.lookup(req.block_hashes, max_blocks=max_blocks)

    def _grow(self, req: _Request, num_new: int) -> bool:
        needed = self._blocks_for(req.num_computed_tokens + num_new) - len(req.block_ids)
        if needed <= 0:
            return True
        fresh = self.kv.allocate(needed)
        if fresh is None:
            return False
        req.block_ids.extend(fresh)
        return True

    def _preempt(self, req: _Request) -> None:
        self.kv.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._waiting.appendleft(req)

    def _extend_hashes(self, req: _Request) -> None:
        bs = self.kv.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            start = len(req.block_hashes) * bs
            parent = req.block_hashes[-1] if req.block_hashes else None
            block = [req.token_at(j) for j in range(start, start + bs)]
            req.block_hashes.append(prompt.hash_block(block, parent=parent))

    def _register_full_blocks(self, req: _Request) -> None:
        kv = self.kv
        full = min(req.num_computed_tokens // kv.block_size, len(req.block_hashes))
        if kv.events is None:
            for j in range(req.num_registered_blocks, full):
                kv.register(req.block_ids[j], req.block_hashes[j])
        else:  # one event per run of newly cached blocks, as vLLM's BlockStored
            run: list[int] = []
            for j in range(req.num_registered_blocks, full + 1):
                if j < full and kv.register(req.block_ids[j], req.block_hashes[j]):
                    run.append(j)
                    continue
                if run:
                    bs = kv.block_size
                    first, last = run[0], run[-1]
                    kv.events.append(
                        CacheStored(
                            block_hashes=tuple(req.block_hashes[first : last + 1]),
                            parent_block_hash=req.block_hashes[first - 1] if first else None,
                            token_ids=tuple(
                                req.token_at(t) for t in range(first * bs, (last + 1) * bs)
                            )
                            if self._event_token_ids
                            else (),
                        )
                    )
                    run = []
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def _finish(self, req: _Request, reason: str, now: float) -> RequestRecord:
        if req.block_ids:
            self.kv.free(req.block_ids)
            req.block_ids = []
        req.status = Status.FINISHED
        del self._requests[req.request_id]
        self.stats.request_success[reason] += 1
        return RequestRecord(
            request_id=req.request_id,
            finish_reason=reason,
            prompt_tokens=req.prompt_len,
            generation_tokens=len(req.output_token_ids),
            cached_prompt_tokens=req.cached_prompt_tokens,
            max_tokens=req.max_tokens,
            num_preemptions=req.num_preemptions,
            arrival_s=req.arrival_s,
            queued_s=req.queued_s,
            first_scheduled_s=req.first_scheduled_s,
            first_token_s=req.first_token_s,
            finished_s=now,
        )
