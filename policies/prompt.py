"""Prompt rendering, token counting and prefix block hashes: one definition for everyone.

The simulator counts and caches tokens with these functions, and the agent hashes prompt
prefixes with the very same ones, so a prefix the agent believes is cached on a node is the
prefix the node actually caches.

Rendering (``render_chat``) follows the ChatML layout that many chat templates use::

    <|im_start|>system\\nYou are terse.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\n                          (the generation prompt)

Tokenizing (``tokenize``) is a deterministic stand-in for a BPE tokenizer.  The text is cut into
pieces, left to right, by one regular expression:

* a special token ``<|...|>`` is one piece;
* a run of up to 8 letters, with the single space before it, is one piece (longer words take
  several pieces, as BPE does for rare words);
* a run of up to 3 digits is one piece;
* any other non-space character is one piece;
* a run of whitespace not absorbed by a word is one piece.

Measured on this repository's design notes: English prose comes out at 1.3 tokens per word (4.7
characters per token), close to Llama-3's tokenizer; Markdown dense with code and tables at about
2 tokens per word.  Each
piece's id is the first four bytes of its BLAKE2b digest modulo ``vocab_size``: equal text gives
equal ids, which is all prefix caching needs.

Block hashes (``block_hashes``) chain over full blocks of token ids, as vLLM's prefix cache
does: block ``i``'s hash covers its own token ids and the hash of block ``i - 1``, so two
prompts share block ``i``'s hash only when they share every token up to the end of block ``i``.
A partial last block has no hash.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

DEFAULT_VOCAB_SIZE: Final = 32_000
_PIECE: Final = re.compile(r"<\|[a-z_]{1,32}\|>| ?[A-Za-z]{1,8}|\d{1,3}|[^\sA-Za-z\d]|\s+")
_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})


class PromptError(ValueError):
    """A chat message or prompt that cannot be rendered; the message says what to fix."""


def _content_text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise PromptError(
                    f"messages[{index}].content[{j}]: only parts of type 'text' are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise PromptError(f"messages[{index}].content[{j}].text must be a string")
            parts.append(text)
        return "".join(parts)
    raise PromptError(f"messages[{index}].content must be a string or a list of text parts")


def render_chat(messages: Sequence[object], *, add_generation_prompt: bool = True) -> str:
    """Render OpenAI chat messages to the prompt text the model sees."""
    if not messages:
        raise PromptError("messages must be a non-empty list")
    out: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in _ROLES:
            allowed = ", ".join(sorted(_ROLES))
            raise PromptError(f"messages[{i}].role must be one of {allowed}; got {role!r}")
        out.append(f"<|im_start|>{role}\n{_content_text(message.get('content'), i)}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def pieces(text: str) -> list[str]:
    """The text pieces that become tokens, in order (see the module docstring)."""
    return _PIECE.findall(text)


def piece_id(piece: str, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab_size


def tokenize(text: str, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[int, ...]:
    """Token ids of ``text``: deterministic, and equal for equal text."""
    return tuple(piece_id(p, vocab_size=vocab_size) for p in _PIECE.findall(text))


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def block_hashes(
    token_ids: Sequence[int], *, block_size: int, parent: int | None = None
) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block has none).

    ``parent`` continues a chain: pass the last hash of the blocks before ``token_ids``.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    prev = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(token_ids[start : start + block_size], parent=prev)
        hashes.append(prev)
    return tuple(hashes)


def hash_block(token_ids: Iterable[int], *, parent: int | None) -> int:
    """One block's hash, chained to its parent block's hash (``None`` for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(b"\x01" if parent is not None else b"\x00")
    for token in token_ids:
        h.update(token.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little")
