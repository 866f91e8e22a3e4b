"""Commands of this role (filled in by the role's issue)."""

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this role's commands to the top-level app and to `bench`."""
