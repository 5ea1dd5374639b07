"""Fixtures for simulator tests: small engine profiles and in-process simulated nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

from meridian_sim import profile
from tests.conftest import NodeFactory

__all__ = ["NodeFactory", "small_profile"]


def small_profile(**overrides: Any) -> profile.Profile:
    """A tiny profile for engine tests: 4-token blocks, 8 of them, 1 ms per step."""
    timing = profile.Timing(
        step_overhead_ms=1.0,
        linear_tokens=(1, 1000),
        linear_ms=(0.0, 1.0),
        decode_attention_ms_per_1k_kv_tokens=0.0,
        prefill_attention_ms_per_1m_token_pairs=0.0,
    )
    base = profile.Profile(
        name="test-small",
        description="engine tests",
        model="test-model",
        max_model_len=32,
        block_size=4,
        num_gpu_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        mean_output_tokens=8,
        timing=timing,
        source="tests",
    )
    return dataclasses.replace(base, **overrides)
