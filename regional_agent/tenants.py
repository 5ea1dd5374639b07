"""The data plane's API keys and tenants: who may call ``/v1/*``, with what priority, on which
models, at what rate (docs/agent.md, "Tenants, keys and rate limits").

**Open mode.**  Without ``tenants.keys_file`` every client is served as before: ``X-Priority``
and ``X-Tenant`` are honoured and ``Authorization`` is forwarded to the node.  The agent logs a
WARNING at start: this is for trusted networks only.

**With keys.**  ``tenants.keys_file`` (``settings.KeysFile``) lists tenants and the SHA-256 of
each of their keys.  A request's ``Authorization: Bearer <key>`` is hashed and compared with
every configured hash in constant time (``hmac.compare_digest``, all of them, no early exit),
as the controller checks its admin tokens.  A missing or unknown key is 401, the same answer
either way, naming no tenant and no key.  The key's tenant then decides: its priority class
(``X-Priority`` only when the tenant has ``trust_priority``; ``X-Tenant`` never), its models
(403 naming the model), its limits (429), and the key is not forwarded to the node.

**Reload.**  The file is read again when its modification time, size or inode changes (checked
every ``tenants.reload_interval_s``; a Kubernetes Secret's atomic symlink swap is a change) and
on SIGHUP (``regional_agent.app.reload_on_signal``).  A file that does not load keeps the keys
in force, and the log says why; rate-limit usage carries over for tenants that stay.

**Rate limits.**  Per tenant, ``policies.ratelimit``: requests and tokens per minute over a
sliding window.  A request reserves ``prompt_tokens + max_tokens`` and is settled with what it
used (:class:`UsageTally`).  The limits are the region's: with several agent replicas each
enforces its share, ``ratelimit.share(limit, replicas, rank)``, from the live replicas the
publisher sees in etcd (:meth:`Tenants.set_replicas`); alone, or without etcd, the whole limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from meridian_service.clock import Clock
from policies import admission, ratelimit
from regional_agent.errors import Forbidden, InvalidKey, RateLimited
from regional_agent.observability import usage_of
from regional_agent.settings import KeysFile, TenantsSettings, load_keys_file

log = logging.getLogger(__name__)

KEY_PREFIX = "mk-"  # recognisable in a leak scan; the rest is 256 random bits
_UNAUTHORIZED = (
    "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key issued for "
    "this service"
)


def new_key() -> tuple[str, str]:
    """A new random API key and its SHA-256 (hex), as the keys file lists it."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, digest(key)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
    name: str
    priority: int  # policies.admission class: 0 high, 1 normal, 2 low
    models: frozenset[str]  # empty: every model
    limits: ratelimit.Limits  # the region's
    trust_priority: bool

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(slots=True, kw_only=True)
class Admission:
    """An admitted request's reservation, settled once at its end (:meth:`Tenants.settle`)."""

    tenant: Tenant
    ticket: ratelimit.Ticket
    headers: dict[str, str]  # x-ratelimit-* for the response
    settled: bool = False


@dataclass(slots=True)
class _Table:
    keys: list[tuple[bytes, Tenant]] = field(default_factory=list)  # (hex SHA-256, tenant)
    tenants: dict[str, Tenant] = field(default_factory=dict)


def _table(file: KeysFile) -> _Table:
    table = _Table()
    for entry in file.tenants:
        tenant = Tenant(
            name=entry.name,
            priority=admission.PRIORITIES[entry.priority],
            models=frozenset(entry.models),
            limits=ratelimit.Limits(requests=entry.rpm, tokens=entry.tpm),
            trust_priority=entry.trust_priority,
        )
        table.tenants[tenant.name] = tenant
        table.keys.extend((k.sha256.encode(), tenant) for k in entry.keys)
    return table


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells that the file changed: modification time, size and inode (of the target of
    a symlink: a Secret volume swaps one); ``None`` when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class Tenants:
    """The keys and tenants in force, their rate limiters, and the replica share."""

    def __init__(self, settings: TenantsSettings, *, clock: Clock) -> None:
        self._settings = settings
        self._clock = clock
        self._path = settings.keys_file
        self._table = _Table()
        self._limiters: dict[str, ratelimit.Limiter] = {}
        self.replicas = 1
        self.rank = 0
        self.reloads = 0  # good reloads since start
        self.failed_reloads = 0
        self._seen: tuple[int, int, int] | None = None
        if self._path is not None:
            self._seen = _signature(self._path)
            self._table = _table(load_keys_file(self._path))  # ValueError: stops the start

    # -- what the edge asks ------------------------------------------------------------------

    @property
    def open(self) -> bool:
        """No keys file: every client is served, nothing is checked."""
        return self._path is None

    @property
    def counts(self) -> tuple[int, int]:
        """(tenants, keys) in force."""
        return len(self._table.tenants), len(self._table.keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of the request's bearer key; ``None`` in open mode; else 401
        (``InvalidKey``), the same whether the key is missing, malformed or unknown."""
        if self.open:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        presented = digest(key.strip()).encode() if key.strip() else b""
        found: Tenant | None = None
        for stored, tenant in self._table.keys:  # every hash: the time does not tell which
            if hmac.compare_digest(presented, stored):
                found = tenant
        if found is None or scheme.lower() != "bearer":
            raise InvalidKey(_UNAUTHORIZED)
        return found

    def authorize(self, tenant: Tenant, model: str) -> None:
        """403 naming the model when the tenant may not use it."""
        if not tenant.may_use(model):
            allowed = ", ".join(f"`{m}`" for m in sorted(tenant.models))
            raise Forbidden(
                f"this API key may not use the model `{model}`; it may use {allowed}",
                param="model",
            )

    def shares(self, tenant: Tenant) -> ratelimit.Limits:
        """The tenant's limits on this replica: its share of the region's."""

        def one(limit: int | None) -> int | None:
            if limit is None:
                return None
            return ratelimit.share(limit, replicas=self.replicas, rank=self.rank)

        return ratelimit.Limits(
            requests=one(tenant.limits.requests), tokens=one(tenant.limits.tokens)
        )

    def admit(self, tenant: Tenant, *, tokens: int) -> Admission:
        """Take one request and ``tokens`` from the tenant's limits, or 429 (``RateLimited``,
        with the ``x-ratelimit-*`` headers and Retry-After) taking nothing."""
        limits = self.shares(tenant)
        limiter = self._limiters.setdefault(tenant.name, ratelimit.Limiter())
        verdict = limiter.admit(tokens=tokens, limits=limits, now=self._clock.now())
        headers = _headers(verdict)
        if verdict.ticket is None:
            headers.update(_retry_after(verdict.retry_after_s))
            raise RateLimited(
                _refusal(tenant, verdict, limits, self),
                limit_headers=headers,
                cause=verdict.exceeded or "",
            )
        return Admission(tenant=tenant, ticket=verdict.ticket, headers=headers)

    def settle(self, admitted: Admission, *, used: int) -> None:
        """Correct the reservation with what the request used (once; later calls do nothing)."""
        if admitted.settled:
            return
        admitted.settled = True
        limiter = self._limiters.get(admitted.tenant.name)
        current = self._table.tenants.get(admitted.tenant.name)
        if limiter is None or current is None:
            return  # the tenant was removed meanwhile
        limiter.settle(
            admitted.ticket, used=used, limit=self.shares(current).tokens, now=self._clock.now()
        )

    def tenant(self, name: str) -> Tenant | None:
        return self._table.tenants.get(name)

    def limiter(self, name: str) -> ratelimit.Limiter | None:
        return self._limiters.get(name)

    # -- replicas (the publisher's callback) -------------------------------------------------

    def set_replicas(self, replicas: int, rank: int) -> None:
        """This agent is replica ``rank`` (0-based) of ``replicas`` live in its region: each
        tenant's limits here become ``ratelimit.share`` of the region's."""
        replicas = max(1, replicas)
        rank = min(max(0, rank), replicas - 1)
        if (replicas, rank) != (self.replicas, self.rank):
            log.info(
                "rate-limit shares: the region's limits split over %d agent processes "
                "(replicas, each of their workers), this one rank %d",
                replicas,
                rank,
            )
        self.replicas, self.rank = replicas, rank

    # -- reload ------------------------------------------------------------------------------

    def reload(self, *, reason: str) -> bool:
        """Read the keys file again; on any problem keep the keys in force and log why."""
        if self._path is None:
            return False
        self._seen = _signature(self._path)
        try:
            table = _table(load_keys_file(self._path))
        except ValueError as exc:
            self.failed_reloads += 1
            tenants, keys = self.counts
            log.warning(
                "API keys not reloaded (%s): %s; keeping the keys in force (%d keys of %d tenants)",
                reason,
                exc,
                keys,
                tenants,
            )
            return False
        before = {d for d, _ in self._table.keys}
        after = {d for d, _ in table.keys}
        self._table = table
        self._limiters = {n: lim for n, lim in self._limiters.items() if n in table.tenants}
        self.reloads += 1
        log.info(
            "API keys reloaded (%s) file=%s tenants=%d keys=%d added=%d removed=%d",
            reason,
            self._path,
            len(table.tenants),
            len(table.keys),
            len(after - before),
            len(before - after),
        )
        return True

    def check_file(self) -> bool:
        """Reload when the file changed since it was last read; whether it was reloaded."""
        if self._path is None or _signature(self._path) == self._seen:
            return False
        return self.reload(reason="file changed")

    async def watch_loop(self) -> None:
        """Check the keys file every ``tenants.reload_interval_s`` (the app runs it)."""
        while True:
            await asyncio.sleep(self._settings.reload_interval_s)
            self.check_file()


# -- headers and messages ---------------------------------------------------------------------


def _headers(verdict: ratelimit.Verdict) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has (this replica's)."""
    out: dict[str, str] = {}
    for kind, state in (("requests", verdict.requests), ("tokens", verdict.tokens)):
        if state is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(state.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(state.remaining)
            out[f"x-ratelimit-reset-{kind}"] = ratelimit.duration(state.reset_s)
    return out


def _retry_after(seconds: float) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) and retry-after-ms, which the openai client
    prefers; a request that cannot fit this replica's share is told to wait a window (the
    share may grow when a replica leaves)."""
    if not math.isfinite(seconds):
        seconds = ratelimit.WINDOW_S
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000))),
    }


def _refusal(
    tenant: Tenant, verdict: ratelimit.Verdict, limits: ratelimit.Limits, tenants: Tenants
) -> str:
    kind = verdict.exceeded
    what = "requests per minute (RPM)" if kind == "requests" else "tokens per minute (TPM)"
    limit = limits.requests if kind == "requests" else limits.tokens
    region = tenant.limits.requests if kind == "requests" else tenant.limits.tokens
    state = verdict.requests if kind == "requests" else verdict.tokens
    used = 0 if state is None or limit is None else limit - state.remaining
    share = (
        f" (this agent's share of the region's {region}, {tenants.replicas} agents)"
        if tenants.replicas > 1
        else ""
    )
    if not math.isfinite(verdict.retry_after_s):
        return (
            f"Request too large for tenant {tenant.name} on {what}: limit {limit}{share}, "
            f"requested {verdict.needed}; lower max_tokens or the prompt"
        )
    return (
        f"Rate limit reached for tenant {tenant.name} on {what}: limit {limit}{share}, used "
        f"{used}, requested {verdict.needed}. Please try again in "
        f"{ratelimit.duration(verdict.retry_after_s)}."
    )


# -- what a response used ---------------------------------------------------------------------


class UsageTally:
    """The tokens a response used, for the TPM correction.

    Non-streamed: its ``usage.total_tokens``.  Streamed: the last ``usage`` a chunk carried
    (``stream_options.include_usage``, or vLLM's continuous usage stats), else the prompt's
    tokens as the agent counted them plus one token per chunk with generated text (vLLM sends
    a chunk per engine step, one token each unless ``--stream-interval`` batches them).  A
    response that never came: 0 (the request still counts against the RPM)."""

    def __init__(self, *, prompt_tokens: int) -> None:
        self._prompt = prompt_tokens
        self._generated = 0
        self._usage: int | None = None
        self._started = False
        self._buffer = b""

    def body(self, data: bytes) -> None:
        self._started = True
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return
        self._take_usage(parsed)

    def feed(self, chunk: bytes) -> None:
        self._started = True
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line.strip())

    def total(self) -> int:
        if self._buffer.strip():
            self._line(self._buffer.strip())
            self._buffer = b""
        if self._usage is not None:
            return self._usage
        if not self._started:
            return 0
        return self._prompt + self._generated

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload.startswith(b"{"):
            return  # [DONE]
        try:
            event = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return
        if self._take_usage(event):
            return
        choices = event.get("choices") if isinstance(event, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                self._generated += 1

    def _take_usage(self, event: object) -> bool:
        usage = usage_of(event)
        if usage is None:
            return False
        total = usage.get("total_tokens")
        if not isinstance(total, int) or isinstance(total, bool):
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            if not (isinstance(prompt, int) and isinstance(completion, int)):
                return False
            total = prompt + completion
        self._usage = max(0, total)
        return True
