"""Request traces for the fleet simulator: readers, a synthetic generator, rate scaling.

Every workload becomes a list of :class:`TraceRequest`: an arrival time, prompt and output
lengths, and the prompt's content as a list of **block ids** of ``block_tokens`` tokens each.
Equal ids at the same position mean equal content, and because ids are prefix-unique (an id is
always preceded by the same ids), two requests that share their first ``k`` ids share their
first ``k * block_tokens`` tokens.  This is the Mooncake trace's own format: each of its
``hash_ids`` stands for one 512-token block.

**Mapping onto the engine's blocks.**  :class:`BlockPrompt` turns ids into token ids without
materialising them: block id ``h``'s tokens are the 32-bit words of SHAKE-128(``h``), so equal
ids give equal tokens on every node and in the agent's hashing, whatever the node's KV block
size (16 tokens for the GPU profiles: one Mooncake block is 32 engine blocks).  The last id of
a prompt covers only the tokens that remain (``input_length`` need not be a multiple of 512).
:class:`BlockHasher` computes the chained hashes of ``policies.prompt.block_hashes`` for such a
prompt, memoised per block id when the engine's block size divides ``block_tokens`` (hashing a
12k-token prompt from scratch costs milliseconds; the Mooncake trace has 180k distinct ids).

**Readers.**

- :func:`read_mooncake`: JSON lines with ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (kvcache-ai/Mooncake's FAST'25 traces).
- :func:`read_azure`: Azure LLM inference CSV, ``TIMESTAMP,ContextTokens,GeneratedTokens``;
  no prefixes, so every request gets fresh ids.

Malformed input raises :class:`WorkloadError` naming the file, the line and the field.

**Synthetic.**  :func:`synthetic` makes sessions (Poisson session starts, a geometric number
of turns, exponential think time between turns); each session opens with one of a set of
shared system prompts picked with Zipf popularity, and each turn's prompt is the previous
turn's prompt plus the previous answer plus a new user message (multi-turn growth).

**Rate scaling.**  :func:`node_capacity_rps` measures one node's capacity for a trace's length
mix on the engine itself (see its docstring); :func:`scale_to_rate` stretches or compresses the
timestamps so that the mean arrival rate is a target (``load * nodes * capacity``).
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, overload

from meridian_sim.engine import Engine
from meridian_sim.profile import Profile
from policies import prompt

MOONCAKE_BLOCK_TOKENS: Final = 512
_FRESH_ID_BASE: Final = 1 << 40  # ids handed out to requests without prefix information


class WorkloadError(ValueError):
    """A trace file that cannot be read; the message names the file, line and field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request of a trace: when it arrives, how long it is, and what its prompt holds."""

    timestamp_s: float  # arrival, seconds from the trace's start
    input_length: int  # prompt tokens
    output_length: int  # tokens to generate (the simulator uses ignore_eos)
    hash_ids: tuple[int, ...]  # prompt content: one id per block of block_tokens tokens
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    session: str | None = None  # a session key when the trace has one


def block_bytes(block_id: int, block_tokens: int) -> bytes:
    """The little-endian 32-bit token ids of block id ``block_id``, as bytes (SHAKE-128)."""
    return hashlib.shake_128(block_id.to_bytes(8, "little")).digest(4 * block_tokens)


def _token(block_id: int, j: int, block_tokens: int) -> int:
    """Token ``j`` of block id ``block_id``."""
    data = block_bytes(block_id, block_tokens)
    return int.from_bytes(data[4 * j : 4 * j + 4], "little")


class BlockPrompt(Sequence[int]):
    """The token ids of a prompt described by block ids, computed on access (no big tuples)."""

    __slots__ = ("_block_tokens", "_ids", "_length")

    def __init__(self, hash_ids: Sequence[int], *, length: int, block_tokens: int) -> None:
        if length > len(hash_ids) * block_tokens:
            raise ValueError(
                f"{len(hash_ids)} blocks of {block_tokens} tokens cannot hold {length} tokens"
            )
        self._ids = tuple(hash_ids)
        self._length = length
        self._block_tokens = block_tokens

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._length)))
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError("BlockPrompt index out of range")
        q, r = divmod(i, self._block_tokens)
        return _token(self._ids[q], r, self._block_tokens)

    def __iter__(self) -> Iterator[int]:
        bt = self._block_tokens
        for q in range(-(-self._length // bt)):
            data = block_bytes(self._ids[q], bt)
            for r in range(min(bt, self._length - q * bt)):
                yield int.from_bytes(data[4 * r : 4 * r + 4], "little")


def prompt_of(request: TraceRequest) -> BlockPrompt:
    return BlockPrompt(
        request.hash_ids, length=request.input_length, block_tokens=request.block_tokens
    )


class BlockHasher:
    """``policies.prompt.block_hashes`` of trace prompts at one block size, memoised per id.

    Valid because ids are prefix-unique: the chain entering block id ``h`` is always the same.
    When ``block_size`` does not divide the trace's ``block_tokens`` it hashes from scratch.
    """

    def __init__(self, *, block_size: int) -> None:
        self.block_size = block_size
        self._memo: dict[tuple[int, int], tuple[int, ...]] = {}

    def hashes(self, request: TraceRequest) -> tuple[int, ...]:
        bs, bt = self.block_size, request.block_tokens
        if bt % bs:
            return prompt.block_hashes(prompt_of(request), block_size=bs)
        per_block = bt // bs
        full = request.input_length // bs
        out: list[int] = []
        parent: int | None = None
        for k, h in enumerate(request.hash_ids):
            if len(out) >= full:
                break
            chain = self._memo.get((bt, h))
            if chain is None:
                chain = _chain(block_bytes(h, bt), block_size=bs, parent=parent)
                self._memo[(bt, h)] = chain
            take = min(per_block, full - k * per_block)
            out.extend(chain[:take])
            parent = chain[-1]
        return tuple(out)


def _chain(data: bytes, *, block_size: int, parent: int | None) -> tuple[int, ...]:
    """``prompt.block_hashes`` over tokens given as packed little-endian 32-bit bytes.

    Byte for byte what ``prompt.hash_block`` feeds BLAKE2b (a test holds the two equal), but one
    update per block instead of one per token.
    """
    step = 4 * block_size
    out: list[int] = []
    prev = parent
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(digest_size=8)
        h.update((prev if prev is not None else 0).to_bytes(8, "little"))
        h.update(b"\x01" if prev is not None else b"\x00")
        h.update(data[start : start + step])
        prev = int.from_bytes(h.digest(), "little")
        out.append(prev)
    return tuple(out)


# -- readers ------------------------------------------------------------------------------------


def _int_field(row: dict[str, object], key: str, where: str, *, minimum: int) -> int:
    if key not in row:
        raise WorkloadError(f"{where}: missing field {key!r}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where}: field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise WorkloadError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


def read_mooncake(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines); ``limit``: at most this many requests.

    ``timestamp`` is in milliseconds; each of ``hash_ids`` is one 512-token block, and the ids
    must cover the prompt (``ceil(input_length / 512)`` of them).  Requests are returned in the
    file's order, which must be by time.
    """
    p = Path(path)
    out: list[TraceRequest] = []
    try:
        f = p.open(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {p}: {exc.strerror}") from exc
    with f:
        last_ts = -math.inf
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{where}: expected a JSON object")
            ts_raw = row.get("timestamp")
            if isinstance(ts_raw, bool) or not isinstance(ts_raw, int | float):
                raise WorkloadError(f"{where}: field 'timestamp' must be a number, got {ts_raw!r}")
            if ts_raw < 0 or not math.isfinite(ts_raw):
                raise WorkloadError(f"{where}: field 'timestamp' must be >= 0, got {ts_raw}")
            if ts_raw < last_ts:
                raise WorkloadError(f"{where}: field 'timestamp' goes back in time ({ts_raw})")
            last_ts = ts_raw
            input_length = _int_field(row, "input_length", where, minimum=1)
            output_length = _int_field(row, "output_length", where, minimum=1)
            ids = row.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
            ):
                raise WorkloadError(
                    f"{where}: field 'hash_ids' must be a list of non-negative integers"
                )
            needed = -(-input_length // MOONCAKE_BLOCK_TOKENS)
            if len(ids) < needed:
                raise WorkloadError(
                    f"{where}: field 'hash_ids' has {len(ids)} blocks of "
                    f"{MOONCAKE_BLOCK_TOKENS} tokens, input_length {input_length} needs {needed}"
                )
            out.append(
                TraceRequest(
                    timestamp_s=ts_raw / 1000.0,
                    input_length=input_length,
                    output_length=output_length,
                    hash_ids=tuple(ids[:needed]),
                )
            )
    if not out:
        raise WorkloadError(f"{p}: no requests in the trace")
    return out


def _parse_azure_time(text: str, where: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (7 fractional digits) → POSIX seconds."""
    head, _, frac = text.strip().partition(".")
    try:
        base = dt.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
        fraction = float(f"0.{frac}") if frac else 0.0
    except ValueError:
        raise WorkloadError(
            f"{where}: field 'TIMESTAMP' must look like 2023-11-16 18:17:03.98, got {text!r}"
        ) from None
    return base.timestamp() + fraction


def read_azure(
    path: str | Path, *, limit: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Read an Azure LLM inference trace (CSV); timestamps become seconds from the first row.

    The trace has no prompt content, so every request gets its own fresh block ids (no prefix
    is shared).  Rows must be in time order.
    """
    p = Path(path)
    try:
        f = p.open(encoding="utf-8", newline="")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {p}: {exc.strerror}") from exc
    out: list[TraceRequest] = []
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != expected:
            raise WorkloadError(f"{p}:1: expected the header {','.join(expected)}, got {header}")
        first: float | None = None
        last = -math.inf
        next_id = _FRESH_ID_BASE
        for lineno, row in enumerate(reader, start=2):
            if limit is not None and len(out) >= limit:
                break
            if not row:
                continue
            where = f"{p}:{lineno}"
            if len(row) != 3:
                raise WorkloadError(f"{where}: expected 3 fields, got {len(row)}")
            t = _parse_azure_time(row[0], where)
            lengths: list[int] = []
            for name, raw in zip(expected[1:], row[1:], strict=True):
                try:
                    value = int(raw)
                except ValueError:
                    raise WorkloadError(
                        f"{where}: field {name!r} must be an integer, got {raw!r}"
                    ) from None
                if value < 1:
                    raise WorkloadError(f"{where}: field {name!r} must be >= 1, got {value}")
                lengths.append(value)
            if t < last:
                raise WorkloadError(f"{where}: field 'TIMESTAMP' goes back in time ({row[0]})")
            last = t
            if first is None:
                first = t
            n_blocks = -(-lengths[0] // block_tokens)
            ids = tuple(range(next_id, next_id + n_blocks))
            next_id += n_blocks
            out.append(
                TraceRequest(
                    timestamp_s=t - first,
                    input_length=lengths[0],
                    output_length=lengths[1],
                    hash_ids=ids,
                    block_tokens=block_tokens,
                )
            )
    if not out:
        raise WorkloadError(f"{p}: no requests in the trace")
    return out


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake for ``.jsonl``/``.json``, Azure for ``.csv``."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_mooncake(path, limit=limit)
    if suffix == ".csv":
        return read_azure(path, limit=limit)
    raise WorkloadError(f"{path}: unknown trace format (expected .jsonl Mooncake or .csv Azure)")


# -- synthetic ----------------------------------------------------------------------------------


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


def synthetic(
    *,
    duration_s: float,
    sessions_per_s: float,
    rng: random.Random,
    num_system_prompts: int = 32,
    zipf_s: float = 1.1,
    system_prompt_tokens: tuple[int, int] = (512, 4096),
    mean_turns: float = 4.0,
    mean_think_s: float = 20.0,
    mean_user_tokens: int = 200,
    mean_output_tokens: int = 300,
    max_input_tokens: int = 32_768,
    block_tokens: int = 16,
) -> list[TraceRequest]:
    """Multi-turn sessions over shared system prompts (see the module docstring).

    Lengths are whole blocks of ``block_tokens``; the system prompt of rank ``k`` (1-based) is
    chosen with probability proportional to ``1 / k**zipf_s`` and its length is drawn once,
    uniformly in ``system_prompt_tokens``.  A session stops early when its next prompt would
    pass ``max_input_tokens``.  Requests come back sorted by arrival.
    """
    if duration_s <= 0 or sessions_per_s <= 0:
        raise ValueError("duration_s and sessions_per_s must be positive")
    if mean_turns < 1:
        raise ValueError("mean_turns must be at least 1")
    next_id = 1

    def fresh(tokens: int) -> list[int]:
        nonlocal next_id
        n = max(1, -(-tokens // block_tokens))
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    lo, hi = system_prompt_tokens
    systems = [fresh(rng.randint(lo, hi)) for _ in range(num_system_prompts)]
    weights = _zipf_weights(num_system_prompts, zipf_s)
    out: list[TraceRequest] = []
    p_stop = 1.0 / mean_turns
    t = rng.expovariate(sessions_per_s)
    session = 0
    while t < duration_s:
        (sys_ids,) = rng.choices(systems, weights=weights)
        ids = list(sys_ids)
        turn_t = t
        while turn_t < duration_s:
            ids += fresh(int(rng.expovariate(1.0 / mean_user_tokens)) + 1)
            if len(ids) * block_tokens > max_input_tokens:
                break
            output = int(rng.expovariate(1.0 / mean_output_tokens)) + 1
            out.append(
                TraceRequest(
                    timestamp_s=turn_t,
                    input_length=len(ids) * block_tokens,
                    output_length=output,
                    hash_ids=tuple(ids),
                    block_tokens=block_tokens,
                    session=f"s{session}",
                )
            )
            if rng.random() < p_stop:
                break
            ids += fresh(output)  # the answer becomes part of the next prompt
            turn_t += rng.expovariate(1.0 / mean_think_s)
        session += 1
        t += rng.expovariate(sessions_per_s)
    out.sort(key=lambda r: r.timestamp_s)
    return out


# -- rate scaling -------------------------------------------------------------------------------


def mean_rate_per_s(requests: Sequence[TraceRequest]) -> float:
    """Arrivals per second over the trace's span (first to last arrival)."""
    if len(requests) < 2:
        raise ValueError("a rate needs at least two requests")
    span = requests[-1].timestamp_s - requests[0].timestamp_s
    if span <= 0:
        raise ValueError("every request arrives at the same instant: the trace has no rate")
    return (len(requests) - 1) / span


def scale_to_rate(requests: Sequence[TraceRequest], *, rate_per_s: float) -> list[TraceRequest]:
    """The same requests with timestamps multiplied so the mean rate is ``rate_per_s``."""
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be positive")
    factor = mean_rate_per_s(requests) / rate_per_s
    t0 = requests[0].timestamp_s
    return [replace(r, timestamp_s=(r.timestamp_s - t0) * factor) for r in requests]


def node_capacity_rps(
    profile: Profile,
    requests: Sequence[TraceRequest],
    *,
    slots: int = 64,
    sample: int = 256,
    warmup: int = 32,
) -> float:
    """Requests per second one node completes on this length mix with no prefix reuse.

    Method: ``sample`` requests spread evenly over the trace, each with fresh content (so no
    prefix is shared: capacity does not depend on the routing policy), are kept ``slots`` at a
    time in one engine (the agent's per-node cap), each generating exactly its
    ``output_length``; the engine steps in virtual time with the profile's step costs.  The
    capacity is the completion rate after the first ``warmup`` completions, up to the last.
    Requests too long for the profile are left out of the sample; a trace shorter than
    ``sample`` is repeated.
    """
    fits = [
        r
        for r in requests
        if r.input_length + r.output_length <= profile.max_model_len
        and r.input_length + r.output_length <= profile.kv_cache_tokens
    ]
    if not fits:
        raise WorkloadError(
            f"no request of the trace fits the profile {profile.name!r} "
            f"(max_model_len {profile.max_model_len}, {profile.kv_cache_tokens} KV tokens)"
        )
    if warmup + 2 > sample:
        raise ValueError("sample must exceed warmup by at least 2")
    if len(fits) >= sample:
        picked = fits[:: len(fits) // sample][:sample]
    else:  # a short trace: its mix, repeated
        picked = [fits[i % len(fits)] for i in range(sample)]
    engine = Engine(profile, rng=random.Random(0))
    pending = list(reversed(picked))
    now = 0.0
    done_times: list[float] = []
    fresh_id = _FRESH_ID_BASE * 4

    def add_one() -> None:
        nonlocal fresh_id
        r = pending.pop()
        ids = range(fresh_id, fresh_id + len(r.hash_ids))
        fresh_id += len(r.hash_ids)
        tokens = BlockPrompt(ids, length=r.input_length, block_tokens=r.block_tokens)
        engine.add(f"c{len(pending)}", tokens, max_tokens=r.output_length, ignore_eos=True, now=now)

    in_flight = 0
    while pending and in_flight < slots:
        add_one()
        in_flight += 1
    while engine.has_unfinished:
        result = engine.step(now=now)
        now += result.duration_s
        for _ in result.finished:
            done_times.append(now)
            in_flight -= 1
            if pending:
                add_one()
                in_flight += 1
    span = done_times[-1] - done_times[warmup - 1]
    return (len(done_times) - warmup) / span


def shaped(
    requests: Sequence[TraceRequest],
    *,
    base_rps: float,
    shape: Sequence[tuple[float, float]],
    duration_s: float,
) -> list[TraceRequest]:
    """The trace's requests arriving at ``base_rps`` times a multiplier that varies over time:
    ``shape`` is ``(t, multiplier)`` points, linear between them and flat after the last (a 2x
    spike: ``[(0, 1), (300, 1), (360, 2), (900, 2), (960, 1)]``).

    The trace is first scaled to ``base_rps``, then its clock is warped: a request at ``s``
    arrives when ``integral of the multiplier from 0 to t`` reaches ``s``, so the trace's own
    burstiness rides on the shape.  A trace too short for ``duration_s`` is repeated, each
    repeat with fresh block ids and sessions (a new population of prompts).
    """
    if base_rps <= 0 or duration_s <= 0:
        raise ValueError("base_rps and duration_s must be positive")
    points = list(shape)
    if any(b[0] <= a[0] for a, b in itertools.pairwise(points)):
        raise ValueError("shape's times must increase strictly (a step is two close points)")
    if not points or points[0][0] != 0 or any(m <= 0 for _, m in points):
        raise ValueError("shape must start at t = 0, with multipliers > 0")
    base = scale_to_rate(requests, rate_per_s=base_rps)
    period = base[-1].timestamp_s + 1.0 / base_rps
    offset = 1 + max(max(r.hash_ids, default=0) for r in base)
    # the warped clock, segment by segment: (t0, t1, m0, m1, area before t0)
    segments: list[tuple[float, float, float, float, float]] = []
    area = 0.0
    for (t0, m0), (t1, m1) in itertools.pairwise(points):
        segments.append((t0, t1, m0, m1, area))
        area += (t1 - t0) * (m0 + m1) / 2
    last_t, last_m = points[-1]

    def warp(s: float) -> float:
        for t0, t1, m0, m1, before in segments:
            inside = (t1 - t0) * (m0 + m1) / 2
            if s <= before + inside:
                # solve before + m0*x + (m1-m0)/(2*(t1-t0))*x^2 = s for x in [0, t1-t0]
                a = (m1 - m0) / (2 * (t1 - t0)) if t1 > t0 else 0.0
                rest = s - before
                if abs(a) < 1e-12:
                    return t0 + rest / m0
                return t0 + (-m0 + math.sqrt(m0 * m0 + 4 * a * rest)) / (2 * a)
        return last_t + (s - area) / last_m

    out: list[TraceRequest] = []
    cycle = 0
    while True:
        for r in base:
            t = warp(r.timestamp_s + cycle * period)
            if t >= duration_s:
                return out
            out.append(
                replace(
                    r,
                    timestamp_s=t,
                    hash_ids=tuple(h + cycle * offset for h in r.hash_ids) if cycle else r.hash_ids,
                    session=None if r.session is None else f"{r.session}~{cycle}",
                )
            )
        cycle += 1
