#!/usr/bin/env python3
"""Derive the H100 and A100 Llama-3-8B simulator profiles from vidur's operator profiles.

Usage::

    .venv/bin/python scripts/calibrate_profiles.py [CALIBRATION_DIR] [--out-dir DIR]

``CALIBRATION_DIR`` defaults to ``data/calibration`` in the repository (see ``data/README.md``)
and must hold vidur's ``*_mlp.csv`` tables for A100 Llama-2-7B, A100 Meta-Llama-3-8B and H100
Llama-2-7B.  The script writes ``h100-llama3-8b.toml`` and ``a100-llama3-8b.toml`` (to
``meridian_sim/profiles`` unless ``--out-dir`` says otherwise), prints the derived numbers, then
loads the written files with ``meridian_sim.profile.load`` and prints a sanity check against
llm-d's simulator.  See ``docs/calibration.md`` for the method and its inputs.  Standard library
only.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CALIBRATION_DIR = REPO_ROOT / "data" / "calibration"
DEFAULT_OUT_DIR = REPO_ROOT / "meridian_sim" / "profiles"

CSV_A100_LLAMA2 = "vidur_a100_meta-llama_Llama-2-7b-hf_mlp.csv"
CSV_A100_LLAMA3 = "vidur_a100_meta-llama_Meta-Llama-3-8B_mlp.csv"
CSV_H100_LLAMA2 = "vidur_h100_meta-llama_Llama-2-7b-hf_mlp.csv"

# vidur's per-layer, non-attention operators (times in ms); ``emb`` runs once per step.
PER_LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
PER_STEP_OPS = ("emb",)
ALL_OPS = PER_STEP_OPS + PER_LAYER_OPS

# Token counts for the ``linear_tokens`` table (the closest row of each table is used).
TARGET_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Meta-Llama-3-8B architecture.
LAYERS = 32
HIDDEN = 4096
KV_HEADS = 8
HEAD_DIM = 128
INTERMEDIATE = 14336
VOCAB = 128256
BYTES_PER_PARAM = 2  # bf16
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES_PER_PARAM  # K and V: 128 KiB
# Attention FLOPs per (query, key) pair: QK^T and AV, hidden MACs each, 2 FLOPs per MAC.
ATTN_FLOPS_PER_TOKEN_PAIR = 4 * LAYERS * HIDDEN
# Weights the vidur tables read per step (q, k, v, o, gate, up, down) and the lm_head.
LAYER_WEIGHT_PARAMS = LAYERS * HIDDEN * (2 * HIDDEN + 2 * KV_HEADS * HEAD_DIM + 3 * INTERMEDIATE)
LM_HEAD_PARAMS = VOCAB * HIDDEN

# Calibration targets and assumptions (see docs/calibration.md).
H100_LIGHT_LOAD_ITL_MS = 13.0  # vLLM-reported ms per output token, Llama-3-8B, one H100
LIGHT_LOAD_CONTEXT_TOKENS = 1024  # context of the one decoding sequence in that step
DECODE_BANDWIDTH_EFFICIENCY = 0.65  # achieved / peak HBM bandwidth for paged KV reads
PREFILL_FLOPS_EFFICIENCY = 0.45  # achieved / peak dense bf16 FLOP/s for prefill attention
SMALL_TOKENS_MAX = 64  # rows with num_tokens <= this are the memory-bound (decode) regime

# Scheduler / capacity settings shared by both profiles.
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
NUM_GPU_BLOCKS_80GB = 27793  # real vLLM log, Llama-3-8B on an 80 GB card (docs/calibration.md)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
MEAN_OUTPUT_TOKENS = 256

# llm-d inference simulator's 8B-on-H100 settings (docs/calibration.md).
LLMD_TTFT_BASE_MS = 30.0
LLMD_TTFT_MS_PER_TOKEN = 0.25
LLMD_ITL_MS = 12.0


@dataclass(frozen=True, slots=True)
class Gpu:
    label: str
    hbm_tb_per_s: float
    bf16_dense_tflops: float


H100 = Gpu("H100 SXM 80GB", hbm_tb_per_s=3.35, bf16_dense_tflops=989.0)
A100 = Gpu("A100 SXM 80GB", hbm_tb_per_s=2.0, bf16_dense_tflops=312.0)


@dataclass(frozen=True, slots=True)
class OpTable:
    """Median op times of one vidur CSV (tensor parallel 1), keyed by num_tokens."""

    path: Path
    ops: Mapping[int, Mapping[str, float]]

    def closest(self, tokens: int) -> int:
        return min(self.ops, key=lambda n: (abs(n - tokens), n))

    def step_ms(self, tokens: int) -> float:
        """Non-attention step time: emb + LAYERS x sum of the per-layer ops."""
        row = self.ops[tokens]
        return sum(row[op] for op in PER_STEP_OPS) + LAYERS * sum(row[op] for op in PER_LAYER_OPS)

    @property
    def max_tokens(self) -> int:
        return max(self.ops)


def load_op_table(path: Path) -> OpTable:
    """Read a vidur ``*_mlp.csv``: keep TP=1 rows, average the medians of duplicate rows."""
    if not path.is_file():
        raise SystemExit(f"calibration file not found: {path}")
    samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if int(row["num_tensor_parallel_workers"]) != 1:
                continue
            if int(row["n_embd"]) != HIDDEN:
                raise SystemExit(f"{path}: unexpected n_embd {row['n_embd']}")
            tokens = int(row["num_tokens"])
            for op in ALL_OPS:
                samples[tokens][op].append(float(row[f"time_stats.{op}.median"]))
    if not samples:
        raise SystemExit(f"{path}: no rows with num_tensor_parallel_workers == 1")
    ops = {
        tokens: {op: statistics.fmean(values) for op, values in per_op.items()}
        for tokens, per_op in samples.items()
    }
    return OpTable(path=path, ops=ops)


@dataclass(frozen=True, slots=True)
class LinearPoint:
    tokens: int
    ms: float
    note: str


@dataclass(frozen=True, slots=True)
class Derived:
    name: str
    gpu: Gpu
    points: tuple[LinearPoint, ...]
    step_overhead_ms: float
    lm_head_ms: float
    decode_attention_ms_per_1k_kv_tokens: float
    prefill_attention_ms_per_1m_token_pairs: float

    def linear_at(self, tokens: int) -> float:
        for point in self.points:
            if point.tokens == tokens:
                return point.ms
        raise KeyError(tokens)


def decode_attention_ms_per_1k(gpu: Gpu) -> float:
    bytes_per_s = gpu.hbm_tb_per_s * 1e12 * DECODE_BANDWIDTH_EFFICIENCY
    return 1_000 * KV_BYTES_PER_TOKEN / bytes_per_s * 1e3


def prefill_attention_ms_per_1m_pairs(gpu: Gpu) -> float:
    flops_per_s = gpu.bf16_dense_tflops * 1e12 * PREFILL_FLOPS_EFFICIENCY
    return 1_000_000 * ATTN_FLOPS_PER_TOKEN_PAIR / flops_per_s * 1e3


def a100_linear_points(a100_l3: OpTable) -> tuple[LinearPoint, ...]:
    points: list[LinearPoint] = []
    for target in TARGET_TOKENS:
        if target > a100_l3.max_tokens:
            continue
        row = a100_l3.closest(target)
        if points and row == points[-1].tokens:
            continue
        points.append(LinearPoint(row, a100_l3.step_ms(row), "A100 Llama-3-8B, measured"))
    return tuple(points)


def h100_linear_points(
    h100_l2: OpTable, a100_l2: OpTable, a100_l3: OpTable
) -> tuple[LinearPoint, ...]:
    """H100 Llama-3-8B ~= H100 Llama-2-7B x (A100 Llama-3-8B / A100 Llama-2-7B) per token count.

    Beyond the last Llama-2-7B row, hold the H100/A100 speedup of that row constant and scale the
    A100 Llama-3-8B measurement (the GEMMs are compute-bound there).
    """
    points: list[LinearPoint] = []
    last_speedup: float | None = None
    for target in TARGET_TOKENS:
        if target <= h100_l2.max_tokens:
            row = h100_l2.closest(target)
            if row not in a100_l2.ops or row not in a100_l3.ops:
                raise SystemExit(f"no A100 row with num_tokens={row} to form the model ratio")
            ratio = a100_l3.step_ms(row) / a100_l2.step_ms(row)
            ms = h100_l2.step_ms(row) * ratio
            last_speedup = a100_l3.step_ms(row) / ms
            note = f"H100 Llama-2-7B x {ratio:.3f}"
        elif target <= a100_l3.max_tokens and last_speedup is not None:
            row = a100_l3.closest(target)
            ms = a100_l3.step_ms(row) / last_speedup
            note = f"A100 Llama-3-8B / {last_speedup:.3f} (speedup held)"
        else:
            continue
        if points and row == points[-1].tokens:
            continue
        points.append(LinearPoint(row, ms, note))
    return tuple(points)


def per_op_h100_estimate(h100_l2: OpTable, a100_l2: OpTable, a100_l3: OpTable, n: int) -> float:
    """Cross-check: apply the Llama-3/Llama-2 ratio per operator instead of to the total."""
    h2, a2, a3 = h100_l2.ops[n], a100_l2.ops[n], a100_l3.ops[n]
    per_step = sum(h2[op] * a3[op] / a2[op] for op in PER_STEP_OPS)
    per_layer = sum(h2[op] * a3[op] / a2[op] for op in PER_LAYER_OPS)
    return per_step + LAYERS * per_layer


def small_token_ratio(slow: OpTable, fast: OpTable) -> float:
    """Mean slow/fast ratio of the non-attention step time over the memory-bound rows."""
    rows = sorted(n for n in slow.ops if n <= SMALL_TOKENS_MAX and n in fast.ops)
    return statistics.fmean(slow.step_ms(n) / fast.step_ms(n) for n in rows)


def lm_head_ms(points: Sequence[LinearPoint]) -> float:
    """lm_head time at decode: its weight bytes read at the bandwidth the 1-token row achieves."""
    return points[0].ms * LM_HEAD_PARAMS / LAYER_WEIGHT_PARAMS


def derive(calibration_dir: Path) -> tuple[Derived, Derived, float, float]:
    a100_l2 = load_op_table(calibration_dir / CSV_A100_LLAMA2)
    a100_l3 = load_op_table(calibration_dir / CSV_A100_LLAMA3)
    h100_l2 = load_op_table(calibration_dir / CSV_H100_LLAMA2)

    h100_points = h100_linear_points(h100_l2, a100_l2, a100_l3)
    a100_points = a100_linear_points(a100_l3)
    if h100_points[0].tokens != 1 or a100_points[0].tokens != 1:
        raise SystemExit("the calibration tables need a num_tokens=1 row")

    h100_decode = decode_attention_ms_per_1k(H100)
    h100_overhead = (
        H100_LIGHT_LOAD_ITL_MS - h100_points[0].ms - h100_decode * LIGHT_LOAD_CONTEXT_TOKENS / 1_000
    )
    if h100_overhead < 0:
        raise SystemExit("measured 1-token time already exceeds the light-load ITL target")
    ratio = small_token_ratio(a100_l2, h100_l2)
    h100 = Derived(
        name="h100-llama3-8b",
        gpu=H100,
        points=h100_points,
        step_overhead_ms=h100_overhead,
        lm_head_ms=lm_head_ms(h100_points),
        decode_attention_ms_per_1k_kv_tokens=h100_decode,
        prefill_attention_ms_per_1m_token_pairs=prefill_attention_ms_per_1m_pairs(H100),
    )
    a100 = Derived(
        name="a100-llama3-8b",
        gpu=A100,
        points=a100_points,
        step_overhead_ms=h100_overhead * ratio,
        lm_head_ms=lm_head_ms(a100_points),
        decode_attention_ms_per_1k_kv_tokens=decode_attention_ms_per_1k(A100),
        prefill_attention_ms_per_1m_token_pairs=prefill_attention_ms_per_1m_pairs(A100),
    )

    print("Non-attention step time (ms) = emb + 32 x sum(per-layer op medians), TP=1")
    print(
        f"{'tokens':>7} {'A100 L2-7B':>11} {'A100 L3-8B':>11} {'H100 L2-7B':>11} "
        f"{'L3/L2':>6} {'H100 L3 est':>12} {'per-op est':>11}  H100 source"
    )
    for point in h100_points:
        n = point.tokens
        a2 = f"{a100_l2.step_ms(n):11.3f}" if n in a100_l2.ops else f"{'-':>11}"
        h2 = f"{h100_l2.step_ms(n):11.3f}" if n in h100_l2.ops else f"{'-':>11}"
        if n in a100_l2.ops:
            l3_over_l2 = f"{a100_l3.step_ms(n) / a100_l2.step_ms(n):6.3f}"
            per_op = f"{per_op_h100_estimate(h100_l2, a100_l2, a100_l3, n):11.3f}"
        else:
            l3_over_l2, per_op = f"{'-':>6}", f"{'-':>11}"
        print(
            f"{n:>7} {a2} {a100_l3.step_ms(n):11.3f} {h2} {l3_over_l2} "
            f"{point.ms:12.3f} {per_op}  {point.note}"
        )
    print()
    print(
        f"A100/H100 ratio of the non-attention time, mean over rows <= {SMALL_TOKENS_MAX} tokens: "
        f"{ratio:.3f} (HBM bandwidth ratio {H100.hbm_tb_per_s / A100.hbm_tb_per_s:.3f})"
    )
    alt_overhead = h100.step_overhead_ms - h100.lm_head_ms + a100.lm_head_ms
    print(
        f"A100 step_overhead_ms = H100 {h100.step_overhead_ms:.3f} x {ratio:.3f} = "
        f"{a100.step_overhead_ms:.3f}; alternative (only the lm_head scales, the rest is host "
        f"time): {alt_overhead:.3f}"
    )
    light_kv = a100.decode_attention_ms_per_1k_kv_tokens * LIGHT_LOAD_CONTEXT_TOKENS / 1_000
    print(
        f"A100 batch-1 decode step: {a100.step_overhead_ms + a100_points[0].ms + light_kv:.2f} ms "
        f"(alternative: {alt_overhead + a100_points[0].ms + light_kv:.2f} ms)"
    )
    return h100, a100, ratio, alt_overhead


def _fmt_list(values: Sequence[float | int], fmt: str) -> str:
    return "[" + ", ".join(format(v, fmt) for v in values) + "]"


def render_toml(d: Derived, ratio: float, alt_overhead_ms: float) -> str:
    tokens = [p.tokens for p in d.points]
    ms = [p.ms for p in d.points]
    host_ms = d.step_overhead_ms - d.lm_head_ms
    if d.gpu is H100:
        linear_comment = (
            "# There is no H100 Llama-3-8B table, so linear_ms is an ESTIMATE:\n"
            "# H100 Llama-2-7B x (A100 Llama-3-8B / A100 Llama-2-7B) at each token count; above\n"
            "# 4096 tokens (the last Llama-2-7B row) it is A100 Llama-3-8B divided by the\n"
            "# H100/A100 speedup at 4096 tokens."
        )
        overhead_comment = (
            "# step_overhead_ms: set so that one decoding sequence with "
            f"{LIGHT_LOAD_CONTEXT_TOKENS} tokens of context\n"
            f"# takes {H100_LIGHT_LOAD_ITL_MS:g} ms per step (vLLM's light-load figure for "
            "Llama-3-8B on one H100). Of it,\n"
            f"# ~{d.lm_head_ms:.2f} ms is the lm_head (not in vidur's tables: its 128256 x 4096 "
            "bf16 weights read at the\n# bandwidth the 1-token row achieves); the other "
            f"~{host_ms:.2f} ms is not explained by the tables\n"
            "# (sampling, host/scheduler work, launch gaps)."
        )
        description = "Llama-3-8B bf16 on one H100 SXM 80GB, vLLM V1 defaults (vidur-derived)"
    else:
        linear_comment = "# Measured directly from vidur's A100 Meta-Llama-3-8B table."
        overhead_comment = (
            f"# step_overhead_ms: the H100 overhead x {ratio:.3f}, the measured A100/H100 "
            "ratio of\n"
            f"# the non-attention step time at <= {SMALL_TOKENS_MAX} tokens (memory-bound, like "
            f"decode; the HBM\n# bandwidth ratio is {H100.hbm_tb_per_s / A100.hbm_tb_per_s:.3f})."
            f" This treats all of it as GPU time; the lm_head\n# share is ~{d.lm_head_ms:.2f} ms. "
            "If the unexplained H100 remainder were host time that does not\n# scale, the "
            f"overhead would be {alt_overhead_ms:.3f} ms. Not validated against an A100 "
            "measurement."
        )
        description = "Llama-3-8B bf16 on one A100 SXM 80GB, vLLM V1 defaults (vidur-derived)"
    tables = (
        "H100 Llama-2-7B scaled by A100 Llama-3-8B/Llama-2-7B"
        if d.gpu is H100
        else "A100 Meta-Llama-3-8B"
    )
    anchor = f"batch-1 ITL anchored to {H100_LIGHT_LOAD_ITL_MS:g} ms on H100"
    if d.gpu is not H100:
        anchor = f"overhead scaled x{ratio:.3f} from the H100 {H100_LIGHT_LOAD_ITL_MS:g} ms anchor"
    source_note = (
        f"scripts/calibrate_profiles.py: microsoft/vidur operator profiles ({tables}); "
        f"{anchor}; see docs/calibration.md"
    )
    eff_bw = DECODE_BANDWIDTH_EFFICIENCY
    eff_fl = PREFILL_FLOPS_EFFICIENCY
    return f"""\
# Generated by scripts/calibrate_profiles.py -- edit the script, not this file.
# Meta-Llama-3-8B-Instruct, bf16, tensor parallel 1, on one {d.gpu.label}.
# Capacity: {NUM_GPU_BLOCKS_80GB} blocks of {BLOCK_SIZE} tokens, from a real vLLM log for \
Llama-3-8B on an 80 GB card
# (128 KiB of KV per token, 2 MiB per block); scheduler limits are vLLM V1 chunked-prefill defaults.
name = "{d.name}"
description = "{description}"
model = "{MODEL}"
max_model_len = {MAX_MODEL_LEN}
block_size = {BLOCK_SIZE}
num_gpu_blocks = {NUM_GPU_BLOCKS_80GB}
max_num_seqs = {MAX_NUM_SEQS}
max_num_batched_tokens = {MAX_NUM_BATCHED_TOKENS}
mean_output_tokens = {MEAN_OUTPUT_TOKENS}
source_note = "{source_note}"

[timing]
{overhead_comment}
step_overhead_ms = {d.step_overhead_ms:.3f}
# linear_ms: non-attention time per step = emb + 32 x sum of vidur's per-layer op medians
# (layernorms, qkv/o projections, rope, MLP, residual add), TP=1, at each token count.
{linear_comment}
linear_tokens = {_fmt_list(tokens, "d")}
linear_ms = {_fmt_list(ms, ".3f")}
# Decode attention reads 128 KiB of KV per context token at {eff_bw:.0%} of \
{d.gpu.hbm_tb_per_s:g} TB/s HBM bandwidth.
decode_attention_ms_per_1k_kv_tokens = {d.decode_attention_ms_per_1k_kv_tokens:.4f}
# Prefill attention: 4 x 32 layers x 4096 FLOPs per (query, key) pair at {eff_fl:.0%} of \
{d.gpu.bf16_dense_tflops:g} dense
# bf16 TFLOP/s.
prefill_attention_ms_per_1m_token_pairs = {d.prefill_attention_ms_per_1m_token_pairs:.4f}
"""


def print_derived(profiles: Sequence[Derived]) -> None:
    print()
    print("Derived timing")
    header = f"{'':>42}" + "".join(f"{d.name:>16}" for d in profiles)
    print(header)
    rows: list[tuple[str, list[float], str]] = [
        ("step_overhead_ms", [d.step_overhead_ms for d in profiles], ".3f"),
        ("  of which lm_head (estimate)", [d.lm_head_ms for d in profiles], ".3f"),
        (
            "decode_attention_ms_per_1k_kv_tokens",
            [d.decode_attention_ms_per_1k_kv_tokens for d in profiles],
            ".4f",
        ),
        (
            "prefill_attention_ms_per_1m_token_pairs",
            [d.prefill_attention_ms_per_1m_token_pairs for d in profiles],
            ".4f",
        ),
    ]
    for label, values, fmt in rows:
        print(f"{label:>42}" + "".join(f"{format(v, fmt):>16}" for v in values))
    for i, point in enumerate(profiles[0].points):
        values = [d.points[i].ms if i < len(d.points) else float("nan") for d in profiles]
        print(f"{f'linear_ms @ {point.tokens} tokens':>42}" + "".join(f"{v:16.3f}" for v in values))


def _prefill_alone_ms(step: Callable[[int, int, float], float], prompt: int, chunk: int) -> float:
    total, done = 0.0, 0
    while done < prompt:
        c = min(chunk, prompt - done)
        total += step(c, 0, c * done + c * c / 2)
        done += c
    return total


class StepFn:
    """Adapter so the sanity check can call a loaded profile's Timing.step_ms positionally."""

    def __init__(self, profile_path: Path) -> None:
        sys.path.insert(0, str(REPO_ROOT))
        from meridian_sim.profile import load

        self.profile = load(str(profile_path))

    def __call__(self, tokens: int, kv_tokens: int, pairs: float) -> float:
        return self.profile.timing.step_ms(
            tokens_in_step=tokens, kv_tokens_read=kv_tokens, token_pairs=pairs
        )


def sanity_check(profile_path: Path, *, compare_llmd: bool) -> None:
    step = StepFn(profile_path)
    profile = step.profile
    timing = profile.timing
    print()
    print(
        f"Sanity check: {profile.name} loaded from {profile_path.name} "
        f"(KV cache {profile.kv_cache_tokens} tokens)"
    )
    context = LIGHT_LOAD_CONTEXT_TOKENS
    llmd_cols = f" {'llm-d ms':>9} {'ratio':>6}" if compare_llmd else ""
    print(f"  decode step, every sequence with {context} tokens of context")
    print(f"  {'batch':>6} {'step ms':>9} {'attn ms':>8} {'tok/s':>8}{llmd_cols}")
    for batch in (1, 32, 128, 256):
        ms = step(batch, batch * context, 0.0)
        attn = timing.decode_attention_ms_per_1k_kv_tokens * batch * context / 1_000
        line = f"  {batch:>6} {ms:9.2f} {attn:8.2f} {batch / ms * 1e3:8.0f}"
        if compare_llmd:
            # llm-d: ITL 12 ms, scaled linearly up to 2x as the batch fills to max_num_seqs.
            llmd = LLMD_ITL_MS * (1 + batch / profile.max_num_seqs)
            line += f" {llmd:9.2f} {ms / llmd:6.2f}"
        print(line)
    chunk = profile.max_num_batched_tokens
    print(f"  prefill of one prompt alone (chunks of {chunk} tokens; TTFT = the prefill steps)")
    print(f"  {'prompt':>6} {'TTFT ms':>9} {'attn ms':>8} {'tok/s':>8}{llmd_cols}")
    needed_eff: list[tuple[int, float]] = []
    for prompt in (1024, 2048, 4096):
        ms = _prefill_alone_ms(step, prompt, chunk)
        attn = ms - _prefill_alone_ms(lambda t, k, _p: step(t, k, 0.0), prompt, chunk)
        line = f"  {prompt:>6} {ms:9.2f} {attn:8.2f} {prompt / ms * 1e3:8.0f}"
        if compare_llmd:
            llmd = LLMD_TTFT_BASE_MS + LLMD_TTFT_MS_PER_TOKEN * prompt
            line += f" {llmd:9.2f} {ms / llmd:6.2f}"
            needed_attn = llmd - (ms - attn)
            needed_eff.append((prompt, PREFILL_FLOPS_EFFICIENCY * attn / needed_attn))
        print(line)
    if compare_llmd:
        for prompt, eff in needed_eff:
            print(
                f"  prefill attention efficiency that would match llm-d's TTFT at {prompt} "
                f"tokens: {eff:.2%} (used: {PREFILL_FLOPS_EFFICIENCY:.0%})"
            )
        batch = profile.max_num_seqs
        no_attn = step(batch, 0, 0.0)
        full_bw = no_attn + (
            timing.decode_attention_ms_per_1k_kv_tokens
            * DECODE_BANDWIDTH_EFFICIENCY
            * batch
            * context
            / 1_000
        )
        print(
            f"  decode step at batch {batch} with 100% HBM efficiency: {full_bw:.2f} ms "
            f"(without attention: {no_attn:.2f} ms)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "calibration_dir",
        nargs="?",
        type=Path,
        default=DEFAULT_CALIBRATION_DIR,
        help=f"folder with vidur's *_mlp.csv tables (default: {DEFAULT_CALIBRATION_DIR})",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help=f"where to write the profiles (default: {DEFAULT_OUT_DIR})",
    )
    args = parser.parse_args(argv)
    calibration_dir: Path = args.calibration_dir
    out_dir: Path = args.out_dir

    h100, a100, ratio, alt_overhead_ms = derive(calibration_dir)
    print_derived((h100, a100))

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for derived in (h100, a100):
        path = out_dir / f"{derived.name}.toml"
        path.write_text(render_toml(derived, ratio, alt_overhead_ms), encoding="utf-8")
        written.append(path)
    print()
    for path in written:
        print(f"wrote {path}")

    sanity_check(written[0], compare_llmd=True)
    sanity_check(written[1], compare_llmd=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
