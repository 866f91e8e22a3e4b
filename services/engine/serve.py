"""`deltaboard engine` as a process: bind, load what the directory holds, say so, serve.

The port is bound first (`background.listen`), so a taken port fails before minutes of
loading. A directory without a checkpoint is not an error: a sidecar's follower fills it
and then asks for a reload. But an engine that said nothing looked as if it were still
loading, forever; so the startup line says what is served, and a warning says when
nothing is, and why.
"""

from __future__ import annotations

import sys
from pathlib import Path

from deltaboard.services.engine.app import EngineState, create_app
from deltaboard.services.engine.hot import HotWeights
from deltaboard.services.sidecar.background import listen, uvicorn_server


def serve_engine(
    directory: Path,
    *,
    host: str,
    port: int,
    weight_version: int | None,
    name: str,
    device: str = "cpu",
    hot: bool = False,
) -> None:
    """Serve the reference engine on `host:port` until interrupted."""
    sock = listen(host, port)
    state = EngineState(name, device=device)
    if hot:
        state.hot = HotWeights(state.slot)
    if (directory / "config.json").is_file():
        version, _ = state.reload(directory, weight_version)
        holds = f"serving {directory}" + ("" if version is None else f" as version {version}")
    else:
        why = "does not exist" if not directory.exists() else "holds no checkpoint (no config.json)"
        print(
            f"warning: {directory} {why}: the engine serves nothing (503) until POST /reload "
            "loads a checkpoint, which a sidecar does once its follower holds a version",
            file=sys.stderr,
            flush=True,
        )
        holds = "serving nothing yet"
    how = f" (on {device}" + (", hot updates in place)" if hot else ")")
    print(f"deltaboard engine {name!r} listening on http://{host}:{port}, {holds}{how}", flush=True)
    uvicorn_server(create_app(state)).run(sockets=[sock])
