"""The reference engine's HTTP app: OpenAI-compatible completions plus reload/pause control.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming with SSE or
not), `GET /v1/models`, `GET /health`, and the control routes the reference adapter
drives: `POST /reload {"model": DIR, "weight_version": N}`, `POST /pause`, `POST /resume`,
and with `--hot` the in-place update (`services.engine.hot`): `POST /weights/stage
{"patch": PATH, "weight_version": N}` and `POST /weights/commit {"weight_version": N}`.
The control routes are for the sidecar alone: the sidecar's proxy never forwards them, and
the engine's own port must not be reachable by clients.
Generation runs in a worker thread per request; a client that disconnects stops it
between two tokens (counted in `/health` as `aborted`).

What the engine holds is reported with a load counter that moves with every load
(`WeightSlot.stamp`): in `/health` (`weight_version`, `loads`), in the answer to
`/reload`, and in the headers `X-Engine-Weight-Version` / `X-Engine-Load-Count` of every
response, taken when the response starts (for a completion that is not streamed: after
its last token). A sidecar compares them with what it loaded itself, so a response
generated with weights it did not load is never stamped with its version.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaboard.clients.engines.reference import LOADS_HEADER, VERSION_HEADER
from deltaboard.clients.resident import BaseMismatch, ResidentError
from deltaboard.services.engine.hot import HotWeights
from deltaboard.services.engine.protocol import ChatRequest, Completion, CompletionRequest
from deltaboard.services.engine.runtime import (
    Cancelled,
    EngineNotLoaded,
    LoadedModel,
    SamplingParams,
    TokenStep,
    WeightSlot,
    generate,
    load_model,
)
from deltaboard.services.sidecar.background import unless_disconnected

RETRY_AFTER_S = "1"
# A CPU reference engine: longer prompts are a mistake, not a workload.
MAX_PROMPT_TOKENS = 8192


class StageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    patch: str = Field(min_length=1)
    weight_version: int = Field(ge=0)


class CommitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: int = Field(ge=0)


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    weight_version: int | None = Field(default=None, ge=0)


@dataclass
class EngineState:
    """What one engine process holds: the weight slot, its name, counters."""

    model_name: str
    slot: WeightSlot = field(default_factory=WeightSlot)
    reload_lock: threading.Lock = field(default_factory=threading.Lock)
    device: str = "cpu"
    hot: HotWeights | None = None  # set: versions may also be patched in place (`--hot`)
    requests: int = 0
    aborted: int = 0
    generating: int = 0  # generation threads alive
    tokens: int = 0  # tokens generated, all requests

    def reload(self, directory: Path, version: int | None) -> tuple[int | None, int]:
        """Load `directory` as `version`; returns the slot's stamp (version, loads) after it."""
        with self.reload_lock:
            return self.slot.install(load_model(directory, version, self.device))


class StampHeaders:
    """Adds what the engine holds, as the response starts, to every response's headers."""

    def __init__(self, app: ASGIApp, slot: WeightSlot) -> None:
        self.app = app
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                version, loads = self.slot.stamp()
                headers = [*message.get("headers", []), (LOADS_HEADER.lower().encode(), str(loads).encode())]
                if version is not None:
                    headers.append((VERSION_HEADER.lower().encode(), str(version).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)


def error(status: int, code: str, message: str, retry: bool = False) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if retry else None
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def _steps(
    state: EngineState, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event
) -> AsyncIterator[TokenStep]:
    """Run `generate` in a thread and hand its steps to the event loop as they come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[TokenStep | BaseException | None] = asyncio.Queue()

    def work() -> None:
        try:
            for step in generate(state.slot, prompt_ids, params, cancel):
                state.tokens += 1
                loop.call_soon_threadsafe(queue.put_nowait, step)
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            state.generating -= 1

    state.generating += 1
    threading.Thread(target=work, name="engine-generate", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancel.set()


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="deltaboard reference engine")
    app.add_middleware(StampHeaders, slot=state.slot)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, "BadRequest", str(exc.errors()[:3]))

    async def serve(
        request: Request, completion: Completion, params: SamplingParams, stream: bool
    ) -> Response:
        state.requests += 1
        cancel = threading.Event()
        if stream:
            return StreamingResponse(_stream(completion, params, cancel), media_type="text/event-stream")
        response: Response
        finished, response = await unless_disconnected(request, _collect(completion, params, cancel))
        if not finished:
            cancel.set()
            state.aborted += 1
            return Response(status_code=499)
        return response

    async def _collect(completion: Completion, params: SamplingParams, cancel: threading.Event) -> Response:
        try:
            async for step in _steps(state, completion.prompt_ids, params, cancel):
                completion.steps.append(step)
        except EngineNotLoaded as exc:
            return error(503, "ModelNotLoaded", str(exc), retry=True)
        return JSONResponse(completion.final())

    async def _stream(
        completion: Completion, params: SamplingParams, cancel: threading.Event
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for step in _steps(state, completion.prompt_ids, params, cancel):
                yield _sse(completion.chunk(step))
            finished = True
            yield _sse("[DONE]")
        except (EngineNotLoaded, Cancelled) as exc:
            yield _sse({"error": {"code": type(exc).__name__, "message": str(exc)}})
        finally:
            cancel.set()  # whoever ended the stream (client gone, error), stop generating
            if not finished:
                state.aborted += 1

    def prompt_ids(loaded: LoadedModel, prompt: str | list[int]) -> list[int]:
        ids = loaded.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not 0 < len(ids) <= MAX_PROMPT_TOKENS or any(not 0 <= t < loaded.vocab_size for t in ids):
            raise ValueError(f"prompt must be 1..{MAX_PROMPT_TOKENS} token ids in [0, {loaded.vocab_size})")
        return ids

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        loaded = state.slot.current
        if loaded is None:
            return error(503, "ModelNotLoaded", "no weights loaded yet", retry=True)
        try:
            ids = prompt_ids(loaded, body.prompt)
        except ValueError as exc:
            return error(400, "BadPrompt", str(exc))
        completion = Completion("text", state.model_name, loaded.codec, ids, body.logprobs is not None)
        return await serve(request, completion, body.sampling(), body.stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        loaded = state.slot.current
        if loaded is None:
            return error(503, "ModelNotLoaded", "no weights loaded yet", retry=True)
        text = loaded.codec.render_chat([m.model_dump() for m in body.messages])
        try:
            ids = prompt_ids(loaded, text)
        except ValueError as exc:
            return error(400, "BadPrompt", str(exc))
        completion = Completion("chat", state.model_name, loaded.codec, ids, body.logprobs)
        return await serve(request, completion, body.sampling(), body.stream)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        loaded = state.slot.current
        version = loaded.version if loaded else None
        return {
            "object": "list",
            "data": [{"id": state.model_name, "object": "model", "weight_version": version}],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        loaded = state.slot.current
        version, loads = state.slot.stamp()
        status = "ok" if loaded else ("loading" if state.reload_lock.locked() else "empty")
        return {
            "status": status,
            "weight_version": version,
            "loads": loads,
            "model": str(loaded.directory) if loaded else None,
            "paused": state.slot.paused,
            "hot": state.hot is not None,
            "device": state.device,
            "requests": state.requests,
            "aborted": state.aborted,
            "generating": state.generating,
            "tokens": state.tokens,
        }

    @app.post("/reload")
    async def reload(body: ReloadRequest) -> Response:
        loaded = state.slot.current
        directory = Path(body.model) if body.model else (loaded.directory if loaded else None)
        if directory is None or not (directory / "config.json").is_file():
            return error(400, "BadModelDir", f"not a checkpoint directory: {directory}")
        try:
            version, loads = await run_in_threadpool(state.reload, directory, body.weight_version)
        except (OSError, ValueError) as exc:
            return error(400, "ModelLoadFailed", str(exc))
        return JSONResponse({"weight_version": version, "loads": loads, "model": str(directory)})

    @app.post("/weights/stage")
    async def stage(body: StageRequest) -> Response:
        if state.hot is None:
            return error(404, "NotHot", "this engine was not started with --hot")
        try:
            staged = await run_in_threadpool(state.hot.stage, Path(body.patch), body.weight_version)
        except ResidentError as exc:
            return error(409, "HotRefused", str(exc))
        return JSONResponse(
            {"weight_version": staged.version, "changed": staged.changed, "bytes": staged.nbytes}
        )

    @app.post("/weights/commit")
    async def commit(body: CommitRequest) -> Response:
        if state.hot is None:
            return error(404, "NotHot", "this engine was not started with --hot")
        try:
            done = await run_in_threadpool(state.hot.commit, body.weight_version)
        except BaseMismatch as exc:
            return error(409, "BaseMismatch", str(exc))
        except ResidentError as exc:
            return error(409, "HotRefused", str(exc))
        return JSONResponse(
            {
                "weight_version": done.version,
                "loads": done.loads,
                "changed": done.changed,
                "pause_ms": done.pause_s * 1e3,
                "held_ms": done.held_s * 1e3,
            }
        )

    @app.post("/pause")
    async def pause() -> dict[str, bool]:
        await run_in_threadpool(state.slot.pause)
        return {"paused": True}

    @app.post("/resume")
    async def resume() -> dict[str, bool]:
        state.slot.resume()
        return {"paused": False}

    return app
