"""What the agent proxies: every inference endpoint of a vLLM 0.32 OpenAI server.

Each :class:`Endpoint` says how a request to it is routed:

=============  ===============================================================================
``chat``       a chat's messages, rendered and hashed (prefix-aware), ``max_tokens``
``completion`` a prompt, tokenised and hashed (prefix-aware)
``responses``  the Responses API: ``instructions`` and ``input`` messages hashed as a chat
``messages``   Anthropic's Messages API: ``system`` and ``messages`` hashed as a chat
``load``       no prompt worth sharing (embeddings, pooling, scoring, tokenising, rendering,
               batches, SageMaker's ``/invocations``):
               the least loaded node serving the model; its prompt's size estimated from the
               body's length
``form``       multipart (audio transcription and translation): the model from the form
=============  ===============================================================================

Every one goes through the same admission, queue, retries before the first byte, spill-over,
cancellation and metrics as chat.  An answer is relayed as a stream when the node answers
``text/event-stream`` (or the request asked for ``stream``).  What is not here — node
administration (``/reset_prefix_cache``, ``/sleep``, LoRA loading, weight updates, profiling),
``/v1/realtime`` (a WebSocket), elastic expert parallelism and each node's ``/health``,
``/ping``, ``/load``, ``/version``, ``/metrics`` and ``/kv_event_sources`` — is the operator's
business with a node, not a client's with the fleet (:data:`NODE_ONLY`).

A generative model's server lists what ``tests/fixtures/vllm/openapi-paths-0.32.json`` holds
(its ``/openapi.json``); pooling and speech-to-text models add the embedding, scoring and audio
paths.  A test holds the table to that list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

Kind = Literal["chat", "completion", "responses", "messages", "load", "form"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    kind: Kind


PROXIED: Final[tuple[Endpoint, ...]] = (
    Endpoint("/v1/chat/completions", "chat"),
    Endpoint("/v1/completions", "completion"),
    Endpoint("/v1/responses", "responses"),
    Endpoint("/v1/messages", "messages"),
    Endpoint("/v1/embeddings", "load"),
    Endpoint("/v2/embed", "load"),
    Endpoint("/pooling", "load"),
    Endpoint("/classify", "load"),
    Endpoint("/score", "load"),
    Endpoint("/v1/score", "load"),
    Endpoint("/rerank", "load"),
    Endpoint("/v1/rerank", "load"),
    Endpoint("/v2/rerank", "load"),
    Endpoint("/tokenize", "load"),
    Endpoint("/detokenize", "load"),
    Endpoint("/v1/messages/count_tokens", "load"),
    Endpoint("/v1/chat/completions/render", "load"),
    Endpoint("/v1/completions/render", "load"),
    Endpoint("/v1/responses/render", "load"),
    Endpoint("/v1/messages/render", "load"),
    Endpoint("/v1/chat/completions/batch", "load"),
    Endpoint("/generative_scoring", "load"),
    Endpoint("/v1/systemone", "load"),
    Endpoint("/invocations", "load"),
    Endpoint("/v1/audio/transcriptions", "form"),
    Endpoint("/v1/audio/translations", "form"),
)

# Answered by the agent itself, or sent to the node that made the response.
OWN: Final[tuple[str, ...]] = (
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /v1/responses/{response_id}",
    "POST /v1/responses/{response_id}/cancel",
)

# A node's own, not proxied: node operations and probes (the agent has its own /health,
# /metrics).
NODE_ONLY: Final[frozenset[str]] = frozenset(
    {
        "/health", "/ping", "/load", "/version", "/metrics", "/kv_event_sources",
        "/scale_elastic_ep", "/is_scaling_elastic_ep",
    }
)  # fmt: skip

# The agent's own probes and admin API, for the 404 that lists what there is.
AGENT: Final[tuple[str, ...]] = ("GET /health", "GET /ready", "GET /metrics", "/admin/...")


def supported() -> str:
    """Every path a client may call, for a 404's message."""
    posts = ", ".join(f"POST {e.path}" for e in PROXIED)
    return f"{posts}, {', '.join(OWN)}, {', '.join(AGENT)}"
