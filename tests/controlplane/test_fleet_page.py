"""The fleet page's files over HTTP against a real controller and etcd (no browser: the page in
Chromium is tests/browser/): what the admin port serves at /ui/, with which headers, that no
data is in them, and that the read port serves no page at all."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from controlplane.api import ui
from tests.meridianctl.stack import REGIONS, TOKENS, Stack, leading
from tests.support import EtcdServer


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    async with leading(etcd.url) as s:
        yield s


@pytest.fixture
async def admin(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url("ctl-a"), timeout=10) as c:
        yield c


async def test_the_admin_port_serves_the_page_with_a_strict_policy_and_no_data(
    admin: httpx.AsyncClient,
) -> None:
    kinds = {"/ui/": "text/html", "/ui/app.js": "text/javascript", "/ui/app.css": "text/css"}
    for path, kind in kinds.items():
        r = await admin.get(path)  # no token: the files hold no data
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith(kind), path
        assert r.headers["x-content-type-options"] == "nosniff"
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp, csp
        assert "unsafe" not in csp and "frame-ancestors 'none'" in csp, csp
        for region in REGIONS:
            assert region["id"] not in r.text, (path, region["id"])
    moved = await admin.get("/ui", follow_redirects=False)
    assert moved.status_code == 308 and moved.headers["location"] == "/ui/"
    missing = await admin.get("/ui/nothing.js")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/problem+json")


def test_the_page_has_no_inline_script_or_style_and_never_parses_data_as_html() -> None:
    html = ui.asset("index.html").decode()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html), "an inline event handler"
    assert not re.search(r"\sstyle\s*=", html) and "<style" not in html
    js = ui.asset("app.js").decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", ".style."):  # fmt: skip
        assert sink not in js, sink
    assert "sessionStorage" in js and "localStorage" not in js  # the token: this tab only


async def test_the_read_port_serves_no_page_and_says_where_it_is(
    stack: Stack, admin: httpx.AsyncClient
) -> None:
    site = web.TCPSite(stack.runners["ctl-a"], "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as read:
            for path in ("/ui", "/ui/", "/ui/app.js", "/ui/app.css"):
                r = await read.get(path, follow_redirects=False)
                assert r.status_code == 404, (path, r.status_code)
                body = r.json()
                assert "read port" in body["detail"] and "--admin-port" in body["fix"], body
            token = {"Authorization": f"Bearer {TOKENS['viewer']}"}
            assert (await read.get("/v1/regions", headers=token)).status_code == 200  # reads stay
    finally:
        await site.stop()
