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
piece's id is the CRC-32 of its UTF-8 modulo ``vocab_size``: equal text gives equal ids, which is
all prefix caching needs.

Text must be valid Unicode: a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON, and Python's
``json`` decodes it to a string no UTF-8 encoder accepts) raises :class:`PromptError` naming the
field (:func:`check_text`), never ``UnicodeEncodeError``.

Bounded work (``tokenize_prefix``): the tokenizer is a regular expression plus C loops over
its pieces (UTF-8, CRC-32, modulo, in ``map``), so an unseen word costs what a seen one does:
0.4-0.8 µs a token with the block hashes for 100,000 random words and 0.5-0.6 µs for 1 MB of
this repository's Markdown docs (364k tokens).  The BLAKE2b id it replaced, cached per piece in
a dict, cost 0.4-0.6 µs on the docs but 1.6-2.6 µs on the random words, whose every piece
missed (three interleaved runs each on a shared 2-core development host, 2026-12-01).  So a
caller that must answer fast tokenizes only a prompt's first ``max_tokens`` tokens and
estimates the rest from the characters left, at the characters per token of the part it
tokenized.

A served model's own tokenizer (``encode_head``, below; the agent's ``[tokenizer]`` settings,
``regional_agent.prompts``) comes in as a callable, so that this module stays pure: the
routing head of a prompt is read up to ``max_tokens * HEAD_CHARS_PER_TOKEN`` characters, cut
between two words or before a special token, and a ``PrefixCache`` of prefix states (keyed by
a digest of the text before a special token) lets a shared system prompt or a conversation's
earlier turns be tokenised and hashed once.

Block hashes (``block_hashes``) chain over full blocks of token ids, as vLLM's prefix cache
does: block ``i``'s hash covers its own token ids and the hash of block ``i - 1``, so two
prompts share block ``i``'s hash only when they share every token up to the end of block ``i``.
A partial last block has no hash.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
import re
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

DEFAULT_VOCAB_SIZE: Final = 32_000
_PIECE: Final = re.compile(r"<\|[a-z_]{1,32}\|>| ?[A-Za-z]{1,8}|\d{1,3}|[^\sA-Za-z\d]|\s+")
ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
# the stand-in's special tokens, where its tokenisation splits: the pieces of ``a + b`` are
# those of ``a`` then those of ``b`` when ``b`` starts with one (no other piece holds a ``<``),
# so ``encode_head`` may tokenise and cache a chat prompt by segments (``STAND_IN_SPECIAL``)
STAND_IN_SPECIAL: Final = re.compile(r"<\|[a-z_]{1,32}\|>")
_ROLES: Final = ROLES


class PromptError(ValueError):
    """A chat message or prompt that cannot be rendered; the message says what to fix."""


def check_text(text: str, *, field: str) -> str:
    """``text`` itself when it is valid Unicode; a lone surrogate raises :class:`PromptError`
    naming ``field`` (``messages[0].content``, ``prompt``) and where it is."""
    if text.isascii():  # O(1) for the common case: CPython flags ASCII-only strings
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"{field} contains a lone surrogate (U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}), which is not valid Unicode: send UTF-8 text; a character outside the "
            "Basic Multilingual Plane is escaped in JSON as a pair, e.g. \\ud83d\\ude00"
        ) from None
    return text


def _content_text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, field=f"messages[{index}].content")
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
            parts.append(check_text(text, field=f"messages[{index}].content[{j}].text"))
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
        if not isinstance(role, str) or role not in _ROLES:
            allowed = ", ".join(sorted(_ROLES))
            raise PromptError(f"messages[{i}].role must be one of {allowed}; got {role!r}")
        out.append(f"<|im_start|>{role}\n{_content_text(message.get('content'), i)}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def pieces(text: str) -> list[str]:
    """The text pieces that become tokens, in order (see the module docstring)."""
    return _PIECE.findall(text)


# how far a piece's match can look past its own end: a special token, ``<|`` + 32 + ``|>``
_PIECE_LOOKAHEAD: Final = 36


def _piece_ids(pieces: list[str], vocab_size: int) -> tuple[int, ...]:
    """Each piece's id, ``crc32(UTF-8) % vocab_size``, in C loops only (``map``): no Python frame
    a piece, so an unseen piece costs what a seen one does (``UnicodeEncodeError`` for a lone
    surrogate)."""
    return tuple(
        map(operator.mod, map(zlib.crc32, map(str.encode, pieces)), itertools.repeat(vocab_size))
    )


def piece_id(piece: str, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    return zlib.crc32(piece.encode("utf-8")) % vocab_size


def tokenize(text: str, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[int, ...]:
    """Token ids of ``text``: deterministic, and equal for equal text."""
    return _text_piece_ids(text, _PIECE.findall(text), vocab_size)


def _text_piece_ids(text: str, pieces: list[str], vocab_size: int) -> tuple[int, ...]:
    """:func:`_piece_ids` of ``text``'s ``pieces``, a lone surrogate a ``PromptError`` saying
    where in ``text``."""
    try:
        return _piece_ids(pieces, vocab_size)
    except UnicodeEncodeError:
        check_text(text, field="the text")  # raises PromptError saying where
        raise


@dataclass(frozen=True, slots=True)
class Prefix:
    """The first tokens of a text (:func:`tokenize_prefix`)."""

    token_ids: tuple[int, ...]  # ``tokenize(text)[:max_tokens]``
    total_tokens: int  # the whole text's tokens: exact when ``complete``, else estimated
    complete: bool  # the whole text was tokenized


def tokenize_prefix(text: str, *, max_tokens: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Prefix:
    """The first ``max_tokens`` token ids of ``text`` and its total token count, doing work in
    proportion to ``max_tokens`` rather than to the text.

    Past ``max_tokens`` the count is an estimate: the characters not tokenized, at the
    characters per token of the part that was, rounded up.  Equal to ``tokenize`` (and exact)
    for a text of at most ``max_tokens`` tokens.

    The pieces are cut from a head of the text (``HEAD_CHARS_PER_TOKEN`` characters a token,
    doubled until it holds ``max_tokens`` pieces): a piece that ends ``_PIECE_LOOKAHEAD``
    characters or more before the head's end is the piece the whole text gives, since no
    match looks further ahead, and the pieces tile the text, so their lengths say where the
    last one ends.
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be positive")
    limit = max_tokens * HEAD_CHARS_PER_TOKEN + _PIECE_LOOKAHEAD
    while True:
        head = _PIECE.findall(text, 0, limit)
        if limit >= len(text):
            break  # the whole text: every piece is exact
        safe = limit - _PIECE_LOOKAHEAD
        if len(head) > max_tokens and sum(map(len, head[:max_tokens])) <= safe:
            break
        limit *= 2
    head = head[:max_tokens]
    ids = _text_piece_ids(text, head, vocab_size)
    end = sum(map(len, head))
    if end == len(text):
        return Prefix(token_ids=ids, total_tokens=len(ids), complete=True)
    rest = math.ceil((len(text) - end) * len(ids) / end)
    return Prefix(token_ids=ids, total_tokens=len(ids) + rest, complete=False)


def tokenize_many(texts: Sequence[str]) -> list[tuple[int, ...]]:
    """:func:`tokenize` of each text: the stand-in as :func:`encode_head`'s ``tokenize``."""
    return [tokenize(text) for text in texts]


class PieceIds:
    """:func:`tokenize_many` with the ids of the pieces met so far remembered: a piece's id is
    looked up, not encoded and hashed again (a short chat of 27 pieces in 5.9 µs instead of 9.4
    on a 2-core Intel VM, CPython 3.11, most of it the pieces' regular expression).  At most
    ``limit`` pieces are kept; then they are forgotten and learnt again.  The ids are
    :func:`tokenize`'s, and so are its errors.  Safe to share between threads: a lookup that
    misses, or meets a map being cleared, takes the long way."""

    __slots__ = ("_ids", "_limit")

    def __init__(self, *, limit: int = 16_384) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit}")
        self._ids: dict[str, int] = {}
        self._limit = limit

    def __len__(self) -> int:
        return len(self._ids)

    def tokenize_many(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        ids = self._ids
        known = ids.__getitem__
        out = []
        for text in texts:
            pieces = _PIECE.findall(text)
            try:
                out.append(tuple(map(known, pieces)))
            except KeyError:
                found = _text_piece_ids(text, pieces, DEFAULT_VOCAB_SIZE)  # tokenize's
                if len(found) <= self._limit:
                    if len(ids) + len(found) > self._limit:
                        ids.clear()
                    ids.update(zip(pieces, found, strict=True))
                out.append(found)
        return out


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
    full = len(token_ids) - len(token_ids) % block_size
    if full <= 0:
        return ()
    try:  # every id as 4 little-endian bytes at once, as hash_block writes them one by one
        packed = struct.pack(f"<{full}I", *token_ids[:full])
    except struct.error:  # an id outside 0..2**32-1: hash_block's own error
        packed = b"".join(t.to_bytes(4, "little") for t in token_ids[:full])
    hashes: list[int] = []
    prev = parent
    step = 4 * block_size
    for start in range(0, 4 * full, step):
        h = hashlib.blake2b(digest_size=8)
        h.update((prev if prev is not None else 0).to_bytes(8, "little"))
        h.update(b"\x01" if prev is not None else b"\x00")
        h.update(packed[start : start + step])
        prev = int.from_bytes(h.digest(), "little")
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


# -- a served model's own tokenizer -------------------------------------------------------------
#
# The agent tokenises with the model's tokenizer when it has one (``regional_agent.prompts``
# loads it); what follows is the pure part: where a long prompt's head is cut, how its blocks
# are hashed, and the cache of prefix states that lets a shared system prompt (or the previous
# turns of a conversation) be tokenised and hashed once.  The tokenizer comes in as a callable.

TokenizeMany = Callable[[Sequence[str]], Sequence[Sequence[int]]]
"""Token ids of each text, in order (a tokenizer's batch encode, without special tokens added
unless the caller wants them)."""

HEAD_CHARS_PER_TOKEN: Final = 8
"""A text longer than ``max_tokens`` times this many characters is tokenised only up to there
(:func:`head_cut`): prose runs at 4-5 characters a token and code at 3-4, so the head almost
always holds ``max_tokens`` tokens, and the work stays bounded by the characters read."""

_BACKOFF_CHARS: Final = 1024  # how far back head_cut looks for whitespace to cut at
_MAX_BOUNDARIES: Final = 1024  # segment boundaries looked at in one prompt (encode_head)
_LEAD_STATES: Final = 8  # prefix states kept at a prompt's first boundaries (encode_head)
# a text shorter than this is tokenised whole, without the cache: its keys and states cost more
# than tokenising it (measured: 27 against 13 us at 128 characters, even near 500; see
# docs/benchmarks.md, "Router CPU per request")
CACHE_MIN_CHARS: Final = 512


def head_cut(text: str, max_tokens: int) -> int:
    """Where a prompt's routing head ends: ``len(text)`` when the text is at most ``max_tokens *
    HEAD_CHARS_PER_TOKEN`` characters, else the start of the last run of whitespace before that
    limit (within ``_BACKOFF_CHARS``; the limit itself when there is none), so that the cut
    falls between two words.  :func:`encode_head` drops the head's last token, which the cut
    may have changed."""
    limit = max_tokens * HEAD_CHARS_PER_TOKEN
    if len(text) <= limit:
        return len(text)
    low = max(0, limit - _BACKOFF_CHARS)
    k = max(text.rfind(" ", low, limit), text.rfind("\n", low, limit), text.rfind("\t", low, limit))
    if k <= 0:
        return limit
    while k > low and text[k - 1] in " \t\r\n":
        k -= 1
    return k if k > 0 else limit


@dataclass(frozen=True, slots=True)
class Encoded:
    """A prompt's routing head, tokenised and hashed (:func:`encode_head`)."""

    block_hashes: tuple[int, ...]  # chained hashes of the full blocks of the head's tokens
    head_tokens: int  # tokens hashed: at most max_tokens
    total_tokens: int  # the whole prompt's tokens: exact when ``complete``, else estimated
    complete: bool  # every token of the prompt is in the head


@dataclass(frozen=True, slots=True)
class PrefixState:
    """What hashing a prompt's prefix left: enough to go on with the text after it."""

    tokens: int  # the prefix's tokens that were hashed: at most max_tokens
    hashes: tuple[int, ...]  # chained hashes of their full blocks
    tail: tuple[int, ...]  # their token ids after the last full block (fewer than a block)
    chars: int = 0  # the prefix's characters
    read: int = 0  # the prefix's tokens, those past max_tokens too

    def estimated_bytes(self) -> int:
        """An upper bound of what holding this state in a :class:`PrefixCache` costs: 44 bytes
        a block hash (a 64-bit int and its slot), 36 a tail id, 480 for the rest (the key, the
        cache's entry, this object, two tuples); tests/policies/test_prompt.py measures it."""
        return 480 + 44 * len(self.hashes) + 36 * len(self.tail)


_NO_STATE: Final = PrefixState(tokens=0, hashes=(), tail=())  # a text's start


class PrefixCache:
    """Prefix states by a digest of the rendered text they cover, least recently used first
    out, holding at most ``max_bytes`` (:meth:`PrefixState.estimated_bytes`).

    Not thread-safe: a caller that shares one between threads locks around it."""

    def __init__(self, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be at least 0")
        self.max_bytes = max_bytes
        # least recently used first: an OrderedDict, whose oldest entry is found in O(1) where a
        # dict's ``next(iter(...))`` scans the slots its evictions left (7-22 us a put, full)
        self._states: OrderedDict[bytes, PrefixState] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._states)

    def estimated_bytes(self) -> int:
        return self._bytes

    def longest(self, keys: Sequence[bytes]) -> tuple[int, PrefixState] | None:
        """The last of ``keys`` that is cached and its state (refreshed), or None; one hit or
        one miss is counted either way."""
        for i in range(len(keys) - 1, -1, -1):
            state = self._states.get(keys[i])
            if state is not None:
                self._states.move_to_end(keys[i])
                self.hits += 1
                return i, state
        self.misses += 1
        return None

    def put(self, key: bytes, state: PrefixState) -> None:
        size = state.estimated_bytes()
        if size > self.max_bytes:
            return
        old = self._states.pop(key, None)
        if old is not None:
            self._bytes -= old.estimated_bytes()
        self._states[key] = state
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._bytes -= self._states.popitem(last=False)[1].estimated_bytes()


class StateCache(Protocol):
    """What :func:`encode_head` needs of a cache (:class:`PrefixCache`, or one behind a lock)."""

    def longest(self, keys: Sequence[bytes]) -> tuple[int, PrefixState] | None: ...

    def put(self, key: bytes, state: PrefixState) -> None: ...


def encode_head(
    text: str,
    *,
    tokenize: TokenizeMany,
    block_size: int,
    max_tokens: int,
    boundaries: re.Pattern[str] | None = None,
    cache: StateCache | None = None,
    namespace: bytes = b"",
) -> Encoded:
    """Tokenise and block-hash the first ``max_tokens`` tokens of ``text`` with ``tokenize``,
    reading at most :func:`head_cut` characters of it.

    With ``boundaries`` (a pattern of the tokenizer's special tokens, at which its tokenisation
    splits: the tokens of ``a + b`` are those of ``a`` then those of ``b`` when ``b`` starts
    with one; ``regional_agent.prompts`` checks that of each tokenizer) and ``cache``, the text
    is cut into segments before each special token, the longest prefix of whole segments found
    in ``cache`` is taken from it, and only the rest is tokenised; the states at the first
    boundaries, the last two and the end go into ``cache`` for the next prompts.  ``namespace``
    keeps the states of different tokenizers apart.  The hashes are the same with or without a
    cache: ``block_hashes(tokens[:max_tokens])``, for a text of at most ``max_tokens *
    HEAD_CHARS_PER_TOKEN`` characters (past that, of the tokens of a head cut between two words
    or at a special token, less the last token when it may have changed).

    The token count is exact when the prompt has at most ``max_tokens`` tokens.  Past them it is
    exact when every token of the head was read, else estimated at the characters per token of
    what was read: past the head, and when the cache held a state that already had
    ``max_tokens`` tokens (a prompt whose shared prefix alone fills the head is then not
    tokenised at all).

    A text of fewer than :data:`CACHE_MIN_CHARS` characters is tokenised whole without the
    cache, which would cost it more than it saves."""
    if block_size <= 0 or max_tokens <= 0:
        raise ValueError("block_size and max_tokens must be positive")
    if len(text) < CACHE_MIN_CHARS and len(text) <= max_tokens * HEAD_CHARS_PER_TOKEN:
        # a short prompt, read whole and without the cache: what the rest of this function does
        # for it, without its segments and state (2 µs of a short chat's 12)
        (ids,) = tokenize([text])
        taken = ids[:max_tokens]
        return Encoded(
            block_hashes(taken, block_size=block_size),
            len(taken),
            total_tokens=len(ids),
            complete=len(taken) == len(ids),
        )
    cut = head_cut(text, max_tokens)
    clean = False  # the head ends at a special token's start or end: its tokens are exact
    if boundaries is not None and cut < len(text):  # never inside a special token
        for match in boundaries.finditer(text, max(0, cut - 256), min(len(text), cut + 256)):
            if match.start() <= cut <= match.end():
                cut, clean = match.start() or match.end(), True
                break
    head = text[:cut] if cut < len(text) else text
    whole = cut == len(text)
    state = _NO_STATE
    keys: list[bytes] = []
    first = 0
    if boundaries is None or cache is None or len(text) < CACHE_MIN_CHARS:
        segments, ends = [head], [len(head)]
    else:
        starts = itertools.islice(boundaries.finditer(head), _MAX_BOUNDARIES)
        edges = [0, *(m.start() for m in starts if m.start() > 0), len(head)]
        pairs = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
        segments, ends = [head[a:b] for a, b in pairs], [b for _, b in pairs]
        seed = namespace + block_size.to_bytes(4, "little") + max_tokens.to_bytes(8, "little")
        digest = hashlib.blake2b(seed, digest_size=16)
        for segment in segments:
            digest.update(segment.encode("utf-8"))
            keys.append(digest.digest())  # keys[i]: the text of segments[: i + 1]
        found = cache.longest(keys)
        cut_end = found is not None and not whole and found[0] == len(keys) - 1
        if cut_end and found is not None and found[1].tokens < max_tokens:
            found = cache.longest(keys[:-1])  # a whole text that is this head: a token more
        if found is not None:
            first, state = found[0] + 1, found[1]
            if state.tokens >= max_tokens:  # the head is all in the state: the rest estimated
                if state.chars == len(text):
                    done = state.read == state.tokens
                    return Encoded(state.hashes, state.tokens, state.read, complete=done)
                total = _estimate(state, len(text))
                return Encoded(state.hashes, state.tokens, total_tokens=total, complete=False)
    pieces_ids = list(tokenize(segments[first:])) if first < len(segments) else []
    if not whole and not clean and pieces_ids:
        pieces_ids[-1] = pieces_ids[-1][:-1]  # the cut may have changed the head's last token
    read = state.tokens + sum(len(ids) for ids in pieces_ids)
    tokens = state.tokens
    hashes = list(state.hashes)
    pending = list(state.tail)
    last = len(segments) - 1
    prefix_read = state.read
    for index, ids in enumerate(pieces_ids, start=first):
        prefix_read += len(ids)
        taken = ids[: max_tokens - tokens]
        tokens += len(taken)
        pending.extend(taken)
        full = len(pending) - len(pending) % block_size
        if full:
            parent = hashes[-1] if hashes else None
            hashes.extend(block_hashes(pending[:full], block_size=block_size, parent=parent))
            del pending[:full]
        capped = tokens >= max_tokens
        if (
            keys
            and hashes
            and cache is not None
            and (index < last or whole or len(taken) < len(ids))  # not what the cut changed
            and (capped or _keep_state(index, last, whole))
        ):
            kept = PrefixState(tokens, tuple(hashes), tuple(pending), ends[index], prefix_read)
            cache.put(keys[index], kept)
        if capped:
            break
    if whole:
        return Encoded(tuple(hashes), tokens, total_tokens=read, complete=tokens == read)
    total = math.ceil(read * len(text) / cut) if read else math.ceil(len(text) / 4)
    return Encoded(tuple(hashes), tokens, total_tokens=total, complete=False)


def _estimate(state: PrefixState, chars: int) -> int:
    """A text's tokens at the characters per token of a prefix state."""
    return math.ceil(state.read * chars / state.chars) if state.chars else state.read


def _keep_state(index: int, last: int, whole: bool) -> bool:
    """Whether the state after segment ``index`` (of ``last + 1``) goes into the cache: the
    first few (a system prompt, the first turns), the last two when the text is whole (the
    conversation so far without its generation prompt, which the next turn extends; and the
    whole prompt, for a repeat), never the cut end."""
    if index == last:
        return whole
    return index < _LEAD_STATES or index >= last - 1
