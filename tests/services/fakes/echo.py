"""An engine stand-in that echoes what reached it (body, headers, query), plain or as SSE.

It serves the reference engine's inference routes (so the sidecar passes them) and its
`/health` stamp, without a load counter in its responses' headers: the sidecar then asks
`/health`, as it does for engines that stamp no responses.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


def echo_engine() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def echo(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(events(body), media_type="text/event-stream")
        seen: dict[str, Any] = {
            "body": body,
            "headers": dict(request.headers),
            "query": dict(request.query_params),
        }
        return JSONResponse(seen, status_code=int(request.query_params.get("status", 200)))

    async def events(body: dict[str, Any]) -> AsyncIterator[bytes]:
        yield b": a comment\n\n"
        for i in range(int(body.get("n", 3))):
            yield f"data: {json.dumps({'i': i})}\n\n".encode()
        if body.get("done", True):
            yield b"data: [DONE]\n\n"

    @app.get("/v1/models")
    async def text() -> PlainTextResponse:
        return PlainTextResponse("plain")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"weight_version": None, "loads": 1}

    return app
