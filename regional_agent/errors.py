"""Errors of the regional agent, each carrying what the HTTP edge needs.

::

    AgentError                      http_status, openai_type, retryable
    ├── BadRequest                  400  the client sent something we cannot serve
    │   ├── BodyTooLarge            413
    │   └── UnknownModel            404  no node serves the model
    ├── Unauthorized                401  admin token missing or wrong
    │   └── InvalidKey              401  data-plane API key missing or wrong
    ├── Forbidden                   403  the API key's tenant may not use the model
    ├── NotFound                    404  admin: no such node; no such stored response
    ├── Conflict                    409  admin: node already exists
    ├── QueueFull                   429  the central queue is at its limit (Retry-After)
    ├── RateLimited                 429  the tenant's RPM or TPM is used up (x-ratelimit-*)
    ├── DeadlineExceeded            504  waited in the queue past the deadline
    ├── NoCapacity                  503  no routable node for the model
    └── UpstreamError               a node failed; raised only by ``upstream/``
        ├── UpstreamUnavailable     503  connect error, reset, timeout before the first byte
        ├── UpstreamStatus          the node answered 5xx or 429 (retryable) or another status
        └── UpstreamProtocolError   502  the node answered garbage
    ActuatorError                   an autoscaler actuator could not act (``autoscaler/``)
    TableConflicts                  group-table writes kept losing to other agents' (backs off)

etcd's failures are the etcd layer's own (``meridian_etcd.errors``: ``Unavailable``,
``LeaseLost``, ...).  Foreign exceptions are translated in one place each: aiohttp's in
``upstream/``, aetcd's and grpc's in ``meridian_etcd``.  etcd, actuator and table errors never
reach a client: the background loops that meet them log the change of state once and retry with
backoff.
"""

from __future__ import annotations

from typing import Any


class AgentError(Exception):
    http_status = 500
    openai_type = "InternalServerError"
    retryable = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        """Headers the error's response carries besides the body (Retry-After, ...)."""
        return {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.http_status,
            }
        }


class BadRequest(AgentError):
    http_status = 400
    openai_type = "BadRequestError"


class BodyTooLarge(BadRequest):
    http_status = 413


class UnknownModel(BadRequest):
    http_status = 404
    openai_type = "NotFoundError"


class Unauthorized(AgentError):
    http_status = 401
    openai_type = "AuthenticationError"


class InvalidKey(Unauthorized):
    """The data plane's API key is missing or not valid (one answer for both)."""


class Forbidden(AgentError):
    http_status = 403
    openai_type = "PermissionDeniedError"


class NotFound(AgentError):
    http_status = 404
    openai_type = "NotFoundError"


class Conflict(AgentError):
    http_status = 409
    openai_type = "ConflictError"


class QueueFull(AgentError):
    http_status = 429
    openai_type = "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class RateLimited(AgentError):
    """A tenant's rate limit refused the request; ``limit_headers`` are the ``x-ratelimit-*``
    headers and ``Retry-After``."""

    http_status = 429
    openai_type = "RateLimitError"

    def __init__(self, message: str, *, limit_headers: dict[str, str], cause: str = "") -> None:
        super().__init__(message)
        self.limit_headers = limit_headers
        self.cause = cause  # requests or tokens

    def headers(self) -> dict[str, str]:
        return dict(self.limit_headers)


class DeadlineExceeded(AgentError):
    http_status = 504
    openai_type = "TimeoutError"


class NoCapacity(AgentError):
    http_status = 503
    openai_type = "ServiceUnavailableError"


class UpstreamError(AgentError):
    """A node failed to serve; ``node_id`` says which."""

    def __init__(self, message: str, *, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id


class UpstreamUnavailable(UpstreamError):
    http_status = 503
    openai_type = "ServiceUnavailableError"
    retryable = True


class UpstreamStatus(UpstreamError):
    """The node answered with an error status; its body is relayed when not retried."""

    def __init__(
        self, message: str, *, node_id: str, status: int, body: bytes, content_type: str
    ) -> None:
        super().__init__(message, node_id=node_id)
        self.http_status = status
        self.upstream_body = body
        self.content_type = content_type
        self.retryable = status >= 500 or status == 429


class UpstreamProtocolError(UpstreamError):
    http_status = 502
    openai_type = "BadGatewayError"
    retryable = True  # nothing reached the client yet: another node may do better


class ActuatorError(AgentError):
    """An autoscaler actuator could not act: a node did not start, a hook command failed."""

    retryable = True


class TableConflicts(AgentError):
    """Group-table transactions failed their compares several times in a row: other agents
    keep changing the same ranges.  The flush loop backs off and tries again."""

    retryable = True
