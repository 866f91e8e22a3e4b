"""`deltaboard board serve` and `deltaboard bench board`.

Every flag defaults to None so that unset flags fall through to the DELTABOARD_*
environment and then to the defaults of `board.settings.Settings`. Imports are lazy: the
CLI must start without FastAPI, boto3 or torch loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `board serve` to the app and `board` to `bench`."""
    board = typer.Typer(no_args_is_help=True, help="The bulletin board server.")
    app.add_typer(board, name="board")

    @board.command("serve")
    def serve(
        data_dir: Path | None = typer.Option(None, help="Data directory (local store, temp uploads)."),
        host: str | None = typer.Option(None, help="Bind address [127.0.0.1]."),
        port: int | None = typer.Option(None, help="Port [8080]."),
        store: str | None = typer.Option(
            None, help="s3://bucket/prefix (default: local store in the data dir)."
        ),
        s3_endpoint: str | None = typer.Option(None, help="S3 endpoint URL (SeaweedFS, MinIO, ...)."),
        s3_public_endpoint: str | None = typer.Option(None, help="S3 endpoint for presigned URLs (clients)."),
        s3_region: str | None = typer.Option(None, help="S3 region."),
        redis: str | None = typer.Option(
            None, help="redis://host:port/db: shared index for several replicas."
        ),
        auth_config: Path | None = typer.Option(None, help="Token file (YAML or JSON)."),
        token: list[str] | None = typer.Option(None, help="scope:token[:run-glob], repeatable."),
        anonymous_read: bool | None = typer.Option(None, "--anonymous-read/--no-anonymous-read"),
        log_level: str | None = typer.Option(None, help="debug, info, warning [warning]."),
    ) -> None:
        """Serve the board (embedded defaults: local directory, in-process index, 127.0.0.1:8080)."""
        from deltaboard.board.server.api import serve as serve_board
        from deltaboard.board.server.settings import Settings

        given: dict[str, Any] = {
            "data_dir": data_dir,
            "host": host,
            "port": port,
            "store": store,
            "s3_endpoint": s3_endpoint,
            "s3_public_endpoint": s3_public_endpoint,
            "s3_region": s3_region,
            "redis": redis,
            "auth_config": auth_config,
            "tokens": ",".join(token) if token else None,
            "anonymous_read": anonymous_read,
            "log_level": log_level,
        }
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
        typer.echo(f"deltaboard board on http://{settings.host}:{settings.port} (data {settings.data_dir})")
        serve_board(settings)

    @bench.command("board")
    def bench_board(
        quick: bool = typer.Option(False, "--quick", help="A shorter run (under a minute)."),
        json_path: Path | None = typer.Option(
            None, "--json", help="Also write the figures to this JSON file."
        ),
        pollers: int = typer.Option(1000, min=1, help="Concurrent long-pollers woken by one commit."),
        mixed: bool = typer.Option(
            False, "--mixed", help="Pollers, blob downloaders and a commit per second at once."
        ),
        downloaders: int = typer.Option(16, min=0, help="With --mixed: concurrent blob downloaders."),
    ) -> None:
        """Long-poll wake latency, head requests/s, commit latency, blob download GB/s; with
        --mixed, wake and commit latency while blobs are downloaded (mixed_* keys)."""
        if mixed:
            from deltaboard.services.bench.board_mixed import run_mixed_bench

            run_mixed_bench(quick, pollers, downloaders, json_path)
            return
        from deltaboard.services.bench.board_bench import run_board_bench

        run_board_bench(quick, pollers, json_path)
