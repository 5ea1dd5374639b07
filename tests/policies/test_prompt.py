"""policies.prompt: rendering, the deterministic tokenizer and chained block hashes."""

from __future__ import annotations

import hashlib
import math
import random
import re
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import prompt


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hello world", ["Hello", " world"]),
        ("Internationalization", ["Internat", "ionaliza", "tion"]),
        ("costs 12345!", ["costs", " ", "123", "45", "!"]),
        ("<|im_start|>user\n", ["<|im_start|>", "user", "\n"]),
        ("a  b", ["a", "  ", "b"]),
        ("", []),
    ],
)
def test_pieces(text: str, pieces: list[str]) -> None:
    assert prompt.pieces(text) == pieces
    assert prompt.count_tokens(text) == len(pieces)


def test_render_chat_is_chatml_with_a_generation_prompt() -> None:
    rendered = prompt.render_chat(
        [
            {"role": "system", "content": "Be terse."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
            },
        ]
    )
    assert rendered == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not prompt.render_chat(
        [{"role": "user", "content": "x"}], add_generation_prompt=False
    ).endswith("assistant\n")


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty"),
        (["hello"], "messages[0] must be an object"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "type 'text'"),
    ],
)
def test_render_chat_rejects_bad_messages(messages: list[object], needle: str) -> None:
    with pytest.raises(prompt.PromptError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        prompt.render_chat(messages)


def test_block_hashes_cover_full_blocks_only_and_chain() -> None:
    ids = tuple(range(10))
    hashes = prompt.block_hashes(ids, block_size=4)
    assert len(hashes) == 2
    assert hashes[1] == prompt.hash_block(ids[4:8], parent=hashes[0])
    # same tokens in block 2, different block 1: different chained hash
    other = prompt.block_hashes((99, *ids[1:]), block_size=4)
    assert other[1] != hashes[1]
    # continuing a chain equals hashing the whole
    assert prompt.block_hashes(ids[4:8], block_size=4, parent=hashes[0]) == hashes[1:]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        prompt.block_hashes((1, 2), block_size=0)


@given(st.text(max_size=300))
def test_pieces_rebuild_the_text_and_ids_are_in_vocab(text: str) -> None:
    assert "".join(prompt.pieces(text)) == text
    assert all(0 <= t < prompt.DEFAULT_VOCAB_SIZE for t in prompt.tokenize(text))


@given(st.text(max_size=200), st.text(max_size=200))
def test_equal_prefix_text_gives_equal_prefix_ids(head: str, tail: str) -> None:
    """Appending a user turn never changes the tokens of the turns before it."""
    first = prompt.render_chat([{"role": "user", "content": head}], add_generation_prompt=False)
    both = prompt.render_chat(
        [{"role": "user", "content": head}, {"role": "user", "content": tail}],
        add_generation_prompt=False,
    )
    a, b = prompt.tokenize(first), prompt.tokenize(both)
    assert b[: len(a)] == a


@given(
    st.lists(st.integers(min_value=0, max_value=2**31), max_size=64),
    st.lists(st.integers(min_value=0, max_value=2**31), max_size=64),
    st.integers(min_value=1, max_value=16),
)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(
    a: list[int], b: list[int], block_size: int
) -> None:
    whole = prompt.block_hashes(a + b, block_size=block_size)
    head = prompt.block_hashes(a, block_size=block_size)
    assert whole[: len(head)] == head
    assert len(whole) == (len(a) + len(b)) // block_size


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": "hi \ud800"}], "messages[0].content"),
        (
            [{"role": "system", "content": "ok"}, {"role": "user", "content": "\udfff"}],
            "messages[1].content",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "é\ud83d"}]}],
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_is_a_prompt_error_naming_the_field(
    messages: list[object], field: str
) -> None:
    """Valid JSON ("\\ud800") that no UTF-8 encoder takes: a PromptError saying where, never the
    UnicodeEncodeError the tokenizer would raise."""
    with pytest.raises(prompt.PromptError) as raised:
        prompt.render_chat(messages)
    assert str(raised.value).startswith(f"{field} contains a lone surrogate (U+")
    assert "UTF-8" in str(raised.value)


def test_check_text_passes_valid_text_and_names_where_a_surrogate_is() -> None:
    for text in ("", "plain", "café 😀", "\U0001f600"):
        assert prompt.check_text(text, field="prompt") is text
    with pytest.raises(prompt.PromptError, match=r"^prompt contains .*U\+D800 at character 3\)"):
        prompt.check_text("abc\ud800", field="prompt")
    with pytest.raises(prompt.PromptError, match="lone surrogate"):
        prompt.tokenize("x \udc80 y")  # the tokenizer itself never leaks UnicodeEncodeError
    with pytest.raises(prompt.PromptError, match="lone surrogate"):
        prompt.tokenize_prefix("x \udc80 y", max_tokens=10)


@given(st.text(max_size=300), st.integers(min_value=1, max_value=400))
def test_tokenize_prefix_is_the_head_of_tokenize(text: str, max_tokens: int) -> None:
    """Equal to ``tokenize`` for a text that fits, its first ``max_tokens`` ids otherwise, so a
    prompt under the bound routes exactly as before."""
    text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
    whole = prompt.tokenize(text)
    head = prompt.tokenize_prefix(text, max_tokens=max_tokens)
    assert head.token_ids == whole[:max_tokens]
    assert head.complete == (len(whole) <= max_tokens)
    if head.complete:
        assert head.total_tokens == len(whole)
    else:
        assert head.total_tokens > max_tokens


_FRAGMENTS = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|" + "a" * 32 + "|>", "<|x", "|>", " ", "  ", "\n",
     " " * 90, "\t\n ", "word", " Supercalifragilistic", "12345", "7", "é", "😀", ".", "<"]
)  # fmt: skip


def _reference_prefix(text: str, max_tokens: int) -> tuple[tuple[int, ...], int]:
    """The definition: the whole text's pieces, the first ``max_tokens`` of them, and where the
    last of those ends."""
    matches = list(prompt._PIECE.finditer(text))[:max_tokens]
    ids = tuple(prompt.piece_id(m[0]) for m in matches)
    return ids, (matches[-1].end() if matches else 0)


@given(st.lists(_FRAGMENTS, max_size=400).map("".join), st.integers(1, 300))
def test_tokenize_prefix_cuts_a_head_that_gives_the_whole_texts_pieces(
    text: str, max_tokens: int
) -> None:
    """Pieces come from a head of the text: special tokens, long runs of whitespace and long
    words that straddle the head's end still give the pieces (and the estimate) the whole text
    gives."""
    ids, end = _reference_prefix(text, max_tokens)
    head = prompt.tokenize_prefix(text, max_tokens=max_tokens)
    assert head.token_ids == ids
    assert head.complete == (end == len(text))
    if not head.complete:
        assert head.total_tokens == len(ids) + math.ceil((len(text) - end) * len(ids) / end)


def test_tokenize_prefix_estimates_the_rest_at_the_measured_rate() -> None:
    """Past the bound the count is estimated from the characters left at the characters per
    token of the head: within a few percent for uniform prose, and the work stays bounded."""
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900 KB, 200k tokens
    exact = len(prompt.tokenize(text))
    head = prompt.tokenize_prefix(text, max_tokens=1000)
    assert len(head.token_ids) == 1000 and not head.complete
    assert abs(head.total_tokens - exact) / exact < 0.02, (head.total_tokens, exact)
    with pytest.raises(ValueError, match="max_tokens"):
        prompt.tokenize_prefix("x", max_tokens=0)


@pytest.mark.parametrize("role", [[], {}, 5, None, ["user"]])
def test_a_role_that_is_not_a_string_is_refused_naming_it(role: object) -> None:
    """Found by the agent's fuzzer: ``"role": []`` (unhashable) was a 500."""
    with pytest.raises(prompt.PromptError, match=r"messages\[0\]\.role must be one of"):
        prompt.render_chat([{"role": role, "content": "hi"}])


# -- a model's own tokenizer: the routing head and the prefix cache ------------------------------

_SPECIAL = re.compile(r"<\|[a-z_]{1,32}\|>")


def _stand_in(texts: Sequence[str]) -> list[tuple[int, ...]]:
    """The stand-in tokenizer as a batch tokenizer; its pieces, like a real tokenizer's, never
    run across the start of a special token, so the tokens of a text cut before one add up."""
    return [prompt.tokenize(t) for t in texts]


def test_head_cut_falls_before_the_whitespace_at_the_limit() -> None:
    assert prompt.head_cut("short text", 4) == len("short text")
    text = "abcdefgh " * 10  # 90 characters, 8 a token: the limit for 2 tokens is 16
    assert prompt.head_cut(text, 2) == 8  # "abcdefgh" then the space at 8
    assert prompt.head_cut("x" * 100, 2) == 16  # no whitespace: the limit itself
    assert prompt.head_cut("ab  \n cdefghijklmnopqrstuvwxyz", 2) == 2  # before the whole run


@given(
    st.lists(st.sampled_from(["sys A", "sys B long " * 9, "u1", "u2 x", "a1", "a2 yy"]),
             min_size=1, max_size=9),
    st.sampled_from([1, 3, 16]),
    st.integers(min_value=1, max_value=120),
)  # fmt: skip
def test_encode_head_is_the_block_hashes_of_the_head_with_or_without_the_cache(
    contents: list[str], block_size: int, max_tokens: int
) -> None:
    """Whatever the cache holds from earlier prompts (every prefix of this conversation, and
    the prompt itself), the result is the same as without it: the hashes of the first
    max_tokens tokens, exact for a text within max_tokens * HEAD_CHARS_PER_TOKEN characters;
    past that, of a head of the tokens cut between two words."""
    cache = prompt.PrefixCache(max_bytes=1 << 20)
    roles = ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
    for n in [1, len(contents) // 2 + 1, len(contents), len(contents)]:
        messages = [{"role": roles[i % 8], "content": c} for i, c in enumerate(contents[:n])]
        text = prompt.render_chat(messages)
        ids = prompt.tokenize(text)
        heads = [
            prompt.encode_head(
                text, tokenize=_stand_in, block_size=block_size, max_tokens=max_tokens,
                boundaries=_SPECIAL, cache=c,
            )
            for c in (None, cache)
        ]  # fmt: skip
        assert heads[0].block_hashes == heads[1].block_hashes
        assert heads[0].head_tokens == heads[1].head_tokens
        head = heads[1]  # with the cache: a count past max_tokens may be estimated
        assert head.block_hashes == prompt.block_hashes(
            ids[: head.head_tokens], block_size=block_size
        )
        if len(text) <= max_tokens * prompt.HEAD_CHARS_PER_TOKEN:
            assert head.head_tokens == min(max_tokens, len(ids))
            assert heads[0].total_tokens == len(ids)  # without the cache: all of it was read
            assert head.complete == (len(ids) <= max_tokens)
            if head.complete:
                assert head.total_tokens == len(ids)
            else:
                assert head.total_tokens >= max_tokens
        else:
            assert 0 < head.head_tokens <= max_tokens and not head.complete


def test_the_cache_saves_the_tokenising_of_a_shared_prefix_and_is_keyed_by_namespace() -> None:
    seen: list[str] = []

    def counting(texts: Sequence[str]) -> list[tuple[int, ...]]:
        seen.extend(texts)
        return _stand_in(texts)

    cache = prompt.PrefixCache(max_bytes=1 << 20)
    system = {"role": "system", "content": "You route requests to the warmest node. " * 20}
    first = prompt.render_chat([system, {"role": "user", "content": "one"}])
    second = prompt.render_chat([system, {"role": "user", "content": "two"}])
    kw: dict[str, Any] = {"tokenize": counting, "block_size": 16, "max_tokens": 4096,
                          "boundaries": _SPECIAL, "cache": cache}  # fmt: skip
    prompt.encode_head(first, **kw)
    assert "".join(seen) == first and cache.misses == 1
    seen.clear()
    prompt.encode_head(second, **kw)
    assert "".join(seen) == "<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n"
    assert cache.hits == 1
    seen.clear()
    prompt.encode_head(second, **{**kw, "namespace": b"another tokenizer"})
    assert "".join(seen) == second  # nothing shared with another tokenizer's states
    # a system prompt that alone fills the head: the next prompts are not tokenised at all
    short = {**kw, "max_tokens": 64}
    whole = prompt.encode_head(first, **short)
    seen.clear()
    head = prompt.encode_head(second, **short)
    assert seen == [] and head.block_hashes == whole.block_hashes and head.head_tokens == 64
    assert head.block_hashes == prompt.block_hashes(prompt.tokenize(second)[:64], block_size=16)
    assert abs(head.total_tokens - prompt.count_tokens(second)) <= 2 and not head.complete


def test_a_text_past_the_head_is_read_only_to_the_cut_and_estimated() -> None:
    seen: list[str] = []

    def counting(texts: Sequence[str]) -> list[tuple[int, ...]]:
        seen.extend(texts)
        return _stand_in(texts)

    text = " ".join(f"word{i % 97} alpha" for i in range(3000))  # 2 tokens a word, 6k tokens
    head = prompt.encode_head(text, tokenize=counting, block_size=16, max_tokens=200)
    assert len("".join(seen)) <= 200 * prompt.HEAD_CHARS_PER_TOKEN
    ids = prompt.tokenize(text)
    assert head.block_hashes == prompt.block_hashes(ids[:200], block_size=16)
    assert not head.complete and abs(head.total_tokens - len(ids)) <= 0.02 * len(ids)


def test_the_prefix_cache_holds_at_most_its_bytes_least_recently_used_first_out() -> None:
    state = prompt.PrefixState(tokens=32, hashes=(1, 2), tail=(5,))
    size = state.estimated_bytes()
    cache = prompt.PrefixCache(max_bytes=3 * size)
    for key in (b"a", b"b", b"c"):
        cache.put(key, state)
    assert cache.longest([b"a"]) == (0, state)  # a is now the most recent
    cache.put(b"d", state)  # b goes
    assert len(cache) == 3 and cache.estimated_bytes() == 3 * size
    assert cache.longest([b"b"]) is None
    assert cache.longest([b"a", b"x", b"c", b"y"]) == (2, state)  # the longest cached one
    cache.put(b"huge", prompt.PrefixState(tokens=10**6, hashes=tuple(range(10**5)), tail=()))
    assert b"huge" not in cache._states and len(cache) == 3  # larger than the whole cache
    assert (cache.hits, cache.misses) == (2, 1)
    with pytest.raises(ValueError):
        prompt.PrefixCache(max_bytes=-1)


def test_estimated_bytes_bound_what_the_states_really_cost() -> None:
    rng = random.Random(7)
    cache = prompt.PrefixCache(max_bytes=1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2000):
            hashes = tuple(rng.getrandbits(64) for _ in range(i % 40))
            tail = tuple(rng.randrange(2048, 150_000) for _ in range(i % 16))
            key = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
            cache.put(key, prompt.PrefixState(tokens=16 * len(hashes), hashes=hashes, tail=tail))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used <= cache.estimated_bytes(), (used, cache.estimated_bytes())
    assert used >= 0.5 * cache.estimated_bytes()  # an upper bound, not a wild one


def test_a_short_text_is_tokenised_whole_without_the_cache() -> None:
    cache = prompt.PrefixCache(max_bytes=1 << 20)
    kw: dict[str, Any] = {"tokenize": _stand_in, "block_size": 16, "max_tokens": 4096,
                          "boundaries": _SPECIAL}  # fmt: skip
    short = prompt.render_chat([{"role": "user", "content": "route me " * 20}])
    assert len(short) < prompt.CACHE_MIN_CHARS
    head = prompt.encode_head(short, cache=cache, **kw)
    assert len(cache) == 0 and cache.hits == cache.misses == 0  # neither read nor written
    assert head == prompt.encode_head(short, **kw)
    long = prompt.render_chat([{"role": "user", "content": "route me " * 80}])
    assert prompt.encode_head(long, cache=cache, **kw) == prompt.encode_head(long, **kw)
    assert len(cache) > 0 and cache.misses == 1


def test_a_full_cache_evicts_the_least_recently_used_first() -> None:
    state = prompt.PrefixState(tokens=16, hashes=(1,), tail=())
    cache = prompt.PrefixCache(max_bytes=3 * state.estimated_bytes())
    for key in (b"a", b"b", b"c"):
        cache.put(key, state)
    assert cache.longest([b"a"]) == (0, state)  # a is used: b is now the oldest
    for key in (b"d", b"e"):
        cache.put(key, state)
    assert [cache.longest([k]) is not None for k in (b"a", b"b", b"c", b"d", b"e")] == [
        True, False, False, True, True
    ]  # fmt: skip
    assert len(cache) == 3 and cache.estimated_bytes() == 3 * state.estimated_bytes()


@given(
    batches=st.lists(
        st.lists(st.lists(_FRAGMENTS, max_size=40).map("".join), max_size=4), max_size=6
    ),
    limit=st.integers(1, 40),
)
def test_piece_ids_tokenise_as_tokenize_many_while_they_fill_and_forget(
    batches: list[list[str]], limit: int
) -> None:
    """However full the remembered pieces (a small ``limit`` forgets them often), the ids are
    those of :func:`tokenize_many`, text after text, batch after batch; never more than
    ``limit`` pieces are kept."""
    pieces = prompt.PieceIds(limit=limit)
    for texts in batches:
        assert pieces.tokenize_many(texts) == prompt.tokenize_many(texts)
        assert len(pieces) <= limit


def test_piece_ids_raise_what_tokenize_raises_and_refuse_a_bad_limit() -> None:
    pieces = prompt.PieceIds()
    pieces.tokenize_many(["a word"])  # "a" and " word" are known now
    with pytest.raises(prompt.PromptError, match="lone surrogate"):
        pieces.tokenize_many(["a \udfff"])
    with pytest.raises(ValueError, match="limit must be at least 1"):
        prompt.PieceIds(limit=0)
