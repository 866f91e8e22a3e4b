"""The engine adapter port and the HTTP plumbing every adapter shares.

A version swap, as the sidecar drives it, is `pause(mode)`, then the follower's swap on
disk, then `reload(model_dir, version, mode)`, then `resume(mode)`. Each call is told the
swap's mode; an adapter remembers nothing between them. In `quiesce` mode the sidecar has
already drained its requests, so adapters need not pause the engine, and they drop the
prefix cache after the reload (its KV was computed with the old weights); in `in_place`
mode requests are still running and the engine must hold them between two steps while
the weights change under them, keeping their cache.

Adapters are synchronous (httpx.Client): they run on the follower's thread, never on
the proxy's event loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import httpx

CommitMode = Literal["quiesce", "in_place"]


class EngineAdapterError(RuntimeError):
    """The engine refused or failed a control call (or could not be reached)."""


class EngineAdapter:
    kind = "abstract"

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
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

    def holds(self, version: int) -> bool:
        """Whether the engine still serves `version` (False after it restarted empty).

        Engines that cannot say are taken at their health check: an engine that went
        away and came back is reloaded once it answers again.
        """
        return self.healthy()

    def pause(self, mode: CommitMode) -> None:
        """Hold generation for an in-place swap (a drained engine needs nothing)."""
        if mode == "in_place":
            self._hold()

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> None:
        """Load `version` from `model_dir`; after a `quiesce` swap, also drop stale caches."""
        raise NotImplementedError

    def resume(self, mode: CommitMode) -> None:
        """Undo `pause`."""
        if mode == "in_place":
            self._release()

    def _hold(self) -> None:
        """The engine's route that holds running generations between two steps."""
        raise NotImplementedError

    def _release(self) -> None:
        """The engine's route that lets held generations go on."""
        raise NotImplementedError
