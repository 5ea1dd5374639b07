"""Errors of the admin API, each an RFC 9457 problem (``application/problem+json``).

::

    ApiProblem                 status, title, detail, fix (what to do instead)
    ├── Unauthenticated  401   no token, or a token this controller does not know
    ├── Forbidden        403   the token's role may not do this
    ├── BadRequest       400   malformed JSON, a bad query parameter
    ├── NotFound         404   unknown region or path
    ├── Conflict         409   the action is unsafe or does not apply in this state
    ├── Invalid          422   the body does not validate, or breaks residency
    └── Unavailable      503   no leader, etcd unreachable, leadership changed: retry

Nothing is changed when one is raised.
"""

from __future__ import annotations

from aiohttp import web

from controlplane.api.models import Problem

PROBLEM_JSON = "application/problem+json"


class ApiProblem(Exception):
    status = 500
    slug = "internal"
    title = "Internal error"

    def __init__(self, detail: str, *, fix: str = "", errors: list[str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix
        self.errors = errors or []

    def body(self) -> Problem:
        return Problem(
            type=f"urn:meridian:problem:{self.slug}",
            title=self.title,
            status=self.status,
            detail=self.detail,
            fix=self.fix,
            errors=self.errors,
        )

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": 'Bearer realm="meridian"'} if self.status == 401 else None
        return response(self.body(), headers=headers)


def response(problem: Problem, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=problem.model_dump_json(),
        status=problem.status,
        content_type=PROBLEM_JSON,
        headers=headers,
    )


class Unauthenticated(ApiProblem):
    status, slug, title = 401, "unauthenticated", "Not authenticated"


class Forbidden(ApiProblem):
    status, slug, title = 403, "forbidden", "Not allowed for this role"


class BadRequest(ApiProblem):
    status, slug, title = 400, "bad-request", "Bad request"


class NotFound(ApiProblem):
    status, slug, title = 404, "not-found", "Not found"


class Conflict(ApiProblem):
    status, slug, title = 409, "refused", "Refused: unsafe or not applicable now"


class Invalid(ApiProblem):
    status, slug, title = 422, "invalid", "Invalid request"


class Unavailable(ApiProblem):
    status, slug, title = 503, "unavailable", "Unavailable: retry"
