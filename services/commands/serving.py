"""`deltaboard engine`, `deltaboard sidecar` and `deltaboard demo`: the rollout side's
processes; and `deltaboard bench sidecar`, what the sidecar costs beside a fast engine."""

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
    device: str = typer.Option("cpu", help="Where the model runs: cpu or cuda."),
    hot: bool = typer.Option(
        False,
        "--hot",
        help="Accept versions patched into the loaded weights in place (sidecar hot path).",
    ),
) -> None:
    """Serve the reference engine: OpenAI-compatible completions over transformers."""
    import torch

    from deltaboard.services.engine.serve import serve_engine

    served = checkpoint_dir(directory, model, must_exist=False)
    torch.set_num_threads(threads)
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter("--device is cpu or cuda")
    serve_engine(
        served,
        host=host,
        port=port,
        weight_version=weight_version,
        name=name or served.resolve().name,
        device=device,
        hot=hot,
    )


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
    run_wait: float = typer.Option(
        600.0,
        min=0.0,
        help="Seconds to wait for a run that does not exist yet (its trainer creates it); a run "
        "that existed and is gone, or a token the board refuses, stops the sidecar at once.",
    ),
    hot: bool = typer.Option(
        False,
        "--hot",
        help="Put each version into the engine's weights in place (an engine started with its "
        "in-place hooks: deltaboard engine --hot, or SGLang/vLLM with deltaboard's loader); "
        "versions that cannot go in place are reloaded from disk.",
    ),
    abort_stale: bool = typer.Option(
        False,
        "--abort-stale",
        help="At a swap, abort the requests in flight that the new version breaks (an exact or "
        "max below it: 410 WeightVersionGone, or an error event ending a stream) instead of "
        "waiting for them to finish.",
    ),
    workers: str = typer.Option(
        "auto",
        help="Processes serving requests on the port; one more process runs the version loop "
        "for all of them, and /metrics totals them. auto: 2 where the sidecar may use two cores "
        "or more (a second worker shortens the time added to a first token), else 1.",
    ),
) -> None:
    """Serve the version-aware proxy in front of an engine; it runs its own follower, which
    keeps the directory at the run's head and reloads the engine."""
    from deltaboard.services.commands.failures import UserError
    from deltaboard.services.sidecar.node import Sidecar, SidecarConfig, SidecarFailed

    processes = _worker_count(workers)
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
        run_wait_s=run_wait,
        abort_stale=abort_stale,
        hot=hot,
    )
    try:
        Sidecar(config).serve(host, port, processes)
    except SidecarFailed as exc:
        raise UserError(str(exc)) from exc


def _worker_count(workers: str) -> int:
    """`--workers` of `deltaboard sidecar` and `bench sidecar`: auto (`workers.auto_workers`)
    or a number of at least 1."""
    from deltaboard.services.sidecar.workers import AUTO, auto_workers

    processes = auto_workers() if workers == AUTO else int(workers) if workers.isdigit() else 0
    if processes < 1:
        raise typer.BadParameter(f"--workers must be {AUTO} or a number of at least 1, not {workers!r}")
    return processes


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `engine`, `sidecar`, `demo` and `bench sidecar`."""
    from deltaboard.services.demo import demo

    app.command("engine")(engine)
    app.command("sidecar")(sidecar)
    app.command("demo")(demo)
    bench.command("sidecar")(bench_sidecar)


def bench_sidecar(
    quick: bool = typer.Option(False, "--quick", help="5 s per phase: under a minute."),
    duration: float | None = typer.Option(
        None,
        help="Seconds per phase (streams, paced streams, then requests; each direct, through a "
        "pass-through proxy, then through the sidecar) (default: 20; quick 5).",
    ),
    workers: str = typer.Option(
        "auto",
        help="The sidecar's worker processes, as deltaboard sidecar --workers takes them (auto, "
        "its default: what is deployed by default; the JSON's workers says how many ran).",
    ),
    swap_every: float | None = typer.Option(
        None, help="Seconds between the swaps during the run (default: 3; quick 1)."
    ),
    own_core: bool = typer.Option(
        False,
        "--own-core",
        help="Run the proxy under test (the pass-through, then the sidecar) alone on the last "
        "core, the engine and the load generator on the others, as a sidecar beside a GPU "
        "engine finds a core; --workers auto is then 1.",
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Write the figures here (default: nowhere)."),
) -> None:
    """The sidecar's cost beside a fast fake engine: the same load direct, through a proxy
    that does nothing (the floor) and through the sidecar."""
    from dataclasses import replace

    from rich.console import Console

    from deltaboard.services.bench import sidecar_bench
    from deltaboard.services.commands.progress import measured, write_report
    from deltaboard.services.sidecar.workers import AUTO

    if own_core:
        try:
            sidecar_bench.Cores.split()
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--own-core") from exc
    processes = 1 if own_core and workers == AUTO else _worker_count(workers)  # auto: on one core
    config = sidecar_bench.quick(processes) if quick else sidecar_bench.BenchConfig(workers=processes)
    config = replace(
        config,
        duration_s=duration or config.duration_s,
        swap_every_s=swap_every or config.swap_every_s,
        own_core=own_core,
    )
    console = Console()
    report = measured(console, lambda status: sidecar_bench.run(config, status))
    sidecar_bench.render(report, console)
    write_report(report, json_path, console)
