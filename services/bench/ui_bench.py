"""`deltaboard bench ui`: the dashboard's first render with a long run and a large fleet.

A board process is filled through the real API: a `Publisher` publishes a small bf16
state (`elements` elements, a few of them moved each version, a keyframe every
`keyframe_every`) `versions` times, then `nodes` nodes report their versions, spread over
the last few heads. Debian's headless Chromium (driven by Playwright, as `tests/ui` does)
then opens `/ui` on the run, `repeats` times in fresh pages, the read token already in the
page's session storage. The page sets the performance mark `deltaboard:rendered` once its
charts, head and fleet table are drawn (the frame after its first commit event is handled);
its time since navigation started is the first render. The target: under 1 s.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from deltaboard.board.contract.schemas import Heartbeat
from deltaboard.clients.board_client import BoardClient
from deltaboard.services.bench.publish_bench import board_process

RUN = "ui-bench"
RENDERED_MARK = "deltaboard:rendered"
TARGET_S = 1.0
TOKEN_KEY = "deltaboard.token"  # the page's session-storage key (board/server/ui/app.js)


@dataclass(frozen=True)
class BenchConfig:
    versions: int = 1000
    nodes: int = 200
    keyframe_every: int = 50
    elements: int = 4096
    repeats: int = 3


QUICK = BenchConfig(versions=100, nodes=20, repeats=1)


class NoBrowser(RuntimeError):
    """Debian's chromium (or Playwright) is not installed: nothing can be measured."""


def fill(client: BoardClient, run: str, config: BenchConfig, status: Callable[[str], None]) -> float:
    """Publish `config.versions` versions of a small state and report `config.nodes` nodes;
    seconds it took. Nodes sit 0-4 versions behind the head, node i at head - i % 5."""
    import torch

    from deltaboard.publisher.publisher import Publisher

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(config.elements, generator=generator).to(torch.bfloat16)
    moved = max(1, config.elements // 100)
    # A config.json travels with the first version, as a trainer's does: the runs route
    # finds a run's assets by listing their folder, and for a run without one the local
    # store walks the whole run instead (0.1-0.2 s per run at 1,000 versions).
    assets = {"config.json": b'{"model_type": "bench"}'}
    with Publisher(
        client, run, keyframe_every=config.keyframe_every, encode_workers=1, assets=assets
    ) as publisher:
        for version in range(config.versions):
            if version:  # about 1% of the elements move, as an RL step moves a bf16 view
                at = torch.randint(0, config.elements, (moved,), generator=generator)
                weight[at] = torch.randn(moved, generator=generator).to(torch.bfloat16)
            publisher.publish({"w": weight})
            if version % 100 == 0:
                status(f"published {version} of {config.versions} versions")
        publisher.flush()
    head = config.versions - 1
    for i in range(config.nodes):
        beat = Heartbeat(node_id=f"node-{i:03d}", version=max(0, head - i % 5), engine="bench")
        client.heartbeat(run, beat)
    return time.perf_counter() - started


def chromium_path() -> str:
    """Debian's chromium, with Playwright to drive it, or `NoBrowser` saying which is missing."""
    executable = shutil.which("chromium")
    if executable is None:
        raise NoBrowser("Debian's chromium is not installed (apt-get install -y chromium): nothing measured")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        raise NoBrowser(
            "Playwright is not installed (pip install deltaboard[dev]): nothing measured"
        ) from exc
    return executable


def first_renders(url: str, token: str, run: str, repeats: int) -> list[float]:
    """Seconds from navigation to the page's `deltaboard:rendered` mark, once per fresh page."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    seconds = []
    with sync_playwright() as playwright:
        # headless (Playwright's default), no sandbox (containers), no GPU: as tests/ui runs it
        browser = playwright.chromium.launch(
            executable_path=executable, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            for _ in range(repeats):
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                context.add_init_script(
                    f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(token)})"
                )
                page = context.new_page()
                page.goto(f"{url}/ui/#run={run}")
                page.wait_for_function(
                    f"() => performance.getEntriesByName({json.dumps(RENDERED_MARK)}).length > 0",
                    timeout=60_000,
                )
                mark = page.evaluate(
                    f"() => performance.getEntriesByName({json.dumps(RENDERED_MARK)})[0].startTime"
                )
                seconds.append(float(mark) / 1000)
                context.close()
        finally:
            browser.close()
    return seconds


def run(config: BenchConfig, status: Callable[[str], None]) -> dict[str, Any]:
    """Fill a board and measure the page's first render; see the module doc."""
    chromium_path()  # before spending a minute filling a board for nothing
    with (
        tempfile.TemporaryDirectory(prefix="deltaboard-ui-bench-") as tmp,
        board_process(Path(tmp)) as (url, token),
        BoardClient(url, token) as client,
    ):
        client.create_run(RUN)
        fill_s = fill(client, RUN, config, status)
        status("opening the dashboard")
        renders = first_renders(url, token, RUN, config.repeats)
    median = statistics.median(renders)
    return {
        "config": asdict(config),
        "fill_s": round(fill_s, 2),
        "first_render_s": [round(s, 3) for s in renders],
        "first_render_median_s": round(median, 3),
        "target_s": TARGET_S,
        "met": median < TARGET_S,
    }


def render(report: dict[str, Any], console: Console) -> None:
    config = report["config"]
    filled = f"{config['versions']} versions and {config['nodes']} nodes"
    console.print(f"board filled with {filled} in {report['fill_s']:.1f} s")
    runs = ", ".join(f"{s:.3f}" for s in report["first_render_s"])
    mark = "[green]met[/green]" if report["met"] else "[red]missed[/red]"
    console.print(
        "first render (navigation to charts, head and fleet drawn): "
        f"median {report['first_render_median_s']:.3f} s ({runs}); target < {report['target_s']:g} s {mark}"
    )
