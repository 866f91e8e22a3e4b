"""`deltaboard publish DIR --run R` and `deltaboard bench publish`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltaboard.services.commands.options import (
    board_option,
    checkpoint_dir,
    dir_option,
    elapsed,
    hidden_argument,
    token_option,
)

DEFAULT_CACHE = Path.home() / ".cache" / "deltaboard" / "publish"


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `publish` and `bench publish`."""

    @app.command("publish")
    def publish(
        directory: Path | None = dir_option("A Hugging Face checkpoint directory of safetensors files."),
        positional: Path | None = hidden_argument(),
        run: str = typer.Option(..., "--run", help="The run to publish to (created if absent)."),
        board: str = board_option(),
        token: str | None = token_option("publish"),
        dtype: str = typer.Option("bf16", help="Served dtype of floating tensors: bf16, fp16 or fp32."),
        keyframe_every: int = typer.Option(50, help="A keyframe whenever version % K == 0."),
        cache: Path = typer.Option(
            DEFAULT_CACHE, help="Where the previous version's view is kept (a follower directory per run)."
        ),
    ) -> None:
        """Publish the directory as the run's next version: a delta against the previous one."""
        from deltaboard.board.contract.schemas import ViewSpec
        from deltaboard.clients.board_client import BoardClient
        from deltaboard.services.commands.progress import BYTES, Bars, make_console

        source = checkpoint_dir(directory, positional, must_exist=True)
        if dtype not in ("bf16", "fp16", "fp32"):
            raise typer.BadParameter("dtype must be bf16, fp16 or fp32", param_hint="'--dtype'")
        console = make_console()
        with BoardClient(board, token) as client:
            # The run is created as the publisher would create it, but first: a board that is
            # down or a token it refuses is said at once, not after reading the checkpoint.
            client.create_run(run)
            from deltaboard.publisher.checkpoint_dir import publish_directory  # torch: seconds

            with Bars(console) as bars:
                # The upload's size is known only once the delta is encoded: the bar counts up.
                bars.phase("upload", f"publishing {source} to {run} (bytes uploaded)", BYTES, None)
                result = publish_directory(
                    source,
                    client,
                    run,
                    spec=ViewSpec(default_dtype=dtype),
                    cache_dir=cache / run,
                    keyframe_every=keyframe_every,
                    on_uploaded=lambda n: bars.advance("upload", n),
                    cache_progress=bars.follower(f"cache of {run}: "),
                )
        console.print(
            f"[bold]{run}[/] version {result.version} ({result.kind}): {result.changed_elements:,} of "
            f"{result.total_elements:,} elements changed, {result.encoded_bytes:,} bytes uploaded "
            f"(done in {elapsed():.2f} s)"
        )

    @bench.command("publish")
    def bench_publish(
        quick: bool = typer.Option(False, "--quick", help="A 62.5 MB view: under a minute on 2 cores."),
        json_path: Path | None = typer.Option(
            None, "--json", help="Write the figures here (default: nowhere)."
        ),
        view_gb: float | None = typer.Option(
            None, help="Size of the bf16 view in GB (default: 1; quick 0.0625)."
        ),
        link_gbit: list[float] = typer.Option([], help="Emulated link speeds in Gbit/s (default 1 10)."),
        device: str = typer.Option("cpu", help="Where the trainer's tensors live: cpu or cuda."),
        throughput: bool = typer.Option(
            False,
            "--throughput",
            help="Only snapshot + diff throughput on --device (no board, no link): the fused pass and "
            "the torch reference, without and with context hints, against a device copy; views of "
            "--view-gb (default 1, 8 and 32 on CUDA, 0.25 on CPU) and a model-shaped list of tensors.",
        ),
        tensors: int | None = typer.Option(
            None,
            min=1,
            help="Cut the view into N equal tensors and compare with the same bytes in "
            "256 (deltas only, first link); e.g. 20000 for an MoE-like model (default: off).",
        ),
        ranks: int | None = typer.Option(
            None, min=2, help="N gloo ranks on CPU publish row slices, against one rank (default: off)."
        ),
    ) -> None:
        """Deltas vs full checkpoints of a bf16 view through a board across an emulated link
        (--ranks N: sharded publishing, per rank)."""
        from dataclasses import replace

        from rich.console import Console

        from deltaboard.services.bench import publish_bench
        from deltaboard.services.commands.progress import measured, write_report

        console = Console()
        if ranks is not None:
            from deltaboard.services.bench import publish_ranks

            base = publish_ranks.QUICK_RANKS if quick else publish_ranks.RanksConfig()
            sharded = replace(base, ranks=ranks, view_mb=1e3 * view_gb if view_gb else base.view_mb)
            with console.status("starting") as status:
                figures = publish_ranks.run_ranks(sharded, status.update)
            publish_ranks.render_ranks(figures, console)
            if json_path is not None:
                json_path.write_text(json.dumps(figures, indent=2))
            return
        if throughput:
            on_cuda = device.startswith("cuda")
            sizes = (view_gb,) if view_gb else (1.0, 8.0, 32.0) if on_cuda else (0.25,)
            with console.status("measuring"):
                figures = publish_bench.throughput(sizes, view_gb or (8.0 if on_cuda else 0.25), device)
            publish_bench.render_throughput(figures, console)
            if json_path is not None:
                json_path.write_text(json.dumps(figures, indent=2))
            return
        config = publish_bench.QUICK if quick else publish_bench.BenchConfig()
        config = replace(
            config,
            view_gb=view_gb or config.view_gb,
            links_gbit=tuple(link_gbit) or config.links_gbit,
            device=device,
            tensors=tensors,
        )
        if tensors is None:
            report = measured(console, lambda status: publish_bench.run(config, status))
            publish_bench.render(report, console)
        else:
            report = measured(console, lambda status: publish_bench.run_shapes(config, status))
            publish_bench.render_shapes(report, console)
        write_report(report, json_path, console)
