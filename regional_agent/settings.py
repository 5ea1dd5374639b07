"""Settings of ``meridian-agent``: one class, loaded once in ``main()`` and passed down.

Sources, highest first: command-line flags, environment variables (``MERIDIAN_AGENT_``, nested
groups joined by ``__``, e.g. ``MERIDIAN_AGENT_QUEUE__MAX_DEPTH=200``), the TOML file given with
``--config``, then the defaults below.  Invalid settings stop the agent at start with a message
naming the field.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    SettingsConfigDict,
)

import meridian_etcd
from meridian_etcd import endpoints as etcd_endpoints
from meridian_service import cpus, hygiene, loops, otlp
from meridian_service import settings as settings_loading
from meridian_service import tls as tls_module
from policies import autoscaling, group_routing, routing


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Group):
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8080, ge=0, le=65535, description="TCP port; 0 picks a free one")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="largest request body accepted, in bytes (413 above)"
    )
    event_loop: loops.EventLoop = Field(
        "uvloop",
        description="uvloop (the default, where installed: less CPU per request) or asyncio "
        "(the standard library's loop)",
    )
    # Connection hygiene (meridian_service.hygiene; docs/agent.md, Connections).  The timeouts
    # bound reading a request, never writing a response: a stream may last minutes.
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's line and headers must arrive within this many seconds of the "
        "connection's accept (or of the request's first byte on a kept-alive connection), else "
        "408 and the connection is closed; default 10",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="the whole request body must arrive within this many seconds of its headers "
        "(a deadline, not a gap between chunks), else 408 and the connection is closed; "
        "default 60 (4 MiB at 560 kbit/s)",
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="an idle kept-alive connection is closed this many seconds after its last "
        "response; default 75 (longer than a balancer's usual 60 s idle timeout)",
    )
    max_requests_per_connection: int = Field(
        1000,
        ge=0,
        description="the response to a connection's request number N says Connection: close, so "
        "that clients reconnect and balancers spread them again; 0: no limit; default 1000",
    )
    max_connections_per_ip: int = Field(
        0,
        ge=0,
        description="connections one client address may hold at once; more are closed at once; "
        "0: no cap, the default (a balancer that rewrites source addresses, or a NAT, puts every "
        "client behind one address; set it when clients reach the agent directly)",
    )
    # meridian_service.gc_tuning: under load, CPython's default thresholds gave one full
    # collection (39-42 ms on average, up to 63) every 0.7 s and about 10 % of the agent's
    # CPU in the collector
    gc_young_threshold: int = Field(
        50_000,
        ge=0,
        description="once listening, the agent freezes what start-up built (gc.freeze) and "
        "collects reference cycles after this many container allocations instead of "
        "CPython's 700: fewer and shorter collector pauses under load; 0 leaves the collector "
        "as CPython sets it; default 50000",
    )
    tls_cert_file: Path | None = Field(
        None,
        description="PEM certificate (chain) to serve HTTPS with: set it with tls_key_file, or "
        "neither (plain HTTP); both are read again on SIGHUP",
    )
    tls_key_file: Path | None = Field(
        None, description="PEM private key of tls_cert_file; read again with it on SIGHUP"
    )

    @field_validator("tls_cert_file", "tls_key_file")
    @classmethod
    def _exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value} does not exist (or is not a file)")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = ("tls_cert_file", "tls_key_file")
            if self.tls_cert_file is None:
                given, missing = missing, given
            raise ValueError(
                f"server.{given} is set but server.{missing} is not: set both, or neither"
            )
        return self

    def tls(self) -> tls_module.ServerTls | None:
        """The listener's certificate and key (reloadable), or None for plain HTTP.  Raises
        ``meridian_service.tls.TlsError`` naming the setting when they cannot be loaded."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return tls_module.ServerTls(
            self.tls_cert_file,
            self.tls_key_file,
            cert_setting="server.tls_cert_file",
            key_setting="server.tls_key_file",
        )

    def limits(self) -> hygiene.ConnectionLimits:
        """What :mod:`meridian_service.hygiene` enforces on the agent's port."""
        return hygiene.ConnectionLimits(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            max_requests_per_connection=self.max_requests_per_connection,
            max_connections_per_ip=self.max_connections_per_ip,
        )


class NodeSettings(_Group):
    url: str = Field(
        description="base URL of a vLLM (or meridian-sim) node, e.g. http://10.0.0.5:8000"
    )
    id: str | None = Field(None, description="node id; default host:port of the URL")
    weight: float = Field(1.0, gt=0, description="relative capacity for the weighted policy")
    slots: int | None = Field(
        None, gt=0, description="most requests in flight on this node; default queue.slots_per_node"
    )
    group: str | None = Field(
        None,
        description="GPU group (server, NVLink domain) for the groups policy; default: the node id",
    )

    kv_events_endpoint: str | None = Field(
        None,
        description="this node's KV-event PUB socket, e.g. tcp://10.0.0.5:5557 (vLLM's "
        "--kv-events-config endpoint); default: kv_events.endpoint on the node's host, if set",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description="this node's KV-event replay socket, e.g. tcp://10.0.0.5:5558; with "
        "kv_events_endpoint only: none, so a gap clears the node's blocks",
    )

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not _ZMQ_ENDPOINT.match(value):
            raise ValueError(
                f"{value!r} is not a ZeroMQ endpoint to connect to: tcp://HOST:PORT or ipc://PATH"
            )
        return value

    @model_validator(mode="after")
    def _replay_needs_events(self) -> NodeSettings:
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint is set without kv_events_endpoint")
        return self

    @field_validator("group")
    @classmethod
    def _group_id(cls, value: str | None) -> str | None:
        if value is not None and not _GROUP_ID.match(value):
            raise ValueError(
                f"group {value!r} must be 1-63 letters, digits, dots, colons, dashes, underscores"
            )
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
        return value.rstrip("/")

    @property
    def node_id(self) -> str:
        if self.id:
            return self.id
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


GROUPS_POLICY = group_routing.NAME  # routing by shared group tables (policies/group_routing.py)
POLICY_NAMES = (*routing.NAMES, GROUPS_POLICY)


class RoutingSettings(_Group):
    policy: str = Field("meridian", description=f"routing policy, one of {', '.join(POLICY_NAMES)}")
    prefix_block_tokens: int = Field(
        16, gt=0, description="tokens per block when hashing prompt prefixes for routing"
    )
    # 8192: every prompt of a model with an 8k context (Llama-3-8B; the simulator's profiles and
    # so every benchmark), and most chat traffic (all of the Azure traces but one prompt, 55 % of
    # Mooncake's), is tokenised and hashed exactly; a longer conversation still matches the node
    # that holds its first 8k tokens.  The stand-in tokeniser is pure Python at 1.4-2.8 us a
    # token (0.29-0.60 s for 1 MB here), so 8k tokens bound a request's routing work to 12-23 ms,
    # where a 4 MiB body (800k tokens) cost 1.6-2 s of the event loop; and it holds the GIL, so
    # that bound is what keeps other requests fast (three 3.8 MB prompts at once: /health worst
    # 21-38 ms at 8k, 24-36 ms at 16k, 144-172 ms at 32k; docs/agent.md, Large prompts).
    prefix_max_tokens: int = Field(
        8192,
        gt=0,
        description="tokens of a prompt that are tokenised and block-hashed for routing; past "
        "them the prompt's token count is estimated from the characters left, at the "
        "characters per token of the part tokenised, and prefixes are matched on these first "
        "tokens only (a bound on the work one request costs: 0.5-0.7 us a token with the "
        "stand-in; with a model's tokenizer at most 8 characters a token are read); raise it "
        "for long-context models whose prompts share more than this; default 8192",
    )
    tuning: dict[str, float | int] = Field(
        default_factory=dict,
        description="overrides of policies.routing.RoutingConfig fields (thresholds, weights)",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("tuning")
    @classmethod
    def _known_tuning(cls, value: dict[str, float | int]) -> dict[str, float | int]:
        try:
            routing.RoutingConfig(**value)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"bad routing tuning: {exc}") from exc
        return value

    def config(self) -> routing.RoutingConfig:
        return routing.RoutingConfig(**self.tuning)  # type: ignore[arg-type]


class ParseSettings(_Group):
    """Where a request's body is parsed (JSON, chat rendering, tokenising and block hashing):
    on the event loop for small bodies, on a parse thread for large ones (docs/agent.md)."""

    # 4 KiB (about 900 tokens, 1 ms of parsing): the loop's longest stall while one chat prompt
    # is parsed, through a real agent, inline vs on the parse thread (an idle loop: 1.7 ms): 2 KB
    # 2.1 vs 2.8 ms (the same, within noise), 4 KB 4.6 vs 3.1, 10 KB (2,000 words) 7.5 vs 3.6,
    # 16 KB 12.0 vs 3.5, 64 KB 26.0 vs 5.4.  Below it a thread saves nothing measurable and
    # costs a hop (about 0.1 ms) and GIL handoffs on the most common requests.
    offload_min_bytes: int = Field(
        4 * 1024,
        ge=0,
        description="request bodies of at least this many bytes are parsed on a parse thread, "
        "smaller ones on the event loop (their parsing costs less than a thread hop and the GIL "
        "handoffs it brings); 0: every body on a thread; default 4096 (about 1 ms of parsing)",
    )
    # 1: the tokeniser holds the GIL, so a second thread adds no throughput, and every busy
    # parse thread is one more the loop must win the GIL back from after each syscall (three
    # 3.8 MB prompts at once: /health worst 21-38 ms with one thread, 49-60 ms with two).
    threads: int = Field(
        1,
        ge=1,
        description="parse threads; large bodies beyond this many wait for one (the stand-in "
        "tokeniser holds the GIL: more threads add no throughput, only contention with the "
        "event loop; a model's tokenizer releases it while it encodes, the hashing around it "
        "does not); default 1",
    )


class TokenizerFiles(_Group):
    """One model's tokenizer and chat template (``[tokenizer]`` or ``[tokenizer.models."m"]``):
    its Hugging Face directory, or the files one by one (docs/agent.md, "Prompts with the
    model's own tokenizer").  The files are checked when the settings are read; a start loads
    them and renders a probe conversation (``regional_agent.prompts``)."""

    model_dir: Path | None = Field(
        None,
        description="the model's directory (as vLLM's --model): tokenizer.json, and "
        "chat_template.jinja and tokenizer_config.json when there",
    )
    tokenizer_file: Path | None = Field(
        None,
        description="the tokenizer.json (Hugging Face tokenizers format); default: model_dir's",
    )
    chat_template_file: Path | None = Field(
        None,
        description="the Jinja chat template; default: model_dir's chat_template.jinja, else "
        "tokenizer_config.json's chat_template; none: chat prompts are laid out as ChatML",
    )
    tokenizer_config_file: Path | None = Field(
        None,
        description="the tokenizer_config.json (special tokens, add_bos_token, chat_template); "
        "default: model_dir's, when there",
    )
    bos_token: str | None = Field(
        None, description="the template's bos_token, instead of tokenizer_config.json's"
    )
    eos_token: str | None = Field(
        None, description="the template's eos_token, instead of tokenizer_config.json's"
    )

    @dataclass(frozen=True, slots=True)
    class Paths:
        tokenizer_file: Path
        chat_template_file: Path | None
        tokenizer_config_file: Path | None

    def configured(self) -> bool:
        return self.model_dir is not None or self.tokenizer_file is not None

    def paths(self) -> TokenizerFiles.Paths:
        """The files to read, explicit ones first, else the model directory's."""
        d = self.model_dir
        tokenizer = self.tokenizer_file or (d / "tokenizer.json" if d is not None else None)
        if tokenizer is None:
            raise ValueError("no tokenizer: set model_dir or tokenizer_file")
        template = self.chat_template_file
        if template is None and d is not None and (d / "chat_template.jinja").is_file():
            template = d / "chat_template.jinja"
        config = self.tokenizer_config_file
        if config is None and d is not None and (d / "tokenizer_config.json").is_file():
            config = d / "tokenizer_config.json"
        return TokenizerFiles.Paths(tokenizer, template, config)

    @model_validator(mode="after")
    def _files(self) -> Self:
        if not self.configured():
            given = [
                name
                for name in (
                    "chat_template_file",
                    "tokenizer_config_file",
                    "bos_token",
                    "eos_token",
                )
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} set without a tokenizer: set model_dir (the model's "
                    "directory) or tokenizer_file too"
                )
            return self
        if self.model_dir is not None and not self.model_dir.is_dir():
            raise ValueError(f"model_dir: {self.model_dir} is not a directory")
        paths = self.paths()
        if not paths.tokenizer_file.is_file():
            if self.tokenizer_file is None:
                raise ValueError(
                    f"model_dir: {self.model_dir} has no tokenizer.json: point model_dir at the "
                    "model's directory, or set tokenizer_file"
                )
            raise ValueError(
                f"tokenizer_file: {paths.tokenizer_file} does not exist (or is not a file)"
            )
        for name in ("chat_template_file", "tokenizer_config_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: {path} does not exist (or is not a file)")
        return self


class TokenizerSettings(TokenizerFiles):
    """The served models' own tokenizers and chat templates: a default for every model (the
    fields here) and per-model ones (``models``).  A model with neither is tokenised by the
    agent's stand-in (policies.prompt), as without these settings."""

    models: dict[str, TokenizerFiles] = Field(
        default_factory=dict,
        description="per-model tokenizers, by the model name requests carry, e.g. "
        '{"meta-llama/Llama-3.1-8B-Instruct": {"model_dir": "/models/llama-3.1-8b"}}; '
        "a model not named here gets the default above (or the stand-in without one)",
    )
    # 16 MiB: about 380k block hashes (6M tokens of 16-token blocks), the system prompts and
    # conversations of a busy region for minutes; each entry costs PrefixState.estimated_bytes.
    prefix_cache_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="memory for the prefix states of every model's prompts, the stand-in's "
        "too (a shared system prompt is tokenised and hashed once), least recently used first "
        "out; estimated, an upper bound; 0: no cache; default 16 MiB",
    )


class TelemetrySettings(_Group):
    # 1 s, not 0.25: every scrape costs the node a render of its ~50 KB /metrics page; the
    # routing benchmark measured 0.2 cores less on 8 nodes and a lower client TTFT at 1 s, the
    # fleet simulator no change in Meridian's tail between fresh and 1 s old telemetry (the
    # agent's own in-flight and prefill counts carry the decision; docs/benchmarks.md)
    scrape_interval_s: float = Field(
        1.0, gt=0, description="seconds between /metrics scrapes of a node"
    )
    scrape_timeout_s: float = Field(1.0, gt=0, description="timeout of one scrape, seconds")
    stale_after_s: float = Field(
        4.0, gt=0, description="a sample older than this is unknown, never idle (seconds)"
    )
    models_refresh_s: float = Field(10.0, gt=0, description="seconds between /v1/models refreshes")


class HealthSettings(_Group):
    probe_interval_s: float = Field(1.0, gt=0, description="seconds between active /health probes")
    # 3 s and 3 failures: a loaded node, or an agent whose event loop stalls, must not flap out
    # of the pool (1 s and 2 failures marked 7 of 8 busy nodes unhealthy in a benchmark).  A dead
    # node is still out within probe_interval_s * 3 + probe_timeout_s (about 6 s), and under
    # traffic sooner: its refused connections fail at once, count towards
    # eject_consecutive_errors and are retried on another node, whatever the probes say.
    probe_timeout_s: float = Field(3.0, gt=0, description="timeout of one probe, seconds")
    probe_generate: bool = Field(
        False,
        description="also ask each node for a one-token completion every probe round: an engine "
        "that stopped stepping still answers /health (off: it costs the node a request a round)",
    )
    probe_generate_timeout_s: float = Field(
        10.0, gt=0, description="time the one-token completion of a probe may take (seconds)"
    )
    unhealthy_after: int = Field(3, ge=1, description="consecutive failed probes before unhealthy")
    healthy_after: int = Field(2, ge=1, description="consecutive good probes before healthy again")
    eject_consecutive_errors: int = Field(
        5, ge=1, description="consecutive failed requests (5xx, reset, timeout) that eject a node"
    )
    eject_base_s: float = Field(30.0, gt=0, description="first ejection lasts this long (seconds)")
    eject_max_s: float = Field(300.0, gt=0, description="longest ejection (seconds)")
    max_ejected_fraction: float = Field(
        0.5, ge=0, le=1, description="most of the pool ejected at once (at least one node may be)"
    )
    latency_outlier_factor: float = Field(
        3.0,
        gt=1,
        description="eject a node whose time to first token is this many times its peers'",
    )
    latency_outlier_min_s: float = Field(
        0.5, ge=0, description="never call a node slow below this time to first token (seconds)"
    )
    latency_min_samples: int = Field(
        20, ge=1, description="samples before latency ejection applies"
    )
    slow_start_s: float = Field(
        30.0, ge=0, description="after (re)admission, traffic ramps up over this many seconds"
    )
    panic_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "when fewer than this fraction of active nodes are routable, route to every active"
            " node as if healthy (panic, as Envoy); 0 turns it off"
        ),
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="draining node: in-flight requests get this long to finish (seconds)",
    )


class QueueSettings(_Group):
    slots_per_node: int = Field(64, gt=0, description="most requests in flight on one node")
    max_depth: int = Field(1024, ge=0, description="requests waiting per model before 429")
    max_wait_low_s: float = Field(
        10.0, gt=0, description="a lower-priority request waits at most this long behind others"
    )
    deadline_s: float = Field(
        120.0, gt=0, description="a request still queued after this long gets 504 (seconds)"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After sent with 429 (seconds)")
    tenant_priority: dict[str, Literal["high", "normal", "low"]] = Field(
        default_factory=dict,
        description="X-Tenant value -> priority class (high, normal, low); open mode only: "
        "with tenants.keys_file the key's tenant decides and X-Tenant is ignored",
    )


class TenantsSettings(_Group):
    """API keys and tenants of the data plane (``/v1/*``; docs/agent.md, "Tenants, keys and
    rate limits").  Without ``keys_file`` the data plane is open (trusted networks only)."""

    keys_file: Path | None = Field(
        None,
        description="TOML file of [[tenants]] with their [[tenants.keys]] hashes, priority "
        "class, models and limits (KeysFile); read at start (a bad file stops the agent) and "
        "again when it changes or on SIGHUP (a bad new file keeps the old keys); unset: open "
        "mode, every client served and X-Priority and X-Tenant trusted (a WARNING at start)",
    )
    reload_interval_s: float = Field(
        5.0,
        gt=0,
        description="seconds between checks of keys_file for a change (modification time, "
        "size, inode); default 5",
    )

    @field_validator("keys_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            load_keys_file(value)  # a bad file stops the agent at start, naming the problem
        return value


_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class KeyEntry(_Group):
    """One API key of a tenant, as its SHA-256: ``meridian-agent key new`` makes one."""

    sha256: str = Field(description="hex SHA-256 of the key; the key itself is never stored")
    name: str = Field("", max_length=64, description="a label for logs and rotation, e.g. 2026-03")

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        value = value.strip().lower()
        if not _SHA256_HEX.match(value):
            raise ValueError("must be 64 hex digits: the SHA-256 of the key, not the key")
        return value


class TenantEntry(_Group):
    """One tenant of the keys file (``[[tenants]]``)."""

    name: str = Field(description="the tenant's name: in logs, spans and metrics' labels")
    priority: Literal["high", "normal", "low"] = Field(
        "normal", description="the queue's priority class of its requests"
    )
    models: list[str] = Field(
        default_factory=list, description="models it may use (403 for others); empty: every model"
    )
    rpm: int | None = Field(
        None,
        ge=0,
        description="requests per minute in the whole region (split among the live agent "
        "replicas); unset: no limit",
    )
    tpm: int | None = Field(
        None,
        ge=0,
        description="tokens (prompt + completion) per minute in the whole region, reserved as "
        "prompt + max_tokens at admission and settled with the real usage; unset: no limit",
    )
    trust_priority: bool = Field(
        False,
        description="whether its requests' X-Priority is honoured; else ignored (its class "
        "applies)",
    )
    keys: list[KeyEntry] = Field(
        default_factory=list, description="its keys ([[tenants.keys]]); several during rotation"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _TENANT_NAME.match(value):
            raise ValueError(
                f"tenant name {value!r} must be 1-64 letters, digits, dots, dashes, underscores"
            )
        return value


class KeysFile(_Group):
    """The keys file (``tenants.keys_file``): every tenant and its keys."""

    tenants: list[TenantEntry] = Field(description="the tenants ([[tenants]])")

    @model_validator(mode="after")
    def _consistent(self) -> KeysFile:
        names: set[str] = set()
        hashes: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            if tenant.name in names:
                raise ValueError(f"tenants[{i}]: duplicate tenant name {tenant.name!r}")
            names.add(tenant.name)
            for j, key in enumerate(tenant.keys):
                if key.sha256 in hashes:
                    raise ValueError(f"tenants[{i}].keys[{j}]: a key listed twice")
                hashes.add(key.sha256)
        if not hashes:
            raise ValueError(
                "no keys: a keys file needs at least one [[tenants.keys]] (an empty file is "
                "taken for a half-written one); for an open data plane unset tenants.keys_file"
            )
        return self


def load_keys_file(path: Path) -> KeysFile:
    """The keys file at ``path``; ``ValueError`` saying what is wrong (never a key's hash)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read keys file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"keys file {path} is not valid TOML: {exc}") from None
    try:
        return KeysFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"keys file {path}: {problems}") from None


class RetrySettings(_Group):
    max_attempts: int = Field(3, ge=1, description="tries per request, the first included")
    budget_ratio: float = Field(
        0.2, ge=0, description="retries allowed as a fraction of requests (a retry budget)"
    )
    budget_min_per_s: float = Field(3.0, ge=0, description="retries always allowed per second")


class StallLimits(_Group):
    """Stall limits of one model's streamed requests (``stall.models.<model>``)."""

    first_token_s: float = Field(
        120.0,
        gt=0,
        description="a streamed request waiting longer than this on a node for its first token "
        "is cut, counted as a node failure and retried elsewhere (seconds)",
    )
    inter_token_s: float = Field(
        15.0,
        gt=0,
        description="a stream silent this long between tokens is ended with an error event and "
        "counted as a node failure (seconds)",
    )


class StallSettings(StallLimits):
    """When a streamed response counts as stalled: an engine that stopped stepping answers
    /health but sends no tokens.  Defaults sized for real engines: vLLM's inter-token latency
    is tens of ms, so 15 s of silence mid-stream is a stuck engine; a first token can take tens
    of seconds on a loaded node (a long prompt behind others), so the first-token limit is the
    agent's own queue deadline, 120 s.  Non-streamed requests keep
    upstream.first_byte_timeout_s and upstream.read_timeout_s (their tokens are not seen)."""

    models: dict[str, StallLimits] = Field(
        default_factory=dict,
        description="per-model limits, e.g. a 70B model's longer prefill: "
        '{"meta-llama/Llama-3.1-70B": {"first_token_s": 120, "inter_token_s": 30}}',
    )

    def limits(self, model: str) -> StallLimits:
        return self.models.get(model, self)


class UpstreamSettings(_Group):
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout to a node")
    first_byte_timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "time a node gets to start answering, from sending the request: its headers and any"
            " silence before the first token (queue wait and prefill) (seconds)"
        ),
    )
    read_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "longest silence inside a response once it is older than first_byte_timeout_s (seconds)"
        ),
    )


class AdminSettings(_Group):
    """The bearer token of ``/admin/*``, kept only as its SHA-256 (docs/security.md).

    One of ``token`` (from the environment, ``MERIDIAN_AGENT_ADMIN__TOKEN``, or the TOML file;
    there is no flag, so it is never on a command line), ``token_file`` or ``token_sha256``.
    The token is hashed as the settings are read and never kept: ``token`` is always None
    afterwards, and a presented token is hashed and compared with the hash in constant time.
    None of them: every admin call is 401.
    """

    token: SecretStr | None = Field(
        None,
        description="bearer token for /admin/*, best from the environment "
        "(MERIDIAN_AGENT_ADMIN__TOKEN); hashed at start and not kept; no flag takes it",
    )
    token_file: Path | None = Field(
        None,
        description="file whose content (surrounding whitespace stripped) is the token; read and "
        "hashed at start; keep it readable by the agent's user only",
    )
    token_sha256: str | None = Field(
        None,
        description="hex SHA-256 of the token, instead of the token (as the controller's "
        "api.tokens; `meridianctl token new` makes a token and its hash)",
    )
    _digest: bytes | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _hash_token(cls, data: Any) -> Any:
        """A token given in plain is replaced by its hash before anything keeps it."""
        if not isinstance(data, dict) or data.get("token") is None:
            return data
        if data.get("token_file") is not None or data.get("token_sha256") is not None:
            raise ValueError(_ONE_TOKEN)
        value = data["token"]
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        if not isinstance(text, str) or not text.strip():
            raise ValueError("admin.token must be a non-empty string")
        rest = {k: v for k, v in data.items() if k != "token"}
        return {**rest, "token_sha256": hashlib.sha256(text.strip().encode()).hexdigest()}

    @field_validator("token_file")
    @classmethod
    def _token_file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value} does not exist (or is not a file)")
        return value

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().lower()
        if not _HEX64.match(value):
            raise ValueError("must be 64 hex digits: the SHA-256 of the token, not the token")
        return value

    @model_validator(mode="after")
    def _digest_of(self) -> AdminSettings:
        if self.token_file is not None and self.token_sha256 is not None:
            raise ValueError(_ONE_TOKEN)
        if self.token_sha256 is not None:
            self._digest = bytes.fromhex(self.token_sha256)
        elif self.token_file is not None:
            try:
                text = self.token_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(
                    f"admin.token_file: cannot read {self.token_file}: {exc}"
                ) from None
            if not text:
                raise ValueError(f"admin.token_file: {self.token_file} is empty")
            self._digest = hashlib.sha256(text.encode()).digest()
        return self

    @property
    def enabled(self) -> bool:
        """Whether a token is configured (else every admin call is 401)."""
        return self._digest is not None

    def verify(self, presented: str) -> bool:
        """Whether ``presented`` is the token: its SHA-256 against the configured one, in
        constant time."""
        if self._digest is None:
            return False
        given = hashlib.sha256(presented.strip().encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(given, self._digest)


_ONE_TOKEN = "set one of admin.token, admin.token_file and admin.token_sha256, not several"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class TelemetryExportSettings(otlp.OtlpSettings):
    """``[otel]``: OTLP export (meridian_service.otlp; docs/observability.md#otlp)."""

    console_spans: bool = Field(False, description="print OpenTelemetry spans to stderr")


_REGION_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # as meridian_wire.models.REGION_ID
_RESIDENCY_TAG = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")  # as meridian_wire.models.RESIDENCY_TAG
_AGENT_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")  # as meridian_wire.keys.AGENT_ID
_GROUP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,62}$")
_ZMQ_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}|ipc://.+)$")


def _url(value: str, *, schemes: tuple[str, ...]) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"must be a {'/'.join(schemes)} URL with a host, got {value!r}")
    return value.rstrip("/")


class RegionSettings(_Group):
    """The region this agent serves and how it reports to the global control plane (etcd).

    The agent publishes only when both ``id`` and ``etcd`` are set; otherwise it is a plain
    regional proxy (docs/agent-publisher.md).
    """

    id: str | None = Field(
        None, description="region id, e.g. eu-west (lowercase letters, digits, dashes)"
    )
    geo: str | None = Field(
        None, description="the geography the region serves, e.g. eu; required with id"
    )
    residency: list[str] = Field(
        default_factory=list, description="data-residency tags the region meets, e.g. ['eu']"
    )
    endpoints: list[str] = Field(
        default_factory=list, description="client-facing URLs of the region (for DNS)"
    )
    etcd: list[str] = Field(
        default_factory=list,
        description="etcd client URLs, e.g. http://10.0.0.1:2379; tried in turn when one fails",
    )
    agent_id: str | None = Field(
        None,
        description="this agent replica's id in its etcd keys; default hostname-pid, lowercased",
    )
    lease_ttl_s: int = Field(
        10, ge=2, description="TTL of the liveness lease, whole seconds; refreshed every TTL/3"
    )
    window_s: float = Field(
        30.0, gt=0, description="status heartbeat: rewritten at least this often (seconds)"
    )
    min_interval_s: float = Field(
        1.0, gt=0, description="status is never written more often than this (debounce, seconds)"
    )
    load_change: float = Field(
        0.25, gt=0, description="relative move of a load figure that counts as a change (0.25)"
    )
    load_min_interval_s: float = Field(
        5.0, gt=0, description="a change of load alone rewrites the status at most this often (s)"
    )
    etcd_timeout_s: float = Field(2.0, gt=0, description="timeout of one etcd call (seconds)")
    etcd_ca_file: Path | None = Field(
        None,
        description="PEM CA that signed the etcd members' certificates; required with https:// "
        "etcd URLs, refused with http:// ones (docs/security.md#etcd-tls-users-and-roles)",
    )
    etcd_cert_file: Path | None = Field(
        None,
        description="PEM client certificate for etcd's --client-cert-auth; its CN is the etcd "
        "user (agent-<region>); with etcd_key_file",
    )
    etcd_key_file: Path | None = Field(None, description="PEM private key of etcd_cert_file")
    etcd_user: str | None = Field(
        None, description="etcd user to authenticate as by password (with etcd_password_file)"
    )
    etcd_password_file: Path | None = Field(
        None, description="file holding etcd_user's password (one line; never logged)"
    )
    retry_base_s: float = Field(
        0.5, gt=0, description="first retry after an etcd failure (seconds; doubles, jittered)"
    )
    retry_max_s: float = Field(5.0, gt=0, description="longest wait between etcd retries (s)")

    @field_validator("id")
    @classmethod
    def _region_id(cls, value: str | None) -> str | None:
        if value is not None and not _REGION_ID.match(value):
            raise ValueError(
                f"region id {value!r} must be 1-63 lowercase letters, digits and dashes"
            )
        return value

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, value: str | None) -> str | None:
        if value is not None and not _AGENT_ID.match(value):
            raise ValueError(
                f"agent id {value!r} must be 1-63 lowercase letters, digits, dots, dashes, "
                "underscores"
            )
        return value

    @field_validator("residency")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        for tag in value:
            if not _RESIDENCY_TAG.match(tag):
                raise ValueError(
                    f"residency tag {tag!r} must be 1-32 lowercase letters, digits and dashes"
                )
        return value

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        return [_url(v, schemes=("http", "https")) for v in value]

    @field_validator("etcd")
    @classmethod
    def _etcd(cls, value: list[str]) -> list[str]:
        for v in value:
            etcd_endpoints.parse(v)  # one parser for every etcd URL (meridian_etcd.endpoints)
        return [v.strip() for v in value]

    @model_validator(mode="after")
    def _complete(self) -> RegionSettings:
        if self.id is not None and not self.geo:
            raise ValueError("region.geo is required when region.id is set")
        if self.etcd and self.id is None:
            raise ValueError("region.etcd is set but region.id is not: name the region")
        if self.retry_max_s < self.retry_base_s:
            raise ValueError("region.retry_max_s must be >= region.retry_base_s")
        access = self._etcd_access()
        if self.etcd:  # TLS and auth go with the URLs; the files must be usable now
            meridian_etcd.check_settings(endpoints=self.etcd, prefix="region.etcd_", **access)
        elif given := [f"region.etcd_{k}" for k, v in access.items() if v is not None]:
            raise ValueError(f"{', '.join(given)} set but region.etcd is not")
        return self

    def _etcd_access(self) -> dict[str, Any]:
        return {
            "ca_file": self.etcd_ca_file,
            "cert_file": self.etcd_cert_file,
            "key_file": self.etcd_key_file,
            "user": self.etcd_user,
            "password_file": self.etcd_password_file,
        }

    def etcd_client(self) -> meridian_etcd.ClientConfig:
        """How the publisher reaches etcd: URLs, time limit, TLS and credentials."""
        return meridian_etcd.ClientConfig(
            endpoints=self.etcd, timeout_s=self.etcd_timeout_s, **self._etcd_access()
        )

    @property
    def publishing(self) -> bool:
        """Whether the agent publishes to etcd: a region id and at least one etcd URL."""
        return self.id is not None and bool(self.etcd)


class GroupTableSettings(_Group):
    """Group routing tables (``routing.policy = "groups"``; docs/group-tables.md): hash buckets
    of prefixes and sessions -> GPU groups, shared by the region's agents through etcd."""

    n_buckets: int = Field(16_384, ge=1, le=99_999, description="hash buckets per table")
    key_blocks: int = Field(
        64,
        ge=1,
        description="prompt blocks (routing.prefix_block_tokens each) hashed into a prefix key",
    )
    vnodes: int = Field(8, ge=1, description="ring points per group of mean weight (assignment)")
    load_factor: float = Field(
        1.25, ge=1, description="a group takes at most this times its fair share of buckets"
    )
    debounce_s: float = Field(
        1.0, ge=0, description="staleness window: moves are published at most this often (s)"
    )
    move_abs_threshold: float = Field(
        16.0,
        ge=0,
        description="a bucket moves when its group's requests per GPU exceed the least by this...",
    )
    move_rel_threshold: float = Field(
        1.5, ge=1, description="...and by this factor (also the GPU guard inside a group)"
    )
    memory_keys: int = Field(
        100_000, ge=1, description="routing keys whose last GPU the agent remembers (LRU)"
    )


_LOAD_DEFAULTS = autoscaling.Config()
_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class AutoscalerLoadSettings(_Group):
    """The region's own load as a floor (``[autoscaler.load]``; docs/autoscaling.md): the
    reactive and predictive policies of ``policies.autoscaling`` on the nodes' KV-cache use, the
    queue and the arrival rate.  The defaults are the seed's production policy."""

    policy: Literal["off", "reactive", "predictive", "combined"] = Field(
        "off",
        description="off: only the controller's floor; reactive (thresholds), predictive (the "
        "arrival rate's forecast) or combined (the larger of both; the controller's floor "
        "still holds)",
    )
    min_nodes: int = Field(_LOAD_DEFAULTS.min_nodes, ge=0, description="fewest nodes it keeps")
    max_nodes: int = Field(
        _LOAD_DEFAULTS.max_nodes, ge=1, description="most nodes it asks for, the region's whole"
    )
    scale_up_kv_util: float = Field(
        _LOAD_DEFAULTS.scale_up_kv_util, ge=0, le=1,
        description="scale up when the serving nodes' mean KV-cache use stays above this",
    )  # fmt: skip
    scale_up_kv_for_s: float = Field(
        _LOAD_DEFAULTS.scale_up_kv_for_s, ge=0, description="... for this long (seconds)"
    )
    scale_up_queue: int = Field(
        _LOAD_DEFAULTS.scale_up_queue, ge=0,
        description="or when the requests waiting (the agent's queue and the engines') stay "
        "above this",
    )  # fmt: skip
    scale_up_queue_for_s: float = Field(
        _LOAD_DEFAULTS.scale_up_queue_for_s, ge=0, description="... for this long (seconds)"
    )
    scale_up_step: float = Field(
        _LOAD_DEFAULTS.scale_up_step, gt=0,
        description="a step up adds this fraction of the serving nodes (at least one)",
    )  # fmt: skip
    scale_up_cooldown_s: float = Field(
        _LOAD_DEFAULTS.scale_up_cooldown_s, ge=0, description="seconds between steps up"
    )
    scale_down_kv_util: float = Field(
        _LOAD_DEFAULTS.scale_down_kv_util, ge=0, le=1,
        description="scale down only when KV-cache use stays below this (below scale_up_kv_util)",
    )  # fmt: skip
    scale_down_queue: int = Field(
        _LOAD_DEFAULTS.scale_down_queue, ge=0,
        description="... and the queue below this (below scale_up_queue)",
    )  # fmt: skip
    scale_down_for_s: float = Field(
        _LOAD_DEFAULTS.scale_down_for_s, ge=0,
        description="... for this long; each step down waits this long again (seconds)",
    )  # fmt: skip
    scale_down_step: int = Field(
        _LOAD_DEFAULTS.scale_down_step, ge=1, description="nodes a step down removes"
    )
    provision_delay_s: float = Field(
        120.0, ge=0,
        description="how long a new node takes to serve (warm standby about 120, cold 480-900): "
        "the forecast looks this far ahead",
    )  # fmt: skip
    node_capacity_rps: float | None = Field(
        None, gt=0,
        description="one node's measured capacity in requests/s on this traffic, for the "
        "forecast (benchmarks/node_load_curve.py measures it); unset: no predictive demand",
    )  # fmt: skip
    target_utilisation: float = Field(
        _LOAD_DEFAULTS.target_utilisation, gt=0, le=1,
        description="the forecast's demand keeps nodes at this fraction of their capacity",
    )  # fmt: skip
    level_smoothing: float = Field(
        _LOAD_DEFAULTS.level_smoothing, gt=0, le=1, description="the forecast's level (alpha)"
    )
    trend_smoothing: float = Field(
        _LOAD_DEFAULTS.trend_smoothing, gt=0, le=1, description="the forecast's trend (beta)"
    )

    @model_validator(mode="after")
    def _asymmetric(self) -> AutoscalerLoadSettings:
        if self.policy != "off":
            self.config()  # its ValueError names the fields (scale_down_kv_util, ...)
        if self.policy == "predictive" and self.node_capacity_rps is None:
            raise ValueError(
                "autoscaler.load.node_capacity_rps is required with policy = 'predictive': the "
                "forecast sizes nodes by it (benchmarks/node_load_curve.py measures it)"
            )
        return self

    def config(self) -> autoscaling.Config:
        """The policy's pure configuration ("off" gives the combined policy's)."""
        mode: autoscaling.Mode = "combined" if self.policy == "off" else self.policy
        fields = {
            n: getattr(self, n) for n in autoscaling.Config.__dataclass_fields__ if n != "mode"
        }
        return autoscaling.Config(mode=mode, **fields)


class AutoscalerSettings(_Group):
    """What the agent does with the capacity floor the controller asks of it."""

    actuator: Literal["none", "dry-run", "command", "simulator", "webhook", "kubernetes"] = Field(
        "none",
        description="none (ignore the floor), dry-run (log only), command (run a hook), "
        "simulator (start meridian-sim nodes), webhook (a signed JSON POST), kubernetes (patch "
        "the vLLM Deployment's scale subresource)",
    )
    interval_s: float = Field(2.0, gt=0, description="seconds between checks of the floor")
    scale_down_delay_s: float = Field(
        60.0,
        ge=0,
        description="capacity must exceed the floor by a node for this long before one of the "
        "nodes the autoscaler started is stopped (seconds)",
    )
    command: list[str] = Field(
        default_factory=list,
        description="command actuator: argv run when the floor changes; {floor}, {current}, "
        "{region} and {model_floors} (A=0.5,B=2) are replaced",
    )
    command_timeout_s: float = Field(60.0, gt=0, description="command actuator: time limit (s)")
    profile: str = Field(
        "h100-llama3-8b", description="simulator actuator: meridian-sim profile of new nodes"
    )
    model: str | None = Field(
        None,
        description="simulator actuator: model the nodes it starts for the region's floor serve; "
        "default the profile's (a model short of its own floor gets nodes of that model)",
    )
    models: list[str] = Field(
        default_factory=list,
        description="dry-run, command, webhook and kubernetes actuators: the models the nodes they "
        "bring serve; a per-model floor of one of these raises the floor handed over, one of "
        "another model is logged as unmet; empty: they serve every model",
    )
    time_scale: float = Field(1.0, gt=0, description="simulator actuator: --time-scale of nodes")
    node_weight: float = Field(
        1.0,
        gt=0,
        description="capacity of one new node (H100 = 1.0): the simulator's nodes, and what "
        "webhook and kubernetes divide the floor by to count replicas",
    )
    max_nodes: int = Field(4, ge=0, description="simulator actuator: most nodes it runs at once")
    start_timeout_s: float = Field(
        30.0, gt=0, description="simulator actuator: time a node gets to print READY (seconds)"
    )
    webhook_url: str | None = Field(
        None, description="webhook actuator: the URL it POSTs the replica count to"
    )
    webhook_secret_file: Path | None = Field(
        None,
        description="webhook actuator: file holding the HMAC-SHA256 key of X-Meridian-Signature",
    )
    request_timeout_s: float = Field(
        10.0, gt=0, description="webhook and kubernetes actuators: time limit of one call (s)"
    )
    kubernetes_api: str | None = Field(
        None,
        description="kubernetes actuator: the API server's URL; default "
        "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT (in a pod)",
    )
    kubernetes_namespace: str | None = Field(
        None,
        description="kubernetes actuator: the Deployment's namespace; default the pod's "
        "(the service account's namespace file)",
    )
    kubernetes_deployment: str | None = Field(
        None,
        description="kubernetes actuator: the vLLM Deployment (or StatefulSet, with "
        "kubernetes_kind) whose replicas it sets",
    )
    kubernetes_kind: Literal["deployments", "statefulsets"] = Field(
        "deployments",
        description="kubernetes actuator: the resource kubernetes_deployment names (apps/v1); "
        "statefulsets for the Terraform region module's vLLM",
    )
    kubernetes_token_file: Path = Field(
        Path(_SERVICE_ACCOUNT) / "token",
        description="kubernetes actuator: the service-account token, re-read on every call",
    )
    kubernetes_ca_file: Path | None = Field(
        None,
        description="kubernetes actuator: the CA the API server's certificate is checked "
        "against; unset: the service account's ca.crt when there is one, else the system's",
    )
    load: AutoscalerLoadSettings = Field(
        AutoscalerLoadSettings(),
        description="the region's own load as a floor: the reactive and predictive policies "
        "(docs/autoscaling.md); off by default",
    )

    @model_validator(mode="after")
    def _command_given(self) -> AutoscalerSettings:
        if self.actuator == "command" and not self.command:
            raise ValueError("autoscaler.command is required with autoscaler.actuator = 'command'")
        if self.actuator == "webhook":
            if not self.webhook_url or urlsplit(self.webhook_url).scheme not in ("http", "https"):
                raise ValueError(
                    "autoscaler.webhook_url must be an http(s) URL with autoscaler.actuator = "
                    f"'webhook', got {self.webhook_url!r}"
                )
            if self.webhook_secret_file is None or not self.webhook_secret_file.is_file():
                raise ValueError(
                    "autoscaler.webhook_secret_file must name a readable file with "
                    f"autoscaler.actuator = 'webhook', got {self.webhook_secret_file}"
                )
        if self.actuator == "kubernetes":
            if not self.kubernetes_deployment:
                raise ValueError(
                    "autoscaler.kubernetes_deployment is required with autoscaler.actuator = "
                    "'kubernetes'"
                )
            if self.kubernetes_api_url() is None:
                raise ValueError(
                    "autoscaler.kubernetes_api is unset and KUBERNETES_SERVICE_HOST is not in "
                    "the environment (not in a pod): set the API server's URL"
                )
            if self.kubernetes_namespace_name() is None:
                raise ValueError(
                    "autoscaler.kubernetes_namespace is unset and the service account's "
                    f"namespace file {_SERVICE_ACCOUNT}/namespace cannot be read: set it"
                )
        return self

    def kubernetes_api_url(self) -> str | None:
        if self.kubernetes_api:
            return self.kubernetes_api
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            return None
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    def kubernetes_ca(self) -> Path | None:
        if self.kubernetes_ca_file is not None:
            return self.kubernetes_ca_file
        default = Path(_SERVICE_ACCOUNT) / "ca.crt"
        return default if default.is_file() else None

    def kubernetes_namespace_name(self) -> str | None:
        if self.kubernetes_namespace:
            return self.kubernetes_namespace
        try:
            return (Path(_SERVICE_ACCOUNT) / "namespace").read_text().strip() or None
        except OSError:
            return None


_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


class DnsDiscoverySettings(_Group):
    """One name whose records are nodes (``[[discovery.dns]]``; docs/agent.md, Node discovery)."""

    name: str = Field(
        description="the DNS name to resolve, fully qualified (no search domains), e.g. "
        "vllm.inference.svc.cluster.local or _http._tcp.vllm.example.com for SRV"
    )
    record: Literal["A", "AAAA", "SRV"] = Field(
        "A",
        description="A or AAAA: every address is a node at port; SRV: every target and port is "
        "a node, at the target's A addresses (AAAA when it has none)",
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="the nodes' port; required with A and AAAA, not with SRV"
    )
    scheme: Literal["http", "https"] = Field("http", description="the nodes' URL scheme")
    interval_s: float = Field(5.0, gt=0, description="seconds between resolutions of the name")
    timeout_s: float = Field(
        2.0, gt=0, description="time one resolution may take, retries included (seconds)"
    )
    nameservers: list[str] = Field(
        default_factory=list,
        description="servers to ask, IP[:port] ([IPv6]:port), port 53 by default; none: those "
        "of /etc/resolv.conf",
    )
    empty_after: int = Field(
        0,
        ge=0,
        description="apply an empty answer (NXDOMAIN, or no records of the type) only after "
        "this many in a row, draining every node of the name; 0, the default: never, the last "
        "good set stays",
    )
    weight: float = Field(1.0, gt=0, description="weight of every node found (as [[nodes]])")
    slots: int | None = Field(
        None, gt=0, description="slots of every node found; default queue.slots_per_node"
    )

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        name = value.strip().rstrip(".").lower()
        labels = name.split(".")
        if len(name) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
            raise ValueError(f"{value!r} is not a DNS name (letters, digits, '-', '_' labels)")
        return name

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, value: list[str]) -> list[str]:
        for server in value:
            _parse_nameserver(server)
        return value

    @model_validator(mode="after")
    def _port_given(self) -> DnsDiscoverySettings:
        if self.record == "SRV" and self.port is not None:
            raise ValueError(f"{self.name}: port is taken from the SRV records; remove port")
        if self.record != "SRV" and self.port is None:
            raise ValueError(f"{self.name}: port is required with record = {self.record!r}")
        return self

    @property
    def source(self) -> str:
        """The nodes' source in ``GET /admin/nodes``."""
        return f"dns:{self.name}"

    def servers(self) -> list[tuple[str, int]]:
        """``nameservers`` as (IP address, port)."""
        return [_parse_nameserver(s) for s in self.nameservers]


def _parse_nameserver(server: str) -> tuple[str, int]:
    """``10.0.0.2``, ``10.0.0.2:5353``, ``fd00::2`` or ``[fd00::2]:5353`` as (address, port)."""
    text = server.strip()
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ("53" if not rest else "x")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    try:
        ip = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        ip, number = None, 0
    if ip is None or not 0 < number < 65536 or (text.startswith("[") and ip.version != 6):
        raise ValueError(
            f"nameserver {server!r} must be an IP address with an optional port: "
            "10.0.0.2, 10.0.0.2:5353, fd00::2, [fd00::2]:5353"
        )
    return str(ip), number


class DiscoverySettings(_Group):
    """Where the agent finds nodes besides [[nodes]] and the admin API."""

    dns: list[DnsDiscoverySettings] = Field(
        default_factory=list, description="DNS names whose records are nodes ([[discovery.dns]])"
    )

    @model_validator(mode="after")
    def _unique_names(self) -> DiscoverySettings:
        names = [entry.name for entry in self.dns]
        if len(set(names)) != len(names):
            raise ValueError(f"discovery.dns: a name is given twice: {', '.join(names)}")
        return self


class KvEventsSettings(_Group):
    """The nodes' KV-cache events (vLLM's ``--kv-events-config``; docs/agent.md "KV events"):
    where they are published, and the precise prefix index they feed."""

    endpoint: str | None = Field(
        None,
        description="the KV-event PUB socket of every node, a template on the node's host, "
        "e.g. tcp://{host}:5557; a node's own nodes[].kv_events_endpoint wins; none: only the "
        "nodes with their own endpoint publish, the rest are routed by the approximate index",
    )
    replay_endpoint: str | None = Field(
        None,
        description="the replay socket of every node, e.g. tcp://{host}:5558: after a gap or a "
        "reconnect the agent asks it for what it missed; none: a gap clears the node's blocks",
    )
    topic: str = Field(
        "", description="the topic subscribed to (vLLM's kv-events topic); default all"
    )
    # 400k entries, about 115 MiB (policies.kv_index.ENTRY_BYTES): every block of 14 H100s'
    # caches with Llama-3-8B (28k 16-token blocks each); past it the fullest node loses its
    # least recently stored blocks, so a burst of events is bounded, never the agent's memory
    capacity_blocks: int = Field(
        400_000,
        ge=1,
        description="most (node, block) entries the precise index keeps, about 300 bytes each "
        "(115 MiB at the default); over it, the node holding most loses its least recently "
        "stored blocks; default 400000",
    )
    replay_timeout_s: float = Field(
        2.0, gt=0, description="how long a replay socket may take between two replies, seconds"
    )
    retry_interval_s: float = Field(
        5.0,
        gt=0,
        description="seconds between retries of a replay that did not answer, and between two "
        "warnings about one node's endpoint (unreachable, malformed events)",
    )
    reconcile_interval_s: float = Field(
        1.0, gt=0, description="seconds between checks for nodes that joined or left the pool"
    )
    receive_hwm: int = Field(
        100_000,
        ge=1,
        description="batches queued per node before the agent's socket drops them (a gap, "
        "resynced by replay); vLLM's own PUB high-water mark is 100000",
    )

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            sample = value.format(host="10.0.0.5")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"{value!r}: the only placeholder is {{host}}, the node's host ({exc!r})"
            ) from exc
        if not _ZMQ_ENDPOINT.match(sample):
            raise ValueError(
                f"{value!r} is not a ZeroMQ endpoint to connect to: tcp://{{host}}:PORT or "
                "ipc://PATH"
            )
        return value

    @model_validator(mode="after")
    def _replay_needs_events(self) -> KvEventsSettings:
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("replay_endpoint is set without endpoint")
        return self


_MAX_WORKERS = 256


class WorkersSettings(_Group):
    """Serving processes (``regional_agent.workers``, docs/agent.md "Workers")."""

    count: int = Field(
        0,
        ge=0,
        le=_MAX_WORKERS,
        description="agent processes serving the port, each with its own SO_REUSEPORT socket and "
        "event loop, routing on their summed in-flight and prefill counts and each other's "
        "prefix records; 0 (the default): one per CPU the process may use (the cores it may run "
        "on, at most its cgroup's CPU quota, a container's CPU limit, rounded up; 256 at most), "
        "or one with the simulator actuator; 1: one process, no supervisor",
    )
    share_interval_s: float = Field(
        0.002,
        gt=0,
        le=1,
        description="while requests wait in a worker's queue, how often it reads its siblings' "
        "in-flight and prefill counts and wakes the queue when a sibling freed a slot (every "
        "0.1 s while none waits; its decisions read the counts, and the prompts its siblings "
        "routed, themselves)",
    )
    table_slots: int = Field(
        1024,
        ge=8,
        le=65536,
        description="nodes the shared load table holds; a node past it is routed on this "
        "worker's own counts only (a WARNING says so)",
    )

    def processes(self) -> int:
        """How many workers to run: ``count``, or with 0 one per CPU this process may use (its
        affinity's cores, at most its cgroup's CPU quota: ``meridian_service.cpus``)."""
        if self.count:
            return self.count
        return min(cpus.usable(), _MAX_WORKERS)


class SpillSettings(_Group):
    """Spill-over to other regions (``regional_agent.spill``, docs/agent.md "Spill-over"): a
    request this region would queue too long, refuse, or not serve goes to the best other
    region its residency allows that serves its model, read from the controller's plan."""

    enabled: bool = Field(
        False,
        description="forward requests to other regions (needs region.id and region.etcd: the "
        "controller's plan says which regions serve what, where, how loaded)",
    )
    queue_depth: int = Field(
        32,
        ge=1,
        description="spill a request when this many of its model's requests already wait in the "
        "queue here (it queues here when no region is better)",
    )
    latency_budget_ms: float = Field(
        100.0,
        ge=0,
        description="the longest round trip to a region worth spilling to (ms); a region whose "
        "round trip is unknown counts as this",
    )
    latency_ms: dict[str, float] = Field(
        default_factory=dict,
        description="round trip from this region to others (ms), e.g. {eu-central = 12}; wins "
        "over what the controller's probes measured",
    )
    max_regions: int = Field(
        2, ge=1, le=8, description="regions one request may be forwarded to in turn, at most"
    )
    status_max_age_s: float = Field(
        90.0, gt=0, description="a region whose status in the plan is older is not a target (s)"
    )
    eject_consecutive_errors: int = Field(
        3, ge=1, description="failed forwards in a row that eject a region from spill-over"
    )
    eject_base_s: float = Field(
        10.0, gt=0, description="the first ejection lasts this long; the n-th n times as long (s)"
    )
    eject_max_s: float = Field(120.0, gt=0, description="longest ejection of a region (s)")

    @field_validator("latency_ms")
    @classmethod
    def _latencies(cls, value: dict[str, float]) -> dict[str, float]:
        for region, ms in value.items():
            if not _REGION_ID.match(region):
                raise ValueError(
                    f"latency_ms: region id {region!r} must be 1-63 lowercase letters, digits "
                    "and dashes"
                )
            if not ms >= 0 or ms == float("inf"):
                raise ValueError(f"latency_ms: {region} = {ms} must be a finite number >= 0")
        return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MERIDIAN_AGENT_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = ServerSettings()
    nodes: list[NodeSettings] = Field(default_factory=list, description="the region's nodes")
    discovery: DiscoverySettings = DiscoverySettings()
    routing: RoutingSettings = RoutingSettings()
    parse: ParseSettings = ParseSettings()
    tokenizer: TokenizerSettings = TokenizerSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    health: HealthSettings = HealthSettings()
    queue: QueueSettings = QueueSettings()
    tenants: TenantsSettings = TenantsSettings()
    retry: RetrySettings = RetrySettings()
    upstream: UpstreamSettings = UpstreamSettings()
    stall: StallSettings = StallSettings()
    admin: AdminSettings = AdminSettings()
    otel: TelemetryExportSettings = TelemetryExportSettings()
    region: RegionSettings = RegionSettings()
    group_tables: GroupTableSettings = GroupTableSettings()
    autoscaler: AutoscalerSettings = AutoscalerSettings()
    workers: WorkersSettings = WorkersSettings()
    kv_events: KvEventsSettings = KvEventsSettings()
    spill: SpillSettings = SpillSettings()

    @model_validator(mode="after")
    def _one_owner(self) -> Settings:
        """What one process must own is not shared between workers yet: refuse it by name.
        (An autoscaler that calls out, ``command``, ``webhook`` or ``kubernetes``, acts in one
        worker and reads every worker's load; the simulator actuator adds the nodes it starts
        to its own process's pool.)"""
        if self.workers.count > 1 and self.autoscaler.actuator == "simulator":
            raise ValueError(
                f"workers.count = {self.workers.count} with autoscaler.actuator = 'simulator': "
                "the simulator actuator adds the nodes it starts to one process's pool, so it "
                "runs with workers.count = 1 (the other actuators run with workers); see "
                "docs/agent.md, Workers"
            )
        return self

    def processes(self) -> int:
        """How many workers to run (``workers.count``, its 0 resolved: one per CPU, or one
        where the simulator actuator needs one process)."""
        if self.workers.count == 0 and self.autoscaler.actuator == "simulator":
            return 1
        return self.workers.processes()

    @model_validator(mode="after")
    def _spill_needs_the_plan(self) -> Settings:
        if self.spill.enabled and not self.region.publishing:
            raise ValueError(
                "spill.enabled needs region.id and region.etcd: the regions to spill to come "
                "from the controller's plan in etcd"
            )
        return self

    @model_validator(mode="after")
    def _unique_nodes(self) -> Settings:
        seen: set[str] = set()
        for i, node in enumerate(self.nodes):
            if node.node_id in seen:
                raise ValueError(f"nodes[{i}]: duplicate node id {node.node_id!r}")
            seen.add(node.node_id)
        return self


def load(*, config_file: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Settings from flags (``overrides``) > environment > ``config_file`` > defaults."""
    return settings_loading.load_settings(Settings, config_file=config_file, overrides=overrides)
