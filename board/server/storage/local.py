"""A directory as the object store: the embedded default for one board process.

Writes go to a temporary file and are renamed into place, so a reader never sees a torn
object; with `fsync` (the default) plain objects are synced before and their directory
after the rename, so a crash keeps both the bytes and the name. Create-if-absent uses
`link(2)` (atomic, fails if the name exists). Compare-and-set on a record holds its lock
file's `flock`, so that processes sharing the directory agree. A record's version tag is
a generation number that only grows, so a tag never comes back even when the same bytes
are written again; each write also puts it in the lock file, rewritten in place at a
fixed width: truncating the file first would make ext4 flush it (its `auto_da_alloc`
heuristic), a millisecond on every commit.

Records are made durable by their run's commit log (`commit_log`): the writes of a
group (a commit's manifest and head) are appended to it in one synced data write, then
written to their files without a sync; opening the directory replays the logs over the
files, and the files are synced before a log starts over (`_checkpoint`: when it is
full, before a record it names is deleted, after a replay). A group too large for its
log is made durable where it lands: every record but the last synced (bytes and name at
once), then the last.

Records other than manifests (head.json, lease.json: read only as records) are slotted
files (`slots`), rewritten in place; their tag is their current slot's. Manifests stay
whole files, their tag the lock file's number: they are read as plain objects too
(`get`, by retention and listings). A record a store before slots wrote whole is read as
it is and becomes slotted at its next write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deltaboard.board.server.storage import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    commit_log,
    manifest_version,
    slots,
)
from deltaboard.board.server.storage.commit_log import LOG_BYTES, CommitLog, LoggedWrite

GENERATION_WIDTH = 20  # digits: a generation number never outgrows it
# Beside the caller's own: a checkpoint (or a group too large for its log) syncs files and
# folders at once.
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


def log_scope(key: str) -> str:
    """What shares a commit log: a run's records (`runs/<run>`), or for other keys their
    top folder. A group of records written together is one run's (a commit's manifest
    and head)."""
    parts = key.split("/")
    return "/".join(parts[:2] if parts[0] == "runs" else parts[:1])


@dataclass(frozen=True)
class _Pending:
    """A record write whose compare-and-set passed: its new tag, its current slots (where
    it is a slotted file) and its lock file's descriptor, locked."""

    key: str
    data: bytes
    tag: int
    slotted: slots.Slotted | None
    lock: int


def _write_at(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset` (a write to a regular file is cut short only by an error
    or a signal, but may be)."""
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)


class LocalStore:
    def __init__(self, root: Path, *, fsync: bool = True, log_bytes: int = LOG_BYTES) -> None:
        self.root = root
        self.fsync = fsync
        self._tmp = root / ".tmp"
        self._locks = root / ".locks"
        self._commits = root / ".commits"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)
        remove_stale_files(self._tmp)
        self._syncers: ThreadPoolExecutor | None = None
        self._log_bytes = log_bytes
        self._logs: dict[str, CommitLog] = {}
        self._logs_guard = threading.Lock()
        self._replay()

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
    def _lock_file(self, key: str) -> Iterator[int]:
        """The descriptor of the record's lock file, which also holds the record's
        generation number."""
        lock = self._locks / hashlib.sha1(key.encode()).hexdigest()
        # Not O_APPEND: the generation is rewritten in place with pwrite.
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _record(self, key: str, exclusive: bool) -> Iterator[int]:
        """The record's lock file's descriptor, locked. Plain descriptors here and in
        `_read_file`: a commit's store work runs in a thread that takes the GIL back after
        each system call, which waits for the event loop to let it go when the loop is
        busy, so every call it does not make is a wait it does not have."""
        with self._lock_file(key) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

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
        tags = self._write([(key, data, expected)])
        if not tags:
            raise PreconditionFailed(key)
        return tags[0]

    def write_records(self, writes: Sequence[tuple[str, bytes, str | None]]) -> int:
        """Each record's expected tag is checked with its lock taken, in order, up to the
        first that loses; those that passed are made durable together, in one entry of
        their run's log, and only then set: a later record (the head) never points at
        bytes that could be lost, and a group written is never half durable."""
        return len(self._write(writes))

    def _write(self, writes: Sequence[tuple[str, bytes, str | None]]) -> list[str]:
        """The tags of the records written: the first ones of `writes`, up to the first
        that loses its compare-and-set."""
        with contextlib.ExitStack() as held:
            pending: list[_Pending] = []
            for key, data, expected in writes:
                try:
                    pending.append(self._set_record(key, data, expected, held=held))
                except PreconditionFailed:
                    break
            if pending:
                self._make_durable(pending)
            return [str(p.tag) for p in pending]

    def _set_record(
        self, key: str, data: bytes, expected: str | None, *, held: contextlib.ExitStack
    ) -> _Pending:
        """Compare-and-set, first half: the record's lock taken (and kept in `held` until
        the group is written) and its tag checked; returns the write to make."""
        lock = held.enter_context(self._record(key, exclusive=True))
        found = self._stored(key, lock)
        if (expected is None) != (found is None) or (found is not None and expected != str(found[1])):
            raise PreconditionFailed(key)
        # A new number even for the same bytes: a tag never comes back (no ABA). The lock
        # file's number may lag a slot's after a power loss (it is not synced).
        tag = max(self._generation(lock), 0 if found is None else found[1]) + 1
        return _Pending(key, data, tag, None if found is None else found[2], lock)

    def _make_durable(self, pending: list[_Pending]) -> None:
        """Set the records, durable on return (with `fsync`): logged in one entry where
        their log holds it, else synced where they land."""
        if not self.fsync:
            self._set_all(pending, sync=False)
            return
        log = self._log_of(pending[0].key, create=True)
        assert log is not None
        if any(self._log_of(p.key, create=False) is not log for p in pending[1:]):
            raise ValueError("records written together must belong to one run")
        body = commit_log.encode([LoggedWrite(p.key, p.tag, p.data) for p in pending])
        with log.locked():
            if log.holds(body):
                if not log.fits(body):
                    self._checkpoint(log)
                log.append(body)
                self._set_all(pending, sync=False)
                return
            # A manifest the log names would be set again by a replay, over the newer
            # bytes: the log is emptied first. (A slot's tag keeps a replay off it.)
            named = {w.key for entry in log.entries() for w in entry}
            if any(p.key in named and not in_place(p.key) for p in pending):
                self._checkpoint(log)
        *earlier, last = pending
        self._set_all(earlier, sync=False)
        if earlier:
            self._sync_all(
                list(dict.fromkeys(p for w in earlier for p in (self._path(w.key), self._path(w.key).parent)))
            )
        self._set_all([last], sync=True)

    def _set_all(self, pending: list[_Pending], *, sync: bool) -> None:
        for p in pending:
            self._put_record(p.key, p.data, p.tag, p.slotted, sync=sync)
            os.pwrite(p.lock, str(p.tag).zfill(GENERATION_WIDTH).encode(), 0)

    def _put_record(
        self, key: str, data: bytes, tag: int, slotted: slots.Slotted | None, *, sync: bool
    ) -> None:
        """Write the record's other slot in place where it is a slotted file with room,
        else rename a new file onto it; with `sync`, durable on return."""
        path = self._path(key)
        if slotted is not None and slotted.fits(data):
            self._write_slot(path, *slotted.rewrite(tag, data), sync=sync)
        else:
            self._replace(path, slots.new_file(tag, data) if in_place(key) else data, sync=sync)

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

    # ---- the commit logs ---------------------------------------------------------------

    def _log_of(self, key: str, *, create: bool) -> CommitLog | None:
        """The log of the run `key` belongs to (`log_scope`); None where it has none and
        `create` is false."""
        name = hashlib.sha1(log_scope(key).encode()).hexdigest()
        with self._logs_guard:
            log = self._logs.get(name)
        if log is not None or not (create or (self._commits / name).exists()):
            return log
        # Opened outside the guard: making a log writes its zeros, which another run's
        # commit must not wait for.
        opened = CommitLog(self._commits / name, self._log_bytes)
        with self._logs_guard:
            log = self._logs.setdefault(name, opened)
        if log is not opened:
            opened.close()
        return log

    def _checkpoint(self, log: CommitLog) -> None:
        """Sync the files of every record the log names (each file and its folder, at
        once), then start the log over. (Called with the log locked: no entry is added,
        and no logged record set, meanwhile.)"""
        keys = sorted({w.key for entry in log.entries() for w in entry})
        paths = [p for key in keys for p in (self._path(key), self._path(key).parent)]
        existing = [p for p in dict.fromkeys(paths) if p.exists()]  # a plain delete may have taken one
        if existing and self.fsync:
            self._sync_all(existing)
        log.start_over()

    def _replay(self) -> None:
        """Set every record the logs hold where its file lacks it (the files are written
        without a sync, so a power cut may have lost them, or torn a slot), in the logs'
        order, then checkpoint. Run with each log locked but no record's lock: a process
        appending to a log takes its records' locks first, and every write it logged is
        set before it lets the log go."""
        if not self._commits.is_dir():
            return
        for entry in sorted(os.listdir(self._commits)):
            if entry.startswith("."):
                continue  # a log being made
            log = CommitLog(self._commits / entry, self._log_bytes)
            try:
                with log.locked():
                    entries = log.entries()
                    for write in (w for e in entries for w in e):
                        self._restore(write)
                    if entries:
                        self._checkpoint(log)
            finally:
                log.close()  # opened again by the run's next write: a descriptor per run written

    def _restore(self, write: LoggedWrite) -> None:
        """Set a logged write unless its file holds it or a later one."""
        with self._lock_file(write.key) as lock:
            found = self._stored(write.key, lock)
            if found is not None and (
                found[1] >= write.tag if found[2] is not None else found[0] == write.data
            ):
                return
            self._put_record(
                write.key, write.data, write.tag, None if found is None else found[2], sync=False
            )
            os.pwrite(lock, str(max(write.tag, self._generation(lock))).zfill(GENERATION_WIDTH).encode(), 0)

    def close(self) -> None:
        with self._logs_guard:
            logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            with log.locked():
                if not log.empty:
                    self._checkpoint(log)
            log.close()
        if self._syncers is not None:
            self._syncers.shutdown()
            self._syncers = None  # an app started again on this store makes another

    def delete_record(self, key: str) -> None:
        """A record its log names is synced first (with every other the log names): a
        replay would set it again."""
        with self._record(key, exclusive=True):
            log = self._log_of(key, create=False)
            if log is not None:
                with log.locked():
                    if not log.empty:
                        self._checkpoint(log)
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
