"""Engine unit tests: batching, prefix hits in whole blocks, eviction, preemption, queueing."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from meridian_sim.engine import Engine, RequestRecord, StepResult
from tests.simulator.conftest import small_profile


def _run(
    engine: Engine, *, now: float = 0.0, max_steps: int = 10_000
) -> tuple[float, list[StepResult]]:
    steps = []
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        result = engine.step(now=now)
        now += result.duration_s
        steps.append(result)
    assert not engine.has_unfinished, "engine did not drain"
    return now, steps


def _finished(steps: list[StepResult]) -> dict[str, RequestRecord]:
    return {r.request_id: r for s in steps for r in s.finished}


def _blocks_conserved(engine: Engine) -> None:
    kv = engine.kv
    referenced = sum(1 for r in kv._ref if r > 0)
    assert referenced + kv.num_free == kv.num_blocks
    assert all(r >= 0 for r in kv._ref)


def test_single_request_generates_max_tokens_with_ignore_eos() -> None:
    engine = Engine(small_profile(), rng=random.Random(0))
    engine.add("a", tuple(range(10)), max_tokens=5, ignore_eos=True, now=0.0)
    _, steps = _run(engine)
    record = _finished(steps)["a"]
    assert record.finish_reason == "length"
    assert record.generation_tokens == 5
    assert record.prompt_tokens == 10
    # one prefill step that samples the first token, then four decode steps
    assert len(steps) == 5
    assert engine.kv.usage == 0.0
    assert engine.stats.request_success["length"] == 1


def test_without_ignore_eos_stops_between_min_and_max_tokens() -> None:
    engine = Engine(small_profile(max_model_len=400, num_gpu_blocks=200), rng=random.Random(3))
    for i in range(20):
        engine.add(f"r{i}", (1, 2, 3), max_tokens=30, min_tokens=4, now=0.0)
    _, steps = _run(engine)
    records = _finished(steps)
    assert all(4 <= r.generation_tokens <= 30 for r in records.values())
    for r in records.values():
        assert r.finish_reason == ("length" if r.generation_tokens == 30 else "stop")
    assert {r.finish_reason for r in records.values()} == {"stop", "length"}


def test_max_num_seqs_bounds_the_batch_and_the_rest_wait() -> None:
    engine = Engine(small_profile(num_gpu_blocks=64), rng=random.Random(0))
    for i in range(6):
        engine.add(f"r{i}", (i, 1, 2), max_tokens=4, ignore_eos=True, now=0.0)
    engine.step(now=0.0)
    assert engine.num_running == 4  # max_num_seqs
    assert engine.num_waiting == 2
    _run(engine)


def test_token_budget_chunks_a_long_prefill() -> None:
    # 30-token prompt, budget 16 tokens per step: prefill takes two steps, then decode
    engine = Engine(small_profile(), rng=random.Random(0))
    engine.add("a", tuple(range(30)), max_tokens=2, ignore_eos=True, now=0.0)
    first = engine.step(now=0.0)
    assert first.num_scheduled_tokens == 16 and not first.tokens
    second = engine.step(now=first.duration_s)
    assert second.num_scheduled_tokens == 14 and len(second.tokens) == 1
    assert second.tokens[0].time_s == first.duration_s + second.duration_s


def test_prefix_hit_is_counted_in_whole_blocks_and_never_covers_the_last_token() -> None:
    engine = Engine(small_profile(), rng=random.Random(0))
    prompt = tuple(range(11))  # 2 full blocks of 4 + 3 tokens
    engine.add("a", prompt, max_tokens=1, ignore_eos=True, now=0.0)
    _run(engine)
    assert engine.stats.prefix_cache_queries == 11
    assert engine.stats.prefix_cache_hits == 0
    engine.add("b", prompt, max_tokens=1, ignore_eos=True, now=1.0)
    _, steps = _run(engine, now=1.0)
    assert _finished(steps)["b"].cached_prompt_tokens == 8
    assert engine.stats.prefix_cache_queries == 22
    assert engine.stats.prefix_cache_hits == 8
    # a prompt of exactly two blocks hits only one: the last token is always computed
    engine.add("c", tuple(range(8)), max_tokens=1, ignore_eos=True, now=2.0)
    _run(engine, now=2.0)
    assert engine.stats.prefix_cache_hits == 12
    assert engine.stats.prefix_cache_hits % engine.kv.block_size == 0


def test_a_different_first_block_shares_nothing() -> None:
    engine = Engine(small_profile(), rng=random.Random(0))
    engine.add("a", (1, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens=1, ignore_eos=True, now=0.0)
    _run(engine)
    # same second block, different first block: chained hashes differ
    engine.add("b", (0, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens=1, ignore_eos=True, now=1.0)
    _run(engine, now=1.0)
    assert engine.stats.prefix_cache_hits == 0


def test_generated_tokens_are_cached_too() -> None:
    engine = Engine(small_profile(), rng=random.Random(0))
    engine.add("a", (1, 2, 3), max_tokens=6, ignore_eos=True, now=0.0)
    _run(engine)
    # prompt (3) + output (6) = 9 tokens: two full blocks registered, one of them holding output
    assert engine.kv.num_cached == 2


def test_lru_eviction_keeps_the_most_recent_prefix() -> None:
    engine = Engine(small_profile(num_gpu_blocks=6), rng=random.Random(0))
    old = tuple(range(100, 109))  # 2 full blocks + 1
    new = tuple(range(200, 209))
    engine.add("old", old, max_tokens=1, ignore_eos=True, now=0.0)
    _run(engine)
    engine.add("new", new, max_tokens=1, ignore_eos=True, now=1.0)
    _run(engine, now=1.0)
    # a third, unrelated prompt needs 3 blocks: only 2 free blocks are unused, so it evicts the
    # least recently freed cached block, which belongs to "old"
    engine.add("other", tuple(range(300, 309)), max_tokens=1, ignore_eos=True, now=2.0)
    _run(engine, now=2.0)
    hits_before = engine.stats.prefix_cache_hits
    engine.add("new-again", new, max_tokens=1, ignore_eos=True, now=3.0)
    _run(engine, now=3.0)
    assert engine.stats.prefix_cache_hits - hits_before == 8
    hits_before = engine.stats.prefix_cache_hits
    engine.add("old-again", old, max_tokens=1, ignore_eos=True, now=4.0)
    _run(engine, now=4.0)
    assert engine.stats.prefix_cache_hits - hits_before < 8


def test_kv_exhaustion_preempts_the_newest_request_and_it_still_finishes() -> None:
    # 8 blocks of 4 tokens = 32 tokens of KV.  Three requests of 4 + 8 tokens need 36.
    engine = Engine(small_profile(max_num_seqs=8), rng=random.Random(0))
    for i in range(3):
        engine.add(f"r{i}", (10 * i, 1, 2, 3), max_tokens=8, ignore_eos=True, now=0.0)
    _, steps = _run(engine)
    records = _finished(steps)
    assert engine.stats.num_preemptions >= 1
    assert sum(s.num_preempted for s in steps) == engine.stats.num_preemptions
    assert records["r2"].num_preemptions >= 1  # the most recently admitted goes first
    assert records["r0"].num_preemptions == 0
    assert all(r.generation_tokens == 8 for r in records.values())
    # recomputation does not count the prompt twice
    assert engine.stats.prompt_tokens == 12
    assert engine.stats.prefix_cache_queries == 12
    _blocks_conserved(engine)


def test_queueing_delays_the_first_token() -> None:
    engine = Engine(small_profile(max_num_seqs=1, num_gpu_blocks=64), rng=random.Random(0))
    engine.add("first", (1, 2, 3), max_tokens=5, ignore_eos=True, now=0.0)
    engine.add("second", (4, 5, 6), max_tokens=5, ignore_eos=True, now=0.0)
    _, steps = _run(engine)
    records = _finished(steps)
    second = records["second"]
    assert second.first_scheduled_s is not None and second.first_token_s is not None
    assert second.first_scheduled_s >= records["first"].finished_s
    assert second.first_token_s > records["first"].first_token_s  # type: ignore[operator]


def test_abort_frees_blocks_and_counts_as_abort() -> None:
    engine = Engine(small_profile(), rng=random.Random(0))
    engine.add("a", tuple(range(12)), max_tokens=10, ignore_eos=True, now=0.0)
    engine.step(now=0.0)
    assert engine.kv.usage > 0
    record = engine.abort("a", now=0.5)
    assert record is not None and record.finish_reason == "abort"
    assert engine.kv.usage == 0.0
    assert engine.stats.request_success["abort"] == 1
    assert engine.abort("a", now=0.6) is None
    assert not engine.has_unfinished


def test_step_time_grows_with_batch_and_prefill() -> None:
    from meridian_sim import profile

    h100 = profile.load("h100-llama3-8b")
    engine = Engine(h100, rng=random.Random(0))
    engine.add("one", tuple(range(1000)), max_tokens=50, ignore_eos=True, now=0.0)
    prefill = engine.step(now=0.0)
    decode_1 = engine.step(now=1.0)
    for i in range(63):
        prompt = tuple(range(i * 1000, i * 1000 + 1000))
        engine.add(f"b{i}", prompt, max_tokens=50, ignore_eos=True, now=1.0)
    now = 1.0
    while (result := engine.step(now=now)).num_prefill_requests:
        now += result.duration_s  # chunked prefill of the others, 8192 tokens a step
    decode_64 = engine.step(now=now)
    assert decode_64.num_decode_requests == 64
    assert prefill.duration_s > decode_1.duration_s
    assert decode_64.duration_s > decode_1.duration_s


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3),  # prompt family (shared prefixes)
            st.integers(min_value=1, max_value=14),  # prompt length
            st.integers(min_value=1, max_value=10),  # max_tokens
            st.integers(min_value=0, max_value=3),  # steps before the next arrival
        ),
        min_size=1,
        max_size=12,
    ),
    abort_every=st.integers(min_value=0, max_value=5),
)
def test_invariants_under_random_load(
    requests: list[tuple[int, int, int, int]], abort_every: int
) -> None:
    """Blocks are conserved, hits are whole blocks, every request ends exactly once."""
    engine = Engine(small_profile(), rng=random.Random(1))
    now = 0.0
    ended: dict[str, str] = {}
    for i, (family, length, max_tokens, gap) in enumerate(requests):
        prompt = tuple(family * 100 + j for j in range(length))
        engine.add(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True, now=now)
        if abort_every and i % abort_every == 0:
            record = engine.abort(f"r{i - 1}", now=now) if i else None
            if record is not None:
                ended[record.request_id] = "abort"
        for _ in range(gap):
            result = engine.step(now=now)
            now += result.duration_s
            for r in result.finished:
                assert r.request_id not in ended
                ended[r.request_id] = r.finish_reason
            assert engine.num_running <= engine.profile.max_num_seqs
            _blocks_conserved(engine)
    _, steps = _run(engine, now=now)
    for r in (r for s in steps for r in s.finished):
        assert r.request_id not in ended
        ended[r.request_id] = r.finish_reason
    assert set(ended) == {f"r{i}" for i in range(len(requests))}
    assert engine.stats.prefix_cache_hits % engine.kv.block_size == 0
    assert engine.stats.prefix_cache_hits <= engine.stats.prefix_cache_queries
    assert engine.kv.usage == 0.0
    _blocks_conserved(engine)
