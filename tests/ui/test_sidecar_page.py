"""The sidecar's own status page (`/ui` on the sidecar) in headless Chromium, against a
real board, a real sidecar with hot updates and the reference engine in-process, while
versions are committed: the page shows what the node serves and its swaps."""

from __future__ import annotations

from typing import Any

import httpx

from deltaboard.publisher.publisher import Publisher
from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.engine.hot import HotWeights
from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.trajectory import build_model, train
from tests.services.test_hot_e2e import RUN, hot_sidecar
from tests.support.browser import Watched


def shows(page: Any, field: str, value: str) -> None:
    page.wait_for_function(
        "([id, value]) => document.getElementById(id).textContent === value",
        arg=[field, value],
        timeout=10_000,
    )


def test_status_page_shows_the_served_version_and_the_swaps(board, browser, tmp_path):
    model = build_model("tiny", seed=3)
    config: Any = model.config
    state = EngineState("hot")
    state.hot = HotWeights(state.slot)
    with BackgroundServer(create_app(state)) as engine:
        sidecar = hot_sidecar(board, engine.url, tmp_path / "node")
        with BackgroundServer(sidecar.app) as node:
            page_answer = httpx.get(f"{node.url}/ui", follow_redirects=True)
            assert page_answer.status_code == 200 and "<title>deltaboard sidecar</title>" in page_answer.text
            assert "default-src 'self'" in page_answer.headers["content-security-policy"]
            assert httpx.get(f"{node.url}/ui/app.js").headers["content-type"].startswith("text/javascript")
            missing = httpx.get(f"{node.url}/ui/missing.js")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "NotFound"
            assert httpx.get(f"{node.url}/ui/%2E%2E%2Fui.py").status_code == 404
            # The page is the sidecar's own; the engine's control routes stay out.
            refused = httpx.post(f"{node.url}/reload", json={})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "NotFound"

            watched = Watched(browser, node.url)
            page = watched.page
            page.goto(f"{node.url}/ui")
            shows(page, "node", "hot-node")
            assets = {"config.json": config.to_json_string().encode()}
            with Publisher(board.url, RUN, token=board.publish_token, assets=assets) as publisher:
                for step in train(model, steps=1, lr=1e-3, regime="fp32-master"):
                    publisher.publish(model, step=step).result()
                    # The sidecar may go from nothing straight to the head; waiting for
                    # the keyframe to be served pins the two swaps the table must list.
                    shows(page, "served", str(step))
            shows(page, "served", "1")
            shows(page, "head", "1")
            shows(page, "lag", "0")
            rows = page.query_selector_all("#swaps tbody tr")
            # latest first: version 1 went in place, version 0 (the keyframe) was loaded
            assert [r.get_attribute("data-version") for r in rows] == ["1", "0"]
            assert [r.query_selector("td:nth-child(2)").inner_text() for r in rows] == ["hot", "reload"]
            assert float(rows[0].query_selector("td.pause").inner_text()) >= 0
            assert float(rows[0].query_selector("td.ready").inner_text()) >= 0
            assert page.inner_text("#errors") == "none"
            page.screenshot(path=str(tmp_path / "sidecar.png"), full_page=True)
            assert watched.errors == []
            assert watched.foreign == []
            page.close()
