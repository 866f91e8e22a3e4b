"""`deltaboard bench codec`: the patch codec against the published baselines."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltaboard.services.trajectory import DEFAULT_CACHE


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `bench codec`."""

    @bench.command("codec")
    def bench_codec(
        quick: bool = typer.Option(False, "--quick", help="Fewer settings and pairs: under a minute."),
        json_path: Path | None = typer.Option(
            None, "--json", help="Write {'results': [...], 'spans': [...]} here (default: nowhere)."
        ),
        size: str = typer.Option("bench", help="Model size of the trajectories: bench (~27M) or tiny."),
        regime: list[str] = typer.Option([], help="fp32-master and/or bf16 (default: both)."),
        lr: list[float] = typer.Option([], help="Learning rates (default 1e-6 3e-6; quick 1e-6)."),
        k: list[int] = typer.Option([], help="Version distances (default 1 8 32; quick 1 4)."),
        pairs: int | None = typer.Option(
            None, help="Version pairs per setting, medians over them (default: 4; quick 2)."
        ),
        warmup: int | None = typer.Option(
            None, help="Warm-up steps at 1e-3 before the measured steps (default: 16; quick 6)."
        ),
        encoding: list[str] = typer.Option(
            [],
            help="Encodings (default: full coo32 pulse xor-zstd deltaboard; also deltaboard-sparse).",
        ),
        cache: Path = typer.Option(DEFAULT_CACHE, help="Where trajectories are kept between runs."),
        view: str = typer.Option(
            "bf16",
            help="bf16: every encoding on the cached bf16 views; fp8: the FP8 block-scaled view "
            "against the bf16 view of the same fp32-master steps (trained in the run).",
        ),
        scale: str = typer.Option("amax", help="With --view fp8: the block scale rule, amax or ue8m0."),
    ) -> None:
        """Bits per changed element, throughput and exactness of every encoding (--view fp8:
        what the FP8 view's deltas cost against the bf16 view's)."""
        from dataclasses import asdict, replace

        from rich.console import Console
        from rich.progress import Progress

        from deltaboard.services.bench import codec_bench
        from deltaboard.services.bench.baselines import ENCODINGS, VARIANTS
        from deltaboard.services.trajectory import REGIMES

        config = codec_bench.QUICK if quick else codec_bench.BenchConfig()
        bad = [r for r in regime if r not in REGIMES]
        if bad:
            raise typer.BadParameter(f"unknown regime {bad}; choose from {REGIMES}")
        known = ENCODINGS + VARIANTS
        if any(e not in known for e in encoding):
            raise typer.BadParameter(f"unknown encoding in {encoding}; choose from {known}")
        config = replace(
            config,
            size=size,
            cache=cache,
            regimes=tuple(r for r in REGIMES if r in regime) or config.regimes,
            lrs=tuple(lr) or config.lrs,
            ks=tuple(k) or config.ks,
            pairs=pairs or config.pairs,
            warmup_steps=config.warmup_steps if warmup is None else warmup,
            encodings=tuple(encoding) or config.encodings,
        )
        if view not in ("bf16", "fp8"):
            raise typer.BadParameter("view must be bf16 or fp8", param_hint="'--view'")
        if scale not in ("amax", "ue8m0"):
            raise typer.BadParameter("scale must be amax or ue8m0", param_hint="'--scale'")
        console = Console()
        if not console.is_terminal:  # logs and pipes: keep the table's columns readable
            console = Console(width=200)
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("starting", total=None)

            def progress(what: str, done: int, total: int) -> None:
                bar.update(task, description=what, completed=done, total=total)

            if view == "fp8":
                records = codec_bench.run_fp8(config, scale, progress)
            else:
                report = codec_bench.run(config, progress)
        if view == "fp8":
            codec_bench.render_fp8(records, console)
            figures: dict[str, object] = {"fp8": [asdict(r) for r in records]}
        else:
            codec_bench.render(report, console)
            figures = report.to_json()
        if json_path is not None:
            json_path.write_text(json.dumps(figures, indent=2))
            console.print(f"wrote {json_path}")
