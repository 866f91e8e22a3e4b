"""Fake SGLang and vLLM servers that implement exactly the control routes the adapters use
(and the routes that report what they hold).

Each records the calls it received, so a test asserts the sequence an adapter drives; a
route the real engine lacks is simply absent here (404), so an adapter calling it fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse


def fake_sglang(calls: list[tuple[str, Any]]) -> FastAPI:
    app = FastAPI()
    state: dict[str, Any] = {"paused": False, "model_path": "/started/with", "weight_version": "default"}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict[str, str]:
        body = await request.json()
        if body.get("mode") not in ("abort", "in_place", "retract"):
            raise HTTPException(422, "bad mode")
        state["paused"] = True
        calls.append(("pause_generation", body))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request) -> dict[str, str]:
        calls.append(("continue_generation", await request.json()))
        state["paused"] = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> JSONResponse:
        body = await request.json()
        calls.append(("update_weights_from_disk", body))
        if not Path(body["model_path"]).is_dir():
            return JSONResponse({"success": False, "message": "no such checkpoint"}, status_code=400)
        state["model_path"] = body["model_path"]
        if body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": state["model_path"],
            "is_generation": True,
            "weight_version": state["weight_version"],
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> PlainTextResponse:
        calls.append(("flush_cache", None))
        return PlainTextResponse("Cache flushed.", status_code=400 if state["paused"] else 200)

    return app


def fake_vllm(calls: list[tuple[str, Any]]) -> FastAPI:
    app = FastAPI()
    state: dict[str, Any] = {"weight_version": None}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/pause")
    async def pause(mode: str = Query("abort")) -> dict[str, str]:
        if mode not in ("abort", "wait", "keep"):
            raise HTTPException(400, "bad mode")
        calls.append(("pause", mode))
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        calls.append(("resume", None))
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def rpc(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body.get("method") != "reload_weights":
            raise HTTPException(400, "unexpected method")
        calls.append(("collective_rpc", body["method"]))
        return {"results": [None]}

    @app.post("/update_weight_version")
    async def tag(request: Request) -> dict[str, Any]:
        body = await request.json()
        calls.append(("update_weight_version", body["new_version"]))
        state["weight_version"] = body["new_version"]
        return {"success": True, "new_version": body["new_version"]}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": state["weight_version"]}

    @app.post("/reset_prefix_cache")
    async def reset() -> PlainTextResponse:
        calls.append(("reset_prefix_cache", None))
        return PlainTextResponse("")

    return app
