"""A directory as the object store: the embedded default for one board process.

Writes go to a temporary file and are renamed into place, so a reader never sees a torn
object. Create-if-absent uses `link(2)` (atomic, fails if the name exists);
compare-and-set holds an `flock` per key, so that processes sharing the directory agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from board.storage import ObjectInfo, ObjectNotFound, PreconditionFailed


def _etag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class LocalStore:
    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self._tmp = root / ".tmp"
        self._locks = root / ".locks"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValueError(f"bad object key {key!r}")
        return self.root.joinpath(*parts)

    def _write_temp(self, data: bytes) -> Path:
        fd, name = tempfile.mkstemp(dir=self._tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return Path(name)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        lock = self._locks / hashlib.sha1(key.encode()).hexdigest()
        with open(lock, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        return data, _etag(data)

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._write_temp(data)
        try:
            if if_none_match:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailed(key) from None
            elif if_match is not None:
                with self._locked(key):
                    try:
                        current = _etag(path.read_bytes())
                    except FileNotFoundError:
                        raise PreconditionFailed(key) from None
                    if current != if_match:
                        raise PreconditionFailed(key)
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return _etag(data)

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self.root / prefix.rstrip("/") if prefix.rstrip("/") else self.root
        start = base if base.is_dir() else base.parent
        keys = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                key = (Path(dirpath) / name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        for key in sorted(keys):  # lexicographic, like S3
            info = self.stat(key)
            if info is not None:
                yield info

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def presign_download(self, key: str, expires_s: int) -> str | None:
        return None

    def presign_upload(self, key: str, sha256: str, expires_s: int) -> tuple[str, dict[str, str]] | None:
        return None
