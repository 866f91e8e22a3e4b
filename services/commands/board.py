"""`deltaboard board serve` and `deltaboard bench board`.

Every flag defaults to None so that unset flags fall through to the DELTABOARD_*
environment and then to the defaults of `board.settings.Settings`. Imports are lazy: the
CLI must start without FastAPI, boto3 or torch loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from deltaboard.services.commands.failures import UserError

if TYPE_CHECKING:
    from deltaboard.board.server.settings import Settings

SCOPES = "read, publish or admin"


def setting(what: str, default: str) -> Any:
    """A flag that, unset, falls through to DELTABOARD_<FLAG> and then to `default`."""
    return typer.Option(None, help=f"{what} (default: {default})", show_default=False)


def check_tokens(specs: str) -> None:
    """Say in one line what is wrong with a `scope:token[:run-glob]` the board would refuse
    (the board itself reports it as a validation error of the token grant)."""
    from pydantic import ValidationError

    from deltaboard.board.server.auth import AuthConfig

    for spec in filter(None, (s.strip() for s in specs.split(","))):
        scope, colon, rest = spec.partition(":")
        if not colon:
            raise UserError(f"a token needs its scope: --token SCOPE:TOKEN, with SCOPE one of {SCOPES}")
        try:
            AuthConfig.parse_grants([spec])
        except ValidationError as exc:
            for error in exc.errors():
                if error["loc"] == ("scope",):
                    raise UserError(f"unknown token scope {scope!r}: use {SCOPES}") from exc
                if error["type"] == "string_too_short":
                    need, length = error["ctx"]["min_length"], len(rest.partition(":")[0])
                    raise UserError(
                        f"tokens need at least {need} characters; the {scope} token has {length}"
                    ) from exc
            raise


def warn_without_tokens(settings: Settings) -> None:
    """A board without tokens refuses every publish (and every read, unless reads are
    anonymous): almost certainly not what the person starting it meant."""
    from deltaboard.board.server.auth import AuthConfig

    config = AuthConfig.load(settings.auth_config) if settings.auth_config else AuthConfig()
    if not config.tokens and not settings.tokens.strip():
        refused = "every publish" if settings.anonymous_read or config.anonymous_read else "every request"
        typer.secho(
            f"warning: no tokens: the board refuses {refused}; add --token publish:TOKEN "
            "(and read:TOKEN for the rollout nodes)",
            fg="yellow",
            err=True,
        )


def announce_when_listening(settings: Settings) -> None:
    """Print the board's URL once the board answers on it (its own `/healthz`, recognised
    by the instance nonce): a URL printed before would promise a board that may never come
    up (a port taken, a store out of reach)."""
    import threading
    import time

    import httpx

    host = settings.host
    probe = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    url, probe_url = (f"http://{f'[{h}]' if ':' in h else h}:{settings.port}" for h in (host, probe))

    def wait() -> None:
        while True:
            try:
                if httpx.get(f"{probe_url}/healthz", timeout=1.0).json().get("instance") == settings.instance:
                    typer.echo(f"deltaboard board listening on {url} (data {settings.data_dir})")
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.05)

    threading.Thread(target=wait, name="announce", daemon=True).start()


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `board serve` to the app and `board` to `bench`."""
    board = typer.Typer(no_args_is_help=True, help="The bulletin board server.")
    app.add_typer(board, name="board")

    @board.command("serve")
    def serve(
        data_dir: Path | None = setting("Data directory (local store, temp uploads).", "./deltaboard-data"),
        host: str | None = setting("Address to listen on.", "127.0.0.1"),
        port: int | None = setting("Port to listen on.", "8080"),
        store: str | None = setting(
            "s3://bucket/prefix: an S3 store.", "a local store in the data directory"
        ),
        s3_endpoint: str | None = setting("S3 endpoint URL (SeaweedFS, MinIO, ...).", "AWS's"),
        s3_public_endpoint: str | None = setting(
            "S3 endpoint in the presigned URLs clients get.", "the S3 endpoint"
        ),
        s3_region: str | None = setting("S3 region.", "us-east-1"),
        redis: str | None = setting(
            "redis://host:port/db: a shared index for several replicas.", "an in-process index"
        ),
        auth_config: Path | None = setting("Token file (YAML or JSON).", "none"),
        token: list[str] | None = setting(
            f"scope:token[:run-glob], repeatable; scope is {SCOPES}, a token has at least 8 characters.",
            "none",
        ),
        anonymous_read: bool | None = typer.Option(
            None,
            "--anonymous-read/--no-anonymous-read",
            help="Let requests without a token read every run (default: no).",
            show_default=False,
        ),
        log_level: str | None = setting("debug, info, warning or error.", "warning"),
    ) -> None:
        """Serve the board (embedded defaults: local directory, in-process index,
        127.0.0.1:8080). Each flag can also be set as DELTABOARD_<FLAG> (DELTABOARD_PORT,
        DELTABOARD_TOKENS comma-separated, ...)."""
        import secrets

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
        check_tokens(settings.tokens)
        warn_without_tokens(settings)
        if not settings.instance:
            settings = settings.model_copy(update={"instance": secrets.token_hex(8)})
        from deltaboard.board.server.api import serve as serve_board  # FastAPI: after the checks

        announce_when_listening(settings)
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

    @bench.command("ui")
    def bench_ui(
        quick: bool = typer.Option(False, "--quick", help="100 versions and 20 nodes, one page load."),
        json_path: Path | None = typer.Option(
            None, "--json", help="Write the figures here (default: nowhere)."
        ),
        versions: int | None = typer.Option(
            None, min=1, help="Versions published (default: 1000; quick 100)."
        ),
        nodes: int | None = typer.Option(None, min=0, help="Nodes reporting (default: 200; quick 20)."),
    ) -> None:
        """The dashboard's first render in headless Chromium with a long run and a large fleet."""
        import json
        from dataclasses import replace

        from rich.console import Console

        from deltaboard.services.bench import ui_bench

        config = ui_bench.QUICK if quick else ui_bench.BenchConfig()
        config = replace(
            config,
            versions=config.versions if versions is None else versions,
            nodes=config.nodes if nodes is None else nodes,
        )
        console = Console()
        try:
            with console.status("starting") as status:
                report = ui_bench.run(config, lambda what: status.update(what))
        except ui_bench.NoBrowser as exc:
            raise UserError(str(exc)) from exc
        ui_bench.render(report, console)
        if json_path is not None:
            json_path.write_text(json.dumps(report, indent=2))
            console.print(f"wrote {json_path}")
