"""Adapter for deltaboard's reference engine (`deltaboard engine`).

Routes (see `deltaboard.services.engine.app`): `POST /pause`, `POST /reload {"model",
"weight_version"}` (answers the new `weight_version` and `loads`), `POST /resume`,
`GET /health` (`weight_version`, `loads`), and with `deltaboard engine --hot` the in-place
path: `POST /weights/stage {"patch", "weight_version"}`, `POST /weights/commit
{"weight_version"}` (answers the stamp and `pause_ms`). The engine counts every load, and stamps every
response with the headers `X-Engine-Weight-Version` / `X-Engine-Load-Count`, so a
foreign load between two of the sidecar's own shows, even under the same version number.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from deltaboard.clients.engines.base import (
    CommitMode,
    EngineAdapter,
    EngineAdapterError,
    EngineStamp,
    HotCommitted,
    HotRefused,
)

VERSION_HEADER = "X-Engine-Weight-Version"
LOADS_HEADER = "X-Engine-Load-Count"


class ReferenceAdapter(EngineAdapter):
    kind = "reference"
    counts_loads = True

    def _hold(self) -> None:
        self._call("POST", "/pause")

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> EngineStamp:
        # The reference engine holds no KV cache: both modes reload the same way.
        answer = self._call("POST", "/reload", json={"model": str(model_dir), "weight_version": version})
        return self.parse_stamp(answer.json())

    def stamp_of(self, headers: Mapping[str, str]) -> EngineStamp | None:
        loads = headers.get(LOADS_HEADER)
        if loads is None or not loads.isdigit():
            return None
        return EngineStamp(headers.get(VERSION_HEADER), int(loads))

    def _release(self) -> None:
        self._call("POST", "/resume")

    def stage_patch(self, patch: Path, version: int) -> None:
        self._hot_call("/weights/stage", {"patch": str(patch), "weight_version": version})

    def commit_patch(self, version: int, mode: CommitMode) -> HotCommitted:
        # The engine holds its forward passes for the swap itself, in either mode.
        answer = self._hot_call("/weights/commit", {"weight_version": version})
        return HotCommitted(self.parse_stamp(answer), float(answer["pause_ms"]))

    def _hot_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineAdapterError(f"reference engine at {self.url}: POST {path}: {exc}") from exc
        if response.status_code in (404, 409):  # not started with --hot; or it refused the patch
            raise HotRefused(f"reference engine at {self.url}: POST {path} -> {response.text[:300]}")
        if response.status_code >= 400:
            raise EngineAdapterError(f"reference engine at {self.url}: POST {path} -> {response.status_code}")
        answer: dict[str, Any] = response.json()
        return answer
