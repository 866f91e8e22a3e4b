"""The board's HTTP API (FastAPI): `create_app(settings)` and `serve(settings)`."""

from board.api.app import create_app
from board.api.server import serve

__all__ = ["create_app", "serve"]
