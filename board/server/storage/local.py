"""A directory as the object store: the embedded default for one board process.

Writes go to a temporary file and are renamed into place, so a reader never sees a torn
object; with `fsync` (the default) the file is synced before and its directory after the
rename, so a crash keeps both the bytes and the name (records written together,
`write_records`, sync all but the last just after their renames, at once).
Create-if-absent uses `link(2)` (atomic, fails if the name exists). Compare-and-set on a
record holds its lock file's `flock`, so that processes sharing the directory agree. A
record's version tag is a generation number that only grows, so a tag never comes back
even when the same bytes are written again; each write also puts it in the lock file,
rewritten in place at a fixed width: truncating the file first would make ext4 flush it
(its `auto_da_alloc` heuristic), a millisecond on every commit.

Records other than manifests (head.json, lease.json: read only as records) are slotted
files (`slots`), rewritten in place; their tag is their current slot's, which is durable
with its bytes. Manifests stay whole files, their tag the lock file's number: they are
read as plain objects too (`get`, by retention and listings). A record a store before
slots wrote whole is read as it is and becomes slotted at its next write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deltaboard.board.server.storage import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    manifest_version,
    slots,
)

GENERATION_WIDTH = 20  # digits: a generation number never outgrows it
# Beside the caller's own: a commit's first round syncs its manifest and that one's folder.
SYNC_THREADS = 1
# A temporary file untouched for this long belongs to a write that died with its process
# (a live write touches it every few milliseconds; a stalled upload is cut off in seconds).
STALE_TEMP_S = 3600.0


def remove_stale_files(directory: Path, older_than_s: float = STALE_TEMP_S) -> int:
    """Delete the files in `directory` not modified for `older_than_s` (leftovers of a
    crash; another process sharing the directory may still be writing fresh ones)."""
    cutoff = time.time() - older_than_s
    removed = 0
    for entry in os.scandir(directory):
        with contextlib.suppress(FileNotFoundError):
            if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
                removed += 1
    return removed


def in_place(key: str) -> bool:
    """Whether the record at `key` is a slotted file: every record but manifests."""
    return manifest_version(key) is None


def _write_at(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset` (a write to a regular file is cut short only by an error
    or a signal, but may be)."""
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)


class LocalStore:
    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self._tmp = root / ".tmp"
        self._locks = root / ".locks"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)
        remove_stale_files(self._tmp)
        self._syncers: ThreadPoolExecutor | None = None

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValueError(f"bad object key {key!r}")
        return self.root.joinpath(*parts)

    def _write_temp(self, data: bytes, *, sync: bool = True) -> Path:
        fd, name = tempfile.mkstemp(dir=self._tmp)
        try:
            _write_at(fd, data, 0)
            if self.fsync and sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return Path(name)

    @staticmethod
    def _sync_file(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sync_dir(self, directory: Path) -> None:
        """Make a rename or link in `directory` durable: without it a crash can lose the new
        name even though the file's bytes were synced (POSIX keeps the two apart)."""
        if self.fsync:
            self._sync_file(directory)

    def _sync_all(self, paths: list[Path]) -> None:
        """fsync the files and directories concurrently: their flushes share journal
        commits instead of queueing one behind the other."""
        if self._syncers is None:
            self._syncers = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="deltaboard-fsync")
        pending = [self._syncers.submit(self._sync_file, p) for p in paths[1:]]
        self._sync_file(paths[0])
        for future in pending:
            future.result()

    @contextlib.contextmanager
    def _record(self, key: str, exclusive: bool) -> Iterator[int]:
        """The record's lock file's descriptor, locked: the file also holds the record's
        generation number. Plain descriptors here and in `_read_file`: a commit's store
        work runs in a thread that takes the GIL back after each system call, which waits
        for the event loop to let it go when the loop is busy, so every call it does not
        make is a wait it does not have."""
        lock = self._locks / hashlib.sha1(key.encode()).hexdigest()
        # Not O_APPEND: the generation is rewritten in place with pwrite.
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @staticmethod
    def _generation(lock: int) -> int:
        text = os.pread(lock, GENERATION_WIDTH + 1, 0).strip()
        return int(text) if text.isdigit() else 0

    @staticmethod
    def _read_file(path: Path) -> bytes:
        """The file's bytes in one read where it does not grow meanwhile (a regular file's
        read comes back short only at its end)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size + 1)
            if len(data) == size:
                return data
            chunks = [data]  # it changed size, or is beyond one read's limit
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        try:
            return self._read_file(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None

    def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._write_temp(data)
        try:
            if if_none_match:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailed(key) from None
            else:
                os.replace(tmp, path)
            self._sync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def _stored(self, key: str, lock: int) -> tuple[bytes, int, slots.Slotted | None] | None:
        """The record's bytes and tag, with its slots where it is a slotted file; None when
        absent. (Called with the record's lock held.)"""
        try:
            raw = self._read_file(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        # A manifest is never read as slots: its bytes are the publisher's, which could
        # hold a valid slot where the second one would begin.
        slotted = slots.read(raw) if in_place(key) else None
        if slotted is None:
            return raw, self._generation(lock), None
        return slotted.data, slotted.tag, slotted

    def read_record(self, key: str) -> tuple[bytes, str] | None:
        with self._record(key, exclusive=False) as lock:
            found = self._stored(key, lock)
            return None if found is None else (found[0], str(found[1]))

    def write_record(self, key: str, data: bytes, expected: str | None) -> str:
        return self._set_record(key, data, expected)

    def write_records(self, writes: Sequence[tuple[str, bytes, str | None]]) -> int:
        """Every record but the last is set, then made durable (its bytes and its name, at
        once), and only then is the last set: a later record (the head) never points at
        bytes that could be lost. A commit waits for two rounds of syncs: its manifest's
        file and directory, then the head's slot, rewritten in place (`slots`), which
        commits nothing to the filesystem's journal. A record set but not yet synced when
        the machine loses power is one above the head, which the next commit of that
        version replaces."""
        if not writes:
            return 0
        *earlier, (last_key, last_data, last_expected) = writes
        durable: list[Path] = []
        for written, (key, data, expected) in enumerate(earlier):
            try:
                self._set_record(key, data, expected, sync=False)
            except PreconditionFailed:
                return written
            durable += [self._path(key), self._path(key).parent]
        if self.fsync and durable:
            self._sync_all(list(dict.fromkeys(durable)))
        try:
            self._set_record(last_key, last_data, last_expected)
        except PreconditionFailed:
            return len(earlier)
        return len(writes)

    def _set_record(self, key: str, data: bytes, expected: str | None, *, sync: bool = True) -> str:
        """Compare-and-set: write the record's other slot in place where it is a slotted
        file with room, else rename a new file onto it; with `sync`, durable on return."""
        path = self._path(key)
        with self._record(key, exclusive=True) as lock:
            found = self._stored(key, lock)
            if (expected is None) != (found is None) or (found is not None and expected != str(found[1])):
                raise PreconditionFailed(key)
            # A new number even for the same bytes: a tag never comes back (no ABA). The
            # lock file's number may lag a slot's after a power loss (it is not synced).
            tag = max(self._generation(lock), 0 if found is None else found[1]) + 1
            slotted = None if found is None else found[2]
            if slotted is not None and slotted.fits(data):
                self._write_slot(path, *slotted.rewrite(tag, data), sync=sync)
            else:
                whole = slots.new_file(tag, data) if in_place(key) else data
                self._replace(path, whole, sync=sync)
            os.pwrite(lock, str(tag).zfill(GENERATION_WIDTH).encode(), 0)
        return str(tag)

    def _write_slot(self, path: Path, offset: int, data: bytes, *, sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _write_at(fd, data, offset)
            if self.fsync and sync:
                os.fdatasync(fd)  # the file's size and blocks stay: no metadata to commit
        finally:
            os.close(fd)

    def _replace(self, path: Path, data: bytes, *, sync: bool) -> None:
        """Put a new file with `data` at `path` (with `sync`, its bytes and name durable)."""
        tmp = self._write_temp(data, sync=sync)
        try:
            try:
                os.replace(tmp, path)
            except FileNotFoundError:  # the first record in its folder
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, path)
            if sync:
                self._sync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def delete_record(self, key: str) -> None:
        with self._record(key, exclusive=True):
            self.delete(key)

    def put_file(self, key: str, path: Path) -> None:
        """The file's bytes are synced before its rename, as `put`'s are: a commit syncs
        only its manifest and the head, so the blobs a manifest names must be durable
        from their upload on."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        if self.fsync:
            self._sync_file(path)
        os.replace(path, target)
        self._sync_dir(target.parent)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self.root / prefix.rstrip("/") if prefix.rstrip("/") else self.root
        if not base.is_dir() and prefix.endswith("/"):
            return  # a folder that does not exist holds nothing: do not walk its parent
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
