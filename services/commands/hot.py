"""`deltaboard bench update`: the hot path against disk-based updates, in one run."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `bench update`."""

    @bench.command("update")
    def bench_update(
        quick: bool = typer.Option(
            False, "--quick", help="A smaller view and fewer versions: under a minute."
        ),
        device: str = typer.Option("cpu", help="Where the engine's weights live: cpu or cuda."),
        view_gb: float | None = typer.Option(
            None, help="Size of the bf16 view in GB (default: 1 on cpu, 8 on cuda)."
        ),
        tensors: int | None = typer.Option(None, help="Tensors the view is cut into (default: 256)."),
        many_tensors: int = typer.Option(
            0, help="Also run the same bytes in this many tensors (an MoE-shaped view, e.g. 20000)."
        ),
        versions: int | None = typer.Option(
            None, help="Versions measured, medians over them (default: 4; quick 2)."
        ),
        json_path: Path | None = typer.Option(
            None, "--json", help="Write the figures here (default: nowhere)."
        ),
    ) -> None:
        """From a commit to the engine serving it: hot path, disk slot + reload, full reload."""
        from dataclasses import replace

        from rich.console import Console

        from deltaboard.services.bench import update_bench
        from deltaboard.services.commands.progress import measured, write_report

        if device not in ("cpu", "cuda"):
            raise typer.BadParameter("--device is cpu or cuda")
        config = update_bench.quick(device) if quick else update_bench.BenchConfig(device=device)
        if not quick and device == "cuda":
            config = replace(config, view_gb=8.0)
        config = replace(
            config,
            view_gb=view_gb or config.view_gb,
            tensors=tensors or config.tensors,
            versions=versions or config.versions,
        )
        console = Console()
        report = measured(
            console, lambda status: update_bench.run_shapes(config, many_tensors, status), timestamped=True
        )
        update_bench.render(report, console)
        write_report(report, json_path, console)
