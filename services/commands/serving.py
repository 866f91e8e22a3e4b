"""`deltaboard engine`, `deltaboard sidecar` and `deltaboard demo`: the rollout side's processes."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def engine(
    model: Path = typer.Option(
        ..., "--model", help="Hugging Face checkpoint directory (may be empty until a reload)"
    ),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
    weight_version: int | None = typer.Option(
        None, help="the version the directory holds at start, if known"
    ),
    name: str | None = typer.Option(
        None, help="model name reported by the API (default: the directory name)"
    ),
    threads: int = typer.Option(
        1, help="torch CPU threads (1 keeps several engines from fighting over cores)"
    ),
) -> None:
    """Serve the reference engine: OpenAI-compatible completions over transformers on CPU."""
    import torch
    import uvicorn

    from deltaboard.services.engine.app import EngineState, create_app

    torch.set_num_threads(threads)
    state = EngineState(name or model.resolve().name)
    if (model / "config.json").is_file():
        state.reload(model, weight_version)
    uvicorn.run(create_app(state), host=host, port=port, log_level="warning")


def sidecar(
    board: str = typer.Option(..., "--board", help="board URL"),
    run: str = typer.Option(..., "--run", help="run name"),
    directory: Path = typer.Option(..., "--dir", help="the follower's checkpoint directory"),
    engine_url: str = typer.Option(..., "--engine", help="engine base URL"),
    engine_kind: str = typer.Option("reference", "--engine-kind", help="reference, sglang or vllm"),
    mode: str = typer.Option("quiesce", help="commit mode: quiesce (drain, swap) or in_place (pause, swap)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8100, help="port to listen on"),
    node_id: str | None = typer.Option(None, help="node id in the board's fleet (default: host name)"),
    token: str | None = typer.Option(None, envvar="DELTABOARD_TOKEN", help="board read token"),
    default_wait: float = typer.Option(30.0, help="seconds a constrained request waits by default"),
    max_wait: float = typer.Option(300.0, help="upper bound on any request's wait"),
    poll: float = typer.Option(5.0, min=0.1, max=60.0, help="seconds per long-poll of the board's head"),
) -> None:
    """Serve the version-aware proxy in front of an engine, following the run's versions."""
    import uvicorn

    from deltaboard.services.sidecar.node import Sidecar, SidecarConfig

    if engine_kind not in ("reference", "sglang", "vllm"):
        raise typer.BadParameter("--engine-kind must be reference, sglang or vllm")
    if mode not in ("quiesce", "in_place"):
        raise typer.BadParameter("--mode must be quiesce or in_place")
    config = SidecarConfig(
        board_url=board,
        run=run,
        directory=directory,
        engine_url=engine_url,
        engine_kind=engine_kind,
        mode="quiesce" if mode == "quiesce" else "in_place",
        token=token,
        node_id=node_id or os.uname().nodename,
        default_wait_s=default_wait,
        max_wait_s=max_wait,
        poll_s=poll,
    )
    uvicorn.run(Sidecar(config).app, host=host, port=port, log_level="warning")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `engine`, `sidecar` and `demo`."""
    from deltaboard.services.demo import demo

    app.command("engine")(engine)
    app.command("sidecar")(sidecar)
    app.command("demo")(demo)
