"""benchmarks/workers_throughput.py's routing measure for static nodes: the prompt affinity,
from the request ids each node logged (``g<prompt>-<n>``; the agent's own requests log none)."""

from __future__ import annotations

import random

import pytest
import workers_throughput


def test_every_prompt_on_one_node_is_an_affinity_of_one() -> None:
    logs = [["g0-1", "g0-3", "-", "g2-5"], ["g1-2", "g1-4", "-"]]
    assert workers_throughput.prompt_affinity(logs) == 1.0


def test_a_prompt_split_over_two_nodes_counts_its_larger_share() -> None:
    # g0: 3 on node 0, 1 on node 1 -> 3 of 4; g1: 2 of 2 -> 5 of 6 in all
    logs = [["g0-1", "g0-3", "g0-5"], ["g0-7", "g1-2", "g1-4"]]
    assert workers_throughput.prompt_affinity(logs) == pytest.approx(5 / 6)


def test_requests_sent_to_either_node_at_random_are_about_one_half() -> None:
    rng = random.Random(7)
    logs: list[list[str]] = [[], []]
    for n in range(1, 8001):
        logs[rng.randrange(2)].append(f"g{n % 8}-{n}")
    assert workers_throughput.prompt_affinity(logs) == pytest.approx(0.5, abs=0.02)


def test_no_request_of_the_load_is_no_measure() -> None:
    assert workers_throughput.prompt_affinity([["-", "-"], []]) is None
