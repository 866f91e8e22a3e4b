"""Running the board under uvicorn (used by `deltaboard board serve` and `python -m board.api`)."""

from __future__ import annotations

import logging

from board.settings import Settings


def serve(settings: Settings) -> None:
    import uvicorn

    from board.api.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # Long-polls hold connections for up to a minute; keep idle ones a little longer.
        timeout_keep_alive=75,
        backlog=4096,
    )
