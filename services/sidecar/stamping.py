"""How a response carries the versions it was served with.

- headers `X-Weight-Version-Start` / `X-Weight-Version-End`,
- a JSON object body gains `"weight_version": {"start": s, "end": e, "spans": ...}`,
- a server-sent event stream is passed through as it comes (nothing held back: each
  token leaves with the read that brought it) and ends with an event of the sidecar's own,
  `data: {"choices": [], "weight_version": {...}}`, after the engine's last data event
  and before `data: [DONE]`; so the stream's last data event carries the range, as an
  OpenAI usage chunk carries usage (`choices` empty). An engine's own `weight_version` in
  an event is taken out of it (its spans are read, see below). When the weights behind the
  stream cannot be vouched for at its end, `{"error": {"code": "EngineChanged", ...}}`
  takes the range's place; when a swap aborts the request (`abort_stale`, see
  `services.sidecar.gate`), the stream ends with `{"error": {"code": "WeightVersionGone",
  ...}}` (the error object of the 410 a request arriving now would get).

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

Bodies are stamped by splicing bytes, not by decoding and encoding them: the field is
appended before an object's closing brace, and an engine's own `weight_version`, when it
is the object's last member (as the reference engine writes it), is read alone and cut
out; only a body where it sits elsewhere is decoded whole. A stream's reads are scanned
for event boundaries, `[DONE]` and the field's name, and passed on in one piece; under the
sidecar's server, from the upstream connection's callback until the first read that names
either (`restamped_stream`'s `sink`), and only that end through the coroutine; there, a
read of whole chunks that each end an event goes on as the engine framed it, not decoded
and framed again (`upstream.whole_chunks`).

`Release` ends a request's admission exactly once (its result is the range's end); the
proxy releases every admission once its upstream is closed, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import pairwise
from typing import Any, Protocol

from deltaboard.services.sidecar.constraints import SidecarCode
from deltaboard.services.sidecar.gate import Admitted, Stale, VersionGate, unless_stale
from deltaboard.services.sidecar.upstream import Framed, whole_chunks


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


_FIELD = b'"weight_version"'
_EVENTS = whole_chunks(b"\n\n")  # a read of whole chunks, each ending an event
# Bytes are searched with `find`, not `in`: CPython 3.11's `bytes.__contains__` first tries
# its argument as an integer and builds a formatted TypeError for every bytes one, which
# costs more than the search itself (a stream's every read searches two or three times).
_DECODER = json.JSONDecoder()
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode  # one encoder, not one per call


def _last_member(body: bytes) -> tuple[bytes, Any] | None:
    """(`body` up to its `weight_version` member, the member's value) when that member is
    the last of the object `body` (stripped), read without decoding the rest; else None."""
    at = body.rfind(_FIELD)
    head = body[:at].rstrip()
    if not head.endswith((b",", b"{")):
        return None
    rest = body[at + len(_FIELD) :].lstrip()
    if not rest.startswith(b":"):
        return None
    try:
        text = rest[1:].decode().lstrip()
        value, stop = _DECODER.raw_decode(text)
    except ValueError:  # UnicodeDecodeError included
        return None
    if text[stop:].strip() != "}":  # a nested member, or not the last one
        return None
    return head.removesuffix(b","), value


def without_field(payload: bytes) -> tuple[bytes, Any] | None:
    """A JSON object's text without its closing brace and without its `weight_version`
    member, and that member's value (None: it has none); None when `payload` is not an
    object. Only a payload naming the field elsewhere than as its last member is decoded."""
    body = payload.strip()
    if not (body.startswith(b"{") and body.endswith(b"}")):
        return None
    if body.find(_FIELD) < 0:
        return body[:-1].rstrip(), None
    found = _last_member(body)
    if found is not None:
        return found
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    if not isinstance(decoded, dict):
        return None
    reported = decoded.pop("weight_version", None)
    return _COMPACT(decoded).encode()[:-1], reported


def cut_field(raw: bytes) -> bytes | None:
    """`raw`, a JSON object whose decoding has a top-level `weight_version`, without that
    member, cut out by bytes; None when it cannot be told by bytes alone which occurrence
    is that member (the name written twice, or a `\\u` escape that could spell it)."""
    at = raw.find(_FIELD)
    if at < 0 or raw.find(_FIELD, at + 1) >= 0 or raw.find(b"\\u") >= 0:
        return None
    colon = raw.find(b":", at + len(_FIELD))
    if colon < 0 or raw[at + len(_FIELD) : colon].strip():
        return None
    text = raw.decode("latin-1")  # one character per byte: the offsets are the bytes'
    begin = colon + 1
    while text[begin : begin + 1] in (" ", "\t", "\n", "\r"):
        begin += 1
    try:
        stop = _DECODER.raw_decode(text, begin)[1]
    except ValueError:
        return None
    before, after = raw[:at].rstrip(), raw[stop:].lstrip()
    if before.endswith(b","):
        return before[:-1] + after
    if before.endswith(b"{"):
        return before + after.removeprefix(b",")
    return None


def stamp(payload: bytes, start: int | None, end: int | None) -> bytes | None:
    """`payload` (a JSON object) with the versions added (start and end None: none, and any
    the engine wrote removed), or None when it is not a JSON object. A body that only looks
    like one (braces around something else) is spliced as if it were, and stays as invalid
    as it came."""
    split = without_field(payload)
    if split is None:
        return None
    head, reported = split
    if start is None and end is None:
        return head + b"}"
    field = _COMPACT(version_field(start, end, reported)).encode()
    return head + (b'"weight_version":' if head == b"{" else b',"weight_version":') + field + b"}"


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


class Sink(Protocol):
    """Where a stream's parts can be written from a callback (the sidecar's server's
    `_Cycle`): `write` a part now, or `write_framed` parts already framed as chunks (False:
    the answer is not chunked, nothing written); `behind` gives a future while the client lags."""

    def write(self, body: bytes) -> None: ...

    def write_framed(self, framed: bytes) -> bool: ...

    def behind(self) -> asyncio.Future[None] | None: ...


def _events(pending: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """(the complete events of `pending` + `chunk`, maybe b"", the start of the next one)."""
    data = pending + chunk if pending else chunk
    if data.find(b"\r") >= 0:
        data = data.replace(b"\r\n", b"\n")
    cut = data.rfind(b"\n\n") + 2
    if cut < 2:
        return b"", data
    return (data, b"") if cut == len(data) else (data[:cut], data[cut:])


def _ends(complete: bytes) -> bool:
    """Whether `complete` holds `[DONE]` or the engine's versions (once or twice a stream)."""
    return complete.find(b"[DONE]") >= 0 or complete.find(_FIELD) >= 0


async def restamped_stream(
    upstream: Any,
    admitted: Admitted,
    release: Release,
    verify: Callable[[], Awaitable[str | None]],
    aborted: Callable[[], None],
    sink: Sink | None = None,
) -> AsyncIterator[bytes]:
    """Pass SSE events through as each read of `upstream.aiter_raw()` brings them (its
    complete events in one piece), then the range in an event of its own, before `[DONE]`
    or at the end (`verify()`, asked then, returns why the range must not be given, or
    None). A swap that aborts the request ends the stream with its error (and calls
    `aborted()`); the caller closes the upstream and releases the admission after it.

    With a `sink` (and `upstream.forward`, for a request no swap can abort), the events up
    to the stream's end go to `sink.write` straight from the upstream connection's reads,
    without a step of this generator per read; what is yielded is the end."""
    start = admitted.start
    abortable = admitted.high is not None  # only a request with a highest version goes stale
    pending = b""  # the start of an event not complete yet
    reported: list[Any] = [None]  # the engine's own `weight_version`, the last it wrote
    if sink is not None and not abortable:
        last = b""  # the events a forward stopped at

        def forward(chunk: bytes) -> bool:
            nonlocal pending, last
            complete, pending = _events(pending, chunk)
            if _ends(complete):
                last = complete
                return False
            if complete:
                sink.write(complete)
            return True

        def as_read(framed: bytes) -> bool | None:
            """A read of whole chunks, each ending an event (`_EVENTS`), passed on as it came
            when it is what `forward` would write: no event held from before and neither
            `[DONE]` nor the engine's versions in it (the chunk framing, hex digits and CRLF,
            can neither hide nor fake either: a search of the framed bytes finds what one of
            the payloads would). Else None: decoded, for `forward`."""
            if pending or _ends(framed):
                return None
            return True if sink.write_framed(framed) else None

        await upstream.forward(forward, sink.behind, Framed(_EVENTS, as_read))
        if last:
            last = await _ending(last, start, release, verify, reported)
            if last:
                yield last
    chunks = upstream.aiter_raw()
    while True:
        if abortable:
            try:
                chunk = await unless_stale(anext(chunks, None), admitted)
            except Stale as stale:
                aborted()
                yield _data_event({"error": stale.refused.error()})
                return
        else:
            chunk = await anext(chunks, None)
        if chunk is None:
            break
        complete, pending = _events(pending, chunk)
        if _ends(complete):
            complete = await _ending(complete, start, release, verify, reported)
        if complete:
            yield complete
    if not release.done:
        yield await _final_event(start, release, verify, reported[0])


async def _ending(
    complete: bytes,
    start: int | None,
    release: Release,
    verify: Callable[[], Awaitable[str | None]],
    reported: list[Any],
) -> bytes:
    """`complete` (whole events) with the engine's versions taken out of its events and the
    range put before `[DONE]`. Event by event, but only from the first event that names
    either: a read behind a fast engine holds many tokens, and only the last ones matter."""
    first = min(at for at in (complete.find(b"[DONE]"), complete.find(_FIELD)) if at >= 0)
    cut = complete.rfind(b"\n\n", 0, first)
    begin = 0 if cut < 0 else cut + 2
    out = [complete[:begin]]
    for event in complete[begin:].split(b"\n\n")[:-1]:
        data = _event_data(event)  # once an event
        if not release.done and data == b"[DONE]":
            out.append(await _final_event(start, release, verify, reported[0]))
        out.append(_without_engine_versions(event, data, reported) + b"\n\n")
    return b"".join(out)


def _without_engine_versions(event: bytes, data: bytes | None, reported: list[Any]) -> bytes:
    """`event` (its data: `data`) without the `weight_version` the engine wrote into its
    data, which goes into `reported[0]` (the event as it came when its data names none)."""
    if data is None or data.find(_FIELD) < 0:
        return event
    split = without_field(data)
    if split is None:
        return event
    reported[0] = split[1]
    others = [line for line in event.split(b"\n") if not line.startswith(b"data:")]
    return b"\n".join([*others, b"data: " + split[0].replace(b"\n", b" ") + b"}"])


def _data_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def error_event(code: SidecarCode, message: str) -> bytes:
    """The last event of a stream refused after its head went out, in place of its range:
    the client reads why, in the sidecar's error shape, instead of a cut connection."""
    return _data_event({"error": {"code": str(code), "message": message}})


async def _final_event(
    start: int | None, release: Release, verify: Callable[[], Awaitable[str | None]], reported: Any
) -> bytes:
    """The stream's range, in an event of its own (or, not vouched for, an error)."""
    refusal = await verify()
    end = await release()
    if refusal is not None:
        return error_event(SidecarCode.ENGINE_CHANGED, refusal)
    return _data_event({"choices": [], "weight_version": version_field(start, end, reported)})
