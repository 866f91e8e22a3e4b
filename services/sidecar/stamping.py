"""How a response carries the versions it was served with.

- headers `X-Weight-Version-Start` / `X-Weight-Version-End`,
- a JSON object body gains `"weight_version": {"start": s, "end": e, "spans": ...}`,
- a server-sent event stream is passed through as it comes, holding back only its latest
  data event (and what came after it), so that its last data event (the one before
  `data: [DONE]`) can gain the same field once the range's end is known; a stream
  without a JSON last event gets one extra event carrying it. When the weights behind
  the stream cannot be vouched for at its end, the last event goes out unstamped,
  followed by `{"error": {"code": "EngineChanged", ...}}`; when a swap aborts the request
  (`abort_stale`, see `services.sidecar.gate`), the events so far go out unstamped, then
  `{"error": {"code": "WeightVersionGone", ...}}` (the error object of the 410 a request
  arriving now would get), and the stream ends there.

`spans` says which version made which token of the completion: `[[0, 7], [12, 8]]` is
tokens 0-11 from version 7, from token 12 on version 8 (indices into the choice's
generated tokens). Only the engine can know where a swap fell between two tokens, so

- the engine's own `weight_version.spans` are kept when they fit the sidecar's range:
  well formed (from token 0, indices and versions increasing) and every version within
  `[start, end]` (a swap the sidecar made before the request's first token gives
  `[[0, end]]`); the reference engine reports them, exactly, from its token steps;
- else, when start == end, every token came from that version: `[[0, start]]`;
- else, `"spans": null`: the range spans a swap and the engine did not say where it fell
  (SGLang and vLLM report no per-token versions). Such tokens cannot be attributed: a
  caller that needs them exact uses `quiesce` mode or pins `exact`, which keep start ==
  end.

For a response of several choices (`n` > 1, engines other than the reference), `[[0, v]]`
holds for each choice; engine spans describe its one choice.

`Release` ends a request's admission exactly once (its result is the range's end); the
proxy releases every admission once its upstream is closed, whatever happened.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import pairwise
from typing import Any

from deltaboard.services.sidecar.constraints import SidecarCode
from deltaboard.services.sidecar.gate import Admitted, Stale, VersionGate, unless_stale


def range_headers(start: int | None, end: int | None) -> dict[str, str]:
    headers = {}
    if start is not None:
        headers["X-Weight-Version-Start"] = str(start)
    if end is not None:
        headers["X-Weight-Version-End"] = str(end)
    return headers


def _is_version(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _fits(spans: Any, start: int, end: int) -> bool:
    """Whether an engine's `spans` are well formed and within the sidecar's range."""
    if not isinstance(spans, list) or not spans:
        return False
    if not all(isinstance(s, list) and len(s) == 2 and all(map(_is_version, s)) for s in spans):
        return False
    indices, versions = [s[0] for s in spans], [s[1] for s in spans]
    increasing = all(a < b for a, b in (*pairwise(indices), *pairwise(versions)))
    return indices[0] == 0 and increasing and start <= versions[0] and versions[-1] <= end


def version_field(start: int | None, end: int | None, reported: Any = None) -> dict[str, Any]:
    """The `weight_version` a response carries: the sidecar's range and the token spans,
    the engine's own (`reported`: the field it wrote) where they fit the range."""
    engine = reported.get("spans") if isinstance(reported, dict) else None
    spans: list[list[int]] | None = None
    if start is not None and end is not None and _fits(engine, start, end):
        spans = engine
    elif start is not None and start == end:
        spans = [[0, start]]
    return {"start": start, "end": end, "spans": spans}


def stamp(payload: bytes, start: int | None, end: int | None) -> bytes | None:
    """`payload` (JSON) with the versions added (None: none, and any the engine wrote
    removed), or None when it is not a JSON object."""
    try:
        decoded = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(decoded, dict):
        return None
    reported = decoded.pop("weight_version", None)
    if start is not None or end is not None:
        decoded["weight_version"] = version_field(start, end, reported)
    return json.dumps(decoded, separators=(",", ":")).encode()


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class Release:
    """Release a request's admission exactly once, remembering the version it ended with."""

    def __init__(self, gate: VersionGate, admitted: Admitted) -> None:
        self._gate = gate
        self._admitted = admitted
        self._end: int | None = None
        self.done = False

    async def __call__(self) -> int | None:
        if not self.done:
            self.done = True
            self._end = await self._gate.release(self._admitted)
        return self._end


async def restamped_stream(
    upstream: Any,
    admitted: Admitted,
    release: Release,
    verify: Callable[[], Awaitable[str | None]],
    aborted: Callable[[], None],
) -> AsyncIterator[bytes]:
    """Pass SSE events through, holding back only what the last data event needs, so it
    can carry the range (`verify()`, asked at the end, returns why the range must not be
    given, or None). `upstream.aiter_raw()` gives the body; every read's complete events
    go out as one piece, as they came, except the last data event among them (and what
    follows it), which waits for the next read. A swap that aborts the request ends the
    stream with its error (and calls `aborted()`); the caller closes the upstream and
    releases the admission after it."""
    start = admitted.start
    abortable = admitted.high is not None  # only a request with a highest version goes stale
    chunks = upstream.aiter_raw()
    held = b""  # complete events, from the last data event on
    pending = b""  # the start of an event not complete yet
    while True:
        if abortable:
            try:
                chunk = await unless_stale(anext(chunks, None), admitted)
            except Stale as stale:
                aborted()
                yield _unstamped(held) + _data_event({"error": stale.refused.error()})
                return
        else:
            chunk = await anext(chunks, None)
        if chunk is None:
            break
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        data = pending + chunk if pending else chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            pending = data
            continue
        complete, pending = data[:cut], data[cut:]
        if b"[DONE]" in complete:  # once a stream: event by event
            for event in complete.split(b"\n\n")[:-1]:
                out, held = await _next_event(event, held, start, release, verify)
                if out:
                    yield out
            continue
        last = _last_data_event(complete)
        if last < 0 and held:
            held += complete
            continue
        out, held = (complete, b"") if last < 0 else (held + complete[:last], complete[last:])
        if out:
            yield out
    if held or not release.done:
        yield await _final_event(held, start, release, verify)


def _is_data(event: bytes) -> bool:
    return event.startswith(b"data:") or b"\ndata:" in event


def _last_data_event(complete: bytes) -> int:
    """Where the last data event of `complete` (whole events) starts; -1: none in it."""
    end = len(complete) - 2
    while True:
        separator = complete.rfind(b"\n\n", 0, end)
        begin = 0 if separator < 0 else separator + 2
        if _is_data(complete[begin:end]):
            return begin
        if separator < 0:
            return -1
        end = separator


async def _next_event(
    event: bytes,
    held: bytes,
    start: int | None,
    release: Release,
    verify: Callable[[], Awaitable[str | None]],
) -> tuple[bytes, bytes]:
    """What goes out for one more `event`, and what is held back after it."""
    data = _event_data(event)
    if data == b"[DONE]":
        return await _final_event(held, start, release, verify) + event + b"\n\n", b""
    if data is not None:
        return held, event + b"\n\n"
    if held:
        return b"", held + event + b"\n\n"
    return event + b"\n\n", b""


def _data_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _split_held(held: bytes) -> tuple[bytes | None, bytes]:
    """The held data event (None: none) and the events after it (with their separators)."""
    if not held:
        return None, b""
    end = held.index(b"\n\n")
    return held[:end], held[end + 2 :]


def _unstamped(held: bytes) -> bytes:
    """The held events as they go out before an error: the data event without any
    versions, not even ones the engine wrote itself."""
    event, after = _split_held(held)
    if event is None:
        return b""
    data = _event_data(event)
    unstamped = stamp(data, None, None) if data is not None else None
    return (b"data: " + unstamped if unstamped else event) + b"\n\n" + after


async def _final_event(
    held: bytes, start: int | None, release: Release, verify: Callable[[], Awaitable[str | None]]
) -> bytes:
    refusal = await verify()
    end = await release()
    if refusal is not None:
        error = {"code": str(SidecarCode.ENGINE_CHANGED), "message": refusal}
        return _unstamped(held) + _data_event({"error": error})
    event, after = _split_held(held)
    data = _event_data(event) if event is not None else None
    stamped = stamp(data, start, end) if data is not None else None
    if stamped is not None:
        return b"data: " + stamped + b"\n\n" + after
    before = b"" if event is None else event + b"\n\n"
    return before + after + _data_event({"weight_version": version_field(start, end)})
