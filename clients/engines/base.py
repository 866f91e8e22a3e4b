"""The engine adapter port and the HTTP plumbing every adapter shares.

A version swap, as the sidecar drives it, is `pause(mode)`, then the follower's swap on
disk, then `reload(model_dir, version, mode)`, then `resume(mode)`. Each call is told the
swap's mode; an adapter remembers nothing between them. In `quiesce` mode the sidecar has
already drained its requests, so adapters need not pause the engine, and they drop the
prefix cache after the reload (its KV was computed with the old weights); in `in_place`
mode requests are still running and the engine must hold them between two steps while
the weights change under them, keeping their cache.

With `hot`, a version can instead go into the engine's weights in place: the sidecar
writes the verified changes to a patch file (`clients.resident`), `stage_patch` has the
engine stage it while it generates, and `commit_patch` swaps it in between two forward
passes, all or nothing (`HotRefused`: the engine keeps what it served, and the sidecar
loads the version from disk instead).

An adapter also says what the sidecar may show clients and how to tell what the engine
holds:

- `inference_routes`: the (method, path) pairs the sidecar proxies; every other route of
  the engine (its reload and pause controls above all) stays out of clients' reach;
- `EngineStamp`: what the engine reports it holds, read from `stamp_path` (`loaded()`),
  returned by `reload`, and, for engines that stamp their responses, read from a
  response's headers (`stamp_of`). The sidecar compares it with what it loaded itself
  before it stamps a response with a version.

Adapters are synchronous (httpx.Client): they run on the follower's thread, never on
the proxy's event loop (the proxy asks `stamp_path` with its own client).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx

CommitMode = Literal["quiesce", "in_place"]
Route = tuple[str, str]

# What every OpenAI-compatible engine serves for inference.
OPENAI_ROUTES: frozenset[Route] = frozenset(
    {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")}
)


class EngineAdapterError(RuntimeError):
    """The engine refused or failed a control call (or could not be reached)."""


@dataclass(frozen=True)
class EngineStamp:
    """What an engine reports it holds. Equal stamps mean the same load as far as the
    engine can say: `loads` (a counter of loads, where the engine keeps one) tells two
    loads of one version apart; `source` (the path it loaded, where it reports one) tells
    weights from another directory under the same version label apart."""

    version: str | None
    loads: int | None = None
    source: str | None = None

    def follows(self, previous: EngineStamp | None) -> bool:
        """Whether this can be the load right after `previous`: with a counter, exactly one
        more; without one nothing can be told, so yes."""
        if previous is None or self.loads is None or previous.loads is None:
            return True
        return self.loads == previous.loads + 1


class HotRefused(EngineAdapterError):
    """The engine would not take a version in place and still serves the one it had:
    load the version from disk instead."""


@dataclass(frozen=True)
class HotCommitted:
    """A version swapped in place: what the engine holds now, and how long it could not
    generate (None where the engine does not say)."""

    stamp: EngineStamp
    pause_ms: float | None


class EngineAdapter:
    kind = "abstract"
    inference_routes: ClassVar[frozenset[Route]] = OPENAI_ROUTES
    # The GET route that reports what the engine holds, as a JSON object with its
    # `weight_version`, a load counter `loads` where `counts_loads`, and the path it loaded
    # under `source_field` where it reports one.
    stamp_path: ClassVar[str] = "/health"
    counts_loads: ClassVar[bool] = False
    source_field: ClassVar[str | None] = None

    def __init__(self, url: str, timeout_s: float = 600.0, *, hot: bool = False) -> None:
        self.hot = hot  # the engine was started with this adapter's in-place hooks
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def _call(
        self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None
    ) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise EngineAdapterError(f"{self.kind} engine at {self.url}: {method} {path}: {exc}") from exc
        if response.status_code >= 400:
            answer = f"{response.status_code} {response.text[:300]}"
            raise EngineAdapterError(f"{self.kind} engine at {self.url}: {method} {path} -> {answer}")
        return response

    health_path = "/health"

    def healthy(self) -> bool:
        try:
            return self._http.get(self.health_path, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def parse_stamp(self, body: Any) -> EngineStamp:
        """The stamp in the engine's answer to `stamp_path` (ValueError if there is none)."""
        if not isinstance(body, dict):
            raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        loads = body.get("loads")
        if self.counts_loads and not isinstance(loads, int):
            raise ValueError("no load counter ('loads') in the answer")
        version = body.get("weight_version")
        return EngineStamp(
            None if version is None else str(version),  # a number or a string, by engine
            loads if self.counts_loads else None,
            None if self.source_field is None else body.get(self.source_field),
        )

    def stamp_of(self, headers: Mapping[str, str]) -> EngineStamp | None:
        """The stamp a response carries in its headers; None: this engine stamps no
        responses, ask `stamp_path`."""
        return None

    def loaded(self) -> EngineStamp:
        """What the engine says it holds now."""
        answer = self._call("GET", self.stamp_path)
        try:
            return self.parse_stamp(answer.json())
        except ValueError as exc:
            raise EngineAdapterError(
                f"{self.kind} engine at {self.url}: GET {self.stamp_path}: {exc}"
            ) from exc

    def pause(self, mode: CommitMode) -> None:
        """Hold generation for an in-place swap (a drained engine needs nothing)."""
        if mode == "in_place":
            self._hold()

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> EngineStamp:
        """Load `version` from `model_dir`; after a `quiesce` swap, also drop stale caches.
        Returns what the engine holds afterwards."""
        raise NotImplementedError

    def resume(self, mode: CommitMode) -> None:
        """Undo `pause`."""
        if mode == "in_place":
            self._release()

    # ---- the hot path: versions patched in place (`hot`) -------------------------------

    def stage_patch(self, patch: Path, version: int) -> None:
        """Have the engine stage the patch file `patch` (it takes the served version to
        `version`) while it keeps generating; `HotRefused` if it will not."""
        raise HotRefused(f"the {self.kind} adapter has no in-place path")

    def commit_patch(self, version: int, mode: CommitMode) -> HotCommitted:
        """Swap the staged `version` in between two forward passes (in `quiesce` mode the
        sidecar has drained its requests); `HotRefused` leaves the served version."""
        raise HotRefused(f"the {self.kind} adapter has no in-place path")

    def discard_patch(self) -> None:
        """Forget what was staged (best effort)."""

    def _held(self, mode: CommitMode, swap: Callable[[], None]) -> float:
        """Run `swap` with the engine's running requests held between two steps (`in_place`;
        a drained engine needs nothing); the milliseconds it could not generate."""
        started = time.perf_counter()
        if mode == "in_place":
            self._hold()
        try:
            swap()
        finally:
            if mode == "in_place":
                self._release()
        return (time.perf_counter() - started) * 1e3

    def _hold(self) -> None:
        """The engine's route that holds running generations between two steps."""
        raise NotImplementedError

    def _release(self) -> None:
        """The engine's route that lets held generations go on."""
        raise NotImplementedError
