"""Compiled kernels written under other codec sources are dropped before any loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deltaboard.board.codec import kernel_cache


def _cache_of(tmp_path: Path) -> tuple[Path, list[Path]]:
    sources = tmp_path / "codec"
    sources.mkdir()
    for name, text in (("jit.py", "def f(): return 1\n"), ("bitio.py", "def g(): return 2\n")):
        (sources / name).write_text(text)
    cache = sources / "__pycache__"
    cache.mkdir()
    names = ("bitio.put-10.py312.nbi", "bitio.put-10.py312.1.nbc", "jit.cpython-312.pyc")
    return sources, [cache / name for name in names]


def _touch(paths: list[Path]) -> None:
    for p in paths:
        p.write_bytes(b"compiled")


def test_a_changed_source_drops_every_compiled_kernel_once(tmp_path):
    sources, (index, data, pyc) = _cache_of(tmp_path)
    _touch([index, data, pyc])
    digest = kernel_cache.sources_digest(sources.glob("*.py"))
    assert kernel_cache.drop_stale([sources / "__pycache__"], digest) == [sources / "__pycache__"]
    assert not index.exists() and not data.exists() and pyc.exists()  # numba's files only
    _touch([index, data])  # compiled again under these sources: kept from now on
    assert kernel_cache.drop_stale([sources / "__pycache__"], digest) == []
    assert index.exists() and data.exists()
    (sources / "bitio.py").write_text("def g(): return 3\n")  # a callee changed, not its caller
    changed = kernel_cache.sources_digest(sources.glob("*.py"))
    assert changed != digest
    assert kernel_cache.drop_stale([sources / "__pycache__"], changed) == [sources / "__pycache__"]
    assert not index.exists() and not data.exists()


def test_a_missing_cache_directory_is_left_alone(tmp_path):
    assert kernel_cache.drop_stale([tmp_path / "absent"], "0" * 64) == []
    assert not (tmp_path / "absent").exists()


def test_the_codec_stamps_the_directory_numba_uses(tmp_path):
    """Importing the codec with NUMBA_CACHE_DIR set stamps that cache with the digest of the
    codec's sources, where numba itself will look."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    script = (
        "from pathlib import Path\n"
        "from deltaboard.board.codec import jit, kernel_cache\n"
        "here = Path(jit.__file__).parent\n"
        "(d,) = kernel_cache.numba_cache_dirs(here / 'jit.py')\n"
        "print(d)\n"
        "print((d / kernel_cache.STAMP).read_text() == kernel_cache.sources_digest(here.glob('*.py')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    directory, fresh = out.stdout.split()
    assert Path(directory).is_relative_to(tmp_path)
    assert fresh == "True"
