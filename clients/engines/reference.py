"""Adapter for deltaboard's reference engine (`deltaboard engine`).

Routes (see `deltaboard.services.engine.app`): `POST /pause`, `POST /reload {"model",
"weight_version"}` (answers the new `weight_version` and `loads`), `POST /resume`,
`GET /health` (`weight_version`, `loads`). The engine counts every load, and stamps every
response with the headers `X-Engine-Weight-Version` / `X-Engine-Load-Count`, so a
foreign load between two of the sidecar's own shows, even under the same version number.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from deltaboard.clients.engines.base import CommitMode, EngineAdapter, EngineStamp

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
