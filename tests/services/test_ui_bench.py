"""`deltaboard bench ui` where Debian's chromium is missing: it says so in one line and
measures nothing (the page itself is tested in tests/ui, the timing is the bench's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltaboard.services.cli import build_app
from deltaboard.services.commands.failures import UserError


def test_bench_ui_says_when_chromium_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium on it
    result = CliRunner().invoke(build_app(), ["bench", "ui", "--quick", "--json", str(tmp_path / "ui.json")])
    assert isinstance(result.exception, UserError), result.output
    assert "chromium is not installed" in str(result.exception)
    assert "nothing measured" in str(result.exception)
    assert not (tmp_path / "ui.json").exists()
