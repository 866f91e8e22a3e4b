"""`deltaboard bench quantize`: the FP8 block quantizer's cost on the trainer's device."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `bench quantize`."""

    @bench.command("quantize")
    def bench_quantize(
        device: str = typer.Option("cpu", help="Where the view lives: cpu or cuda."),
        view_gb: float | None = typer.Option(
            None, "--view-gb", help="Size of the bf16 view in GB (default: 8 on cuda, 0.25 on cpu)."
        ),
        repeats: int = typer.Option(5, min=1, help="Timed runs per path, the median reported."),
        json_path: Path | None = typer.Option(
            None, "--json", help="Write the figures here (default: nowhere)."
        ),
    ) -> None:
        """Quantizing a model-shaped bf16 view to FP8 with 128x128 block scales: the Triton
        kernel and the torch reference (checked bit for bit), against the memory floor."""
        from rich.console import Console
        from rich.table import Table

        from deltaboard.services.bench.quantize_bench import quantize_throughput

        if device not in ("cpu", "cuda"):
            raise typer.BadParameter("device must be cpu or cuda", param_hint="'--device'")
        figures = quantize_throughput(view_gb or (8.0 if device == "cuda" else 0.25), device, repeats)
        table = Table(title=f"FP8 block quantize, {figures['view_gb']:.2f} GB bf16 view on {device}")
        for column in ("rule", "path", "ms", "bit-exact", "tensors quantized"):
            table.add_column(column)
        for row in figures["results"]:
            exact = {True: "yes", False: "NO"}.get(row.get("bit_exact"), "-")
            table.add_row(row["rule"], row["path"], f"{row['ms']:.2f}", exact, str(row["quantized_tensors"]))
        console = Console()
        console.print(table)
        console.print(
            f"floor: one read of the view and one write of its codes at {figures['copy_gbps']:.0f} GB/s "
            f"(device copy, read + write) = {figures['floor_ms']:.2f} ms"
        )
        if json_path is not None:
            json_path.write_text(json.dumps(figures, indent=2) + "\n")
