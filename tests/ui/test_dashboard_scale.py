"""The dashboard with a long run and a large fleet (issue 15's 1,000 versions and 200
nodes): every version charted, every node a row with its lag, the first render marked.
Correctness only: `deltaboard bench ui` measures the time (docs/design.md, Operators).
Committing 1,000 versions takes the board ~40 s on 2 busy cores, so the default run
charts 200 (every node still there) and the 1,000 are `slow`."""

from __future__ import annotations

import pytest

from deltaboard.board.contract.schemas import Heartbeat
from deltaboard.services.bench.ui_bench import RENDERED_MARK
from tests.support.browser import Watched
from tests.support.manifests import manifest

NODES = 200


@pytest.mark.parametrize("versions", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_dashboard_renders_every_version_and_node(board, browser, versions):
    publisher = board.client(board.publish_token)
    reader = board.client(board.read_token)
    publisher.create_run("long")
    epoch = publisher.acquire_lease("long", "trainer", ttl_s=600).epoch
    # One blob for every version (the board stores blobs, it never reads them): one
    # request per version, so the fill takes seconds, not a minute.
    payload = {"w": b"w" * 64}
    publisher.upload_blob("long", payload["w"])
    for v in range(versions):
        publisher.commit("long", manifest("long", v, epoch, payload, kind="full" if v % 50 == 0 else None))
    head = versions - 1
    for i in range(NODES):
        reader.heartbeat("long", Heartbeat(node_id=f"node-{i:03d}", version=head - i % 5, engine="reference"))

    watched = Watched(browser, board.url)
    page = watched.page
    page.goto(f"{board.url}/ui#run=long")
    watched.login(board.read_token)
    page.wait_for_function(
        f"() => performance.getEntriesByName('{RENDERED_MARK}').length === 1", timeout=30_000
    )
    assert page.inner_text("#head") == str(head)
    lags = page.evaluate(
        "() => [...document.querySelectorAll('#fleet tbody tr')]"
        ".map((row) => row.querySelector('td.lag').textContent)"
    )
    assert lags == [str(i % 5) for i in range(NODES)]
    assert page.inner_text("#fleet-summary") == f"{NODES} node(s), {NODES * 4 // 5} behind, 0 stale"
    # Every version in the charts, keyframes apart; every node a series of the fleet chart.
    charted = page.evaluate("() => state.charts.bytes.data[0]")
    assert charted == list(range(versions))
    keyframes = page.evaluate("() => state.charts.bytes.data[2].filter((x) => x !== null).length")
    assert keyframes == versions // 50
    assert page.evaluate("() => state.charts.fleet.series.length") == NODES + 2
    assert page.evaluate("() => state.charts.fleet.data[0].length") >= 1
    assert watched.errors == [] and watched.foreign == []
    page.close()
