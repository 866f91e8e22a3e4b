"""The follower's journal: the durable state of each slot, replaced atomically.

A follower directory holds two slots (see `slots`). The journal records, per slot, whether
it is `empty`, `clean` at a version (with the digest of every tensor at that version), or
`dirty` (being written). Every mutation of a slot is bracketed by journal writes: mark it
`dirty`, write, verify, mark it `clean` at the new version. After a crash a `dirty` slot is
never trusted: it is rebuilt from the other slot (a local copy) or from scratch. That makes
applying idempotent without logging every changed byte: recovery restarts from the last
clean state, and the downloaded blobs are still in the local cache.

The file is written to a temporary name and renamed over the old one, so a kill at any
instant leaves either the old or the new journal, never a torn one. Power loss is a
different matter: only a `durable` journal fsyncs (together with the slots' data, see
`Follower(durable=...)`), since a journal that survives without its data would not help.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deltaboard.clients.follower.errors import DirectoryError

SlotName = Literal["A", "B"]


class SlotRecord(BaseModel):
    """One slot's state. `digests` (tensor name -> codec digest) is what lets the follower
    verify a new version in O(changed elements): the next patch's digest update starts
    from these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: Literal["empty", "dirty", "clean"] = "empty"
    version: int | None = None
    digests: dict[str, str] = Field(default_factory=dict)


EMPTY = SlotRecord()


class JournalState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["deltaboard/follower-journal/v1"] = "deltaboard/follower-journal/v1"
    run: str
    slots: dict[SlotName, SlotRecord] = Field(default_factory=dict)

    def slot(self, name: SlotName) -> SlotRecord:
        return self.slots.get(name, EMPTY)

    def with_slot(self, name: SlotName, record: SlotRecord) -> JournalState:
        return self.model_copy(update={"slots": {**self.slots, name: record}})


class Journal:
    """Reads and atomically replaces `path` (a JSON `JournalState`); `durable` also fsyncs."""

    def __init__(self, path: Path, *, durable: bool = False) -> None:
        self.path = path
        self.durable = durable

    def read(self) -> JournalState | None:
        """The saved state, None if there is none yet."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return JournalState.model_validate_json(raw)
        except ValidationError as exc:
            raise DirectoryError(f"unreadable follower journal {self.path}: {exc}") from exc

    def load(self, run: str) -> JournalState:
        """The saved state, or a fresh one for `run`; refuses a journal of another run."""
        state = self.read()
        if state is None:
            return JournalState(run=run)
        if state.run != run:
            raise DirectoryError(f"{self.path.parent.parent} follows run {state.run!r}, not {run!r}")
        return state

    def save(self, state: JournalState) -> None:
        atomic_write(self.path, state.model_dump_json().encode(), durable=self.durable)


def atomic_write(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write `data` to `path` so that a killed process leaves the old or the new content,
    never a mix (rename is atomic); `durable` also survives power loss (fsyncs)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (the rename itself is atomic without this)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
