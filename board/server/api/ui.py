"""The operators' dashboard (`/ui`): static files shipped in the package (`board/server/ui`),
served without a token (the page asks for one and sends it with each data request, which
keeps its read scope). The Content-Security-Policy lets the page reach its own origin only:
no script, style, image or request may come from or go anywhere else."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"


class DashboardFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers["Content-Security-Policy"] = CSP
        return response


def dashboard() -> DashboardFiles:
    return DashboardFiles(directory=UI_DIR, html=True)
