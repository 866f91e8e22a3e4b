"""The local store's commit log: record writes made durable by one data write each.

A record written where it lands is durable only once its file and its directory are
synced, and the directory's sync (a new manifest's name) waits for a journal commit of
the filesystem, which queues behind every other writer of the disk: that was the tail
of a commit. Here a group of record writes (a commit's manifest and head, with their new
tags) is first appended to a log file whose blocks were all written when it was made
(zeros, synced), by one `pwritev` with `RWF_DSYNC`: a write inside blocks a file already
owns changes no metadata, so it costs the disk one data write and a cache flush, and the
thread one system call. The records are then written to their own files without a sync;
a store that opens the directory replays the log over them, so a write the log holds is
never lost. Once the files are synced (a checkpoint), the log starts over.

An entry is a header line, `deltaboard/log/v1 <nonce:016x> <seq:020d> <length:010d>
<body crc32:08x> <header crc32:08x>\\n`, and its body: each write as `<tag:020d> <key
length:010d> <data length:010d>\\n`, the key and the data. Entries follow one another
from offset 0 with consecutive sequence numbers under one nonce. A log that starts over
zeroes its first header (synced) and takes a new random nonce, so that entries of an
earlier round, still on the disk further on, are never read as this round's. An entry
torn by a power cut fails its checksum: neither it nor what follows is part of the log
(its write had not returned, so no one was told it was durable).

Processes sharing the store's directory share its logs: an `flock` orders their appends,
and each one, on taking it, checks that the log still ends where it left it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import tempfile
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_MAGIC = b"deltaboard/log/v1"
LOG_BYTES = 4 << 20  # each log's size, written once; an entry over a quarter of it is not logged
_HEADER = len(LOG_MAGIC) + 1 + 16 + 1 + 20 + 1 + 10 + 1 + 8 + 1 + 8 + 1
_WRITE_LINE = 20 + 1 + 10 + 1 + 10 + 1
_ZEROS = 1 << 20


@dataclass(frozen=True)
class LoggedWrite:
    """One record write as the log holds it: the record's key, its new tag and bytes."""

    key: str
    tag: int
    data: bytes


@dataclass(frozen=True)
class _Header:
    nonce: int
    seq: int
    length: int
    body_crc: int


def _header(nonce: int, seq: int, body: bytes) -> bytes:
    line = b"%s %016x %020d %010d %08x " % (LOG_MAGIC, nonce, seq, len(body), zlib.crc32(body))
    return line + b"%08x\n" % zlib.crc32(line)


def _parse_header(raw: bytes) -> _Header | None:
    """The header's fields; None where there is none (zeros, a torn or stale write)."""
    fields = raw[: _HEADER - 1].split(b" ")
    if len(raw) != _HEADER or len(fields) != 6 or fields[0] != LOG_MAGIC or raw[-1:] != b"\n":
        return None
    if b"%08x" % zlib.crc32(raw[: _HEADER - 9]) != fields[5]:
        return None
    return _Header(int(fields[1], 16), int(fields[2]), int(fields[3]), int(fields[4], 16))


def encode(writes: Sequence[LoggedWrite]) -> bytes:
    """An entry's body."""
    return b"".join(
        b"%020d %010d %010d\n%s%s" % (w.tag, len(w.key.encode()), len(w.data), w.key.encode(), w.data)
        for w in writes
    )


def decode(body: bytes) -> list[LoggedWrite]:
    writes, at = [], 0
    while at < len(body):
        tag, key_length, data_length = (int(f) for f in body[at : at + _WRITE_LINE - 1].split(b" "))
        at += _WRITE_LINE
        key = body[at : at + key_length].decode()
        writes.append(LoggedWrite(key, tag, body[at + key_length : at + key_length + data_length]))
        at += key_length + data_length
    return writes


def _write_durably(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset`, on the disk when this returns (a regular file's write is
    cut short only by an error or a signal, but may be)."""
    written = 0
    while written < len(data):
        written += os.pwritev(fd, [data[written:]], offset + written, os.RWF_DSYNC)


def _open_log(path: Path, size: int) -> int:
    """The log's descriptor, the file made first where it is missing: `size` bytes of
    zeros written and synced, then linked into place with its directory synced (another
    process may make it at the same time: the first link wins)."""
    with contextlib.suppress(FileNotFoundError):
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=".new-")
    try:
        for offset in range(0, size, _ZEROS):
            os.pwrite(fd, bytes(min(_ZEROS, size - offset)), offset)
        os.fsync(fd)
        with contextlib.suppress(FileExistsError):
            os.link(name, path)
    finally:
        os.close(fd)
        os.unlink(name)
    directory = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


class CommitLog:
    """One log file. `append`, `entries` and `start_over` are called inside `locked()`."""

    def __init__(self, path: Path, size: int = LOG_BYTES) -> None:
        self.path = path
        self._fd = _open_log(path, size)
        self.size = os.fstat(self._fd).st_size
        self._threads = threading.Lock()  # flock does not order the threads of one process
        self._nonce, self._seq, self._tail = 0, 0, 0
        with self.locked():
            pass

    def close(self) -> None:
        os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._catch_up()
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _header_at(self, offset: int) -> _Header | None:
        if offset + _HEADER > self.size:
            return None
        return _parse_header(os.pread(self._fd, _HEADER, offset))

    def _catch_up(self) -> None:
        """Read the log again where another process appended to it (a header of this round
        where it ended) or started it over (its first header changed)."""
        first = self._header_at(0)
        if self._tail == 0:
            moved = first is not None
        else:
            after = self._header_at(self._tail)
            moved = (
                first is None
                or first.nonce != self._nonce
                or (after is not None and after.nonce == self._nonce)
            )
        if moved or self._nonce == 0:
            self.entries()

    def entries(self) -> list[list[LoggedWrite]]:
        """The log's entries in order: from offset 0, while each is whole and follows the
        one before (its end is where the next append goes)."""
        found: list[list[LoggedWrite]] = []
        offset, nonce, seq = 0, None, 0
        while (header := self._header_at(offset)) is not None:
            if nonce is not None and (header.nonce != nonce or header.seq != seq + 1):
                break
            end = offset + _HEADER + header.length
            body = os.pread(self._fd, header.length, offset + _HEADER) if end <= self.size else b""
            if len(body) != header.length or zlib.crc32(body) != header.body_crc:
                break
            found.append(decode(body))
            offset, nonce, seq = end, header.nonce, header.seq
        self._tail, self._seq = offset, seq
        self._nonce = nonce if nonce is not None else secrets.randbits(64) | 1
        return found

    @property
    def empty(self) -> bool:
        return self._tail == 0

    def holds(self, body: bytes) -> bool:
        """Whether an entry of this body is logged at all (else its writes are made
        durable where they land)."""
        return _HEADER + len(body) <= self.size // 4

    def fits(self, body: bytes) -> bool:
        """Whether an entry of this body fits after the log's last one."""
        return self._tail + _HEADER + len(body) <= self.size

    def append(self, body: bytes) -> None:
        """Append an entry (`fits` first), durable on return."""
        _write_durably(self._fd, _header(self._nonce, self._seq + 1, body) + body, self._tail)
        self._tail += _HEADER + len(body)
        self._seq += 1

    def start_over(self) -> None:
        """Forget every entry (their files are synced): the first header zeroed, durably,
        and a new nonce for the next round."""
        _write_durably(self._fd, bytes(_HEADER), 0)
        self._tail, self._seq, self._nonce = 0, 0, secrets.randbits(64) | 1
