"""The board's HTTP API (FastAPI): `create_app(settings)` and `serve(settings)`."""

from deltaboard.board.server.api.app import create_app
from deltaboard.board.server.api.server import serve

__all__ = ["create_app", "serve"]
