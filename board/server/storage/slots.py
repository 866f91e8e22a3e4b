"""A record kept in place: one file of two checksummed slots, the newer valid one current.

The local store rewrites a record (head.json, lease.json) by writing the slot that is not
current, instead of renaming a new file into place: the file keeps its name, size and
blocks. The write is made durable by the run's commit log (`commit_log`), or, for a group
too large for it, by `fdatasync`ing the file: a write inside a file's allocated blocks
changes no metadata the journal must commit, so it costs the disk one data write and a
cache flush, where a rename waits for a journal commit behind every other writer of the
filesystem. Power lost in the middle of a write leaves that slot torn, which its checksum
rejects: the other slot, the record as it was, stays current (and the log, where it holds
the write, sets it again). A slot is a whole number of pages, so writing one never
rewrites a byte of the other.

Slot layout: `deltaboard/slot/v1 <tag:020d> <length:010d> <crc32:08x>\\n`, the record's
bytes, zeros to the slot's end; the checksum covers the line up to itself and the bytes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

SLOT_MAGIC = b"deltaboard/slot/v1"
SLOT_PAGE = 4096  # a slot's size is a multiple of it
_HEADER = len(SLOT_MAGIC) + 1 + 20 + 1 + 10 + 1 + 8 + 1


@dataclass(frozen=True)
class Slotted:
    """A slotted file's current record: its bytes and tag, which slot holds it, and the
    size of each slot."""

    data: bytes
    tag: int
    slot: int
    slot_bytes: int

    def fits(self, data: bytes) -> bool:
        return _HEADER + len(data) <= self.slot_bytes

    def rewrite(self, tag: int, data: bytes) -> tuple[int, bytes]:
        """Where and what to write so that `data` under `tag` becomes current: the other
        slot's offset and its whole new contents."""
        return (1 - self.slot) * self.slot_bytes, slot(tag, data, self.slot_bytes)


def slot(tag: int, data: bytes, size: int) -> bytes:
    """One slot of `size` bytes holding `data` under `tag`."""
    line = b"%s %020d %010d " % (SLOT_MAGIC, tag, len(data))
    return (line + b"%08x\n" % zlib.crc32(data, zlib.crc32(line)) + data).ljust(size, b"\0")


def new_file(tag: int, data: bytes) -> bytes:
    """A slotted file whose first slot holds `data` under `tag`, the second one empty,
    both large enough for it."""
    size = -(-(_HEADER + len(data)) // SLOT_PAGE) * SLOT_PAGE
    return slot(tag, data, size) + bytes(size)


def _parse(raw: bytes) -> tuple[bytes, int] | None:
    """The slot's bytes and tag, None when it is empty, torn or damaged."""
    fields = raw[: _HEADER - 1].split(b" ")
    if len(fields) != 4 or fields[0] != SLOT_MAGIC or raw[_HEADER - 1 : _HEADER] != b"\n":
        return None
    tag, length, crc = fields[1], fields[2], fields[3]
    if not (tag.isdigit() and length.isdigit()) or _HEADER + int(length) > len(raw):
        return None
    data = raw[_HEADER : _HEADER + int(length)]
    line = raw[: _HEADER - 9]
    if b"%08x" % zlib.crc32(data, zlib.crc32(line)) != crc:
        return None
    return data, int(tag)


def read(raw: bytes) -> Slotted | None:
    """The current record of a slotted file's bytes; None for any other file (a record
    written whole, as a store before slots wrote every record)."""
    size = len(raw) // 2
    if size == 0 or size % SLOT_PAGE or len(raw) != 2 * size:
        return None
    current = None
    for index in (0, 1):
        found = _parse(raw[index * size : (index + 1) * size])
        if found is not None and (current is None or found[1] > current.tag):
            current = Slotted(data=found[0], tag=found[1], slot=index, slot_bytes=size)
    return current
