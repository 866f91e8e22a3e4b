"""An engine stand-in that echoes what reached it (body, headers, query), plain or as SSE."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def echo_engine() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        seen: dict[str, Any] = {
            "body": body,
            "headers": dict(request.headers),
            "query": dict(request.query_params),
        }
        return JSONResponse(seen, status_code=int(request.query_params.get("status", 200)))

    @app.get("/text")
    async def text() -> PlainTextResponse:
        return PlainTextResponse("plain")

    @app.post("/v1/sse")
    async def sse(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> AsyncIterator[bytes]:
            yield b": a comment\n\n"
            for i in range(int(body.get("n", 3))):
                yield f"data: {json.dumps({'i': i})}\n\n".encode()
            if body.get("done", True):
                yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
