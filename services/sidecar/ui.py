"""The sidecar's own status page (`/ui`): what this node serves, the board's head, its lag,
the requests in flight, its last swaps (hot or reload, with their pause and ready times)
and its errors, for an operator looking at one node rather than the fleet (the board's
`/ui` shows the fleet).

The page reads `GET /sidecar/status` and asks again every couple of seconds, sooner while
a swap is in progress: the sidecar has no event stream to push from (the board's dashboard
has one and does not poll), and one small JSON from one browser tab costs the sidecar
nothing next to the inference it proxies. Its three files ship in the package (`ui/`,
the folder beside this module) and are served by name: nothing else is read from disk.
The Content-Security-Policy keeps every script, style and request on the sidecar's own
origin; it is the board's policy, written out here because importing the board's would
import the board server into every sidecar.

The proxy's catch-all route, added when the app is built, would answer `/ui` with its
404 for paths the engine does not serve, so the page's routes go in front of it: `/ui`
is the sidecar's own and never reaches the engine, and the engine's other routes stay
out as before.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from deltaboard.services.sidecar.constraints import SidecarCode
from deltaboard.services.sidecar.proxy import HTTP_STATUS

UI_DIR = Path(__file__).resolve().parent / "ui"
FILES = frozenset({"index.html", "app.js", "app.css"})  # all there is under /ui
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"


async def _to_folder(_: Request) -> Response:
    """`/ui` -> `/ui/`, so that the page's relative file names resolve under `/ui/`."""
    return RedirectResponse("/ui/")


async def _file(request: Request) -> Response:
    name = request.path_params.get("name") or "index.html"
    if name not in FILES:
        code = SidecarCode.NOT_FOUND
        body = {"error": {"code": str(code), "message": f"no file {name} in the status page"}}
        return JSONResponse(body, status_code=HTTP_STATUS[code])
    return FileResponse(UI_DIR / name, headers={"Content-Security-Policy": CSP})


def add_status_page(app: FastAPI) -> None:
    """Serve the status page at `/ui` on `app`, ahead of the routes already there."""
    app.router.routes[:0] = [
        Route("/ui", _to_folder, include_in_schema=False),
        Route("/ui/", _file, include_in_schema=False),
        Route("/ui/{name}", _file, include_in_schema=False),
    ]
