"""The compaction worker's loop: spans for every head the board's event stream announces.

Stateless: everything it holds (a follower directory at the oldest base it needs) can be
rebuilt from the board, so it may be killed at any instant and any number may run. A span
becomes visible only through the board's registration, after its blob is uploaded and its
digests checked against the committed manifests, and registration is create-if-absent: a
kill leaves at most an unreferenced blob (retention collects it), and racing workers leave
one span. The event stream coalesces heads that land faster than spans are built, so a
slow worker builds for the latest head rather than queueing behind.
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

log = logging.getLogger("deltaboard.compact")

RETRY_S = 2.0


def compact_head(builder: SpanBuilder, head: int) -> int:
    """Build and register the spans ending at `head`; returns how many this call stored."""
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
    return stored


def run_worker(client: BoardClient, run: str, directory: Path, node_id: str, stop: threading.Event) -> None:
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
                            compact_head(builder, head.version)
                        except (PatchError, FollowerError, InvalidRequest) as exc:
                            # the chain or this worker's copy is wrong: no span from it
                            log.error("no spans to %d: %s", head.version, exc)
                        done = head.version
            except (BoardUnavailable, httpx.HTTPError) as exc:
                log.warning("board unreachable (%s): retrying in %.0f s", exc, RETRY_S)
                stop.wait(RETRY_S)
