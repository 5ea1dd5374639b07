"""The fleet page: the fleet live in a browser, and the runbook actions, on the admin port.

``GET /ui/`` (``index.html``), ``/ui/app.js`` and ``/ui/app.css`` are package data
(``controlplane/api/static/``): plain HTML, CSS and vanilla JavaScript, no build step.  They
hold no data and load without a token; the page asks for one (kept in ``sessionStorage``) and
its script reads and acts through the admin API's own ``/v1/...`` routes with
``Authorization: Bearer``, as ``meridianctl`` does: same roles, same dry runs, same audit.  A
401 clears what the page shows and asks again.

Every file is served with a Content-Security-Policy that allows scripts, styles and requests
from this origin only (no inline script or style, no frames, no forms posted anywhere),
``X-Content-Type-Options: nosniff`` and no referrer.  The script builds the DOM with
``textContent`` only, so no value from the API is ever parsed as HTML.

The read port (``server.port``) does not serve the page: it is plain HTTP and refuses writes,
so a token typed there would travel in the clear for a page whose actions cannot work.  Its
``/ui/`` answers 404 naming the admin port.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from controlplane.api.problems import NotFound

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFIX = "/ui/"
FILES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "app.css": "text/css",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",
}


@functools.cache
def asset(name: str) -> bytes:
    """One file of the page, read once from the package."""
    return resources.files(__package__).joinpath("static", name).read_bytes()


def add_routes(app: web.Application) -> None:
    """The page on the admin port: ``/ui`` redirects to ``/ui/``."""
    app.router.add_get("/ui", _redirect)
    for name, kind in FILES.items():
        path = PREFIX if name == "index.html" else PREFIX + name
        app.router.add_get(path, _file(name, kind))


def add_refusal(app: web.Application) -> None:
    """The read port: ``/ui`` and below answer 404, naming the admin port."""
    app.router.add_get("/ui", _elsewhere)
    app.router.add_get("/ui/{tail:.*}", _elsewhere)


def _file(name: str, kind: str) -> Handler:
    body = asset(name)

    async def serve(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type=kind, charset="utf-8", headers=HEADERS)

    return serve


async def _redirect(_: web.Request) -> web.StreamResponse:
    raise web.HTTPPermanentRedirect(PREFIX, headers=HEADERS)


async def _elsewhere(request: web.Request) -> web.StreamResponse:
    raise NotFound(
        f"{request.path}: the fleet page is not served on the controller's read port "
        "(server.port), which is plain HTTP and read-only",
        fix="open /ui/ on the admin port (api.port, meridian-controller --admin-port)",
    )
