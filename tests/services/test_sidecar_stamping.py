"""Version-range stamping of responses: JSON bodies and SSE streams cut at any byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.services.sidecar.gate import VersionGate
from deltaboard.services.sidecar.stamping import Release, restamped_stream, stamp


class EndsAt:
    """A gate stand-in whose release reports the version a request ended with."""

    def __init__(self, end: int) -> None:
        self.end = end
        self.released = 0

    async def release(self, high: int | None) -> int:
        self.released += 1
        return self.end


class Chunked:
    """An upstream response whose raw body arrives cut at the given offsets."""

    def __init__(self, body: bytes, cuts: list[int]) -> None:
        self.body = body
        self.cuts = sorted({c % (len(body) + 1) for c in cuts})

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        last = 0
        for cut in [*self.cuts, len(self.body)]:
            if cut > last:
                yield self.body[last:cut]
                last = cut


def run_stream(
    body: bytes, cuts: list[int], start: int, end: int, refusal: str | None = None
) -> tuple[list[bytes], int]:
    gate = EndsAt(end)

    async def verify() -> str | None:
        return refusal

    async def collect() -> list[bytes]:
        release = Release(cast(VersionGate, gate), None)
        stream = restamped_stream(cast(Any, Chunked(body, cuts)), start, release, verify)
        return [part async for part in stream]

    out = asyncio.run(collect())
    return b"".join(out).split(b"\n\n")[:-1], gate.released


payloads = st.dictionaries(
    st.sampled_from(["i", "text", "x"]), st.integers() | st.text(max_size=5), max_size=3
)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)  # a shared, busy CPU
@given(
    st.lists(payloads, min_size=1, max_size=6),
    st.booleans(),
    st.booleans(),
    st.lists(st.integers(0, 10_000), max_size=8),
    st.integers(0, 50),
    st.integers(0, 50),
)
def test_every_event_passes_and_only_the_last_data_event_is_stamped(events, comment, done, cuts, start, end):
    lines = [b": keep-alive"] if comment else []
    lines += [b"data: " + json.dumps(e).encode() for e in events]
    if done:
        lines.append(b"data: [DONE]")
    body = b"".join(line + b"\n\n" for line in lines)
    out, released = run_stream(body, cuts, start, end)
    assert released == 1
    data = [json.loads(e[6:]) for e in out if e.startswith(b"data: {")]
    assert data[:-1] == events[:-1]
    assert data[-1] == {**events[-1], "weight_version": {"start": start, "end": end}}
    assert (out[-1] == b"data: [DONE]") == done
    assert (out[0] == b": keep-alive") == comment


@given(
    st.lists(payloads, min_size=1, max_size=4), st.booleans(), st.lists(st.integers(0, 10_000), max_size=4)
)
def test_a_stream_the_gate_does_not_vouch_for_ends_with_an_error_not_a_range(events, done, cuts):
    lines = [b"data: " + json.dumps(e).encode() for e in events] + ([b"data: [DONE]"] if done else [])
    out, released = run_stream(b"".join(line + b"\n\n" for line in lines), cuts, 1, 1, "other weights")
    assert released == 1
    data = [json.loads(e[6:]) for e in out if e.startswith(b"data: {")]
    assert data == [*events, {"error": {"code": "EngineChanged", "message": "other weights"}}]
    assert (out[-1] == b"data: [DONE]") == done


def test_a_stream_without_data_events_still_reports_its_range():
    out, released = run_stream(b": only a comment\n\n", [3], 4, 5)
    assert released == 1
    assert out == [b": only a comment", b'data: {"weight_version": {"start": 4, "end": 5}}']


@given(payloads, st.integers(0, 9), st.integers(0, 9))
def test_json_objects_gain_the_range_and_keep_everything_else(payload, start, end):
    stamped = stamp(json.dumps(payload).encode(), start, end)
    assert stamped is not None
    assert json.loads(stamped) == {**payload, "weight_version": {"start": start, "end": end}}


def test_non_objects_are_left_alone():
    assert stamp(b"[1, 2]", 1, 1) is None
    assert stamp(b"not json", 1, 1) is None
