"""The compaction worker's loop: spans for every head the board's event stream announces,
and a keyframe when a new node would otherwise start too far back (`keyframes`).

Stateless: everything it holds (a follower directory at the last head, the window of
decoded deltas) can be rebuilt from the board, so it may be killed at any instant and any
number may run. A span or keyframe becomes visible only through the board's registration,
after its blob is uploaded and its digests checked against the committed manifests, and
registration is create-if-absent: a kill leaves at most an unreferenced blob (retention
collects it), and racing workers leave one. The event stream coalesces heads that land
faster than spans are built, so a slow worker builds for the latest head rather than
queueing behind.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx

from deltaboard.board.codec import PatchError
from deltaboard.board.contract.errors import BoardUnavailable, InvalidRequest
from deltaboard.clients.board_client import BoardClient
from deltaboard.clients.follower import Follower, FollowerError
from deltaboard.services.compact.build import SpanBuilder
from deltaboard.services.compact.keyframes import KEYFRAME_EVERY, build_keyframe, keyframe_due

log = logging.getLogger("deltaboard.compact")

RETRY_S = 2.0


def compact_head(builder: SpanBuilder, head: int, keyframe_every: int = 0) -> int:
    """Build and register the spans ending at `head`, and its keyframe when one is due
    (`keyframe_every` > 0); returns how many spans and keyframes this call stored."""
    client, run = builder.client, builder.run
    stored = 0
    for span, blob in builder.build(head):
        if span.tensors:
            client.upload_blob(run, blob)
        registered = client.register_span(run, span)
        stored += registered.created
        log.info(
            "span %d -> %d: %d bytes%s",
            span.from_version,
            span.to_version,
            len(blob),
            "" if registered.created else " (already there)",
        )
    if keyframe_every and keyframe_due(builder, head, keyframe_every):
        stored += keyframe_head(builder, head)
    return stored


def keyframe_head(builder: SpanBuilder, head: int) -> int:
    """Build and register the keyframe of `head` (the builder's copy is at head); 1 if
    this call stored it."""
    keyframe, blob = build_keyframe(builder, head)
    builder.client.upload_blob(builder.run, blob)
    registered = builder.client.register_keyframe(builder.run, keyframe)
    log.info("keyframe %d: %d bytes%s", head, len(blob), "" if registered.created else " (already there)")
    return int(registered.created)


def run_worker(
    client: BoardClient,
    run: str,
    directory: Path,
    node_id: str,
    stop: threading.Event,
    keyframe_every: int = KEYFRAME_EVERY,
) -> None:
    """Follow the run's commits until `stop` is set, building the spans of each new head.
    Board and network trouble is logged and retried; a refused token or a gone run is
    raised; a head whose spans cannot be built or are refused is logged and passed."""
    with (
        Follower(client, run, directory, node_id=node_id, engine="compact") as follower,
        SpanBuilder(client, run, follower) as builder,
    ):
        done: int | None = None
        while not stop.is_set():
            try:
                for head in client.events(run):
                    if stop.is_set():
                        return
                    if head.version is not None and head.version != done:
                        try:
                            compact_head(builder, head.version, keyframe_every)
                        except (PatchError, FollowerError, InvalidRequest) as exc:
                            # the chain or this worker's copy is wrong: no span from it
                            log.error("no spans to %d: %s", head.version, exc)
                        done = head.version
            except (BoardUnavailable, httpx.HTTPError) as exc:
                log.warning("board unreachable (%s): retrying in %.0f s", exc, RETRY_S)
                stop.wait(RETRY_S)
