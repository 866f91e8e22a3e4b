"""Adapter for deltaboard's reference engine (`deltaboard engine`).

Routes (see `deltaboard.services.engine.app`): `POST /pause`, `POST /reload {"model", "weight_version"}`,
`POST /resume`, `GET /health`.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from deltaboard.clients.engines.base import CommitMode, EngineAdapter


class ReferenceAdapter(EngineAdapter):
    kind = "reference"

    def _hold(self) -> None:
        self._call("POST", "/pause")

    def reload(self, model_dir: Path, version: int, mode: CommitMode) -> None:
        # The reference engine holds no KV cache: both modes reload the same way.
        self._call("POST", "/reload", json={"model": str(model_dir), "weight_version": version})

    def holds(self, version: int) -> bool:
        try:
            health = self._http.get(self.health_path, timeout=2.0)
            return health.status_code == 200 and health.json().get("weight_version") == version
        except (httpx.HTTPError, ValueError):
            return False

    def _release(self) -> None:
        self._call("POST", "/resume")
