"""The operators' dashboard (`/ui`) in a real browser: Debian's headless Chromium driven by
Playwright (no browser download: `executable_path`), against a real board process while
versions are committed and nodes report."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from deltaboard.board.contract.schemas import Heartbeat
from tests.support.browser import Watched
from tests.support.manifests import publish

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


def node_lag(page: Any, node: str) -> str | None:
    cell = page.query_selector(f'#fleet tr[data-node="{node}"] td.lag')
    return None if cell is None else str(cell.inner_text())


def painted(page: Any, chart: str) -> int:
    """How many pixels of the chart's canvas are painted."""
    return int(
        page.evaluate(
            """(id) => {
                const canvas = document.querySelector(`#chart-${id} canvas`);
                const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
                let n = 0;
                for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) n++;
                return n;
            }""",
            chart,
        )
    )


def test_page_is_static_and_keeps_to_its_origin(board):
    """The page needs no token (its data routes do) and forbids every other origin."""
    answer = httpx.get(f"{board.url}/ui", follow_redirects=True)
    assert answer.status_code == 200 and "<title>deltaboard</title>" in answer.text
    assert "default-src 'self'" in answer.headers["content-security-policy"]
    assert httpx.get(f"{board.url}/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{board.url}/ui/missing.js").status_code == 404
    assert httpx.get(f"{board.url}/v1/runs").status_code == 401


def test_dashboard_follows_commits_and_the_fleet(board, browser, tmp_path):
    publisher = board.client(board.publish_token)
    reader = board.client(board.read_token)
    publisher.create_run("exp")
    epoch = publisher.acquire_lease("exp", "trainer").epoch
    publish(publisher, "exp", 0, epoch, {"a": b"A" * 20_000, "b": b"B" * 20_000})
    for v in range(1, 6):
        publish(publisher, "exp", v, epoch, {"a": bytes([v]) * (500 * v)})
    reader.heartbeat("exp", Heartbeat(node_id="node-a", version=5, engine="reference"))
    reader.heartbeat("exp", Heartbeat(node_id="node-b", version=3, engine="reference"))

    watched = Watched(browser, board.url)
    page = watched.page
    page.goto(f"{board.url}/ui")
    page.wait_for_selector("#status:has-text('Enter a read token')")

    # A wrong token: a clear message, nothing shown, the token not kept.
    watched.login("not-a-token")
    page.wait_for_selector("#status.error:has-text('The board refused this token')")
    assert page.evaluate("() => sessionStorage.getItem('deltaboard.token')") is None
    assert page.is_hidden("#run")
    # The browser itself reports the refused requests; the page reports nothing else.
    assert all("status of 401" in e for e in watched.errors), watched.errors
    watched.errors.clear()

    watched.login(board.read_token)
    page.wait_for_function("() => document.getElementById('head').textContent === '5'", timeout=10_000)
    page.wait_for_function("() => document.querySelectorAll('#fleet tbody tr').length === 2")
    assert node_lag(page, "node-b") == "2" and node_lag(page, "node-a") == "0"
    assert "token" not in page.url and board.read_token not in page.url

    # A commit reaches the page through the event stream within 2 s, with the node's lag.
    started = time.monotonic()
    publish(publisher, "exp", 6, epoch, {"a": b"k" * 9000}, kind="full")
    page.wait_for_function(
        "() => document.getElementById('head').textContent === '6'"
        " && document.querySelector('#fleet tr[data-node=\"node-a\"] td.lag').textContent === '1'",
        timeout=2000,
    )
    assert time.monotonic() - started < 2.0
    assert node_lag(page, "node-b") == "3"
    assert "lag-2" in (page.get_attribute('#fleet tr[data-node="node-b"] td.lag', "class") or "")
    assert page.evaluate("() => state.charts.bytes.data[0].length") == 7
    keyframes = page.evaluate("() => state.charts.bytes.data[2].filter((x) => x !== null).length")
    assert keyframes == 2
    for chart in ("bytes", "changed", "latency", "fleet"):
        assert painted(page, chart) > 500, chart

    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    if os.environ.get("DELTABOARD_UPDATE_SCREENSHOT"):
        shutil.copy(tmp_path / "dashboard.png", DOCS_SCREENSHOT)
    assert watched.errors == []
    assert watched.foreign == []
    page.close()
