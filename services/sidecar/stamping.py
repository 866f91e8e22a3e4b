"""How a response carries the version range it was served with.

- headers `X-Weight-Version-Start` / `X-Weight-Version-End`,
- a JSON object body gains `"weight_version": {"start": s, "end": e}`,
- a server-sent event stream is passed through holding one event back, so that its last
  data event (the one before `data: [DONE]`) can gain the same field once the range's
  end is known; a stream without a JSON last event gets one extra event carrying it.
  When the weights behind the stream cannot be vouched for at its end, the last event
  goes out unstamped, followed by `{"error": {"code": "EngineChanged", ...}}`.

`Release` ends a request's admission exactly once (its result is the range's end);
`StampedStream` guarantees that release even if the client left before the first byte.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi.responses import StreamingResponse

from deltaboard.services.sidecar.constraints import SidecarCode
from deltaboard.services.sidecar.gate import VersionGate


def range_headers(start: int | None, end: int | None) -> dict[str, str]:
    headers = {}
    if start is not None:
        headers["X-Weight-Version-Start"] = str(start)
    if end is not None:
        headers["X-Weight-Version-End"] = str(end)
    return headers


def stamp(payload: bytes, start: int | None, end: int | None) -> bytes | None:
    """`payload` (JSON) with the version range added (None: no range, and any range the
    engine wrote removed), or None when it is not a JSON object."""
    try:
        decoded = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(decoded, dict):
        return None
    decoded.pop("weight_version", None)
    if start is not None or end is not None:
        decoded["weight_version"] = {"start": start, "end": end}
    return json.dumps(decoded, separators=(",", ":")).encode()


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class Release:
    """Release a request's admission exactly once, remembering the version it ended with."""

    def __init__(self, gate: VersionGate, high: int | None) -> None:
        self._gate = gate
        self._high = high
        self._end: int | None = None
        self.done = False

    async def __call__(self) -> int | None:
        if not self.done:
            self.done = True
            self._end = await self._gate.release(self._high)
        return self._end


class StampedStream(StreamingResponse):
    """A stream that always releases its admission and closes the upstream, even when the
    client went away before the first byte (when the body iterator never ran)."""

    def __init__(self, upstream: httpx.Response, release: Release, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._upstream = upstream
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.aclose()
            await self._release()


async def restamped_stream(
    upstream: httpx.Response,
    start: int | None,
    release: Release,
    verify: Callable[[], Awaitable[str | None]],
) -> AsyncIterator[bytes]:
    """Pass SSE events through, holding one back so the last data event can carry the range
    (`verify()`, asked at the end, returns why the range must not be given, or None)."""
    buffer = b""
    held: bytes | None = None
    async for chunk in upstream.aiter_raw():
        buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = _event_data(event)
            if data == b"[DONE]":
                yield await _final_event(held, start, release, verify)
                held = None
            elif data is not None:
                if held is not None:
                    yield held + b"\n\n"
                held = event
                continue
            yield event + b"\n\n"
    if held is not None or not release.done:
        yield await _final_event(held, start, release, verify)


def _data_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _final_event(
    held: bytes | None, start: int | None, release: Release, verify: Callable[[], Awaitable[str | None]]
) -> bytes:
    refusal = await verify()
    end = await release()
    data = _event_data(held) if held is not None else None
    if refusal is not None:  # no range, not even one the engine wrote itself
        unstamped = stamp(data, None, None) if data is not None else None
        before = b"" if held is None else (b"data: " + unstamped if unstamped else held) + b"\n\n"
        return before + _data_event({"error": {"code": str(SidecarCode.ENGINE_CHANGED), "message": refusal}})
    stamped = stamp(data, start, end) if data is not None else None
    if stamped is not None:
        return b"data: " + stamped + b"\n\n"
    before = b"" if held is None else held + b"\n\n"
    return before + _data_event({"weight_version": {"start": start, "end": end}})
