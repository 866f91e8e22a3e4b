"""`deltaboard engine`, `deltaboard sidecar` and `deltaboard demo`: the rollout side's processes."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from deltaboard.services.commands.options import (
    board_option,
    checkpoint_dir,
    dir_option,
    hidden_alias,
    token_option,
)


def engine(
    directory: Path | None = dir_option(
        "The Hugging Face checkpoint directory to serve (may be empty until a reload)."
    ),
    model: Path | None = hidden_alias("--model"),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    weight_version: int | None = typer.Option(
        None, help="The version the directory holds at start, if known (default: none).", show_default=False
    ),
    name: str | None = typer.Option(
        None, help="Model name reported by the API (default: the directory's name).", show_default=False
    ),
    threads: int = typer.Option(1, help="torch CPU threads (1: several engines do not fight over cores)."),
) -> None:
    """Serve the reference engine: OpenAI-compatible completions over transformers on CPU."""
    import torch
    import uvicorn

    from deltaboard.services.engine.app import EngineState, create_app

    served = checkpoint_dir(directory, model, must_exist=False)
    torch.set_num_threads(threads)
    state = EngineState(name or served.resolve().name)
    if (served / "config.json").is_file():
        state.reload(served, weight_version)
    uvicorn.run(create_app(state), host=host, port=port, log_level="warning")


def sidecar(
    board: str = board_option(),
    run: str = typer.Option(..., "--run", help="The run to follow."),
    directory: Path | None = dir_option(
        "The checkpoint directory the sidecar's own follower keeps (no other follower may hold it)."
    ),
    engine_url: str = typer.Option(..., "--engine", help="The engine's base URL."),
    engine_kind: str = typer.Option("reference", "--engine-kind", help="reference, sglang or vllm."),
    mode: str = typer.Option("quiesce", help="Commit mode: quiesce (drain, swap) or in_place (pause, swap)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8100, help="Port to listen on."),
    node_id: str | None = typer.Option(
        None, help="This node's id in the board's fleet (default: the host name).", show_default=False
    ),
    token: str | None = token_option("read"),
    default_wait: float = typer.Option(30.0, help="Seconds a constrained request waits by default."),
    max_wait: float = typer.Option(300.0, help="Upper bound on any request's wait, in seconds."),
    poll: float = typer.Option(5.0, min=0.1, max=60.0, help="Seconds per long-poll of the board's head."),
) -> None:
    """Serve the version-aware proxy in front of an engine; it runs its own follower, which
    keeps the directory at the run's head and reloads the engine."""
    import uvicorn

    from deltaboard.services.sidecar.node import Sidecar, SidecarConfig

    if engine_kind not in ("reference", "sglang", "vllm"):
        raise typer.BadParameter("--engine-kind must be reference, sglang or vllm")
    if mode not in ("quiesce", "in_place"):
        raise typer.BadParameter("--mode must be quiesce or in_place")
    config = SidecarConfig(
        board_url=board,
        run=run,
        directory=checkpoint_dir(directory, None, must_exist=False),
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
