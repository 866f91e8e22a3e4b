"""Version stamping of responses (range and token spans): JSON bodies and SSE streams cut
at any byte, and streams a swap aborts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.services.sidecar.constraints import SidecarCode, VersionConstraint
from deltaboard.services.sidecar.gate import Admitted, Refused, VersionGate
from deltaboard.services.sidecar.stamping import Release, cut_field, restamped_stream, stamp, version_field


class EndsAt:
    """A gate stand-in whose release reports the version a request ended with."""

    def __init__(self, end: int) -> None:
        self.end = end
        self.released = 0

    async def release(self, admitted: Admitted) -> int:
        self.released += 1
        return self.end


GONE = Refused(SidecarCode.WEIGHT_VERSION_GONE, "swapped past it", {"min": None, "max": 3}, 3, 4, None)


class Chunked:
    """An upstream response whose raw body arrives cut at the given offsets. With `abort`,
    once all of it went out, a swap aborts the request (`abort` is its `stale` future) while
    the engine is still generating: no more bytes, no end."""

    def __init__(self, body: bytes, cuts: list[int], abort: asyncio.Future[Refused] | None = None) -> None:
        self.body = body
        self.cuts = sorted({c % (len(body) + 1) for c in cuts})
        self.abort = abort

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        last = 0
        for cut in [*self.cuts, len(self.body)]:
            if cut > last:
                yield self.body[last:cut]
                last = cut
        if self.abort is not None:
            self.abort.set_result(GONE)
            await asyncio.Event().wait()  # still generating: only the abort ends the read


def run_stream(
    body: bytes, cuts: list[int], start: int, end: int, refusal: str | None = None, aborted: bool = False
) -> tuple[list[bytes], int]:
    gate = EndsAt(end)

    async def verify() -> str | None:
        return refusal

    async def collect() -> list[bytes]:
        stale: asyncio.Future[Refused] = asyncio.get_running_loop().create_future()
        admitted = Admitted(start, 0.0, VersionConstraint(max=3), 0, stale)
        release = Release(cast(VersionGate, gate), admitted)
        upstream = Chunked(body, cuts, stale if aborted else None)
        stream = restamped_stream(cast(Any, upstream), admitted, release, verify, lambda: counted.append(1))
        return [part async for part in stream]

    counted: list[int] = []
    out = asyncio.run(collect())
    assert len(counted) == aborted
    return b"".join(out).split(b"\n\n")[:-1], gate.released


def whole(start: int, end: int) -> dict[str, Any]:
    """The versions of a response the engine said nothing about."""
    return {"start": start, "end": end, "spans": [[0, start]] if start == end else None}


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
def test_every_event_passes_as_it_came_and_the_range_comes_last_in_its_own(
    events, comment, done, cuts, start, end
):
    lines = [b": keep-alive"] if comment else []
    lines += [b"data: " + json.dumps(e).encode() for e in events]
    if done:
        lines.append(b"data: [DONE]")
    body = b"".join(line + b"\n\n" for line in lines)
    out, released = run_stream(body, cuts, start, end)
    assert released == 1
    assert out[: len(lines) - done] == lines[: len(lines) - done]  # byte for byte
    data = [json.loads(e[6:]) for e in out if e.startswith(b"data: {")]
    assert data == [*events, {"choices": [], "weight_version": whole(start, end)}]
    assert (out[-1] == b"data: [DONE]") == done


@given(st.lists(payloads, min_size=1, max_size=4), st.lists(st.integers(0, 10_000), max_size=6))
def test_the_engines_own_versions_leave_its_event_for_the_range(events, cuts):
    spans = {"start": 7, "end": 8, "spans": [[0, 7], [2, 8]]}
    last = {**events[-1], "weight_version": spans}
    lines = [b"data: " + json.dumps(e).encode() for e in [*events[:-1], last]] + [b"data: [DONE]"]
    out, _ = run_stream(b"".join(line + b"\n\n" for line in lines), cuts, 7, 8)
    data = [json.loads(e[6:]) for e in out if e.startswith(b"data: {")]
    assert data == [*events, {"choices": [], "weight_version": spans}]


def test_an_event_goes_out_before_the_next_one_is_read():
    """Nothing is held back for the range: a stream's first token leaves when it comes."""
    received: list[bytes] = []
    asked: list[int] = []

    class OneByOne:
        async def aiter_raw(self) -> AsyncIterator[bytes]:
            for i in range(3):
                asked.append(len(received))  # what the client had when the engine was read again
                yield b'data: {"i": %d}\n\n' % i

    async def main() -> None:
        stale: asyncio.Future[Refused] = asyncio.get_running_loop().create_future()
        admitted = Admitted(1, 0.0, VersionConstraint(), 0, stale)
        release = Release(cast(VersionGate, EndsAt(1)), admitted)

        async def verify() -> None:
            return None

        async for part in restamped_stream(OneByOne(), admitted, release, verify, lambda: None):
            received.append(part)

    asyncio.run(main())
    assert asked == [0, 1, 2]
    assert (
        received[-1]
        == b'data: {"choices": [], "weight_version": {"start": 1, "end": 1, "spans": [[0, 1]]}}\n\n'
    )


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
    range_event = b'data: {"choices": [], "weight_version": {"start": 4, "end": 5, "spans": null}}'
    assert out == [b": only a comment", range_event]


@given(payloads, st.integers(0, 9), st.integers(0, 9))
def test_json_objects_gain_the_range_and_keep_everything_else(payload, start, end):
    stamped = stamp(json.dumps(payload).encode(), start, end)
    assert stamped is not None
    assert json.loads(stamped) == {**payload, "weight_version": whole(start, end)}


engine_values = (
    st.integers()
    | st.text(alphabet='a"\\{}:, weight_version', max_size=20)
    | st.fixed_dictionaries({"weight_version": st.integers(0, 9)})
    | st.fixed_dictionaries({"spans": st.just([[0, 3], [2, 4]])})
)
engine_bodies = st.dictionaries(
    st.sampled_from(["i", "text", "weight_version", "x"]), engine_values, max_size=4
)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    engine_bodies,
    st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}]),
    st.sampled_from([b"", b" \n"]),
    st.integers(3, 4),
    st.integers(4, 5),
)
def test_a_spliced_body_reads_as_the_decoded_one_would_be_stamped(body, style, space, start, end):
    """Byte splicing (the engine's field last, elsewhere, nested, named in strings; any
    layout) gives the object that decoding, editing and encoding would."""
    payload = space + json.dumps(body, **style).encode() + space
    expected = {k: v for k, v in body.items() if k != "weight_version"}
    stamped = stamp(payload, start, end)
    assert stamped is not None
    assert json.loads(stamped) == {
        **expected,
        "weight_version": version_field(start, end, body.get("weight_version")),
    }
    unstamped = stamp(payload, None, None)
    assert unstamped is not None and json.loads(unstamped) == expected


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    engine_bodies,
    engine_values | st.text(max_size=3),
    st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}, {"ensure_ascii": False}]),
)
def test_a_requests_field_cut_out_by_bytes_leaves_what_decoding_would(others, field, style):
    """The request's `weight_version` cut out of its bytes where that is sure (else None,
    and the proxy encodes the decoded rest): the same object as the decoded one without it."""
    body = {**others, "weight_version": field}
    raw = json.dumps(body, **style).encode()
    cut = cut_field(raw)
    if cut is not None:
        assert json.loads(cut) == {k: v for k, v in body.items() if k != "weight_version"}
    if raw.count(b'"weight_version"') == 1 and b"\\u" not in raw:
        assert cut is not None  # the usual request: its one field, cut by bytes


def test_non_objects_are_left_alone():
    assert stamp(b"[1, 2]", 1, 1) is None
    assert stamp(b"not json", 1, 1) is None


@given(
    st.lists(payloads, min_size=1, max_size=4),
    st.lists(st.integers(0, 10_000), max_size=4),
    st.sampled_from([None, {"start": 3, "end": 3, "spans": [[0, 3]]}]),
)
def test_a_stream_a_swap_aborts_ends_with_the_refusal_and_no_versions(events, cuts, engine_versions):
    if engine_versions is not None:  # the engine's last event: its versions must not go out either
        events = [*events[:-1], {**events[-1], "weight_version": engine_versions}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    out, released = run_stream(body, cuts, 3, 3, aborted=True)
    assert released == 0  # `StampedStream` releases, once the upstream is closed
    data = [json.loads(e[6:]) for e in out if e.startswith(b"data: ")]
    unstamped = [{k: v for k, v in e.items() if k != "weight_version"} for e in events]
    assert data == [*unstamped, {"error": GONE.error()}]
    assert GONE.error()["code"] == "WeightVersionGone" and GONE.error()["retryable"] is False


def test_the_engines_spans_are_kept_where_they_fit_the_range():
    swap = {"start": 7, "end": 8, "spans": [[0, 7], [12, 8]]}
    assert version_field(7, 8, swap) == swap
    # the swap fell before the first token: exact, and within the sidecar's range
    assert version_field(7, 8, {"start": 8, "end": 8, "spans": [[0, 8]]})["spans"] == [[0, 8]]
    assert version_field(7, 9, {"spans": [[0, 7], [3, 8], [5, 9]]})["spans"] == [[0, 7], [3, 8], [5, 9]]


@pytest.mark.parametrize(
    "reported",
    [
        None,
        "8",  # an engine's own version label, not spans
        {"spans": None},
        {"spans": []},
        {"spans": [[0, 6], [12, 8]]},  # a version outside the range
        {"spans": [[0, 7], [12, 9]]},
        {"spans": [[1, 7], [12, 8]]},  # not from the first token
        {"spans": [[0, 8], [12, 7]]},  # versions go back
        {"spans": [[0, 7], [0, 8]]},  # indices do not increase
        {"spans": [[0, 7], [12, True]]},
        {"spans": [[0, 7, 1]]},
        {"spans": [[0, "7"]]},
    ],
)
def test_spans_the_sidecar_cannot_vouch_for_are_null_or_the_one_version(reported):
    assert version_field(7, 8, reported)["spans"] is None  # the swap's place is not known
    assert version_field(7, 7, reported)["spans"] == [[0, 7]]  # one version made every token
