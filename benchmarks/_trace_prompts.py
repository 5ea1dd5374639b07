"""Mooncake trace rows turned into chat requests whose text reproduces the trace's block sharing.

The Mooncake trace (kvcache-ai/Mooncake, FAST'25) gives each request ``hash_ids``: one id per
512-token block of its prompt, equal ids meaning an equal prefix up to the end of that block.
Rows are read with ``meridian_sim.workloads.read_mooncake``.  Here every hash id becomes a fixed
run of 512 words, each one token under the simulator's
tokenizer (``policies/prompt.py``: a space and 1-8 letters is one piece), drawn from a
``random.Random`` seeded by the id.  A prompt is the concatenation of its blocks' words, the last
block cut to the request's ``input_length``.  So two requests with equal leading hash ids have
identical leading text, hence identical token ids and identical 16-token block hashes in the
nodes' prefix caches (and identical characters for the peers' character-level radix trees), up
to the first id that differs.  Words start with a space, so no token spans two blocks.

Rendered as one user message, the chat template adds 9 tokens (``<|im_start|>user\\n`` before,
``<|im_end|>\\n<|im_start|>assistant\\n`` after); they are the same for every request, so they
shift every block boundary alike and change no sharing.

Prompts longer than the model's context are cut at the end (``max_prompt_tokens``): with
``h100-llama3-8b`` (8,192 tokens) that is 46 % of the conversation trace's requests, whose mean
input is 12,035 tokens.  The cut keeps the shared prefix, which is at the front.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any, Final

from meridian_sim import workloads
from meridian_sim.workloads import TraceRequest

TRACE_BLOCK_TOKENS: Final = 512
TEMPLATE_TOKENS: Final = 9  # what render_chat adds around one user message ("assistant" is 2)
_LETTERS: Final = string.ascii_lowercase


def read_rows(path: Path | str, *, limit: int, skip: int = 0) -> list[TraceRequest]:
    """Rows ``skip .. skip + limit`` of a Mooncake trace
    (``meridian_sim.workloads.read_mooncake``)."""
    return workloads.read_mooncake(path, limit=skip + limit)[skip:]


class PromptBuilder:
    """Block texts by hash id, built once and reused (a conversation's blocks recur)."""

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed
        self._blocks: dict[tuple[int, int], list[str]] = {}

    def block_words(self, hash_id: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[str]:
        words = self._blocks.get((hash_id, block_tokens))
        if words is None:
            rng = random.Random(f"mooncake-block:{self.seed}:{hash_id}")
            words = [
                " " + "".join(rng.choices(_LETTERS, k=rng.randint(2, 8)))
                for _ in range(block_tokens)
            ]
            self._blocks[(hash_id, block_tokens)] = words
        return words

    def prompt_tokens(self, req: TraceRequest, *, max_prompt_tokens: int | None = None) -> int:
        n = min(req.input_length, len(req.hash_ids) * req.block_tokens)
        return n if max_prompt_tokens is None else min(n, max_prompt_tokens)

    def text(self, req: TraceRequest, *, max_prompt_tokens: int | None = None) -> str:
        """The user message: ``prompt_tokens(req)`` one-token words, block by block."""
        remaining = self.prompt_tokens(req, max_prompt_tokens=max_prompt_tokens)
        parts: list[str] = []
        for hash_id in req.hash_ids:
            if remaining <= 0:
                break
            words = self.block_words(hash_id, req.block_tokens)
            take = min(remaining, len(words))
            parts.extend(words[:take])
            remaining -= take
        return "".join(parts)

    def chat_body(
        self,
        req: TraceRequest,
        *,
        model: str,
        stream: bool,
        max_model_len: int,
    ) -> dict[str, Any]:
        """An OpenAI chat request: the prompt cut so that prompt, template and output fit."""
        max_prompt = max_model_len - req.output_length - TEMPLATE_TOKENS - 1
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": self.text(req, max_prompt_tokens=max_prompt)}],
            "max_tokens": req.output_length,
            "min_tokens": req.output_length,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body
