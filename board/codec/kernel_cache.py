"""Compiled kernels on disk that match the codec's sources, or none.

numba keys its disk cache on each kernel's own source file, not on what the kernel calls
or inlines, and the codec's kernels call kernels and intrinsics of other modules (the
encoders write through `bitio`'s `put_*`, the context hint runs `context.plan`, every
word loop inlines `jit`'s intrinsics). After an upgrade that changed a callee but not its
caller, numba would load the caller as it was compiled against the old callee: at best a
patch that fails its digest, at worst one that encodes differently from its decoder. So
the cache of this directory carries a stamp of every source in it, and compiled files
written under other sources are dropped before any kernel loads.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STAMP = "deltaboard-sources.sha256"


def sources_digest(sources: Iterable[Path]) -> str:
    """sha256 over the sources' names and contents, in name order."""
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def drop_stale(cache_dirs: Iterable[Path], digest: str) -> list[Path]:
    """In each existing cache directory whose stamp is not `digest`: delete numba's index and
    data files (`*.nbi`, `*.nbc`), then write the stamp (replaced whole, so a process that
    reads it sees the old stamp or the new one). Gives the directories it cleaned. A
    directory it cannot write is left as it is: numba does not use one it cannot write."""
    cleaned = []
    for directory in cache_dirs:
        stamp = directory / STAMP
        try:
            if stamp.read_text() == digest:
                continue
        except OSError:
            pass
        if not directory.is_dir():
            continue
        try:
            for pattern in ("*.nbi", "*.nbc"):
                for compiled in directory.glob(pattern):
                    compiled.unlink(missing_ok=True)
            partial = directory / f"{STAMP}.{os.getpid()}"
            partial.write_text(digest)
            partial.replace(stamp)
        except OSError:
            continue
        cleaned.append(directory)
    return cleaned


def numba_cache_dirs(module_file: Path) -> list[Path]:
    """Where numba keeps the compiled kernels of the modules next to `module_file`: the
    first of its cache locators that takes a function of that file, as numba picks one
    (`NUMBA_CACHE_DIR`, next to the sources, or the user's cache directory); next to the
    sources if numba's internals have moved."""
    try:
        from numba.core.caching import CacheImpl

        locator_classes: list[Any] = list(CacheImpl._locator_classes)
        for locator_class in locator_classes:
            locator = locator_class.from_function(numba_cache_dirs, str(module_file))
            if locator is not None:
                return [Path(locator.get_cache_path())]
        return []
    except Exception:  # a private API: fall back to numba's default place
        return [module_file.parent / "__pycache__"]


def ensure_fresh(package_dir: Path) -> None:
    """`drop_stale` for the kernels of `package_dir`, stamped with its Python sources."""
    drop_stale(numba_cache_dirs(package_dir / "jit.py"), sources_digest(package_dir.glob("*.py")))
