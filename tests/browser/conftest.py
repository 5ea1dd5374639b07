"""The fleet page in a real headless Chromium: Debian's ``chromium`` package driven by Playwright
from PyPI (tests/browser/requirements.txt; Playwright's own browser download is never used).
``make test-browser`` installs both when missing.

browser   function  Chromium, launched from the system's binary
open_ui   function  ``page = await open_ui(url)``: a fresh context (empty sessionStorage) on
                    ``url``/ui/, recording the console and every /v1 request and its status

Playwright is imported inside the fixtures, so ``make test`` (which deselects the ``browser``
marker) collects these modules without it; under ``-m browser`` a missing Playwright or
Chromium fails the tests, naming what to install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page


@dataclass
class UiPage:
    page: Page
    console: list[str] = field(default_factory=list)
    requests: list[tuple[str, str, bool]] = field(default_factory=list)  # path, method, token?
    statuses: list[tuple[str, int]] = field(default_factory=list)  # path, status

    def csp_violations(self) -> list[str]:
        return [m for m in self.console if "Content Security Policy" in m]

    async def screenshot(self, name: str) -> Path | None:
        """``$MERIDIAN_SCREENSHOTS/<name>`` (e.g. docs/img), only when that is set."""
        where = os.environ.get("MERIDIAN_SCREENSHOTS")
        if not where:
            return None
        path = Path(where) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=str(path), full_page=True)
        return path


OpenUi = Callable[[str], Awaitable[UiPage]]


def chromium_binary() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.fail("no chromium on PATH: `make test-browser` installs Debian's chromium package")
    return found


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("playwright is not installed: `make test-browser` installs it in .venv")
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium_binary(), args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
async def open_ui(browser: Browser) -> AsyncIterator[OpenUi]:
    contexts: list[Any] = []

    async def open_(base_url: str) -> UiPage:
        context = await browser.new_context(viewport={"width": 1400, "height": 1000})
        contexts.append(context)
        page = await context.new_page()
        ui = UiPage(page=page)
        page.on("console", lambda m: ui.console.append(f"{m.type}: {m.text}"))
        prefix = base_url.rstrip("/") + "/v1/"

        def request(r: Any) -> None:
            if r.url.startswith(prefix):
                path = urlsplit(r.url).path
                ui.requests.append((path, r.method, "authorization" in r.headers))

        def response(r: Any) -> None:
            if r.url.startswith(prefix):
                ui.statuses.append((urlsplit(r.url).path, r.status))

        page.on("request", request)
        page.on("response", response)
        await page.goto(base_url.rstrip("/") + "/ui/")
        return ui

    yield open_
    for context in contexts:
        await context.close()
