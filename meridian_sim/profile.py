"""GPU timing profiles for simulated vLLM nodes.

A profile is a TOML data file in ``meridian_sim/profiles/`` (or any path) that says how big the
node's KV cache is, how vLLM's scheduler is configured, and how long one engine step takes::

    step_ms = step_overhead_ms
            + interp(linear_tokens, linear_ms, tokens_in_step)          # GEMMs, norms, MLP
            + decode_attention_ms_per_1k_kv_tokens * kv_tokens_read / 1000
            + prefill_attention_ms_per_1m_token_pairs * token_pairs / 1e6
            + decode_ms_per_seq * decoding_sequences                    # optional, default 0

``tokens_in_step`` is the number of tokens the step computes (prefill chunk tokens plus one per
decoding sequence); ``kv_tokens_read`` is the sum of the context lengths of the decoding
sequences; ``token_pairs`` is, for each prefill chunk of ``c`` tokens after ``p`` tokens already
in the cache, ``c * p + c * c / 2`` (causal attention).  ``interp`` is piecewise-linear inside the
table and linear extrapolation from the last two points beyond it.

Two optional ``[timing]`` fields (default 0) carry what real vLLM on CPU showed
(benchmarks/sim_fidelity.py): ``decode_ms_per_seq``, a cost per decoding sequence in a step
(sampling, per-sequence attention and output handling, which on CPU cost far more than a prefill
token), and ``request_overhead_ms``, the time between a request's arrival at the server and its
entering the engine's queue (vLLM's API server and the hop to its engine-core process); it counts
in TTFT and end-to-end latency, not in queue time.
"""

from __future__ import annotations

import bisect
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


class ProfileError(ValueError):
    """A profile file is missing, unreadable or has a bad field (the message names it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    step_overhead_ms: float
    linear_tokens: tuple[int, ...]
    linear_ms: tuple[float, ...]
    decode_attention_ms_per_1k_kv_tokens: float
    prefill_attention_ms_per_1m_token_pairs: float
    decode_ms_per_seq: float = 0.0
    request_overhead_ms: float = 0.0

    def linear_cost_ms(self, tokens: int) -> float:
        xs, ys = self.linear_tokens, self.linear_ms
        if tokens <= 0:
            return 0.0
        if tokens <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, tokens)
        if i >= len(xs):
            i = len(xs) - 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def step_ms(
        self,
        *,
        tokens_in_step: int,
        kv_tokens_read: int,
        token_pairs: float,
        decode_seqs: int = 0,
    ) -> float:
        return (
            self.step_overhead_ms
            + self.linear_cost_ms(tokens_in_step)
            + self.decode_attention_ms_per_1k_kv_tokens * kv_tokens_read / 1_000
            + self.prefill_attention_ms_per_1m_token_pairs * token_pairs / 1_000_000
            + self.decode_ms_per_seq * decode_seqs
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    name: str
    description: str
    model: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    mean_output_tokens: int
    timing: Timing
    source: str

    @property
    def kv_cache_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks


def builtin_names() -> list[str]:
    folder = resources.files("meridian_sim").joinpath("profiles")
    return sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )


def load(name_or_path: str) -> Profile:
    """Load a built-in profile by name (``h100-llama3-8b``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read profile file {path}: {exc.strerror}") from exc
        return parse(text, source=str(path))
    resource = resources.files("meridian_sim").joinpath("profiles", f"{name_or_path}.toml")
    if not resource.is_file():
        known = ", ".join(builtin_names())
        raise ProfileError(f"unknown profile {name_or_path!r}; built-in profiles: {known}")
    return parse(resource.read_text(encoding="utf-8"), source=f"builtin:{name_or_path}")


def _field(table: dict[str, object], key: str, kind: type, where: str) -> object:
    if key not in table:
        raise ProfileError(f"profile {where}: missing field {key!r}")
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProfileError(f"profile {where}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _positive_int(table: dict[str, object], key: str, where: str) -> int:
    value = _field(table, key, int, where)
    assert isinstance(value, int)
    if value <= 0:
        raise ProfileError(f"profile {where}: field {key!r} must be > 0, got {value}")
    return value


def _nonneg_float(table: dict[str, object], key: str, where: str) -> float:
    value = _field(table, key, float, where)
    assert isinstance(value, float)
    if value < 0:
        raise ProfileError(f"profile {where}: field {key!r} must be >= 0, got {value}")
    return value


def _optional_nonneg_float(table: dict[str, object], key: str, where: str) -> float:
    return _nonneg_float(table, key, where) if key in table else 0.0


def parse(text: str, *, source: str) -> Profile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {source}: not valid TOML: {exc}") from exc
    timing_table = doc.get("timing")
    if not isinstance(timing_table, dict):
        raise ProfileError(f"profile {source}: missing table [timing]")
    tokens = timing_table.get("linear_tokens")
    costs = timing_table.get("linear_ms")
    if (
        not isinstance(tokens, list)
        or not isinstance(costs, list)
        or len(tokens) != len(costs)
        or len(tokens) < 2
    ):
        raise ProfileError(
            f"profile {source}: [timing] linear_tokens and linear_ms must be lists of equal "
            "length (at least 2 points)"
        )
    if any(not isinstance(t, int) or t <= 0 for t in tokens) or tokens != sorted(set(tokens)):
        raise ProfileError(
            f"profile {source}: [timing] linear_tokens must be strictly increasing positive ints"
        )
    if any(not isinstance(c, int | float) or c < 0 for c in costs):
        raise ProfileError(f"profile {source}: [timing] linear_ms must be non-negative numbers")
    where_t = f"{source} [timing]"
    timing = Timing(
        step_overhead_ms=_nonneg_float(timing_table, "step_overhead_ms", where_t),
        linear_tokens=tuple(int(t) for t in tokens),
        linear_ms=tuple(float(c) for c in costs),
        decode_attention_ms_per_1k_kv_tokens=_nonneg_float(
            timing_table, "decode_attention_ms_per_1k_kv_tokens", where_t
        ),
        prefill_attention_ms_per_1m_token_pairs=_nonneg_float(
            timing_table, "prefill_attention_ms_per_1m_token_pairs", where_t
        ),
        decode_ms_per_seq=_optional_nonneg_float(timing_table, "decode_ms_per_seq", where_t),
        request_overhead_ms=_optional_nonneg_float(timing_table, "request_overhead_ms", where_t),
    )
    name = _field(doc, "name", str, source)
    description = _field(doc, "description", str, source)
    model = _field(doc, "model", str, source)
    assert isinstance(name, str) and isinstance(description, str) and isinstance(model, str)
    profile = Profile(
        name=name,
        description=description,
        model=model,
        max_model_len=_positive_int(doc, "max_model_len", source),
        block_size=_positive_int(doc, "block_size", source),
        num_gpu_blocks=_positive_int(doc, "num_gpu_blocks", source),
        max_num_seqs=_positive_int(doc, "max_num_seqs", source),
        max_num_batched_tokens=_positive_int(doc, "max_num_batched_tokens", source),
        mean_output_tokens=_positive_int(doc, "mean_output_tokens", source),
        timing=timing,
        source=source,
    )
    return profile
