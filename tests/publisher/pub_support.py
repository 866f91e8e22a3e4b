"""Helpers of the publisher tests: rebuild versions from the board, inject faults on the wire."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import httpx
import numpy as np
import torch

from deltaboard.board import codec
from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.clients.board_client import BoardClient
from deltaboard.publisher.view import rollout_view, tensor_bytes


def materialize(client: BoardClient, run: str, version: int) -> dict[str, np.ndarray]:
    """The view bytes of `version`, rebuilt by applying the chain from its keyframe
    (an independent reader: codec.apply on the manifests and blob ranges)."""
    plan = client.plan(run, None, version)
    held: dict[str, np.ndarray] = {}
    digests: dict[str, str] = {}
    for step in plan.steps:
        manifest = client.manifest(run, step.version)
        if manifest.kind == "full":
            held, digests = {}, {}
        for entry in manifest.tensors:
            patch = client.get_blob(
                run, entry.blob.sha256, entry.blob.offset, entry.blob.offset + entry.blob.length
            )
            held[entry.name] = codec.apply(held.get(entry.name), patch, digests.get(entry.name))
            digests[entry.name] = entry.digest
        assert codec.state_digest(digests.items()) == manifest.state_digest
    return held


def view_bytes(state: Mapping[str, torch.Tensor], spec: ViewSpec | None = None) -> dict[str, np.ndarray]:
    return {k: tensor_bytes(v).copy() for k, v in rollout_view(dict(state), spec or ViewSpec()).items()}


def assert_same_view(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, data in want.items():
        assert np.array_equal(got[name], data), name


Rule = Callable[[httpx.Request], httpx.Response | None]


class FaultyTransport(httpx.HTTPTransport):
    """A real transport with a hook that may answer a request itself (an injected fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.rule: Rule | None = None
        self.blob_puts = 0
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT" and "/blobs/" in request.url.path:
            with self.lock:
                self.blob_puts += 1
        rule = self.rule
        if rule is not None and (answer := rule(request)) is not None:
            return answer
        return super().handle_request(request)


def is_blob_put(request: httpx.Request) -> bool:
    return request.method == "PUT" and "/blobs/" in request.url.path


def error(status: int, code: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": "injected by the test"}})
