"""The public face: what `import deltaboard` offers, and that nothing else of ours lands at
the top of site-packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import deltaboard

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = [
    "BlobIntegrityError",
    "BoardClient",
    "BoardError",
    "BoardUnavailable",
    "Conflict",
    "CorruptBase",
    "DeltaboardCallback",
    "DirectoryError",
    "Follower",
    "FollowerError",
    "Forbidden",
    "IntegrityError",
    "InvalidRequest",
    "LeaseHeld",
    "NotFound",
    "NotHead",
    "PatchError",
    "Publisher",
    "StaleEpoch",
    "Unauthorized",
    "UnknownBase",
    "UnknownRun",
    "UnknownVersion",
    "ViewSpec",
    "__version__",
]


def test_all_is_pinned() -> None:
    assert deltaboard.__all__ == EXPECTED


def test_every_public_name_resolves_to_its_own_name() -> None:
    for name in deltaboard.__all__:
        value = getattr(deltaboard, name)
        if name != "__version__":
            assert value.__name__ == name
            assert value.__module__.startswith("deltaboard.")


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        deltaboard.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("deltaboard.NoSuchThing resolved")


def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    """Build the wheel as `pip install .` does, install it alone into a folder, and import
    from there outside the checkout: only `deltaboard` exists, with real files (the links
    in deltaboard/ are followed), and the role folders are not importable on their own."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("deltaboard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"deltaboard"}
    assert "deltaboard/board/codec/api.py" in names
    # The dashboard's static files (`/ui`) ship as package data, with the vendored library's licence.
    ui = {"index.html", "app.js", "app.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"}
    assert {f"deltaboard/board/server/ui/{name}" for name in ui} <= set(names)
    assert not any(name.startswith("deltaboard/tests/") for name in names)

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import deltaboard\n"
        "assert deltaboard.__file__.startswith(sys.argv[1]), deltaboard.__file__\n"
        "from deltaboard import Publisher, Follower, BoardClient, BoardError, ViewSpec\n"
        "for name in ('board', 'clients', 'publisher', 'services'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(f'{name} is importable at the top level')\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(target)], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
