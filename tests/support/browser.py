"""Pages in a real browser: Debian's headless Chromium driven by Playwright (no browser
download: `executable_path`), for the board's dashboard and the sidecar's status page."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium; the test is skipped where Debian's chromium is missing."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip(
            "Debian's chromium is not installed and could not be (make test runs apt-get install -y chromium)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield launched
        finally:
            launched.close()


class Watched:
    """A page whose console errors, uncaught exceptions and requests are recorded."""

    def __init__(self, browser: Any, origin: str) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.origin = origin
        self.errors: list[str] = []
        self.foreign: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._request)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _request(self, request: Any) -> None:
        if not request.url.startswith(self.origin + "/"):
            self.foreign.append(request.url)

    def login(self, token: str) -> None:
        self.page.fill("#token", token)
        self.page.click("#login button[type=submit]")
