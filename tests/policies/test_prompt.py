"""policies.prompt: rendering, the deterministic tokenizer and chained block hashes."""

from __future__ import annotations

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
